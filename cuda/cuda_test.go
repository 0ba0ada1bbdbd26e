// SPDX-License-Identifier: Apache-2.0

package cuda_test

import (
	"errors"
	"strings"
	"syscall"
	"testing"

	"github.com/cudapool/cudapool/cuda"
)

// Each way pidfd_open or pidfd_getfd can fail says what is missing, and the
// errno stays reachable.
func TestPidfdErrorMessages(t *testing.T) {
	for _, c := range []struct {
		err  cuda.PidfdError
		want []string
	}{
		{cuda.PidfdError{Call: "pidfd_getfd", PID: 42, FD: 7, Errno: syscall.ENOSYS}, []string{"the kernel lacks pidfd_getfd (Linux 5.6+)"}},
		{cuda.PidfdError{Call: "pidfd_open", PID: 42, FD: -1, Errno: syscall.ENOSYS}, []string{"the kernel lacks pidfd_open (Linux 5.3+)"}},
		{cuda.PidfdError{Call: "pidfd_getfd", PID: 42, FD: 7, Errno: syscall.EPERM}, []string{"ptrace permission to process 42 is needed", "kernel.yama.ptrace_scope", "CAP_SYS_PTRACE"}},
		{cuda.PidfdError{Call: "pidfd_open", PID: 42, FD: -1, Errno: syscall.ESRCH}, []string{"process 42 has exited"}},
		{cuda.PidfdError{Call: "pidfd_getfd", PID: 42, FD: 7, Errno: syscall.EBADF}, []string{"file descriptor 7 is not open in process 42"}},
		{cuda.PidfdError{Call: "pidfd_getfd", PID: 42, FD: 7, Errno: syscall.EMFILE}, []string{"pidfd_getfd(process 42)", syscall.EMFILE.Error(), "RLIMIT_NOFILE"}},
	} {
		err := error(&c.err)
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%v: %q lacks %q", c.err.Errno, err, w)
			}
		}
		if !errors.Is(err, c.err.Errno) {
			t.Errorf("%q does not unwrap to %v", err, c.err.Errno)
		}
	}
}

func TestShareableKindString(t *testing.T) {
	for k, want := range map[cuda.ShareableKind]string{
		0: "none", cuda.ShareablePOSIXFD: "posix-fd", cuda.ShareableFabric: "fabric",
		cuda.ShareablePOSIXFD | cuda.ShareableFabric: "posix-fd|fabric", 2: "ShareableKind(0x2)",
	} {
		if got := k.String(); got != want {
			t.Errorf("%d: %q, want %q", uint32(k), got, want)
		}
	}
	if got := cuda.ErrNotPermitted.Error(); got != "CUDA_ERROR_NOT_PERMITTED (800)" {
		t.Errorf("ErrNotPermitted = %q", got)
	}
}
