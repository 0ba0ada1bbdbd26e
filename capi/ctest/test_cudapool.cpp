// SPDX-License-Identifier: Apache-2.0
// test_cudapool.cpp - tests libcudapool.so from C++: the header compiles as
// C++, every C function works from C++, and the PyTorch entry points
// (cudapool_torch_*) behave as PyTorch needs: the throwing malloc, and the
// std::function stream filter routing capture allocations to a private pool.
// Run on the simulator (CUDAPOOL_BACKEND=sim CUDAPOOL_SIM_DEVICES=2), as
// make test does. The last line is "C++ ABI: N passed, M failed".
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "cudapool.h"
#include "cudapool_testing.h"

namespace {

constexpr size_t MiB = size_t(1) << 20;
constexpr size_t GiB = size_t(1) << 30;

int passed, failed;

void check_at(bool ok, int line, const char *what, const char *fmt, ...) {
	char name[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(name, sizeof name, fmt, ap);
	va_end(ap);
	if (ok) {
		passed++;
		std::printf("ok    %s\n", name);
	} else {
		const char *e = cudapool_last_error();
		failed++;
		std::printf("FAIL  %s\n      line %d: %s\n      last error: %s\n", name, line, what, e ? e : "(none)");
	}
	std::fflush(stdout);
}

#define CHECK(cond, ...) check_at(!!(cond), __LINE__, #cond, __VA_ARGS__)

cudapool_stream stream(uintptr_t n) { return reinterpret_cast<cudapool_stream>(n); }

bool err_has(const char *sub) {
	const char *e = cudapool_last_error();
	return e != nullptr && std::strstr(e, sub) != nullptr;
}

std::string last_error() {
	const char *e = cudapool_last_error();
	return e ? e : "";
}

std::string take(char *s) {
	std::string out = s ? s : "";
	cudapool_string_free(s);
	return out;
}

long long stat_of(int dev, const char *key) {
	std::string js = take(cudapool_memory_stats_json(dev));
	std::string pat = std::string("\"") + key + "\":";
	size_t at = js.find(pat);
	return at == std::string::npos ? -1 : std::atoll(js.c_str() + at + pat.size());
}

bool snapshot_has(const char *sub) { return take(cudapool_snapshot_json()).find(sub) != std::string::npos; }

// torch_malloc that reports an exception instead of propagating it.
void *torch_malloc(size_t size, int dev, cudapool_stream s, std::string *what) {
	try {
		return cudapool_torch_malloc(size, dev, s);
	} catch (const std::runtime_error &e) {
		*what = e.what();
		return nullptr;
	}
}

using PoolId = std::pair<unsigned long long, unsigned long long>;
using Filter = std::function<bool(cudapool_stream)>;

void test_c_api_from_cpp() {
	std::printf("-- the C API from C++\n");
	cudapool_init(2);
	CHECK(cudapool_last_error() == nullptr, "init(2)");
	void *p = cudapool_malloc(1 * MiB, 0, nullptr);
	CHECK(p != nullptr, "malloc");
	size_t sz = 0;
	CHECK(cudapool_base_allocation(p, &sz) != nullptr && sz >= 1 * MiB, "base_allocation");
	cudapool_record_stream(p, stream(0x10));
	cudapool_sim_submit(stream(0x10));
	cudapool_free(p, 1 * MiB, 0, nullptr);
	CHECK(snapshot_has("active_awaiting_free"), "record_stream + free: the block awaits stream 0x10");
	cudapool_sim_complete_all();
	void *q = cudapool_malloc(1 * MiB, 0, nullptr);
	CHECK(q == p, "sim_complete_all lets it be reused");
	cudapool_free(q, 1 * MiB, 0, nullptr);
	std::string stats = take(cudapool_memory_stats_json(0));
	size_t keys = 0;
	for (size_t at = 0; (at = stats.find("\":", at)) != std::string::npos; at += 2)
		keys++;
	CHECK(keys == 122, "memory_stats_json has 122 keys");
	CHECK(take(cudapool_snapshot_json()).rfind("{\"segments\":", 0) == 0, "snapshot_json");
	cudapool_reset_peak_stats(0);
	CHECK(stat_of(0, "allocated_bytes.all.peak") == 0, "reset_peak_stats");
	cudapool_reset_accumulated_stats(0);
	CHECK(stat_of(0, "allocation.all.allocated") == 0, "reset_accumulated_stats");
	cudapool_set_memory_fraction(0.5, 0);
	CHECK(cudapool_malloc(50 * GiB, 0, nullptr) == nullptr && err_has("out of memory"), "set_memory_fraction");
	cudapool_set_memory_fraction(1.0, 0);
	CHECK(cudapool_configure("garbage_collection_threshold:0.8") == 0, "configure");
	CHECK(cudapool_configure("garbage_collection_threshold:8") == -1 && err_has("garbage_collection_threshold"),
	      "configure with a bad value");
	CHECK(cudapool_configure("") == 0, "configure back to the defaults");
	cudapool_begin_allocate_to_pool(1, 5, 0, nullptr, nullptr);
	void *r = cudapool_malloc(4096, 1, stream(0x33));
	CHECK(r != nullptr && snapshot_has("\"segment_pool_id\":[5,0]"), "C begin_allocate_to_pool with a NULL filter");
	cudapool_free(r, 4096, 1, stream(0x33));
	cudapool_end_allocate_to_pool(1, 5, 0);
	cudapool_release_pool(1, 5, 0);
	cudapool_empty_cache();
	CHECK(!snapshot_has("\"segment_pool_id\":[5,0]"), "end, release, empty_cache");
	cudapool_free(reinterpret_cast<void *>(0x42), 0, 0, nullptr);
	CHECK(err_has("not allocated by cudapool"), "free of an unknown pointer");
}

void test_torch_malloc() {
	std::printf("-- cudapool_torch_malloc\n");
	std::string what;
	void *p = torch_malloc(4096, 0, nullptr, &what);
	CHECK(p != nullptr && what.empty(), "torch_malloc(4096)");
	CHECK(torch_malloc(0, 0, nullptr, &what) == nullptr && what.empty(), "torch_malloc(0) returns NULL without throwing");
	what.clear();
	CHECK(torch_malloc(100 * GiB, 0, nullptr, &what) == nullptr, "torch_malloc(100 GiB) fails");
	CHECK(what.find("CUDA out of memory. Tried to allocate 100.00 GiB. GPU 0 has a total capacity of 80.00 GiB") !=
	          std::string::npos,
	      "... by throwing std::runtime_error with PyTorch's OOM message");
	CHECK(what.rfind("CUDA out of memory.", 0) == 0 && "cudapool_torch_malloc: " + what == last_error(),
	      "... PyTorch's message exactly (the last error adds the name of the function called)");
	what.clear();
	CHECK(torch_malloc(SIZE_MAX, 0, nullptr, &what) == nullptr && what.find("Tried to allocate more than 1EB memory") != std::string::npos,
	      "torch_malloc(SIZE_MAX) throws");
	what.clear();
	CHECK(torch_malloc(16, 9, nullptr, &what) == nullptr && what.find("device 9 does not exist") != std::string::npos,
	      "torch_malloc on device 9 throws");
	what.clear();
	void *q = torch_malloc(4096, 0, nullptr, &what);
	CHECK(q != nullptr && what.empty(), "allocation works again after the exceptions");
	cudapool_free(p, 4096, 0, nullptr);
	cudapool_free(q, 4096, 0, nullptr);
	bool caught_base = false;
	try {
		cudapool_torch_malloc(200 * GiB, 1, nullptr);
	} catch (const std::exception &) {
		caught_base = true;
	}
	CHECK(caught_base, "the exception is a std::exception (PyTorch's bindings turn it into RuntimeError)");
}

void test_torch_capture() {
	std::printf("-- cudapool_torch_begin/end/release with a std::function filter\n");
	const cudapool_stream cs = stream(0x5000), other = stream(0x6000);
	auto token = std::make_shared<int>(0);
	std::atomic<int> calls{0};
	{
		Filter f = [token, cs, &calls](cudapool_stream s) {
			calls++;
			return s == cs;
		};
		cudapool_torch_begin_allocate_to_pool(0, PoolId{1, 0}, f);
	} // PyTorch's filter is gone once the hook returns; cudapool's copy is not
	CHECK(token.use_count() == 2, "begin copies the filter (use_count %ld)",
	      token.use_count());
	CHECK(cudapool_sim_begin_capture(cs, 0) == 0, "sim_begin_capture (global mode)");
	std::string what;
	void *x = torch_malloc(4000, 0, cs, &what);
	CHECK(x != nullptr && what.empty(), "torch_malloc on the capture stream");
	CHECK(calls.load() > 0, "the copied std::function was called");
	// The front cache serves the capture's pool as well, from the route Go
	// returned with the thread's malloc on the stream, without asking the
	// filter (allocator/routing.go): two blocks freed during the capture
	// come back newest first, where best fit gives the lower.
	void *x1 = torch_malloc(4000, 0, cs, &what);
	cudapool_torch_free(x, 4000, 0, cs);
	cudapool_torch_free(x1, 4000, 0, cs);
	int calls0 = calls.load();
	void *c1 = torch_malloc(4000, 0, cs, &what), *c2 = torch_malloc(4000, 0, cs, &what);
	CHECK(x1 != nullptr && c1 == x1 && c2 == x, "the front served the capture's blocks, the newest first");
	CHECK(calls.load() == calls0, "the filter was not asked (%d calls)", calls.load() - calls0);
	cudapool_torch_free(c1, 4000, 0, cs);
	x = c2;
	CHECK(snapshot_has("\"segment_pool_id\":[1,0]"), "the allocation went to the graph's pool {1,0}");
	void *y = torch_malloc(30 * MiB, 0, cs, &what);
	void *z = torch_malloc(4000, 0, other, &what);
	CHECK(y != nullptr && z != nullptr, "more allocations during the capture");
	std::string snap = take(cudapool_snapshot_json());
	size_t in_pool = 0;
	for (size_t at = 0; (at = snap.find("\"segment_pool_id\":[1,0]", at)) != std::string::npos; at++)
		in_pool++;
	CHECK(in_pool == 2, "the other stream's allocation stayed in the default pool (%zu segments in {1,0})", in_pool);
	cudapool_free(x, 4000, 0, cs);
	cudapool_free(z, 4000, 0, other);
	CHECK(cudapool_sim_end_capture(cs) == 0, "sim_end_capture: not invalidated");
	cudapool_torch_end_allocate_to_pool(0, PoolId{1, 0});
	CHECK(token.use_count() == 1, "end deletes the copy (use_count %ld)", token.use_count());
	CHECK(cudapool_sim_violations() == 0, "no capture violations");
	cudapool_free(y, 30 * MiB, 0, cs); // freed while the graph lives: stays in its pool
	cudapool_empty_cache();
	CHECK(snapshot_has("\"segment_pool_id\":[1,0]"), "the graph's pool keeps its memory until release");
	cudapool_torch_release_pool(0, PoolId{1, 0});
	cudapool_empty_cache();
	CHECK(!snapshot_has("\"segment_pool_id\":[1,0]"), "release + empty_cache return it");

	// A second begin for a recording pool fails and deletes its copy. The
	// references to token2: token2, f2's lambda, cudapool's copies.
	auto token2 = std::make_shared<int>(0);
	Filter f2 = [token2](cudapool_stream) { return true; };
	cudapool_torch_begin_allocate_to_pool(0, PoolId{2, 0}, f2);
	cudapool_torch_begin_allocate_to_pool(0, PoolId{2, 0}, f2);
	CHECK(err_has("already"), "begin for a pool already recording fails");
	CHECK(token2.use_count() == 3, "... and its copy is deleted (use_count %ld)", token2.use_count());
	cudapool_torch_end_allocate_to_pool(0, PoolId{2, 0});
	CHECK(token2.use_count() == 2, "end deletes the first copy");
	cudapool_torch_release_pool(0, PoolId{2, 0});

	// A begin that fails for a bad device deletes its copy too.
	cudapool_torch_begin_allocate_to_pool(7, PoolId{3, 0}, f2);
	CHECK(err_has("device 7 does not exist") && token2.use_count() == 2, "begin on a bad device fails, copy deleted");

	// An empty std::function: every stream.
	cudapool_torch_begin_allocate_to_pool(0, PoolId{0, 3}, Filter());
	void *u = torch_malloc(4000, 0, stream(0x7777), &what);
	CHECK(u != nullptr && snapshot_has("\"segment_pool_id\":[0,3]"), "an empty filter routes every stream");
	cudapool_free(u, 4000, 0, stream(0x7777));
	cudapool_torch_end_allocate_to_pool(0, PoolId{0, 3});
	cudapool_torch_release_pool(0, PoolId{0, 3});

	// A filter that throws counts as "no" and does not unwind into Go.
	cudapool_torch_begin_allocate_to_pool(0, PoolId{4, 0}, [](cudapool_stream) -> bool { throw std::logic_error("boom"); });
	void *v = torch_malloc(4000, 0, cs, &what);
	CHECK(v != nullptr && !snapshot_has("\"segment_pool_id\":[4,0]"), "a throwing filter is treated as false");
	cudapool_free(v, 4000, 0, cs);
	cudapool_torch_end_allocate_to_pool(0, PoolId{4, 0});
	cudapool_torch_release_pool(0, PoolId{4, 0});

	cudapool_torch_end_allocate_to_pool(0, PoolId{99, 0});
	CHECK(err_has("end_allocate_to_pool"), "torch end of an unknown pool fails");
	cudapool_torch_release_pool(0, PoolId{99, 0});
	CHECK(err_has("release_pool"), "torch release of an unknown pool fails");
	cudapool_empty_cache();
	CHECK(stat_of(0, "reserved_bytes.all.current") == 0, "everything returned");
	CHECK(cudapool_sim_violations() == 0, "still no capture violations");
}

void test_torch_free_queue() {
	std::printf("-- cudapool_torch_free (queued frees)\n");
	std::string what;
	cudapool_stream s = stream(0x777);
	void *p = torch_malloc(4096, 0, s, &what);
	long long before = stat_of(0, "allocation.all.current");
	cudapool_torch_free(p, 4096, 0, s);
	CHECK(stat_of(0, "allocation.all.current") == before - 1, "a queued free is done before the stats are read");
	void *q = torch_malloc(4096, 0, s, &what);
	cudapool_torch_free(q, 4096, 0, s);
	void *r = torch_malloc(4096, 0, s, &what);
	CHECK(q == p && r == p, "a queued free is done before the next malloc, which reuses the block");
	// More frees than the queue holds: the overflow hands them all to Go.
	std::vector<void *> ps;
	for (int i = 0; i < 150; i++)
		ps.push_back(torch_malloc(1000 + i, 0, s, &what));
	long long live = stat_of(0, "allocation.all.current");
	for (int i = 0; i < 150; i++)
		cudapool_torch_free(ps[i], 1000 + i, 0, s);
	CHECK(stat_of(0, "allocation.all.current") == live - 150, "150 queued frees, past the queue's capacity, all done");
	// A bad free: reported by the call that performs it; nothing else changes.
	cudapool_torch_free(r, 4096, 0, s);
	cudapool_torch_free(r, 4096, 0, s); // double free
	void *t = torch_malloc(8192, 0, s, &what);
	CHECK(t != nullptr && what.empty(), "the malloc after a queued double free succeeds");
	CHECK(err_has("already freed"), "... and the double free is the thread's last error: %s", last_error().c_str());
	cudapool_torch_free(t, 8192, 0, s);
	cudapool_empty_cache();
	CHECK(stat_of(0, "allocation.all.current") == live - 151, "r and t were freed once each, nothing else");
}

void test_threads() {
	std::printf("-- threads\n");
	std::atomic<int> failures{0};
	std::vector<std::thread> ts;
	for (int t = 0; t < 8; t++)
		ts.emplace_back([t, &failures] {
			unsigned x = 777u + 31u * unsigned(t);
			std::vector<std::pair<void *, size_t>> live;
			for (int i = 0; i < 2000; i++) {
				x = x * 1664525u + 1013904223u;
				if (live.size() > 6 || (!live.empty() && (x & 1))) {
					cudapool_torch_free(live.back().first, live.back().second, 0, stream(0x900 + t));
					live.pop_back();
					continue;
				}
				size_t size = 512 + (x >> 8) % (3 * MiB);
				try {
					live.emplace_back(cudapool_torch_malloc(size, 0, stream(0x900 + t)), size);
				} catch (...) {
					failures++;
				}
			}
			for (auto &l : live)
				cudapool_torch_free(l.first, l.second, 0, stream(0x900 + t));
		});
	for (auto &t : ts)
		t.join();
	CHECK(failures.load() == 0, "8 std::threads x 2000 torch_malloc/torch_free: no exception");
	CHECK(stat_of(0, "allocation.all.current") == 0, "all freed (the stats call performs the queued frees)");
	cudapool_empty_cache();
}

void test_fork() {
	std::printf("-- fork\n");
	pid_t pid = fork();
	if (pid == 0) {
		alarm(10);
		int bad = 0;
		std::string what;
		if (torch_malloc(1024, 0, nullptr, &what) != nullptr || what.find("forked child") == std::string::npos)
			bad |= 1;
		if (torch_malloc(0, 0, nullptr, &what) != nullptr)
			bad |= 2;
		auto token = std::make_shared<int>(0);
		cudapool_torch_begin_allocate_to_pool(0, PoolId{1, 0}, [token](cudapool_stream) { return true; });
		if (token.use_count() != 1)
			bad |= 4; // nothing was copied
		cudapool_torch_end_allocate_to_pool(0, PoolId{1, 0});
		cudapool_torch_release_pool(0, PoolId{1, 0});
		if (!err_has("forked child"))
			bad |= 8;
		_exit(bad);
	}
	int status = 0;
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "in a forked child torch_malloc throws the fork error and the pool hooks do nothing (status %#x)", status);
}

// The child of test_bad_conf, run with an invalid CUDAPOOL_CONF: the
// process's first call, a torch_malloc, throws the configuration's error
// in its own name; the next one allocates. The exit status counts the
// failures.
int bad_conf_child() {
	int bad = 0;
	std::string what;
	if (torch_malloc(1024, 0, nullptr, &what) != nullptr ||
	    what.rfind("cudapool_torch_malloc: CUDAPOOL_CONF: max_split_size_mb=1 is too small", 0) != 0) {
		std::printf("      [child] first torch_malloc: \"%s\"\n", what.c_str());
		bad |= 1;
	}
	what.clear();
	void *p = torch_malloc(1024, 0, nullptr, &what);
	if (p == nullptr || !what.empty()) {
		std::printf("      [child] second torch_malloc: %p \"%s\"\n", p, what.c_str());
		bad |= 2;
	}
	cudapool_torch_free(p, 1024, 0, nullptr);
	if (stat_of(0, "max_split_size") != -1)
		bad |= 4; // the default configuration
	return bad;
}

void test_bad_conf(const char *self) {
	std::printf("-- an invalid configuration in the environment (child process)\n");
	pid_t pid = fork();
	if (pid == 0) {
		setenv("CUDAPOOL_CONF", "max_split_size_mb:1", 1);
		FILE *null = std::freopen("/dev/null", "w", stderr); // its one warning
		(void)null;
		char *argv[] = {const_cast<char *>(self), const_cast<char *>("--child"), const_cast<char *>("bad-conf"),
		                nullptr};
		execv("/proc/self/exe", argv);
		_exit(127);
	}
	int status = 0;
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "the first torch_malloc throws the configuration's error as cudapool_torch_malloc's; the next allocates "
	      "(status %#x)",
	      status);
}

} // namespace

int main(int argc, char **argv) {
	std::setvbuf(stdout, nullptr, _IOLBF, 0);
	if (argc == 3 && std::strcmp(argv[1], "--child") == 0 && std::strcmp(argv[2], "bad-conf") == 0)
		return bad_conf_child();
	test_c_api_from_cpp();
	test_torch_malloc();
	test_torch_capture();
	test_torch_free_queue();
	test_threads();
	test_fork();
	test_bad_conf(argv[0]);
	std::printf("C++ ABI: %d passed, %d failed\n", passed, failed);
	return failed == 0 ? 0 : 1;
}
