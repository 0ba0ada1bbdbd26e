// SPDX-License-Identifier: Apache-2.0

// Package vmem owns one device's CUDA virtual memory: the address ranges
// it reserves, the physical allocations mapped into them, and stitching's
// moves of physical pages between ranges. It is what expandable segments
// and stitching are made of, both on by default (expandable_segments:False
// turns both off, stitch:False stitching alone; where the driver has no
// virtual memory management API, growth falls back to ordinary segments,
// quietly unless the configuration named either key).
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
// per-page record of which allocation backs each page (pools.Segment.Page,
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
// memory and back, for pausing memory with its contents and resuming it);
// pause.go (giving a tag's physical memory back and mapping it again).
//
// # One page pool for both size classes
//
// The default pools have one reserved range per size class and stream: the
// small pool's (blocks up to 1 MiB, carved from 2 MiB pages) and the large
// pool's. PyTorch's expandable segments keep the two apart: a page mapped
// for small blocks serves small blocks until empty_cache, so a workload
// whose mix moves between small and large tensors strands memory in the
// class it left, and a stream's free pages serve no other stream. Here the
// default pools' free whole pages, both size classes and every stream, are
// one pool of physical pages per device, which any growth of the default
// pools takes from before creating memory (a private pool grows only while
// allocations are routed to it, which counts as a capture: nothing is
// stitched then):
//
//   - Every physical allocation of the default pools' ranges is one page:
//     the small pool maps page by page (its requests need less than one),
//     and the default large pool, which maps the 20 MiB unit per growth,
//     does so in page-sized chunks (chunkSize), so that any whole free
//     page can move alone.
//   - The pool is no separate free list. A free page stays mapped where it
//     was, so that a later request of its range and stream reuses it in
//     place (a cache hit: no driver call, no page move). Pages move only at
//     a miss that would raise reserved memory above its high-water mark
//     (stitch.go): the growth takes whole pages inside free blocks of
//     either class on any stream, smallest blocks first, and maps them
//     where it needs them; a page freed by the small pool feeds a large
//     block and the other way round. The holes of the request's own
//     range are left alone when that range holds plenty of free memory:
//     its miss comes from fragmentation, which a steady working set would
//     renew at every miss, and the range grows instead (stitch.go,
//     "Fragmented ranges").
//   - Whether a page may move is decided per block by its stream's
//     progress: idle pages are unmapped and mapped again, pages busy with
//     the requesting stream's own work are lent, other streams' busy pages
//     stay (stitch.go). A stream's progress is learned from marks recorded
//     at its own misses (the legacy default stream's at every miss): a
//     stream may be destroyed while memory allocated on it lives on, so
//     stitching names it to the driver only in a call that names it. A page
//     holding any live block, even one 512-byte small block, is not whole
//     and stays.
//   - Private pools (CUDA graphs, MemPools) are not part of it: their pages
//     stay theirs while their pool lives, since a graph's replays use
//     memory its pool counts as free; their large ranges map each growth
//     as one allocation of up to 128 MiB (page by page when the mapping
//     unit is one page: space.go, chunkSize).
//     Released, their memory goes back to the driver at the next
//     empty_cache.
//   - Nor are a tag's pools (pause.go), though a tag's small pool maps page
//     by page too: they are pools of their own, neither donors nor
//     receivers, so that a pause gives back the tag's pages and no other's.
//   - empty_cache and the OOM retry unmap the pool's idle pages and give
//     them back. The high-water mark is the reserved_bytes peak statistic
//     (reset_peak_memory_stats lowers it).
//   - With stitch_chunk_mb above one page the default large pool maps
//     allocations of that size, which move whole and only between ranges
//     of that size: the two size classes then keep their pages apart
//     (stitch.go, "Chunks").
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
// Two capabilities stand on this structure:
//
//   - Sharing physical allocations with other processes (CUDA IPC of
//     expandable and stitched memory, in PyTorch's handle format;
//     export.go has the design). Every physical allocation is created in
//     two places, growth (mapper.go, Map) and a resume (pause.go), both
//     shareable with the handle kind chosen at the first growth. A block's
//     export lists the allocations under it; each is exported once,
//     lazily, and its file descriptor stays with its handle until the
//     handle is released, whatever moves it (stitching maps the same
//     handle elsewhere); every release forgets the export (released). The
//     rule that makes exported pages safe needs no count of importers: the
//     memory under an allocated block is never moved or released here
//     (stitching and release take only whole pages of free blocks, and the
//     allocator refuses to pause a tag with a block shared: pools.Block's
//     Shared), and a shared block stays allocated until its importers are
//     done (the caller's protocol: PyTorch's reference-counter file); the
//     driver keeps the memory itself alive until every process has
//     unmapped it. The other side, importing what other processes shared,
//     is ImportCache (shareimport.go), with its own lock.
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
