// SPDX-License-Identifier: Apache-2.0

package sim

import (
	"bytes"
	"testing"

	"github.com/cudapool/cudapool/cuda"
)

// The bytes of physical memory that is gone are forgotten, but not while a
// queued copy still reads them.
func TestContentsForgottenWithTheirMemory(t *testing.T) {
	d := New(Options{})
	base, err := d.MemAddressReserve(0, Granularity)
	copyMust(t, err)
	h, err := d.MemCreate(0, Granularity)
	copyMust(t, err)
	copyMust(t, d.MemMap(0, base, Granularity, h))
	copyMust(t, d.MemSetAccess(0, base, Granularity))
	copyMust(t, d.WriteDevice(0, base, []byte{1, 2, 3}))
	mem := d.devs[0].vmm.handles[h].mem
	host, err := d.HostAlloc(0, 3)
	copyMust(t, err)
	copyMust(t, d.MemcpyDtoHAsync(0, host, base, 3, 5))
	d.Complete(5)
	copyMust(t, d.MemUnmap(0, base, Granularity))
	copyMust(t, d.MemRelease(0, h))
	got, err := d.ReadHost(host, 3)
	copyMust(t, err)
	if string(got) != "\x01\x02\x03" {
		t.Fatalf("host bytes %v: the completed copy must read the memory before it went", got)
	}
	if !mem.gone || mem.data != nil {
		t.Fatalf("released memory (gone %v) keeps %d pages", mem.gone, len(mem.data))
	}

	// A MemAlloc allocation freed while a copy from it is queued: the copy
	// reads its bytes when it runs, and then they go.
	p, err := d.MemAlloc(0, 4096)
	copyMust(t, err)
	copyMust(t, d.WriteDevice(0, p, []byte{7}))
	mem = d.devs[0].allocMem[p]
	copyMust(t, d.MemcpyDtoHAsync(0, host, p, 1, 6))
	copyMust(t, d.MemFree(0, p))
	if len(d.devs[0].allocMem) != 0 || !mem.gone {
		t.Fatalf("a freed allocation's contents are still reachable")
	}
	if mem.data == nil {
		t.Fatal("the queued copy's source bytes went before it ran")
	}
	d.Complete(6)
	got, err = d.ReadHost(host, 1)
	copyMust(t, err)
	if got[0] != 7 {
		t.Fatalf("host byte %d: the copy queued before the free must read it", got[0])
	}
	if mem.data != nil || mem.copies != 0 || len(d.cp.pending) != 0 {
		t.Fatalf("after the copy: %d pages, %d copies on the memory, %d queued", len(mem.data), mem.copies, len(d.cp.pending))
	}

	// Freed with nothing queued: the bytes go at once.
	p, err = d.MemAlloc(0, 4096)
	copyMust(t, err)
	copyMust(t, d.WriteDevice(0, p, []byte{1}))
	mem = d.devs[0].allocMem[p]
	copyMust(t, d.MemFree(0, p))
	if mem.data != nil {
		t.Fatalf("a freed MemAlloc allocation keeps its bytes (%d pages)", len(mem.data))
	}
}

// Nothing is stored until something writes: copies of memory nothing wrote,
// 16 GiB of it, make no page anywhere and leave nothing queued once their
// streams complete.
func TestContentsCostNothingUntilWritten(t *testing.T) {
	const size = 16 << 30
	d := New(Options{Memory: 2 * size})
	base, err := d.MemAddressReserve(0, size)
	copyMust(t, err)
	h, err := d.MemCreate(0, size)
	copyMust(t, err)
	copyMust(t, d.MemMap(0, base, size, h))
	copyMust(t, d.MemSetAccess(0, base, size))
	p, err := d.MemAlloc(0, size/2)
	copyMust(t, err)
	host, err := d.HostAlloc(0, size)
	copyMust(t, err)
	for s := range cuda.Stream(4) {
		copyMust(t, d.MemcpyDtoHAsync(0, host, base, size, s))
		copyMust(t, d.MemcpyHtoDAsync(0, base, host, size, s))
		copyMust(t, d.MemcpyHtoDAsync(0, p, host, size/2, s))
		copyMust(t, d.MemcpyDtoHAsync(0, host, p, size/2, s))
	}
	if n := len(d.cp.pending); n != 16 {
		t.Fatalf("%d copies queued, want 16", n)
	}
	copyMust(t, d.DeviceSynchronize(0))
	dv := d.devs[0]
	if n := len(d.cp.pending); n != 0 {
		t.Fatalf("%d copies still queued after synchronising", n)
	}
	if vm, am, ha := dv.vmm.handles[h].mem, dv.allocMem[p], d.cp.host[host]; vm.data != nil || am.data != nil || ha.data != nil || vm.copies+am.copies != 0 {
		t.Fatalf("pages made without a write: %d, %d, %d (copies %d, %d)", len(vm.data), len(am.data), len(ha.data), vm.copies, am.copies)
	}
	got, err := d.ReadDevice(0, base+size-4, 4)
	copyMust(t, err)
	if !bytes.Equal(got, make([]byte, 4)) {
		t.Fatalf("untouched memory reads %v", got)
	}
}

func copyMust(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
