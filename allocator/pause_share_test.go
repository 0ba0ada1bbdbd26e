// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/vmem"
)

// Pause by tag and CUDA IPC of expandable memory (pause.go, share.go), on
// two simulated processes: a tag's block exported in PyTorch's handle
// format keeps the tag from pausing until the block is freed; a paused
// tag's block cannot be exported; the pause's release closes the
// descriptors of the chunks it gives back, and resumed memory is
// shareable again. A tag's pools map pages whatever expandable_segments
// says, so both the default (expandable segments with stitching) and
// ordinary segments are tried.
func TestPauseRefusesSharedTaggedBlock(t *testing.T) {
	for _, conf := range []string{"", ordinary} {
		t.Run(conf, func(t *testing.T) {
			lockThread(t)
			exp := newProc(t, conf, cuda.ShareablePOSIXFD, 4*GiB)
			imp := newProc(t, "", cuda.ShareablePOSIXFD, 4*GiB)
			kv, err := exp.a.TagID("kv")
			require.NoError(t, err)
			mallocKV := func(size uint64) cuda.Ptr {
				p, err := exp.a.Malloc(&allocator.MallocRequest{Size: size, Tag: kv})
				require.NoError(t, err)
				return p
			}
			p := mallocKV(8 * MiB)
			q := mallocKV(8 * MiB) // not shared
			wantP := fill(t, exp.d, p, 8*MiB, 3)
			wantQ := fill(t, exp.d, q, 8*MiB, 5)

			raw, h, off := share(t, exp.a, p)
			require.Equal(t, byte(vmem.TypeExpandable), h.Type, "a tag's memory is virtual memory")
			base, err := imp.a.OpenIpcHandle(0, raw)
			require.NoError(t, err)
			require.Equal(t, wantP, read(t, imp.d, base+cuda.Ptr(off), 8*MiB))

			for _, tag := range []string{"kv", ""} { // the tag, and every tag
				err = exp.a.Pause(tag, true)
				require.ErrorIs(t, err, allocator.ErrInUse)
				require.ErrorContains(t, err, `tag "kv": the block at`)
				require.ErrorContains(t, err, "shared with another process")
			}
			require.Empty(t, exp.a.Paused(), "nothing paused")
			n, err := exp.a.PausedBytes(0)
			require.NoError(t, err)
			require.Zero(t, n)
			require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: mallocKV(MiB)}), "the tag stays usable")
			require.Equal(t, wantP, read(t, imp.d, base+cuda.Ptr(off), 8*MiB), "the importer's view is intact")

			// Closed by the importer, the block is still allocated: the
			// exporter cannot know, so the refusal stands until the free.
			require.NoError(t, imp.a.IpcClose(base))
			importsGone(t, imp)
			require.ErrorIs(t, exp.a.Pause("kv", true), allocator.ErrInUse)
			require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: p}))
			require.Len(t, exp.d.OpenFDs(), 1, "the freed block's chunk keeps its descriptor")

			require.NoError(t, exp.a.Pause("kv", true))
			require.Empty(t, exp.d.OpenFDs(), "the pause released the chunk and closed its descriptor")
			allocs, fds, err := exp.a.ExportStats(0)
			require.NoError(t, err)
			require.Zero(t, allocs+fds)
			require.Zero(t, exp.d.Used(0), "all of the tag's memory went back")
			_, _, _, err = exp.a.ShareIpcHandle(q)
			require.ErrorIs(t, err, allocator.ErrPaused, "a paused tag's block cannot be shared")
			require.ErrorContains(t, err, "resume it before sharing")
			_, _, _, err = exp.a.IpcHandle(q)
			require.ErrorIs(t, err, allocator.ErrPaused)

			// Resumed, q's memory is new, shareable as before.
			require.NoError(t, exp.a.Resume("kv"))
			require.Equal(t, wantQ, read(t, exp.d, q, 8*MiB))
			raw, _, off = share(t, exp.a, q)
			base, err = imp.a.OpenIpcHandle(0, raw)
			require.NoError(t, err)
			require.Equal(t, wantQ, read(t, imp.d, base+cuda.Ptr(off), 8*MiB), "the importer reads the resumed memory")
			require.NoError(t, imp.a.IpcClose(base))
			importsGone(t, imp)
			require.ErrorIs(t, exp.a.Pause("kv", false), allocator.ErrInUse)
			require.NoError(t, exp.a.Free(allocator.FreeRequest{Ptr: q}))
			require.NoError(t, exp.a.Pause("kv", false))
			require.NoError(t, exp.a.Resume("kv"))
			require.NoError(t, exp.a.EmptyCache(0))
			require.Empty(t, exp.d.OpenFDs())
			require.Zero(t, exp.d.Used(0))
			for _, x := range []proc{exp, imp} {
				require.NoError(t, x.a.CheckInvariants())
				require.Zero(t, x.d.Violations(), "%v", x.d.ViolationLog())
			}
		})
	}
}
