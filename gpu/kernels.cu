// SPDX-License-Identifier: Apache-2.0
// Kernels for the GPU tests, compiled to PTX on the GPU machine and loaded
// with cuModuleLoad by test_gpu.c (which is plain C).
extern "C" __global__ void fill(unsigned *p, unsigned n, unsigned v) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = v;
}

// Spins for ns nanoseconds, then counts the elements of p that are not v:
// a kernel still reading a buffer long after the host has freed it.
extern "C" __global__ void spin_check(const unsigned *p, unsigned n, unsigned v,
                                      unsigned long long ns, unsigned *bad) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
  for (unsigned i = threadIdx.x; i < n; i += blockDim.x)
    if (p[i] != v) atomicAdd(bad, 1u);
}

extern "C" __global__ void add_one(unsigned *out, const unsigned *in, unsigned n) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] + 1;
}
