/*
 * runtime_tick.c - CALLS calls from C into Go (cudapool_caching, a near
 * no-op), then 350 ms asleep in C, so that GODEBUG=schedtrace=100,
 * scheddetail=1 prints every P's schedule tick after the calls
 * (capi/ctest/runtime_tick.sh reads it).
 */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cudapool.h"

int main(int argc, char **argv) {
	long calls = argc > 1 ? atol(argv[1]) : 3000;
	int sink = 0;
	for (long i = 0; i < calls; i++)
		sink += cudapool_caching();
	struct timespec nap = {0, 350000000};
	nanosleep(&nap, NULL);
	printf("calls %ld (%d)\n", calls, sink > 0);
	return cudapool_last_error() != NULL;
}
