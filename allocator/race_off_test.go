// SPDX-License-Identifier: Apache-2.0

//go:build !race

package allocator_test

const raceOn = false
