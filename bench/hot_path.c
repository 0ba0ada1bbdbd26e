// SPDX-License-Identifier: Apache-2.0
/*
 * hot_path.c - where one cache-hit malloc+free pair spends its time, seen
 * from C (docs/hot-path.md): the cost of a call, of a call into Go (on a
 * thread whose Go M is warm, and the first call of a new thread), the pair
 * as PyTorch's C++ class makes it (cudapool_malloc_ctx, then
 * cudapool_free_deferred), the pair as a C program makes it
 * (cudapool_malloc, cudapool_free), and the PyTorch-class pair after other
 * memory was touched (as the Python interpreter does between allocations),
 * and a call into Go after the thread slept in C for 1, 10 and 30 ms (a
 * Python step that allocates nothing for that long; at 30 ms also with
 * warm_runtime:False, capi/warm's keeper off). Last, what the Go runtime's
 * own threads do while a caller allocates at a Python-like pace (a malloc
 * through Go every 50 us of busy work, 0.5 s a round): their wake-ups and
 * CPU time per second, the caller's involuntary switches and its mean call
 * (docs/hot-path.md, "The Go runtime between calls"). The pairs are served by the
 * front cache (allocator/front.go: no call into Go); the "front off" rows
 * are the same pairs with front_cache:False, through Go (the class path's
 * free is queued and performed by the next malloc: one call into Go; the C
 * API's: two).
 *
 *   hot_path [ROUNDS]      (CUDAPOOL_BACKEND=sim: the simulator, no GPU)
 *   hot_path --threads [SECS]   one paced run of SECS s (default 2), the
 *                          process's threads listed by name: on the
 *                          simulator every other thread is the Go runtime's,
 *                          on the driver CUDA's show too
 *
 * Loop rows are thread CPU time per operation; the rounds are interleaved
 * and the table shows the median and min-max over rounds. Rows of single
 * operations ("first call", "after touching") time each one with
 * CLOCK_MONOTONIC, less the clock's own cost, and show the median.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cudapool.h"

typedef int CUresult;
typedef struct CUctx_st *CUcontext;
static CUcontext cuda_ctx;
static CUresult (*cuda_ctx_set_current)(CUcontext);

/* cuda_ctx_setup retains device 0's primary context and makes it current,
 * as PyTorch has it (nothing under CUDAPOOL_BACKEND=sim); 0, or -1 after
 * saying why on stderr (prog names the program). cuda_ctx_enter makes it
 * current on another thread. */
static int cuda_ctx_setup(const char *prog) {
	const char *backend = getenv("CUDAPOOL_BACKEND");
	if (backend != NULL && strcmp(backend, "sim") == 0)
		return 0;
	void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
	if (h == NULL) {
		fprintf(stderr, "%s: no libcuda.so.1 (%s); set CUDAPOOL_BACKEND=sim to use the simulator\n", prog,
		        dlerror());
		return -1;
	}
	CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(h, "cuInit");
	CUresult (*device_get)(int *, int) = (CUresult(*)(int *, int))dlsym(h, "cuDeviceGet");
	CUresult (*retain)(CUcontext *, int) = (CUresult(*)(CUcontext *, int))dlsym(h, "cuDevicePrimaryCtxRetain");
	cuda_ctx_set_current = (CUresult(*)(CUcontext))dlsym(h, "cuCtxSetCurrent");
	int dev;
	if (!init || !device_get || !retain || !cuda_ctx_set_current || init(0) || device_get(&dev, 0) ||
	    retain(&cuda_ctx, dev) || cuda_ctx_set_current(cuda_ctx)) {
		fprintf(stderr, "%s: CUDA driver setup failed\n", prog);
		return -1;
	}
	return 0;
}

static void cuda_ctx_enter(void) {
	if (cuda_ctx_set_current != NULL)
		cuda_ctx_set_current(cuda_ctx);
}

static int64_t now_ns(clockid_t c) {
	struct timespec ts;
	clock_gettime(c, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
	qsort(v, (size_t)n, sizeof *v, cmp_d);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- the operations ---- */

__attribute__((noinline)) static void c_nop(void) { __asm__ volatile(""); }
static void (*volatile c_nop_ptr)(void) = c_nop;
static volatile unsigned sink;

static void op_c_call(void) { c_nop_ptr(); }
static void op_lib_c(void) { sink += cudapool_gather_mask(); }
static void op_go_nop(void) { sink += (unsigned)cudapool_caching(); }

static void op_pair_torch(void) {
	void *p = cudapool_malloc_ctx(4096, 0, NULL, 0);
	cudapool_free_deferred(p, 0, -1, 0); /* performed by the next malloc */
}

static void op_pair_c(void) {
	void *p = cudapool_malloc(4096, 0, NULL);
	cudapool_free(p, 4096, 0, NULL);
}

static double cpu_per_op(void (*fn)(void), int n) {
	int64_t t0 = now_ns(CLOCK_THREAD_CPUTIME_ID);
	for (int i = 0; i < n; i++)
		fn();
	return (double)(now_ns(CLOCK_THREAD_CPUTIME_ID) - t0) / n;
}

/* Median wall time of single calls of fn, each after prepare(arg), less the
 * clock's own cost. */
static double timed_after(void (*prepare)(void *), void *arg, void (*fn)(void), int n) {
	double *op = malloc(sizeof(double) * (size_t)n), *clk = malloc(sizeof(double) * (size_t)n);
	for (int i = 0; i < n; i++) {
		prepare(arg);
		int64_t t0 = now_ns(CLOCK_MONOTONIC);
		int64_t t1 = now_ns(CLOCK_MONOTONIC);
		fn();
		int64_t t2 = now_ns(CLOCK_MONOTONIC);
		clk[i] = (double)(t1 - t0);
		op[i] = (double)(t2 - t1);
	}
	double r = median(op, n) - median(clk, n);
	free(op);
	free(clk);
	return r;
}

/* Touches one byte per cache line of a buffer (evicting the caller's
 * working set), or sleeps, before a timed call. */
struct evict_buf {
	char *p;
	size_t len;
};

static void touch(void *arg) {
	struct evict_buf *b = arg;
	for (size_t j = 0; j < b->len; j += 64)
		b->p[j]++;
}

static void sleep_ns(void *arg) {
	int64_t gap_ns = *(int64_t *)arg;
	struct timespec ts = {gap_ns / 1000000000, gap_ns % 1000000000};
	nanosleep(&ts, NULL);
}

/* Median wall time of fn after touching evict_len bytes. */
static double after_touch(void (*fn)(void), char *evict, size_t evict_len, int n) {
	struct evict_buf b = {evict, evict_len};
	return timed_after(touch, &b, fn, n);
}

/* Median wall time of a call into Go after sleeping gap_ns in C. */
static double after_gap(int64_t gap_ns, int n) { return timed_after(sleep_ns, &gap_ns, op_go_nop, n); }

/* First and second call into Go on a new thread. */
struct first_call {
	double first, second;
};

static void *first_call_thread(void *arg) {
	struct first_call *fc = arg;
	cuda_ctx_enter();
	int64_t t0 = now_ns(CLOCK_MONOTONIC);
	int64_t t1 = now_ns(CLOCK_MONOTONIC);
	op_go_nop();
	int64_t t2 = now_ns(CLOCK_MONOTONIC);
	op_go_nop();
	int64_t t3 = now_ns(CLOCK_MONOTONIC);
	fc->first = (double)(t2 - t1) - (double)(t1 - t0);
	fc->second = (double)(t3 - t2) - (double)(t1 - t0);
	return NULL;
}

enum {
	R_C_CALL,
	R_LIB_C,
	R_GO_NOP,
	R_GO_FIRST,
	R_GO_SECOND,
	R_GO_GAP1,
	R_GO_GAP10,
	R_GO_GAP30,
	R_GO_GAP30_COLD,
	R_PAIR_TORCH,
	R_PAIR_C,
	R_TOUCH_S,
	R_TOUCH_L,
	R_PAIR_TORCH_GO,
	R_PAIR_C_GO,
	R_TOUCH_S_GO,
	NROWS
};
static const char *row_names[NROWS] = {
    "C call through a pointer (loop floor)",
    "C function in libcudapool (PLT call)",
    "call into Go, warm thread (near no-op)",
    "call into Go, first on a new thread",
    "call into Go, second on that thread",
    "call into Go after 1 ms asleep in C",
    "call into Go after 10 ms asleep in C",
    "call into Go after 30 ms asleep in C",
    "after 30 ms asleep, warm_runtime:False",
    "pair, PyTorch class path",
    "pair, C API",
    "class-path pair after 2 MiB touched",
    "class-path pair after 8 MiB touched",
    "pair, class path, front off (1 Go call)",
    "pair, C API, front off (2 Go calls)",
    "class pair, 2 MiB touched, front off",
};
static const char *row_units[NROWS] = {"cpu", "cpu", "cpu", "wall", "wall", "wall", "wall", "wall", "wall",
                                       "cpu", "cpu", "wall", "wall", "cpu", "cpu", "wall"};

/* warm switches capi/warm's keeper on or off: off, a call after more than
 * 10 ms in C wakes the Go runtime's sysmon (docs/hot-path.md, "The Go
 * runtime between calls"). */
/* ---- the runtime's threads under a paced caller ---- */

/* One thread of this process as /proc tells it: switches and CPU so far. */
struct proc_thread {
	int tid;
	char name[32];
	long vol, invol; /* voluntary switches (wake-ups), involuntary (preempted) */
	double cpu_s;
};
enum { MAXT = 512 };

/* read_threads fills t with the process's threads (at most MAXT); returns how many. */
static int read_threads(struct proc_thread *t) {
	DIR *d = opendir("/proc/self/task");
	long tick = sysconf(_SC_CLK_TCK);
	struct dirent *e;
	int n = 0;
	while (d != NULL && n < MAXT && (e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		char path[300], line[512];
		struct proc_thread *x = &t[n];
		memset(x, 0, sizeof *x);
		x->tid = atoi(e->d_name);
		snprintf(path, sizeof path, "/proc/self/task/%s/status", e->d_name);
		FILE *f = fopen(path, "r");
		if (f == NULL)
			continue;
		while (fgets(line, sizeof line, f) != NULL) {
			sscanf(line, "Name: %31s", x->name);
			sscanf(line, "voluntary_ctxt_switches: %ld", &x->vol);
			sscanf(line, "nonvoluntary_ctxt_switches: %ld", &x->invol);
		}
		fclose(f);
		snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
		if ((f = fopen(path, "r")) != NULL) {
			unsigned long ut = 0, st = 0;
			char *p = fgets(line, sizeof line, f) != NULL ? strrchr(line, ')') : NULL;
			/* after the name: utime and stime are the 12th and 13th fields */
			if (p != NULL && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) == 2)
				x->cpu_s = (double)(ut + st) / (double)tick;
			fclose(f);
		}
		n++;
	}
	if (d != NULL)
		closedir(d);
	return n;
}

/* A paced caller's run: the process's threads before and after, per second
 * of it, and the caller's mean call. */
struct paced {
	struct proc_thread before[MAXT], after[MAXT];
	int nb, na, self;
	double secs, call_ns; /* call_ns: a malloc with the previous block's free, wall */
};

/* delta is thread j of p->after less its state before (zero if it is new). */
static struct proc_thread delta(const struct paced *p, int j) {
	struct proc_thread d = p->after[j];
	for (int k = 0; k < p->nb; k++)
		if (p->before[k].tid == d.tid) {
			d.vol -= p->before[k].vol, d.invol -= p->before[k].invol, d.cpu_s -= p->before[k].cpu_s;
			break;
		}
	return d;
}

/* The threads other than the caller, summed, per second: wake-ups and CPU;
 * and the caller's preemptions per second. In this program every other
 * thread is the Go runtime's (and, on the driver, CUDA's). */
struct threads {
	double wakeups, cpu_s, caller_preempted;
};

static struct threads totals(const struct paced *p) {
	struct threads t = {0, 0, 0};
	for (int j = 0; j < p->na; j++) {
		struct proc_thread d = delta(p, j);
		if (d.tid == p->self)
			t.caller_preempted += (double)d.invol / p->secs;
		else
			t.wakeups += (double)d.vol / p->secs, t.cpu_s += d.cpu_s / p->secs;
	}
	return t;
}

static void busy_ns(int64_t ns) {
	int64_t end = now_ns(CLOCK_MONOTONIC) + ns;
	while (now_ns(CLOCK_MONOTONIC) < end)
		;
}

/* paced_caller allocates through Go (sizes the front does not hold, freed
 * by the next malloc, as the class path frees) every gap_ns of busy work
 * for secs seconds, recording the threads before and after into p. */
static void paced_caller(int64_t gap_ns, double secs, struct paced *p) {
	p->self = (int)syscall(SYS_gettid);
	p->nb = read_threads(p->before);
	int64_t t0 = now_ns(CLOCK_MONOTONIC), end = t0 + (int64_t)(secs * 1e9);
	void *prev = NULL;
	int64_t in_calls = 0, calls = 0;
	for (unsigned i = 0; now_ns(CLOCK_MONOTONIC) < end; i++) {
		int64_t c0 = now_ns(CLOCK_MONOTONIC);
		if (prev != NULL)
			cudapool_free_deferred(prev, 0, -1, 0);
		prev = cudapool_malloc_ctx((size_t)(2u + i % 7) << 20, 0, NULL, 0);
		in_calls += now_ns(CLOCK_MONOTONIC) - c0, calls++;
		busy_ns(gap_ns);
	}
	if (prev != NULL)
		cudapool_free_deferred(prev, 0, -1, 0);
	p->secs = (double)(now_ns(CLOCK_MONOTONIC) - t0) / 1e9;
	p->call_ns = calls > 0 ? (double)in_calls / (double)calls : 0;
	p->na = read_threads(p->after);
}

/* threads_mode (hot_path --threads [SECS]): one paced run of SECS seconds
 * (default 2), every thread that did anything listed by name. */
static int threads_mode(double secs) {
	static struct paced p;
	void *w = cudapool_malloc_ctx(1 << 20, 0, NULL, 0); /* the runtime and the device started */
	cudapool_free_deferred(w, 0, -1, 0);
	paced_caller(50000, secs, &p);
	for (int j = 0; j < p.na; j++) {
		struct proc_thread d = delta(&p, j);
		if (d.vol != 0 || d.invol != 0)
			printf("  tid %d %-16s%s: %6.0f wake-ups/s, %5.0f preempted/s, %5.1f%% CPU\n", d.tid, d.name,
			       d.tid == p.self ? " (caller)" : "", (double)d.vol / p.secs, (double)d.invol / p.secs,
			       d.cpu_s / p.secs * 100);
	}
	struct threads t = totals(&p);
	printf("others: %.0f wake-ups/s, %.1f%% of a CPU; the caller's call %.0f ns\n", t.wakeups, t.cpu_s * 100,
	       p.call_ns);
	if (cudapool_last_error() != NULL) {
		fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
		return 2;
	}
	return 0;
}

static int warm(int on) {
	return cudapool_configure_update(on ? "warm_runtime:True" : "warm_runtime:False");
}

/* front switches the front cache on or off (a live configuration update). */
static int front(int on) {
	return cudapool_configure_update(on ? "front_cache:True" : "front_cache:False");
}

int main(int argc, char **argv) {
	if (cuda_ctx_setup("hot_path") != 0)
		return 2;
	if (argc > 1 && strcmp(argv[1], "--threads") == 0)
		return threads_mode(argc > 2 ? atof(argv[2]) : 2);
	int rounds = argc > 1 ? atoi(argv[1]) : 7;
	if (rounds < 1)
		rounds = 1;
	cudapool_init(-1);
	if (cudapool_last_error() != NULL) {
		fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
		return 2;
	}
	cudapool_expect_announced_captures(); /* as under PyTorch: no capture query per malloc */
	op_pair_torch();
	op_pair_c();
	if (cudapool_last_error() != NULL) {
		fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
		return 2;
	}
	size_t small = 2u << 20, large = 8u << 20; /* more takes milliseconds: the 'asleep' rows' effect */
	char *evict = calloc(1, large);
	double *res[NROWS];
	for (int r = 0; r < NROWS; r++)
		res[r] = calloc((size_t)rounds, sizeof(double));
	enum { THREADS = 50 };
	double *wakeups = calloc((size_t)rounds, sizeof(double)), *cpu = calloc((size_t)rounds, sizeof(double)),
	       *preempted = calloc((size_t)rounds, sizeof(double)), *paced = calloc((size_t)rounds, sizeof(double));
	for (int k = 0; k < rounds; k++) {
		res[R_C_CALL][k] = cpu_per_op(op_c_call, 2000000);
		res[R_LIB_C][k] = cpu_per_op(op_lib_c, 2000000);
		res[R_GO_NOP][k] = cpu_per_op(op_go_nop, 500000);
		res[R_PAIR_TORCH][k] = cpu_per_op(op_pair_torch, 300000);
		res[R_PAIR_C][k] = cpu_per_op(op_pair_c, 300000);
		res[R_TOUCH_S][k] = after_touch(op_pair_torch, evict, small, 3000);
		res[R_TOUCH_L][k] = after_touch(op_pair_torch, evict, large, 1000);
		if (front(0) != 0) {
			fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
			return 2;
		}
		res[R_PAIR_TORCH_GO][k] = cpu_per_op(op_pair_torch, 300000);
		res[R_PAIR_C_GO][k] = cpu_per_op(op_pair_c, 300000);
		res[R_TOUCH_S_GO][k] = after_touch(op_pair_torch, evict, small, 3000);
		if (front(1) != 0) {
			fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
			return 2;
		}
		res[R_GO_GAP1][k] = after_gap(1000000, 50);
		res[R_GO_GAP10][k] = after_gap(10000000, 15);
		res[R_GO_GAP30][k] = after_gap(30000000, 9);
		if (warm(0) != 0) {
			fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
			return 2;
		}
		res[R_GO_GAP30_COLD][k] = after_gap(30000000, 9);
		if (warm(1) != 0) {
			fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
			return 2;
		}
		double first[THREADS], second[THREADS];
		for (int i = 0; i < THREADS; i++) {
			struct first_call fc;
			pthread_t th;
			pthread_create(&th, NULL, first_call_thread, &fc);
			pthread_join(th, NULL);
			first[i] = fc.first;
			second[i] = fc.second;
		}
		res[R_GO_FIRST][k] = median(first, THREADS);
		res[R_GO_SECOND][k] = median(second, THREADS);
		static struct paced pc;
		paced_caller(50000, 0.5, &pc);
		struct threads pt = totals(&pc);
		wakeups[k] = pt.wakeups, cpu[k] = pt.cpu_s * 100, preempted[k] = pt.caller_preempted;
		paced[k] = pc.call_ns;
	}
	if (cudapool_last_error() != NULL) {
		fprintf(stderr, "hot_path: %s\n", cudapool_last_error());
		return 2;
	}
	printf("libcudapool hot path, ns per operation: median of %d interleaved rounds (min-max)\n", rounds);
	printf("%-40s %5s %22s\n", "operation", "clock", "ns");
	for (int r = 0; r < NROWS; r++) {
		double mn = res[r][0], mx = res[r][0];
		for (int k = 1; k < rounds; k++) {
			mn = res[r][k] < mn ? res[r][k] : mn;
			mx = res[r][k] > mx ? res[r][k] : mx;
		}
		char cell[64];
		snprintf(cell, sizeof cell, "%.1f (%.1f-%.1f)", median(res[r], rounds), mn, mx);
		printf("%-40s %5s %22s\n", row_names[r], row_units[r], cell);
	}
	/* median sorts: the minimum and maximum are then the ends */
	double mw = median(wakeups, rounds), mc = median(cpu, rounds), mp = median(preempted, rounds),
	       mpc = median(paced, rounds);
	printf("Go runtime's threads while a caller allocates through Go every 50 us, per second, median (min-max):\n"
	       "  %.0f wake-ups (%.0f-%.0f), %.1f%% of a CPU (%.1f-%.1f), the caller preempted %.0f times (%.0f-%.0f)\n"
	       "  that caller's call (malloc + the previous block's deferred free, wall): %.0f ns (%.0f-%.0f)\n",
	       mw, wakeups[0], wakeups[rounds - 1], mc, cpu[0], cpu[rounds - 1], mp, preempted[0], preempted[rounds - 1],
	       mpc, paced[0], paced[rounds - 1]);
	return 0;
}
