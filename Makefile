# cudapool: build libcudapool.so and run every test.
#
#   make          lib/libcudapool.so and lib/cudapool.h
#   make test     Go checks and tests, the C and C++ ABI tests (simulator),
#                 the library's symbol and loading checks, Python unit tests
#   make soak     10^7 randomized operations from many goroutines on the
#                 simulator, invariants checked after every batch
#                 (SOAK_OPS=N sets the count; make test runs 10^5)
#   make demo     replay demo/trace.txt through the library
#   make pgo      regenerate capi/default.pgo, the profile for profile-guided
#                 optimization (commit it; see the target)
#   make clean

GO      ?= go
CC      := gcc
CXX     := g++
LIBDIR  := lib
LIB     := $(LIBDIR)/libcudapool.so
BUILD   := build

# The library is built by capi/build_lib.sh (here and in python/setup.py):
# only the cudapool_* functions are exported (capi/exports.map), and the Go
# runtime counts a call from C as a schedule tick and waits for the
# package initialization only once (docs/hot-path.md 22, 24).
# go build reads capi/default.pgo by itself (-pgo=auto: the main package's
# default.pgo).

TEST_CFLAGS   := -O1 -g -Wall -Wextra -Werror -I include
TEST_LDFLAGS  := -L $(LIBDIR) -lcudapool -Wl,-rpath,$(CURDIR)/$(LIBDIR) -pthread
# The ABI tests run on the simulator with two devices and no configuration.
SIM_ENV       := env -u CUDAPOOL_CONF -u PYTORCH_CUDA_ALLOC_CONF CUDAPOOL_BACKEND=sim CUDAPOOL_SIM_DEVICES=2

# Packages whose tests run goroutines concurrently, run again with -race.
RACE_PKGS := ./allocator/... ./cuda/sim/... ./events/... ./graphs/... ./pools/... ./privatepool/...

section = @printf '\n==== %s ====\n' '$(1)'

.PHONY: all lib lib-stock test check-go test-go test-race test-c test-cxx check-lib test-python demo soak pgo clean

all: lib

# $(call build_lib,DIR,ENV): libcudapool.so in DIR by capi/build_lib.sh (ENV:
# variables for it), and DIR/BUILD_COMMIT, the record bench/run_bench.sh reads
# where no git checkout travels along: the commit, "dirty" if the tree
# differs from it, and the script's last line (which Go runtime).
define build_lib
	@mkdir -p $(1)
	$(2) GO='$(GO)' bash capi/build_lib.sh $(1)/libcudapool.so >$(1)/.runtime || { cat $(1)/.runtime; exit 1; }
	@cat $(1)/.runtime
	@{ git rev-parse --short HEAD 2>/dev/null || echo unknown; \
	   git diff --quiet HEAD -- . 2>/dev/null || echo dirty; tail -n 1 $(1)/.runtime; } >$(1)/BUILD_COMMIT
	@rm -f $(1)/.runtime
endef

lib:
	$(call build_lib,$(LIBDIR))
	cp include/cudapool.h $(LIBDIR)/cudapool.h

# lib-stock: the same library with the stock Go runtime (no callback tick),
# for A/B runs on the GPU machine (gpu/diag_runtime_tick.sh:
# CUDAPOOL_LIBRARY_B=build/lib_stock/libcudapool.so) and check-lib.
lib-stock:
	$(call build_lib,$(BUILD)/lib_stock,CUDAPOOL_RUNTIME_TICK=0)

test: check-go test-go test-race test-c test-cxx check-lib test-python test-install test-charts
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

$(BUILD)/test_interop: capi/ctest/test_interop.c capi/ctest/check.h include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_front: capi/ctest/test_front.c capi/ctest/check.h include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

# front.c alone (no library, no Go): its cold mode.
$(BUILD)/test_front_cold: capi/ctest/test_front_cold.c capi/front.c capi/capi.h
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -I capi -o $@ $< -pthread

# test_front runs twice, with the front cache on and off (debug_checks in
# both); its "cmp" lines are statistics that do not depend on placement, so
# the two runs' must be identical. Then twice more with expandable segments,
# whose private pools the front serves holding only small blocks (shorter:
# every operation's invariant check walks the pages).
FRONT_CONF := debug_checks:True,max_split_size_mb:40
FRONT_EXP_ARGS := 1 30000 10000

test-c: $(BUILD)/test_cudapool $(BUILD)/test_torchabi $(BUILD)/test_interop $(BUILD)/test_front $(BUILD)/test_front_cold $(BUILD)/c_bench
	$(call section,C ABI test (simulator))
	$(SIM_ENV) ./$(BUILD)/test_cudapool
	$(call section,C ABI for the PyTorch allocator class (simulator))
	$(SIM_ENV) CUDAPOOL_SIM_MEMORY=8G ./$(BUILD)/test_torchabi
	$(call section,C ABI for CuPy and other libraries (simulator))
	$(SIM_ENV) ./$(BUILD)/test_interop
	$(call section,front cache: cold mode (front.c alone))
	./$(BUILD)/test_front_cold
	$(call section,front cache: randomized; front on and off (simulator))
	@rc=0; for kind in plain exp; do \
		args=; extra=; if [ $$kind = exp ]; then args='$(FRONT_EXP_ARGS)'; extra=,expandable_segments:True; fi; \
		for mode in on off; do \
			conf='$(FRONT_CONF)'$$extra; if [ $$mode = off ]; then conf="$$conf,front_cache:False"; fi; \
			out=$(BUILD)/test_front.$$kind.$$mode; \
			echo "CUDAPOOL_CONF=$$conf ./$(BUILD)/test_front $$args"; \
			$(SIM_ENV) CUDAPOOL_CONF=$$conf ./$(BUILD)/test_front $$args >$$out.out || rc=1; \
			grep -v '^cmp ' $$out.out; \
			grep '^cmp ' $$out.out >$$out.cmp; \
		done; \
		on=$(BUILD)/test_front.$$kind.on.cmp; off=$(BUILD)/test_front.$$kind.off.cmp; \
		if [ -s $$off ] && cmp -s $$on $$off; then \
			echo "ok    front on and off ($$kind): the same $$(wc -l <$$on) statistics lines"; \
		else \
			echo "FAIL  front on and off ($$kind): the statistics differ (< on, > off):"; \
			diff $$on $$off | head -20; rc=1; \
		fi; \
	done; \
	exit $$rc
	$(call section,front cache: a recorded training run (fragmentation; simulator))
	capi/ctest/front_trace.sh ./$(BUILD)/c_bench demo/train75.txt.gz

# bench/c_bench.c, for the front's trace test (test-c).
$(BUILD)/c_bench: bench/c_bench.c bench/workloads.h include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -I include -I bench -o $@ $< $(TEST_LDFLAGS) -ldl -pthread

test-cxx: $(BUILD)/test_cudapool_cpp
	$(call section,C++ ABI test (simulator))
	$(SIM_ENV) ./$(BUILD)/test_cudapool_cpp

# bench/hot_path.c (docs/hot-path.md), built and run once by check-lib: the
# library's hot path works from a C program (it exits non-zero on an error).
$(BUILD)/hot_path: bench/hot_path.c include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I include -o $@ $< $(TEST_LDFLAGS) -ldl

# capi/ctest/runtime_tick.c: calls from C, then the Go runtime's schedtrace
# (check-lib: the library has the callback tick, the stock build has not).
$(BUILD)/runtime_tick: capi/ctest/runtime_tick.c include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I include -o $@ $< $(TEST_LDFLAGS)

check-lib: lib lib-stock $(BUILD)/hot_path $(BUILD)/runtime_tick
	$(call section,hot-path breakdown runs (simulator; one round))
	$(SIM_ENV) ./$(BUILD)/hot_path 1
	$(call section,the Go runtime counts calls from C as schedule ticks (capi/build_lib.sh))
	capi/ctest/runtime_tick.sh ./$(BUILD)/runtime_tick $(LIBDIR)
	capi/ctest/runtime_tick.sh ./$(BUILD)/runtime_tick $(BUILD)/lib_stock
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
	python3 -m pytest -q bench/test_report.py bench/test_kvcache.py bench/test_fsdp_tools.py
	$(call section,PyTorch test report generator tests)
	python3 -m pytest -q -p no:cacheprovider gpu/pytorch_tests/test_report.py

# soak: allocator/soak_test.go with SOAK_OPS operations (10^7 by default).
SOAK_OPS ?= 1e7
soak:
	$(call section,soak: $(SOAK_OPS) operations on the simulator)
	SOAK_OPS=$(SOAK_OPS) $(GO) test -count=1 -timeout 0 -run '^TestSoak$$' -v ./allocator/

# demo: replay a recorded allocation trace through the library, on the GPU
# if there is one, else on the simulator. make demo TRACE=... REPEATS=...
TRACE   ?= demo/trace.txt
REPEATS ?= 5
demo: lib $(BUILD)/replay
	$(call section,replay $(TRACE))
	@if [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; then backend=cuda; else backend=sim; fi; \
	echo "backend: $$backend"; \
	env CUDAPOOL_BACKEND=$$backend ./$(BUILD)/replay $(TRACE) $(REPEATS)

# pgo: rewrites capi/default.pgo, the CPU profile go build uses for
# profile-guided optimization of the library: hotter inlining along the
# class path's malloc (cpgo_malloc_ctx, MallocTracked, the device's malloc
# and free, the pools) and in the runtime's side of the crossing, about 6%
# fewer instructions per mixed pair and no more instruction-cache lines
# (docs/hot-path.md, section 13). The profile comes from committed
# benchmarks (bench/pgo_profile.sh: bench/c_bench.c through a profiling
# build of the library, and allocator's BenchmarkPGOCapture), on the
# simulator, in about 20 s. Run it after changing the hot path and commit
# the result: a stale profile still builds, but helps less and can cost
# cache lines.
pgo:
	$(call section,pgo: profile the library on the simulator into capi/default.pgo)
	GO='$(GO)' CC='$(CC)' bench/pgo_profile.sh capi/default.pgo $(BUILD)/pgo

$(BUILD)/replay: capi/ctest/replay.c include/cudapool.h lib
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I include -o $@ $< $(TEST_LDFLAGS)

clean:
	rm -rf $(LIBDIR) $(BUILD)

# ---- packaging: install, uninstall, wheel ----------------------------------
#
#   make install [PREFIX=/usr/local] [DESTDIR=...]   the library with its
#        SONAME and symlinks, include/cudapool.h, lib/pkgconfig/cudapool.pc,
#        share/doc/cudapool/LICENSE and README.md
#   make uninstall [PREFIX=...] [DESTDIR=...]
#   make wheel     dist/cudapool-VERSION-py3-none-manylinux_X_Y_<arch>.whl
#   make test-install   install into a temporary DESTDIR, build and run
#        examples/c/example.c with pkg-config, uninstall (part of make test)
#
# VERSION holds the one version string (capi/version_test.go checks its
# copies). The installed library is built apart from lib/libcudapool.so,
# which keeps no SONAME: what links against lib/ (tests, benchmarks, the
# PyTorch class) then needs no libcudapool.so.MAJOR link beside it.

VERSION        := $(shell cat VERSION)
VERSION_MAJOR  := $(firstword $(subst ., ,$(VERSION)))
SONAME         := libcudapool.so.$(VERSION_MAJOR)
REALNAME       := libcudapool.so.$(VERSION)
PREFIX         ?= /usr/local
INSTALL_LIBDIR ?= $(PREFIX)/lib
INSTALL_INCDIR ?= $(PREFIX)/include
INSTALL_PCDIR  ?= $(INSTALL_LIBDIR)/pkgconfig
INSTALL_DOCDIR ?= $(PREFIX)/share/doc/cudapool
INSTALL_BUILD  := $(BUILD)/install
PYTHON         ?= python3
# Extra flags for `pip wheel` (e.g. --no-build-isolation where there is no index).
PIP_WHEEL_FLAGS ?=

.PHONY: install-lib install uninstall wheel test-install test-charts set-version

install-lib:
	@mkdir -p $(INSTALL_BUILD)
	GO='$(GO)' CUDAPOOL_SONAME=$(SONAME) bash capi/build_lib.sh $(INSTALL_BUILD)/$(REALNAME)

install: install-lib
	install -d $(DESTDIR)$(INSTALL_LIBDIR) $(DESTDIR)$(INSTALL_INCDIR) $(DESTDIR)$(INSTALL_PCDIR) \
		$(DESTDIR)$(INSTALL_DOCDIR)
	install -m 0755 $(INSTALL_BUILD)/$(REALNAME) $(DESTDIR)$(INSTALL_LIBDIR)/$(REALNAME)
	ln -sf $(REALNAME) $(DESTDIR)$(INSTALL_LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(INSTALL_LIBDIR)/libcudapool.so
	install -m 0644 include/cudapool.h $(DESTDIR)$(INSTALL_INCDIR)/cudapool.h
	printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$(INSTALL_LIBDIR)' 'includedir=$(INSTALL_INCDIR)' '' \
		'Name: cudapool' 'Description: CUDA caching memory allocator (C ABI; the driver is loaded at run time)' \
		'Version: $(VERSION)' 'Libs: -L$${libdir} -lcudapool' 'Cflags: -I$${includedir}' \
		>$(DESTDIR)$(INSTALL_PCDIR)/cudapool.pc
	install -m 0644 LICENSE README.md $(DESTDIR)$(INSTALL_DOCDIR)/
	@# The loader cache knows the new library only after ldconfig (root, real install only).
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ] && command -v ldconfig >/dev/null; then ldconfig; fi

uninstall:
	rm -f $(DESTDIR)$(INSTALL_LIBDIR)/libcudapool.so $(DESTDIR)$(INSTALL_LIBDIR)/$(SONAME) \
		$(DESTDIR)$(INSTALL_LIBDIR)/$(REALNAME) $(DESTDIR)$(INSTALL_INCDIR)/cudapool.h \
		$(DESTDIR)$(INSTALL_PCDIR)/cudapool.pc \
		$(DESTDIR)$(INSTALL_DOCDIR)/LICENSE $(DESTDIR)$(INSTALL_DOCDIR)/README.md
	@rmdir $(DESTDIR)$(INSTALL_DOCDIR) 2>/dev/null || true

test-install:
	$(call section,make install into a temporary DESTDIR; pkg-config example)
	MAKE="$(MAKE)" sh examples/c/test_install.sh

# The wheel carries lib/libcudapool.so and the C++ class's sources; the class
# itself is compiled against the user's torch on the first install(), so
# torch is no build dependency (CUDAPOOL_PREBUILD_CLASS=0). python/setup.py
# tags it manylinux_2_N for the newest glibc symbol version the library needs.
wheel: lib
	rm -rf python/build
	@mkdir -p dist
	rm -f dist/cudapool-$(VERSION)-*.whl
	CUDAPOOL_LIBRARY=$(CURDIR)/$(LIB) CUDAPOOL_PREBUILD_CLASS=0 \
		$(PYTHON) -m pip wheel --no-deps $(PIP_WHEEL_FLAGS) -w dist ./python
	@ls dist/cudapool-$(VERSION)-py3-none-*.whl

# The charts' data handling, and the trace series recording on the simulator;
# the drawing tests skip without matplotlib (saying so).
test-charts: lib
	$(call section,benchmark charts tests)
	python3 -m pytest -q -rs -p no:cacheprovider bench/test_charts.py

# make set-version V=MAJOR.MINOR.PATCH: writes V into VERSION and its copies
# (capi/version.go, include/cudapool.h, python/cudapool/_version.py), then
# checks that they agree. The ABI numbers are changed by hand, on purpose.
set-version:
	@echo '$(V)' | grep -Eqx '[0-9]+\.[0-9]+\.[0-9]+' || { echo "usage: make set-version V=MAJOR.MINOR.PATCH"; exit 1; }
	@set -e; v='$(V)'; ma=$${v%%.*}; rest=$${v#*.}; mi=$${rest%%.*}; pa=$${rest#*.}; \
	echo "$$v" >VERSION; \
	sed -i -E "s/^(\tversionMajor = )[0-9]+/\1$$ma/; s/^(\tversionMinor = )[0-9]+/\1$$mi/; s/^(\tversionPatch = )[0-9]+/\1$$pa/" capi/version.go; \
	sed -i -E "s/^(#define CUDAPOOL_VERSION_MAJOR )[0-9]+/\1$$ma/; s/^(#define CUDAPOOL_VERSION_MINOR )[0-9]+/\1$$mi/; s/^(#define CUDAPOOL_VERSION_PATCH )[0-9]+/\1$$pa/; s/^(#define CUDAPOOL_VERSION_STRING )\"[^\"]*\"/\1\"$$v\"/" include/cudapool.h; \
	sed -i -E "s/^__version__ = \"[^\"]*\"/__version__ = \"$$v\"/" python/cudapool/_version.py
	$(GO) test -run TestVersionsAgree ./capi
