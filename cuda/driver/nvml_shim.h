// SPDX-License-Identifier: Apache-2.0
// Shared declarations of the NVML trampoline shim (see nvml_shim.c).
// Everything here is hidden: it links go-nvml's references inside
// libcudapool.so and never appears in its dynamic symbol table.

#ifndef CUDAPOOL_NVML_SHIM_H
#define CUDAPOOL_NVML_SHIM_H

#define CP_HIDDEN __attribute__((visibility("hidden")))

// Generated (zz_nvml_trampolines_linux_amd64.c).
extern CP_HIDDEN const int cp_nvml_count;
extern CP_HIDDEN const char *const cp_nvml_names[];
extern CP_HIDDEN const unsigned char cp_nvml_returns_string[];
extern CP_HIDDEN void *cp_nvml_table[];

// Hand-written (nvml_shim.c). cp_nvml_lazy is an assembly entry point with
// a private calling convention (r11 = slot); never call it from C.
CP_HIDDEN void cp_nvml_lazy(void);
CP_HIDDEN void cp_nvml_resolve(void);

#endif
