// SPDX-License-Identifier: Apache-2.0
// native_bench.cpp - the C-level workloads of bench/workloads.h through
// PyTorch's CUDA allocator in libc10_cuda:
// c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete.
//
//   PYTORCH_CUDA_ALLOC_CONF=...  native_bench --config NAME [workloads.h options]
//
// The allocator behind those functions is chosen by libc10_cuda from
// PYTORCH_CUDA_ALLOC_CONF when the library loads: "" is the native caching
// allocator, "expandable_segments:True" the same with expandable segments,
// "backend:cudaMallocAsync" the cudaMallocAsync allocator. Streams come from
// c10's stream pool (non-blocking, as PyTorch's side streams).
//
// Built by bench/run_bench.sh with g++ against torch's headers and
// libc10_cuda / libc10 (no libtorch, no Python). Define NB_EXTRAS to also
// report, after the trace, how many segments are expandable (a check that
// the configuration took effect); the script falls back to a build without
// it if that part of the API does not compile.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "workloads.h"

namespace cca = c10::cuda::CUDACachingAllocator;

static thread_local std::string g_err;

static void set_err(const char *what, const std::exception &e) {
	g_err = std::string(what) + ": " + e.what();
	// c10 errors carry a long backtrace after the first line.
	size_t nl = g_err.find('\n');
	if (nl != std::string::npos)
		g_err.resize(nl);
}

static const char *bk_last_error(void) {
	return g_err.c_str();
}

static int bk_init(char *name, size_t name_len) {
	try {
		int n = static_cast<int>(c10::cuda::device_count());
		if (n < 1) {
			g_err = "no CUDA device";
			return -1;
		}
		cca::init(n);
		std::snprintf(name, name_len, "%s", cca::name().c_str());
		// First use (creates the context and the stream pools).
		void *p = cca::raw_alloc_with_stream(512, nullptr);
		cca::raw_delete(p);
		return 0;
	} catch (const std::exception &e) {
		set_err("init", e);
		return -1;
	}
}

static void *bk_malloc(size_t size, bk_stream s) {
	try {
		return cca::raw_alloc_with_stream(size, static_cast<cudaStream_t>(s));
	} catch (const std::exception &e) {
		set_err("raw_alloc_with_stream", e);
		return nullptr;
	}
}

static void bk_free(void *p, size_t size, bk_stream s) {
	(void)size;
	(void)s;
	try {
		cca::raw_delete(p);
	} catch (const std::exception &e) {
		set_err("raw_delete", e);
	}
}

static bk_stream bk_stream_new(void) {
	try {
		c10::cuda::CUDAStream s = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(0));
		return static_cast<bk_stream>(s.stream());
	} catch (const std::exception &e) {
		set_err("getStreamFromPool", e);
		return nullptr;
	}
}

static void bk_thread_enter(void) {
	// The device is 0 on a new thread already (cudaGetDevice's default).
}

static void bk_empty_cache(void) {
	try {
		cca::emptyCache();
	} catch (const std::exception &e) {
		set_err("emptyCache", e);
	}
}

static void bk_sync(void) {
	try {
		c10::cuda::device_synchronize();
	} catch (const std::exception &e) {
		set_err("device_synchronize", e);
	}
}

static int bk_stats(long long *cur_res, long long *peak_alloc, long long *peak_res, long long *peak_segs) {
	try {
		auto st = cca::getDeviceStats(0);
		// Index 0 is StatType::AGGREGATE ("all").
		*cur_res = static_cast<long long>(st.reserved_bytes[0].current);
		*peak_alloc = static_cast<long long>(st.allocated_bytes[0].peak);
		*peak_res = static_cast<long long>(st.reserved_bytes[0].peak);
		*peak_segs = static_cast<long long>(st.segment[0].peak);
		return 0;
	} catch (const std::exception &e) {
		set_err("getDeviceStats", e);
		return -1;
	}
}

static int bk_current(long long *alloc, long long *res) {
	try {
		auto st = cca::getDeviceStats(0);
		*alloc = static_cast<long long>(st.allocated_bytes[0].current);
		*res = static_cast<long long>(st.reserved_bytes[0].current);
		return 0;
	} catch (const std::exception &e) {
		set_err("getDeviceStats", e);
		return -1;
	}
}

static void bk_trace_extras(char *buf, size_t len) {
	buf[0] = 0;
	try {
		auto st = cca::getDeviceStats(0);
		std::snprintf(buf, len, "\"trace_alloc_retries\":%lld", static_cast<long long>(st.num_alloc_retries));
	} catch (const std::exception &) {
	}
#ifdef NB_EXTRAS
	try {
		auto snap = cca::snapshot();
		long long segs = 0, expandable = 0;
		for (const auto &seg : snap.segments) {
			segs++;
			expandable += seg.is_expandable ? 1 : 0;
		}
		size_t o = std::strlen(buf);
		std::snprintf(buf + o, len - o, "%s\"trace_segments_now\":%lld,\"trace_expandable_segments_now\":%lld",
		              o ? "," : "", segs, expandable);
	} catch (const std::exception &) {
	}
#endif
}

// In a program without ATen's CUDA library, c10's "has primary context"
// hook is a stub that throws ("Should never been called"); getStreamFromPool
// and the cudaMallocAsync backend reach it. ATen's CUDAHooks registers the
// real one at load; this program registers a trivial one instead (the
// primary context exists: the allocator made it current).
namespace c10::cuda::_internal {
void setHasPrimaryContext(bool (*func)(c10::DeviceIndex));
}

static bool has_primary_context(c10::DeviceIndex) { return true; }

#ifdef WL_PAIR_PREFIX
// bench/pair_bench.c has the main and calls this first.
extern "C" void WL_PAIR_FN(prepare)(void) { c10::cuda::_internal::setHasPrimaryContext(has_primary_context); }
#else
int main(int argc, char **argv) {
	c10::cuda::_internal::setHasPrimaryContext(has_primary_context);
	return wl_main(argc, argv);
}
#endif
