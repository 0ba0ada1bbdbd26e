// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package vmem_test

import (
	"bytes"
	"encoding/binary"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
	"github.com/cudapool/cudapool/vmem"
)

// On a GPU: 2 GiB saved and restored with the default options come back
// intact; the rates are logged (the second cycle reuses the pinned memory).
func TestGPUCopySaveRestore(t *testing.T) {
	d, err := driver.Open()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	if n, _ := d.DeviceCount(); n == 0 {
		t.Skip("no CUDA driver: no devices")
	}
	defer d.Close()
	const size, chunk = 2 << 30, 64 << 20
	p, err := d.MemAlloc(0, size)
	if err != nil {
		t.Fatalf("MemAlloc: %v", err)
	}
	defer d.MemFree(0, p)
	s, err := d.StreamCreate(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.StreamDestroy(0, s)
	buf := make([]byte, chunk)
	for i := range buf {
		buf[i] = byte(i*131 + i>>13)
	}
	// put writes chunk i of the pattern (or zeros) from pageable Go memory,
	// waiting for the copy before buf changes.
	put := func(i int, zero bool) {
		if zero {
			clear(buf)
		} else {
			for j := range buf {
				buf[j] = byte(j*131 + j>>13)
			}
			binary.LittleEndian.PutUint64(buf, uint64(i))
		}
		if err := d.MemcpyHtoDAsync(0, p+cuda.Ptr(i*chunk), cuda.HostPtr(uintptr(unsafe.Pointer(&buf[0]))), chunk, s); err != nil {
			t.Fatal(err)
		}
		if err := d.StreamSynchronize(0, s); err != nil {
			t.Fatal(err)
		}
		runtime.KeepAlive(buf)
	}
	for i := range size / chunk {
		put(i, false)
	}
	want := append([]byte(nil), buf...)
	c := vmem.NewCopier(d, vmem.CopyOptions{})
	defer c.Close()
	rs := []vmem.CopyRange{{Dev: 0, Ptr: p, Size: size}}
	for cycle := range 2 {
		start := time.Now()
		saved, err := c.Save(rs)
		if err != nil {
			t.Fatalf("Save: %v", err)
		}
		save := time.Since(start)
		for i := range size / chunk {
			put(i, true)
		}
		start = time.Now()
		if err := c.Restore(saved); err != nil {
			t.Fatalf("Restore: %v", err)
		}
		restore := time.Since(start)
		t.Logf("cycle %d: save %v (%.1f GiB/s), restore %v (%.1f GiB/s), %d pieces", cycle,
			save, 2/save.Seconds(), restore, 2/restore.Seconds(), saved.Pieces())
	}
	got := make([]byte, chunk)
	for i := range size / chunk {
		if err := d.MemcpyDtoHAsync(0, cuda.HostPtr(uintptr(unsafe.Pointer(&got[0]))), p+cuda.Ptr(i*chunk), chunk, s); err != nil {
			t.Fatal(err)
		}
		if err := d.StreamSynchronize(0, s); err != nil {
			t.Fatal(err)
		}
		runtime.KeepAlive(got)
		binary.LittleEndian.PutUint64(want, uint64(i))
		if !bytes.Equal(got, want) {
			t.Fatalf("chunk %d differs after save and restore", i)
		}
	}
}
