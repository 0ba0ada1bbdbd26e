// SPDX-License-Identifier: Apache-2.0
// Kernels of the C soak (gpu/soak_c.c), compiled to PTX by gpu/soak.sh and
// loaded with cuModuleLoad (the soak itself is plain C, through the driver
// API and cudapool's C ABI).

extern "C" __global__ void soak_fill(unsigned *p, unsigned long long n, unsigned v) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    p[i] = v;
}

// Adds to *bad the number of elements of p that are not v.
extern "C" __global__ void soak_count_ne(const unsigned *p, unsigned long long n, unsigned v,
                                         unsigned long long *bad) {
  unsigned long long mine = 0;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    mine += p[i] != v;
  if (mine) atomicAdd(bad, mine);
}

// Spins for ns nanoseconds: the delay before a delayed read.
extern "C" __global__ void soak_spin(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// out[i] = in[i] + 1: the graphs' work.
extern "C" __global__ void soak_add_one(unsigned *out, const unsigned *in, unsigned long long n) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    out[i] = in[i] + 1;
}
