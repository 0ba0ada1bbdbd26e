// SPDX-License-Identifier: Apache-2.0

package vmem

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/cuda"
)

// Handles built byte by byte from PyTorch's layout (see the comment at the
// top of share.go): DeviceCachingAllocator::shareIpcHandle's version and
// type bytes, then ExpandableSegment::share's ShareHeader and entries.
var (
	// Process 0x1234 shares two 20 MiB allocations as descriptors 37 and 38.
	shareHandFD = []byte{
		2, 'e', // SHAREABLE_HANDLE_VERSION, SHAREABLE_CUDA_EXPANDABLE_SEGMENT
		0x34, 0x12, 0x00, 0x00, // pid
		0x00, 0x00, 0x00, 0x00, // padding
		0x00, 0x00, 0x40, 0x01, 0x00, 0x00, 0x00, 0x00, // segment_size 20 MiB
		0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // num_handles
		0x25, 0x00, 0x00, 0x00, // fd 37
		0x26, 0x00, 0x00, 0x00, // fd 38
	}
	// Process 77 shares one 2 MiB allocation as a fabric handle.
	shareHandFabric = append([]byte{
		2, 'e',
		77, 0, 0, 0,
		0, 0, 0, 0,
		0x00, 0x00, 0x20, 0x00, 0, 0, 0, 0, // 2 MiB
		1, 0, 0, 0, 0, 0, 0, 0,
	}, shareFabricBytes()...)
)

func shareFabricBytes() []byte {
	b := make([]byte, 64)
	for i := range b {
		b[i] = byte(0xa0 + i)
	}
	return b
}

func TestParseHandBuiltFD(t *testing.T) {
	h, err := ParseStorageHandle(shareHandFD)
	if err != nil {
		t.Fatal(err)
	}
	s := h.Segment
	if h.Version != 2 || h.Type != TypeExpandable || s.PID != 0x1234 || s.SegmentSize != 20<<20 ||
		s.Kind != cuda.ShareablePOSIXFD || len(s.FDs) != 2 || s.FDs[0] != 37 || s.FDs[1] != 38 || s.Fabric != nil {
		t.Fatalf("decoded %+v", h)
	}
	if s.Len() != 2 || s.Bytes() != 40<<20 {
		t.Errorf("Len %d, Bytes %d", s.Len(), s.Bytes())
	}
	b, err := EncodeSegment(s)
	if err != nil || !bytes.Equal(b, shareHandFD) {
		t.Fatalf("EncodeSegment = % x, %v\nwant            % x", b, err, shareHandFD)
	}
}

func TestParseHandBuiltFabric(t *testing.T) {
	h, err := ParseStorageHandle(shareHandFabric)
	if err != nil {
		t.Fatal(err)
	}
	s := h.Segment
	if s.Kind != cuda.ShareableFabric || s.PID != 77 || s.SegmentSize != 2<<20 || len(s.Fabric) != 1 ||
		!bytes.Equal(s.Fabric[0][:], shareFabricBytes()) || s.FDs != nil {
		t.Fatalf("decoded %+v", s)
	}
	b, err := EncodeSegment(s)
	if err != nil || !bytes.Equal(b, shareHandFabric) {
		t.Fatalf("EncodeSegment = % x, %v", b, err)
	}
}

// Padding PyTorch left uninitialised, or an older version byte, changes the
// bytes but not the segment they name.
func TestKeyIgnoresPaddingAndVersion(t *testing.T) {
	dirty := bytes.Clone(shareHandFD)
	copy(dirty[6:10], []byte{0xde, 0xad, 0xbe, 0xef})
	dirty[0] = 1
	a, err := ParseStorageHandle(shareHandFD)
	if err != nil {
		t.Fatal(err)
	}
	b, err := ParseStorageHandle(dirty)
	if err != nil {
		t.Fatal(err)
	}
	if a.Segment.Key() != b.Segment.Key() {
		t.Error("padding or version changed the key")
	}
	other := a.Segment
	other.FDs = []int32{37, 39}
	if other.Key() == a.Segment.Key() {
		t.Error("different descriptors, same key")
	}
	other = a.Segment
	other.PID++
	if other.Key() == a.Segment.Key() {
		t.Error("different process, same key")
	}
}

func TestCudaMallocHandles(t *testing.T) {
	var ipc cuda.IpcHandle
	for i := range ipc {
		ipc[i] = byte(i * 3)
	}
	b := EncodeCudaMalloc(ipc)
	if len(b) != 66 || b[0] != 2 || b[1] != 'c' || !bytes.Equal(b[2:], ipc[:]) {
		t.Fatalf("EncodeCudaMalloc = % x", b)
	}
	for name, in := range map[string][]byte{"versioned": b, "bare": ipc[:]} {
		h, err := ParseStorageHandle(in)
		if err != nil || h.Type != TypeCudaMalloc || h.IPC != ipc {
			t.Errorf("%s: %+v, %v", name, h, err)
		}
	}
}

func TestRoundTrip(t *testing.T) {
	var f1, f2 cuda.FabricHandle
	f1[0], f2[63] = 1, 2
	for _, s := range []SegmentShare{
		{PID: 1, SegmentSize: 2 << 20, Kind: cuda.ShareablePOSIXFD, FDs: []int32{3}},
		{PID: 4194304, SegmentSize: 20 << 20, Kind: cuda.ShareablePOSIXFD, FDs: []int32{3, 1 << 20, 5, 0}},
		{PID: 9, SegmentSize: 2 << 20, Kind: cuda.ShareableFabric, Fabric: []cuda.FabricHandle{f1, f2}},
		{PID: 0, SegmentSize: 1 << 30, Kind: cuda.ShareableFabric, Fabric: []cuda.FabricHandle{f2}},
	} {
		b, err := EncodeSegment(s)
		if err != nil {
			t.Fatalf("%+v: %v", s, err)
		}
		h, err := ParseStorageHandle(b)
		if err != nil {
			t.Fatalf("%+v: %v", s, err)
		}
		if h.Segment.Key() != s.Key() || h.Segment.Len() != s.Len() {
			t.Errorf("%+v came back as %+v", s, h.Segment)
		}
	}
}

func TestParseRefusals(t *testing.T) {
	withVersion := func(v byte) []byte { b := bytes.Clone(shareHandFD); b[0] = v; return b }
	withCount := func(n byte) []byte { b := bytes.Clone(shareHandFD); b[18] = n; return b }
	for name, c := range map[string]struct {
		b    []byte
		want string
	}{
		"empty":            {nil, "0 bytes"},
		"version 3":        {withVersion(3), "version 3"},
		"version 0":        {withVersion(0), "version 0"},
		"type":             {append([]byte{2, 'x'}, shareHandFD[2:]...), "type 'x'"},
		"short header":     {shareHandFD[:20], "shorter than its header"},
		"no entries":       {withCount(0)[:26], "listing 0 physical allocations"},
		"count mismatch":   {withCount(3), "listing 3 physical allocations in 8 bytes"},
		"truncated entry":  {shareHandFD[:len(shareHandFD)-1], "in 7 bytes"},
		"short cudaMalloc": {[]byte{2, 'c', 1, 2, 3}, "cudaMalloc handle of 3 bytes"},
		"huge count":       {append(append(bytes.Clone(shareHandFD[:18]), 0, 0, 0, 0, 0, 0, 0, 0x80), shareHandFD[26:]...), "physical allocations"},
		"zero size":        {append(append(bytes.Clone(shareHandFD[:10]), 0, 0, 0, 0, 0, 0, 0, 0), shareHandFD[18:]...), "of 0 bytes"},
		"no process":       {append([]byte{2, 'e', 0, 0, 0, 0}, shareHandFD[6:]...), "names process 0"},
		"negative fd":      {append(bytes.Clone(shareHandFD[:30]), 0xff, 0xff, 0xff, 0xff), "file descriptor -1"},
	} {
		_, err := ParseStorageHandle(c.b)
		if !errors.Is(err, ErrBadHandle) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an ErrBadHandle mentioning %q", name, err, c.want)
		}
	}
	for name, s := range map[string]SegmentShare{
		"no kind":    {PID: 1, SegmentSize: 2 << 20, FDs: []int32{3}},
		"both kinds": {PID: 1, SegmentSize: 2 << 20, Kind: cuda.ShareablePOSIXFD, FDs: []int32{3}, Fabric: make([]cuda.FabricHandle, 1)},
		"empty":      {PID: 1, SegmentSize: 2 << 20, Kind: cuda.ShareablePOSIXFD},
		"overflow":   {PID: 1, SegmentSize: 1 << 63, Kind: cuda.ShareablePOSIXFD, FDs: []int32{3, 4}},
	} {
		if _, err := EncodeSegment(s); !errors.Is(err, ErrBadHandle) {
			t.Errorf("EncodeSegment(%s): %v", name, err)
		}
	}
}

// Whatever the bytes, decoding neither panics nor accepts what it cannot
// re-encode to the same segment.
func FuzzParseStorageHandle(f *testing.F) {
	f.Add(shareHandFD)
	f.Add(shareHandFabric)
	f.Add(EncodeCudaMalloc(cuda.IpcHandle{1}))
	f.Add([]byte{2, 'e'})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseStorageHandle(b)
		if err != nil || h.Type != TypeExpandable {
			return
		}
		again, err := EncodeSegment(h.Segment)
		if err != nil {
			t.Fatalf("decoded %+v does not encode: %v", h.Segment, err)
		}
		if len(again) != len(b) || !bytes.Equal(again[10:], b[10:]) || !bytes.Equal(again[2:6], b[2:6]) {
			t.Fatalf("re-encoded % x from % x", again, b)
		}
	})
}
