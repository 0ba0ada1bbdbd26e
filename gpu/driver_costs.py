# SPDX-License-Identifier: Apache-2.0
"""What the CUDA driver's memory calls cost this host, in microseconds of
host time: the figures docs/fragmentation.md ("What a page move costs") and
docs/benchmarks.md reason with. Needs only libcuda (no PyTorch).

    python3 gpu/driver_costs.py            # all four tables, device 0
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

Each figure is the median over --reps repetitions (the first one dropped:
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


TABLES = {"sizes": table_sizes, "runs": table_runs, "calls": table_calls, "fixed": table_fixed}


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
