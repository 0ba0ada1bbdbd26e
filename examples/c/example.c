// SPDX-License-Identifier: Apache-2.0
/*
 * example.c - a C program using an installed libcudapool:
 *
 *   cc example.c $(pkg-config --cflags --libs cudapool) -o example
 *   CUDAPOOL_BACKEND=sim ./example      (on the simulator; on a GPU without it)
 *
 * It checks that the header it was compiled with and the library it runs
 * with are the same version, allocates a few blocks on one stream, frees
 * them, and shows that freed memory stays cached until cudapool_empty_cache.
 * Prints "example: ok" and exits 0 on success.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cudapool.h>

static int fail(const char *what) {
	const char *e = cudapool_last_error();
	fprintf(stderr, "example: %s: %s\n", what, e ? e : "(no error recorded)");
	return 1;
}

/* Reserved bytes of device 0, from the statistics (-1 if unknown). */
static long long reserved(void) {
	cudapool_device_stats st;
	if (cudapool_get_device_stats(0, &st) != 0)
		return -1;
	return (long long)st.reserved_bytes[0].current;
}

int main(void) {
	const char *v = cudapool_version();
	printf("header %s (ABI %d), library %s (ABI %d)\n", CUDAPOOL_VERSION_STRING, CUDAPOOL_ABI_VERSION,
	       v ? v : "?", cudapool_abi_version());
	if (v == NULL || strcmp(v, CUDAPOOL_VERSION_STRING) != 0 || cudapool_abi_version() != CUDAPOOL_ABI_VERSION) {
		fprintf(stderr, "example: the library is not the version of the header\n");
		return 1;
	}

	cudapool_stream stream = NULL; /* the legacy default stream (a cudaStream_t works too) */
	size_t sizes[] = {512, 1 << 20, 3 << 20, 40 << 20};
	void *p[4];
	for (int i = 0; i < 4; i++) {
		p[i] = cudapool_malloc(sizes[i], 0, stream);
		if (p[i] == NULL)
			return fail("cudapool_malloc");
	}
	for (int i = 0; i < 4; i++)
		cudapool_free(p[i], sizes[i], 0, stream);
	long long cached = reserved();
	printf("after free: %lld bytes reserved (cached for reuse)\n", cached);
	if (cached <= 0)
		return fail("nothing cached after free");

	void *q = cudapool_malloc(1 << 20, 0, stream); /* reuses a cached block: no driver call */
	if (q == NULL)
		return fail("cudapool_malloc");
	cudapool_free(q, 1 << 20, 0, stream);
	if (reserved() != cached)
		return fail("a cached block was not reused");

	cudapool_empty_cache();
	printf("after empty_cache: %lld bytes reserved\n", reserved());
	if (reserved() != 0)
		return fail("empty_cache kept memory");
	printf("example: ok\n");
	return 0;
}
