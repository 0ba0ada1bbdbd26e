// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/cudapool/cudapool/cuda"
	"github.com/cudapool/cudapool/cuda/driver"
)

// Pinned memory to the device and back, in 64 MiB copies over two streams,
// arrives intact; the rates are logged (1 GiB each way).
func TestGPUCopyEngine(t *testing.T) {
	d := openGPU(t)
	const size, chunk = 1 << 30, 64 << 20
	dev, err := d.MemAlloc(0, size)
	if err != nil {
		t.Fatalf("MemAlloc: %v", err)
	}
	defer d.MemFree(0, dev)
	var hosts [2]cuda.HostPtr
	for i := range hosts {
		if hosts[i], err = d.HostAlloc(0, size); err != nil {
			t.Fatalf("HostAlloc: %v", err)
		}
		defer d.HostFree(0, hosts[i])
	}
	var streams [2]cuda.Stream
	for i := range streams {
		if streams[i], err = d.StreamCreate(0); err != nil {
			t.Fatalf("StreamCreate: %v", err)
		}
		defer d.StreamDestroy(0, streams[i])
	}
	pattern := make([]byte, chunk)
	for i := range pattern {
		pattern[i] = byte(i*131 + i>>11)
	}
	for off := uint64(0); off < size; off += chunk {
		pattern[0] = byte(off >> 26) // each chunk differs
		driver.HostWrite(hosts[0]+cuda.HostPtr(off), pattern)
	}
	run := func(name string, copyChunk func(off uint64, s cuda.Stream) error) {
		t.Helper()
		start := time.Now()
		for i, off := 0, uint64(0); off < size; i, off = i+1, off+chunk {
			if err := copyChunk(off, streams[i%2]); err != nil {
				t.Fatalf("%s at %d: %v", name, off, err)
			}
		}
		for _, s := range streams {
			if err := d.StreamSynchronize(0, s); err != nil {
				t.Fatalf("%s: StreamSynchronize: %v", name, err)
			}
		}
		el := time.Since(start)
		t.Logf("%s: 1 GiB in %v (%.1f GiB/s)", name, el, 1/el.Seconds())
	}
	run("host to device", func(off uint64, s cuda.Stream) error {
		return d.MemcpyHtoDAsync(0, dev+cuda.Ptr(off), hosts[0]+cuda.HostPtr(off), chunk, s)
	})
	run("device to host", func(off uint64, s cuda.Stream) error {
		return d.MemcpyDtoHAsync(0, hosts[1]+cuda.HostPtr(off), dev+cuda.Ptr(off), chunk, s)
	})
	a, b := make([]byte, chunk), make([]byte, chunk)
	for off := uint64(0); off < size; off += chunk {
		driver.HostRead(a, hosts[0]+cuda.HostPtr(off))
		driver.HostRead(b, hosts[1]+cuda.HostPtr(off))
		if !bytes.Equal(a, b) {
			t.Fatalf("chunk at %d differs after the round trip", off)
		}
	}
}
