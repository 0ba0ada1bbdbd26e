// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"math"
	"math/bits"
)

// Sizes that define the pools (PyTorch's constants, same values).
const (
	MinBlockSize  = 512      // every block is a multiple of this
	SmallSize     = 1 << 20  // requests at or below this use the small pool
	SmallBuffer   = 2 << 20  // segment size of the small pool
	LargeBuffer   = 20 << 20 // segment size for requests below MinLargeAlloc
	MinLargeAlloc = 10 << 20 // requests from here on get their own segment
	RoundLarge    = 2 << 20  // large segments are rounded to this
	MaxRequest    = 1 << 60  // 1 EiB: anything above is a caller's bug
	Unlimited     = math.MaxUint64
)

// roundupIntervals is the number of power-of-two size intervals (1 MiB up to
// 64 GiB) that roundup_power2_divisions can set separately.
const roundupIntervals = 16

// Config is the pool policy. The zero value is not valid; start from
// DefaultConfig.
type Config struct {
	// MaxSplitSize: blocks at or above it are never split and are not given
	// to smaller requests. Unlimited by default.
	MaxSplitSize uint64
	// RoundupDivisions[i] applies to sizes in [2^(20+i), 2^(21+i)) (the first
	// also below, the last also above); 0 or 1 means plain 512 B rounding.
	// Second, so that entry 0 (every size below 2 MiB) shares a cache line
	// with MaxSplitSize and the Cache fields before them.
	RoundupDivisions [roundupIntervals]uint64
	// MaxNonSplitRounding: a request at or above MaxSplitSize may take a
	// cached block at most this much larger.
	MaxNonSplitRounding uint64
	// LargeSegmentSize is the segment size for large-pool requests below
	// MinLargeAlloc.
	LargeSegmentSize uint64
	// GCThreshold (0 = off) frees old cached blocks once reserved memory
	// exceeds this fraction of the memory-fraction limit.
	GCThreshold float64
	// FreeSet selects the free-set implementation.
	FreeSet FreeSetKind
}

// DefaultConfig is PyTorch's default policy.
func DefaultConfig() Config {
	return Config{
		MaxSplitSize:        Unlimited,
		MaxNonSplitRounding: LargeBuffer,
		LargeSegmentSize:    LargeBuffer,
		FreeSet:             DefaultFreeSet,
	}
}

// Divisions returns the roundup_power2_divisions that apply to size.
func (c *Config) Divisions(size uint64) uint64 {
	i := bits.Len64(size) - 1 - 20
	if i < 0 {
		i = 0
	}
	if i >= roundupIntervals {
		i = roundupIntervals - 1
	}
	return c.RoundupDivisions[i]
}

// RoundSize is the block size used for a request of size bytes.
func (c *Config) RoundSize(size uint64) uint64 {
	if size < MinBlockSize {
		return MinBlockSize
	}
	if d := c.Divisions(size); d > 1 && size > MinBlockSize*d {
		return roundupPower2Division(size, d)
	}
	return roundUp(size, MinBlockSize)
}

// roundupPower2Division rounds size up to the next of d equal steps between
// the powers of two around it.
func roundupPower2Division(size, d uint64) uint64 {
	if size&(size-1) == 0 {
		return size
	}
	floor := uint64(1) << (bits.Len64(size) - 1)
	step := floor >> (bits.Len64(d) - 1)
	if step == 0 {
		return floor << 1
	}
	return roundUp(size, step)
}

func roundUp(n, m uint64) uint64 { return (n + m - 1) / m * m }

// SegmentSize is the driver allocation made for a rounded request that no
// cached block can serve.
func (c *Config) SegmentSize(size uint64) uint64 {
	switch {
	case size <= SmallSize:
		return SmallBuffer
	case size < MinLargeAlloc:
		return max(c.LargeSegmentSize, roundUp(size, RoundLarge))
	default:
		return roundUp(size, RoundLarge)
	}
}

// IsSmall reports whether a rounded request belongs to the small pool.
func IsSmall(size uint64) bool { return size <= SmallSize }
