// SPDX-License-Identifier: Apache-2.0
// torch_allocator.cpp - cudapool as PyTorch's CUDA allocator, at full
// fidelity: a C++ class compiled against the user's installed torch.
//
// Design
//
// PyTorch reaches a pluggable allocator only through
// torch::cuda::CUDAPluggableAllocator, which implements malloc and free and
// refuses the rest of the CUDAAllocator interface (graph-pool checkpoints,
// cacheInfo, IPC, stats, snapshots, memory history, MemPool, OOM observers).
// This class derives from it and overrides every method, so that each
// torch._C entry point (torch.cuda.memory_stats, torch.accelerator,
// cudagraph trees, cuDNN's cacheInfo, torch.multiprocessing) reaches
// cudapool. Deriving from the pluggable base rather than from CUDAAllocator
// directly keeps the class compiling against later torch releases: a method
// a later release adds is implemented (or refused) by the base.
//
// This file only converts: PyTorch's C++ types to cudapool's C ABI
// (include/cudapool.h) and back. Every allocator rule (pools, checkpoints,
// which history actions are recorded and with which context, the ring of
// trace entries, configuration parsing) lives once, in Go, behind that ABI.
//
// The hot path. allocate() asks the C ABI for memory with the current
// device and stream and returns a DataPtr whose deleter queues the free in C
// (cudapool_free_deferred); the next call into the library performs the
// queued frees under the same device lock as its malloc, so a malloc+free
// pair costs one call into Go. The pluggable base's own path (std::function
// calls, a mutex and an unordered_map insert per allocation) stays
// available for comparison (install(fast=False)); see the README for both
// measured. The benchmark's build of this class
// (bench/torch_allocator_bench.cpp) compiles this file and adds its
// switches in a subclass: the shipped class carries no benchmark code.
//
// Contexts. PyTorch's memory history hands the allocator a function that
// captures the current Python/C++ stack. Only C++ can call it, so when Go
// says an operation needs a context (cudapool_gather_mask), this file
// gathers one, keeps it in a table under an integer id and passes the id to
// Go, which records ids on blocks and trace entries. Snapshots map ids back
// to the objects. The table is swept against the ids Go still holds
// (cudapool_live_contexts); an id between its gathering and the Go call
// that records it is protected by a shared lock the sweep takes exclusively.
//
// Errors from the C ABI are reported by cudapool_last_error(); this file
// clears it before a call whose result says nothing, and turns a message into
// a c10::Error (torch.OutOfMemoryError for out-of-memory) after the call has
// returned, so that no C++ exception crosses Go frames.

#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cudapool.h"

namespace cudapool_torch {
namespace {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;
using Base = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using Context = std::shared_ptr<c10::GatheredContext>;

// cudapool's failure message for the last call, without the "cudapool: "
// prefix duplication, or fallback.
std::string last_error(const char *fallback) {
	const char *e = cudapool_last_error();
	return (e != nullptr && e[0] != 0) ? std::string(e) : std::string(fallback);
}

// check raises the message of a failed C ABI call made after
// cudapool_clear_error() (the message names the operation).
void check() {
	const char *e = cudapool_last_error();
	if (e != nullptr && e[0] != 0) {
		std::string msg(e);
		cudapool_clear_error();
		TORCH_CHECK(false, msg);
	}
}

bool is_oom(const std::string &m) { return m.find("CUDA out of memory") != std::string::npos; }

// ---- contexts -------------------------------------------------------------

// depth counts the InFlight guards this thread holds: gathering a context
// runs Python, whose garbage collector may free tensors on this thread, so
// guards nest, and a sweep (which needs the lock exclusively) must not start
// inside one.
thread_local int depth = 0;

class ContextTable {
  public:
	// inflight is held shared from a context's gathering until Go has
	// recorded its id (InFlight), and exclusively by sweep().
	std::shared_mutex inflight;

	uint64_t add(Context c) {
		if (!c)
			return 0;
		std::lock_guard<std::mutex> l(mu_);
		uint64_t id = next_++;
		map_.emplace(id, std::move(c));
		return id;
	}

	Context get(uint64_t id) {
		if (id == 0)
			return nullptr;
		std::lock_guard<std::mutex> l(mu_);
		auto it = map_.find(id);
		return it == map_.end() ? nullptr : it->second;
	}

	// maybe_sweep drops the contexts Go no longer refers to, once the table
	// has doubled since the last sweep (not inside an InFlight guard).
	void maybe_sweep() {
		if (depth > 0)
			return;
		{
			std::lock_guard<std::mutex> l(mu_);
			if (map_.size() < sweep_at_)
				return;
		}
		sweep();
	}

	// sweep never waits for the lock: a thread in a guard may be waiting for
	// the GIL (gathering a stack) while this one holds it; a sweep that
	// cannot start now happens at a later call.
	void sweep() {
		std::unique_lock<std::shared_mutex> w(inflight, std::try_to_lock);
		if (!w.owns_lock())
			return;
		std::vector<unsigned long long> live(1024);
		size_t n = cudapool_live_contexts(live.data(), live.size());
		if (n > live.size()) {
			live.resize(n + 1024);
			n = cudapool_live_contexts(live.data(), live.size());
		}
		live.resize(n < live.size() ? n : live.size());
		std::unordered_set<uint64_t> keep(live.begin(), live.end());
		std::vector<Context> dead; // destroyed outside mu_
		{
			std::lock_guard<std::mutex> l(mu_);
			for (auto it = map_.begin(); it != map_.end();) {
				if (keep.count(it->first) == 0) {
					dead.push_back(std::move(it->second));
					it = map_.erase(it);
				} else {
					++it;
				}
			}
			sweep_at_ = std::max<size_t>(4096, 2 * map_.size());
		}
	}

  private:
	std::mutex mu_;
	std::unordered_map<uint64_t, Context> map_; // guarded by mu_
	uint64_t next_ = 1;                         // guarded by mu_
	size_t sweep_at_ = 4096;                    // guarded by mu_
};

ContextTable contexts;
std::atomic<CCA::CreateContextFn> recorder{nullptr};

// InFlight holds contexts.inflight shared, counting the nesting.
struct InFlight {
	std::shared_lock<std::shared_mutex> lock;
	InFlight() : lock(contexts.inflight) { depth++; }
	~InFlight() { depth--; }
};

// gather returns the id of a new context when Go asks for one for op
// (CUDAPOOL_GATHER_*), else 0. The caller holds contexts.inflight shared
// until Go has recorded the id.
uint64_t gather(unsigned op) {
	CCA::CreateContextFn fn = recorder.load(std::memory_order_acquire);
	if (fn == nullptr || (cudapool_gather_mask() & op) == 0)
		return 0;
	return contexts.add(fn());
}

// ---- out of memory ----------------------------------------------------------

std::mutex observers_mu;
std::vector<CCA::OutOfMemoryObserver> observers; // guarded by observers_mu

// raise_malloc_error turns a failed cudapool malloc into PyTorch's errors:
// c10::OutOfMemoryError (torch.OutOfMemoryError) for out of memory, after the
// OOM observers have been told, as native does; c10::Error otherwise.
[[noreturn]] void raise_malloc_error(DeviceIndex device) {
	std::string msg = last_error("cudapool: malloc failed");
	cudapool_clear_error();
	const std::string prefix = "cudapool_malloc_ctx: "; // the function called names itself
	if (msg.compare(0, prefix.size(), prefix) == 0 && is_oom(msg))
		msg.erase(0, prefix.size());
	if (is_oom(msg)) {
		cudapool_oom_info info{};
		if (cudapool_last_oom(&info) == 0) {
			std::vector<CCA::OutOfMemoryObserver> obs;
			{
				std::lock_guard<std::mutex> l(observers_mu);
				obs = observers;
			}
			for (auto &o : obs)
				o(info.device, info.size, info.device_total, info.device_free);
		}
		if (c10::memoryProfilingEnabled()) {
			cudapool_device_stats s{};
			if (cudapool_get_device_stats(device, &s) == 0)
				c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(info.size),
				                                 static_cast<size_t>(s.allocated_bytes[0].current),
				                                 static_cast<size_t>(s.reserved_bytes[0].current),
				                                 c10::Device(c10::DeviceType::CUDA, device));
			cudapool_clear_error();
		}
		TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
	}
	TORCH_CHECK(false, msg);
}

// ---- memory ---------------------------------------------------------------

// report tells PyTorch's profiler (torch.profiler with profile_memory=True)
// about an allocation (size > 0) or a free (size < 0), with the device's
// totals after it, as native does.
void report(void *p, int64_t size, int device) {
	cudapool_device_stats s{};
	if (cudapool_get_device_stats(device, &s) != 0) {
		cudapool_clear_error();
		return;
	}
	c10::reportMemoryUsageToProfiler(p, size, static_cast<size_t>(s.allocated_bytes[0].current),
	                                 static_cast<size_t>(s.reserved_bytes[0].current),
	                                 c10::Device(c10::DeviceType::CUDA, static_cast<DeviceIndex>(device)));
}

void *malloc_on(size_t size, DeviceIndex device, cudaStream_t stream) {
	void *p;
	if (C10_UNLIKELY(cudapool_gather_mask() & CUDAPOOL_GATHER_ALLOC)) {
		{
			InFlight r;
			p = cudapool_malloc_ctx(size, device, reinterpret_cast<cudapool_stream>(stream), gather(CUDAPOOL_GATHER_ALLOC));
		}
		contexts.maybe_sweep();
	} else {
		p = cudapool_malloc_ctx(size, device, reinterpret_cast<cudapool_stream>(stream), 0);
	}
	if (C10_UNLIKELY(p == nullptr) && size != 0)
		raise_malloc_error(device);
	if (C10_UNLIKELY(c10::memoryProfilingEnabled()) && p != nullptr)
		report(p, static_cast<int64_t>(size), device);
	return p;
}

// free_ptr queues the free of p; the device and size are found by cudapool.
void free_ptr(void *p) {
	if (p == nullptr)
		return;
	if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
		size_t size = 0;
		int device = -1;
		if (cudapool_allocation_info(p, &size, &device) == 0)
			report(p, -static_cast<int64_t>(size), device);
		else
			cudapool_clear_error(); // the free itself reports the bad pointer
	}
	if (C10_UNLIKELY(cudapool_gather_mask() & CUDAPOOL_GATHER_FREE)) {
		{
			InFlight r;
			cudapool_free_deferred(p, 0, -1, gather(CUDAPOOL_GATHER_FREE));
		}
		contexts.maybe_sweep();
		return;
	}
	cudapool_free_deferred(p, 0, -1, 0);
}

void deleter(void *p) { free_ptr(p); }

DeviceIndex current_device() {
	DeviceIndex device = -1;
	C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
	return device;
}

// ---- MemPool segment sources ------------------------------------------------

// A MemPool whose segments come from another allocator (MemPool(allocator=X)):
// Go calls these with a device lock held; they never throw into Go.
struct Source {
	std::shared_ptr<CCA::CUDAAllocator> alloc;
};

void *source_alloc(void *ctx, size_t size, int device, cudapool_stream stream) noexcept {
	try {
		c10::cuda::CUDAGuard g(static_cast<DeviceIndex>(device));
		return static_cast<Source *>(ctx)->alloc->raw_alloc_with_stream(size, reinterpret_cast<cudaStream_t>(stream));
	} catch (const std::exception &e) {
		fprintf(stderr, "cudapool: a MemPool's allocator failed to allocate %zu bytes: %s\n", size, e.what());
		return nullptr;
	} catch (...) {
		return nullptr;
	}
}

int source_free(void *ctx, void *ptr, size_t size, int device) noexcept {
	(void)size;
	try {
		c10::cuda::CUDAGuard g(static_cast<DeviceIndex>(device));
		static_cast<Source *>(ctx)->alloc->raw_delete(ptr);
		return 0;
	} catch (const std::exception &e) {
		fprintf(stderr, "cudapool: a MemPool's allocator failed to free %p: %s\n", ptr, e.what());
		return -1;
	} catch (...) {
		return -1;
	}
}

// Reads the protected alloc function of another pluggable allocator (the
// pointer-to-member of a derived class may name a base's member).
struct PeekAlloc : Base {
	static const std::function<void *(size_t, int, cudaStream_t)> &of(const Base &b) {
		return b.*(&PeekAlloc::alloc_fn_);
	}
};

// is_cudapool reports whether a allocates through cudapool itself (e.g.
// cudapool.allocator()), which as a pool's source would re-enter cudapool.
bool is_cudapool(const std::shared_ptr<CCA::CUDAAllocator> &a);

// ---- the checkpoint of a private pool -----------------------------------------

struct PoolState : CCA::AllocatorState {
	unsigned long long id = 0;
	explicit PoolState(unsigned long long i) : id(i) {}
	~PoolState() override {
		if (id != 0)
			cudapool_checkpoint_release(id);
	}
};

// ---- IPC handles -------------------------------------------------------------

// PyTorch's handle string (ShareableHandle::handle), which Go writes and
// reads whole (cudapool_ipc_share, cudapool_ipc_open_shared): 'c' for an
// ordinary segment, 'e' for expandable memory. Most handles fit this.
constexpr size_t kIpcHandleGuess = 256;

// ---- the allocator ---------------------------------------------------------

// Not final: the benchmark's build derives from it (see the design note).
class Allocator : public Base {
  public:
	explicit Allocator(bool fast) : Base(&cudapool_torch_malloc, &cudapool_torch_free), fast_(fast) {}

	c10::DataPtr allocate(size_t size) override {
		if (!fast_)
			return Base::allocate(size);
		DeviceIndex device = current_device();
		cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
		void *p = malloc_on(size, device, stream);
		return {p, p, &deleter, c10::Device(c10::DeviceType::CUDA, device)};
	}

	c10::DeleterFnPtr raw_deleter() const override { return fast_ ? &deleter : Base::raw_deleter(); }

	void *raw_alloc(size_t n) override {
		DeviceIndex device = current_device();
		return malloc_on(n, device, c10::cuda::getCurrentCUDAStream(device).stream());
	}

	void *raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
		return malloc_on(n, current_device(), stream);
	}

	// raw_delete frees at once (not queued like the DataPtr deleter), so
	// that a bad pointer raises here, with native's words first.
	void raw_delete(void *p) override {
		if (!fast_) {
			Base::raw_delete(p);
			return;
		}
		if (p == nullptr)
			return;
		int rc;
		{
			InFlight r;
			rc = cudapool_free_ctx(p, 0, -1, gather(CUDAPOOL_GATHER_FREE));
		}
		contexts.maybe_sweep();
		if (rc != 0) {
			std::string msg = last_error("cudapool: free failed");
			cudapool_clear_error();
			TORCH_CHECK(false, "invalid device pointer: ", p, " (", msg, ")");
		}
	}

	void init(int device_count) override {
		cudapool_clear_error();
		cudapool_init(device_count);
		check();
		initialized_ = true;
	}

	// torch.cuda.caching_allocator_enable: off, every allocation is the
	// driver's own, freed at once (a debugging switch).
	void enable(bool on) override {
		cudapool_clear_error();
		cudapool_set_caching(on ? 1 : 0);
		check();
	}

	bool isEnabled() const override { return cudapool_caching() != 0; }

	double getMemoryFraction(DeviceIndex device) override {
		cudapool_clear_error();
		double f = cudapool_get_memory_fraction(device);
		check();
		return f;
	}

	void setMemoryFraction(double fraction, DeviceIndex device) override {
		cudapool_clear_error();
		cudapool_set_memory_fraction(fraction, device);
		check();
	}

	std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex device) override {
		std::vector<CCA::StreamSegmentSize> out;
		cudapool_snapshot *s = take_snapshot(nullptr, false);
		for (size_t i = 0; i < s->nsegments; i++) {
			const cudapool_segment_info &g = s->segments[i];
			if (g.device == device && g.is_expandable)
				out.emplace_back(reinterpret_cast<cudaStream_t>(g.stream), !g.is_large, g.total_size);
		}
		cudapool_snapshot_free(s);
		return out;
	}

	void emptyCache(MempoolId_t id) override {
		cudapool_clear_error();
		if (id.first == 0 && id.second == 0) {
			InFlight r;
			cudapool_empty_cache_ctx(gather(CUDAPOOL_GATHER_RELEASE));
		} else {
			cudapool_empty_pool(-1, id.first, id.second);
		}
		check();
	}

	void cacheInfo(DeviceIndex device, size_t *largest) override {
		cudapool_clear_error();
		cudapool_cache_info(device, largest);
		check();
	}

	void *getBaseAllocation(void *p, size_t *size) override {
		cudapool_clear_error();
		void *base = cudapool_base_allocation(p, size);
		check();
		return base;
	}

	void recordStream(const c10::DataPtr &p, c10::cuda::CUDAStream stream) override {
		// As native: a DataPtr that is not ours (from_blob, IPC) is skipped.
		if (p.get() == nullptr || p.get_deleter() != raw_deleter())
			return;
		cudapool_clear_error();
		cudapool_record_stream(p.get(), reinterpret_cast<cudapool_stream>(stream.stream()));
		check();
	}

	c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
		cudapool_device_stats s{};
		cudapool_clear_error();
		cudapool_get_device_stats(device, &s);
		check();
		c10::CachingDeviceAllocator::DeviceStats d;
		auto conv = [](c10::CachingAllocator::Stat &to, const cudapool_stat &from) {
			to.current = from.current;
			to.peak = from.peak;
			to.allocated = from.allocated;
			to.freed = from.freed;
		};
		auto arr = [&](c10::CachingAllocator::StatArray &to, const cudapool_stat *from) {
			for (size_t i = 0; i < 3; i++)
				conv(to[i], from[i]);
		};
		arr(d.allocation, s.allocation);
		arr(d.segment, s.segment);
		arr(d.active, s.active);
		arr(d.inactive_split, s.inactive_split);
		arr(d.allocated_bytes, s.allocated_bytes);
		arr(d.reserved_bytes, s.reserved_bytes);
		arr(d.active_bytes, s.active_bytes);
		arr(d.inactive_split_bytes, s.inactive_split_bytes);
		arr(d.requested_bytes, s.requested_bytes);
		d.num_alloc_retries = s.num_alloc_retries;
		d.num_ooms = s.num_ooms;
		conv(d.oversize_allocations, s.oversize_allocations);
		conv(d.oversize_segments, s.oversize_segments);
		d.num_sync_all_streams = s.num_sync_all_streams;
		d.num_device_alloc = s.num_device_alloc;
		d.num_device_free = s.num_device_free;
		d.max_split_size = s.max_split_size;
		return d;
	}

	void resetAccumulatedStats(DeviceIndex device) override {
		cudapool_clear_error();
		cudapool_reset_accumulated_stats(device);
		check();
	}

	void resetPeakStats(DeviceIndex device) override {
		cudapool_clear_error();
		cudapool_reset_peak_stats(device);
		check();
	}

	CCA::SnapshotInfo snapshot(MempoolId_t pool, bool include_traces) override {
		bool all = pool.first == 0 && pool.second == 0;
		cudapool_snapshot *s = take_snapshot(all ? nullptr : &pool, include_traces);
		CCA::SnapshotInfo out;
		out.segments.reserve(s->nsegments);
		for (size_t i = 0; i < s->nsegments; i++) {
			const cudapool_segment_info &g = s->segments[i];
			c10::CachingDeviceAllocator::SegmentInfo si;
			si.device = static_cast<DeviceIndex>(g.device);
			si.address = g.address;
			si.total_size = g.total_size;
			si.requested_size = g.requested_size;
			si.allocated_size = g.allocated_size;
			si.active_size = g.active_size;
			si.stream = reinterpret_cast<void *>(g.stream);
			si.is_large = g.is_large != 0;
			si.is_expandable = g.is_expandable != 0;
			si.owner_private_pool_id = {g.pool_a, g.pool_b};
			si.context_when_allocated = contexts.get(g.context);
			si.blocks.reserve(g.nblocks);
			for (size_t j = 0; j < g.nblocks; j++) {
				const cudapool_block_info &b = s->blocks[g.first_block + j];
				c10::CachingDeviceAllocator::BlockInfo bi;
				bi.size = b.size;
				bi.requested_size = b.requested_size;
				bi.gc_counter = b.gc_counter;
				bi.allocated = b.allocated != 0;
				bi.active = b.active != 0;
				bi.context_when_allocated = contexts.get(b.context);
				si.blocks.push_back(std::move(bi));
			}
			out.segments.push_back(std::move(si));
		}
		int ndev = 0;
		for (size_t i = 0; i < s->ntraces; i++)
			ndev = std::max(ndev, s->traces[i].device + 1);
		ndev = std::max(ndev, static_cast<int>(s->ndevices));
		out.device_traces.resize(static_cast<size_t>(ndev));
		using TE = c10::CachingDeviceAllocator::TraceEntry;
		for (size_t i = 0; i < s->ntraces; i++) {
			const cudapool_trace_entry &t = s->traces[i];
			TE e(static_cast<TE::Action>(t.action), static_cast<DeviceIndex>(t.device), t.addr, t.size,
			     reinterpret_cast<void *>(t.stream), {t.pool_a, t.pool_b}, 0, contexts.get(t.context),
			     t.compile_context ? t.compile_context : "N/A", t.user_metadata ? t.user_metadata : "");
			e.time_.t_ = static_cast<time_t>(t.time_us);
			out.device_traces[static_cast<size_t>(t.device)].push_back(std::move(e));
		}
		for (size_t i = 0; i < s->nannotations; i++) {
			const cudapool_annotation &a = s->annotations[i];
			c10::CachingDeviceAllocator::AnnotationEntry ae(static_cast<DeviceIndex>(a.device), 0);
			ae.time_.t_ = static_cast<time_t>(a.time_us);
			for (size_t k = 0; k < a.n; k++)
				ae.recordUserMetadata(a.keys[k], a.values[k]);
			out.external_annotations.push_back(std::move(ae));
		}
		const cudapool_config_info &c = s->config;
		out.config_metadata.garbage_collection_threshold = c.garbage_collection_threshold;
		out.config_metadata.max_split_size = c.max_split_size;
		out.config_metadata.expandable_segments = c.expandable_segments != 0;
		out.config_metadata.release_lock_on_malloc = c.release_lock_on_malloc != 0;
		out.config_metadata.last_allocator_settings = c.settings ? c.settings : "";
		out.config_metadata.roundup_power2_divisions.assign(c.roundup_power2_divisions,
		                                                    c.roundup_power2_divisions + c.nroundup);
		cudapool_snapshot_free(s);
		return out;
	}

	void beginAllocateToPool(DeviceIndex device, MempoolId_t id, std::function<bool(cudaStream_t)> filter) override {
		cudapool_clear_error();
		cudapool_torch_begin_allocate_to_pool(device, id, std::move(filter));
		check();
	}

	void endAllocateToPool(DeviceIndex device, MempoolId_t id) override {
		cudapool_clear_error();
		cudapool_torch_end_allocate_to_pool(device, id);
		check();
	}

	void releasePool(DeviceIndex device, MempoolId_t id) override {
		cudapool_clear_error();
		cudapool_torch_release_pool(device, id);
		check();
	}

	int getPoolUseCount(DeviceIndex device, MempoolId_t id) override {
		cudapool_clear_error();
		int n = cudapool_pool_use_count(device, id.first, id.second);
		check();
		return n;
	}

	void createOrIncrefPool(DeviceIndex device, MempoolId_t id, std::shared_ptr<CCA::CUDAAllocator> alloc) override {
		cudapool_clear_error();
		cudapool_pool_create_or_incref(device, id.first, id.second);
		check();
		if (alloc && !is_cudapool(alloc)) {
			// Owned by Go from here: kept as long as the pool's segments.
			auto *src = new Source{std::move(alloc)};
			if (cudapool_pool_set_source(device, id.first, id.second, &source_alloc, &source_free, src) != 0) {
				delete src;
				check();
			}
		}
	}

	void setUseOnOOM(DeviceIndex device, MempoolId_t id, bool use) override {
		cudapool_clear_error();
		cudapool_pool_set_use_on_oom(device, id.first, id.second, use ? 1 : 0);
		check();
	}

	void setNoSplit(DeviceIndex device, MempoolId_t id) override {
		cudapool_clear_error();
		cudapool_pool_set_no_split(device, id.first, id.second);
		check();
	}

	bool checkPoolLiveAllocations(DeviceIndex device, MempoolId_t id,
	                              const std::unordered_set<void *> &expected) override {
		std::vector<void *> v(expected.begin(), expected.end());
		cudapool_clear_error();
		int r = cudapool_pool_check_live(device, id.first, id.second, v.data(), v.size());
		check();
		return r == 1;
	}

	CCA::ShareableHandle shareIpcHandle(void *p) override {
		std::string s(kIpcHandleGuess, '\0');
		size_t len = 0, offset = 0;
		int device = -1;
		cudapool_clear_error();
		if (cudapool_ipc_share(p, s.data(), s.size(), &len, &offset, &device) != 0 && len > s.size()) {
			s.resize(len); // longer than guessed: *len says how long
			cudapool_clear_error();
			cudapool_ipc_share(p, s.data(), s.size(), &len, &offset, &device);
		}
		check();
		s.resize(len);
		return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(s)};
	}

	std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
		cudapool_clear_error();
		void *p = cudapool_ipc_open_shared(current_device(), handle.data(), handle.size());
		check();
		return std::shared_ptr<void>(p, [](void *q) {
			if (cudapool_ipc_close(q) != 0)
				fprintf(stderr, "cudapool: closing a CUDA IPC mapping: %s\n", last_error("failed").c_str());
		});
	}

	bool isHistoryEnabled() override { return cudapool_history_enabled() != 0; }

	void recordHistory(bool enabled, CCA::CreateContextFn recorder_fn, size_t max_entries, CCA::RecordContext when,
	                   bool clear, const std::vector<std::string> &skip_actions) override {
		std::string skip;
		for (const auto &a : skip_actions) {
			if (!skip.empty())
				skip.push_back(',');
			skip += a;
		}
		recorder.store(enabled ? recorder_fn : nullptr, std::memory_order_release);
		cudapool_clear_error();
		cudapool_record_history(enabled ? 1 : 0, max_entries, static_cast<int>(when), clear ? 1 : 0, skip.c_str());
		check();
		contexts.sweep();
	}

	void recordAnnotation(const std::vector<std::pair<std::string, std::string>> &md) override {
		std::vector<const char *> keys, values;
		for (const auto &kv : md) {
			keys.push_back(kv.first.c_str());
			values.push_back(kv.second.c_str());
		}
		DeviceIndex device = -1;
		if (c10::cuda::GetDevice(&device) != cudaSuccess)
			device = 0;
		cudapool_clear_error();
		cudapool_record_annotation(device, keys.data(), values.data(), keys.size());
		check();
	}

	void pushCompileContext(std::string &md) override { cudapool_push_compile_context(md.c_str()); }

	void popCompileContext() override { cudapool_pop_compile_context(); }

	void setUserMetadata(const std::string &md) override { cudapool_set_user_metadata(md.c_str()); }

	std::string getUserMetadata() override {
		char *s = cudapool_get_user_metadata();
		std::string out = s ? s : "";
		cudapool_string_free(s);
		return out;
	}

	void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override {
		std::lock_guard<std::mutex> l(observers_mu);
		observers.push_back(std::move(observer));
	}

	void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker) override {
		TORCH_CHECK(false, "cudapool does not support attachAllocatorTraceTracker: PyTorch uses it only to "
		                   "register segments with NCCL (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK); "
		                   "unset that variable, or use PyTorch's own allocator for that run");
	}

	std::shared_ptr<CCA::AllocatorState> getCheckpointState(DeviceIndex device, MempoolId_t id) override {
		cudapool_clear_error();
		unsigned long long cp = cudapool_checkpoint_pool(device, id.first, id.second);
		check();
		TORCH_CHECK(cp != 0, "cudapool: get_checkpoint_state failed");
		return std::make_shared<PoolState>(cp);
	}

	CCA::CheckpointDelta setCheckpointPoolState(DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) override {
		auto *st = dynamic_cast<PoolState *>(pps.get());
		TORCH_CHECK(st != nullptr, "cudapool: set_checkpoint_pool_state: the state was not made by cudapool's "
		                           "getCheckpointState (was the allocator changed?)");
		cudapool_restore_result r{};
		cudapool_clear_error();
		cudapool_checkpoint_restore(device, st->id, &r);
		check();
		CCA::CheckpointDelta d;
		d.ptrs_freed.assign(r.freed, r.freed + r.nfreed);
		d.dataptrs_allocd.reserve(r.nallocated);
		for (size_t i = 0; i < r.nallocated; i++)
			d.dataptrs_allocd.emplace_back(r.allocated[i], r.allocated[i], raw_deleter(),
			                               c10::Device(c10::DeviceType::CUDA, device));
		cudapool_restore_result_free(&r);
		return d;
	}

	std::string name() override { return "cudapool"; }

	bool fast() const { return fast_; }

  private:
	static cudapool_snapshot *take_snapshot(const MempoolId_t *pool, bool traces) {
		cudapool_clear_error();
		cudapool_snapshot *s = pool ? cudapool_snapshot_take(1, pool->first, pool->second, traces ? 1 : 0)
		                            : cudapool_snapshot_take(0, 0, 0, traces ? 1 : 0);
		check();
		TORCH_CHECK(s != nullptr, "cudapool: snapshot failed");
		return s;
	}

	const bool fast_;
};

bool is_cudapool(const std::shared_ptr<CCA::CUDAAllocator> &a) {
	if (dynamic_cast<Allocator *>(a.get()) != nullptr)
		return true;
	auto *p = dynamic_cast<Base *>(a.get());
	if (p == nullptr)
		return false;
	using Fn = void *(*)(size_t, int, cudaStream_t);
	const auto &fn = PeekAlloc::of(*p);
	const Fn *target = fn.template target<Fn>();
	if (target == nullptr)
		return false;
	return reinterpret_cast<void *>(*target) == reinterpret_cast<void *>(&cudapool_malloc) ||
	       reinterpret_cast<void *>(*target) == reinterpret_cast<void *>(&cudapool_torch_malloc);
}

std::shared_ptr<Allocator> installed;

// install makes allocator a PyTorch's CUDA allocator: the current CUDAAllocator, c10's
// allocator for the CUDA device type (what torch.accelerator reads), and a
// listener of torch.cuda.memory._set_allocator_settings. Once per process:
// a later call keeps the first allocator.
void install(std::shared_ptr<Allocator> a) {
	if (installed)
		return;
	torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
	c10::SetAllocator(c10::DeviceType::CUDA, a.get(), UINT8_MAX);
	// torch.cuda.memory._set_allocator_settings reaches the CUDA allocator
	// through this hook: native's parser runs first (its checks and
	// errors), then cudapool applies the same keys.
	auto &hook = c10::CachingAllocator::AcceleratorAllocatorConfig::getConfigParserHook();
	auto prev = hook;
	hook = [prev](const std::string &env) {
		if (prev)
			prev(env);
		cudapool_clear_error();
		if (cudapool_configure_update(env.c_str()) != 0) {
			std::string msg = last_error("cudapool: configure failed");
			cudapool_clear_error();
			TORCH_CHECK(false, msg);
		}
	};
	cudapool_expect_announced_captures();
	installed = std::move(a);
}

} // namespace
} // namespace cudapool_torch

// ---- entry points, called through ctypes by cudapool._ext -------------------

extern "C" {

// cudapool_torch_ext_install makes cudapool PyTorch's CUDA allocator (see
// install). fast=0 keeps the pluggable base's malloc/free path, for
// comparison; any other value takes the direct path. Returns 0, or -1 with
// the reason in err.
__attribute__((visibility("default"))) int cudapool_torch_ext_install(int fast, char *err, size_t errlen) {
	using namespace cudapool_torch;
	try {
		if (!installed)
			install(std::make_shared<Allocator>(fast != 0));
		return 0;
	} catch (const std::exception &e) {
		snprintf(err, errlen, "%s", e.what());
		return -1;
	}
}

// cudapool_torch_ext_fast reports whether the installed allocator uses the
// direct path (1), the pluggable base's (0), or is not installed (-1).
__attribute__((visibility("default"))) int cudapool_torch_ext_fast(void) {
	return cudapool_torch::installed ? (cudapool_torch::installed->fast() ? 1 : 0) : -1;
}

// cudapool_torch_ext_version is the version of this file's interface with
// cudapool._ext (a mismatch means a stale cached build).
__attribute__((visibility("default"))) int cudapool_torch_ext_version(void) { return 5; }

} // extern "C"
