// SPDX-License-Identifier: Apache-2.0

package cuda

// HostPtr is the address of pinned (page-locked) host memory from
// cuMemHostAlloc, as the driver returns it. It is an integer, like the other
// handles here, so that no layer above cuda/ converts it to a Go pointer:
// the simulator's host addresses are fake.
type HostPtr uintptr
