# SPDX-License-Identifier: Apache-2.0
"""What the CUDA driver's memory calls cost this host, in microseconds of
host time: the figures docs/fragmentation.md ("What a page move costs") and
docs/benchmarks.md reason with. Needs only libcuda (no PyTorch).

    python3 gpu/driver_costs.py            # all five tables, device 0
    python3 gpu/driver_costs.py --device 1 --reps 9 --tables sizes,runs

Tables:
  sizes  per physical allocation of 2, 4, 8 and 20 MiB, over a run of
         allocations mapped side by side: cuMemMap of each, one
         cuMemSetAccess over the run (the driver charges it per
         allocation), cuMemUnmap of each.
  runs   cuMemUnmap of k adjacent 2 MiB mappings, k calls against one
         call over the run (k = 1, 4, 16, 64), per mapping.
  calls  one call at a time: cuMemAddressReserve of 17 GiB, cuMemCreate,
         cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease of one
         allocation, and cuMemAlloc / cuMemFree of the same size (2, 20,
         64 and 128 MiB).
  fixed  what a range's growth may pay once, whatever it maps: reserving
         (and freeing) 1/8 and 9/8 of the device's memory of addresses (a
         small and a large pool's range), cuMemGetInfo (read before mapping
         new memory), and cuCtxSynchronize with nothing queued.
  deferred
         whether a malloc could return before its pages are mapped: work
         queued on a stream behind cuStreamWaitValue32 on a host flag, into
         addresses reserved but not yet mapped (a kernel, cuMemsetD32Async,
         cuMemcpyHtoDAsync from pinned memory, cuMemcpyDtoDAsync), and the
         pointer queries, each call's CUresult (0: taken); then another
         thread maps the pages, sets access and raises the flag, and what
         was taken is checked. Also what such a wait costs the calling
         thread, against cuEventRecord.

Each timing is the median over --reps repetitions (the first one dropped:
it pays for lazy set-up). The device must have a few GiB free. Prints
"SKIP: ..." and exits 0 where there is no driver or device.
"""

import argparse
import ctypes
import statistics
import sys
import time

MiB = 1 << 20


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _LOCATION_DEVICE, _READ_WRITE = 1, 1, 3


class Driver:
    """The few driver entry points the tables time, on device dev's primary
    context made current on this thread."""

    def __init__(self, dev):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0), "cuInit")
        n = ctypes.c_int()
        self.check(self.cu.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        if not 0 <= dev < n.value:
            raise LookupError(f"device {dev} does not exist ({n.value} devices)")
        d = ctypes.c_int()
        self.check(self.cu.cuDeviceGet(ctypes.byref(d), dev), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), d), "cuDevicePrimaryCtxRetain")
        self.check(self.cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.prop = _AllocProp()
        self.prop.type = _PINNED
        self.prop.location = _Location(_LOCATION_DEVICE, dev)
        self.access = _AccessDesc(_Location(_LOCATION_DEVICE, dev), _READ_WRITE)

    @staticmethod
    def check(rc, what):
        if rc:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def reserve(self, size):
        p = ctypes.c_ulonglong()
        self.check(self.cu.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                               ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        return p.value

    def free_range(self, va, size):
        self.check(self.cu.cuMemAddressFree(ctypes.c_ulonglong(va), ctypes.c_size_t(size)), "cuMemAddressFree")

    def create(self, size):
        h = ctypes.c_ulonglong()
        self.check(self.cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(self.prop),
                                       ctypes.c_ulonglong(0)), "cuMemCreate")
        return h.value

    def release(self, h):
        self.check(self.cu.cuMemRelease(ctypes.c_ulonglong(h)), "cuMemRelease")

    def map(self, va, size, h):
        self.check(self.cu.cuMemMap(ctypes.c_ulonglong(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                    ctypes.c_ulonglong(h), ctypes.c_ulonglong(0)), "cuMemMap")

    def set_access(self, va, size):
        self.check(self.cu.cuMemSetAccess(ctypes.c_ulonglong(va), ctypes.c_size_t(size), ctypes.byref(self.access),
                                          ctypes.c_size_t(1)), "cuMemSetAccess")

    def unmap(self, va, size):
        return self.cu.cuMemUnmap(ctypes.c_ulonglong(va), ctypes.c_size_t(size))

    def mem_alloc(self, size):
        p = ctypes.c_ulonglong()
        self.check(self.cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(size)), "cuMemAlloc")
        return p.value

    def mem_free(self, p):
        self.check(self.cu.cuMemFree_v2(ctypes.c_ulonglong(p)), "cuMemFree")

    def mem_get_info(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check(self.cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def synchronize(self):
        self.check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def stream(self):
        s = ctypes.c_void_p()
        self.check(self.cu.cuStreamCreate(ctypes.byref(s), ctypes.c_uint(1)), "cuStreamCreate")  # non-blocking
        return s

    def host_alloc(self, size, flags):
        p = ctypes.c_void_p()
        self.check(self.cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_uint(flags)),
                   "cuMemHostAlloc")
        return p

    def host_device_pointer(self, p):
        d = ctypes.c_ulonglong()
        self.check(self.cu.cuMemHostGetDevicePointer_v2(ctypes.byref(d), p, ctypes.c_uint(0)),
                   "cuMemHostGetDevicePointer")
        return d.value


def median_us(samples):
    """Median in us of samples in seconds, the first (set-up) dropped."""
    return statistics.median(samples[1:] if len(samples) > 1 else samples) * 1e6


def table_sizes(drv, reps, run_mib=256):
    print(f"per allocation, over a run of {run_mib} MiB (one cuMemSetAccess for the run)")
    print(f"{'allocation':>10} {'count':>5} {'cuMemMap us':>12} {'cuMemSetAccess us':>18} {'cuMemUnmap us':>14}")
    va = drv.reserve(run_mib * MiB)
    try:
        for mib in (2, 4, 8, 20):
            n = max(1, run_mib // mib)
            size = mib * MiB
            handles = [drv.create(size) for _ in range(n)]
            tm, ta, tu = [], [], []
            try:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for i, h in enumerate(handles):
                        drv.map(va + i * size, size, h)
                    t1 = time.perf_counter()
                    drv.set_access(va, n * size)
                    t2 = time.perf_counter()
                    for i in range(n):
                        drv.check(drv.unmap(va + i * size, size), "cuMemUnmap")
                    t3 = time.perf_counter()
                    tm.append((t1 - t0) / n)
                    ta.append((t2 - t1) / n)
                    tu.append((t3 - t2) / n)
            finally:
                for h in handles:
                    drv.release(h)
            print(f"{mib:>7} MiB {n:>5} {median_us(tm):>12.1f} {median_us(ta):>18.1f} {median_us(tu):>14.1f}")
    finally:
        drv.free_range(va, run_mib * MiB)


def table_runs(drv, reps):
    print("cuMemUnmap of k adjacent 2 MiB mappings, us per mapping")
    print(f"{'k':>3} {'k calls':>9} {'one call':>9}")
    page, kmax = 2 * MiB, 64
    va = drv.reserve(kmax * page)
    handles = [drv.create(page) for _ in range(kmax)]

    def map_run(k):
        for i in range(k):
            drv.map(va + i * page, page, handles[i])
        drv.set_access(va, k * page)

    try:
        for k in (1, 4, 16, 64):
            apart, whole = [], []
            for _ in range(reps):
                map_run(k)
                t = time.perf_counter()
                for i in range(k):
                    drv.check(drv.unmap(va + i * page, page), "cuMemUnmap")
                apart.append((time.perf_counter() - t) / k)
                map_run(k)
                t = time.perf_counter()
                rc = drv.unmap(va, k * page)
                whole.append((time.perf_counter() - t) / k)
                if rc:  # this driver refuses a run: unmap the mappings one by one
                    for i in range(k):
                        drv.unmap(va + i * page, page)
                    print(f"{k:>3} {median_us(apart):>9.1f}   refused (CUresult {rc})")
                    break
            else:
                print(f"{k:>3} {median_us(apart):>9.1f} {median_us(whole):>9.1f}")
    finally:
        for h in handles:
            drv.release(h)
        drv.free_range(va, kmax * page)


def table_calls(drv, reps):
    print("one call at a time, us")
    cols = ("reserve 17 GiB", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
            "cuMemAlloc", "cuMemFree")
    print(f"{'size':>8} " + " ".join(f"{c:>14}" for c in cols))
    big = 17 << 30
    for mib in (2, 20, 64, 128):
        size = mib * MiB
        t = {c: [] for c in cols}
        pc = time.perf_counter
        for _ in range(reps):
            t0 = pc()
            va = drv.reserve(big)
            t["reserve 17 GiB"].append(pc() - t0)
            try:
                t0 = pc()
                h = drv.create(size)
                t["cuMemCreate"].append(pc() - t0)
                t0 = pc()
                drv.map(va, size, h)
                t["cuMemMap"].append(pc() - t0)
                t0 = pc()
                drv.set_access(va, size)
                t["cuMemSetAccess"].append(pc() - t0)
                t0 = pc()
                drv.check(drv.unmap(va, size), "cuMemUnmap")
                t["cuMemUnmap"].append(pc() - t0)
                t0 = pc()
                drv.release(h)
                t["cuMemRelease"].append(pc() - t0)
            finally:
                drv.free_range(va, big)
            t0 = pc()
            p = drv.mem_alloc(size)
            t["cuMemAlloc"].append(pc() - t0)
            t0 = pc()
            drv.mem_free(p)
            t["cuMemFree"].append(pc() - t0)
        print(f"{mib:>4} MiB " + " ".join(f"{median_us(t[c]):>14.1f}" for c in cols))


def table_fixed(drv, reps):
    _, total = drv.mem_get_info()
    print(f"fixed costs of a growth, us (device memory {total / (1 << 30):.1f} GiB)")
    sizes = {"1/8": (total // 8 + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)}
    sizes["9/8"] = sizes["1/8"] * 9
    pc = time.perf_counter
    t = {}
    for _ in range(reps):
        for name, size in sizes.items():
            t0 = pc()
            va = drv.reserve(size)
            t1 = pc()
            drv.free_range(va, size)
            t.setdefault(f"reserve {name}", []).append(t1 - t0)
            t.setdefault(f"free {name}", []).append(pc() - t1)
        t0 = pc()
        drv.mem_get_info()
        t.setdefault("cuMemGetInfo", []).append(pc() - t0)
        t0 = pc()
        drv.synchronize()
        t.setdefault("cuCtxSynchronize, idle", []).append(pc() - t0)
    for name, samples in t.items():
        print(f"{name:>24} {median_us(samples):>9.1f}")


# A kernel that stores v into n 32-bit words from p (PTX, compiled by the
# driver for whatever device runs it).
_FILL_PTX = b"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry fill(.param .u64 p, .param .u32 v, .param .u32 n)
{
    .reg .pred %q;
    .reg .b32 %r<6>;
    .reg .b64 %d<5>;
    ld.param.u64 %d1, [p];
    ld.param.u32 %r1, [v];
    ld.param.u32 %r2, [n];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r3, %r3, %r4, %r5;
    setp.ge.u32 %q, %r3, %r2;
    @%q bra DONE;
    cvta.to.global.u64 %d2, %d1;
    mul.wide.u32 %d3, %r3, 4;
    add.s64 %d4, %d2, %d3;
    st.global.u32 [%d4], %r1;
DONE:
    ret;
}
"""


def table_deferred(drv, reps, delay_s=0.2):
    """Queue work behind a wait on a host flag into addresses not yet
    mapped, map them on another thread, raise the flag, check the work."""
    import threading
    cu, page, pages = drv.cu, 2 * MiB, 4
    U64, U32 = ctypes.c_ulonglong, ctypes.c_uint32
    words, fill = page // 4, 0x5A5A5A5A
    va = drv.reserve(pages * page)
    hs, mapped, made = [], {}, {}
    try:
        hs.extend(drv.create(page) for _ in range(pages))
        made["flag"] = drv.host_alloc(4096, 2)  # CU_MEMHOSTALLOC_DEVICEMAP
        flag = U32.from_address(made["flag"].value)
        flag.value = 0
        flag_dev = U64(drv.host_device_pointer(made["flag"]))
        made["pinned"] = drv.host_alloc(page, 0)
        src = (U32 * words).from_address(made["pinned"].value)
        for i in range(words):
            src[i] = i
        s = made["stream"] = drv.stream()
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        drv.check(cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(_FILL_PTX)), "cuModuleLoadData")
        made["module"] = mod
        drv.check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"fill"), "cuModuleGetFunction")
        ev = ctypes.c_void_p()
        drv.check(cu.cuEventCreate(ctypes.byref(ev), ctypes.c_uint(2)), "cuEventCreate")
        made["event"] = ev

        def wait():  # cuStreamWaitValue32(stream, addr, value, CU_STREAM_WAIT_VALUE_GEQ)
            return cu.cuStreamWaitValue32_v2(s, flag_dev, U32(1), ctypes.c_uint(0))

        def launch(p):
            args = [U64(p), U32(fill), U32(words)]
            params = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
            return cu.cuLaunchKernel(fn, ctypes.c_uint((words + 255) // 256), 1, 1, 256, 1, 1, 0, s, params, None)

        def mapper():
            try:
                drv.check(cu.cuCtxSetCurrent(drv.ctx), "cuCtxSetCurrent")
                time.sleep(delay_s)
                mapped["t0"] = time.perf_counter()
                for i, h in enumerate(hs):
                    drv.map(va + i * page, page, h)
                drv.set_access(va, pages * page)
                mapped["us"] = (time.perf_counter() - mapped["t0"]) * 1e6
            finally:
                flag.value = 1  # never leave the stream waiting

        rc = wait()
        if rc != 0:  # nothing would hold the work back: queue none
            print(f"cuStreamWaitValue32 on a host flag refused (CUresult {rc}): nothing to measure")
            return
        th = threading.Thread(target=mapper, daemon=True)
        th.start()
        ordinal, base, size = ctypes.c_int(), U64(), ctypes.c_size_t()
        rc = {
            "kernel launch": launch(va),
            "cuMemsetD32Async": cu.cuMemsetD32Async(U64(va + page), ctypes.c_uint(fill), ctypes.c_size_t(words), s),
            "cuMemcpyHtoDAsync, pinned": cu.cuMemcpyHtoDAsync_v2(U64(va + 2 * page), made["pinned"],
                                                                  ctypes.c_size_t(page), s),
            "cuMemcpyDtoDAsync": cu.cuMemcpyDtoDAsync_v2(U64(va + 3 * page), U64(va), ctypes.c_size_t(page), s),
            "cuPointerGetAttribute": cu.cuPointerGetAttribute(ctypes.byref(ordinal), ctypes.c_int(9), U64(va)),
            "cuMemGetAddressRange": cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), U64(va)),
        }
        issued_before_mapping = "t0" not in mapped
        th.join(30)
        done = [None]

        def sync():
            done[0] = cu.cuStreamSynchronize(s)

        ts = threading.Thread(target=sync, daemon=True)
        ts.start()
        ts.join(30)
        print(f"work queued on unmapped addresses behind a stream wait (all issued before the mapping began: "
              f"{issued_before_mapping}; the other thread mapped {pages} pages in {mapped.get('us', -1):.0f} us)")
        if done[0] != 0:
            print(f"the stream did not drain after the flag (CUresult {done[0]}): stopping here")
            made.clear()  # the stream may still run: leave everything to the process's exit
            hs.clear()
            mapped.clear()
            va = 0
            return
        back = (U32 * (pages * words))()
        drv.check(cu.cuMemcpyDtoH_v2(back, U64(va), ctypes.c_size_t(pages * page)), "cuMemcpyDtoH")
        checks = {"kernel launch": all(back[i] == fill for i in range(0, words, 997)),
                  "cuMemsetD32Async": all(back[words + i] == fill for i in range(0, words, 997)),
                  "cuMemcpyHtoDAsync, pinned": all(back[2 * words + i] == i for i in range(0, words, 997)),
                  "cuMemcpyDtoDAsync": all(back[3 * words + i] == fill for i in range(0, words, 997))}
        for name, r in rc.items():
            what = "taken" if r == 0 else "refused"
            ok = checks.get(name)
            right = "" if ok is None or r != 0 else (", result right" if ok else ", result WRONG")
            print(f"{name:>32} CUresult {r:>3}: {what}{right}")
        pc, t = time.perf_counter, {}
        for _ in range(reps):
            for name, f in (("cuStreamWaitValue32, met", wait), ("cuEventRecord", lambda: cu.cuEventRecord(ev, s))):
                t0 = pc()
                for _ in range(200):
                    f()
                t.setdefault(name, []).append((pc() - t0) / 200)
        drv.check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
        for name, samples in t.items():
            print(f"{name:>32} {median_us(samples):>9.2f} us per call")
    finally:
        if "event" in made:
            cu.cuEventDestroy_v2(made["event"])
        if "module" in made:
            cu.cuModuleUnload(made["module"])
        if "stream" in made:
            cu.cuStreamDestroy_v2(made["stream"])
        for k in ("pinned", "flag"):
            if k in made:
                cu.cuMemFreeHost(made[k])
        if "t0" in mapped:  # (a page the mapper never reached refuses quietly)
            for i in range(pages):
                drv.unmap(va + i * page, page)
        for h in hs:
            drv.release(h)
        if va:
            drv.free_range(va, pages * page)

TABLES = {"sizes": table_sizes, "runs": table_runs, "calls": table_calls, "fixed": table_fixed,
          "deferred": table_deferred}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=7, help="repetitions per figure (the first is dropped)")
    ap.add_argument("--tables", default=",".join(TABLES), help="comma-separated: " + ", ".join(TABLES))
    args = ap.parse_args(argv)
    names = [t.strip() for t in args.tables.split(",") if t.strip()]
    bad = [t for t in names if t not in TABLES]
    if bad or not names:
        ap.error(f"unknown table(s) {bad}; choose from {', '.join(TABLES)}")
    if args.reps < 2:
        ap.error("--reps must be at least 2 (the first is dropped)")
    try:
        drv = Driver(args.device)
    except OSError as e:
        print(f"SKIP: no CUDA driver ({e})")
        return 0
    except RuntimeError as e:
        print(f"SKIP: {e}")
        return 0
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, name in enumerate(names):
        if i:
            print()
        TABLES[name](drv, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
