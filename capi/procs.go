// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"runtime"
)

// minProcs is the fewest Ps the library's Go runtime runs with, so that
// every thread that calls in from C can take a P without waiting, with some
// left idle: PyTorch's main thread, an autograd thread per device, the
// keeper (capi/warm), and spares.
//
// Why it matters: a C thread keeps the P its call took (the runtime parks
// it "in a system call" when the call returns) until sysmon takes it back.
// A thread coming back into Go whose P was taken takes an idle one, and
// with none idle it waits until sysmon retakes one from another thread.
// GOMAXPROCS defaults to the CPUs the process may use, 1 on a one-CPU host,
// where every caller would queue for the one P and the keeper, which would
// hold it, stays off. More Ps than CPUs costs a few kilobytes each; the
// library's Go code rarely has more than one goroutine ready to run.
// (docs/go-runtime-proposal.md: what sysmon's retakes cost a C caller.)
const minProcs = 8

func init() { raiseProcs(os.LookupEnv, runtime.GOMAXPROCS) }

// raiseProcs raises GOMAXPROCS to minProcs unless the environment the
// process started with sets it (the runtime read the same one); it returns
// the value in effect.
func raiseProcs(lookup func(string) (string, bool), gomaxprocs func(int) int) int {
	n := gomaxprocs(0)
	if _, set := lookup("GOMAXPROCS"); set || n >= minProcs {
		return n
	}
	gomaxprocs(minProcs)
	return minProcs
}
