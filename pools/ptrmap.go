package pools

import "github.com/cudapool/cudapool/cuda"

// ptrMap indexes allocated blocks by address. It is an open-addressing table
// with linear probing and backward-shift deletion: no tombstones, so a steady
// mix of inserts and deletes never rehashes or allocates. It grows (doubling)
// only when the number of live entries reaches a new high.
type ptrMap struct {
	keys []cuda.Ptr // 0 marks an empty slot; 0 is never a device address
	vals []*Block
	n    int
	mask uint64
}

func newPtrMap(capacity int) ptrMap {
	c := 16
	for c < capacity*2 {
		c <<= 1
	}
	return ptrMap{keys: make([]cuda.Ptr, c), vals: make([]*Block, c), mask: uint64(c - 1)}
}

func (m *ptrMap) slot(p cuda.Ptr) uint64 {
	// Fibonacci hashing; device addresses are 512-byte aligned, so the low
	// bits carry nothing and must be mixed in from the top.
	return (uint64(p) * 0x9e3779b97f4a7c15 >> 20) & m.mask
}

func (m *ptrMap) get(p cuda.Ptr) *Block {
	for i := m.slot(p); ; i = (i + 1) & m.mask {
		switch m.keys[i] {
		case p:
			return m.vals[i]
		case 0:
			return nil
		}
	}
}

func (m *ptrMap) put(p cuda.Ptr, b *Block) {
	if (m.n+1)*2 > len(m.keys) {
		m.grow()
	}
	for i := m.slot(p); ; i = (i + 1) & m.mask {
		switch m.keys[i] {
		case p:
			m.vals[i] = b
			return
		case 0:
			m.keys[i], m.vals[i] = p, b
			m.n++
			return
		}
	}
}

func (m *ptrMap) del(p cuda.Ptr) bool {
	i := m.slot(p)
	for ; m.keys[i] != p; i = (i + 1) & m.mask {
		if m.keys[i] == 0 {
			return false
		}
	}
	// Shift later entries of the probe run back so that lookups never meet a
	// hole before their key.
	for j := (i + 1) & m.mask; m.keys[j] != 0; j = (j + 1) & m.mask {
		home := m.slot(m.keys[j])
		// Move j into the hole at i unless its home lies cyclically in (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			m.keys[i], m.vals[i] = m.keys[j], m.vals[j]
			i = j
		}
	}
	m.keys[i], m.vals[i] = 0, nil
	m.n--
	return true
}

func (m *ptrMap) grow() {
	old := *m
	*m = newPtrMap(len(old.keys))
	for i, k := range old.keys {
		if k != 0 {
			m.put(k, old.vals[i])
		}
	}
}

func (m *ptrMap) each(fn func(*Block)) {
	for i, k := range m.keys {
		if k != 0 {
			fn(m.vals[i])
		}
	}
}
