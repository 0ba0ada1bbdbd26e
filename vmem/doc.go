// Package vmem owns one device's CUDA virtual memory: the address ranges
// it reserves, the physical allocations mapped into them, and stitching's
// moves of physical pages between ranges. It is what expandable segments
// (expandable_segments:True) and stitching (stitch:True) are made of.
//
// # Design
//
// The block cache (pools) keeps the blocks of an expandable segment, which
// tile one reserved range, and decides which bytes must be mapped or may be
// unmapped; it reaches the driver only through the pools.Mapper a Space
// passes it. A Space does all the driver work and keeps all the physical
// state: the mapping unit and page size, the spare physical allocations (made
// or unmapped, not mapped), the orphans (dropped during a capture, released
// after it), the lent pages whose old mapping waits for its stream, and the
// per-page record of which allocation backs each page (pools.Segment.Pages,
// which this package fills and empties; pools only reads chunk boundaries
// from it). Its owner, the allocator's device, calls it under the device lock
// through one interface, and gives it what it cannot own itself (Deps): the
// stream progress of the device's events (events.Tracker, for stitching),
// the memory history's record of mappings, the device's capacity, and the
// construction of errors and warnings. A Space has no lock of its own.
//
// Files: space.go (configuration, growth, trimming and release), mapper.go
// (the pools.Mapper: creating, mapping, unmapping and releasing physical
// allocations; spares and orphans), stitch.go (stitching's policy);
// export.go (physical memory created shareable and exported to other
// processes), share.go (PyTorch's shareable handle of a segment: the
// format), shareimport.go (ImportCache: mapping the segments other
// processes shared); copy.go (copies of device memory to pinned host
// memory and back, for pausing memory with its contents and resuming it).
//
// # Capture rules
//
// Reserving, creating, mapping and setting access obey the calling thread's
// capture mode like cuMemAlloc: they run in relaxed mode
// (cuda.WithThreadRelaxed), so growth is legal during any capture, whose
// graph then owns the pages through its private pool. Unmapping, releasing
// and freeing ranges are never done while a capture may be under way: the
// owner says so (Grow's capturing), and what must be dropped meanwhile
// waits in the spares and orphans for the next Release.
//
// # Sharing and pausing
//
// Two capabilities belong here. Sharing stands on this structure as
// described below; for pausing, the copies that keep contents are written
// (copy.go), and what ties them to a Space is to be built as described.
//
//   - Sharing physical allocations with other processes (CUDA IPC of
//     expandable and stitched memory, in PyTorch's handle format;
//     export.go has the design). Every physical allocation is made in one
//     place (mapper.go, Map) and is created shareable there, with the
//     handle kind chosen at the first growth. A block's export lists the
//     allocations under it; each is exported once, lazily, and its file
//     descriptor stays with its handle until the handle is released,
//     whatever moves it (stitching maps the same handle elsewhere). The
//     rule that makes exported pages safe needs no count of importers: the
//     memory under an allocated block is never moved or released here
//     (stitching and release take only whole pages of free blocks), and a
//     shared block stays allocated until its importers are done (the
//     caller's protocol: PyTorch's reference-counter file); the driver
//     keeps the memory itself alive until every process has unmapped it.
//     The other side, importing what other processes shared, is
//     ImportCache (shareimport.go), with its own lock.
//   - Pausing and resuming tagged memory, contents kept by copy.go's
//     Copier. A tag's ranges are its own (the owner reserves per pool,
//     stream and tag), so pausing one tag touches no other's pages. Pause
//     walks the tag's ranges, records each mapped chunk's offset and size
//     from the page record, saves their contents, unmaps and releases them
//     (the reservations and the pools' blocks stay as they are, the
//     reserved bytes drop), and marks the ranges paused; Grow and stitching
//     skip paused ranges. Resume creates and maps the recorded chunks at the
//     same offsets and restores their contents, so addresses, and the CUDA
//     graphs that hold them, stay valid. Stitching never moves pages between
//     tags.
package vmem
