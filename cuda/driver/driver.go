// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

// Package driver is cudapool's real CUDA backend: it implements
// allocator.Driver (and events.Driver) over the CUDA driver API, with the
// allocator's optional virtual memory management and CUDA IPC calls where
// the driver has them, plus DeviceProcesses through NVML for out-of-memory
// reports.
//
// Design:
//
//   - Nothing from the CUDA toolkit is needed to build. libcuda.so.1 is
//     loaded at run time (purego.Dlopen/Dlsym) and the few C types used are
//     declared below. Versioned symbols are looked up by their exported names
//     (cuMemAlloc_v2, cuCtxPushCurrent_v2, ...); cuStreamGetCaptureInfo, whose
//     ABI changed across releases, is fetched with cuGetProcAddress_v2 at an
//     explicit API version (see resolveCaptureInfo).
//
//   - Every driver call goes through a static C function in the preamble
//     that receives the function pointers and the arguments and makes the
//     call: one cgo call (~45 ns), no Go allocation. purego's reflective
//     calls allocate and cost 0.5-0.9 us, so purego is used only for
//     Dlopen/Dlsym. Results come back as small structs by value, because a
//     pointer to a Go variable passed to C escapes to the heap.
//
//   - Context handling: CUDA's current context is per OS thread and belongs
//     to the caller (PyTorch sets it). A method that names a device makes
//     that device's primary context current, calls, and restores what it
//     found, entirely inside one C function, so no goroutine can move to
//     another thread in between. When the device's primary context is
//     already current (the usual case under PyTorch) it skips the push/pop.
//     Primary contexts are retained lazily, once per device, on first use.
//
//   - NVML (DeviceProcesses) lives in nvml.go; see the comment there for
//     how go-nvml is linked without leaving undefined nvml* symbols.
package driver

/*
#include <stdint.h>
#include <stdlib.h>

// The CUDA driver API types used here (values and layouts from cuda.h).
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr; // CUdeviceptr_v2
typedef unsigned long long cuuint64_t;

// Function pointers resolved from libcuda.so.1. Stored as integers so that
// Go can fill them without unsafe.Pointer conversions; cast at each call.
typedef struct {
	uintptr_t getProcAddress; // cuGetProcAddress_v2; 0 on pre-12.0 drivers
	uintptr_t init;           // cuInit
	uintptr_t driverGetVersion;
	uintptr_t deviceGetCount;
	uintptr_t deviceGet;
	uintptr_t deviceGetPCIBusId;
	uintptr_t primaryCtxRetain;  // cuDevicePrimaryCtxRetain
	uintptr_t primaryCtxRelease; // cuDevicePrimaryCtxRelease_v2
	uintptr_t ctxGetCurrent;
	uintptr_t ctxPushCurrent; // cuCtxPushCurrent_v2
	uintptr_t ctxPopCurrent;  // cuCtxPopCurrent_v2
	uintptr_t ctxSynchronize;
	uintptr_t memGetInfo; // cuMemGetInfo_v2
	uintptr_t memAlloc;   // cuMemAlloc_v2
	uintptr_t memFree;    // cuMemFree_v2
	uintptr_t eventCreate;
	uintptr_t eventRecord;
	uintptr_t eventQuery;
	uintptr_t eventSynchronize;
	uintptr_t eventDestroy; // cuEventDestroy_v2
	uintptr_t streamGetCaptureInfo;
	uintptr_t threadExchangeStreamCaptureMode;
	// Virtual memory management (expandable segments); all 0 when the
	// driver lacks any of them.
	uintptr_t deviceGetAttribute;
	uintptr_t memGetAllocationGranularity;
	uintptr_t memAddressReserve;
	uintptr_t memAddressFree;
	uintptr_t memCreate;
	uintptr_t memRelease;
	uintptr_t memMap;
	uintptr_t memUnmap;
	uintptr_t memSetAccess;
	uintptr_t deviceCanAccessPeer; // optional
	// Sharing physical allocations with other processes; both 0 when the
	// driver lacks either.
	uintptr_t memExportToShareableHandle;
	uintptr_t memImportFromShareableHandle;
	// CUDA IPC of memory; all 0 when the driver lacks any of them.
	uintptr_t ipcGetMemHandle;
	uintptr_t ipcOpenMemHandle; // cuIpcOpenMemHandle_v2, else cuIpcOpenMemHandle
	uintptr_t ipcCloseMemHandle;
	// Capture graph topology (graph_capture_record_stream_reuse); 0 when
	// the driver lacks it.
	uintptr_t graphNodeGetDependencies; // the v1 ABI
} cp_api;

// A result and up to two values, returned by value (no Go allocation).
typedef struct {
	CUresult r;
	unsigned long long a, b;
} cp_ret;

typedef CUresult (*cp_fn_void)(void);
typedef CUresult (*cp_fn_u)(unsigned int);
typedef CUresult (*cp_fn_pi)(int *);
typedef CUresult (*cp_fn_ctx)(CUcontext);
typedef CUresult (*cp_fn_pctx)(CUcontext *);

// Push ctx unless it is already current. *pushed tells cp_leave whether
// there is something to pop.
static inline CUresult cp_enter(const cp_api *a, uintptr_t ctx, int *pushed) {
	CUcontext cur = NULL;
	*pushed = 0;
	if (((cp_fn_pctx)a->ctxGetCurrent)(&cur) == 0 && cur == (CUcontext)ctx)
		return 0;
	CUresult r = ((cp_fn_ctx)a->ctxPushCurrent)((CUcontext)ctx);
	*pushed = r == 0;
	return r;
}

// Pop what cp_enter pushed. The operation's own error wins over a pop error.
static inline CUresult cp_leave(const cp_api *a, int pushed, CUresult r) {
	if (pushed) {
		CUcontext popped;
		CUresult pr = ((cp_fn_pctx)a->ctxPopCurrent)(&popped);
		if (r == 0)
			r = pr;
	}
	return r;
}

// ---- cold calls (Open, first use of a device, DeviceProcesses) ----

static CUresult cp_init(const cp_api *a) { return ((cp_fn_u)a->init)(0); }

static cp_ret cp_driver_version(const cp_api *a) {
	int v = 0;
	cp_ret ret = {((cp_fn_pi)a->driverGetVersion)(&v), 0, 0};
	ret.a = (unsigned long long)v;
	return ret;
}

static cp_ret cp_device_count(const cp_api *a) {
	int n = 0;
	cp_ret ret = {((cp_fn_pi)a->deviceGetCount)(&n), 0, 0};
	ret.a = (unsigned long long)n;
	return ret;
}

static cp_ret cp_device_get(const cp_api *a, int ordinal) {
	CUdevice d = 0;
	cp_ret ret = {((CUresult (*)(CUdevice *, int))a->deviceGet)(&d, ordinal), 0, 0};
	ret.a = (unsigned long long)d;
	return ret;
}

static CUresult cp_device_pci_bus_id(const cp_api *a, CUdevice d, char *buf, int len) {
	return ((CUresult (*)(char *, int, CUdevice))a->deviceGetPCIBusId)(buf, len, d);
}

static cp_ret cp_primary_retain(const cp_api *a, CUdevice d) {
	CUcontext c = NULL;
	cp_ret ret = {((CUresult (*)(CUcontext *, CUdevice))a->primaryCtxRetain)(&c, d), 0, 0};
	ret.a = (uintptr_t)c;
	return ret;
}

static CUresult cp_primary_release(const cp_api *a, CUdevice d) {
	return ((CUresult (*)(CUdevice))a->primaryCtxRelease)(d);
}

// cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
//                     cuuint64_t flags, CUdriverProcAddressQueryResult *status)
static cp_ret cp_get_proc_address(const cp_api *a, const char *sym, int version, cuuint64_t flags) {
	void *pfn = NULL;
	int status = 0;
	cp_ret ret = {((CUresult (*)(const char *, void **, int, cuuint64_t, int *))a->getProcAddress)(sym, &pfn, version, flags, &status), 0, 0};
	ret.a = (uintptr_t)pfn;
	ret.b = (unsigned long long)status;
	return ret;
}

// ---- calls on the malloc/free path ----

static cp_ret cp_mem_get_info(const cp_api *a, uintptr_t ctx) {
	size_t free_ = 0, total = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(size_t *, size_t *))a->memGetInfo)(&free_, &total);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = free_;
	ret.b = total;
	return ret;
}

static cp_ret cp_mem_alloc(const cp_api *a, uintptr_t ctx, unsigned long long size) {
	CUdeviceptr p = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(CUdeviceptr *, size_t))a->memAlloc)(&p, (size_t)size);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = p;
	return ret;
}

// cuMemAlloc_v2 in relaxed capture mode: exchange, allocate, exchange back,
// all on this thread in one call. Allocating in the thread's own (global or
// thread-local) mode while a capture is under way would invalidate it.
static cp_ret cp_mem_alloc_relaxed(const cp_api *a, uintptr_t ctx, unsigned long long size) {
	int mode = 2; // CU_STREAM_CAPTURE_MODE_RELAXED
	cp_ret ret = {((cp_fn_pi)a->threadExchangeStreamCaptureMode)(&mode), 0, 0};
	if (ret.r != 0)
		return ret;
	ret = cp_mem_alloc(a, ctx, size);
	CUresult r = ((cp_fn_pi)a->threadExchangeStreamCaptureMode)(&mode);
	if (ret.r == 0 && r != 0) {
		// Cannot restore the caller's mode: report that, but do not leak.
		int pushed;
		if (cp_enter(a, ctx, &pushed) == 0) {
			((CUresult (*)(CUdeviceptr))a->memFree)((CUdeviceptr)ret.a);
			cp_leave(a, pushed, 0);
		}
		ret.r = r;
		ret.a = 0;
	}
	return ret;
}

static CUresult cp_mem_free(const cp_api *a, uintptr_t ctx, unsigned long long p) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUdeviceptr))a->memFree)((CUdeviceptr)p);
	return cp_leave(a, pushed, r);
}

static CUresult cp_ctx_synchronize(const cp_api *a, uintptr_t ctx) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((cp_fn_void)a->ctxSynchronize)();
	return cp_leave(a, pushed, r);
}

static cp_ret cp_event_create(const cp_api *a, uintptr_t ctx, unsigned int flags) {
	CUevent e = NULL;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(CUevent *, unsigned int))a->eventCreate)(&e, flags);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = (uintptr_t)e;
	return ret;
}

static CUresult cp_event_record(const cp_api *a, uintptr_t ctx, uintptr_t e, uintptr_t s) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUevent, CUstream))a->eventRecord)((CUevent)e, (CUstream)s);
	return cp_leave(a, pushed, r);
}

// eventQuery, eventSynchronize and eventDestroy share one signature.
static CUresult cp_event_op(const cp_api *a, uintptr_t fn, uintptr_t ctx, uintptr_t e) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUevent))fn)((CUevent)e);
	return cp_leave(a, pushed, r);
}

// Every cuStreamGetCaptureInfo variant starts (stream, status*, id*):
//   v1 (10.1): 3 parameters
//   v2 (11.3): + graph_out, dependencies_out, numDependencies_out
//   v3 (12.3): + graph_out, dependencies_out, edgeData_out, numDependencies_out
// The call always passes seven arguments, the optional ones NULL. In the
// SysV x86-64 and AAPCS64 ABIs extra arguments are harmless (the caller owns
// its registers and stack), so whichever variant was resolved, it reads
// valid values: never a missing 7th argument from stale stack. NULL
// dependencies_out also keeps v2 from failing with CUDA_ERROR_LOSSY_QUERY.
static cp_ret cp_stream_capture_info(const cp_api *a, uintptr_t ctx, uintptr_t s) {
	int status = 0; // CUstreamCaptureStatus
	cuuint64_t id = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(CUstream, int *, cuuint64_t *, void *, void *, void *, void *))a->streamGetCaptureInfo)(
			(CUstream)s, &status, &id, NULL, NULL, NULL, NULL);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = (unsigned long long)status;
	ret.b = status != 0 ? id : 0; // id_out is only meaningful while capturing
	return ret;
}

// The capture's terminal nodes of s, through cuStreamGetCaptureInfo's v2 ABI
// (stream, status*, id*, graph*, dependencies**, numDependencies*); only
// called when that ABI was resolved. out[0] receives the capture id and
// out[1..cap] the first cap terminals; ret.a is the status, ret.b the number
// of terminals (more than cap: call again with more room). The driver's
// array is only valid until the next call on s, hence the copy.
static cp_ret cp_stream_capture_graph(const cp_api *a, uintptr_t ctx, uintptr_t s, uintptr_t *out, size_t cap) {
	int status = 0;
	cuuint64_t id = 0;
	void *graph = NULL;
	const uintptr_t *deps = NULL;
	size_t n = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(CUstream, int *, cuuint64_t *, void **, const uintptr_t **, size_t *, void *))a->streamGetCaptureInfo)(
			(CUstream)s, &status, &id, &graph, &deps, &n, NULL);
	ret.r = cp_leave(a, pushed, ret.r);
	if (ret.r != 0 || status == 0) {
		n = 0;
		id = 0;
	}
	out[0] = (uintptr_t)id;
	for (size_t i = 0; i < n && i < cap; i++)
		out[1 + i] = deps[i];
	ret.a = (unsigned long long)status;
	ret.b = n;
	return ret;
}

// A graph node's dependencies (cuGraphNodeGetDependencies, v1 ABI: node,
// dependencies*, numDependencies*): the count first, then up to cap of them
// into out; ret.a is the count (more than cap: call again with more room).
static cp_ret cp_graph_node_deps(const cp_api *a, uintptr_t ctx, uintptr_t node, uintptr_t *out, size_t cap) {
	typedef CUresult (*fn_t)(uintptr_t, uintptr_t *, size_t *);
	size_t n = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((fn_t)a->graphNodeGetDependencies)(node, NULL, &n);
	if (ret.r == 0 && n > 0 && n <= cap)
		ret.r = ((fn_t)a->graphNodeGetDependencies)(node, out, &n);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = n;
	return ret;
}

// ---- virtual memory management (expandable segments) ----
//
// The structs below are cuda.h's, written out because no CUDA header is
// used. Enums are 4-byte ints in the x86-64 and AArch64 ABIs.
//
// CUmemLocation: { CUmemLocationType type; int id; }, 8 bytes.
typedef struct {
	int type; // CU_MEM_LOCATION_TYPE_DEVICE = 1
	int id;   // the device ordinal
} cp_mem_location;

// CUmemAllocationProp, 32 bytes, unchanged from CUDA 10.2 to 13:
//   offset  0  CUmemAllocationType type                  (PINNED = 1)
//   offset  4  CUmemAllocationHandleType requestedHandleTypes (NONE = 0)
//   offset  8  CUmemLocation location
//   offset 16  void *win32HandleMetaData                 (NULL)
//   offset 24  struct allocFlags { unsigned char compressionType;
//              unsigned char gpuDirectRDMACapable; unsigned short usage;
//              unsigned char reserved[4]; }              (all 0)
typedef struct {
	int type;
	int requestedHandleTypes;
	cp_mem_location location;
	void *win32HandleMetaData;
	unsigned char compressionType;
	unsigned char gpuDirectRDMACapable;
	unsigned short usage;
	unsigned char reserved[4];
} cp_mem_alloc_prop;
_Static_assert(sizeof(cp_mem_alloc_prop) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(__builtin_offsetof(cp_mem_alloc_prop, location) == 8, "location at 8");
_Static_assert(__builtin_offsetof(cp_mem_alloc_prop, win32HandleMetaData) == 16, "win32HandleMetaData at 16");
_Static_assert(__builtin_offsetof(cp_mem_alloc_prop, compressionType) == 24, "allocFlags at 24");

// CUmemAccessDesc: { CUmemLocation location; CUmemAccess_flags flags; },
// 12 bytes.
typedef struct {
	cp_mem_location location;
	int flags; // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
} cp_mem_access_desc;
_Static_assert(sizeof(cp_mem_access_desc) == 12, "CUmemAccessDesc is 12 bytes");

// Pinned device memory on device ordinal dev, no shareable handle.
static cp_mem_alloc_prop cp_device_prop(int dev) {
	cp_mem_alloc_prop p = {0};
	p.type = 1;          // CU_MEM_ALLOCATION_TYPE_PINNED
	p.location.type = 1; // CU_MEM_LOCATION_TYPE_DEVICE
	p.location.id = dev;
	return p;
}

// The granularity of dev's physical allocations, 0 if the device does not
// support virtual memory management
// (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102).
static cp_ret cp_mem_granularity(const cp_api *a, uintptr_t ctx, CUdevice d, int ordinal) {
	int supported = 0;
	size_t g = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(int *, int, CUdevice))a->deviceGetAttribute)(&supported, 102, d);
	if (ret.r == 0 && supported) {
		cp_mem_alloc_prop p = cp_device_prop(ordinal);
		ret.r = ((CUresult (*)(size_t *, const cp_mem_alloc_prop *, int))a->memGetAllocationGranularity)(
			&g, &p, 1); // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
	}
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = g;
	return ret;
}

static cp_ret cp_mem_address_reserve(const cp_api *a, uintptr_t ctx, unsigned long long size) {
	CUdeviceptr p = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	// Alignment 0: the granularity. No fixed address, no flags.
	if (ret.r == 0)
		ret.r = ((CUresult (*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))a->memAddressReserve)(
			&p, (size_t)size, 0, 0, 0);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = p;
	return ret;
}

static CUresult cp_mem_address_free(const cp_api *a, uintptr_t ctx, unsigned long long p, unsigned long long size) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUdeviceptr, size_t))a->memAddressFree)((CUdeviceptr)p, (size_t)size);
	return cp_leave(a, pushed, r);
}

// kinds is CUmemAllocationProp.requestedHandleTypes: the
// CUmemAllocationHandleType bits through which the allocation may be
// exported (0: none).
static cp_ret cp_mem_create(const cp_api *a, uintptr_t ctx, int ordinal, unsigned long long size, int kinds) {
	unsigned long long h = 0; // CUmemGenericAllocationHandle
	cp_mem_alloc_prop p = cp_device_prop(ordinal);
	p.requestedHandleTypes = kinds;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(unsigned long long *, size_t, const cp_mem_alloc_prop *, unsigned long long))a->memCreate)(
			&h, (size_t)size, &p, 0);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = h;
	return ret;
}

static CUresult cp_mem_release(const cp_api *a, uintptr_t ctx, unsigned long long h) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(unsigned long long))a->memRelease)(h);
	return cp_leave(a, pushed, r);
}

// Maps all of h (offset 0) at p.
static CUresult cp_mem_map(const cp_api *a, uintptr_t ctx, unsigned long long p, unsigned long long size, unsigned long long h) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUdeviceptr, size_t, size_t, unsigned long long, unsigned long long))a->memMap)(
			(CUdeviceptr)p, (size_t)size, 0, h, 0);
	return cp_leave(a, pushed, r);
}

static CUresult cp_mem_unmap(const cp_api *a, uintptr_t ctx, unsigned long long p, unsigned long long size) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUdeviceptr, size_t))a->memUnmap)((CUdeviceptr)p, (size_t)size);
	return cp_leave(a, pushed, r);
}

// Read and write access for device ordinal dev and for the ordinals in the
// bit mask peers (ordinals below 64).
static CUresult cp_mem_set_access(const cp_api *a, uintptr_t ctx, int ordinal, unsigned long long peers,
				  unsigned long long p, unsigned long long size) {
	// Location: CU_MEM_LOCATION_TYPE_DEVICE (1), the ordinal; flags:
	// CU_MEM_ACCESS_FLAGS_PROT_READWRITE (3).
	cp_mem_access_desc desc[65];
	size_t n = 0;
	desc[n++] = (cp_mem_access_desc){{1, ordinal}, 3};
	for (int i = 0; i < 64; i++)
		if (i != ordinal && (peers >> i & 1))
			desc[n++] = (cp_mem_access_desc){{1, i}, 3};
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUdeviceptr, size_t, const cp_mem_access_desc *, size_t))a->memSetAccess)(
			(CUdeviceptr)p, (size_t)size, desc, n);
	return cp_leave(a, pushed, r);
}

// Whether device d can access peer's memory (cuDeviceCanAccessPeer); 0 when
// the driver lacks the call.
static cp_ret cp_can_access_peer(const cp_api *a, CUdevice d, CUdevice peer) {
	int can = 0;
	cp_ret ret = {0, 0, 0};
	if (a->deviceCanAccessPeer)
		ret.r = ((CUresult (*)(int *, CUdevice, CUdevice))a->deviceCanAccessPeer)(&can, d, peer);
	ret.a = (unsigned long long)can;
	return ret;
}

// ---- sharing physical allocations (cuMemExportToShareableHandle) ----
//
// CUmemFabricHandle is { unsigned char data[64]; }. An export writes an int
// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1) or a CUmemFabricHandle
// (CU_MEM_HANDLE_TYPE_FABRIC = 8) through its first argument; an import
// takes the descriptor itself cast to a pointer, or a pointer to the fabric
// handle. Both come back by value, so no Go memory is handed to C.
typedef struct {
	unsigned char data[64];
} cp_fabric_handle;
_Static_assert(sizeof(cp_fabric_handle) == 64, "CUmemFabricHandle is 64 bytes");

typedef struct {
	CUresult r;
	int fd;
	cp_fabric_handle fabric;
} cp_export_ret;

static cp_export_ret cp_mem_export(const cp_api *a, uintptr_t ctx, unsigned long long h, int kind) {
	cp_export_ret ret = {0};
	ret.fd = -1;
	int pushed;
	ret.r = cp_enter(a, ctx, &pushed);
	if (ret.r == 0) {
		void *out = kind == 8 ? (void *)&ret.fabric : (void *)&ret.fd;
		ret.r = ((CUresult (*)(void *, unsigned long long, int, unsigned long long))a->memExportToShareableHandle)(
			out, h, kind, 0);
	}
	ret.r = cp_leave(a, pushed, ret.r);
	return ret;
}

static cp_ret cp_mem_import_fd(const cp_api *a, uintptr_t ctx, int fd) {
	unsigned long long h = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(unsigned long long *, void *, int))a->memImportFromShareableHandle)(
			&h, (void *)(intptr_t)fd, 1);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = h;
	return ret;
}

static cp_ret cp_mem_import_fabric(const cp_api *a, uintptr_t ctx, cp_fabric_handle f) {
	unsigned long long h = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(unsigned long long *, void *, int))a->memImportFromShareableHandle)(&h, &f, 8);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = h;
	return ret;
}

// An integer attribute of device d (cuDeviceGetAttribute needs no context).
static cp_ret cp_device_attribute(const cp_api *a, CUdevice d, int attr) {
	int v = 0;
	cp_ret ret = {((CUresult (*)(int *, int, CUdevice))a->deviceGetAttribute)(&v, attr, d), 0, 0};
	ret.a = (unsigned long long)(unsigned int)v;
	return ret;
}

// ---- CUDA IPC of memory ----
//
// CUipcMemHandle is { char reserved[64]; } (CU_IPC_HANDLE_SIZE), returned
// through a pointer by cuIpcGetMemHandle and passed by value to
// cuIpcOpenMemHandle (on the stack in the x86-64 and AArch64 ABIs; declaring
// the struct lets the compiler get that right). It crosses the cgo boundary
// by value too, so no Go memory is handed to C.
typedef struct {
	unsigned char reserved[64];
} cp_ipc_handle;
_Static_assert(sizeof(cp_ipc_handle) == 64, "CUipcMemHandle is 64 bytes");

typedef struct {
	CUresult r;
	cp_ipc_handle h;
} cp_ipc_ret;

static cp_ipc_ret cp_ipc_get_mem_handle(const cp_api *a, uintptr_t ctx, unsigned long long p) {
	cp_ipc_ret ret = {0};
	int pushed;
	ret.r = cp_enter(a, ctx, &pushed);
	if (ret.r == 0)
		ret.r = ((CUresult (*)(cp_ipc_handle *, CUdeviceptr))a->ipcGetMemHandle)(&ret.h, (CUdeviceptr)p);
	ret.r = cp_leave(a, pushed, ret.r);
	return ret;
}

// Opens h in the current (primary) context with
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS (1), the only flag, which
// cuIpcOpenMemHandle_v2 requires (0 is CUDA_ERROR_INVALID_VALUE).
static cp_ret cp_ipc_open_mem_handle(const cp_api *a, uintptr_t ctx, cp_ipc_handle h) {
	CUdeviceptr p = 0;
	int pushed;
	cp_ret ret = {cp_enter(a, ctx, &pushed), 0, 0};
	if (ret.r == 0)
		ret.r = ((CUresult (*)(CUdeviceptr *, cp_ipc_handle, unsigned int))a->ipcOpenMemHandle)(&p, h, 1);
	ret.r = cp_leave(a, pushed, ret.r);
	ret.a = p;
	return ret;
}

static CUresult cp_ipc_close_mem_handle(const cp_api *a, uintptr_t ctx, unsigned long long p) {
	int pushed;
	CUresult r = cp_enter(a, ctx, &pushed);
	if (r == 0)
		r = ((CUresult (*)(CUdeviceptr))a->ipcCloseMemHandle)((CUdeviceptr)p);
	return cp_leave(a, pushed, r);
}

// cuThreadExchangeStreamCaptureMode works on the calling thread's mode and
// needs no context.
static cp_ret cp_exchange_capture_mode(const cp_api *a, int mode) {
	int m = mode;
	cp_ret ret = {((cp_fn_pi)a->threadExchangeStreamCaptureMode)(&m), 0, 0};
	ret.a = (unsigned long long)m;
	return ret;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/cudapool/cudapool/cuda"
)

// LibraryName is the CUDA driver library that Open loads.
const LibraryName = "libcuda.so.1"

const (
	eventDisableTiming = 0x2 // CU_EVENT_DISABLE_TIMING

	// captureInfoAPIVersion is the API version asked of cuGetProcAddress for
	// cuStreamGetCaptureInfo: 12000 yields the v2 ABI on CUDA 12 and 13
	// drivers alike (a driver serves every older API version it supports).
	captureInfoAPIVersion = 12000
)

// Driver is the CUDA driver API. The zero value is not usable; call Open.
// Its methods are safe for concurrent use, except Close.
type Driver struct {
	api     *C.cp_api // C memory, never freed: in-flight calls may still read it
	lib     uintptr   // dlopen handle of libcuda.so.1
	version int       // cuDriverGetVersion, e.g. 13000

	// captureInfo names the cuStreamGetCaptureInfo variant in use, for
	// diagnostics ("cuGetProcAddress_v2(cuStreamGetCaptureInfo, 12000)",
	// "cuStreamGetCaptureInfo_v2", ...).
	captureInfo string

	devs []C.CUdevice // CUdevice of each ordinal

	// vmm reports whether every virtual memory management entry point
	// (vmmSymbols) was found.
	vmm bool
	// shareable reports whether cuMemExportToShareableHandle and
	// cuMemImportFromShareableHandle were found (with vmm).
	shareable bool
	// ipcOpen names the cuIpcOpenMemHandle entry point in use
	// ("cuIpcOpenMemHandle_v2"), "" when the driver lacks CUDA IPC.
	ipcOpen string
	// copy holds the copy engine's entry points (copy.go).
	copy copyAPI
	// peers[i] is accessPeers(i) | peersKnown once computed, 0 before;
	// computing it twice is harmless.
	peers []atomic.Uint64

	// ctxs[i] is device i's retained primary context, 0 until first use.
	// Read without locking on every call; mu serialises retain/release.
	ctxs []atomic.Uintptr
	mu   sync.Mutex
}

// symbols are the exported names Open resolves. cuStreamGetCaptureInfo is
// resolved separately; cuGetProcAddress_v2 is optional.
var symbols = []struct {
	name string
	slot func(*C.cp_api) *C.uintptr_t
}{
	{"cuInit", func(a *C.cp_api) *C.uintptr_t { return &a.init }},
	{"cuDriverGetVersion", func(a *C.cp_api) *C.uintptr_t { return &a.driverGetVersion }},
	{"cuDeviceGetCount", func(a *C.cp_api) *C.uintptr_t { return &a.deviceGetCount }},
	{"cuDeviceGet", func(a *C.cp_api) *C.uintptr_t { return &a.deviceGet }},
	{"cuDeviceGetPCIBusId", func(a *C.cp_api) *C.uintptr_t { return &a.deviceGetPCIBusId }},
	{"cuDevicePrimaryCtxRetain", func(a *C.cp_api) *C.uintptr_t { return &a.primaryCtxRetain }},
	{"cuDevicePrimaryCtxRelease_v2", func(a *C.cp_api) *C.uintptr_t { return &a.primaryCtxRelease }},
	{"cuCtxGetCurrent", func(a *C.cp_api) *C.uintptr_t { return &a.ctxGetCurrent }},
	{"cuCtxPushCurrent_v2", func(a *C.cp_api) *C.uintptr_t { return &a.ctxPushCurrent }},
	{"cuCtxPopCurrent_v2", func(a *C.cp_api) *C.uintptr_t { return &a.ctxPopCurrent }},
	{"cuCtxSynchronize", func(a *C.cp_api) *C.uintptr_t { return &a.ctxSynchronize }},
	{"cuMemGetInfo_v2", func(a *C.cp_api) *C.uintptr_t { return &a.memGetInfo }},
	{"cuMemAlloc_v2", func(a *C.cp_api) *C.uintptr_t { return &a.memAlloc }},
	{"cuMemFree_v2", func(a *C.cp_api) *C.uintptr_t { return &a.memFree }},
	{"cuEventCreate", func(a *C.cp_api) *C.uintptr_t { return &a.eventCreate }},
	{"cuEventRecord", func(a *C.cp_api) *C.uintptr_t { return &a.eventRecord }},
	{"cuEventQuery", func(a *C.cp_api) *C.uintptr_t { return &a.eventQuery }},
	{"cuEventSynchronize", func(a *C.cp_api) *C.uintptr_t { return &a.eventSynchronize }},
	{"cuEventDestroy_v2", func(a *C.cp_api) *C.uintptr_t { return &a.eventDestroy }},
	{"cuThreadExchangeStreamCaptureMode", func(a *C.cp_api) *C.uintptr_t { return &a.threadExchangeStreamCaptureMode }},
}

// vmmSymbols are the virtual memory management entry points. They are
// optional: without all of them the Driver reports ErrNotSupported from
// MemGranularity and the allocator uses ordinary segments.
var vmmSymbols = []struct {
	name string
	slot func(*C.cp_api) *C.uintptr_t
}{
	{"cuDeviceGetAttribute", func(a *C.cp_api) *C.uintptr_t { return &a.deviceGetAttribute }},
	{"cuMemGetAllocationGranularity", func(a *C.cp_api) *C.uintptr_t { return &a.memGetAllocationGranularity }},
	{"cuMemAddressReserve", func(a *C.cp_api) *C.uintptr_t { return &a.memAddressReserve }},
	{"cuMemAddressFree", func(a *C.cp_api) *C.uintptr_t { return &a.memAddressFree }},
	{"cuMemCreate", func(a *C.cp_api) *C.uintptr_t { return &a.memCreate }},
	{"cuMemRelease", func(a *C.cp_api) *C.uintptr_t { return &a.memRelease }},
	{"cuMemMap", func(a *C.cp_api) *C.uintptr_t { return &a.memMap }},
	{"cuMemUnmap", func(a *C.cp_api) *C.uintptr_t { return &a.memUnmap }},
	{"cuMemSetAccess", func(a *C.cp_api) *C.uintptr_t { return &a.memSetAccess }},
}

// Open loads libcuda.so.1, initialises the driver (cuInit(0)) and counts the
// devices. Contexts are not touched until a device is first used. An error
// (never a crash) is returned when the library or a device is missing.
func Open() (*Driver, error) {
	return openLibrary(LibraryName)
}

// openLibrary is Open with the library path as a parameter (tests load a
// fake driver through it).
func openLibrary(path string) (*Driver, error) {
	lib, err := dlopen(path)
	if err != nil {
		return nil, fmt.Errorf("cudapool: cannot load the CUDA driver (%s): %w", path, err)
	}
	api := (*C.cp_api)(C.calloc(1, C.sizeof_cp_api))
	d := &Driver{api: api, lib: lib}
	ok := false
	defer func() {
		if !ok { // nothing escaped: undo the load
			C.free(unsafe.Pointer(api))
			_ = purego.Dlclose(lib)
		}
	}()
	for _, s := range symbols {
		p, err := purego.Dlsym(lib, s.name)
		if err != nil || p == 0 {
			return nil, fmt.Errorf("cudapool: the CUDA driver (%s) lacks %s; is it too old?", path, s.name)
		}
		*s.slot(api) = C.uintptr_t(p)
	}
	if p, err := purego.Dlsym(lib, "cuGetProcAddress_v2"); err == nil {
		api.getProcAddress = C.uintptr_t(p)
	}
	if p, err := purego.Dlsym(lib, "cuDeviceCanAccessPeer"); err == nil {
		api.deviceCanAccessPeer = C.uintptr_t(p)
	}
	d.resolveIPC()
	d.resolveCopy()
	d.resolveGraphNodeDeps()
	d.vmm = true
	for _, s := range vmmSymbols {
		p, err := purego.Dlsym(lib, s.name)
		if err != nil || p == 0 {
			d.vmm = false
			break
		}
		*s.slot(api) = C.uintptr_t(p)
	}
	if d.vmm {
		exp, err1 := purego.Dlsym(lib, "cuMemExportToShareableHandle")
		imp, err2 := purego.Dlsym(lib, "cuMemImportFromShareableHandle")
		if err1 == nil && err2 == nil && exp != 0 && imp != 0 {
			api.memExportToShareableHandle = C.uintptr_t(exp)
			api.memImportFromShareableHandle = C.uintptr_t(imp)
			d.shareable = true
		}
	}

	if err := check(C.cp_init(api)); err != nil {
		return nil, fmt.Errorf("cudapool: cuInit: %w", err)
	}
	ret := C.cp_driver_version(api)
	if err := check(ret.r); err != nil {
		return nil, fmt.Errorf("cudapool: cuDriverGetVersion: %w", err)
	}
	d.version = int(ret.a)
	if err := d.resolveCaptureInfo(captureInfoAPIVersion); err != nil {
		return nil, err
	}

	ret = C.cp_device_count(api)
	if err := check(ret.r); err != nil {
		return nil, fmt.Errorf("cudapool: cuDeviceGetCount: %w", err)
	}
	n := int(ret.a)
	d.devs = make([]C.CUdevice, n)
	d.ctxs = make([]atomic.Uintptr, n)
	d.peers = make([]atomic.Uint64, n)
	for i := range n {
		ret := C.cp_device_get(api, C.int(i))
		if err := check(ret.r); err != nil {
			return nil, fmt.Errorf("cudapool: cuDeviceGet(%d): %w", i, err)
		}
		d.devs[i] = C.CUdevice(ret.a)
	}
	ok = true
	return d, nil
}

// resolveIPC finds the CUDA IPC entry points: cuIpcGetMemHandle,
// cuIpcCloseMemHandle and cuIpcOpenMemHandle_v2 (the name cuda.h has mapped
// cuIpcOpenMemHandle to since CUDA 11), else the original
// cuIpcOpenMemHandle. Without all three the IPC methods return
// ErrNotSupported.
func (d *Driver) resolveIPC() {
	get, err1 := purego.Dlsym(d.lib, "cuIpcGetMemHandle")
	closeFn, err2 := purego.Dlsym(d.lib, "cuIpcCloseMemHandle")
	if err1 != nil || err2 != nil || get == 0 || closeFn == 0 {
		return
	}
	for _, name := range []string{"cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"} {
		if p, err := purego.Dlsym(d.lib, name); err == nil && p != 0 {
			d.api.ipcGetMemHandle = C.uintptr_t(get)
			d.api.ipcOpenMemHandle = C.uintptr_t(p)
			d.api.ipcCloseMemHandle = C.uintptr_t(closeFn)
			d.ipcOpen = name
			return
		}
	}
}

// dlopen wraps purego.Dlopen on a locked thread: dlerror's message is per
// thread and purego reads it in a second call.
func dlopen(path string) (uintptr, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_LOCAL)
}

// resolveGraphNodeDeps finds cuGraphNodeGetDependencies with its original
// ABI (node, dependencies*, numDependencies*): cuGetProcAddress_v2 at API
// version 12000, else the exported name. Without it, or without the v2
// cuStreamGetCaptureInfo, the capture-graph methods return ErrNotSupported.
func (d *Driver) resolveGraphNodeDeps() {
	if d.api.getProcAddress != 0 {
		name := C.CString("cuGraphNodeGetDependencies")
		ret := C.cp_get_proc_address(d.api, name, C.int(captureInfoAPIVersion), 0)
		C.free(unsafe.Pointer(name))
		if ret.r == 0 && ret.a != 0 && ret.b == 0 {
			d.api.graphNodeGetDependencies = C.uintptr_t(ret.a)
			return
		}
	}
	if p, err := purego.Dlsym(d.lib, "cuGraphNodeGetDependencies"); err == nil && p != 0 {
		d.api.graphNodeGetDependencies = C.uintptr_t(p)
	}
}

// captureGraph reports whether the capture-graph queries are available:
// cuGraphNodeGetDependencies and a cuStreamGetCaptureInfo with the v2 ABI
// (resolved at API version 12000, or exported as _v2).
func (d *Driver) captureGraph() bool {
	return d.api.graphNodeGetDependencies != 0 && d.captureInfo != "cuStreamGetCaptureInfo"
}

// resolveCaptureInfo picks the cuStreamGetCaptureInfo entry point. Preferred:
// cuGetProcAddress_v2 (CUDA 12.0+) at API version 12000, which names the ABI
// explicitly (v2). Fallbacks for older drivers: the exported
// cuStreamGetCaptureInfo_v2 (11.3+), then cuStreamGetCaptureInfo (v1).
// cp_stream_capture_info is safe with any of them, and with the v3 ABI that
// API versions 13000+ yield (see its comment; a GPU test checks both).
func (d *Driver) resolveCaptureInfo(version int) error {
	if d.api.getProcAddress != 0 {
		name := C.CString("cuStreamGetCaptureInfo")
		ret := C.cp_get_proc_address(d.api, name, C.int(version), 0 /* CU_GET_PROC_ADDRESS_DEFAULT */)
		C.free(unsafe.Pointer(name))
		if ret.r == 0 && ret.a != 0 && ret.b == 0 /* CU_GET_PROC_ADDRESS_SUCCESS */ {
			d.api.streamGetCaptureInfo = C.uintptr_t(ret.a)
			d.captureInfo = fmt.Sprintf("cuGetProcAddress_v2(cuStreamGetCaptureInfo, %d)", version)
			return nil
		}
	}
	for _, name := range []string{"cuStreamGetCaptureInfo_v2", "cuStreamGetCaptureInfo"} {
		if p, err := purego.Dlsym(d.lib, name); err == nil && p != 0 {
			d.api.streamGetCaptureInfo = C.uintptr_t(p)
			d.captureInfo = name
			return nil
		}
	}
	return errors.New("cudapool: the CUDA driver has no cuStreamGetCaptureInfo; is it too old?")
}

// check converts a CUresult. Errors are cuda.Result values so that callers
// can use errors.Is(err, cuda.ErrOutOfMemory).
func check(r C.CUresult) error {
	if r == 0 {
		return nil
	}
	return cuda.Result(r)
}

// Version returns the driver's CUDA version (cuDriverGetVersion), e.g. 13000.
func (d *Driver) Version() int { return d.version }

// CaptureInfoEntryPoint says which cuStreamGetCaptureInfo variant is in use.
func (d *Driver) CaptureInfoEntryPoint() string { return d.captureInfo }

// ctx returns dev's primary context, retaining it on first use.
func (d *Driver) ctx(dev int) (C.uintptr_t, error) {
	if uint(dev) >= uint(len(d.ctxs)) {
		return 0, cuda.ErrInvalidDevice
	}
	if c := d.ctxs[dev].Load(); c != 0 {
		return C.uintptr_t(c), nil
	}
	return d.retain(dev)
}

// retain is ctx's slow path. Retaining creates the primary context if no one
// has (PyTorch's runtime API uses the same one), which takes a while and
// some device memory, hence lazily. A failure is not cached: the next call
// tries again.
func (d *Driver) retain(dev int) (C.uintptr_t, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if c := d.ctxs[dev].Load(); c != 0 {
		return C.uintptr_t(c), nil
	}
	ret := C.cp_primary_retain(d.api, d.devs[dev])
	if err := check(ret.r); err != nil {
		return 0, fmt.Errorf("cudapool: cuDevicePrimaryCtxRetain(device %d): %w", dev, err)
	}
	d.ctxs[dev].Store(uintptr(ret.a))
	return C.uintptr_t(ret.a), nil
}

// Close releases the primary contexts this Driver retained. The Driver stays
// usable (it retains again on the next call), but Close must not run
// concurrently with other methods. libcuda.so.1 stays loaded.
func (d *Driver) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var errs []error
	for i := range d.ctxs {
		if d.ctxs[i].Load() == 0 {
			continue
		}
		if err := check(C.cp_primary_release(d.api, d.devs[i])); err != nil {
			errs = append(errs, fmt.Errorf("cudapool: cuDevicePrimaryCtxRelease(device %d): %w", i, err))
			continue
		}
		d.ctxs[i].Store(0)
	}
	return errors.Join(errs...)
}

// DeviceCount returns the number of devices cuDeviceGetCount reported at Open.
func (d *Driver) DeviceCount() (int, error) { return len(d.devs), nil }

// MemGetInfo returns dev's free and total memory in bytes (cuMemGetInfo_v2).
func (d *Driver) MemGetInfo(dev int) (free, total uint64, err error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, 0, err
	}
	ret := C.cp_mem_get_info(d.api, c)
	if err := check(ret.r); err != nil {
		return 0, 0, err
	}
	return uint64(ret.a), uint64(ret.b), nil
}

// MemAlloc allocates size bytes on dev (cuMemAlloc_v2). It obeys the calling
// thread's stream capture mode; see ExchangeCaptureMode and MemAllocRelaxed.
func (d *Driver) MemAlloc(dev int, size uint64) (cuda.Ptr, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	ret := C.cp_mem_alloc(d.api, c, C.ulonglong(size))
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.Ptr(ret.a), nil
}

// MemAllocRelaxed is MemAlloc with the calling thread switched to relaxed
// capture mode for the duration, in a single C call (so it needs no thread
// pinning). It is what the allocator needs while a graph capture is under
// way, and cheaper than ExchangeCaptureMode + MemAlloc + ExchangeCaptureMode.
func (d *Driver) MemAllocRelaxed(dev int, size uint64) (cuda.Ptr, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	ret := C.cp_mem_alloc_relaxed(d.api, c, C.ulonglong(size))
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.Ptr(ret.a), nil
}

// MemFree frees p, allocated on dev (cuMemFree_v2).
func (d *Driver) MemFree(dev int, p cuda.Ptr) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_mem_free(d.api, c, C.ulonglong(p)))
}

// DeviceSynchronize waits for all work on dev's primary context
// (cuCtxSynchronize).
func (d *Driver) DeviceSynchronize(dev int) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_ctx_synchronize(d.api, c))
}

// StreamCaptureInfo reports whether s is capturing and the capture sequence's
// id (0 when not capturing). It is legal during capture.
func (d *Driver) StreamCaptureInfo(dev int, s cuda.Stream) (cuda.CaptureStatus, uint64, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return cuda.CaptureNone, 0, err
	}
	ret := C.cp_stream_capture_info(d.api, c, C.uintptr_t(s))
	if err := check(ret.r); err != nil {
		return cuda.CaptureNone, 0, err
	}
	return cuda.CaptureStatus(ret.a), uint64(ret.b), nil
}

// StreamCaptureGraph reports s's capture status and id, and appends the
// capture's current terminal nodes of s to buf. Legal during capture.
func (d *Driver) StreamCaptureGraph(dev int, s cuda.Stream, buf []cuda.GraphNode) (cuda.CaptureStatus, uint64, []cuda.GraphNode, error) {
	if !d.captureGraph() {
		return cuda.CaptureNone, 0, buf, cuda.ErrNotSupported
	}
	c, err := d.ctx(dev)
	if err != nil {
		return cuda.CaptureNone, 0, buf, err
	}
	room := 8
	for {
		// Slot 0 of the spare capacity takes the id, the rest terminals.
		buf = slices.Grow(buf, room+1)
		spare := buf[len(buf) : len(buf)+room+1]
		ret := C.cp_stream_capture_graph(d.api, c, C.uintptr_t(s), (*C.uintptr_t)(unsafe.Pointer(&spare[0])), C.size_t(room))
		if err := check(ret.r); err != nil {
			return cuda.CaptureNone, 0, buf, err
		}
		n := int(ret.b)
		if n <= room {
			// Read the id before the append overwrites slot 0 with the
			// terminals (the order of operands in a return is unspecified).
			id := uint64(spare[0])
			return cuda.CaptureStatus(ret.a), id, append(buf, spare[1:1+n]...), nil
		}
		room = n
	}
}

// GraphNodeDependencies appends n's dependencies to buf. Legal during
// capture.
func (d *Driver) GraphNodeDependencies(dev int, n cuda.GraphNode, buf []cuda.GraphNode) ([]cuda.GraphNode, error) {
	if !d.captureGraph() {
		return buf, cuda.ErrNotSupported
	}
	c, err := d.ctx(dev)
	if err != nil {
		return buf, err
	}
	room := 4
	for {
		buf = slices.Grow(buf, room)
		spare := buf[len(buf) : len(buf)+room]
		ret := C.cp_graph_node_deps(d.api, c, C.uintptr_t(n), (*C.uintptr_t)(unsafe.Pointer(&spare[0])), C.size_t(room))
		if err := check(ret.r); err != nil {
			return buf, err
		}
		k := int(ret.a)
		if k <= room {
			return append(buf, spare[:k]...), nil
		}
		room = k
	}
}

// ExchangeCaptureMode sets the calling OS thread's stream capture mode and
// returns the previous one (cuThreadExchangeStreamCaptureMode).
//
// The mode belongs to the OS thread, not the goroutine. A caller that
// exchanges, allocates and exchanges back must keep its goroutine on one
// thread throughout: runtime.LockOSThread, or run inside a cgo callback (an
// exported function called from C runs on the calling C thread and cannot
// migrate until it returns, which covers cudapool's entry points).
// MemAllocRelaxed does the whole sequence in one C call.
func (d *Driver) ExchangeCaptureMode(mode cuda.CaptureMode) (cuda.CaptureMode, error) {
	ret := C.cp_exchange_capture_mode(d.api, C.int(mode))
	if err := check(ret.r); err != nil {
		return mode, err
	}
	return cuda.CaptureMode(ret.a), nil
}

// EventCreate returns a new event on dev with timing disabled
// (CU_EVENT_DISABLE_TIMING), the cheapest kind to record and query.
func (d *Driver) EventCreate(dev int) (cuda.Event, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	ret := C.cp_event_create(d.api, c, eventDisableTiming)
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.Event(ret.a), nil
}

// EventRecord records e on stream s (cuEventRecord).
func (d *Driver) EventRecord(dev int, e cuda.Event, s cuda.Stream) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_event_record(d.api, c, C.uintptr_t(e), C.uintptr_t(s)))
}

// EventQuery reports whether the work before e's last record has completed.
// CUDA_ERROR_NOT_READY is (false, nil).
func (d *Driver) EventQuery(dev int, e cuda.Event) (bool, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return false, err
	}
	switch r := C.cp_event_op(d.api, d.api.eventQuery, c, C.uintptr_t(e)); r {
	case 0:
		return true, nil
	case C.CUresult(cuda.ErrNotReady):
		return false, nil
	default:
		return false, check(r)
	}
}

// EventSynchronize waits for e (cuEventSynchronize).
func (d *Driver) EventSynchronize(dev int, e cuda.Event) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_event_op(d.api, d.api.eventSynchronize, c, C.uintptr_t(e)))
}

// EventDestroy destroys e (cuEventDestroy_v2).
func (d *Driver) EventDestroy(dev int, e cuda.Event) error {
	c, err := d.ctx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_event_op(d.api, d.api.eventDestroy, c, C.uintptr_t(e)))
}

// pciBusID returns dev's PCI bus id ("0000:3b:00.0"), which names the same
// GPU for CUDA and NVML: NVML ignores CUDA_VISIBLE_DEVICES, so CUDA ordinals
// and NVML indices may differ.
func (d *Driver) pciBusID(dev int) (string, error) {
	if uint(dev) >= uint(len(d.devs)) {
		return "", cuda.ErrInvalidDevice
	}
	const n = 64
	buf := (*C.char)(C.malloc(n))
	defer C.free(unsafe.Pointer(buf))
	if err := check(C.cp_device_pci_bus_id(d.api, d.devs[dev], buf, n)); err != nil {
		return "", fmt.Errorf("cudapool: cuDeviceGetPCIBusId(device %d): %w", dev, err)
	}
	return C.GoString(buf), nil
}

// The virtual memory management API, which the allocator's expandable
// segments use (see package vmem). Physical memory is pinned
// device memory of the named device, with no shareable handle unless made
// by MemCreateShareable; access is read-write for that device and its
// peers (MemSetAccess).

// MemGranularity returns the recommended granularity of dev's physical
// allocations (cuMemGetAllocationGranularity), or ErrNotSupported when the
// driver or the device lacks virtual memory management.
func (d *Driver) MemGranularity(dev int) (uint64, error) {
	c, err := d.ctx(dev)
	if err != nil {
		return 0, err
	}
	if !d.vmm {
		return 0, cuda.ErrNotSupported
	}
	ret := C.cp_mem_granularity(d.api, c, d.devs[dev], C.int(dev))
	if err := check(ret.r); err != nil {
		return 0, err
	}
	if ret.a == 0 {
		return 0, cuda.ErrNotSupported
	}
	return uint64(ret.a), nil
}

// MemAddressReserve reserves size bytes of address space (cuMemAddressReserve),
// aligned to the granularity. It obeys the thread's capture mode.
func (d *Driver) MemAddressReserve(dev int, size uint64) (cuda.Ptr, error) {
	c, err := d.vmmCtx(dev)
	if err != nil {
		return 0, err
	}
	ret := C.cp_mem_address_reserve(d.api, c, C.ulonglong(size))
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.Ptr(ret.a), nil
}

// MemAddressFree frees a whole reservation (cuMemAddressFree).
func (d *Driver) MemAddressFree(dev int, p cuda.Ptr, size uint64) error {
	c, err := d.vmmCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_mem_address_free(d.api, c, C.ulonglong(p), C.ulonglong(size)))
}

// MemCreate allocates size bytes of physical memory on dev (cuMemCreate),
// with no shareable handle. It obeys the thread's capture mode.
func (d *Driver) MemCreate(dev int, size uint64) (cuda.MemHandle, error) {
	return d.MemCreateShareable(dev, size, 0)
}

// MemCreateShareable is MemCreate for memory that may be exported to other
// processes through the handle kinds in kinds (requestedHandleTypes; 0 is
// MemCreate). A kind the device cannot export fails here or at the export,
// depending on the driver: a driver may accept CU_MEM_HANDLE_TYPE_FABRIC at
// creation and refuse the export (see ProbeFabric).
func (d *Driver) MemCreateShareable(dev int, size uint64, kinds cuda.ShareableKind) (cuda.MemHandle, error) {
	if kinds&^(cuda.ShareablePOSIXFD|cuda.ShareableFabric) != 0 {
		return 0, cuda.ErrInvalidValue
	}
	c, err := d.vmmCtx(dev)
	if err != nil {
		return 0, err
	}
	ret := C.cp_mem_create(d.api, c, C.int(dev), C.ulonglong(size), C.int(kinds))
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.MemHandle(ret.a), nil
}

// MemRelease releases a handle (cuMemRelease); its memory is freed once it
// is unmapped.
func (d *Driver) MemRelease(dev int, h cuda.MemHandle) error {
	c, err := d.vmmCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_mem_release(d.api, c, C.ulonglong(h)))
}

// MemMap maps all of h at p (cuMemMap, offset 0). It obeys the thread's
// capture mode.
func (d *Driver) MemMap(dev int, p cuda.Ptr, size uint64, h cuda.MemHandle) error {
	c, err := d.vmmCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_mem_map(d.api, c, C.ulonglong(p), C.ulonglong(size), C.ulonglong(h)))
}

// MemSetAccess makes [p, p+size) readable and writable from dev
// (cuMemSetAccess). It obeys the thread's capture mode.
func (d *Driver) MemSetAccess(dev int, p cuda.Ptr, size uint64) error {
	c, err := d.vmmCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_mem_set_access(d.api, c, C.int(dev), C.ulonglong(d.accessPeers(dev)), C.ulonglong(p), C.ulonglong(size)))
}

// accessPeers returns, as a bit mask of ordinals, the devices that can
// access dev's memory as peers, found once per device. MemSetAccess grants
// them access too: memory from cuMemCreate is reachable only from the
// devices named in cuMemSetAccess, whatever cuCtxEnablePeerAccess says, and
// PyTorch copies between GPUs with kernels that read the other GPU's memory
// directly. (PyTorch's own expandable segments grant that access when it
// enables peer access, a hook pluggable allocators do not get.)
func (d *Driver) accessPeers(dev int) uint64 {
	if m := d.peers[dev].Load(); m != 0 {
		return m &^ peersKnown
	}
	var mask uint64
	for i := range d.devs {
		if i == dev || i >= 63 {
			continue
		}
		if ret := C.cp_can_access_peer(d.api, d.devs[i], d.devs[dev]); ret.r == 0 && ret.a != 0 {
			mask |= 1 << i
		}
	}
	d.peers[dev].Store(mask | peersKnown)
	return mask
}

// peersKnown marks a computed entry of Driver.peers (ordinals stay below 63:
// devices beyond are not given peer access).
const peersKnown = 1 << 63

// MemUnmap unmaps [p, p+size) (cuMemUnmap).
func (d *Driver) MemUnmap(dev int, p cuda.Ptr, size uint64) error {
	c, err := d.vmmCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_mem_unmap(d.api, c, C.ulonglong(p), C.ulonglong(size)))
}

// CUDA IPC of memory, which lets another process map memory from cuMemAlloc
// (PyTorch's torch.multiprocessing sends CUDA tensors this way). Each call
// runs in dev's primary context, the one PyTorch's runtime uses, so a
// mapping opened here is the one a runtime cudaIpcOpenMemHandle would find.
// None of them is stream-ordered, and on the driver tried (580, CUDA 13)
// none of them disturbs a stream capture under way, whatever the thread's
// capture mode.

// IpcEntryPoint names the cuIpcOpenMemHandle variant in use
// ("cuIpcOpenMemHandle_v2"), or "" when the driver lacks CUDA IPC.
func (d *Driver) IpcEntryPoint() string { return d.ipcOpen }

// IpcGetMemHandle returns the IPC handle of the cuMemAlloc allocation that
// holds p (cuIpcGetMemHandle). The driver accepts any address inside the
// allocation and names the whole allocation; memory of other kinds (mapped
// with the VMM API, or opened from another process) fails with
// ErrInvalidValue. ErrNotSupported: the driver has no CUDA IPC.
func (d *Driver) IpcGetMemHandle(dev int, p cuda.Ptr) (cuda.IpcHandle, error) {
	c, err := d.ipcCtx(dev)
	if err != nil {
		return cuda.IpcHandle{}, err
	}
	ret := C.cp_ipc_get_mem_handle(d.api, c, C.ulonglong(p))
	if err := check(ret.r); err != nil {
		return cuda.IpcHandle{}, err
	}
	return *(*cuda.IpcHandle)(unsafe.Pointer(&ret.h.reserved)), nil
}

// IpcOpenMemHandle maps memory another process exported with
// IpcGetMemHandle into dev's primary context (cuIpcOpenMemHandle_v2 with
// CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, so memory of another device is
// reachable through peer access). The driver counts references: opening a
// handle already open in the context returns the same address, and each
// open needs its IpcCloseMemHandle. A handle of freed memory, or bytes that
// are no handle, fail with ErrInvalidValue; a handle made by this same
// process fails with ErrInvalidContext (CUDA refuses that).
func (d *Driver) IpcOpenMemHandle(dev int, h cuda.IpcHandle) (cuda.Ptr, error) {
	c, err := d.ipcCtx(dev)
	if err != nil {
		return 0, err
	}
	var ch C.cp_ipc_handle
	*(*cuda.IpcHandle)(unsafe.Pointer(&ch.reserved)) = h
	ret := C.cp_ipc_open_mem_handle(d.api, c, ch)
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.Ptr(ret.a), nil
}

// IpcCloseMemHandle drops one reference to a mapping IpcOpenMemHandle
// returned on dev (cuIpcCloseMemHandle); the last one unmaps it. Any other
// address, including one inside the mapping, fails with ErrInvalidValue.
func (d *Driver) IpcCloseMemHandle(dev int, p cuda.Ptr) error {
	c, err := d.ipcCtx(dev)
	if err != nil {
		return err
	}
	return check(C.cp_ipc_close_mem_handle(d.api, c, C.ulonglong(p)))
}

// Sharing physical allocations with other processes, the mechanism of
// PyTorch's IPC of expandable segments: memory made by MemCreateShareable is
// exported as a file descriptor or a fabric handle, and another process
// imports it (after duplicating the descriptor with PidfdGetfd, see
// pidfd.go), maps the handle it gets with MemMap and MemSetAccess, and
// unmaps and releases it when done. The physical memory lives until every
// process has unmapped and released its handle and closed its descriptors.

// Attributes of cuDeviceGetAttribute.
const (
	attrHandlePOSIXFD = 103 // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
	attrHandleFabric  = 128 // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (CUDA 12.3+)
)

// ShareableKinds returns the handle kinds dev's physical memory can be
// exported through, from the device attributes. An attribute the driver
// does not know (fabric before CUDA 12.3) counts as unsupported. A device
// may report fabric support that the system cannot use (no IMEX channel):
// ProbeFabric tries it.
func (d *Driver) ShareableKinds(dev int) (cuda.ShareableKind, error) {
	if _, err := d.shareCtx(dev); err != nil {
		return 0, err
	}
	var kinds cuda.ShareableKind
	if ret := C.cp_device_attribute(d.api, d.devs[dev], attrHandlePOSIXFD); ret.r == 0 && ret.a != 0 {
		kinds |= cuda.ShareablePOSIXFD
	}
	if ret := C.cp_device_attribute(d.api, d.devs[dev], attrHandleFabric); ret.r == 0 && ret.a != 0 {
		kinds |= cuda.ShareableFabric
	}
	return kinds, nil
}

// ProbeFabric reports whether fabric handles work on dev, as PyTorch's
// c10::cuda::get_fabric_access finds out (its isFabricSupported): create one
// granule of memory exportable as a fabric handle, export it, import the
// handle, and release both. nil means all three worked; otherwise the error
// names the step that failed. A device without the attribute fails without
// trying. The probe costs one granule of device memory for a moment, and
// creates memory: call it once, outside any stream capture.
func (d *Driver) ProbeFabric(dev int) error {
	kinds, err := d.ShareableKinds(dev)
	if err != nil {
		return err
	}
	if kinds&cuda.ShareableFabric == 0 {
		return fmt.Errorf("cudapool: device %d does not support fabric handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED): %w", dev, cuda.ErrNotSupported)
	}
	g, err := d.MemGranularity(dev)
	if err != nil {
		return err
	}
	h, err := d.MemCreateShareable(dev, g, cuda.ShareableFabric)
	if err != nil {
		return fmt.Errorf("cudapool: cuMemCreate with a fabric handle on device %d: %w", dev, err)
	}
	defer d.MemRelease(dev, h)
	sh, err := d.MemExportShareable(dev, h, cuda.ShareableFabric)
	if err != nil {
		return fmt.Errorf("cudapool: cuMemExportToShareableHandle (fabric) on device %d: %w", dev, err)
	}
	imp, err := d.MemImportShareable(dev, sh)
	if err != nil {
		return fmt.Errorf("cudapool: cuMemImportFromShareableHandle (fabric) on device %d: %w", dev, err)
	}
	return d.MemRelease(dev, imp)
}

// MemExportShareable exports dev's physical allocation h as one handle of
// kind (cuMemExportToShareableHandle), which h must have been created with.
// Each export of a file descriptor opens a new descriptor, which the caller
// owns and closes with CloseFD; an importer needs it open until it has
// duplicated it. A fabric handle needs no closing.
func (d *Driver) MemExportShareable(dev int, h cuda.MemHandle, kind cuda.ShareableKind) (cuda.ShareableHandle, error) {
	if kind != cuda.ShareablePOSIXFD && kind != cuda.ShareableFabric {
		return cuda.ShareableHandle{}, cuda.ErrInvalidValue
	}
	c, err := d.shareCtx(dev)
	if err != nil {
		return cuda.ShareableHandle{}, err
	}
	ret := C.cp_mem_export(d.api, c, C.ulonglong(h), C.int(kind))
	if err := check(ret.r); err != nil {
		return cuda.ShareableHandle{}, err
	}
	sh := cuda.ShareableHandle{Kind: kind, FD: -1}
	if kind == cuda.ShareablePOSIXFD {
		sh.FD = int(ret.fd)
	} else {
		sh.Fabric = *(*cuda.FabricHandle)(unsafe.Pointer(&ret.fabric.data))
	}
	return sh, nil
}

// MemImportShareable imports a physical allocation another process exported
// (cuMemImportFromShareableHandle) and returns this process's handle of it,
// to map with MemMap and to release with MemRelease. A file descriptor must
// be this process's own (from PidfdGetfd); it stays open, for the caller to
// close: the imported handle does not need it.
func (d *Driver) MemImportShareable(dev int, sh cuda.ShareableHandle) (cuda.MemHandle, error) {
	c, err := d.shareCtx(dev)
	if err != nil {
		return 0, err
	}
	var ret C.cp_ret
	switch sh.Kind {
	case cuda.ShareablePOSIXFD:
		if sh.FD < 0 {
			return 0, cuda.ErrInvalidValue
		}
		ret = C.cp_mem_import_fd(d.api, c, C.int(sh.FD))
	case cuda.ShareableFabric:
		var f C.cp_fabric_handle
		*(*cuda.FabricHandle)(unsafe.Pointer(&f.data)) = sh.Fabric
		ret = C.cp_mem_import_fabric(d.api, c, f)
	default:
		return 0, cuda.ErrInvalidValue
	}
	if err := check(ret.r); err != nil {
		return 0, err
	}
	return cuda.MemHandle(ret.a), nil
}

// shareCtx is ctx for the sharing calls, which need their entry points.
func (d *Driver) shareCtx(dev int) (C.uintptr_t, error) {
	if !d.shareable {
		return 0, cuda.ErrNotSupported
	}
	return d.ctx(dev)
}

// ipcCtx is ctx for the IPC calls, which need the entry points.
func (d *Driver) ipcCtx(dev int) (C.uintptr_t, error) {
	if d.ipcOpen == "" {
		return 0, cuda.ErrNotSupported
	}
	return d.ctx(dev)
}

// vmmCtx is ctx for the VMM calls, which need the entry points.
func (d *Driver) vmmCtx(dev int) (C.uintptr_t, error) {
	if !d.vmm {
		return 0, cuda.ErrNotSupported
	}
	return d.ctx(dev)
}
