# cudapool: build libcudapool.so and run every test.
#
#   make          lib/libcudapool.so and lib/cudapool.h
#   make test     Go checks and tests, the C and C++ ABI tests (simulator),
#                 the library's symbol and loading checks, Python unit tests
#   make demo     replay demo/trace.txt through the library
#   make clean

GO      ?= go
CC      := gcc
CXX     := g++
LIBDIR  := lib
LIB     := $(LIBDIR)/libcudapool.so
BUILD   := build

# Only the cudapool_* functions are exported (see capi/exports.map); the path
# must be absolute because the Go linker runs the external linker elsewhere.
LIB_GOFLAGS := -buildmode=c-shared -ldflags='-extldflags=-Wl,--version-script=$(CURDIR)/capi/exports.map'

TEST_CFLAGS   := -O1 -g -Wall -Wextra -Werror -I include
TEST_LDFLAGS  := -L $(LIBDIR) -lcudapool -Wl,-rpath,$(CURDIR)/$(LIBDIR) -pthread
# The ABI tests run on the simulator with two devices and no configuration.
SIM_ENV       := env -u CUDAPOOL_CONF -u PYTORCH_CUDA_ALLOC_CONF CUDAPOOL_BACKEND=sim CUDAPOOL_SIM_DEVICES=2

# Packages whose tests run goroutines concurrently, run again with -race.
RACE_PKGS := ./allocator/... ./cuda/sim/... ./events/... ./graphs/... ./pools/... ./privatepool/...

section = @printf '\n==== %s ====\n' '$(1)'

.PHONY: all lib test check-go test-go test-race test-c test-cxx check-lib test-python demo clean

all: lib

lib:
	$(GO) build $(LIB_GOFLAGS) -o $(LIB) ./capi
	@rm -f $(LIBDIR)/libcudapool.h  # cgo's header names the internal functions
	cp include/cudapool.h $(LIBDIR)/cudapool.h

test: check-go test-go test-race test-c test-cxx check-lib test-python
	@printf '\n==== make test: all passed ====\n'

check-go:
	$(call section,gofmt and go vet)
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

test-go:
	$(call section,go test ./...)
	$(GO) test ./...

test-race:
	$(call section,go test -race)
	$(GO) test -race $(RACE_PKGS)

$(BUILD)/test_cudapool: capi/ctest/test_cudapool.c capi/ctest/check.h include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_cudapool_cpp: capi/ctest/test_cudapool.cpp include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CXX) -std=c++17 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_torchabi: capi/ctest/test_torchabi.c capi/ctest/check.h include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

test-c: $(BUILD)/test_cudapool $(BUILD)/test_torchabi
	$(call section,C ABI test (simulator))
	$(SIM_ENV) ./$(BUILD)/test_cudapool
	$(call section,C ABI for the PyTorch allocator class (simulator))
	$(SIM_ENV) CUDAPOOL_SIM_MEMORY=8G ./$(BUILD)/test_torchabi

test-cxx: $(BUILD)/test_cudapool_cpp
	$(call section,C++ ABI test (simulator))
	$(SIM_ENV) ./$(BUILD)/test_cudapool_cpp

# bench/hot_path.c (docs/hot-path.md), built and run once by check-lib: the
# library's hot path works from a C program (it exits non-zero on an error).
$(BUILD)/hot_path: bench/hot_path.c include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I include -o $@ $< $(TEST_LDFLAGS) -ldl

check-lib: lib $(BUILD)/hot_path
	$(call section,hot-path breakdown runs (simulator; one round))
	$(SIM_ENV) ./$(BUILD)/hot_path 1
	$(call section,library symbols and loading)
	@if nm -D --undefined-only $(LIB) | grep -Ei ' (cu|nvml)[A-Za-z_]' ; then \
		echo "FAIL: $(LIB) leaves CUDA/NVML symbols undefined"; exit 1; fi
	@echo "ok    no undefined cu*/nvml* symbols"
	@if nm -D --defined-only $(LIB) | awk '{print $$3}' | grep -v '^cudapool_' ; then \
		echo "FAIL: $(LIB) exports symbols other than cudapool_*"; exit 1; fi
	@echo "ok    only cudapool_* symbols are exported ($$(nm -D --defined-only $(LIB) | wc -l))"
	env -u CUDAPOOL_BACKEND python3 -c "import ctypes; ctypes.CDLL('$(LIB)'); print('ok    ctypes.CDLL loads $(LIB)')"
	$(SIM_ENV) python3 -c "import ctypes; l = ctypes.CDLL('$(LIB)'); l.cudapool_malloc.restype = ctypes.c_void_p; \
		p = l.cudapool_malloc(4096, 0, None); assert p, 'malloc'; l.cudapool_free(ctypes.c_void_p(p), 4096, 0, None); \
		print('ok    malloc/free through ctypes on the simulator')"

test-python: lib
	$(call section,Python unit tests)
	@if [ -d python/tests ]; then \
		cd python && python3 -m pytest -q tests; \
	else echo "python/tests does not exist: skipped"; fi
	$(call section,benchmark report generator tests)
	python3 -m pytest -q bench/test_report.py
	$(call section,PyTorch test report generator tests)
	python3 -m pytest -q -p no:cacheprovider gpu/pytorch_tests/test_report.py

# demo: replay a recorded allocation trace through the library, on the GPU
# if there is one, else on the simulator. make demo TRACE=... REPEATS=...
TRACE   ?= demo/trace.txt
REPEATS ?= 5
demo: lib $(BUILD)/replay
	$(call section,replay $(TRACE))
	@if [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; then backend=cuda; else backend=sim; fi; \
	echo "backend: $$backend"; \
	env CUDAPOOL_BACKEND=$$backend ./$(BUILD)/replay $(TRACE) $(REPEATS)

$(BUILD)/replay: capi/ctest/replay.c include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I include -o $@ $< $(TEST_LDFLAGS)

clean:
	rm -rf $(LIBDIR) $(BUILD)
