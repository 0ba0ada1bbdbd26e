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
// share.go (PyTorch's shareable handle of a segment, for IPC export) and
// shareimport.go (ImportCache: mapping the segments other processes
// shared); copy.go (copies of device memory to pinned host memory and
// back, for pausing memory with its contents and resuming it); pause.go
// (giving a tag's physical memory back and mapping it again).
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
// Two capabilities belong here. Their parts that stand alone are written:
// PyTorch's handle codec (share.go), the import side (shareimport.go) and
// the copies a pause keeps contents with (copy.go). How they tie to a
// Space:
//
//   - Sharing physical allocations with other processes (CUDA IPC of
//     expandable and stitched memory, in PyTorch's handle format). Every
//     physical allocation is made in one place (mapper.go, Map's
//     MemCreate): a shareable one is to be created there with the requested
//     handle type. An export records the allocation in a table keyed by its
//     handle, with the count of importers. While that count is not zero the
//     allocation is pinned: stitching's donor verdict (Space.donorKind)
//     refuses a block holding a pinned page, and release (UnmapFree,
//     TrimUnused, unlending) skips it, so a page another process maps is
//     neither moved nor reused here until it closes; the driver keeps the
//     memory itself alive until every process has unmapped it.
//   - Pausing and resuming tagged memory (pause.go; the allocator's
//     pause.go has the policy and saves contents with copy.go's Copier). A
//     tag's ranges are its own (its pools are its own, and ranges are per
//     pool and stream), mapped here whatever expandable_segments says
//     (VMM), in large chunks, and never stitched: pausing one tag touches
//     no other's pages. Pause walks a segment's page record, unmaps and
//     releases each mapped chunk and records it paused
//     (pools.Segment.Paused: the reservation and the blocks stay as they
//     are, the reserved bytes drop); Resume creates and maps a chunk of the
//     same size at each paused offset, so addresses, and the CUDA graphs
//     that hold them, stay valid. The allocator allocates nothing from a
//     paused tag and releases nothing of it.
package vmem
