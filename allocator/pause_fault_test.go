// SPDX-License-Identifier: Apache-2.0

package allocator_test

import (
	"bytes"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/allocator"
	"github.com/cudapool/cudapool/cuda"
)

// Fault injection at the driver calls of pause and resume by tag
// (allocator/pause.go, vmem/pause.go) and of the copies that keep
// contents (vmem/copy.go): each failure gives a clear error, leaves the
// tag usable (a pause that released nothing) or paused (a pause that
// released part, a resume), loses and double-counts nothing, and the call
// made again succeeds. TestFaultCallSitesCovered requires one per site.

// mallocTag allocates size bytes under tag on device 0.
func (e *fenv) mallocTag(size uint64, tag uint32) cuda.Ptr {
	e.t.Helper()
	p, err := e.a.Malloc(&allocator.MallocRequest{Size: size, Stream: 1, Tag: tag})
	require.NoError(e.t, err)
	e.live[p] = size
	return p
}

// tagged makes tag "kv" with two 30 MiB blocks (two physical allocations)
// holding known bytes.
func tagged(t *testing.T, conf string) (*fenv, uint32, []cuda.Ptr, [][]byte) {
	return taggedKinds(t, conf, 0)
}

// taggedKinds is tagged with physical memory created shareable through
// kinds (0: not shareable).
func taggedKinds(t *testing.T, conf string, kinds cuda.ShareableKind) (*fenv, uint32, []cuda.Ptr, [][]byte) {
	e := shareFault(t, conf, kinds)
	id, err := e.a.TagID("kv")
	require.NoError(t, err)
	var ps []cuda.Ptr
	var data [][]byte
	for i := 0; i < 2; i++ {
		p := e.mallocTag(30*MiB, id)
		b := bytes.Repeat([]byte{byte(i + 1), 7, 9}, 10*MiB)
		require.NoError(t, e.sim().WriteDevice(0, p, b))
		ps, data = append(ps, p), append(data, b)
	}
	return e, id, ps, data
}

// usable requires that the tag allocates and holds its bytes.
func (e *fenv) usable(id uint32, ps []cuda.Ptr, data [][]byte) {
	e.t.Helper()
	paused, err := e.a.PausedBytes(0)
	require.NoError(e.t, err)
	require.Zero(e.t, paused)
	for i, p := range ps {
		b, err := e.sim().ReadDevice(0, p, uint64(len(data[i])))
		require.NoError(e.t, err)
		require.True(e.t, bytes.Equal(data[i], b), "contents of %#x", p)
	}
	e.free(e.mallocTag(4096, id))
}

// pausedKV requires that tag kv is paused with want bytes given back.
func (e *fenv) pausedKV(want uint64) {
	e.t.Helper()
	paused, err := e.a.PausedBytes(0)
	require.NoError(e.t, err)
	require.Equal(e.t, want, paused)
	require.Len(e.t, e.a.Paused(), 1)
	_, err = e.a.Malloc(&allocator.MallocRequest{Size: 4096, Tag: 1})
	require.ErrorIs(e.t, err, allocator.ErrPaused)
}

// failedPauseUsable: a pause that failed with op's driver error (what)
// before releasing anything left the tag usable, and the next one works.
func failedPauseUsable(t *testing.T, method, site, what string, keep bool, prepare func(*fenv)) {
	e, id, ps, data := tagged(t, confOrdinary)
	if prepare != nil {
		prepare(e)
	}
	r := e.fail(method, site, 0)
	err := e.a.Pause("kv", keep)
	e.fired(r)
	e.driverErr(err, "pause", what)
	e.consistent(0)
	e.usable(id, ps, data)
	held := e.sim().Used(0) // all of it the tag's
	require.NoError(t, e.a.Pause("kv", keep))
	e.pausedKV(held)
	require.NoError(t, e.a.Resume("kv"))
	if keep {
		e.usable(id, ps, data)
	}
	e.nothingLost()
}

func init() {
	for k, c := range map[string]faultCase{
		"pause.go:(*device).waitQueued.StreamSynchronize": {run: func(t *testing.T) {
			failedPauseUsable(t, "StreamSynchronize", "waitQueued", "synchronizing stream 0x1 of device 0 before pausing", false, nil)
		}},
		// A block another stream used: the device is synchronized.
		"pause.go:(*device).waitQueued.DeviceSynchronize": {run: func(t *testing.T) {
			failedPauseUsable(t, "DeviceSynchronize", "waitQueued", "synchronizing device 0 before pausing", true, func(e *fenv) {
				for p := range e.live {
					require.NoError(t, e.a.RecordStream(p, 2))
					break
				}
			})
		}},
		// A vmem.Copier fails while keeping contents: nothing is paused.
		"vmem/copy.go:(*Copier).ensureStreams.StreamCreate": {run: func(t *testing.T) {
			failedPauseUsable(t, "StreamCreate", "", "keeping the contents of tag \"kv\" on the host (nothing was paused)", true, nil)
		}},
		"vmem/copy.go:(*Copier).takeHost.HostAlloc": {run: func(t *testing.T) {
			failedPauseUsable(t, "HostAlloc", "", "keeping the contents of tag \"kv\" on the host", true, nil)
		}},
		"vmem/copy.go:(*Copier).run.MemcpyDtoHAsync": {run: func(t *testing.T) {
			failedPauseUsable(t, "MemcpyDtoHAsync", "", "keeping the contents of tag \"kv\" on the host", true, nil)
		}},
		// The copies could not be waited for: their pinned memory is
		// given up (Stranded), never reused.
		"vmem/copy.go:(*Copier).run.StreamSynchronize": {run: func(t *testing.T) {
			failedPauseUsable(t, "StreamSynchronize", "(*Copier).run", "keeping the contents of tag \"kv\" on the host", true, nil)
		}},
		// The restore fails: the memory is mapped again, the tag stays
		// paused with its contents on the host, and the next resume
		// restores them.
		"vmem/copy.go:(*Copier).run.MemcpyHtoDAsync": {run: func(t *testing.T) {
			e, id, ps, data := tagged(t, confOrdinary)
			require.NoError(t, e.a.Pause("kv", true))
			r := e.fail("MemcpyHtoDAsync", "", 0)
			err := e.a.Resume("kv")
			e.fired(r)
			e.driverErr(err, "resume", "restoring the contents of tag \"kv\"")
			e.pausedKV(0)
			e.consistent(0)
			require.Equal(t, uint64(60*MiB), e.a.HostMemoryStats().Held)
			require.NoError(t, e.a.Resume("kv"))
			e.usable(id, ps, data)
			e.nothingLost()
		}},
		"vmem/copy.go:(*Copier).releaseHost.HostFree": {run: func(t *testing.T) {
			e, _, _, _ := tagged(t, confOrdinary)
			require.NoError(t, e.a.Pause("kv", true))
			require.NoError(t, e.a.Resume("kv"))
			r := e.fail("HostFree", "", 0)
			_, err := e.a.ReleaseHostMemory()
			e.fired(r)
			e.driverErr(err, "release_host_memory", "freeing pinned host memory")
			require.Equal(t, uint64(60*MiB), e.a.HostMemoryStats().Pooled, "kept, to be freed later")
			freed, err := e.a.ReleaseHostMemory()
			require.NoError(t, err)
			require.Equal(t, uint64(60*MiB), freed)
			n, _ := e.sim().HostMemory()
			require.Zero(t, n)
			e.nothingLost()
		}},
		"vmem/copy.go:(*Copier).Close.StreamDestroy": {run: func(t *testing.T) {
			e, _, _, _ := tagged(t, confOrdinary)
			require.NoError(t, e.a.Pause("kv", true))
			require.NoError(t, e.a.Resume("kv"))
			r := e.fail("StreamDestroy", "", 0)
			_, err := e.a.ReleaseHostMemory()
			e.fired(r)
			e.driverErr(err, "release_host_memory", "copy streams")
			require.Equal(t, 1, e.a.HostMemoryStats().Streams)
			_, err = e.a.ReleaseHostMemory()
			require.NoError(t, err)
			require.Zero(t, e.sim().CopyStreams())
			e.nothingLost()
		}},
		// The first chunk cannot be unmapped: nothing was released, the
		// tag is usable. The second cannot: the tag is paused with the
		// first given back; pausing again gives back the rest, and the
		// resume restores every byte.
		"vmem/pause.go:(*Space).Pause.MemUnmap": {run: func(t *testing.T) {
			e, id, ps, data := tagged(t, confOrdinary)
			r := e.fail("MemUnmap", "(*Space).Pause", 0)
			err := e.a.Pause("kv", true)
			e.fired(r)
			e.driverErr(err, "pause", "unmapping")
			e.consistent(0)
			e.usable(id, ps, data)
			require.Zero(t, e.a.HostMemoryStats().Held, "the contents kept were let go")
			held := e.sim().Used(0) // all of it the tag's

			r = e.fail("MemUnmap", "(*Space).Pause", 1)
			err = e.a.Pause("kv", true)
			e.fired(r)
			e.driverErr(err, "pause", "pause again to release the rest")
			require.ErrorContains(t, err, `tag "kv" is paused`)
			e.pausedKV(30 * MiB)
			e.consistent(0)
			require.NoError(t, e.a.Pause("kv", false))
			e.pausedKV(held)
			e.consistent(0)
			require.NoError(t, e.a.Resume("kv"))
			e.usable(id, ps, data)
			e.nothingLost()
		}},
		// The release fails after the unmap: the pause stands (with a
		// warning), the memory waits in the spares for the next
		// empty_cache.
		"vmem/pause.go:(*Space).Pause.MemRelease": {run: func(t *testing.T) {
			e, id, ps, data := tagged(t, confOrdinary)
			r := e.fail("MemRelease", "(*Space).Pause", 0)
			require.NoError(t, e.a.Pause("kv", true))
			e.fired(r)
			require.Len(t, e.warnings, 1)
			require.Contains(t, e.warnings[0], "they go back at the next empty_cache")
			e.pausedKV(60 * MiB)
			e.consistent(30 * MiB)
			require.NoError(t, e.a.EmptyCache(0))
			e.consistent(0)
			require.NoError(t, e.a.Resume("kv"))
			e.usable(id, ps, data)
			e.nothingLost()
		}},
		// A resume that cannot create (TestFaultResumeCreate), map or set
		// access for a chunk leaves the tag paused with what it mapped;
		// the next resume maps the rest.
		"vmem/pause.go:(*Space).Resume.MemMap": {run: func(t *testing.T) {
			failedResume(t, 0, "MemMap", "mapping")
		}},
		"vmem/pause.go:(*Space).Resume.MemSetAccess": {run: func(t *testing.T) {
			failedResume(t, 0, "MemSetAccess", "setting access to")
		}},
		// The quiet probe fails: the tag's pools get ordinary segments,
		// which a pause refuses.
		"vmem/pause.go:(*Space).VMM.MemGranularity": {run: func(t *testing.T) {
			e := newFault(t, confOrdinary, false)
			id, err := e.a.TagID("kv")
			require.NoError(t, err)
			r := e.fail("MemGranularity", "(*Space).VMM", 0)
			e.mallocTag(4*MiB, id)
			e.fired(r)
			require.Empty(t, e.warnings)
			require.Equal(t, 1, e.sim().Live(0), "an ordinary segment")
			err = e.a.Pause("kv", false)
			require.ErrorIs(t, err, allocator.ErrNotSupported)
			e.consistent(0)
			e.nothingLost()
		}},
	} {
		faultCases[k] = c
	}
}

// A resume creates its chunks where growth does ((*Space).create, whose
// fault cases are growth's): one that cannot be created, plain or
// shareable, leaves the tag paused with what was mapped.
func TestFaultResumeCreate(t *testing.T) {
	t.Run("plain", func(t *testing.T) { failedResume(t, 0, "MemCreate", "creating physical memory") })
	t.Run("shareable", func(t *testing.T) {
		failedResume(t, cuda.ShareablePOSIXFD, "MemCreateShareable", "creating physical memory")
	})
}

// failedResume: the second chunk's method fails at resume (the first
// mapped is the last, 30 MiB).
func failedResume(t *testing.T, kinds cuda.ShareableKind, method, what string) {
	e, id, ps, data := taggedKinds(t, confOrdinary, kinds)
	require.NoError(t, e.a.Pause("kv", true))
	r := e.fail(method, "(*Space).Resume", 1)
	err := e.a.Resume("kv")
	e.fired(r)
	e.driverErr(err, "resume", what)
	e.pausedKV(30 * MiB)
	e.consistent(0)
	require.NoError(t, e.a.Resume("kv"))
	e.usable(id, ps, data)
	if kinds != 0 {
		require.Zero(t, e.f.Calls("MemCreate"), "resumed memory is shareable as grown memory is")
	}
	e.nothingLost()
}

// A capture announced while a pause copies (outside any device lock)
// begins only once the pause is done: its begin waits for the pause, so
// no copy or synchronization runs during it, and the pause, which then
// sees the capture counted, gives up before unmapping anything (the tag
// stays usable). Likewise for a resume's restore.
func TestPauseHoldsCapturesBack(t *testing.T) {
	e, id, ps, data := tagged(t, confOrdinary)
	const cs = cuda.Stream(7)
	g := allocator.PoolID{A: 1}
	began, end, ended := make(chan error, 1), make(chan struct{}), make(chan error, 1)
	capture := func() {
		go func() { // a capture on a thread of its own, begun, then ended when told
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			err := e.a.BeginAllocateToPool(1, g, func(s cuda.Stream) bool { return s == cs })
			if err == nil {
				err = e.sim().BeginCapture(cs, cuda.CaptureModeGlobal)
			}
			began <- err
			<-end
			if err == nil {
				err = e.sim().EndCapture(cs)
			}
			if err == nil {
				err = e.a.EndAllocateToPool(1, g)
			}
			ended <- err
		}()
		select {
		case err := <-began:
			t.Error("a capture began while the pause (or resume) copied")
			began <- err
		case <-time.After(50 * time.Millisecond):
		}
	}
	endCapture := func() {
		require.NoError(t, <-began, "it began once the pause was done")
		end <- struct{}{}
		require.NoError(t, <-ended)
	}
	r := e.f.Before("MemcpyDtoHAsync", "", capture)
	err := e.a.Pause("kv", true)
	e.fired(r)
	require.ErrorIs(t, err, allocator.ErrCaptureUnderway)
	require.ErrorContains(t, err, "began while the memory was being paused")
	endCapture()
	e.usable(id, ps, data)

	require.NoError(t, e.a.Pause("kv", true))
	r = e.f.Before("MemcpyHtoDAsync", "", capture)
	require.NoError(t, e.a.Resume("kv"))
	e.fired(r)
	endCapture()
	e.usable(id, ps, data)
	require.NoError(t, e.a.ReleasePool(1, g))
	e.consistent(0)
	e.nothingLost()
}
