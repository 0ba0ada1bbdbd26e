// SPDX-License-Identifier: Apache-2.0
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
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <typeinfo>
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

// Raising torch.OutOfMemoryError
//
// PyTorch turns a c10::OutOfMemoryError into torch.OutOfMemoryError and any
// other std::exception into RuntimeError. We build without PyTorch's
// headers, so the exception is made from what libc10.so exports, found at
// run time in the process that loaded us: c10::Error's constructor
// Error(SourceLocation, std::string), OutOfMemoryError's vtable and
// typeinfo, and the destructor. OutOfMemoryError adds nothing to Error
// ("using Error::Error;"), so an Error constructed in place and given
// OutOfMemoryError's vtable is one. The object is over-allocated (size only
// matters for storage). If any symbol is missing (no PyTorch, another
// version) we throw std::runtime_error with the same message.
struct SourceLocation { // c10::SourceLocation
	const char *function;
	const char *file;
	uint32_t line;
};
using ErrorCtor = void (*)(void *self, SourceLocation loc, std::string msg);
using Dtor = void (*)(void *);

extern "C" void *__cxa_allocate_exception(size_t) noexcept;
extern "C" [[noreturn]] void __cxa_throw(void *, std::type_info *, void (*)(void *));

struct C10OOM {
	ErrorCtor ctor = nullptr;
	Dtor dtor = nullptr;
	void *vtable = nullptr;
	std::type_info *type = nullptr;
	bool ok = false;
};

// c10sym finds a symbol in the PyTorch libraries already loaded. A class
// without a key function (OutOfMemoryError) has its vtable and typeinfo in
// whichever library uses it, and PyTorch loads them RTLD_LOCAL, so each is
// asked by name; a typeinfo copy from any of them matches PyTorch's catch.
void *c10sym(const char *name) {
	static const char *const libs[] = {"libc10.so", "libc10_cuda.so", "libtorch_cuda.so", "libtorch_cpu.so",
	                                   "libtorch_python.so"};
	for (const char *lib : libs) {
		if (void *h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD)) {
			void *p = dlsym(h, name);
			dlclose(h);
			if (p != nullptr)
				return p;
		}
	}
	return dlsym(RTLD_DEFAULT, name);
}

const C10OOM &c10_oom() {
	static const C10OOM s = [] {
		C10OOM r;
		r.ctor = reinterpret_cast<ErrorCtor>(
		    c10sym("_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"));
		if (r.ctor == nullptr)
			r.ctor = reinterpret_cast<ErrorCtor>(
			    c10sym("_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"));
		r.vtable = c10sym("_ZTVN3c1016OutOfMemoryErrorE");
		// The destructor is inline (not exported) in PyTorch 2.11; the
		// vtable's first virtual slot is the complete-object destructor.
		r.dtor = reinterpret_cast<Dtor>(c10sym("_ZN3c1016OutOfMemoryErrorD1Ev"));
		if (r.dtor == nullptr && r.vtable != nullptr)
			r.dtor = reinterpret_cast<Dtor>(static_cast<void **>(r.vtable)[2]);
		r.type = static_cast<std::type_info *>(c10sym("_ZTIN3c1016OutOfMemoryErrorE"));
		r.ok = r.ctor && r.dtor && r.vtable && r.type && getenv("CUDAPOOL_NO_C10_OOM") == nullptr;
		if (!r.ok && getenv("CUDAPOOL_DEBUG_OOM") != nullptr)
			fprintf(stderr, "cudapool: c10::OutOfMemoryError unavailable: ctor=%p dtor=%p vtable=%p typeinfo=%p\n",
			        (void *)r.ctor, (void *)r.dtor, r.vtable, (void *)r.type);
		return r;
	}();
	return s;
}

// cp_throw_oom raises the error PyTorch turns into a Python exception:
// torch.OutOfMemoryError for an out-of-memory failure (with PyTorch's own
// message, without our "cudapool_torch_malloc: " prefix), RuntimeError
// otherwise.
[[noreturn]] __attribute__((noinline)) void cp_throw_oom(const char *msg) {
	std::string m = msg != nullptr ? msg : kFallbackOOM;
	const char prefix[] = "cudapool_torch_malloc: ";
	bool oom = m.find("CUDA out of memory") != std::string::npos;
	if (oom && m.compare(0, sizeof prefix - 1, prefix) == 0)
		m.erase(0, sizeof prefix - 1);
	const C10OOM &c = c10_oom();
	if (oom && c.ok) {
		void *e = __cxa_allocate_exception(1024);
		std::memset(e, 0, 1024);
		c.ctor(e, SourceLocation{"cudapool_torch_malloc", __FILE__, static_cast<uint32_t>(__LINE__)}, m);
		// The vtable's address point is past offset-to-top and typeinfo.
		*static_cast<void **>(e) = static_cast<char *>(c.vtable) + 2 * sizeof(void *);
		__cxa_throw(e, c.type, c.dtor);
	}
	throw std::runtime_error(m);
}

void set_error(const char *msg) { cp_set_error(msg, std::char_traits<char>::length(msg)); }

// announced: PyTorch announces every capture (begin_allocate_to_pool), which
// the allocator is told before the hooks' first malloc.
std::atomic<bool> announced{false};

} // namespace

extern "C" {

void *cudapool_torch_malloc(size_t size, int device, cudaStream_t stream) {
	if (cp_refused("cudapool_torch_malloc")) {
		if (size == 0)
			return nullptr;
		cp_throw_oom(cudapool_last_error());
	}
	if (__builtin_expect(!announced.load(std::memory_order_relaxed), 0)) {
		// Refused (the library cannot run, or the environment's
		// configuration was, once), the malloc fails with the reason.
		if (cpgo_expect_announced(CP_FN_TORCH_MALLOC) != 0) {
			if (size == 0)
				return nullptr;
			cp_throw_oom(cudapool_last_error());
		}
		announced.store(true, std::memory_order_relaxed);
	}
	void *p = cp_malloc(size, device, reinterpret_cast<uintptr_t>(stream), 0, CP_FN_TORCH_MALLOC);
	if (p == nullptr && size > 0)
		cp_throw_oom(cudapool_last_error());
	return p;
}

void cudapool_torch_begin_allocate_to_pool(int device, MempoolId id, StreamFilter filter) {
	if (cp_refused("cudapool_torch_begin_allocate_to_pool"))
		return;
	uintptr_t handle = 0; // 0: an empty filter, which accepts every stream
	if (filter) {
		try {
			handle = reinterpret_cast<uintptr_t>(new StreamFilter(filter));
		} catch (...) {
			set_error("cudapool_torch_begin_allocate_to_pool: cannot copy the stream filter (out of host memory)");
			return;
		}
	}
	// Go owns the copy from here: it deletes it when the pool's end is
	// processed, or at once if begin fails.
	cpgo_torch_begin_allocate_to_pool(device, id.first, id.second, handle, cp_tag_cur);
}

void cudapool_torch_end_allocate_to_pool(int device, MempoolId id) {
	if (cp_refused("cudapool_torch_end_allocate_to_pool"))
		return;
	cpgo_end_allocate_to_pool(device, id.first, id.second, CP_FN_TORCH_END_ALLOCATE_TO_POOL);
}

void cudapool_torch_release_pool(int device, MempoolId id) {
	if (cp_refused("cudapool_torch_release_pool"))
		return;
	cpgo_release_pool(device, id.first, id.second, CP_FN_TORCH_RELEASE_POOL);
}

int cp_call_std_filter(uintptr_t handle, uintptr_t stream) {
	int yes = 0;
	cp_callback_enter();
	try {
		yes = (*reinterpret_cast<StreamFilter *>(handle))(reinterpret_cast<cudaStream_t>(stream)) ? 1 : 0;
	} catch (...) {
		// an exception must not unwind into Go: "no"
	}
	cp_callback_leave();
	return yes;
}

void cp_delete_std_filter(uintptr_t handle) { delete reinterpret_cast<StreamFilter *>(handle); }

} // extern "C"
