// SPDX-License-Identifier: Apache-2.0
/*
 * replay.c - replays an allocation trace through libcudapool.so and prints
 * what it cost: operations, peak allocated and reserved memory (their ratio
 * is the fragmentation: 1.000 wastes nothing), segments, pages moved by
 * stitching and time per operation, under the configuration in force
 * (CUDAPOOL_CONF or PYTORCH_CUDA_ALLOC_CONF; none: the defaults).
 *
 *   replay TRACE [REPEATS] [DEVICE]
 *
 * Trace format, one operation per line:
 *   a <id> <size> <stream>   allocate size bytes on stream (decimal or 0x hex)
 *   f <id>                   free the allocation id
 *   # ...                    comment
 * Frees of ids never allocated (made before the recording started) are
 * skipped and counted. Allocations still live at the end are freed, then the
 * cache is emptied. Run it with CUDAPOOL_BACKEND=sim to use the simulator
 * (make demo does when there is no GPU).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cudapool.h"

struct op {
	int alloc;      /* 1: allocate, 0: free */
	size_t size;    /* alloc */
	uintptr_t strm; /* alloc */
	long slot;      /* alloc: its own slot; free: the slot of its alloc, -1 if unknown */
};

/* id -> slot, open addressing with linear probing (keys stored +1). */
struct idmap {
	unsigned long long *keys;
	long *vals;
	size_t cap;
};

static size_t idmap_find(struct idmap *m, unsigned long long key) {
	size_t i = (size_t)((key + 1) * 0x9E3779B97F4A7C15ULL) & (m->cap - 1);
	while (m->keys[i] != 0 && m->keys[i] != key + 1)
		i = (i + 1) & (m->cap - 1);
	return i;
}

static void idmap_del(struct idmap *m, size_t i) {
	/* backward-shift deletion keeps probe chains intact */
	size_t j = i;
	m->keys[i] = 0;
	for (;;) {
		j = (j + 1) & (m->cap - 1);
		if (m->keys[j] == 0)
			return;
		size_t home = (size_t)(m->keys[j] * 0x9E3779B97F4A7C15ULL) & (m->cap - 1);
		if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
			m->keys[i] = m->keys[j];
			m->vals[i] = m->vals[j];
			m->keys[j] = 0;
			i = j;
		}
	}
}

static char *read_file(const char *path, size_t *len) {
	FILE *f = fopen(path, "rb");
	if (f == NULL)
		return NULL;
	size_t cap = 1 << 20, n = 0;
	char *buf = malloc(cap + 1);
	size_t r;
	while (buf && (r = fread(buf + n, 1, cap - n, f)) > 0) {
		n += r;
		if (n == cap) {
			cap *= 2;
			buf = realloc(buf, cap + 1);
		}
	}
	fclose(f);
	if (buf)
		buf[n] = 0;
	*len = n;
	return buf;
}

static long long stat_of(int dev, const char *key) {
	char *js = cudapool_memory_stats_json(dev);
	char pat[128];
	snprintf(pat, sizeof pat, "\"%s\":", key);
	const char *p = js ? strstr(js, pat) : NULL;
	long long v = p ? strtoll(p + strlen(pat), NULL, 10) : -1;
	cudapool_string_free(js);
	return v;
}

/* The snapshot's allocator_settings: whether key is true, and the dev-th
 * number of the array key (-1 if absent). */
static int setting_true(const char *js, const char *key) {
	char pat[128];
	snprintf(pat, sizeof pat, "\"%s\":true", key);
	return js != NULL && strstr(js, pat) != NULL;
}

static long long setting_at(const char *js, const char *key, int dev) {
	char pat[128];
	snprintf(pat, sizeof pat, "\"%s\":[", key);
	const char *p = js ? strstr(js, pat) : NULL;
	if (p == NULL)
		return -1;
	p += strlen(pat);
	for (int i = 0; i < dev && p != NULL; i++) {
		p = strchr(p, ',');
		if (p != NULL)
			p++;
	}
	return p != NULL ? strtoll(p, NULL, 10) : -1;
}

static const char *human(long long n, char *buf, size_t sz) {
	if (n < 0)
		snprintf(buf, sz, "n/a");
	else if (n >= (1LL << 30))
		snprintf(buf, sz, "%.2f GiB", (double)n / (1LL << 30));
	else if (n >= (1LL << 20))
		snprintf(buf, sz, "%.2f MiB", (double)n / (1LL << 20));
	else if (n >= 1024)
		snprintf(buf, sz, "%.2f KiB", (double)n / 1024);
	else
		snprintf(buf, sz, "%lld B", n);
	return buf;
}

static double now_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int reject_all(void *ctx, cudapool_stream s) {
	(void)ctx;
	(void)s;
	return 0;
}

int main(int argc, char **argv) {
	if (argc < 2 || argc > 4) {
		fprintf(stderr, "usage: %s TRACE [REPEATS] [DEVICE]\n", argv[0]);
		return 2;
	}
	int repeats = argc > 2 ? atoi(argv[2]) : 1;
	int dev = argc > 3 ? atoi(argv[3]) : 0;
	if (repeats < 1)
		repeats = 1;

	size_t len;
	char *text = read_file(argv[1], &len);
	if (text == NULL) {
		fprintf(stderr, "replay: cannot read %s\n", argv[1]);
		return 1;
	}
	size_t lines = 1;
	for (size_t i = 0; i < len; i++)
		lines += text[i] == '\n';

	struct op *ops = calloc(lines, sizeof *ops);
	struct idmap m = {0};
	m.cap = 1;
	while (m.cap < 2 * lines + 16)
		m.cap <<= 1;
	m.keys = calloc(m.cap, sizeof *m.keys);
	m.vals = calloc(m.cap, sizeof *m.vals);
	if (!ops || !m.keys || !m.vals) {
		fprintf(stderr, "replay: out of memory\n");
		return 1;
	}

	/* Parse, resolving each free to the slot of its allocation. */
	size_t nops = 0, nalloc = 0, nfree = 0, unknown_frees = 0, bad_lines = 0;
	long slots = 0;
	char *save = NULL;
	for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		while (*line == ' ' || *line == '\t')
			line++;
		if (*line == '#' || *line == 0 || *line == '\r')
			continue;
		unsigned long long id, size = 0, strm = 0;
		char *end;
		if (line[0] == 'a' && line[1] == ' ') {
			id = strtoull(line + 2, &end, 0);
			size = strtoull(end, &end, 0);
			strm = strtoull(end, &end, 0);
			size_t i = idmap_find(&m, id);
			m.keys[i] = id + 1; /* a reused id now names the new allocation */
			m.vals[i] = slots;
			ops[nops++] = (struct op){1, (size_t)size, (uintptr_t)strm, slots++};
			nalloc++;
		} else if (line[0] == 'f' && line[1] == ' ') {
			id = strtoull(line + 2, &end, 0);
			size_t i = idmap_find(&m, id);
			if (m.keys[i] == 0) {
				unknown_frees++;
				continue;
			}
			ops[nops++] = (struct op){0, 0, 0, m.vals[i]};
			idmap_del(&m, i);
			nfree++;
		} else {
			bad_lines++;
		}
	}

	void **ptr = calloc((size_t)slots + 1, sizeof *ptr);
	size_t *sizes = calloc((size_t)slots + 1, sizeof *sizes);
	uintptr_t *streams = calloc((size_t)slots + 1, sizeof *streams);
	for (size_t i = 0; i < nops; i++)
		if (ops[i].alloc) {
			sizes[ops[i].slot] = ops[i].size;
			streams[ops[i].slot] = ops[i].strm;
		}

	cudapool_init(-1);
	if (cudapool_last_error() != NULL) {
		fprintf(stderr, "replay: %s\n", cudapool_last_error());
		return 1;
	}
	/* Announce a (never used) private pool, as PyTorch announces captures:
	 * from then on malloc trusts announcements and no longer asks the
	 * driver whether the stream is capturing. That is PyTorch's hot path,
	 * and the trace's stream numbers are not real stream handles. */
	cudapool_begin_allocate_to_pool(dev, 0, 1ULL << 62, reject_all, NULL);
	cudapool_end_allocate_to_pool(dev, 0, 1ULL << 62);
	cudapool_release_pool(dev, 0, 1ULL << 62);
	long long failed = 0, leftover = 0;
	double ns = 0, first_ns = 0;
	for (int r = 0; r < repeats; r++) {
		double t0 = now_ns();
		for (size_t i = 0; i < nops; i++) {
			const struct op *o = &ops[i];
			if (o->alloc) {
				void *p = cudapool_malloc(o->size, dev, (cudapool_stream)o->strm);
				if (p == NULL && o->size > 0 && failed++ == 0)
					fprintf(stderr, "replay: allocation of %zu bytes failed: %s\n", o->size,
					        cudapool_last_error());
				ptr[o->slot] = p;
			} else {
				long s = o->slot;
				if (ptr[s] != NULL) {
					cudapool_free(ptr[s], sizes[s], dev, (cudapool_stream)streams[s]);
					ptr[s] = NULL;
				}
			}
		}
		if (r == 0)
			first_ns = now_ns() - t0;
		else
			ns += now_ns() - t0;
		for (long s = 0; s < slots; s++)
			if (ptr[s] != NULL) {
				cudapool_free(ptr[s], sizes[s], dev, (cudapool_stream)streams[s]);
				ptr[s] = NULL;
				if (r == 0)
					leftover++;
			}
	}

	long long peak_alloc = stat_of(dev, "allocated_bytes.all.peak");
	long long peak_res = stat_of(dev, "reserved_bytes.all.peak");
	long long peak_segs = stat_of(dev, "segment.all.peak");
	long long dev_allocs = stat_of(dev, "num_device_alloc");
	long long retries = stat_of(dev, "num_alloc_retries");
	long long ooms = stat_of(dev, "num_ooms");
	long long now_alloc = stat_of(dev, "allocated_bytes.all.current");
	char *snap = cudapool_snapshot_json();
	int expandable = setting_true(snap, "expandable_segments"), stitch = setting_true(snap, "stitch");
	long long moved = setting_at(snap, "stitch_remaps", dev);
	cudapool_snapshot *cfg = cudapool_snapshot_take(0, 0, 0, 0);
	const char *settings = cfg != NULL && cfg->config.settings != NULL ? cfg->config.settings : "";
	cudapool_empty_cache();
	long long after = stat_of(dev, "reserved_bytes.all.current");
	long long dev_frees = stat_of(dev, "num_device_free"); /* including empty_cache's */

	char b1[32], b2[32], b3[32];
	size_t total = nops * (size_t)repeats;
	printf("cudapool replay of %s on device %d\n", argv[1], dev);
	printf("  %-28s %s (%s)\n", "configuration", *settings ? settings : "the defaults",
	       stitch ? "expandable segments with stitching" : expandable ? "expandable segments, no stitching" : "ordinary segments");
	printf("  %-28s %zu x %d (%zu alloc, %zu free)\n", "operations", nops, repeats, nalloc, nfree);
	if (unknown_frees || bad_lines)
		printf("  %-28s %zu frees of unknown ids, %zu unparsable lines\n", "skipped", unknown_frees, bad_lines);
	printf("  %-28s %lld\n", "failed allocations", failed);
	printf("  %-28s %s\n", "peak allocated", human(peak_alloc, b1, sizeof b1));
	printf("  %-28s %s\n", "peak reserved", human(peak_res, b2, sizeof b2));
	printf("  %-28s %.3f (peak reserved / peak allocated; 1.000 wastes nothing)\n", "fragmentation",
	       peak_alloc > 0 ? (double)peak_res / (double)peak_alloc : 0.0);
	if (expandable)
		printf("  %-28s %lld (expandable segments map pages into reserved ranges, not counted as segments)\n",
		       "segments (peak)", peak_segs);
	else
		printf("  %-28s %lld\n", "segments (peak)", peak_segs);
	if (stitch)
		printf("  %-28s %lld\n", "pages moved by stitching", moved);
	printf("  %-28s %lld allocs, %lld frees, %lld retries, %lld OOMs\n", "driver calls", dev_allocs, dev_frees,
	       retries, ooms);
	printf("  %-28s %.3f ms, %.0f ns per operation (growing the cache)\n", "time, first pass",
	       first_ns / 1e6, nops ? first_ns / (double)nops : 0.0);
	if (repeats > 1)
		printf("  %-28s %.3f ms, %.0f ns per operation (from the cache)\n", "time, later passes", ns / 1e6,
		       total > nops ? ns / (double)(total - nops) : 0.0);
	printf("  %-28s %lld left live by the trace, freed; %s allocated now\n", "at the end", leftover,
	       human(now_alloc, b3, sizeof b3));
	printf("  %-28s %s\n", "reserved after empty_cache", human(after, b1, sizeof b1));
	cudapool_string_free(snap);
	cudapool_snapshot_free(cfg);
	free(ptr);
	free(sizes);
	free(streams);
	free(ops);
	free(m.keys);
	free(m.vals);
	free(text);
	return failed == 0 && now_alloc == 0 ? 0 : 1;
}
