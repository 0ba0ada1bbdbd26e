// SPDX-License-Identifier: Apache-2.0

//go:build !linux

package driver

import (
	"syscall"

	"github.com/cudapool/cudapool/cuda"
)

// Outside Linux there is no pidfd: importing memory shared as file
// descriptors is impossible.

func pidfdOpen(pid int) (int, error) {
	return -1, &cuda.PidfdError{Call: "pidfd_open", PID: pid, FD: -1, Errno: syscall.ENOSYS}
}

func pidfdGetfd(pidfd, pid, fd int) (int, error) {
	return -1, &cuda.PidfdError{Call: "pidfd_getfd", PID: pid, FD: fd, Errno: syscall.ENOSYS}
}

func closeFD(fd int) error { return syscall.EBADF }

func fdLimit() uint64 { return 0 }
