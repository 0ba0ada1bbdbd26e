package sim

import (
	"testing"

	"github.com/cudapool/cudapool/cuda"
)

// The bytes of physical memory that is gone are forgotten, but not while a
// queued copy still reads them.
func TestContentsForgottenWithTheirMemory(t *testing.T) {
	d := New(Options{})
	d.EnableContents()
	base, err := d.MemAddressReserve(0, Granularity)
	copyMust(t, err)
	h, err := d.MemCreate(0, Granularity)
	copyMust(t, err)
	copyMust(t, d.MemMap(0, base, Granularity, h))
	copyMust(t, d.MemSetAccess(0, base, Granularity))
	copyMust(t, d.WriteDevice(0, base, []byte{1, 2, 3}))
	host, err := d.HostAlloc(0, 3)
	copyMust(t, err)
	copyMust(t, d.MemcpyDtoHAsync(0, host, base, 3, 5))
	d.Complete(5)
	copyMust(t, d.MemUnmap(0, base, Granularity))
	copyMust(t, d.MemRelease(0, h))
	if n := len(d.cp.mem); n != 1 {
		t.Fatalf("%d physical allocations with bytes before settling, want 1", n)
	}
	got, err := d.ReadHost(host, 3)
	copyMust(t, err)
	if string(got) != "\x01\x02\x03" {
		t.Fatalf("host bytes %v: the completed copy must read the memory before it went", got)
	}
	if n := len(d.cp.mem); n != 0 {
		t.Fatalf("%d physical allocations still have bytes after their release", n)
	}
	var p cuda.Ptr
	if p, err = d.MemAlloc(0, 4096); err != nil {
		t.Fatal(err)
	}
	copyMust(t, d.WriteDevice(0, p, []byte{1}))
	copyMust(t, d.MemFree(0, p))
	copyMust(t, d.WriteHost(host, []byte{0}))
	if n := len(d.cp.mem); n != 0 {
		t.Fatalf("a freed MemAlloc allocation keeps its bytes (%d)", n)
	}
}

func copyMust(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
