// SPDX-License-Identifier: Apache-2.0

//go:build linux

package driver

import (
	"syscall"

	"github.com/cudapool/cudapool/cuda"
)

// The system call numbers of pidfd_open and pidfd_getfd, the same on every
// Linux architecture (the unified table since 5.1), and absent from older C
// libraries and from package syscall.
const (
	sysPidfdOpen  = 434
	sysPidfdGetfd = 438
)

func pidfdOpen(pid int) (int, error) {
	if pid <= 0 {
		return -1, &cuda.PidfdError{Call: "pidfd_open", PID: pid, FD: -1, Errno: syscall.EINVAL}
	}
	fd, _, errno := syscall.Syscall(sysPidfdOpen, uintptr(pid), 0, 0)
	if errno != 0 {
		return -1, &cuda.PidfdError{Call: "pidfd_open", PID: pid, FD: -1, Errno: errno}
	}
	return int(fd), nil
}

func pidfdGetfd(pidfd, pid, fd int) (int, error) {
	if pidfd < 0 || fd < 0 {
		return -1, &cuda.PidfdError{Call: "pidfd_getfd", PID: pid, FD: fd, Errno: syscall.EBADF}
	}
	nfd, _, errno := syscall.Syscall(sysPidfdGetfd, uintptr(pidfd), uintptr(fd), 0)
	if errno != 0 {
		return -1, &cuda.PidfdError{Call: "pidfd_getfd", PID: pid, FD: fd, Errno: errno}
	}
	return int(nfd), nil
}

func closeFD(fd int) error {
	if fd < 0 {
		return syscall.EBADF
	}
	return syscall.Close(fd)
}

func fdLimit() uint64 {
	var lim syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim) != nil {
		return 0
	}
	return lim.Cur
}
