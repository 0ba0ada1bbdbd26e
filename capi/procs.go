package main

import (
	"os"
	"runtime"
)

// minProcs is the fewest Ps the library's Go runtime runs with, so that
// every thread that calls in from C can keep a P of its own between calls
// with some left idle: PyTorch's main thread, an autograd thread per
// device, the keeper (capi/warm), and spares.
//
// Why it matters (docs/hot-path.md, 'A call from C counted as a schedule
// tick: the Go runtime patched for the build'): a C thread keeps the P its
// call took (the runtime parks it "in a system call" when the call returns).
// The library is built with a runtime in which a call from C counts as a
// schedule tick of that P (capi/build_lib.sh), so sysmon leaves it with the
// caller instead of taking it back at every round, but only while some P is
// idle: with none idle, a thread may be waiting for a P, and sysmon's
// retakes are what give it one. GOMAXPROCS defaults to the CPUs the process
// may use, 1 on a one-CPU host, where no P would ever be idle. More Ps than
// CPUs costs a few kilobytes each; the library's Go code rarely has more
// than one goroutine ready to run.
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
