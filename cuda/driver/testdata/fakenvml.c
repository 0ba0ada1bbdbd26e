// SPDX-License-Identifier: Apache-2.0
// A fake libnvidia-ml.so.1 for the tests. It defines only what cuda/driver's
// DeviceProcesses path uses, plus one function with a made-up signature that
// checks every argument register (to test the lazy resolver), and
// deliberately no nvmlErrorString and no nvmlDeviceGetCount* (to test the
// "function not found" stubs).

#include <string.h>

typedef struct {
	unsigned int pid;
	unsigned long long usedGpuMemory;
	unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t; // the v3 layout (nvmlProcessInfo_v2_t)

static int inited;

int nvmlInit_v2(void) { inited = 1; return 0; }
int nvmlInit(void) { inited = 1; return 0; }
int nvmlShutdown(void) { inited = 0; return 0; }

int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **dev) {
	if (!inited)
		return 1; // NVML_ERROR_UNINITIALIZED
	if (strcmp(bus, "0000:3b:00.0") != 0)
		return 6; // NVML_ERROR_NOT_FOUND
	*dev = (void *)0xd0;
	return 0;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *dev, unsigned int *count, nvmlProcessInfo_t *infos) {
	if (dev != (void *)0xd0)
		return 2; // NVML_ERROR_INVALID_ARGUMENT
	if (*count < 2) {
		*count = 2;
		return 7; // NVML_ERROR_INSUFFICIENT_SIZE
	}
	memset(infos, 0, 2 * sizeof *infos);
	infos[0].pid = 111;
	infos[0].usedGpuMemory = 1ULL << 30;
	infos[1].pid = 222;
	infos[1].usedGpuMemory = ~0ULL; // NVML_VALUE_NOT_AVAILABLE
	*count = 2;
	return 0;
}

// Not NVML's real signature: six integer, eight floating-point and two stack
// arguments. Returns 0 if every one arrived intact, else the first bad one.
int nvmlSystemGetHicVersion(long a1, long a2, long a3, long a4, long a5, long a6,
			    double d0, double d1, double d2, double d3, double d4, double d5, double d6, double d7,
			    long s1, long s2) {
	long a[] = {a1, a2, a3, a4, a5, a6};
	double d[] = {d0, d1, d2, d3, d4, d5, d6, d7};
	for (int i = 0; i < 6; i++)
		if (a[i] != 0x1111 * (i + 1))
			return 100 + i;
	for (int i = 0; i < 8; i++)
		if (d[i] != 0.5 + i)
			return 200 + i;
	if (s1 != 0x7777 || s2 != 0x8888)
		return 300;
	return 0;
}
