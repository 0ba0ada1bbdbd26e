// torch.cpp - the C++ entry points PyTorch calls, with its exact types.
//
// PyTorch casts the hook addresses to C++ function types taking
// std::pair<unsigned long long, unsigned long long> (MempoolId_t) and
// std::function<bool(cudaStream_t)>, and calls the allocator through a
// std::function inside C++ frames, where a C++ exception becomes a Python
// error. Go can neither take those types nor throw, so these wrappers do the
// C++ parts: copy the filter to the heap for Go to call later
// (cp_call_std_filter), and throw after the Go call has returned. No C++
// exception ever crosses a Go frame.
#include <cstdint>
#include <functional>
#include <new>
#include <stdexcept>
#include <utility>

#include "capi.h"
#include "cudapool.h"

typedef struct CUstream_st *cudaStream_t; // same type as CUDA's

namespace {

using MempoolId = std::pair<unsigned long long, unsigned long long>;
using StreamFilter = std::function<bool(cudaStream_t)>;

const char kFallbackOOM[] = "cudapool: out of memory";

// cp_throw_oom raises the error PyTorch turns into a Python exception. It is
// the one place to change to raise c10::OutOfMemoryError instead.
[[noreturn]] __attribute__((noinline)) void cp_throw_oom(const char *msg) {
	throw std::runtime_error(msg != nullptr ? msg : kFallbackOOM);
}

void set_error(const char *msg) { cp_set_error(msg, std::char_traits<char>::length(msg)); }

} // namespace

extern "C" {

void *cudapool_torch_malloc(size_t size, int device, cudaStream_t stream) {
	if (cp_forked_child()) {
		if (size == 0)
			return nullptr;
		cp_throw_oom(cudapool_last_error());
	}
	void *p = reinterpret_cast<void *>(cpgo_torch_malloc(size, device, reinterpret_cast<uintptr_t>(stream)));
	if (p == nullptr && size > 0)
		cp_throw_oom(cudapool_last_error());
	return p;
}

void cudapool_torch_begin_allocate_to_pool(int device, MempoolId id, StreamFilter filter) {
	if (cp_forked_child())
		return;
	uintptr_t handle = 0; // 0: an empty filter, which accepts every stream
	if (filter) {
		try {
			handle = reinterpret_cast<uintptr_t>(new StreamFilter(filter));
		} catch (...) {
			set_error("cudapool: begin_allocate_to_pool: cannot copy the stream filter (out of host memory)");
			return;
		}
	}
	// Go owns the copy from here: it deletes it when the pool's end is
	// processed, or at once if begin fails.
	cpgo_torch_begin_allocate_to_pool(device, id.first, id.second, handle);
}

void cudapool_torch_end_allocate_to_pool(int device, MempoolId id) {
	if (cp_forked_child())
		return;
	cpgo_end_allocate_to_pool(device, id.first, id.second);
}

void cudapool_torch_release_pool(int device, MempoolId id) {
	if (cp_forked_child())
		return;
	cpgo_release_pool(device, id.first, id.second);
}

int cp_call_std_filter(uintptr_t handle, uintptr_t stream) {
	try {
		return (*reinterpret_cast<StreamFilter *>(handle))(reinterpret_cast<cudaStream_t>(stream)) ? 1 : 0;
	} catch (...) {
		return 0; // an exception must not unwind into Go
	}
}

void cp_delete_std_filter(uintptr_t handle) { delete reinterpret_cast<StreamFilter *>(handle); }

} // extern "C"
