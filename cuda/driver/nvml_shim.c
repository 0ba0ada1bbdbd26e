// SPDX-License-Identifier: Apache-2.0
//go:build linux && cgo && amd64

// NVML trampoline shim: the run-time half. See nvml.go for why it exists.
//
// Every nvml* function that go-nvml calls is defined (hidden) in
// zz_nvml_trampolines_linux_amd64.c as
//
//	nvmlFoo: movl $i, %r11d; jmpq *cp_nvml_table+8*i(%rip)
//
// Every table slot starts at cp_nvml_lazy. The first call of any trampoline
// lands there; it saves the argument registers, calls cp_nvml_resolve (which,
// once per process, dlopens libnvidia-ml.so.1 and overwrites every slot with
// the real function or a stub), restores the registers and jumps to slot
// r11, so the original call proceeds with its arguments untouched. Later
// calls cost one indirect jump.
//
// Stubs: without the library every nvmlReturn_t function returns
// NVML_ERROR_LIBRARY_NOT_FOUND (12); a function the installed library lacks
// returns NVML_ERROR_FUNCTION_NOT_FOUND (13); nvmlErrorString returns a
// fixed message instead of a code (its result is read as a char*).
// go-nvml itself dlopens the library in nvml.Init and calls nothing before
// that succeeds, so in practice the stubs matter only for missing functions
// and for callers that skip nvml.Init.

#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>

#include "nvml_shim.h"

#define CP_NVML_LIBRARY "libnvidia-ml.so.1"
#define CP_NVML_ERROR_LIBRARY_NOT_FOUND 12
#define CP_NVML_ERROR_FUNCTION_NOT_FOUND 13

// The stubs take no parameters: whatever the caller passed is ignored, which
// is harmless in the SysV ABI (the caller owns its argument registers and
// stack slots).
static int cp_nvml_no_library(void) { return CP_NVML_ERROR_LIBRARY_NOT_FOUND; }
static int cp_nvml_no_function(void) { return CP_NVML_ERROR_FUNCTION_NOT_FOUND; }
static const char *cp_nvml_no_library_string(void) {
	return "NVML library (" CP_NVML_LIBRARY ") not found";
}
static const char *cp_nvml_no_function_string(void) {
	return "function not found in the NVML library";
}

static pthread_once_t cp_nvml_once = PTHREAD_ONCE_INIT;

static void cp_nvml_resolve_all(void) {
	// RTLD_LOCAL: the symbols are reached through dlsym only. If go-nvml
	// has already opened the library (RTLD_GLOBAL) this returns the same
	// object. The handle is kept for the life of the process.
	void *h = dlopen(CP_NVML_LIBRARY, RTLD_NOW | RTLD_LOCAL);
	for (int i = 0; i < cp_nvml_count; i++) {
		// dlsym on the library's handle searches it and its dependencies
		// only, so it can never return one of our (hidden) trampolines.
		void *p = h != NULL ? dlsym(h, cp_nvml_names[i]) : NULL;
		if (p == NULL) {
			if (cp_nvml_returns_string[i])
				p = h != NULL ? (void *)cp_nvml_no_function_string : (void *)cp_nvml_no_library_string;
			else
				p = h != NULL ? (void *)cp_nvml_no_function : (void *)cp_nvml_no_library;
		}
		// Other threads may read the slot concurrently through a trampoline;
		// they see either the lazy resolver (and then wait in pthread_once)
		// or the final pointer.
		__atomic_store_n(&cp_nvml_table[i], p, __ATOMIC_RELEASE);
	}
}

void cp_nvml_resolve(void) { pthread_once(&cp_nvml_once, cp_nvml_resolve_all); }

// cp_nvml_lazy: entered by jmp from a trampoline with the caller's return
// address on the stack (rsp = 8 mod 16) and the slot index in r11. It
// preserves every register that can carry an argument (rdi, rsi, rdx, rcx,
// r8, r9, rax = vector-register count for variadics, r10 = static chain,
// xmm0-7) across the C call, then tail-jumps to the resolved function.
__asm__(
	".pushsection .text\n"
	".p2align 4\n"
	".globl cp_nvml_lazy\n"
	".hidden cp_nvml_lazy\n"
	".type cp_nvml_lazy, @function\n"
	"cp_nvml_lazy:\n"
	"\tpushq %rbp\n"
	"\tmovq %rsp, %rbp\n"
	"\tsubq $208, %rsp\n" // 10 * 8 (gprs, padded) + 8 * 16 (xmm); rsp stays 16-aligned
	"\tmovq %rdi, 0(%rsp)\n"
	"\tmovq %rsi, 8(%rsp)\n"
	"\tmovq %rdx, 16(%rsp)\n"
	"\tmovq %rcx, 24(%rsp)\n"
	"\tmovq %r8, 32(%rsp)\n"
	"\tmovq %r9, 40(%rsp)\n"
	"\tmovq %rax, 48(%rsp)\n"
	"\tmovq %r10, 56(%rsp)\n"
	"\tmovq %r11, 64(%rsp)\n"
	"\tmovaps %xmm0, 80(%rsp)\n"
	"\tmovaps %xmm1, 96(%rsp)\n"
	"\tmovaps %xmm2, 112(%rsp)\n"
	"\tmovaps %xmm3, 128(%rsp)\n"
	"\tmovaps %xmm4, 144(%rsp)\n"
	"\tmovaps %xmm5, 160(%rsp)\n"
	"\tmovaps %xmm6, 176(%rsp)\n"
	"\tmovaps %xmm7, 192(%rsp)\n"
	"\tcall cp_nvml_resolve\n"
	"\tmovq 0(%rsp), %rdi\n"
	"\tmovq 8(%rsp), %rsi\n"
	"\tmovq 16(%rsp), %rdx\n"
	"\tmovq 24(%rsp), %rcx\n"
	"\tmovq 32(%rsp), %r8\n"
	"\tmovq 40(%rsp), %r9\n"
	"\tmovq 48(%rsp), %rax\n"
	"\tmovq 64(%rsp), %r11\n"
	"\tmovaps 80(%rsp), %xmm0\n"
	"\tmovaps 96(%rsp), %xmm1\n"
	"\tmovaps 112(%rsp), %xmm2\n"
	"\tmovaps 128(%rsp), %xmm3\n"
	"\tmovaps 144(%rsp), %xmm4\n"
	"\tmovaps 160(%rsp), %xmm5\n"
	"\tmovaps 176(%rsp), %xmm6\n"
	"\tmovaps 192(%rsp), %xmm7\n"
	"\tleaq cp_nvml_table(%rip), %r10\n"
	"\tmovq (%r10,%r11,8), %r10\n" // the resolved function
	"\tpushq %r10\n"               // keep it while r10 itself is restored
	"\tmovq 56+8(%rsp), %r10\n"
	"\tpopq %r11\n"                // r11 is scratch in the ABI: free for the target
	"\tmovq %rbp, %rsp\n"
	"\tpopq %rbp\n"
	"\tjmpq *%r11\n"
	".size cp_nvml_lazy, .-cp_nvml_lazy\n"
	".popsection\n");
