// SPDX-License-Identifier: Apache-2.0
/*
 * cudapool.c - the public C entry points of libcudapool.so.
 *
 * Each function checks, before anything else, that it may run
 * (cp_refused): not in a child made by fork() (the Go runtime does not
 * survive fork: its other threads are gone and the first allocation can
 * hang), and not inside a stream filter or a segment source, which run with
 * a device lock held that the call would wait for forever. Refused, an
 * entry point returns at once, records an error and never enters Go.
 * Otherwise it converts its arguments and calls the Go export cpgo_<name>
 * (exports.go). Mallocs and frees meet the front cache first (front.c,
 * FRONT.md): every malloc is cp_malloc (capi.h), every free passes
 * cp_front_free.
 *
 * The last error is thread-local storage here, in C, so that reading it
 * (cudapool_last_error) costs no Go call and works in a forked child; Go
 * writes it through cp_set_error on the calling thread.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "capi.h"
#include "cudapool.h"
#include "cudapool_testing.h"

/* ---- thread-local last error ----
 *
 * Only a pointer is thread-local: the Go runtime makes the library use the
 * static TLS model, whose space is small and shared by every library loaded
 * with dlopen. The buffer is allocated on a thread's first failure and freed
 * when the thread exits. */

#define CP_ERROR_MAX 4096

static __thread char *cp_error;
static pthread_key_t cp_error_key;
static pthread_once_t cp_error_once = PTHREAD_ONCE_INIT;
static const char cp_error_nomem[] = "cudapool: out of host memory while recording an error";

static void cp_error_free(void *buf) {
	if (cp_error == buf)
		cp_error = NULL;
	free(buf);
}

static void cp_error_key_init(void) { pthread_key_create(&cp_error_key, cp_error_free); }

void cp_set_error(const char *msg, size_t len) {
	char *buf = cp_error;
	if (buf == NULL || buf == cp_error_nomem) {
		buf = malloc(CP_ERROR_MAX);
		if (buf == NULL) {
			cp_error = (char *)cp_error_nomem;
			return;
		}
		pthread_once(&cp_error_once, cp_error_key_init);
		pthread_setspecific(cp_error_key, buf); /* frees it at thread exit */
		cp_error = buf;
	}
	if (msg == NULL)
		len = 0;
	if (len >= CP_ERROR_MAX)
		len = CP_ERROR_MAX - 1; /* truncated: messages are far shorter */
	if (len > 0)
		memcpy(buf, msg, len);
	buf[len] = 0;
}

const char *cudapool_last_error(void) { return (cp_error != NULL && cp_error[0] != 0) ? cp_error : NULL; }

void cudapool_clear_error(void) {
	if (cp_error != NULL && cp_error != cp_error_nomem)
		cp_error[0] = 0;
	else if (cp_error == cp_error_nomem)
		cp_error = NULL;
}

/* ---- fork ---- */

volatile int cp_forked; /* set in a forked child (a sig_atomic_t on Linux) */

static void cp_atfork_child(void) { cp_forked = 1; }

__attribute__((constructor)) static void cp_register_atfork(void) {
	pthread_atfork(NULL, NULL, cp_atfork_child);
}

#define CP_FORK_MSG "cudapool: called in a forked child; CUDA memory cannot be used after fork"

int cp_forked_child(void) {
	if (__builtin_expect(cp_forked, 0)) {
		cp_set_error(CP_FORK_MSG, sizeof CP_FORK_MSG - 1);
		return 1;
	}
	return 0;
}

/* ---- calls from inside callbacks ----
 *
 * A stream filter and a segment source run with the device's lock held (Go
 * calls them while it routes or grows a pool, as PyTorch calls its filters
 * under its allocator's mutex). cp_in_callback counts the callbacks under
 * way on the thread (cp_callback_enter), and every entry point that could
 * reach that lock refuses while it is set. */
__thread int cp_in_callback __attribute__((tls_model("initial-exec")));

int cp_refuse(const char *fn) {
	if (cp_forked_child())
		return 1;
	char msg[256];
	int n = snprintf(msg, sizeof msg,
	                 "%s: called from inside a stream filter or segment source; those run with the allocator's lock "
	                 "held, and must not call cudapool",
	                 fn);
	cp_set_error(msg, n < 0 ? 0 : (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
	return 1;
}

/* ---- tags ----
 *
 * Each thread's stack of tags (cudapool_tag_push): cp_tag_cur is its top,
 * which every malloc reads (cp_malloc); the stack below it is allocated at
 * a thread's first push and freed when the thread exits, so that the
 * static TLS holds one word and one pointer. Ids come from Go
 * (cpgo_tag_id), on this cold path only. */
#define CP_TAG_DEPTH 1024

__thread uint32_t cp_tag_cur __attribute__((tls_model("initial-exec")));

struct cp_tag_stack {
	uint32_t n, cap;
	uint32_t ids[];
};
static __thread struct cp_tag_stack *cp_tags;
static pthread_key_t cp_tags_key;
static pthread_once_t cp_tags_once = PTHREAD_ONCE_INIT;

static void cp_tags_free(void *st) {
	if (cp_tags == st) {
		cp_tags = NULL;
		cp_tag_cur = 0;
	}
	free(st);
}

static void cp_tags_key_init(void) { pthread_key_create(&cp_tags_key, cp_tags_free); }

static void cp_tag_error(const char *msg) { cp_set_error(msg, strlen(msg)); }

int cudapool_tag_push(const char *tag) {
	if (cp_refused("cudapool_tag_push"))
		return -1;
	if (tag == NULL) {
		cp_tag_error("cudapool_tag_push: the tag is NULL");
		return -1;
	}
	struct cp_tag_stack *st = cp_tags;
	if (st != NULL && st->n >= CP_TAG_DEPTH) {
		cp_tag_error("cudapool_tag_push: 1024 tags are pushed on this thread already (pop one first)");
		return -1;
	}
	uint32_t id = cpgo_tag_id((char *)tag);
	if (id == 0)
		return -1; /* Go said why */
	if (st == NULL || st->n == st->cap) {
		uint32_t cap = st == NULL ? 8 : 2 * st->cap;
		struct cp_tag_stack *grown = realloc(st, sizeof *st + cap * sizeof st->ids[0]);
		if (grown == NULL) {
			cp_tag_error("cudapool_tag_push: out of host memory");
			return -1;
		}
		if (st == NULL) {
			grown->n = 0;
			pthread_once(&cp_tags_once, cp_tags_key_init);
		}
		grown->cap = cap;
		pthread_setspecific(cp_tags_key, grown); /* frees it at thread exit */
		cp_tags = st = grown;
	}
	st->ids[st->n++] = id;
	cp_tag_cur = id;
	return 0;
}

int cudapool_tag_pop(void) {
	if (cp_refused("cudapool_tag_pop"))
		return -1;
	struct cp_tag_stack *st = cp_tags;
	if (st == NULL || st->n == 0) {
		cp_tag_error("cudapool_tag_pop: no tag is pushed on this thread");
		return -1;
	}
	st->n--;
	cp_tag_cur = st->n > 0 ? st->ids[st->n - 1] : 0;
	return 0;
}

/* ---- PyTorch's frees, queued ----
 *
 * A call from C into Go costs a few hundred nanoseconds when it comes from
 * a Python thread (the interpreter evicts the callback's working set between
 * calls), which made a torch.empty+free pair pay for two of them. PyTorch's
 * free hook returns nothing and PyTorch ignores failures, so
 * cudapool_torch_free only queues the free here; the next call into the
 * library on any thread hands the queue to Go first (cudapool_torch_malloc
 * passes it along with the malloc, which performs those frees under the same
 * device lock). Every other entry point drains the queue before it does
 * anything, so statistics, snapshots and empty_cache reflect every free
 * queued before the call (except a batch another thread has just taken and
 * is still performing). A queued free of a block other streams use records its events when
 * it is drained, a little later than at the free itself: that only delays
 * the block's reuse. The plain C cudapool_free is not queued: its errors
 * reach its caller. */
static cp_pending_free cp_freeq[CP_FREEQ_CAP];
volatile int cp_freeq_n;
volatile unsigned cp_freeq_from; /* under cp_freeq_lock */
static atomic_int cp_freeq_lock;

static void freeq_lock(void) { cp_spin_lock(&cp_freeq_lock); }
static void freeq_unlock(void) { cp_spin_unlock(&cp_freeq_lock); }

size_t cp_take_frees(cp_pending_free *out, size_t cap) {
	freeq_lock();
	size_t n = (size_t)cp_freeq_n;
	if (n > cap)
		n = cap;
	/* Usually one free (the class path's previous tensor): copied here,
	 * without calls to libc (through the PLT); the rest moves up only if
	 * the caller took less than the whole queue. */
	if (n == 1)
		out[0] = cp_freeq[0];
	else
		memcpy(out, cp_freeq, n * sizeof *out);
	if ((size_t)cp_freeq_n > n)
		memmove(cp_freeq, cp_freeq + n, ((size_t)cp_freeq_n - n) * sizeof *out);
	cp_freeq_n -= (int)n;
	freeq_unlock();
	return n;
}

/* The deferred frees' body, after the entry point's cp_refused; fn
 * (CP_FN_*) names the public function called, for errors. */
static inline void cp_free_deferred(void *ptr, size_t size, int device, unsigned long long context, int fn) {
	if (ptr == NULL)
		return;
	cp_pending_free f = {.ptr = (uintptr_t)ptr, .size = size, .device = device, .ctx = context};
	/* A free with a context goes to Go, which records it. */
	int r = cp_front_free((uintptr_t)ptr, size, device, CP_FREE_ANY_DEV | (context != 0 ? CP_FREE_NOW : 0));
	if (r == 1)
		return;
	if (r == CP_FRONT_TWICE) {
		/* Queued, it would be performed after a malloc had handed the
		 * block out again: Go reports it now instead. */
		cpgo_free_batch(&f, 1, fn);
		return;
	}
	freeq_lock();
	if (!(cp_freeq_from & (1u << fn)))
		cp_freeq_from |= 1u << fn; /* written once per function, not per free */
	if (cp_freeq_n < CP_FREEQ_CAP) {
		cp_freeq[cp_freeq_n++] = f;
		freeq_unlock();
		return;
	}
	/* Full: hand the queue and this free to Go now. */
	cp_pending_free batch[CP_FREEQ_CAP + 1];
	memcpy(batch, cp_freeq, sizeof cp_freeq);
	batch[CP_FREEQ_CAP] = f;
	cp_freeq_n = 0;
	freeq_unlock();
	cpgo_free_batch(batch, CP_FREEQ_CAP + 1, fn);
}

void cudapool_free_deferred(void *ptr, size_t size, int device, unsigned long long context) {
	if (cp_refused("cudapool_free_deferred"))
		return;
	cp_free_deferred(ptr, size, device, context, CP_FN_FREE_DEFERRED);
}

void cudapool_torch_free(void *ptr, size_t size, int device, cudapool_stream stream) {
	(void)stream;
	if (cp_refused("cudapool_torch_free"))
		return;
	cp_free_deferred(ptr, size, device, 0, CP_FN_TORCH_FREE);
}

/* ---- stream filters ---- */

int cp_call_c_filter(uintptr_t filter, uintptr_t ctx, uintptr_t stream) {
	cp_callback_enter();
	int yes = ((cudapool_stream_filter)filter)((void *)ctx, (cudapool_stream)stream) != 0;
	cp_callback_leave();
	return yes;
}

/* ---- version ----
 *
 * Asked of Go once, then kept here, so that a forked child can still read
 * it if the parent asked first. */
static char cp_version[32];
static int cp_abi = -1;
static atomic_int cp_version_ready;
static pthread_once_t cp_version_once = PTHREAD_ONCE_INIT;

static void cp_version_init(void) {
	int major = 0, minor = 0, patch = 0;
	cp_abi = cpgo_version(&major, &minor, &patch);
	snprintf(cp_version, sizeof cp_version, "%d.%d.%d", major, minor, patch);
	atomic_store(&cp_version_ready, 1);
}

const char *cudapool_version(void) {
	if (!atomic_load(&cp_version_ready)) {
		if (cp_forked_child())
			return NULL;
		pthread_once(&cp_version_once, cp_version_init);
	}
	return cp_version;
}

int cudapool_abi_version(void) { return cudapool_version() != NULL ? cp_abi : -1; }

/* ---- the API ---- */

/* Entry points that only convert and forward. */
#define CP_FORWARD(ret, fail, name, params, args) \
	ret name params {                          \
		if (cp_refused(#name))             \
			return fail;               \
		return cpgo_##args;                \
	}
#define CP_FORWARD_VOID(name, params, args) \
	void name params {                   \
		if (cp_refused(#name))       \
			return;              \
		cpgo_##args;                 \
	}

/* The malloc of every entry point past the front (cp_malloc): the queued
 * frees go along, and Go's answer goes to the front. fn (CP_FN_*) names
 * the public function called. */
void *cp_malloc_go(size_t size, int device, uintptr_t stream, unsigned long long ctx, int fn) {
	cp_pending_free frees[CP_FREEQ_CAP];
	size_t n = cp_freeq_n != 0 ? cp_take_frees(frees, CP_FREEQ_CAP) : 0;
	cp_track t = {0, 0, 0};
	uintptr_t r = cpgo_malloc_ctx(size, device, stream, ctx, frees, n, &t, fn, cp_tag_cur);
	cp_front_track(r, size, stream, device, t);
	return (void *)r;
}

void *cudapool_malloc(size_t size, int device, cudapool_stream stream) {
	if (cp_refused("cudapool_malloc"))
		return NULL;
	return cp_malloc(size, device, (uintptr_t)stream, 0, CP_FN_MALLOC);
}

void cudapool_free(void *ptr, size_t size, int device, cudapool_stream stream) {
	if (cp_refused("cudapool_free") || ptr == NULL)
		return;
	if (cp_front_free((uintptr_t)ptr, size, device, 0) == 1)
		return;
	cpgo_free((uintptr_t)ptr, size, device, (uintptr_t)stream);
}

void cudapool_init(int device_count) {
	if (cp_refused("cudapool_init"))
		return;
	cpgo_init(device_count);
}

void cudapool_empty_cache(void) {
	if (cp_refused("cudapool_empty_cache"))
		return;
	cpgo_empty_cache();
}

void cudapool_set_memory_fraction(double fraction, int device) {
	if (cp_refused("cudapool_set_memory_fraction"))
		return;
	cpgo_set_memory_fraction(fraction, device);
}

void *cudapool_base_allocation(void *ptr, size_t *size) {
	if (cp_refused("cudapool_base_allocation"))
		return NULL;
	return (void *)cpgo_base_allocation((uintptr_t)ptr, size);
}

void cudapool_record_stream(void *ptr, cudapool_stream stream) {
	if (cp_refused("cudapool_record_stream"))
		return;
	cpgo_record_stream((uintptr_t)ptr, (uintptr_t)stream);
}

void cudapool_begin_allocate_to_pool(int device, unsigned long long pool_a, unsigned long long pool_b,
                                     cudapool_stream_filter filter, void *ctx) {
	if (cp_refused("cudapool_begin_allocate_to_pool"))
		return;
	cpgo_begin_allocate_to_pool(device, pool_a, pool_b, (uintptr_t)filter, (uintptr_t)ctx, cp_tag_cur);
}

void cudapool_end_allocate_to_pool(int device, unsigned long long pool_a, unsigned long long pool_b) {
	if (cp_refused("cudapool_end_allocate_to_pool"))
		return;
	cpgo_end_allocate_to_pool(device, pool_a, pool_b, CP_FN_END_ALLOCATE_TO_POOL);
}

void cudapool_release_pool(int device, unsigned long long pool_a, unsigned long long pool_b) {
	if (cp_refused("cudapool_release_pool"))
		return;
	cpgo_release_pool(device, pool_a, pool_b, CP_FN_RELEASE_POOL);
}

char *cudapool_memory_stats_json(int device) {
	if (cp_refused("cudapool_memory_stats_json"))
		return NULL;
	return cpgo_memory_stats_json(device);
}

char *cudapool_snapshot_json(void) {
	if (cp_refused("cudapool_snapshot_json"))
		return NULL;
	return cpgo_snapshot_json();
}

/* Pure C: safe in a forked child, and the strings come from malloc. */
void cudapool_string_free(char *s) { free(s); }

void cudapool_reset_peak_stats(int device) {
	if (cp_refused("cudapool_reset_peak_stats"))
		return;
	cpgo_reset_peak_stats(device);
}

void cudapool_reset_accumulated_stats(int device) {
	if (cp_refused("cudapool_reset_accumulated_stats"))
		return;
	cpgo_reset_accumulated_stats(device);
}

int cudapool_configure(const char *conf) {
	if (cp_refused("cudapool_configure"))
		return -1;
	return cpgo_configure((char *)conf);
}

int cudapool_sim_begin_capture(cudapool_stream s, int mode) {
	if (cp_refused("cudapool_sim_begin_capture"))
		return -1;
	return cpgo_sim_begin_capture((uintptr_t)s, mode);
}

int cudapool_sim_end_capture(cudapool_stream s) {
	if (cp_refused("cudapool_sim_end_capture"))
		return -1;
	return cpgo_sim_end_capture((uintptr_t)s);
}

void cudapool_sim_submit(cudapool_stream s) {
	if (cp_refused("cudapool_sim_submit"))
		return;
	cpgo_sim_submit((uintptr_t)s);
}

void cudapool_sim_complete_all(void) {
	if (cp_refused("cudapool_sim_complete_all"))
		return;
	cpgo_sim_complete_all();
}

void cudapool_sim_destroy_stream(cudapool_stream s) {
	if (cp_refused("cudapool_sim_destroy_stream"))
		return;
	cpgo_sim_destroy_stream((uintptr_t)s);
}

CP_FORWARD(int, -1, cudapool_sim_set_pidfd_errors, (int open_errno, int getfd_errno),
           sim_set_pidfd_errors(open_errno, getfd_errno))
CP_FORWARD(int, -1, cudapool_sim_write, (int device, void *ptr, const void *src, size_t n),
           sim_write(device, (uintptr_t)ptr, (void *)src, n))
CP_FORWARD(int, -1, cudapool_sim_read, (int device, const void *ptr, void *dst, size_t n),
           sim_read(device, (uintptr_t)ptr, dst, n))

long long cudapool_sim_violations(void) {
	if (cp_refused("cudapool_sim_violations"))
		return -1;
	return cpgo_sim_violations();
}

/* ---- PyTorch's CUDAAllocator interface (the C++ class in python/cudapool/csrc) ---- */

volatile unsigned cp_gather_mask;

unsigned cudapool_gather_mask(void) { return cp_gather_mask; }

int cudapool_get_front_counters(int device, cudapool_front_counters *out) {
	unsigned long long c[4];
	if (out == NULL || cp_front_counters(device, c) != 0)
		return -1;
	*out = (cudapool_front_counters){c[0], c[1], c[2], c[3]};
	return 0;
}

static __thread cudapool_oom_info cp_oom;
static __thread int cp_oom_set;

void cp_set_oom(int device, size_t size, size_t device_total, size_t device_free) {
	cp_oom = (cudapool_oom_info){device, size, device_total, device_free};
	cp_oom_set = device >= 0;
}

int cudapool_last_oom(cudapool_oom_info *out) {
	if (!cp_oom_set || out == NULL)
		return -1;
	*out = cp_oom;
	return 0;
}

void *cudapool_malloc_ctx(size_t size, int device, cudapool_stream stream, unsigned long long context) {
	if (cp_refused("cudapool_malloc_ctx"))
		return NULL;
	return cp_malloc(size, device, (uintptr_t)stream, context, CP_FN_MALLOC_CTX);
}

/* Frees at once: the front forgets the block and Go frees it. */
int cudapool_free_ctx(void *ptr, size_t size, int device, unsigned long long context) {
	if (cp_refused("cudapool_free_ctx"))
		return -1;
	(void)cp_front_free((uintptr_t)ptr, size, device, CP_FREE_ANY_DEV | CP_FREE_NOW);
	return cpgo_free_ctx((uintptr_t)ptr, size, device, context);
}

CP_FORWARD(int, -1, cudapool_ipc_handle, (void *ptr, unsigned char handle[64], size_t *offset, int *device),
           ipc_handle((uintptr_t)ptr, handle, offset, device))

CP_FORWARD_VOID(cudapool_expect_announced_captures, (void), expect_announced(CP_FN_EXPECT_ANNOUNCED_CAPTURES))
CP_FORWARD(int, -1, cudapool_configure_update, (const char *conf), configure_update((char *)conf))
CP_FORWARD(int, -1, cudapool_get_device_stats, (int device, cudapool_device_stats *out),
           get_device_stats(device, out))
CP_FORWARD(int, -1, cudapool_cache_info, (int device, size_t *largest), cache_info(device, largest))
CP_FORWARD(double, -1, cudapool_get_memory_fraction, (int device), get_memory_fraction(device))
CP_FORWARD(int, -1, cudapool_empty_cache_ctx, (unsigned long long context), empty_cache_ctx(context))
CP_FORWARD(int, -1, cudapool_pool_create_or_incref, (int device, unsigned long long a, unsigned long long b),
           pool_create_or_incref(device, a, b))
CP_FORWARD(int, -1, cudapool_pool_use_count, (int device, unsigned long long a, unsigned long long b),
           pool_use_count(device, a, b))
CP_FORWARD(int, -1, cudapool_pool_set_no_split, (int device, unsigned long long a, unsigned long long b),
           pool_set_no_split(device, a, b))
CP_FORWARD(int, -1, cudapool_pool_set_use_on_oom,
           (int device, unsigned long long a, unsigned long long b, int use), pool_set_use_on_oom(device, a, b, use))
CP_FORWARD(int, -1, cudapool_empty_pool, (int device, unsigned long long a, unsigned long long b),
           empty_pool(device, a, b))
CP_FORWARD(int, -1, cudapool_pool_set_source,
           (int device, unsigned long long a, unsigned long long b, cudapool_segment_alloc_fn alloc,
            cudapool_segment_free_fn free_fn, void *ctx),
           pool_set_source(device, a, b, (uintptr_t)alloc, (uintptr_t)free_fn, (uintptr_t)ctx))
CP_FORWARD(unsigned long long, 0, cudapool_checkpoint_pool, (int device, unsigned long long a, unsigned long long b),
           checkpoint_pool(device, a, b))
CP_FORWARD_VOID(cudapool_checkpoint_release, (unsigned long long checkpoint), checkpoint_release(checkpoint))
CP_FORWARD(int, -1, cudapool_checkpoint_restore,
           (int device, unsigned long long checkpoint, cudapool_restore_result *out),
           checkpoint_restore(device, checkpoint, out))
CP_FORWARD(int, -1, cudapool_pool_check_live,
           (int device, unsigned long long a, unsigned long long b, void *const *expected, size_t n),
           pool_check_live(device, a, b, (void *)expected, n))
CP_FORWARD(int, -1, cudapool_record_history,
           (int enabled, size_t max_entries, int when, int clear, const char *skip_actions),
           record_history(enabled, max_entries, when, clear, (char *)skip_actions))
CP_FORWARD(int, 0, cudapool_history_enabled, (void), history_enabled())
CP_FORWARD(size_t, 0, cudapool_live_contexts, (unsigned long long *out, size_t cap), live_contexts(out, cap))
CP_FORWARD_VOID(cudapool_set_user_metadata, (const char *md), set_user_metadata((char *)md))
CP_FORWARD(char *, NULL, cudapool_get_user_metadata, (void), get_user_metadata())
CP_FORWARD_VOID(cudapool_push_compile_context, (const char *c), push_compile_context((char *)c))
CP_FORWARD_VOID(cudapool_pop_compile_context, (void), pop_compile_context())
CP_FORWARD(int, -1, cudapool_record_annotation,
           (int device, const char *const *keys, const char *const *values, size_t n),
           record_annotation(device, (void *)keys, (void *)values, n))
CP_FORWARD(cudapool_snapshot *, NULL, cudapool_snapshot_take, (int by_pool, unsigned long long a, unsigned long long b,
           int include_traces), snapshot_take(by_pool, a, b, include_traces))
void *cudapool_ipc_open(int device, const unsigned char handle[64]) {
	if (cp_refused("cudapool_ipc_open"))
		return NULL;
	return (void *)cpgo_ipc_open(device, (unsigned char *)handle);
}
CP_FORWARD(int, -1, cudapool_ipc_close, (void *ptr), ipc_close((uintptr_t)ptr))
CP_FORWARD(int, -1, cudapool_ipc_share, (void *ptr, void *buf, size_t cap, size_t *len, size_t *offset, int *device),
           ipc_share((uintptr_t)ptr, (unsigned char *)buf, cap, len, offset, device))
void *cudapool_ipc_open_shared(int device, const void *buf, size_t len) {
	if (cp_refused("cudapool_ipc_open_shared"))
		return NULL;
	return (void *)cpgo_ipc_open_shared(device, (unsigned char *)buf, len);
}
/* Tags: pause and resume (cudapool_tag_push and _pop are above). */
CP_FORWARD(int, -1, cudapool_pause, (const char *tag, int keep), pause((char *)tag, keep))
CP_FORWARD(int, -1, cudapool_resume, (const char *tag), resume((char *)tag))
CP_FORWARD(long long, -1, cudapool_paused_bytes, (int device), paused_bytes(device))
CP_FORWARD(int, -1, cudapool_release_host_memory, (void), release_host_memory())
CP_FORWARD(int, -1, cudapool_set_caching, (int on), set_caching(on))
CP_FORWARD(int, 1, cudapool_caching, (void), caching())
CP_FORWARD(int, -1, cudapool_allocation_info, (void *ptr, size_t *size, int *device),
           allocation_info((uintptr_t)ptr, size, device))

/* Pure C: frees what cudapool_checkpoint_restore and cudapool_snapshot_take
 * allocated with malloc. */
void cudapool_restore_result_free(cudapool_restore_result *r) {
	if (r == NULL)
		return;
	free(r->freed);
	free(r->allocated);
	r->freed = r->allocated = NULL;
	r->nfreed = r->nallocated = 0;
}

void cudapool_snapshot_free(cudapool_snapshot *s) {
	if (s == NULL)
		return;
	for (size_t i = 0; i < s->ntraces; i++) {
		free((void *)s->traces[i].compile_context);
		free((void *)s->traces[i].user_metadata);
	}
	for (size_t i = 0; i < s->nannotations; i++) {
		for (size_t k = 0; k < s->annotations[i].n; k++) {
			free((void *)s->annotations[i].keys[k]);
			free((void *)s->annotations[i].values[k]);
		}
		free((void *)s->annotations[i].keys);
		free((void *)s->annotations[i].values);
	}
	free(s->segments);
	free(s->blocks);
	free(s->traces);
	free(s->annotations);
	free((void *)s->config.settings);
	free((void *)s->config.roundup_power2_divisions);
	free(s);
}

uintptr_t cp_call_segment_alloc(uintptr_t fn, uintptr_t ctx, size_t size, int device, uintptr_t stream) {
	cp_callback_enter();
	uintptr_t p = (uintptr_t)((cudapool_segment_alloc_fn)fn)((void *)ctx, size, device, (cudapool_stream)stream);
	cp_callback_leave();
	return p;
}

int cp_call_segment_free(uintptr_t fn, uintptr_t ctx, uintptr_t ptr, size_t size, int device) {
	cp_callback_enter();
	int rc = ((cudapool_segment_free_fn)fn)((void *)ctx, (void *)ptr, size, device);
	cp_callback_leave();
	return rc;
}

/* ---- Other libraries' allocator interfaces ----
 *
 * Plain C, with the bodies of the entry points above (cp_malloc,
 * cp_free_deferred): CuPy's CFunctionAllocator calls these directly, so a
 * CuPy malloc+free pair costs one call into Go and no Python beyond CuPy's
 * own. */

/* cupy_malloc is cudapool_cupy_malloc for the entry point numbered fn;
 * *stream_failed says whether the current-stream function failed. */
static void *cupy_malloc(void *param, size_t size, int device, int fn, int *stream_failed) {
	uintptr_t stream = 0; /* NULL param: the legacy default stream */
	if (param != NULL) {
		intptr_t s = ((cudapool_current_stream_fn)param)();
		if (s == -1) {
			char msg[160];
			int n = snprintf(msg, sizeof msg, "%s: the current-stream function failed (returned -1)",
			                 fn == CP_FN_CUPY_MALLOC ? "cudapool_cupy_malloc" : "cudapool_cupy_malloc_raising");
			cp_set_error(msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
			*stream_failed = 1;
			return NULL;
		}
		stream = (uintptr_t)s;
	}
	return cp_malloc(size, device, stream, 0, fn);
}

void *cudapool_cupy_malloc(void *param, size_t size, int device) {
	if (cp_refused("cudapool_cupy_malloc"))
		return NULL;
	int stream_failed = 0;
	return cupy_malloc(param, size, device, CP_FN_CUPY_MALLOC, &stream_failed);
}

/* ---- cudapool_cupy_malloc_raising: the failure handler ----
 *
 * CuPy's CFunctionAllocator does not check the pointer its C malloc
 * returns, so cudapool.cupy used to wrap the allocator in a Python function
 * that checks for NULL: one Python frame per allocation. CuPy built by
 * Cython 3 without legacy_implicit_noexcept does check one thing: a result
 * of -1 with a Python exception set propagates the exception. So on a
 * failure this entry point calls a Python handler, with the GIL that CuPy
 * holds around the call; the handler may free memory and ask for one retry,
 * else it raises, and -1 carries its exception to CuPy's caller.
 * cudapool.cupy checks at install that this CuPy propagates it (with the
 * probe size below) before it relies on it. The Python C API comes from
 * the caller (ctypes.pythonapi), so the library links no libpython. */

/* The handler and the C API functions it needs, set together by
 * cudapool_cupy_set_failure_handler; read under the GIL. */
typedef struct {
	void *handler; /* a Python callable; the registrant keeps it alive */
	int (*gil_check)(void);
	void (*incref)(void *);
	void (*decref)(void *);
	void *(*call)(void *, const char *, ...);
	int (*is_true)(void *);
} cp_pyhandler;

static cp_pyhandler *_Atomic cp_cupy_handler;

int cudapool_cupy_set_failure_handler(void *handler, void *const *python_api, int n) {
	if (cp_refused("cudapool_cupy_set_failure_handler"))
		return -1;
	/* A record replaced here stays allocated: a thread inside the handler
	 * may still read it (a few dozen bytes per registration; install()
	 * registers two). */
	if (handler == NULL) {
		atomic_store(&cp_cupy_handler, NULL);
		return 0;
	}
	if (python_api == NULL || n != 5) {
		static const char msg[] = "cudapool_cupy_set_failure_handler: python_api must hold the 5 functions "
		                          "PyGILState_Check, Py_IncRef, Py_DecRef, PyObject_CallFunction, PyObject_IsTrue";
		cp_set_error(msg, sizeof msg - 1);
		return -1;
	}
	for (int i = 0; i < n; i++) {
		if (python_api[i] == NULL) {
			static const char msg[] = "cudapool_cupy_set_failure_handler: a Python API function is NULL";
			cp_set_error(msg, sizeof msg - 1);
			return -1;
		}
	}
	cp_pyhandler *h = malloc(sizeof *h);
	if (h == NULL) {
		static const char msg[] = "cudapool_cupy_set_failure_handler: out of host memory";
		cp_set_error(msg, sizeof msg - 1);
		return -1;
	}
	h->handler = handler;
	h->gil_check = (int (*)(void))python_api[0];
	h->incref = (void (*)(void *))python_api[1];
	h->decref = (void (*)(void *))python_api[2];
	h->call = (void *(*)(void *, const char *, ...))python_api[3];
	h->is_true = (int (*)(void *))python_api[4];
	atomic_store(&cp_cupy_handler, h);
	return 0;
}

/* call_handler calls h's handler(size, device, attempt): 1 if it asks for
 * a retry, 0 if it returned anything else, -1 if it raised. */
static int call_handler(cp_pyhandler *h, size_t size, int device, int attempt) {
	h->incref(h->handler); /* held across the call: another thread may unregister it meanwhile */
	void *res = h->call(h->handler, "nii", (ssize_t)size, device, attempt);
	h->decref(h->handler);
	if (res == NULL)
		return -1;
	int yes = h->is_true(res);
	h->decref(res);
	return yes < 0 ? -1 : yes;
}

void *cudapool_cupy_malloc_raising(void *param, size_t size, int device) {
	if (cp_refused("cudapool_cupy_malloc_raising"))
		return NULL;
	void *p = NULL;
	int stream_failed = 0;
	if (size != CUDAPOOL_CUPY_PROBE_SIZE) {
		p = cupy_malloc(param, size, device, CP_FN_CUPY_MALLOC_RAISING, &stream_failed);
		if (p != NULL || size == 0)
			return p;
	}
	cp_pyhandler *h = atomic_load(&cp_cupy_handler);
	if (h == NULL || !h->gil_check())
		return NULL; /* no handler, or a caller without the GIL: NULL, as cudapool_cupy_malloc */
	if (stream_failed)
		return (void *)-1; /* CuPy's function set its own exception: CuPy raises it */
	int rc = call_handler(h, size, device, 0);
	if (rc == 1 && size != CUDAPOOL_CUPY_PROBE_SIZE) {
		p = cupy_malloc(param, size, device, CP_FN_CUPY_MALLOC_RAISING, &stream_failed);
		if (stream_failed)
			return (void *)-1;
		if (p != NULL)
			return p;
		rc = call_handler(h, size, device, 1);
	}
	return rc < 0 ? (void *)-1 : NULL;
}

void cudapool_cupy_free(void *param, void *ptr, int device) {
	(void)param;
	if (cp_refused("cudapool_cupy_free"))
		return;
	if (ptr == (void *)-1)
		return; /* cudapool_cupy_malloc_raising's failure, kept by a CuPy that did not raise it */
	cp_free_deferred(ptr, 0, device, 0, CP_FN_CUPY_FREE);
}

int cudapool_filter_stream_is(void *ctx, cudapool_stream stream) { return stream == (cudapool_stream)ctx; }
