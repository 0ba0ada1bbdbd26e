# SPDX-License-Identifier: Apache-2.0
# cudapool: build libcudapool.so and run its tests.
#
# Build
#   make, make lib  lib/libcudapool.so and lib/cudapool.h; rebuilt only when a
#                   source changes (Go files, capi's C, the export map, the
#                   PGO profile, go.mod/go.sum, the header) or the Go release
#   make install    the library, header, pkg-config file, LICENSE and README
#                   under PREFIX (packaging targets: see the end of this file)
#   make wheel      the Python wheel in dist/
#
# Test (none needs a GPU: the C and Python tests run on the simulator)
#   make check      the inner loop: gofmt, go vet, go test -short ./..., the C
#                   ABI test, the Python unit tests; on two CPUs about 15 s
#                   with a warm Go build cache, under 3 minutes from a cold one
#   make test       everything, about 10 minutes on two CPUs: the stages below,
#                   one line each; their output goes to build/test-logs/*.log
#                   (a failing stage's tail is printed) and a summary with the
#                   counts and every skipped test's reason ends it
#   make check-go test-go test-race test-c test-cxx check-lib test-python
#        test-install test-charts
#                   one stage of make test, with its full output
#   make soak       10^7 randomized operations from many goroutines on the
#                   simulator, invariants checked after every batch
#                   (SOAK_OPS=N sets the count; make test runs 10^5)
#   make demo       replay demo/trace.txt through the library, with the
#                   defaults (stitching) and with expandable_segments:False
#   make pgo        regenerate capi/default.pgo, the profile for profile-guided
#                   optimization (commit it; see the target)
#   make clean

GO      ?= go
CC      := gcc
CXX     := g++
PYTHON  ?= python3
LIBDIR  := lib
LIB     := $(LIBDIR)/libcudapool.so
BUILD   := build

TEST_CFLAGS   := -O1 -g -Wall -Wextra -Werror -I include
TEST_LDFLAGS  := -L $(LIBDIR) -lcudapool -Wl,-rpath,$(CURDIR)/$(LIBDIR) -pthread
# The ABI tests run on the simulator with two devices and no configuration.
SIM_ENV       := env -u CUDAPOOL_CONF -u PYTORCH_CUDA_ALLOC_CONF CUDAPOOL_BACKEND=sim CUDAPOOL_SIM_DEVICES=2

# Packages whose tests run goroutines concurrently, run again with -race.
RACE_PKGS := ./allocator/... ./cuda/sim/... ./events/... ./graphs/... ./pools/... ./privatepool/...

# Extra flags for go test in test-go (make test's runner passes -v, so that
# the summary can name the skipped tests and why they skipped).
GOTESTFLAGS ?=

section = @printf '\n==== %s ====\n' '$(1)'

.PHONY: all lib test check check-go test-go test-short test-race test-c test-c-abi test-cxx check-lib \
	test-python test-python-unit demo soak pgo clean FORCE

all: lib

# ---- the library ------------------------------------------------------------
#
# capi/build_lib.sh builds it (here, for make install, and in python/setup.py):
# go build -buildmode=c-shared with the toolchain as installed, exporting only
# the cudapool_* functions (capi/exports.map). go build reads capi/default.pgo
# by itself (-pgo=auto).

# What the library is built from: the module's Go files (tests and testdata
# aside), the C compiled by cgo, the export map, the profile, the headers.
HEADERS  := $(wildcard include/*.h)
LIB_SRCS := $(shell find . \( -name .git -o -name testdata -o -path ./build -o -path ./lib -o -path ./dist \
		-o -path ./python -o -path ./docs -o -path ./gpu \) -prune -o -type f -name '*.go' ! -name '*_test.go' -print) \
	$(wildcard capi/*.c capi/*.h capi/*.cpp) \
	$(shell find cuda -name testdata -prune -o -type f \( -name '*.c' -o -name '*.h' -o -name '*.s' \) -print) \
	capi/exports.map capi/default.pgo capi/build_lib.sh go.mod go.sum $(HEADERS)

# The Go release and target, rewritten only when they change (GO=...,
# GOTOOLCHAIN=...), so that another toolchain rebuilds the library.
GO_STAMP := $(BUILD)/go-version
$(GO_STAMP): FORCE
	@mkdir -p $(BUILD)
	@v="$$($(GO) env GOVERSION GOOS GOARCH GOAMD64 CGO_ENABLED GOFLAGS | tr '\n' ' ')"; \
	[ "$$(cat $@ 2>/dev/null)" = "$$v" ] || echo "$$v" >$@
FORCE:

# BUILD_COMMIT, which bench/run_bench.sh reads where no git checkout travels
# along: the commit the library was built from, and "dirty" if the tree
# differed from it.
$(LIB): $(LIB_SRCS) $(GO_STAMP)
	@mkdir -p $(LIBDIR)
	GO='$(GO)' bash capi/build_lib.sh $@
	@{ git rev-parse --short HEAD 2>/dev/null || echo unknown; \
	   git diff --quiet HEAD -- . 2>/dev/null || echo dirty; } >$(LIBDIR)/BUILD_COMMIT

$(LIBDIR)/cudapool.h: include/cudapool.h
	@mkdir -p $(LIBDIR)
	cp $< $@

lib: $(LIB) $(LIBDIR)/cudapool.h

# ---- make test and make check -------------------------------------------------
#
# .ci/stages.py runs each stage as `make STAGE`, its output in
# build/test-logs/STAGE.log, prints one line per stage with its counts,
# the tail of a failing stage's log (TEST_TAIL lines), and a summary.
TEST_STAGES  := check-go test-go test-race test-c test-cxx check-lib test-python test-install test-charts
CHECK_STAGES := check-go test-short test-c-abi test-python-unit
TEST_TAIL    ?= 40
STAGES = $(PYTHON) .ci/stages.py --make '$(MAKE)' --logs $(BUILD)/test-logs --tail $(TEST_TAIL)

test: lib
	@$(STAGES) --title 'make test' $(TEST_STAGES) -- GOTESTFLAGS=-v

# check: a quick pass for the inner loop; make test remains the full one.
check: lib
	@$(STAGES) --title 'make check' $(CHECK_STAGES) -- GOTESTFLAGS=-v

check-go:
	$(call section,gofmt and go vet)
	@out=$$(gofmt -l .); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

test-go:
	$(call section,go test ./...)
	$(GO) test $(GOTESTFLAGS) ./...

# test-short: go test -short, which leaves out the long randomized runs, the
# soak and the builds of test programs that make test runs in full.
test-short:
	$(call section,go test -short ./...)
	$(GO) test -short $(GOTESTFLAGS) ./...

test-race:
	$(call section,go test -race)
	$(GO) test -race $(RACE_PKGS)

$(BUILD)/test_cudapool: capi/ctest/test_cudapool.c capi/ctest/check.h $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_cudapool_cpp: capi/ctest/test_cudapool.cpp $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CXX) -std=c++17 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_torchabi: capi/ctest/test_torchabi.c capi/ctest/check.h $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_interop: capi/ctest/test_interop.c capi/ctest/check.h $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_tags: capi/ctest/test_tags.c capi/ctest/check.h $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

$(BUILD)/test_front: capi/ctest/test_front.c capi/ctest/check.h $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -o $@ $< $(TEST_LDFLAGS)

# front.c alone (no library, no Go): its cold mode.
$(BUILD)/test_front_cold: capi/ctest/test_front_cold.c capi/front.c capi/capi.h
	@mkdir -p $(BUILD)
	$(CC) -std=c11 $(TEST_CFLAGS) -I capi -o $@ $< -pthread

# test_front runs twice, with the front cache on and off (debug_checks in
# both); its "cmp" lines are statistics that do not depend on placement, so
# the two runs' must be identical. It does so for ordinary segments
# (expandable_segments:False), for expandable segments without stitching,
# and for the default (expandable segments with stitching): the front serves
# expandable private pools holding only small blocks (shorter runs: every
# operation's invariant check walks the pages). The stitching run keeps
# stitching from synchronizing the device (stitch_sync:False): a
# synchronization completes the work the test's model of waiting frees
# holds pending, at points that depend on placement.
FRONT_CONF := debug_checks:True,max_split_size_mb:40
FRONT_EXP_ARGS := 1 30000 10000

test-c: $(BUILD)/test_cudapool $(BUILD)/test_torchabi $(BUILD)/test_interop $(BUILD)/test_tags $(BUILD)/test_front $(BUILD)/test_front_cold $(BUILD)/c_bench
	$(call section,C ABI test (simulator))
	$(SIM_ENV) ./$(BUILD)/test_cudapool
	$(call section,C ABI for tags: pause and resume (simulator))
	$(SIM_ENV) ./$(BUILD)/test_tags
	$(call section,C ABI for the PyTorch allocator class (simulator))
	$(SIM_ENV) CUDAPOOL_SIM_MEMORY=8G ./$(BUILD)/test_torchabi
	$(call section,C ABI for CuPy and other libraries (simulator))
	$(SIM_ENV) ./$(BUILD)/test_interop
	$(call section,front cache: cold mode (front.c alone))
	./$(BUILD)/test_front_cold
	$(call section,front cache: randomized; front on and off (simulator))
	@rc=0; for kind in plain exp stitch; do \
		args='$(FRONT_EXP_ARGS)'; extra=; \
		case $$kind in plain) args=; extra=,expandable_segments:False;; exp) extra=,expandable_segments:True,stitch:False;; stitch) extra=,stitch_sync:False;; esac; \
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
$(BUILD)/c_bench: bench/c_bench.c bench/workloads.h $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -I include -I bench -o $@ $< $(TEST_LDFLAGS) -ldl -pthread

# test-c-abi: the C ABI tests of the allocator and of tags (make check).
test-c-abi: $(BUILD)/test_cudapool $(BUILD)/test_tags
	$(call section,C ABI test (simulator))
	$(SIM_ENV) ./$(BUILD)/test_cudapool
	$(call section,C ABI for tags: pause and resume (simulator))
	$(SIM_ENV) ./$(BUILD)/test_tags

test-cxx: $(BUILD)/test_cudapool_cpp
	$(call section,C++ ABI test (simulator))
	$(SIM_ENV) ./$(BUILD)/test_cudapool_cpp

# bench/hot_path.c (docs/hot-path.md), built and run once by check-lib: the
# library's hot path works from a C program (it exits non-zero on an error).
$(BUILD)/hot_path: bench/hot_path.c $(HEADERS) $(LIB)
	@mkdir -p $(BUILD)
	$(CC) -std=c11 -O2 -Wall -Wextra -Werror -I include -o $@ $< $(TEST_LDFLAGS) -ldl

check-lib: $(LIB) $(BUILD)/hot_path
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

# -rs: pytest lists every skipped test with its reason.
test-python: test-python-unit
	$(call section,benchmark report generator tests)
	$(PYTHON) -m pytest -q -rs bench/test_report.py bench/test_kvcache.py bench/test_fsdp_tools.py bench/test_pause_bench.py examples/colocated/test_colocated.py
	$(call section,PyTorch test report generator and GPU tool tests)
	$(PYTHON) -m pytest -q -rs -p no:cacheprovider gpu/pytorch_tests/test_report.py gpu/test_tools.py

test-python-unit: $(LIB)
	$(call section,Python unit tests)
	cd python && $(PYTHON) -m pytest -q -rs tests

# soak: allocator/soak_test.go with SOAK_OPS operations (10^7 by default).
SOAK_OPS ?= 1e7
soak:
	$(call section,soak: $(SOAK_OPS) operations on the simulator)
	SOAK_OPS=$(SOAK_OPS) $(GO) test -count=1 -timeout 0 -run '^TestSoak$$' -v ./allocator/

# demo: replay a recorded allocation trace through the library, on the GPU
# if there is one, else on the simulator, with the default configuration
# (expandable segments with stitching) and with expandable_segments:False
# (ordinary segments), then print both fragmentation figures (peak reserved
# / peak allocated). make demo TRACE=... REPEATS=...
TRACE   ?= demo/trace.txt
REPEATS ?= 5
DEMO_CONFS := default expandable_segments:False
demo: $(BUILD)/replay
	$(call section,replay $(TRACE))
	@if [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; then backend=cuda; else backend=sim; fi; \
	echo "backend: $$backend"; \
	rc=0; for conf in $(DEMO_CONFS); do \
		out=$(BUILD)/demo.$$conf.out; echo; \
		cf=CUDAPOOL_CONF=$$conf; [ $$conf = default ] && cf=CUDAPOOL_BACKEND=$$backend; \
		env -u CUDAPOOL_CONF -u PYTORCH_CUDA_ALLOC_CONF CUDAPOOL_BACKEND=$$backend $$cf \
			./$(BUILD)/replay $(TRACE) $(REPEATS) >$$out || rc=1; \
		cat $$out; \
	done; \
	echo; echo "fragmentation of $(TRACE) (peak reserved / peak allocated; 1.000 wastes nothing):"; \
	for conf in $(DEMO_CONFS); do \
		f=$$(awk '$$1 == "fragmentation" { print $$2 }' $(BUILD)/demo.$$conf.out); \
		case $$conf in default) name="the defaults (expandable segments, stitching)";; *) name="$$conf (ordinary segments)";; esac; \
		printf '  %-46s %s\n' "$$name" "$${f:-failed}"; \
	done; \
	exit $$rc

# pgo: rewrites capi/default.pgo, the CPU profile go build uses for
# profile-guided optimization of the library: hotter inlining along the
# class path's malloc (cpgo_malloc_ctx, Allocator.Malloc, the device's malloc
# and free, the pools) and in the runtime's side of the crossing, about 6%
# fewer instructions per mixed pair and no more instruction-cache lines
# (docs/hot-path.md). The profile comes from committed
# benchmarks (bench/pgo_profile.sh: bench/c_bench.c through a profiling
# build of the library, and allocator's BenchmarkPGOCapture), on the
# simulator, in about 20 s. Run it after changing the hot path and commit
# the result: a stale profile still builds, but helps less and can cost
# cache lines.
pgo:
	$(call section,pgo: profile the library on the simulator into capi/default.pgo)
	GO='$(GO)' CC='$(CC)' bench/pgo_profile.sh capi/default.pgo $(BUILD)/pgo

$(BUILD)/replay: capi/ctest/replay.c $(HEADERS) $(LIB)
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
# Extra flags for `pip wheel` (e.g. --no-build-isolation where there is no index).
PIP_WHEEL_FLAGS ?=

.PHONY: install-lib install uninstall wheel test-install test-charts set-version

install-lib: $(INSTALL_BUILD)/$(REALNAME)

$(INSTALL_BUILD)/$(REALNAME): $(LIB_SRCS) $(GO_STAMP)
	@mkdir -p $(INSTALL_BUILD)
	GO='$(GO)' CUDAPOOL_SONAME=$(SONAME) bash capi/build_lib.sh $@

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
test-charts: $(LIB)
	$(call section,benchmark charts tests)
	$(PYTHON) -m pytest -q -rs -p no:cacheprovider bench/test_charts.py

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
