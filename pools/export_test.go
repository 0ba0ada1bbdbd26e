// SPDX-License-Identifier: Apache-2.0

package pools

import "github.com/cudapool/cudapool/cuda"

type cudaPtr = cuda.Ptr

// Internals exposed to this package's tests only.

func (b *Block) InSet() bool              { return b.inSet }
func (c *Cache) SpareBlocks() int         { return c.nSpare }
func (p *BlockPool) FreeCalls() uint64    { return p.freeCalls }
func (p *BlockPool) SetReleasable()       { p.releasable = true }
func NewPtrMapForTest(n int) *ptrMap      { m := newPtrMap(n); return &m }
func (m *ptrMap) Get(p uintptr) *Block    { return m.get(cudaPtr(p)) }
func (m *ptrMap) Put(p uintptr, b *Block) { m.put(cudaPtr(p), b) }
func (m *ptrMap) Del(p uintptr) bool      { return m.del(cudaPtr(p)) }
func (m *ptrMap) Len() int                { return m.n }
func (m *ptrMap) Cap() int                { return len(m.slots) }

// CorruptAllAllocatedBytes changes allocated_bytes.all.current behind the
// cache's back, for a test that Check notices.
func (c *Cache) CorruptAllAllocatedBytes(d int64) { c.hot.all.cur[hAllocatedBytes] += d }

// NewRequest is SetRequest returning the request (tests only).
func (c *Cache) NewRequest(size uint64, s cuda.Stream, small, large *BlockPool) Request {
	var r Request
	c.SetRequest(&r, size, s, small, large)
	return r
}
