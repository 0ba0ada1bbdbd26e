// SPDX-License-Identifier: Apache-2.0

package driver

import "os"

// Duplicating another process's file descriptors, the way an importer gets
// hold of physical memory exported as POSIX file descriptors (PyTorch's
// ExpandableSegment::fromShared does the same): pidfd_open(2) on the
// exporter's process id, pidfd_getfd(2) for each descriptor, then
// MemImportShareable and CloseFD. Neither call blocks. A kernel or a
// permission that lacks them is a *cuda.PidfdError that says what is
// missing (errors.Is(err, syscall.ENOSYS), syscall.EPERM, ...).
//
// These are system calls, not CUDA calls: they work in every build on
// Linux, with or without the driver.

// PidfdOpen returns a descriptor that refers to process pid (pidfd_open).
// Close it with CloseFD.
func (d *Driver) PidfdOpen(pid int) (int, error) { return pidfdOpen(pid) }

// PidfdGetfd duplicates descriptor fd of the process pidfd refers to into
// this process (pidfd_getfd) and returns the copy, close-on-exec. pid is
// that process's id, for the error message.
func (d *Driver) PidfdGetfd(pidfd, pid, fd int) (int, error) { return pidfdGetfd(pidfd, pid, fd) }

// CloseFD closes a descriptor of this process: one from PidfdOpen,
// PidfdGetfd or MemExportShareable.
func (d *Driver) CloseFD(fd int) error { return closeFD(fd) }

// PID returns this process's id: what an exporter writes in the handles it
// makes, for importers to pidfd_open.
func (d *Driver) PID() int { return os.Getpid() }

// FDLimit returns the most descriptors this process may have open
// (RLIMIT_NOFILE's soft limit, which the Go runtime raises to just under
// the hard limit as the library loads), or 0 if unknown. Each physical
// allocation exported as a file descriptor holds one.
func (d *Driver) FDLimit() uint64 { return fdLimit() }
