// SPDX-License-Identifier: Apache-2.0

//go:build race

package allocator_test

// raceOn: the race detector makes the single-threaded randomized tests ten
// times slower without checking anything more in them; they run fewer seeds.
const raceOn = true
