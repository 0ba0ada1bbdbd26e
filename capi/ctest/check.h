// SPDX-License-Identifier: Apache-2.0
/*
 * check.h - the checks the C test programs share: CHECK(cond, description...)
 * prints one "ok"/"FAIL" line and counts it in passed/failed; err_has tests
 * the calling thread's last cudapool error; snapshot_count counts a string
 * in the snapshot's JSON. Include once per program.
 */
#ifndef CUDAPOOL_CTEST_CHECK_H
#define CUDAPOOL_CTEST_CHECK_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cudapool.h"

#define KiB (1024ULL)
#define MiB (1024ULL * KiB)
#define GiB (1024ULL * MiB)

#define STREAM(n) ((cudapool_stream)(uintptr_t)(n))

static int passed, failed;

static void check_at(int ok, const char *file, int line, const char *what, const char *fmt, ...) {
	char name[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(name, sizeof name, fmt, ap);
	va_end(ap);
	if (ok) {
		passed++;
		printf("ok    %s\n", name);
	} else {
		const char *e = cudapool_last_error();
		failed++;
		printf("FAIL  %s\n      %s:%d: %s\n      last error: %s\n", name, file, line, what, e ? e : "(none)");
	}
	fflush(stdout);
}

/* CHECK(condition, description...) */
#define CHECK(cond, ...) check_at(!!(cond), __FILE__, __LINE__, #cond, __VA_ARGS__)

/* The last error contains sub. */
static int err_has(const char *sub) {
	const char *e = cudapool_last_error();
	return e != NULL && strstr(e, sub) != NULL;
}

/* The snapshot's count of occurrences of sub. */
static inline int snapshot_count(const char *sub) {
	char *js = cudapool_snapshot_json();
	int n = 0;
	for (const char *p = js; p && (p = strstr(p, sub)) != NULL; p += strlen(sub))
		n++;
	cudapool_string_free(js);
	return n;
}

#endif
