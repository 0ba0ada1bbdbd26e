// SPDX-License-Identifier: Apache-2.0
// A fake libcuda for the tests: enough of the driver API for cuda/driver,
// with checks that the right context is current and probes (fake_*) that the
// tests call through purego. Device d's primary context is 0x1000+d; its
// memory lives at 0x7f0000000000 + d<<32.

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

#define NDEV 2
#define PRIMARY(d) ((CUcontext)(uintptr_t)(0x1000 + (d)))
#define MEMBASE(d) (0x7f0000000000ULL + ((unsigned long long)(d) << 32))

static __thread CUcontext stack[32];
static __thread int depth;
static __thread int capture_mode; // 0 global, 1 thread-local, 2 relaxed

static int initialised;
static long pushes, retains[NDEV], live_allocs, live_events;
static unsigned long long next_off[NDEV];
static uintptr_t capturing_stream; // stream being captured (0: none)
static unsigned long long capture_id;
static int last_proc_version;

// Live cuMemAlloc allocations, for cuIpcGetMemHandle: base, size and a
// serial number that makes each allocation's IPC handle unique.
#define MAXALLOC 4096
static pthread_mutex_t alloc_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { CUdeviceptr base; size_t size; unsigned long long serial; } allocs[MAXALLOC];
static unsigned long long last_serial;

static int track_alloc(CUdeviceptr p, size_t size) {
	int ok = 0;
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXALLOC; i++)
		if (allocs[i].base == 0) {
			allocs[i].base = p;
			allocs[i].size = size;
			allocs[i].serial = ++last_serial;
			ok = 1;
			break;
		}
	pthread_mutex_unlock(&alloc_mu);
	return ok;
}

static int untrack_alloc(CUdeviceptr p) {
	int ok = 0;
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXALLOC; i++)
		if (allocs[i].base == p) {
			allocs[i].base = 0;
			ok = 1;
			break;
		}
	pthread_mutex_unlock(&alloc_mu);
	return ok;
}

static int env_int(const char *name) {
	const char *v = getenv(name);
	return v ? atoi(v) : 0;
}

static int cur_dev(void) {
	if (depth == 0)
		return -1;
	uintptr_t c = (uintptr_t)stack[depth - 1];
	return c >= 0x1000 && c < 0x1000 + NDEV ? (int)(c - 0x1000) : -1;
}

CUresult cuInit(unsigned int flags) {
	int e = env_int("FAKECUDA_INIT_ERROR");
	if (e)
		return e;
	if (flags != 0)
		return 1;
	initialised = 1;
	return 0;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int *n) { if (!initialised) return 3; *n = NDEV; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) {
	if (ordinal < 0 || ordinal >= NDEV)
		return 101;
	*d = ordinal;
	return 0;
}
CUresult cuDeviceGetPCIBusId(char *buf, int len, int dev) {
	if (dev < 0 || dev >= NDEV)
		return 101;
	snprintf(buf, len, "0000:%02x:00.0", 0x3b + dev);
	return 0;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, int dev) {
	if (dev < 0 || dev >= NDEV)
		return 101;
	__atomic_add_fetch(&retains[dev], 1, __ATOMIC_SEQ_CST);
	*c = PRIMARY(dev);
	return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
	if (dev < 0 || dev >= NDEV || retains[dev] == 0)
		return 101;
	__atomic_sub_fetch(&retains[dev], 1, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuCtxGetCurrent(CUcontext *c) { *c = depth ? stack[depth - 1] : NULL; return 0; }
CUresult cuCtxPushCurrent_v2(CUcontext c) {
	if (c == NULL || depth == 32)
		return 1;
	__atomic_add_fetch(&pushes, 1, __ATOMIC_SEQ_CST);
	stack[depth++] = c;
	return 0;
}
CUresult cuCtxPopCurrent_v2(CUcontext *c) {
	if (depth == 0)
		return 201;
	depth--;
	if (c)
		*c = stack[depth];
	return 0;
}
CUresult cuCtxSynchronize(void) { return cur_dev() < 0 ? 201 : 0; }
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	*total = (size_t)(d + 1) << 34;
	*free_ = *total - ((size_t)1 << 20);
	return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (size == 0)
		return 1;
	if (size > ((size_t)1 << 33))
		return 2;
	if (capturing_stream != 0 && capture_mode != 2)
		return 900; // cudaMalloc is unsafe during a global/thread-local capture
	*p = MEMBASE(d) + __atomic_fetch_add(&next_off[d], (size + 511) & ~511ULL, __ATOMIC_SEQ_CST);
	if (!track_alloc(*p, size))
		return 2;
	__atomic_add_fetch(&live_allocs, 1, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (p < MEMBASE(d) || p >= MEMBASE(d) + (1ULL << 32))
		return 1; // not this context's memory: the wrong context was current
	if (!untrack_alloc(p))
		return 1; // not a live allocation's base
	__atomic_sub_fetch(&live_allocs, 1, __ATOMIC_SEQ_CST);
	return 0;
}

struct event { int dev, pending; };

CUresult cuEventCreate(struct event **e, unsigned int flags) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (flags != 2) // the driver must ask for CU_EVENT_DISABLE_TIMING
		return 1;
	*e = calloc(1, sizeof **e);
	(*e)->dev = d;
	__atomic_add_fetch(&live_events, 1, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuEventRecord(struct event *e, void *stream) {
	(void)stream;
	if (cur_dev() != e->dev)
		return 201;
	e->pending = 2; // not ready for the next two queries
	return 0;
}
CUresult cuEventQuery(struct event *e) {
	if (cur_dev() != e->dev)
		return 201;
	if (e->pending > 0) {
		e->pending--;
		return 600;
	}
	return 0;
}
CUresult cuEventSynchronize(struct event *e) {
	if (cur_dev() != e->dev)
		return 201;
	e->pending = 0;
	return 0;
}
CUresult cuEventDestroy_v2(struct event *e) {
	if (cur_dev() != e->dev)
		return 201;
	free(e);
	__atomic_sub_fetch(&live_events, 1, __ATOMIC_SEQ_CST);
	return 0;
}

static CUresult capture_info(void *stream, int *status, unsigned long long *id) {
	if (cur_dev() < 0)
		return 201;
	if (status == NULL)
		return 1;
	*status = capturing_stream != 0 && (uintptr_t)stream == capturing_stream ? 1 : 0;
	if (id && *status)
		*id = capture_id;
	return 0;
}
// The capturing stream's terminal nodes (fake_set_terminals) and how many
// queries asked for them: StreamCaptureInfo must not (it passes NULL, which
// keeps a real v2 from failing with CUDA_ERROR_LOSSY_QUERY).
static uintptr_t terminals[64];
static size_t nterminals;
static long graph_queries;

// v2 ABI (CUDA 11.3+).
CUresult cuStreamGetCaptureInfo_v2(void *stream, int *status, unsigned long long *id, void **graph,
				   const uintptr_t **deps, size_t *ndeps) {
	CUresult r = capture_info(stream, status, id);
	if (r != 0 || !(graph || deps || ndeps))
		return r;
	graph_queries++;
	if (!graph || !deps || !ndeps)
		return 1;
	*graph = *status ? (void *)0x6a : NULL;
	*deps = *status ? terminals : NULL;
	*ndeps = *status ? nterminals : 0;
	return 0;
}

// cuGraphNodeGetDependencies, v1 ABI. Node v depends on v%8 nodes,
// v*16+1 ... v*16+v%8.
CUresult cuGraphNodeGetDependencies(uintptr_t node, uintptr_t *deps, size_t *n) {
	size_t k = node % 8;
	if (node == 0 || n == NULL)
		return 1;
	if (deps == NULL) {
		*n = k;
		return 0;
	}
	if (*n < k)
		return 1;
	for (size_t i = 0; i < k; i++)
		deps[i] = node * 16 + 1 + i;
	*n = k;
	return 0;
}
// v1 ABI (CUDA 10.1).
CUresult cuStreamGetCaptureInfo(void *stream, int *status, unsigned long long *id) {
	return capture_info(stream, status, id);
}
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, unsigned long long flags, int *status) {
	last_proc_version = version;
	*pfn = NULL;
	if (env_int("FAKECUDA_NO_PROC_ADDRESS") || flags != 0) {
		if (status)
			*status = 1; // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
		return 500;
	}
	if (strcmp(sym, "cuStreamGetCaptureInfo") == 0 && version >= 11030) {
		*pfn = (void *)cuStreamGetCaptureInfo_v2;
		if (status)
			*status = 0;
		return 0;
	}
	if (strcmp(sym, "cuGraphNodeGetDependencies") == 0) {
		*pfn = (void *)cuGraphNodeGetDependencies;
		if (status)
			*status = 0;
		return 0;
	}
	if (status)
		*status = 1;
	return 500;
}
CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
	if (*mode < 0 || *mode > 2)
		return 1;
	int old = capture_mode;
	capture_mode = *mode;
	*mode = old;
	return 0;
}

// Virtual memory management. The fake checks the struct layouts cuda/driver
// writes (CUmemAllocationProp, CUmemAccessDesc), that the named device's
// context is current, and keeps counts for the probes. Address ranges come
// from VBASE(d); FAKECUDA_NO_VMM=1 makes devices report no VMM support.
#define GRAN (2ULL << 20)
#define VBASE(d) (0x7e0000000000ULL + ((unsigned long long)(d) << 36))

typedef struct { int type, id; } fake_location;
typedef struct {
	int type, requestedHandleTypes;
	fake_location location;
	void *win32HandleMetaData;
	unsigned char compressionType, gpuDirectRDMACapable;
	unsigned short usage;
	unsigned char reserved[4];
} fake_prop; // CUmemAllocationProp, 32 bytes
typedef struct { fake_location location; int flags; } fake_access; // CUmemAccessDesc

static long fd_exports, fabric_exports, imports;
static long live_handles, live_reservations, set_access_calls, last_access_count;
static long long mapped_bytes;
static unsigned long long next_handle, next_vaddr[NDEV];

// requestedHandleTypes may name POSIX file descriptors (1) and fabric
// handles (8).
static int good_prop(const fake_prop *p) {
	static const unsigned char zero[4];
	return sizeof(fake_prop) == 32 && p->type == 1 && (p->requestedHandleTypes & ~9) == 0 &&
	       p->location.type == 1 && p->location.id >= 0 && p->location.id < NDEV &&
	       p->win32HandleMetaData == NULL && p->compressionType == 0 && p->gpuDirectRDMACapable == 0 &&
	       p->usage == 0 && memcmp(p->reserved, zero, 4) == 0;
}

// Attributes: VMM (102), POSIX file descriptor handles (103), fabric
// handles (128). FAKECUDA_NO_FABRIC=1: no fabric support (cuMemCreate
// refuses it with CUDA_ERROR_NOT_PERMITTED, as without an IMEX channel);
// FAKECUDA_FABRIC_EXPORT_FAILS=1: the attribute and cuMemCreate accept
// fabric handles but the export fails, which drivers have been seen to do.
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
	if (dev < 0 || dev >= NDEV)
		return 101;
	switch (attr) {
	case 102: // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
		*v = !env_int("FAKECUDA_NO_VMM");
		return 0;
	case 103: // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
		*v = 1;
		return 0;
	case 128: // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
		*v = !env_int("FAKECUDA_NO_FABRIC");
		return 0;
	}
	return 1;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const fake_prop *p, int option) {
	if (!good_prop(p) || (option != 0 && option != 1))
		return 1;
	*g = GRAN;
	return 0;
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (size == 0 || size % GRAN || align % GRAN || addr || flags)
		return 1;
	*p = VBASE(d) + __atomic_fetch_add(&next_vaddr[d], size, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(&live_reservations, 1, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
	if (p == 0 || size % GRAN)
		return 1;
	__atomic_sub_fetch(&live_reservations, 1, __ATOMIC_SEQ_CST);
	return 0;
}
// Each handle, by number: whether it is live, the handle kinds it was
// created with, and the physical allocation it names (an import names the
// exporter's allocation: its own number; a new allocation takes the
// handle's number). Allocations are never freed here.
#define MAXHANDLE 8192
static pthread_mutex_t handle_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { int live, kinds; unsigned long long alloc, size; } handles[MAXHANDLE];

static unsigned long long new_handle(int kinds, unsigned long long alloc, unsigned long long size) {
	unsigned long long h = __atomic_add_fetch(&next_handle, 1, __ATOMIC_SEQ_CST);
	if (h >= MAXHANDLE)
		return 0;
	pthread_mutex_lock(&handle_mu);
	handles[h].live = 1;
	handles[h].kinds = kinds;
	handles[h].alloc = alloc ? alloc : h;
	handles[h].size = size;
	pthread_mutex_unlock(&handle_mu);
	__atomic_add_fetch(&live_handles, 1, __ATOMIC_SEQ_CST);
	return h;
}

CUresult cuMemCreate(unsigned long long *h, size_t size, const fake_prop *p, unsigned long long flags) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (!good_prop(p) || p->location.id != d || size == 0 || size % GRAN || flags)
		return 1;
	if ((p->requestedHandleTypes & 8) && env_int("FAKECUDA_NO_FABRIC"))
		return 800; // CUDA_ERROR_NOT_PERMITTED
	if (capturing_stream != 0 && capture_mode != 2)
		return 900;
	*h = new_handle(p->requestedHandleTypes, 0, size);
	return *h ? 0 : 2;
}
CUresult cuMemRelease(unsigned long long h) {
	CUresult r = 1;
	pthread_mutex_lock(&handle_mu);
	if (h > 0 && h < MAXHANDLE && handles[h].live) {
		handles[h].live = 0;
		r = 0;
	}
	pthread_mutex_unlock(&handle_mu);
	if (r == 0)
		__atomic_sub_fetch(&live_handles, 1, __ATOMIC_SEQ_CST);
	return r;
}

// Sharing (absent, like CUDA IPC, when built with -DFAKECUDA_NO_IPC). A
// POSIX export is a real descriptor (a memfd, so that one
// duplicated with pidfd_getfd still names the allocation: the two share an
// inode), remembered by inode. A fabric export is "FAKEFAB" (8 bytes with
// its NUL), the allocation's number (uint64), then zeros.
#ifndef FAKECUDA_NO_IPC
#define MAXEXPORT 1024
static struct { ino_t ino; unsigned long long alloc; } exports[MAXEXPORT];
static int nexports;

// live_alloc reports whether a live handle names allocation a; handle_mu
// is held.
static int live_alloc(unsigned long long a, unsigned long long *size) {
	for (unsigned long long i = 1; i < MAXHANDLE && i <= next_handle; i++)
		if (handles[i].live && handles[i].alloc == a) {
			*size = handles[i].size;
			return 1;
		}
	return 0;
}

CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type, unsigned long long flags) {
	if (cur_dev() < 0)
		return 201;
	if (flags || (type != 1 && type != 8))
		return 1;
	pthread_mutex_lock(&handle_mu);
	int ok = h > 0 && h < MAXHANDLE && handles[h].live && (handles[h].kinds & type);
	unsigned long long a = ok ? handles[h].alloc : 0;
	pthread_mutex_unlock(&handle_mu);
	if (!ok)
		return 1;
	if (type == 8) {
		if (env_int("FAKECUDA_FABRIC_EXPORT_FAILS"))
			return 1;
		unsigned char *f = out;
		memset(f, 0, 64);
		memcpy(f, "FAKEFAB", 8);
		memcpy(f + 8, &a, 8);
		__atomic_add_fetch(&fabric_exports, 1, __ATOMIC_SEQ_CST);
		return 0;
	}
	int fd = memfd_create("fakecuda-export", MFD_CLOEXEC);
	struct stat st;
	if (fd < 0 || fstat(fd, &st) != 0)
		return 999;
	pthread_mutex_lock(&handle_mu);
	if (nexports < MAXEXPORT) {
		exports[nexports].ino = st.st_ino;
		exports[nexports].alloc = a;
		nexports++;
	} else {
		close(fd);
		fd = -1;
	}
	pthread_mutex_unlock(&handle_mu);
	if (fd < 0)
		return 2;
	*(int *)out = fd;
	__atomic_add_fetch(&fd_exports, 1, __ATOMIC_SEQ_CST);
	return 0;
}

CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os, int type) {
	static const unsigned char zero[48];
	if (cur_dev() < 0)
		return 201;
	unsigned long long a = 0, size = 0;
	if (type == 1) {
		struct stat st;
		if (fstat((int)(intptr_t)os, &st) != 0)
			return 1;
		pthread_mutex_lock(&handle_mu);
		for (int i = 0; i < nexports; i++)
			if (exports[i].ino == st.st_ino)
				a = exports[i].alloc;
		pthread_mutex_unlock(&handle_mu);
	} else if (type == 8) {
		const unsigned char *f = os;
		if (memcmp(f, "FAKEFAB", 8) != 0 || memcmp(f + 16, zero, 48) != 0)
			return 1;
		memcpy(&a, f + 8, 8);
	} else {
		return 1;
	}
	pthread_mutex_lock(&handle_mu);
	int ok = a != 0 && live_alloc(a, &size);
	pthread_mutex_unlock(&handle_mu);
	if (!ok)
		return 1; // not an export of a live allocation
	*h = new_handle(0, a, size);
	if (*h == 0)
		return 2;
	__atomic_add_fetch(&imports, 1, __ATOMIC_SEQ_CST);
	return 0;
}
#endif

long fake_fd_exports(void) { return fd_exports; }
long fake_fabric_exports(void) { return fabric_exports; }
long fake_imports(void) { return imports; }
// The allocation handle h names (0 if h is not live) and its kinds.
unsigned long long fake_handle_alloc(unsigned long long h) {
	unsigned long long a = 0;
	pthread_mutex_lock(&handle_mu);
	if (h > 0 && h < MAXHANDLE && handles[h].live)
		a = handles[h].alloc;
	pthread_mutex_unlock(&handle_mu);
	return a;
}
int fake_handle_kinds(unsigned long long h) { return h < MAXHANDLE ? handles[h].kinds : -1; }
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, unsigned long long h, unsigned long long flags) {
	if (p % GRAN || size == 0 || size % GRAN || offset || flags || h == 0 || h >= MAXHANDLE || !handles[h].live)
		return 1;
	__atomic_add_fetch(&mapped_bytes, (long long)size, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
	if (p % GRAN || size == 0 || size % GRAN)
		return 1;
	__atomic_sub_fetch(&mapped_bytes, (long long)size, __ATOMIC_SEQ_CST);
	return 0;
}
// Peers: every device can access every other (FAKECUDA_NO_PEERS=1: none).
CUresult cuDeviceCanAccessPeer(int *can, int dev, int peer) {
	if (dev < 0 || dev >= NDEV || peer < 0 || peer >= NDEV)
		return 101;
	*can = dev != peer && !env_int("FAKECUDA_NO_PEERS");
	return 0;
}
// The first descriptor is the current device's; the others its peers'.
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const fake_access *desc, size_t count) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (sizeof(fake_access) != 12 || p % GRAN || size % GRAN || count < 1 || count > NDEV ||
	    desc[0].location.id != d)
		return 1;
	for (size_t i = 0; i < count; i++)
		if (desc[i].location.type != 1 || desc[i].location.id < 0 || desc[i].location.id >= NDEV ||
		    desc[i].flags != 3 || (i > 0 && desc[i].location.id == d))
			return 1;
	last_access_count = (long)count;
	__atomic_add_fetch(&set_access_calls, 1, __ATOMIC_SEQ_CST);
	return 0;
}

// CUDA IPC. A handle is "FAKEIPC" (8 bytes with its NUL), the allocation's
// device (int32), 4 zero bytes, its base, size and serial (uint64 each,
// little-endian on the test machines) and 24 zero bytes, so that the tests
// can check what cuIpcGetMemHandle named and that cuIpcOpenMemHandle
// received the 64 bytes intact. As in the driver, any address inside an
// allocation names the whole allocation, an opened handle is reference
// counted per context (opening it again returns the same address) and
// closing needs the opening context and the mapping's exact address. Unlike
// the driver, a process may open its own handles (the driver says
// CUDA_ERROR_INVALID_CONTEXT): the fake plays both processes. Mappings come
// from IBASE(d). Built with -DFAKECUDA_NO_IPC the library has no IPC entry
// points (nor the sharing ones above); with -DFAKECUDA_IPC_V1 it lacks cuIpcOpenMemHandle_v2.
#define IBASE(d) (0x7d0000000000ULL + ((unsigned long long)(d) << 36))

typedef struct {
	char magic[8];
	int dev, pad;
	unsigned long long base, size, serial;
	unsigned char zero[24];
} fake_ipc_handle; // CUipcMemHandle
_Static_assert(sizeof(fake_ipc_handle) == 64, "CUipcMemHandle is 64 bytes");

#define MAXMAP 256
static struct { int dev, refs; CUdeviceptr addr; unsigned long long serial; } maps[MAXMAP];
static long ipc_opens, ipc_v1_opens;

#ifndef FAKECUDA_NO_IPC
static unsigned long long next_iaddr[NDEV];

CUresult cuIpcGetMemHandle(fake_ipc_handle *h, CUdeviceptr p) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	CUresult r = 1; // not inside a live cuMemAlloc allocation of this device
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXALLOC; i++)
		if (allocs[i].base && p >= allocs[i].base && p < allocs[i].base + allocs[i].size &&
		    allocs[i].base >= MEMBASE(d) && allocs[i].base < MEMBASE(d) + (1ULL << 32)) {
			memset(h, 0, sizeof *h);
			memcpy(h->magic, "FAKEIPC", 8);
			h->dev = d;
			h->base = allocs[i].base;
			h->size = allocs[i].size;
			h->serial = allocs[i].serial;
			r = 0;
			break;
		}
	pthread_mutex_unlock(&alloc_mu);
	return r;
}

static CUresult ipc_open(CUdeviceptr *p, fake_ipc_handle h, unsigned int flags) {
	static const unsigned char zero[24];
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (flags != 1) // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, required by _v2
		return 1;
	if (memcmp(h.magic, "FAKEIPC", 8) != 0 || h.pad != 0 || memcmp(h.zero, zero, sizeof zero) != 0)
		return 1;
	CUresult r = 1; // no live allocation has this serial: stale or forged
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXALLOC; i++)
		if (allocs[i].base && allocs[i].serial == h.serial && allocs[i].base == h.base) {
			r = 0;
			break;
		}
	if (r == 0) {
		int free_slot = -1, found = -1;
		for (int i = 0; i < MAXMAP; i++) {
			if (maps[i].refs && maps[i].dev == d && maps[i].serial == h.serial)
				found = i;
			if (!maps[i].refs && free_slot < 0)
				free_slot = i;
		}
		if (found >= 0) {
			maps[found].refs++;
			*p = maps[found].addr;
		} else if (free_slot < 0) {
			r = 2;
		} else {
			maps[free_slot].dev = d;
			maps[free_slot].refs = 1;
			maps[free_slot].serial = h.serial;
			maps[free_slot].addr = IBASE(d) + next_iaddr[d];
			next_iaddr[d] += (h.size + GRAN - 1) / GRAN * GRAN;
			*p = maps[free_slot].addr;
		}
		if (r == 0)
			ipc_opens++;
	}
	pthread_mutex_unlock(&alloc_mu);
	return r;
}

#ifndef FAKECUDA_IPC_V1
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, fake_ipc_handle h, unsigned int flags) {
	return ipc_open(p, h, flags);
}
#endif
CUresult cuIpcOpenMemHandle(CUdeviceptr *p, fake_ipc_handle h, unsigned int flags) {
	CUresult r = ipc_open(p, h, flags);
	if (r == 0)
		__atomic_add_fetch(&ipc_v1_opens, 1, __ATOMIC_SEQ_CST);
	return r;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	CUresult r = 1; // not a mapping of this context
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXMAP; i++)
		if (maps[i].refs && maps[i].dev == d && maps[i].addr == p) {
			maps[i].refs--;
			r = 0;
			break;
		}
	pthread_mutex_unlock(&alloc_mu);
	return r;
}
#endif

// The IPC mappings open (references counted once) and the successful opens
// (all, and through the original cuIpcOpenMemHandle).
long fake_ipc_mappings(void) {
	long n = 0;
	pthread_mutex_lock(&alloc_mu);
	for (int i = 0; i < MAXMAP; i++)
		n += maps[i].refs > 0;
	pthread_mutex_unlock(&alloc_mu);
	return n;
}
long fake_ipc_opens(void) { return ipc_opens; }
long fake_ipc_v1_opens(void) { return ipc_v1_opens; }

// Probes for the tests.
long fake_live_handles(void) { return live_handles; }
long fake_live_reservations(void) { return live_reservations; }
long long fake_mapped_bytes(void) { return mapped_bytes; }
long fake_set_access_calls(void) { return set_access_calls; }
long fake_last_access_count(void) { return last_access_count; }
long fake_pushes(void) { return __atomic_load_n(&pushes, __ATOMIC_SEQ_CST); }
long fake_retains(int dev) { return retains[dev]; }
long fake_live_allocs(void) { return live_allocs; }
long fake_live_events(void) { return live_events; }
int fake_depth(void) { return depth; }
int fake_capture_mode(void) { return capture_mode; }
int fake_last_proc_version(void) { return last_proc_version; }
void fake_set_capture(uintptr_t stream, unsigned long long id) { capturing_stream = stream; capture_id = id; }
void fake_set_terminals(const uintptr_t *t, size_t n) {
	nterminals = n < 64 ? n : 64;
	memcpy(terminals, t, nterminals * sizeof *t);
}
long fake_graph_queries(void) { return graph_queries; }

// Pinned host memory, streams and asynchronous copies (cuda/driver/copy.go).
// Host memory is real (malloc), tracked so that a copy to or from memory
// that is not a live pinned allocation fails. Device memory has no bytes:
// a copy to the host writes fake_device_byte(address) for each device
// address, so that a test can check which bytes arrived where, and a copy
// to the device adds its bytes to a checksum. A stream belongs to the device
// whose context created it; copies and synchronisation must run in that
// context. Built with -DFAKECUDA_NO_COPY the library lacks cuMemcpyHtoDAsync_v2.
#define MAXHOST 256
static pthread_mutex_t host_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { unsigned char *p; size_t size; int dev; } hosts[MAXHOST];
static long live_host, live_streams, stream_syncs, dtoh_copies, htod_copies;
static unsigned long long htod_sum, copied_bytes;

struct fake_stream { int dev; };

unsigned char fake_device_byte(unsigned long long addr) { return (unsigned char)(addr ^ (addr >> 9) ^ 0x5a); }

// Whether [p, p+n) lies inside one live pinned allocation.
static int pinned(const void *p, size_t n) {
	int ok = 0;
	const unsigned char *q = p;
	pthread_mutex_lock(&host_mu);
	for (int i = 0; i < MAXHOST; i++)
		if (hosts[i].p && q >= hosts[i].p && n <= hosts[i].size && q - hosts[i].p <= (long)(hosts[i].size - n)) {
			ok = 1;
			break;
		}
	pthread_mutex_unlock(&host_mu);
	return ok;
}

CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (size == 0 || flags != 1) // cuda/driver asks for CU_MEMHOSTALLOC_PORTABLE
		return 1;
	if (size > ((size_t)1 << 30))
		return 2;
	unsigned char *p = malloc(size);
	if (!p)
		return 2;
	CUresult r = 2;
	pthread_mutex_lock(&host_mu);
	for (int i = 0; i < MAXHOST; i++)
		if (!hosts[i].p) {
			hosts[i].p = p;
			hosts[i].size = size;
			hosts[i].dev = d;
			live_host++;
			r = 0;
			break;
		}
	pthread_mutex_unlock(&host_mu);
	if (r)
		free(p);
	else
		*pp = p;
	return r;
}
CUresult cuMemFreeHost(void *p) {
	if (cur_dev() < 0)
		return 201;
	CUresult r = 1;
	pthread_mutex_lock(&host_mu);
	for (int i = 0; i < MAXHOST; i++)
		if (p && hosts[i].p == p) {
			free(hosts[i].p);
			hosts[i].p = NULL;
			live_host--;
			r = 0;
			break;
		}
	pthread_mutex_unlock(&host_mu);
	return r;
}
CUresult cuStreamCreate(struct fake_stream **s, unsigned int flags) {
	int d = cur_dev();
	if (d < 0)
		return 201;
	if (flags != 1) // CU_STREAM_NON_BLOCKING
		return 1;
	*s = calloc(1, sizeof **s);
	(*s)->dev = d;
	__atomic_add_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuStreamDestroy_v2(struct fake_stream *s) {
	if (s == NULL || cur_dev() != s->dev)
		return 201;
	free(s);
	__atomic_sub_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuStreamSynchronize(struct fake_stream *s) {
	if (s == NULL || cur_dev() != s->dev)
		return 201;
	__atomic_add_fetch(&stream_syncs, 1, __ATOMIC_SEQ_CST);
	return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, struct fake_stream *s) {
	if (s == NULL || cur_dev() != s->dev)
		return 201;
	if (n == 0 || !pinned(dst, n))
		return 1;
	for (size_t i = 0; i < n; i++)
		((unsigned char *)dst)[i] = fake_device_byte(src + i);
	__atomic_add_fetch(&dtoh_copies, 1, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(&copied_bytes, n, __ATOMIC_SEQ_CST);
	return 0;
}
#ifndef FAKECUDA_NO_COPY
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, struct fake_stream *s) {
	(void)dst;
	if (s == NULL || cur_dev() != s->dev)
		return 201;
	if (n == 0 || !pinned(src, n))
		return 1;
	unsigned long long sum = 0;
	for (size_t i = 0; i < n; i++)
		sum += ((const unsigned char *)src)[i];
	__atomic_add_fetch(&htod_sum, sum, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(&htod_copies, 1, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(&copied_bytes, n, __ATOMIC_SEQ_CST);
	return 0;
}
#endif

long fake_live_host(void) { return live_host; }
long fake_live_streams(void) { return live_streams; }
long fake_stream_syncs(void) { return stream_syncs; }
long fake_dtoh_copies(void) { return dtoh_copies; }
long fake_htod_copies(void) { return htod_copies; }
unsigned long long fake_htod_sum(void) { return htod_sum; }
unsigned long long fake_copied_bytes(void) { return copied_bytes; }
