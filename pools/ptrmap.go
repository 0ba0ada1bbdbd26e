// SPDX-License-Identifier: Apache-2.0

package pools

import "github.com/cudapool/cudapool/cuda"

// ptrMap indexes allocated blocks by address. It is an open-addressing table
// with linear probing and backward-shift deletion: no tombstones, so a steady
// mix of inserts and deletes never rehashes or allocates. It grows (doubling)
// only when the number of live entries reaches a new high. A key and its
// value share a slot, so a lookup that hits its home slot reads one cache
// line (separate key and value arrays read two).
type ptrMap struct {
	slots []ptrSlot
	n     int
	mask  uint64
}

type ptrSlot struct {
	key cuda.Ptr // 0 marks an empty slot; 0 is never a device address
	val *Block
}

func newPtrMap(capacity int) ptrMap {
	c := 16
	for c < capacity*2 {
		c <<= 1
	}
	return ptrMap{slots: make([]ptrSlot, c), mask: uint64(c - 1)}
}

func (m *ptrMap) slot(p cuda.Ptr) uint64 {
	// Fibonacci hashing; device addresses are 512-byte aligned, so the low
	// bits carry nothing and must be mixed in from the top.
	return (uint64(p) * 0x9e3779b97f4a7c15 >> 20) & m.mask
}

func (m *ptrMap) get(p cuda.Ptr) *Block {
	for i := m.slot(p); ; i = (i + 1) & m.mask {
		switch s := &m.slots[i]; s.key {
		case p:
			return s.val
		case 0:
			return nil
		}
	}
}

func (m *ptrMap) put(p cuda.Ptr, b *Block) {
	if (m.n+1)*2 > len(m.slots) {
		m.grow()
	}
	for i := m.slot(p); ; i = (i + 1) & m.mask {
		switch s := &m.slots[i]; s.key {
		case p:
			s.val = b
			return
		case 0:
			s.key, s.val = p, b
			m.n++
			return
		}
	}
}

func (m *ptrMap) del(p cuda.Ptr) bool {
	i := m.slot(p)
	for ; m.slots[i].key != p; i = (i + 1) & m.mask {
		if m.slots[i].key == 0 {
			return false
		}
	}
	// Shift later entries of the probe run back so that lookups never meet a
	// hole before their key.
	for j := (i + 1) & m.mask; m.slots[j].key != 0; j = (j + 1) & m.mask {
		home := m.slot(m.slots[j].key)
		// Move j into the hole at i unless its home lies cyclically in (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			m.slots[i] = m.slots[j]
			i = j
		}
	}
	m.slots[i] = ptrSlot{}
	m.n--
	return true
}

func (m *ptrMap) grow() {
	old := m.slots
	*m = newPtrMap(len(old))
	for _, s := range old {
		if s.key != 0 {
			m.put(s.key, s.val)
		}
	}
}

func (m *ptrMap) each(fn func(*Block)) {
	for _, s := range m.slots {
		if s.key != 0 {
			fn(s.val)
		}
	}
}
