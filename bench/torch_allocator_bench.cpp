// SPDX-License-Identifier: Apache-2.0
// torch_allocator_bench.cpp - the benchmark's build of cudapool's C++
// allocator class: the shipped class (python/cudapool/csrc/torch_allocator.cpp,
// compiled here as part of this file) with the benchmark's switches in a
// subclass. Compiled and installed only by bench/bench_ext.py.
//
// Design
//
// BenchAllocator derives from the shipped Allocator and overrides the calls
// the switches concern (allocate, emptyCache, the pool hooks, recordStream,
// raw_deleter), delegating to the shipped methods whenever no switch is on:
// with every switch off, a call costs the shipped path plus one relaxed load
// and a predictable branch.
//
// Passthrough hands allocate() to PyTorch's own allocator (the one cudapool
// replaced) or takes it back, so that a benchmark can alternate the two
// allocators within one process (bench/torch_bench.py, sections alt and
// altcompile). What is handed over: allocate() (torch.empty and every tensor
// PyTorch makes), the raw calls (raw_alloc, raw_delete, raw_deleter),
// emptyCache, and the captures begun meanwhile: their pools are native's
// until released as often as they were begun (begin/endAllocateToPool,
// releasePool, getPoolUseCount, emptyCache and checkPoolLiveAllocations of
// the pool, its checkpoints). The tensors keep their allocator's deleter.
// CUDA graph trees (torch.compile's reduce-overhead) compare a storage's
// deleter with raw_deleter() and free it with raw_delete() when a recording
// ends (torch._C._free_And_Remove_DeleterFn), so the raw calls follow the
// switch: a side's graph trees must run during that side's turns (the
// altcompile section gives each side its own tree manager).
//
// Timing records the duration of each allocate() and each deleter call, per
// allocator, while the alt section runs with --alt-timing: where a
// torch.empty+free pair's time goes inside the process that runs it (the
// interpreter around the calls evicts what the allocators keep warm, so
// timings of the allocators on their own do not tell). A tensor made while
// timing gets a timing deleter. Samples are ticks of the CPU's time-stamp
// counter, converted to ns by the clock read at both ends of a measurement;
// one thread's calls are timed (the benchmark's), so the counters are
// relaxed atomics written with plain loads and stores.
//
// Frees at once (install mode 2): the deleter frees with a call into Go per
// free instead of queueing, which isolates the queue's share of a pair
// (gpu/bench_class_paths.py).

#include "torch_allocator.cpp"

#include <chrono>
#include <cstring>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace cudapool_torch {
namespace {

// free_now: set once, at install (mode 2), before any tensor is made.
bool free_now = false;

// deleter_now frees p at once. With PyTorch's memory profiler on, or when
// Go asks for a context for frees, it takes the shipped deleter's path
// (queued): those are not what mode 2 measures.
void deleter_now(void *p) {
	if (p == nullptr)
		return;
	if (C10_UNLIKELY(c10::memoryProfilingEnabled() || (cudapool_gather_mask() & CUDAPOOL_GATHER_FREE))) {
		free_ptr(p);
		return;
	}
	if (cudapool_free_ctx(p, 0, -1, 0) != 0) { // a deleter cannot throw
		fprintf(stderr, "%s\n", last_error("cudapool: free failed").c_str());
		cudapool_clear_error();
	}
}

namespace timing {

enum Kind {
	kNativeAlloc,
	kNativeFree,
	kAlloc,
	kFree,
	kAllocLib,
	kNativeCross,
	kBeginPool,
	kEndPool,
	kFilter,
	kEmpty,           // cudapool's emptyCache
	kNativeEmpty,     // native's, while passthrough is on
	kNativeBeginPool, // native's begin/endAllocateToPool, while passthrough is on
	kNativeEndPool,
	kKinds
};
constexpr uint32_t kCap = 1u << 17; // samples kept per kind between takes

inline uint64_t ticks() {
#if defined(__x86_64__)
	return __rdtsc();
#else
	return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

inline int64_t now_ns() {
	return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint32_t samples[kKinds][kCap];
std::atomic<uint32_t> kept[kKinds];
std::atomic<uint64_t> calls[kKinds]; // every timed call, kept or not
std::atomic<int64_t> start_ns{0};
std::atomic<uint64_t> start_ticks{0};
std::atomic<c10::DeleterFnPtr> native_deleter{nullptr};
// cross: after each of native's timed allocate() calls, also make one call
// into the library's Go code that does almost nothing (timed as
// kNativeCross): whether the crossing itself slows what runs around it.
std::atomic<bool> cross{false};

void record(Kind k, uint64_t d) {
	uint32_t i = kept[k].load(std::memory_order_relaxed);
	if (i < kCap) {
		samples[k][i] = d > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(d);
		kept[k].store(i + 1, std::memory_order_relaxed);
	}
	calls[k].store(calls[k].load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
}

void timed_deleter(void *p) {
	uint64_t t0 = ticks();
	if (free_now)
		deleter_now(p);
	else
		free_ptr(p);
	record(kFree, ticks() - t0);
}

void timed_native_deleter(void *p) {
	uint64_t t0 = ticks();
	native_deleter.load(std::memory_order_relaxed)(p);
	record(kNativeFree, ticks() - t0);
}

} // namespace timing

class BenchAllocator final : public Allocator {
  public:
	BenchAllocator(bool fast, CCA::CUDAAllocator *native) : Allocator(fast), native_(native) {
		if (free_now)
			mode_.store(kNow, std::memory_order_relaxed);
	}

	// With every switch off, the shipped path after one load and branch
	// (what the alt section's cudapool reps measure).
	c10::DataPtr allocate(size_t size) override {
		uint8_t mode = mode_.load(std::memory_order_relaxed);
		if (C10_UNLIKELY(mode != 0)) {
			if (mode == kNow) {
				DeviceIndex device = current_device();
				cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
				void *p = malloc_on(size, device, stream);
				return {p, p, &deleter_now, c10::Device(c10::DeviceType::CUDA, device)};
			}
			return allocate_measured(size, mode);
		}
		return Allocator::allocate(size);
	}

	// The raw calls follow the switch (see the design note).
	c10::DeleterFnPtr raw_deleter() const override {
		if (C10_UNLIKELY(mode_.load(std::memory_order_relaxed) & kPass))
			return native_->raw_deleter();
		return own_deleter();
	}

	void *raw_alloc(size_t n) override {
		if (C10_UNLIKELY(mode_.load(std::memory_order_relaxed) & kPass))
			return native_->raw_alloc(n);
		return Allocator::raw_alloc(n);
	}

	void *raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
		if (C10_UNLIKELY(mode_.load(std::memory_order_relaxed) & kPass))
			return native_->raw_alloc_with_stream(n, stream);
		return Allocator::raw_alloc_with_stream(n, stream);
	}

	void raw_delete(void *p) override {
		if (C10_UNLIKELY(mode_.load(std::memory_order_relaxed) & kPass)) {
			native_->raw_delete(p);
			return;
		}
		Allocator::raw_delete(p);
	}

	// recordStream goes by the tensor's deleter, whatever the switch says:
	// native's tensors to native, cudapool's (plain or timed) to cudapool.
	void recordStream(const c10::DataPtr &p, c10::cuda::CUDAStream stream) override {
		if (p.get() == nullptr)
			return;
		const c10::DeleterFnPtr d = p.get_deleter();
		if (native_ != nullptr && d == native_->raw_deleter()) {
			native_->recordStream(p, stream);
			return;
		}
		// Anything else but cudapool's (from_blob, IPC, a timed tensor of
		// native's, which native's own check skips too) is skipped, as
		// native does.
		if (d != &timing::timed_deleter && d != own_deleter())
			return;
		cudapool_clear_error();
		cudapool_record_stream(p.get(), reinterpret_cast<cudapool_stream>(stream.stream()));
		check();
	}

	std::shared_ptr<CCA::AllocatorState> getCheckpointState(DeviceIndex device, MempoolId_t id) override {
		if (C10_UNLIKELY(passed(id, false)))
			return native_->getCheckpointState(device, id);
		return Allocator::getCheckpointState(device, id);
	}

	// A state is restored by the allocator that made it (native's is not a
	// PoolState). cudapool's DataPtrs are made with raw_deleter(), which
	// follows the switch: restoring one of cudapool's during native's turn
	// would hand its blocks native's deleter.
	CCA::CheckpointDelta setCheckpointPoolState(DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) override {
		if (dynamic_cast<PoolState *>(pps.get()) == nullptr && native_ != nullptr)
			return native_->setCheckpointPoolState(device, std::move(pps));
		TORCH_CHECK(!(mode_.load(std::memory_order_relaxed) & kPass),
		            "cudapool (benchmark build): a checkpoint of cudapool's restored while passthrough is on");
		return Allocator::setCheckpointPoolState(device, std::move(pps));
	}

	bool checkPoolLiveAllocations(DeviceIndex device, MempoolId_t id,
	                              const std::unordered_set<void *> &expected) override {
		if (C10_UNLIKELY(passed(id, false)))
			return native_->checkPoolLiveAllocations(device, id, expected);
		return Allocator::checkPoolLiveAllocations(device, id, expected);
	}

	void emptyCache(MempoolId_t id) override {
		const uint8_t mode = mode_.load(std::memory_order_relaxed);
		if (C10_UNLIKELY((mode & (kPass | kTime)) || ((id.first != 0 || id.second != 0) && passed(id, false)))) {
			emptyCache_measured(id, mode);
			return;
		}
		Allocator::emptyCache(id);
	}

	void beginAllocateToPool(DeviceIndex device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) override {
		const uint8_t mode = mode_.load(std::memory_order_relaxed);
		const bool timed = mode & kTime;
		const uint64_t t0 = timed ? timing::ticks() : 0;
		const bool known = passed(id, false);
		if (C10_UNLIKELY((mode & kPass) || known)) {
			// A capture begun while passthrough is on is native's, to its
			// end and its graph's release, and so is its pool when a later
			// capture (or a graph tree's warm-up) shares it, switch or not,
			// until released as often as begun. cudapool is not told of
			// native's captures, so nothing may free cudapool's tensors
			// during one (the benchmark's captured functions free only
			// their own), and a pool of cudapool's is not shared with one.
			native_->beginAllocateToPool(device, id, std::move(filter));
			hold(id);
			if (timed)
				timing::record(timing::kNativeBeginPool, timing::ticks() - t0);
			return;
		}
		if (C10_UNLIKELY(timed) && filter)
			filter = [f = std::move(filter)](cudaStream_t s) {
				uint64_t t = timing::ticks();
				bool r = f(s);
				timing::record(timing::kFilter, timing::ticks() - t);
				return r;
			};
		Allocator::beginAllocateToPool(device, id, std::move(filter));
		if (C10_UNLIKELY(timed))
			timing::record(timing::kBeginPool, timing::ticks() - t0);
	}

	void endAllocateToPool(DeviceIndex device, MempoolId_t id) override {
		const bool timed = mode_.load(std::memory_order_relaxed) & kTime;
		const bool native = passed(id, false); // before the clock: not cudapool's time
		const uint64_t t0 = timed ? timing::ticks() : 0;
		if (C10_UNLIKELY(native)) {
			native_->endAllocateToPool(device, id);
			if (timed)
				timing::record(timing::kNativeEndPool, timing::ticks() - t0);
			return;
		}
		Allocator::endAllocateToPool(device, id);
		if (C10_UNLIKELY(timed))
			timing::record(timing::kEndPool, timing::ticks() - t0);
	}

	void releasePool(DeviceIndex device, MempoolId_t id) override {
		if (C10_UNLIKELY(passed(id, true))) {
			native_->releasePool(device, id);
			return;
		}
		Allocator::releasePool(device, id);
	}

	int getPoolUseCount(DeviceIndex device, MempoolId_t id) override {
		if (C10_UNLIKELY(passed(id, false)))
			return native_->getPoolUseCount(device, id);
		return Allocator::getPoolUseCount(device, id);
	}

	// set_passthrough turns passthrough on or off (see the design note).
	// Returns false when there is no allocator to hand over to.
	bool set_passthrough(bool on) {
		if (on && native_ == nullptr)
			return false;
		if (on && !native_->initialized())
			native_->init(static_cast<int>(c10::cuda::device_count()));
		set_mode(kPass, on);
		return true;
	}

	// native_counts puts PyTorch's own allocator's device allocations, device
	// frees and reserved bytes on device into out[0..2]. False when there is
	// no allocator at hand or it has not started.
	bool native_counts(DeviceIndex device, int64_t *out) {
		if (native_ == nullptr || !native_->initialized())
			return false;
		const auto s = native_->getDeviceStats(device);
		out[0] = s.num_device_alloc;
		out[1] = s.num_device_free;
		out[2] = s.reserved_bytes[0].current; // all pools
		return true;
	}

	// set_timing turns call timing on or off; turning it on starts a new
	// measurement: samples and calibration.
	void set_timing(bool on, bool cross) {
		timing::cross.store(on && cross, std::memory_order_relaxed);
		if (on) {
			for (int k = 0; k < timing::kKinds; k++) {
				timing::kept[k].store(0, std::memory_order_relaxed);
				timing::calls[k].store(0, std::memory_order_relaxed);
			}
			timing::start_ns.store(timing::now_ns(), std::memory_order_relaxed);
			timing::start_ticks.store(timing::ticks(), std::memory_order_relaxed);
		}
		set_mode(kTime, on);
	}

  private:
	// mode_ bits: passthrough, timing, frees at once (set at construction).
	static constexpr uint8_t kPass = 1, kTime = 2, kNow = 4;

	// emptyCache_measured: passthrough empties native's cache instead of
	// cudapool's (torch.cuda.graph's enter phase, as native runs it), as
	// does emptying a pool of native's; timing times either.
	C10_NOINLINE void emptyCache_measured(MempoolId_t id, uint8_t mode) {
		const bool native = (mode & kPass) || ((id.first != 0 || id.second != 0) && passed(id, false));
		const uint64_t t0 = timing::ticks();
		if (native)
			native_->emptyCache(id);
		else
			Allocator::emptyCache(id);
		if (mode & kTime)
			timing::record(native ? timing::kNativeEmpty : timing::kEmpty, timing::ticks() - t0);
	}

	// passed reports whether pool id was begun while passthrough was on
	// (native's); with forget it counts one release, and drops the pool at
	// the release that matches its last begin. An empty list costs a load.
	bool passed(MempoolId_t id, bool forget) {
		if (pass_count_.load(std::memory_order_acquire) == 0)
			return false;
		std::lock_guard<std::mutex> g(pass_mu_);
		for (size_t i = 0; i < pass_pools_.size(); i++) {
			if (pass_pools_[i].first == id) {
				if (forget && --pass_pools_[i].second <= 0) {
					pass_pools_.erase(pass_pools_.begin() + static_cast<std::ptrdiff_t>(i));
					pass_count_.store(pass_pools_.size(), std::memory_order_release);
				}
				return true;
			}
		}
		return false;
	}

	// hold counts one begin of native's pool id.
	void hold(MempoolId_t id) {
		std::lock_guard<std::mutex> g(pass_mu_);
		for (auto &p : pass_pools_) {
			if (p.first == id) {
				p.second++;
				return;
			}
		}
		pass_pools_.emplace_back(id, 1);
		pass_count_.store(pass_pools_.size(), std::memory_order_release);
	}

	// own_deleter is cudapool's deleter, whatever the switch says.
	c10::DeleterFnPtr own_deleter() const { return free_now ? &deleter_now : Allocator::raw_deleter(); }

	void set_mode(uint8_t bit, bool on) {
		uint8_t m = mode_.load(std::memory_order_relaxed);
		mode_.store(on ? (m | bit) : (m & ~bit), std::memory_order_relaxed);
	}

	// allocate_measured serves allocate() while a switch is on: passthrough
	// hands the request to PyTorch's allocator; timing times the call (for
	// cudapool, also its call into the library alone) and gives the tensor a
	// timing deleter.
	C10_NOINLINE c10::DataPtr allocate_measured(size_t size, uint8_t mode) {
		if (!(mode & kTime))
			return native_->allocate(size);
		using namespace timing;
		uint64_t t0 = ticks();
		if (mode & kPass) {
			c10::DataPtr d = native_->allocate(size);
			uint64_t t1 = ticks();
			record(kNativeAlloc, t1 - t0);
			if (cross.load(std::memory_order_relaxed)) {
				t1 = ticks();
				(void)cudapool_get_memory_fraction(0);
				record(kNativeCross, ticks() - t1);
			}
			// Native's DataPtr holds the pointer as its context, so the
			// timing deleter can hand it to native's deleter.
			c10::DeleterFnPtr del = d.get_deleter(), none = nullptr;
			if (d.get() != nullptr && d.get_context() == d.get() &&
			    (native_deleter.compare_exchange_strong(none, del) || none == del))
				(void)d.compare_exchange_deleter(del, &timed_native_deleter);
			return d;
		}
		DeviceIndex device = current_device();
		cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
		uint64_t t1 = ticks();
		void *p = malloc_on(size, device, stream);
		uint64_t t2 = ticks();
		record(kAllocLib, t2 - t1);
		record(kAlloc, t2 - t0);
		return {p, p, &timed_deleter, c10::Device(c10::DeviceType::CUDA, device)};
	}

	std::atomic<uint8_t> mode_{0}; // kPass | kTime | kNow
	CCA::CUDAAllocator *const native_;
	// The private pools of captures begun while passthrough was on, each
	// with its begins not yet released: native's until the last release.
	// Guarded by pass_mu_; pass_count_ mirrors the size.
	std::mutex pass_mu_;
	std::vector<std::pair<MempoolId_t, int>> pass_pools_;
	std::atomic<size_t> pass_count_{0};
};

BenchAllocator *bench = nullptr; // the installed one, if this build's

} // namespace
} // namespace cudapool_torch

// ---- entry points, called through ctypes by bench/bench_ext.py -------------

extern "C" {

// cudapool_torch_bench_install makes BenchAllocator PyTorch's CUDA
// allocator, keeping PyTorch's own (the one it replaces) for passthrough,
// unless another pluggable allocator was installed before. fast: 0 the
// pluggable base's path, 1 the direct path, 2 the direct path with frees
// made at once. Returns 0 (also when it is installed already), or -1 with
// the reason in err: when the shipped class was installed by this library.
__attribute__((visibility("default"))) int cudapool_torch_bench_install(int fast, char *err, size_t errlen) {
	using namespace cudapool_torch;
	try {
		if (bench != nullptr)
			return 0;
		if (installed) {
			snprintf(err, errlen, "the shipped class is installed already (cudapool.install() ran before)");
			return -1;
		}
		CCA::CUDAAllocator *native = CCA::get();
		if (dynamic_cast<Base *>(native) != nullptr)
			native = nullptr;
		free_now = fast == 2;
		auto a = std::make_shared<BenchAllocator>(fast != 0, native);
		BenchAllocator *b = a.get();
		install(std::move(a));
		bench = b;
		return 0;
	} catch (const std::exception &e) {
		snprintf(err, errlen, "%s", e.what());
		return -1;
	}
}

// cudapool_torch_bench_passthrough hands torch's allocations to PyTorch's
// own allocator (on=1) or back to cudapool (on=0). 0 on success, -1 when not
// installed on the direct path or when PyTorch's allocator is not at hand.
__attribute__((visibility("default"))) int cudapool_torch_bench_passthrough(int on) {
	using namespace cudapool_torch;
	try {
		return bench != nullptr && bench->fast() && bench->set_passthrough(on != 0) ? 0 : -1;
	} catch (const std::exception &e) {
		fprintf(stderr, "cudapool: passthrough: %s\n", e.what());
		return -1;
	}
}

// cudapool_torch_bench_timing turns call timing on (a new measurement) or
// off; on=2 also crosses into Go after each of native's allocate() calls
// (timing::cross). 0 on success, -1 when not installed on the direct path.
__attribute__((visibility("default"))) int cudapool_torch_bench_timing(int on) {
	using namespace cudapool_torch;
	if (bench == nullptr || !bench->fast())
		return -1;
	bench->set_timing(on != 0, on == 2);
	return 0;
}

// cudapool_torch_bench_timing_take copies up to cap samples of one kind
// (timing::Kind: 0 native allocate, 1 native deleter, 2 cudapool allocate,
// 3 cudapool deleter, 4 cudapool's call into the library within its
// allocate, 5 the crossing after native's allocate, 6 beginAllocateToPool,
// 7 endAllocateToPool, 8 PyTorch's stream filter of a capture begun while
// timing, 9 cudapool's emptyCache, 10 native's, 11 and 12 native's
// begin/endAllocateToPool), in ticks, into buf, and forgets that kind's
// samples (those past cap as well); *calls gets the number of timed calls
// (more than the samples when the buffer filled) and *ns_per_tick the
// calibration since timing was turned on. Returns the number copied, or -1
// for a bad kind.
__attribute__((visibility("default"))) long cudapool_torch_bench_timing_take(int kind, uint32_t *buf, size_t cap,
                                                                             uint64_t *calls, double *ns_per_tick) {
	using namespace cudapool_torch::timing;
	if (kind < 0 || kind >= kKinds)
		return -1;
	uint32_t n = kept[kind].load(std::memory_order_relaxed);
	if (n > cap)
		n = static_cast<uint32_t>(cap);
	if (buf != nullptr)
		memcpy(buf, samples[kind], n * sizeof *buf);
	kept[kind].store(0, std::memory_order_relaxed);
	if (calls != nullptr)
		*calls = ::cudapool_torch::timing::calls[kind].exchange(0, std::memory_order_relaxed);
	if (ns_per_tick != nullptr) {
		uint64_t dt = ticks() - start_ticks.load(std::memory_order_relaxed);
		int64_t dn = now_ns() - start_ns.load(std::memory_order_relaxed);
		*ns_per_tick = dt > 0 ? static_cast<double>(dn) / static_cast<double>(dt) : 0;
	}
	return n;
}

// cudapool_torch_bench_native_counts puts PyTorch's own allocator's device
// allocations, device frees and reserved bytes on device into out[0..2]
// (what cudapool's own figures are in torch.cuda.memory_stats). 0 on
// success, -1 when not installed or PyTorch's allocator is not at hand.
__attribute__((visibility("default"))) int cudapool_torch_bench_native_counts(int device, int64_t *out) {
	using namespace cudapool_torch;
	try {
		return bench != nullptr && out != nullptr &&
		               bench->native_counts(static_cast<DeviceIndex>(device), out)
		           ? 0
		           : -1;
	} catch (const std::exception &e) {
		fprintf(stderr, "cudapool: native counts: %s\n", e.what());
		return -1;
	}
}

// cudapool_torch_bench_version is the version of this file's interface with
// bench/bench_ext.py.
__attribute__((visibility("default"))) int cudapool_torch_bench_version(void) { return 3; }

} // extern "C"
