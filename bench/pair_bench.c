// SPDX-License-Identifier: Apache-2.0
/*
 * pair_bench.c - cudapool and PyTorch's native allocator in one process,
 * their C-level reps alternated (docs/benchmarks.md, "The measures").
 *
 * The benchmark's GPU host runs each process (or a few seconds of one) either
 * fast or 1.5-1.9x slower, per core and at random; two processes started
 * together on different cores do not share the state.
 * A ratio of medians over a handful of separate processes therefore moves by
 * tens of percent between runs. Here both allocators live in one process on
 * one thread and their reps alternate (A B B A A B ...), each rep about
 * 0.1 s, so the two reps of a pair run in the same state of the host; the
 * ratio of each adjacent pair is what this program reports, with its median.
 *
 * Linked from bench/c_bench.c compiled with -DWL_PAIR_PREFIX=cp (cudapool)
 * and bench/native_bench.cpp with -DWL_PAIR_PREFIX=nat (PyTorch's allocator
 * as chosen by PYTORCH_CUDA_ALLOC_CONF); bench/run_bench.sh builds and runs
 * it. For testing without a GPU, both sides can be c_bench.c on cudapool's
 * simulator (-DWL_PAIR_PREFIX=nat for the second, -DPAIR_SIM).
 *
 *   pair_bench [--reps N] [--hot-pairs N] [--mixed-pairs N] [--sections hot,mixed]
 *
 * Output: one JSON line per section ("kind":"pair"): each side's per-rep ns,
 * the per-pair ratios cudapool/native, their median, each side's median.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *cp_init(char *name, size_t name_len);
double cp_hot_rep(long n);
const char *cp_mixed_begin(void);
double cp_mixed_rep(long n);
void cp_mixed_end(void);
const char *nat_init(char *name, size_t name_len);
double nat_hot_rep(long n);
const char *nat_mixed_begin(void);
double nat_mixed_rep(long n);
void nat_mixed_end(void);
double cp_evict_rep(long n);
double nat_evict_rep(long n);
#ifndef PAIR_SIM
void nat_prepare(void);
#endif

#define MAXREPS 64

/* Prints s as the body of a JSON string (errors may hold quotes). */
static void print_json_text(const char *s) {
	for (; *s; s++)
		putchar(*s == '"' || *s == '\\' ? '\'' : (unsigned char)*s < 0x20 ? ' ' : *s);
}

static int cmp_double(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static double median(const double *v, int n) {
	double s[MAXREPS];
	memcpy(s, v, sizeof(double) * (size_t)n);
	qsort(s, (size_t)n, sizeof(double), cmp_double);
	return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

static void print_array(const char *key, const double *v, int n) {
	printf(",\"%s\":[", key);
	for (int i = 0; i < n; i++)
		printf("%s%.4g", i ? "," : "", v[i]);
	printf("]");
}

/* Runs reps pairs of one rep of each side, alternating which goes first, and
 * prints the section's line. 0 on success. */
static int run_pairs(const char *section, double (*cp)(long), double (*nat)(long), long n, int reps) {
	double a[MAXREPS], b[MAXREPS], r[MAXREPS];
	for (int i = 0; i < reps; i++) {
		/* A B, B A, A B, ...: neither side always runs right after the other. */
		if (i % 2 == 0) {
			a[i] = cp(n);
			b[i] = nat(n);
		} else {
			b[i] = nat(n);
			a[i] = cp(n);
		}
		if (a[i] < 0 || b[i] < 0) {
			printf("{\"kind\":\"pair\",\"section\":\"%s\",\"error\":\"%s failed in rep %d\"}\n", section,
			       a[i] < 0 ? "cudapool" : "native", i);
			return 1;
		}
		r[i] = a[i] / b[i];
	}
	printf("{\"kind\":\"pair\",\"section\":\"%s\",\"pairs_per_rep\":%ld,\"ratio\":%.4f,\"cudapool_ns\":%.2f,"
	       "\"native_ns\":%.2f",
	       section, n, median(r, reps), median(a, reps), median(b, reps));
	print_array("ratio_reps", r, reps);
	print_array("cudapool_reps_ns", a, reps);
	print_array("native_reps_ns", b, reps);
	printf("}\n");
	fprintf(stderr, "[%s] cudapool/native %.3f (reps %d: cudapool %.1f ns, native %.1f ns)\n", section, median(r, reps),
	        reps, median(a, reps), median(b, reps));
	fflush(stdout);
	return 0;
}

int main(int argc, char **argv) {
	int reps = 15, hot = 1, mixed = 1;
	long hot_pairs = 300000, mixed_pairs = 100000;
	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		int ok = v != NULL;
		if (strcmp(argv[i], "--reps") == 0 && ok)
			ok = (reps = atoi(v)) > 0 && reps <= MAXREPS;
		else if (strcmp(argv[i], "--hot-pairs") == 0 && ok)
			ok = (hot_pairs = atol(v)) > 0;
		else if (strcmp(argv[i], "--mixed-pairs") == 0 && ok)
			ok = (mixed_pairs = atol(v)) > 0;
		else if (strcmp(argv[i], "--sections") == 0 && ok) {
			hot = strstr(v, "hot") != NULL;
			mixed = strstr(v, "mixed") != NULL;
			ok = hot || mixed;
		} else
			ok = 0;
		if (!ok) {
			fprintf(stderr, "usage: %s [--reps N<=%d] [--hot-pairs N] [--mixed-pairs N] [--sections hot,mixed]\n",
			        argv[0], MAXREPS);
			return 2;
		}
		i++;
	}
#ifndef PAIR_SIM
	nat_prepare();
#endif
	char cp_name[128] = "", nat_name[128] = "";
	const char *err = nat_init(nat_name, sizeof nat_name);
	if (err == NULL)
		err = cp_init(cp_name, sizeof cp_name);
	if (err != NULL) {
		printf("{\"kind\":\"pair\",\"section\":\"init\",\"error\":\"");
		print_json_text(err);
		printf("\"}\n");
		return 1;
	}
	printf("{\"kind\":\"pair\",\"section\":\"init\",\"cudapool\":\"%s\",\"native\":\"%s\",\"reps\":%d}\n", cp_name,
	       nat_name, reps);
	fprintf(stderr, "pair_bench: %s against %s, %d reps each\n", cp_name, nat_name, reps);
	int failed = 0;
	if (hot) {
		if (cp_hot_rep(10000) < 0 || nat_hot_rep(10000) < 0) {
			printf("{\"kind\":\"pair\",\"section\":\"hot\",\"error\":\"warm-up failed\"}\n");
			failed = 1;
		} else {
			failed |= run_pairs("hot", cp_hot_rep, nat_hot_rep, hot_pairs, reps);
		}
	}
	if (mixed) {
		const char *e = cp_mixed_begin();
		if (e == NULL)
			e = nat_mixed_begin();
		if (e != NULL) {
			printf("{\"kind\":\"pair\",\"section\":\"mixed\",\"error\":\"setup: ");
			print_json_text(e);
			printf("\"}\n");
			failed = 1;
		} else {
			failed |= run_pairs("mixed", cp_mixed_rep, nat_mixed_rep, mixed_pairs, reps);
			/* WL_EVICT_KB / WL_EVICT_CODE (bench/workloads.h): what the
			 * evictions in those pairs cost alone, to subtract. */
			if (cp_evict_rep(1) > 0) {
				double e[MAXREPS];
				for (int i = 0; i < reps; i++)
					e[i] = i % 2 ? nat_evict_rep(mixed_pairs) : cp_evict_rep(mixed_pairs);
				printf("{\"kind\":\"pair\",\"section\":\"evict\",\"evict_kb\":\"%s\",\"evict_code\":\"%s\","
				       "\"evict_ns\":%.2f",
				       getenv("WL_EVICT_KB") ? getenv("WL_EVICT_KB") : "0",
				       getenv("WL_EVICT_CODE") ? getenv("WL_EVICT_CODE") : "0", median(e, reps));
				print_array("evict_reps_ns", e, reps);
				printf("}\n");
				fprintf(stderr, "[evict] %.1f ns per eviction\n", median(e, reps));
			}
		}
		cp_mixed_end();
		nat_mixed_end();
	}
	return failed;
}
