// SPDX-License-Identifier: Apache-2.0
/*
 * workloads.h - the C-level allocator workloads, defined once and compiled
 * into both benchmark programs:
 *
 *   bench/c_bench.c         cudapool, through libcudapool.so (C)
 *   bench/native_bench.cpp  PyTorch's allocator, through libc10_cuda (C++):
 *                           native, expandable_segments, cudaMallocAsync
 *
 * The including file defines the backend functions declared below (after
 * including this header), then calls wl_main() from main(). Everything here
 * is valid C11 and C++17 (no designated initializers, no compound literals,
 * casts on malloc), so both programs run the very same loops.
 *
 * Workloads (sizes from one seeded generator, the same in every process;
 * bench/workloads.py is its Python twin, used by bench/torch_bench.py):
 *   hot     malloc+free of one 4 KiB block on the legacy stream, in a loop;
 *           median ns per pair over REPS repetitions (after a warm-up).
 *   mixed   256 live blocks; each pair frees one slot and allocates a new
 *           size into it. Sizes 512 B - 144 MiB: an exponent e in 9..27
 *           drawn uniformly, then uniform in [2^e, 2^(e+1)) (e = 27:
 *           [128 MiB, 144 MiB)). The sequence (65536 sizes and slots) is
 *           replayed cyclically; one full warm-up cycle first (it creates
 *           the segments); median ns per pair over REPS repetitions.
 *   threads T threads, each on its own stream, each doing 4 KiB malloc+free
 *           pairs for a fixed time; total pairs per second (median of REPS).
 *   trace   a recorded allocation trace (demo/trace.txt: "a ID SIZE STREAM",
 *           "f ID") replayed TRACE_REPEATS times; peak allocated and peak
 *           reserved bytes (fragmentation) and ns per operation once cached.
 *           It runs first, on a fresh allocator, so the peaks are its own.
 *           --trace-series N also samples current allocated and reserved
 *           bytes about N times over all passes (one more JSON line,
 *           section "trace_series"; bench/charts.py plots it). The time
 *           spent sampling is left out of the pass times; for replay times
 *           untouched by it, bench/trace_series.sh records the series in a
 *           run of its own.
 *
 * Paired (bench/pair_bench.c): compiled with -DWL_PAIR_PREFIX=x, a file
 * defines no main but exports x_init, x_hot_rep, x_mixed_begin, x_mixed_rep
 * and x_mixed_end (C linkage), so that one program can run two backends'
 * reps alternately, in the same seconds of the host.
 *
 * Output: one JSON object per line on stdout, one per section, each with
 * "kind":"c", "config" and "section"; bench/report.py merges them. A section
 * that fails prints its "error" and the program goes on with the next.
 * Diagnostics go to stderr.
 */
#ifndef CUDAPOOL_BENCH_WORKLOADS_H
#define CUDAPOOL_BENCH_WORKLOADS_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- backend interface (defined by the including file) ---- */

typedef void *bk_stream; /* a cudaStream_t / CUstream; NULL = legacy stream */

/* Sets up the allocator on device 0 and writes its name ("cudapool",
 * "native", "cudaMallocAsync") to name. 0 on success. */
static int bk_init(char *name, size_t name_len);
/* NULL on failure (bk_last_error says why). */
static void *bk_malloc(size_t size, bk_stream s);
static void bk_free(void *p, size_t size, bk_stream s);
/* A new non-blocking stream on device 0 (NULL on failure). */
static bk_stream bk_stream_new(void);
/* Called first in every worker thread (makes the device current). */
static void bk_thread_enter(void);
static void bk_empty_cache(void);
/* Current reserved bytes, peak allocated/reserved bytes and peak segment
 * count; -1 where unknown. 0 on success. */
static int bk_stats(long long *cur_res, long long *peak_alloc, long long *peak_res, long long *peak_segs);
/* Waits for all work on the device. */
static void bk_sync(void);
/* This thread's last error message ("" if none). */
static const char *bk_last_error(void);
/* Current allocated and reserved bytes of device 0 (for --trace-series).
 * 0 on success. */
static int bk_current(long long *alloc, long long *res);
/* Extra "key":value members for the trace section's JSON (may be ""),
 * e.g. how many segments are expandable. */
static void bk_trace_extras(char *buf, size_t len);

/* ---- the shared size generator (splitmix64) ---- */

#define WL_HOT_SIZE 4096
#define WL_LIVE 256
#define WL_SEQ 65536 /* power of two */
#define WL_MIXED_SEED 0x5EED0001ULL
#define WL_MIN_EXP 9
#define WL_MAX_EXP 27
#define WL_TOP_SPAN (16ULL << 20) /* e = 27: [128 MiB, 144 MiB) */

static uint64_t wl_next(uint64_t *state) {
	uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

/* Fills sizes[WL_SEQ] and slots[WL_SEQ]. */
static void wl_mixed_sequence(size_t *sizes, unsigned *slots) {
	uint64_t st = WL_MIXED_SEED;
	for (int i = 0; i < WL_SEQ; i++) {
		uint64_t e = WL_MIN_EXP + wl_next(&st) % (WL_MAX_EXP - WL_MIN_EXP + 1);
		uint64_t lo = 1ULL << e;
		uint64_t span = e == WL_MAX_EXP ? WL_TOP_SPAN : lo;
		sizes[i] = (size_t)(lo + wl_next(&st) % span);
		slots[i] = (unsigned)(wl_next(&st) % WL_LIVE);
	}
}

/* ---- helpers ---- */

static double wl_now_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int wl_cmp_double(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double wl_median(const double *v, int n) {
	double tmp[64];
	if (n <= 0)
		return -1;
	if (n > 64)
		n = 64;
	memcpy(tmp, v, sizeof(double) * (size_t)n);
	qsort(tmp, (size_t)n, sizeof(double), wl_cmp_double);
	return n % 2 ? tmp[n / 2] : (tmp[n / 2 - 1] + tmp[n / 2]) / 2;
}

/* Writes s as a JSON string (with quotes) into out. */
static void wl_json_str(char *out, size_t len, const char *s) {
	size_t o = 0;
	if (len < 3) {
		if (len)
			out[0] = 0;
		return;
	}
	out[o++] = '"';
	for (; s && *s && o + 8 < len; s++) {
		unsigned char c = (unsigned char)*s;
		if (c == '"' || c == '\\') {
			out[o++] = '\\';
			out[o++] = (char)c;
		} else if (c < 0x20) {
			o += (size_t)snprintf(out + o, len - o, "\\u%04x", c);
		} else {
			out[o++] = (char)c;
		}
	}
	out[o++] = '"';
	out[o] = 0;
}

static void wl_json_array(char *out, size_t len, const double *v, int n) {
	size_t o = 0;
	o += (size_t)snprintf(out + o, len - o, "[");
	for (int i = 0; i < n && o + 32 < len; i++)
		o += (size_t)snprintf(out + o, len - o, "%s%.2f", i ? "," : "", v[i]);
	snprintf(out + o, len - o, "]");
}

struct wl_opts {
	const char *config;
	const char *trace;
	long hot_pairs;
	long mixed_pairs;
	int reps;
	double thread_secs;
	int thread_reps;
	int threads[8];
	int nthreads;
	int trace_repeats;
	int trace_series; /* samples over the first pass; 0: none */
	int do_hot, do_mixed, do_threads, do_trace;
};

static char wl_cfg_json[128];

/* Prints one section's JSON line: body holds the members after "section". */
static void wl_emit(const char *section, const char *body) {
	printf("{\"kind\":\"c\",\"config\":%s,\"section\":\"%s\"%s%s}\n", wl_cfg_json, section, body[0] ? "," : "",
	       body);
	fflush(stdout);
}

static void wl_emit_error(const char *section, const char *what) {
	char msg[600], esc[1400], body[1500];
	snprintf(msg, sizeof msg, "%s: %s", what, bk_last_error());
	fprintf(stderr, "[%s] %s\n", section, msg);
	wl_json_str(esc, sizeof esc, msg);
	snprintf(body, sizeof body, "\"%s_error\":%s", section, esc);
	wl_emit(section, body);
}

/* ---- hot ---- */

static double wl_hot_rep(long n, bk_stream s) {
	double t0 = wl_now_ns();
	for (long i = 0; i < n; i++) {
		void *p = bk_malloc(WL_HOT_SIZE, s);
		if (p == NULL)
			return -1;
		bk_free(p, WL_HOT_SIZE, s);
	}
	return (wl_now_ns() - t0) / (double)n;
}

static void wl_section_hot(const struct wl_opts *o) {
	double reps[64];
	int n = o->reps > 64 ? 64 : o->reps;
	if (wl_hot_rep(10000, NULL) < 0) {
		wl_emit_error("hot", "4 KiB malloc failed");
		return;
	}
	for (int r = 0; r < n; r++) {
		reps[r] = wl_hot_rep(o->hot_pairs, NULL);
		if (reps[r] < 0) {
			wl_emit_error("hot", "4 KiB malloc failed");
			return;
		}
	}
	char arr[1024], body[1400];
	wl_json_array(arr, sizeof arr, reps, n);
	snprintf(body, sizeof body, "\"hot_ns_per_pair\":%.2f,\"hot_reps_ns\":%s,\"hot_pairs\":%ld", wl_median(reps, n),
	         arr, o->hot_pairs);
	wl_emit("hot", body);
	fprintf(stderr, "[hot] median %.1f ns/pair\n", wl_median(reps, n));
}

/* ---- eviction between a pair's free and malloc (WL_EVICT_KB) ----
 *
 * In PyTorch's mixed torch.empty loop the interpreter and the dispatcher run
 * between the tensor's free and the next malloc, and evict much of the
 * allocator's working set (docs/hot-path.md, "Why it is built this way"). WL_EVICT_KB=N
 * makes the mixed loop touch N KiB of its own buffer there (a read and a
 * write per 64-byte line), and WL_EVICT_CODE=1 also runs 40 KiB of
 * straight-line code (more than a core's L1 instruction cache), so that
 * the pair's cold cost can be compared between allocators in C, in one
 * process (bench/pair_bench.c). The eviction's own time is in every pair:
 * wl_evict_rep measures it alone, to subtract. */
static size_t wl_evict_bytes;
static int wl_evict_code;
static unsigned char *wl_evict_buf;

static void wl_evict_setup(void) {
	const char *v = getenv("WL_EVICT_KB");
	const char *c = getenv("WL_EVICT_CODE");
	wl_evict_code = c != NULL && strcmp(c, "1") == 0;
	if (v == NULL || atol(v) <= 0 || wl_evict_buf != NULL)
		return;
	wl_evict_bytes = (size_t)atol(v) << 10;
	wl_evict_buf = (unsigned char *)calloc(wl_evict_bytes, 1);
	if (wl_evict_buf == NULL)
		wl_evict_bytes = 0;
}

/* 40 KiB of 8-byte no-ops: fetched and decoded at the front end's pace,
 * with no dependences between them (x86-64 only; elsewhere nothing). */
__attribute__((noinline)) static void wl_evict_code_run(void) {
#if defined(__x86_64__)
	__asm__ __volatile__(".rept 5120\n\tnopl 0x12345678(%%rax,%%rax,1)\n\t.endr" ::: "memory");
#endif
}

static inline void wl_evict(void) {
	for (size_t i = 0; i < wl_evict_bytes; i += 64)
		wl_evict_buf[i]++;
	if (wl_evict_code)
		wl_evict_code_run();
}

/* n evictions alone: ns each. */
__attribute__((unused)) static double wl_evict_rep(long n) {
	double t0 = wl_now_ns();
	for (long i = 0; i < n; i++)
		wl_evict();
	return (wl_now_ns() - t0) / (double)n;
}

/* ---- mixed ---- */

struct wl_mixed {
	size_t *sizes;
	unsigned *slots;
	void *live[WL_LIVE];
	size_t live_size[WL_LIVE];
	unsigned long long k; /* next op */
};

/* Runs n pairs; -1 on failure (with the failing size in *bad). */
static double wl_mixed_run(struct wl_mixed *m, long n, size_t *bad) {
	double t0 = wl_now_ns();
	for (long i = 0; i < n; i++) {
		unsigned j = (unsigned)(m->k & (WL_SEQ - 1));
		unsigned s = m->slots[j];
		size_t sz = m->sizes[j];
		m->k++;
		if (m->live[s] != NULL)
			bk_free(m->live[s], m->live_size[s], NULL);
		if (wl_evict_bytes != 0 || wl_evict_code)
			wl_evict();
		m->live[s] = bk_malloc(sz, NULL);
		m->live_size[s] = sz;
		if (m->live[s] == NULL) {
			*bad = sz;
			return -1;
		}
	}
	return (wl_now_ns() - t0) / (double)n;
}

static void wl_mixed_release(struct wl_mixed *m) {
	for (int s = 0; s < WL_LIVE; s++)
		if (m->live[s] != NULL) {
			bk_free(m->live[s], m->live_size[s], NULL);
			m->live[s] = NULL;
		}
}

/* The workload's sequence, initial fill (slot i gets sizes[i]) and one
 * warm-up cycle (it creates the segments). 0 on success; -1 when the host
 * is out of memory; -2 when a malloc failed (its size in *bad). */
static int wl_mixed_begin(struct wl_mixed *m, size_t *bad, double *warm_ms) {
	memset(m, 0, sizeof *m);
	wl_evict_setup();
	m->sizes = (size_t *)malloc(sizeof(size_t) * WL_SEQ);
	m->slots = (unsigned *)malloc(sizeof(unsigned) * WL_SEQ);
	if (m->sizes == NULL || m->slots == NULL)
		return -1;
	wl_mixed_sequence(m->sizes, m->slots);
	for (int s = 0; s < WL_LIVE; s++) {
		m->live[s] = bk_malloc(m->sizes[s], NULL);
		m->live_size[s] = m->sizes[s];
		if (m->live[s] == NULL) {
			*bad = m->sizes[s];
			return -2;
		}
	}
	double t0 = wl_now_ns();
	double warm = wl_mixed_run(m, WL_SEQ, bad);
	*warm_ms = (wl_now_ns() - t0) / 1e6;
	return warm < 0 ? -2 : 0;
}

/* Frees what wl_mixed_begin made (after a failure too). */
static void wl_mixed_end(struct wl_mixed *m) {
	wl_mixed_release(m);
	free(m->sizes);
	free(m->slots);
	memset(m, 0, sizeof *m);
}

static void wl_section_mixed(const struct wl_opts *o) {
	struct wl_mixed m;
	char what[160];
	size_t bad = 0;
	double reps[64], warm_ms = 0;
	int n = o->reps > 64 ? 64 : o->reps;
	int rc = wl_mixed_begin(&m, &bad, &warm_ms);
	int ok = rc == 0;
	for (int r = 0; r < n && ok; r++) {
		reps[r] = wl_mixed_run(&m, o->mixed_pairs, &bad);
		ok = reps[r] >= 0;
	}
	if (rc == -1) {
		wl_emit_error("mixed", "host out of memory");
	} else if (!ok) {
		snprintf(what, sizeof what, "malloc of %zu bytes failed", bad);
		wl_emit_error("mixed", what);
	} else {
		long long cr = -1, pa = -1, pr = -1, ps = -1;
		bk_stats(&cr, &pa, &pr, &ps);
		char arr[1024], body[1600];
		wl_json_array(arr, sizeof arr, reps, n);
		snprintf(body, sizeof body,
		         "\"mixed_ns_per_pair\":%.2f,\"mixed_reps_ns\":%s,\"mixed_pairs\":%ld,\"mixed_warmup_ms\":%.2f,"
		         "\"mixed_reserved_end\":%lld",
		         wl_median(reps, n), arr, o->mixed_pairs, warm_ms, cr);
		wl_emit("mixed", body);
		fprintf(stderr, "[mixed] median %.1f ns/pair (warm-up cycle %.1f ms)\n", wl_median(reps, n), warm_ms);
	}
	wl_mixed_end(&m);
}

/* ---- threads ---- */

struct wl_thr {
	pthread_t th;
	bk_stream s;
	long long count;
	double t_start, t_end;
	int fail;
	char err[256];
};

static int wl_ready, wl_go, wl_stop; /* accessed with __atomic builtins */

static void *wl_thread_main(void *arg) {
	struct wl_thr *t = (struct wl_thr *)arg;
	bk_thread_enter();
	for (int i = 0; i < 2000 && !t->fail; i++) { /* warm-up: the stream's first block */
		void *p = bk_malloc(WL_HOT_SIZE, t->s);
		if (p == NULL)
			t->fail = 1;
		else
			bk_free(p, WL_HOT_SIZE, t->s);
	}
	if (t->fail)
		snprintf(t->err, sizeof t->err, "%.200s", bk_last_error());
	__atomic_add_fetch(&wl_ready, 1, __ATOMIC_SEQ_CST);
	while (!__atomic_load_n(&wl_go, __ATOMIC_ACQUIRE))
		;
	t->t_start = wl_now_ns();
	long long c = 0;
	while (!t->fail && !__atomic_load_n(&wl_stop, __ATOMIC_ACQUIRE)) {
		for (int i = 0; i < 256; i++) {
			void *p = bk_malloc(WL_HOT_SIZE, t->s);
			if (p == NULL) {
				t->fail = 1;
				snprintf(t->err, sizeof t->err, "%.200s", bk_last_error());
				break;
			}
			bk_free(p, WL_HOT_SIZE, t->s);
			c++;
		}
	}
	t->t_end = wl_now_ns();
	t->count = c;
	return NULL;
}

/* Pairs per second with T threads, or -1 (err filled). */
static double wl_threads_rep(int T, double secs, bk_stream *streams, char *err, size_t errlen) {
	struct wl_thr thr[64];
	int started = 0;
	__atomic_store_n(&wl_ready, 0, __ATOMIC_SEQ_CST);
	__atomic_store_n(&wl_go, 0, __ATOMIC_SEQ_CST);
	__atomic_store_n(&wl_stop, 0, __ATOMIC_SEQ_CST);
	for (int i = 0; i < T; i++) {
		memset(&thr[i], 0, sizeof thr[i]);
		thr[i].s = streams[i];
		if (pthread_create(&thr[i].th, NULL, wl_thread_main, &thr[i]) != 0)
			break;
		started++;
	}
	while (__atomic_load_n(&wl_ready, __ATOMIC_SEQ_CST) < started) {
		struct timespec ts = {0, 100000};
		nanosleep(&ts, NULL);
	}
	__atomic_store_n(&wl_go, 1, __ATOMIC_RELEASE);
	struct timespec d;
	d.tv_sec = (time_t)secs;
	d.tv_nsec = (long)((secs - (double)d.tv_sec) * 1e9);
	nanosleep(&d, NULL);
	__atomic_store_n(&wl_stop, 1, __ATOMIC_RELEASE);
	long long total = 0;
	double t0 = 0, t1 = 0;
	int fail = started < T;
	if (fail)
		snprintf(err, errlen, "pthread_create failed after %d threads", started);
	for (int i = 0; i < started; i++) {
		pthread_join(thr[i].th, NULL);
		total += thr[i].count;
		if (i == 0 || thr[i].t_start < t0)
			t0 = thr[i].t_start;
		if (i == 0 || thr[i].t_end > t1)
			t1 = thr[i].t_end;
		if (thr[i].fail && !fail) {
			fail = 1;
			snprintf(err, errlen, "thread %d: malloc failed: %s", i, thr[i].err);
		}
	}
	if (fail || t1 <= t0)
		return -1;
	return (double)total / ((t1 - t0) / 1e9);
}

static void wl_section_threads(const struct wl_opts *o) {
	bk_stream streams[64];
	int maxT = 0;
	for (int i = 0; i < o->nthreads; i++)
		if (o->threads[i] > maxT)
			maxT = o->threads[i];
	if (maxT > 64)
		maxT = 64;
	for (int i = 0; i < maxT; i++) {
		streams[i] = bk_stream_new();
		if (streams[i] == NULL) {
			wl_emit_error("threads", "creating a stream failed");
			return;
		}
	}
	char body[4096];
	size_t b = 0;
	body[0] = 0;
	int n = o->thread_reps > 64 ? 64 : o->thread_reps; /* each rep is thread_secs long */
	for (int i = 0; i < o->nthreads; i++) {
		int T = o->threads[i] > 64 ? 64 : o->threads[i];
		double reps[64];
		char err[400] = "";
		int ok = 1;
		for (int r = 0; r < n && ok; r++) {
			reps[r] = wl_threads_rep(T, o->thread_secs, streams, err, sizeof err);
			ok = reps[r] >= 0;
		}
		if (!ok) {
			char esc[900];
			wl_json_str(esc, sizeof esc, err);
			fprintf(stderr, "[threads] T=%d: %s\n", T, err);
			b += (size_t)snprintf(body + b, sizeof body - b, "%s\"threads%d_error\":%s", b ? "," : "", T, esc);
			continue;
		}
		char arr[1024];
		wl_json_array(arr, sizeof arr, reps, n);
		b += (size_t)snprintf(body + b, sizeof body - b, "%s\"threads%d_pairs_per_s\":%.0f,\"threads%d_reps\":%s",
		                      b ? "," : "", T, wl_median(reps, n), T, arr);
		fprintf(stderr, "[threads] T=%d: %.3g pairs/s\n", T, wl_median(reps, n));
		if (b >= sizeof body)
			break;
	}
	if (b < sizeof body)
		snprintf(body + b, sizeof body - b, "%s\"thread_secs\":%.2f,\"thread_reps\":%d", b ? "," : "",
		         o->thread_secs, n);
	wl_emit("threads", body);
}

/* ---- trace ---- */

struct wl_op {
	int alloc;         /* 1: alloc, 0: free */
	int strm;          /* alloc: index into the stream table */
	size_t size;       /* alloc */
	unsigned long id;  /* the trace's id */
};

/* The trace_series line: op counts and the bytes after them. */
static void wl_emit_series(size_t n, size_t every, const long long *op, const long long *alloc, const long long *res) {
	const long long *cols[3] = {op, alloc, res};
	const char *names[3] = {"trace_series_op", "trace_series_allocated", "trace_series_reserved"};
	size_t len = 200 + n * 3 * 22;
	char *body = (char *)malloc(len);
	if (body == NULL)
		return;
	size_t o = (size_t)snprintf(body, len, "\"trace_series_every\":%zu", every);
	for (int c = 0; c < 3; c++) {
		o += (size_t)snprintf(body + o, len - o, ",\"%s\":[", names[c]);
		for (size_t i = 0; i < n; i++)
			o += (size_t)snprintf(body + o, len - o, "%s%lld", i ? "," : "", cols[c][i]);
		o += (size_t)snprintf(body + o, len - o, "]");
	}
	wl_emit("trace_series", body);
	free(body);
}

static void wl_section_trace(const struct wl_opts *o) {
	FILE *f = fopen(o->trace, "r");
	if (f == NULL) {
		char what[600];
		snprintf(what, sizeof what, "cannot open trace %s", o->trace);
		wl_emit_error("trace", what);
		return;
	}
	size_t cap = 1 << 14, nops = 0;
	struct wl_op *ops = (struct wl_op *)malloc(sizeof(struct wl_op) * cap);
	char line[256];
	unsigned long max_id = 0;
	long long trace_streams[16];
	int nstreams = 0, bad_lines = 0;
	while (ops != NULL && fgets(line, sizeof line, f) != NULL) {
		char *p = line;
		while (*p == ' ' || *p == '\t')
			p++;
		if (*p == '#' || *p == '\n' || *p == '\r' || *p == 0)
			continue;
		struct wl_op op;
		memset(&op, 0, sizeof op);
		char *end;
		if ((p[0] == 'a' || p[0] == 'f') && p[1] == ' ') {
			op.alloc = p[0] == 'a';
			op.id = strtoul(p + 2, &end, 0);
			if (op.alloc) {
				op.size = (size_t)strtoull(end, &end, 0);
				long long sn = strtoll(end, &end, 0);
				int k;
				for (k = 0; k < nstreams && trace_streams[k] != sn; k++)
					;
				if (k == nstreams && nstreams < 16)
					trace_streams[nstreams++] = sn;
				op.strm = k < 16 ? k : 0;
			}
		} else {
			bad_lines++;
			continue;
		}
		if (op.id > max_id)
			max_id = op.id;
		if (nops == cap) {
			cap *= 2;
			struct wl_op *n2 = (struct wl_op *)realloc(ops, sizeof(struct wl_op) * cap);
			if (n2 == NULL) {
				free(ops);
				ops = NULL;
				break;
			}
			ops = n2;
		}
		ops[nops++] = op;
	}
	fclose(f);
	if (ops == NULL || max_id > 100000000UL) {
		wl_emit_error("trace", ops == NULL ? "host out of memory" : "trace ids too large (> 1e8)");
		free(ops);
		return;
	}
	/* Trace stream 0 is the legacy stream; any other gets a real stream. */
	bk_stream streams[16];
	for (int k = 0; k < nstreams; k++) {
		streams[k] = trace_streams[k] == 0 ? NULL : bk_stream_new();
		if (trace_streams[k] != 0 && streams[k] == NULL) {
			wl_emit_error("trace", "creating a stream failed");
			free(ops);
			return;
		}
	}
	void **ptr = (void **)calloc(max_id + 1, sizeof(void *));
	size_t *psize = (size_t *)calloc(max_id + 1, sizeof(size_t));
	bk_stream *pstream = (bk_stream *)calloc(max_id + 1, sizeof(bk_stream));
	if (ptr == NULL || psize == NULL || pstream == NULL) {
		wl_emit_error("trace", "host out of memory");
		free(ops);
		free(ptr);
		free(psize);
		free(pstream);
		return;
	}
	int repeats = o->trace_repeats < 1 ? 1 : o->trace_repeats;
	/* --trace-series: a sample after every `every`-th op, over all passes. */
	size_t total = nops * (size_t)repeats;
	size_t every = o->trace_series > 0 ? total / (size_t)o->trace_series : 0, ns = 0;
	if (o->trace_series > 0 && every == 0)
		every = 1;
	size_t scap = every ? total / every + 2 : 0;
	long long *s_op = NULL, *s_alloc = NULL, *s_res = NULL;
	if (scap) {
		s_op = (long long *)malloc(sizeof(long long) * scap);
		s_alloc = (long long *)malloc(sizeof(long long) * scap);
		s_res = (long long *)malloc(sizeof(long long) * scap);
		if (s_op == NULL || s_alloc == NULL || s_res == NULL)
			scap = every = 0; /* host out of memory: no series */
	}
	long long failed = 0, unknown_frees = 0;
	double first_ns = 0, later_ns = 0;
	size_t nallocs = 0;
	char failmsg[600] = "";
	for (int r = 0; r < repeats && failed == 0; r++) {
		double t0 = wl_now_ns(), sample_ns = 0;
		for (size_t i = 0; i < nops; i++) {
			const struct wl_op *op = &ops[i];
			if (op->alloc) {
				if (ptr[op->id] != NULL) /* id reused while live: free the old block */
					bk_free(ptr[op->id], psize[op->id], pstream[op->id]);
				bk_stream s = streams[op->strm];
				void *p = bk_malloc(op->size, s);
				if (p == NULL && op->size > 0 && failed++ == 0)
					snprintf(failmsg, sizeof failmsg, "malloc of %zu bytes (op %zu) failed", op->size, i);
				ptr[op->id] = p;
				psize[op->id] = op->size;
				pstream[op->id] = s;
				if (r == 0)
					nallocs++;
			} else if (ptr[op->id] != NULL) {
				bk_free(ptr[op->id], psize[op->id], pstream[op->id]);
				ptr[op->id] = NULL;
			} else if (r == 0) {
				unknown_frees++;
			}
			size_t done = (size_t)r * nops + i + 1;
			if (every && (done % every == 0 || done == total) && ns < scap) {
				double ts = wl_now_ns();
				if (bk_current(&s_alloc[ns], &s_res[ns]) == 0)
					s_op[ns++] = (long long)done;
				sample_ns += wl_now_ns() - ts; /* not the allocator's time */
			}
		}
		double dt = wl_now_ns() - t0 - sample_ns;
		if (r == 0)
			first_ns = dt;
		else
			later_ns += dt;
		for (unsigned long id = 0; id <= max_id; id++) /* blocks the trace left live */
			if (ptr[id] != NULL) {
				bk_free(ptr[id], psize[id], pstream[id]);
				ptr[id] = NULL;
			}
	}
	bk_sync();
	long long cr = -1, pa = -1, pr = -1, ps = -1;
	bk_stats(&cr, &pa, &pr, &ps);
	if (failed) {
		wl_emit_error("trace", failmsg);
	} else {
		char extras[512] = "", body[1600];
		bk_trace_extras(extras, sizeof extras);
		snprintf(body, sizeof body,
		         "\"trace_ops\":%zu,\"trace_allocs\":%zu,\"trace_repeats\":%d,\"trace_unknown_frees\":%lld,"
		         "\"trace_peak_allocated\":%lld,\"trace_peak_reserved\":%lld,\"trace_peak_segments\":%lld,"
		         "\"trace_first_pass_ms\":%.3f,\"trace_ns_per_op\":%.2f%s%s",
		         nops, nallocs, repeats, unknown_frees, pa, pr, ps, first_ns / 1e6,
		         repeats > 1 && nops ? later_ns / (double)nops / (double)(repeats - 1) : -1.0, extras[0] ? "," : "",
		         extras);
		wl_emit("trace", body);
		fprintf(stderr, "[trace] %zu ops, peak allocated %lld, peak reserved %lld (%.3f)\n", nops, pa, pr,
		        pa > 0 ? (double)pr / (double)pa : 0.0);
		if (ns > 0)
			wl_emit_series(ns, every, s_op, s_alloc, s_res);
	}
	free(s_op);
	free(s_alloc);
	free(s_res);
	free(ops);
	free(ptr);
	free(psize);
	free(pstream);
}

/* ---- main ---- */

static void wl_usage(const char *argv0) {
	fprintf(stderr,
	        "usage: %s --config NAME [--trace FILE] [--hot-pairs N] [--mixed-pairs N] [--reps N]\n"
	        "          [--thread-secs S] [--thread-reps N] [--threads 4,8] [--trace-repeats N] [--trace-series N] [--sections hot,mixed,threads,trace]\n"
	        "          [--print-mixed N]\n",
	        argv0);
}

static int wl_parse_sections(struct wl_opts *o, const char *s) {
	o->do_hot = strstr(s, "hot") != NULL;
	o->do_mixed = strstr(s, "mixed") != NULL;
	o->do_threads = strstr(s, "threads") != NULL;
	o->do_trace = strstr(s, "trace") != NULL;
	return o->do_hot || o->do_mixed || o->do_threads || o->do_trace;
}

static int wl_parse_threads(struct wl_opts *o, const char *s) {
	o->nthreads = 0;
	while (*s && o->nthreads < 8) {
		char *end;
		long t = strtol(s, &end, 10);
		if (end == s || t < 1 || t > 64)
			return 0;
		o->threads[o->nthreads++] = (int)t;
		s = *end == ',' ? end + 1 : end;
		if (*end != ',' && *end != 0)
			return 0;
	}
	return o->nthreads > 0;
}

/* BENCH_START_AT (Unix time in seconds): the sections start then, not
 * before (at most 60 s from now), so that two processes started together
 * time the same seconds of the host. */
static void wl_wait_start(void) {
	const char *v = getenv("BENCH_START_AT");
	if (v == NULL || *v == 0)
		return;
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	double wait = atof(v) - ((double)now.tv_sec + (double)now.tv_nsec / 1e9);
	if (wait > 60)
		wait = 60;
	if (wait <= 0) {
		fprintf(stderr, "BENCH_START_AT passed %.2f s before the sections began\n", -wait);
		return;
	}
	struct timespec d = {(time_t)wait, (long)((wait - (double)(time_t)wait) * 1e9)};
	nanosleep(&d, NULL);
}

static int wl_main(int argc, char **argv) {
	struct wl_opts o;
	memset(&o, 0, sizeof o);
	o.config = NULL;
	o.trace = "demo/trace.txt";
	o.hot_pairs = 1000000;
	o.mixed_pairs = 200000;
	o.reps = 5;
	o.thread_secs = 0.5;
	o.thread_reps = 3;
	o.threads[0] = 4;
	o.threads[1] = 8;
	o.nthreads = 2;
	o.trace_repeats = 5;
	o.do_hot = o.do_mixed = o.do_threads = o.do_trace = 1;
	long print_mixed = -1;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		int ok = v != NULL;
		if (strcmp(a, "--config") == 0 && ok)
			o.config = v;
		else if (strcmp(a, "--trace") == 0 && ok)
			o.trace = v;
		else if (strcmp(a, "--hot-pairs") == 0 && ok)
			ok = (o.hot_pairs = atol(v)) > 0;
		else if (strcmp(a, "--mixed-pairs") == 0 && ok)
			ok = (o.mixed_pairs = atol(v)) > 0;
		else if (strcmp(a, "--reps") == 0 && ok)
			ok = (o.reps = atoi(v)) > 0 && o.reps <= 64;
		else if (strcmp(a, "--thread-secs") == 0 && ok)
			ok = (o.thread_secs = atof(v)) > 0 && o.thread_secs < 60;
		else if (strcmp(a, "--thread-reps") == 0 && ok)
			ok = (o.thread_reps = atoi(v)) > 0 && o.thread_reps <= 64;
		else if (strcmp(a, "--threads") == 0 && ok)
			ok = wl_parse_threads(&o, v);
		else if (strcmp(a, "--trace-repeats") == 0 && ok)
			ok = (o.trace_repeats = atoi(v)) > 0;
		else if (strcmp(a, "--trace-series") == 0 && ok)
			ok = (o.trace_series = atoi(v)) > 0 && o.trace_series <= 100000;
		else if (strcmp(a, "--sections") == 0 && ok)
			ok = wl_parse_sections(&o, v);
		else if (strcmp(a, "--print-mixed") == 0 && ok)
			ok = (print_mixed = atol(v)) >= 0;
		else
			ok = 0;
		if (!ok) {
			fprintf(stderr, "bad argument: %s %s\n", a, v ? v : "");
			wl_usage(argv[0]);
			return 2;
		}
		i++;
	}
	if (print_mixed >= 0) { /* the generator, for checking its Python twin */
		size_t *sizes = (size_t *)malloc(sizeof(size_t) * WL_SEQ);
		unsigned *slots = (unsigned *)malloc(sizeof(unsigned) * WL_SEQ);
		if (sizes == NULL || slots == NULL)
			return 1;
		wl_mixed_sequence(sizes, slots);
		for (long i = 0; i < print_mixed && i < WL_SEQ; i++)
			printf("%zu %u\n", sizes[i], slots[i]);
		free(sizes);
		free(slots);
		return 0;
	}
	if (o.config == NULL) {
		wl_usage(argv[0]);
		return 2;
	}
	wl_json_str(wl_cfg_json, sizeof wl_cfg_json, o.config);

	char name[128] = "", esc[300], body[1200];
	if (bk_init(name, sizeof name) != 0) {
		wl_emit_error("init", "allocator initialization failed");
		return 1;
	}
	wl_json_str(esc, sizeof esc, name);
	snprintf(body, sizeof body,
	         "\"backend\":%s,\"hot_size\":%d,\"live_blocks\":%d,\"reps\":%d,\"mixed_seed\":%llu",
	         esc, WL_HOT_SIZE, WL_LIVE, o.reps, (unsigned long long)WL_MIXED_SEED);
	wl_emit("init", body);
	fprintf(stderr, "config %s, backend %s\n", o.config, name);
	wl_wait_start();

	double t0 = wl_now_ns();
	if (o.do_trace) {
		wl_section_trace(&o);
		bk_empty_cache();
	}
	if (o.do_hot)
		wl_section_hot(&o);
	if (o.do_mixed) {
		wl_section_mixed(&o);
		bk_sync();
		bk_empty_cache();
	}
	if (o.do_threads)
		wl_section_threads(&o);
	bk_sync();
	snprintf(body, sizeof body, "\"c_total_s\":%.2f", (wl_now_ns() - t0) / 1e9);
	wl_emit("done", body);
	return 0;
}

/* ---- paired: the reps one at a time, for bench/pair_bench.c ---- */

#ifdef WL_PAIR_PREFIX
#ifdef __cplusplus
#define WL_PAIR_EXTERN extern "C"
#else
#define WL_PAIR_EXTERN
#endif
#define WL_PAIR_CAT2(a, b) a##_##b
#define WL_PAIR_CAT(a, b) WL_PAIR_CAT2(a, b)
#define WL_PAIR_FN(n) WL_PAIR_CAT(WL_PAIR_PREFIX, n)

static struct wl_mixed wl_pair_mixed;
/* The sections' code stays compiled (and unwarned) in this mode. */
static int (*const wl_pair_main)(int, char **) __attribute__((unused)) = wl_main;

/* Sets up the backend; writes its name. NULL on success, else the error. */
WL_PAIR_EXTERN const char *WL_PAIR_FN(init)(char *name, size_t name_len) {
	return bk_init(name, name_len) == 0 ? NULL : bk_last_error();
}

/* n 4 KiB pairs on the legacy stream: ns per pair, -1 on failure. */
WL_PAIR_EXTERN double WL_PAIR_FN(hot_rep)(long n) { return wl_hot_rep(n, NULL); }

/* The mixed workload's sequence, initial fill and warm-up cycle, as its
 * section makes them. NULL on success, else the error. */
WL_PAIR_EXTERN const char *WL_PAIR_FN(mixed_begin)(void) {
	size_t bad = 0;
	double warm_ms = 0;
	int rc = wl_mixed_begin(&wl_pair_mixed, &bad, &warm_ms);
	return rc == 0 ? NULL : rc == -1 ? "host out of memory" : bk_last_error();
}

/* n mixed pairs: ns per pair, -1 on failure. */
WL_PAIR_EXTERN double WL_PAIR_FN(mixed_rep)(long n) {
	size_t bad = 0;
	return wl_mixed_run(&wl_pair_mixed, n, &bad);
}

WL_PAIR_EXTERN void WL_PAIR_FN(mixed_end)(void) { wl_mixed_end(&wl_pair_mixed); }

/* n of the mixed loop's evictions alone (WL_EVICT_KB, WL_EVICT_CODE): ns
 * each; 0 when there are none. */
WL_PAIR_EXTERN double WL_PAIR_FN(evict_rep)(long n) {
	wl_evict_setup();
	return wl_evict_bytes != 0 || wl_evict_code ? wl_evict_rep(n) : 0;
}
#endif /* WL_PAIR_PREFIX */

#endif /* CUDAPOOL_BENCH_WORKLOADS_H */
