/*
 * gpu/runtime_threads.c - the process's threads one by one while this thread
 * allocates through Go at a Python-like pace (docs/hot-path.md 22): a
 * class-path pair (cudapool_malloc_ctx of 2-8 MiB, which the front does not
 * hold, and the previous block's deferred free) every GAP_NS of busy work
 * for SECS seconds. Per thread that did anything: its name, wake-ups
 * (voluntary switches), preemptions (involuntary ones) and CPU per second;
 * then the totals of the threads other than the caller and the caller's mean
 * call (wall). On the simulator (CUDAPOOL_BACKEND=sim) every other thread is
 * the Go runtime's; on the real driver CUDA's threads show too, by name.
 *
 *   runtime_threads [SECS [GAP_NS]]
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cuda_ctx.h"
#include "cudapool.h"

#define MAXT 512

struct thread {
	int tid;
	char name[32];
	long vol, invol;
	double cpu_s;
};

static int64_t now_ns(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int snapshot(struct thread *t) {
	DIR *d = opendir("/proc/self/task");
	long tick = sysconf(_SC_CLK_TCK);
	struct dirent *e;
	int n = 0;
	while (d != NULL && n < MAXT && (e = readdir(d)) != NULL) {
		if (e->d_name[0] == '.')
			continue;
		char path[300], line[512];
		struct thread *x = &t[n];
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

int main(int argc, char **argv) {
	double secs = argc > 1 ? atof(argv[1]) : 2;
	int64_t gap = argc > 2 ? atoll(argv[2]) : 50000;
	if (cuda_ctx_setup("runtime_threads") != 0)
		return 2;
	void *warm = cudapool_malloc_ctx(1 << 20, 0, NULL, 0);
	cudapool_free_deferred(warm, 0, -1, 0);
	int self = (int)syscall(SYS_gettid);
	static struct thread before[MAXT], after[MAXT];
	int nb = snapshot(before);
	int64_t t0 = now_ns(), end = t0 + (int64_t)(secs * 1e9), in_calls = 0, calls = 0;
	void *prev = NULL;
	for (unsigned i = 0; now_ns() < end; i++) {
		int64_t c0 = now_ns();
		if (prev != NULL)
			cudapool_free_deferred(prev, 0, -1, 0);
		prev = cudapool_malloc_ctx((size_t)(2u + i % 7) << 20, 0, NULL, 0);
		in_calls += now_ns() - c0, calls++;
		int64_t until = now_ns() + gap;
		while (now_ns() < until)
			;
	}
	double el = (double)(now_ns() - t0) / 1e9;
	if (prev != NULL)
		cudapool_free_deferred(prev, 0, -1, 0);
	int na = snapshot(after);
	long wakes = 0;
	double cpu = 0;
	for (int j = 0; j < na; j++) {
		struct thread z = {0};
		for (int k = 0; k < nb; k++)
			if (before[k].tid == after[j].tid)
				z = before[k];
		long dv = after[j].vol - z.vol, di = after[j].invol - z.invol;
		double dc = after[j].cpu_s - z.cpu_s;
		if (after[j].tid != self)
			wakes += dv, cpu += dc;
		if (dv != 0 || di != 0)
			printf("  tid %d %-16s%s: %6.0f wake-ups/s, %5.0f preempted/s, %5.1f%% CPU\n", after[j].tid,
			       after[j].name, after[j].tid == self ? " (caller)" : "", (double)dv / el, (double)di / el,
			       dc / el * 100);
	}
	printf("others: %.0f wake-ups/s, %.1f%% of a CPU; the caller's call %.0f ns (mean of %lld)%s\n",
	       (double)wakes / el, cpu / el * 100, (double)in_calls / (double)calls, (long long)calls,
	       cudapool_last_error() != NULL ? "; error" : "");
	return cudapool_last_error() != NULL;
}
