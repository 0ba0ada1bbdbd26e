// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver

// The copy engine's calls: pinned host memory, copy streams and
// asynchronous copies between device and host, which pausing memory with
// its contents uses (vmem's Copier).
//
// Design: these entry points live in a table of their own (cpc_api), filled
// by resolveCopy at Open, so that the binding table of driver.go only gains
// one field. C functions of one file's preamble are invisible to another's,
// so this preamble has its own context push/pop (cpc_enter/cpc_leave, the
// same logic as cp_enter/cp_leave), using the context entry points copied
// from the main table. Every call is one cgo call with no Go allocation, and
// host addresses cross as integers, never as Go pointers.
//
// Pinned memory is allocated portable (CU_MEMHOSTALLOC_PORTABLE), so that
// one staging buffer serves the copies of every device whatever context
// allocated it; streams are non-blocking (CU_STREAM_NON_BLOCKING), so that
// copies never wait on, or hold up, work on the legacy stream.

/*
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

typedef struct {
	// Copied from driver.go's table (cp_api), for cpc_enter/cpc_leave.
	uintptr_t ctxGetCurrent, ctxPushCurrent, ctxPopCurrent;
	uintptr_t memHostAlloc;      // cuMemHostAlloc
	uintptr_t memFreeHost;       // cuMemFreeHost
	uintptr_t streamCreate;      // cuStreamCreate
	uintptr_t streamDestroy;     // cuStreamDestroy_v2
	uintptr_t memcpyDtoHAsync;   // cuMemcpyDtoHAsync_v2
	uintptr_t memcpyHtoDAsync;   // cuMemcpyHtoDAsync_v2
	uintptr_t streamSynchronize; // cuStreamSynchronize
} cpc_api;

typedef struct {
	CUresult r;
	unsigned long long a;
} cpc_ret;

static inline CUresult cpc_enter(const cpc_api *a, uintptr_t ctx, int *pushed) {
	CUcontext cur = NULL;
	*pushed = 0;
	if (((CUresult (*)(CUcontext *))a->ctxGetCurrent)(&cur) == 0 && cur == (CUcontext)ctx)
		return 0;
	CUresult r = ((CUresult (*)(CUcontext))a->ctxPushCurrent)((CUcontext)ctx);
	*pushed = r == 0;
	return r;
}

static inline CUresult cpc_leave(const cpc_api *a, int pushed, CUresult r) {
	if (pushed) {
		CUcontext popped;
		CUresult pr = ((CUresult (*)(CUcontext *))a->ctxPopCurrent)(&popped);
		if (r == 0)
			r = pr;
	}
	return r;
}

#define CPC_MEMHOSTALLOC_PORTABLE 0x01
#define CPC_STREAM_NON_BLOCKING 0x01

static cpc_ret cpc_host_alloc(const cpc_api *a, uintptr_t ctx, unsigned long long size) {
	void *p = NULL;
	int pushed;
	cpc_ret ret = {cpc_enter(a, ctx, &pushed), 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(void **, size_t, unsigned int))a->memHostAlloc)(&p, (size_t)size, CPC_MEMHOSTALLOC_PORTABLE);
	ret.r = cpc_leave(a, pushed, ret.r);
	ret.a = (uintptr_t)p;
	return ret;
}

static CUresult cpc_host_free(const cpc_api *a, uintptr_t ctx, uintptr_t p) {
	int pushed;
	CUresult r = cpc_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(void *))a->memFreeHost)((void *)p);
	return cpc_leave(a, pushed, r);
}

static cpc_ret cpc_stream_create(const cpc_api *a, uintptr_t ctx) {
	CUstream s = NULL;
	int pushed;
	cpc_ret ret = {cpc_enter(a, ctx, &pushed), 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(CUstream *, unsigned int))a->streamCreate)(&s, CPC_STREAM_NON_BLOCKING);
	ret.r = cpc_leave(a, pushed, ret.r);
	ret.a = (uintptr_t)s;
	return ret;
}

// streamDestroy and streamSynchronize share one signature.
static CUresult cpc_stream_op(const cpc_api *a, uintptr_t fn, uintptr_t ctx, uintptr_t s) {
	int pushed;
	CUresult r = cpc_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUstream))fn)((CUstream)s);
	return cpc_leave(a, pushed, r);
}

static CUresult cpc_dtoh(const cpc_api *a, uintptr_t ctx, uintptr_t dst, unsigned long long src,
			 unsigned long long n, uintptr_t s) {
	int pushed;
	CUresult r = cpc_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(void *, CUdeviceptr, size_t, CUstream))a->memcpyDtoHAsync)(
			(void *)dst, (CUdeviceptr)src, (size_t)n, (CUstream)s);
	return cpc_leave(a, pushed, r);
}

static CUresult cpc_htod(const cpc_api *a, uintptr_t ctx, unsigned long long dst, uintptr_t src,
			 unsigned long long n, uintptr_t s) {
	int pushed;
	CUresult r = cpc_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUdeviceptr, const void *, size_t, CUstream))a->memcpyHtoDAsync)(
			(CUdeviceptr)dst, (const void *)src, (size_t)n, (CUstream)s);
	return cpc_leave(a, pushed, r);
}

// Host-side access to pinned memory, for tests that check what a copy
// moved (a Go test file cannot use cgo).
static void cpc_host_read(void *dst, uintptr_t src, size_t n) { memcpy(dst, (const void *)src, n); }
static void cpc_host_write(uintptr_t dst, const void *src, size_t n) { memcpy((void *)dst, src, n); }
*/
import "C"

import (
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/cudapool/cudapool/cuda"
)

// copyAPI is the Driver's copy-engine table; api is nil when the driver
// lacks any of copySymbols.
type copyAPI struct {
	api *C.cpc_api // C memory, never freed, like Driver.api
}

// copySymbols are the copy engine's entry points. They are optional: without
// all of them the methods below return ErrNotSupported.
var copySymbols = []struct {
	name string
	slot func(*C.cpc_api) *C.uintptr_t
}{
	{"cuMemHostAlloc", func(a *C.cpc_api) *C.uintptr_t { return &a.memHostAlloc }},
	{"cuMemFreeHost", func(a *C.cpc_api) *C.uintptr_t { return &a.memFreeHost }},
	{"cuStreamCreate", func(a *C.cpc_api) *C.uintptr_t { return &a.streamCreate }},
	{"cuStreamDestroy_v2", func(a *C.cpc_api) *C.uintptr_t { return &a.streamDestroy }},
	{"cuMemcpyDtoHAsync_v2", func(a *C.cpc_api) *C.uintptr_t { return &a.memcpyDtoHAsync }},
	{"cuMemcpyHtoDAsync_v2", func(a *C.cpc_api) *C.uintptr_t { return &a.memcpyHtoDAsync }},
	{"cuStreamSynchronize", func(a *C.cpc_api) *C.uintptr_t { return &a.streamSynchronize }},
}

// resolveCopy fills d.copy, after the main table is resolved (it copies the
// context entry points from it).
func (d *Driver) resolveCopy() {
	api := (*C.cpc_api)(C.calloc(1, C.sizeof_cpc_api))
	for _, s := range copySymbols {
		p, err := purego.Dlsym(d.lib, s.name)
		if err != nil || p == 0 {
			C.free(unsafe.Pointer(api))
			return
		}
		*s.slot(api) = C.uintptr_t(p)
	}
	api.ctxGetCurrent = d.api.ctxGetCurrent
	api.ctxPushCurrent = d.api.ctxPushCurrent
	api.ctxPopCurrent = d.api.ctxPopCurrent
	d.copy.api = api
}

// copyCtx is ctx for the copy calls, which need their entry points.
func (d *Driver) copyCtx(dev int) (C.uintptr_t, error) {
	if d.copy.api == nil {
		return 0, cuda.ErrNotSupported
	}
	return d.ctx(dev)
}

// HostAlloc allocates size bytes of pinned host memory (cuMemHostAlloc,
// CU_MEMHOSTALLOC_PORTABLE) in dev's primary context; portable memory can
// be copied to and from every device. It obeys the thread's capture mode.
func (d *Driver) HostAlloc(dev int, size uint64) (cuda.HostPtr, error) {
	c, err := d.copyCtx(dev)
	if err != nil {
		return 0, err
	}
	ret := C.cpc_host_alloc(d.copy.api, c, C.ulonglong(size))
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.HostPtr(ret.a), nil
}

// HostFree frees pinned memory from HostAlloc (cuMemFreeHost), naming the
// device it was allocated on. The driver waits for the device's work first.
func (d *Driver) HostFree(dev int, p cuda.HostPtr) error {
	c, err := d.copyCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cpc_host_free(d.copy.api, c, C.uintptr_t(p)))
}

// StreamCreate creates a non-blocking stream on dev (cuStreamCreate with
// CU_STREAM_NON_BLOCKING).
func (d *Driver) StreamCreate(dev int) (cuda.Stream, error) {
	c, err := d.copyCtx(dev)
	if err != nil {
		return 0, err
	}
	ret := C.cpc_stream_create(d.copy.api, c)
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.Stream(ret.a), nil
}

// StreamDestroy destroys a stream StreamCreate made on dev
// (cuStreamDestroy_v2); work queued on it still completes.
func (d *Driver) StreamDestroy(dev int, s cuda.Stream) error {
	c, err := d.copyCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cpc_stream_op(d.copy.api, d.copy.api.streamDestroy, c, C.uintptr_t(s)))
}

// MemcpyDtoHAsync queues a copy of size bytes from dev's memory at src to
// pinned host memory at dst on stream s (cuMemcpyDtoHAsync_v2).
func (d *Driver) MemcpyDtoHAsync(dev int, dst cuda.HostPtr, src cuda.Ptr, size uint64, s cuda.Stream) error {
	c, err := d.copyCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cpc_dtoh(d.copy.api, c, C.uintptr_t(dst), C.ulonglong(src), C.ulonglong(size), C.uintptr_t(s)))
}

// MemcpyHtoDAsync queues a copy of size bytes from pinned host memory at src
// to dev's memory at dst on stream s (cuMemcpyHtoDAsync_v2).
func (d *Driver) MemcpyHtoDAsync(dev int, dst cuda.Ptr, src cuda.HostPtr, size uint64, s cuda.Stream) error {
	c, err := d.copyCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cpc_htod(d.copy.api, c, C.ulonglong(dst), C.uintptr_t(src), C.ulonglong(size), C.uintptr_t(s)))
}

// StreamSynchronize waits for the work queued on s (cuStreamSynchronize).
func (d *Driver) StreamSynchronize(dev int, s cuda.Stream) error {
	c, err := d.copyCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cpc_stream_op(d.copy.api, d.copy.api.streamSynchronize, c, C.uintptr_t(s)))
}

// hostRead copies len(dst) bytes of pinned memory at p into dst.
func hostRead(dst []byte, p cuda.HostPtr) {
	if len(dst) > 0 {
		C.cpc_host_read(unsafe.Pointer(&dst[0]), C.uintptr_t(p), C.size_t(len(dst)))
	}
}

// hostWrite copies src into pinned memory at p.
func hostWrite(p cuda.HostPtr, src []byte) {
	if len(src) > 0 {
		C.cpc_host_write(C.uintptr_t(p), unsafe.Pointer(&src[0]), C.size_t(len(src)))
	}
}
