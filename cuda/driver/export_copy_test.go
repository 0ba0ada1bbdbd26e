// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver

import "github.com/cudapool/cudapool/cuda"

// HostRead copies len(dst) bytes of pinned memory at p into dst.
func HostRead(dst []byte, p cuda.HostPtr) { hostRead(dst, p) }

// HostWrite copies src into pinned memory at p.
func HostWrite(p cuda.HostPtr, src []byte) { hostWrite(p, src) }
