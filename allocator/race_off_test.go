//go:build !race

package allocator_test

const raceOn = false
