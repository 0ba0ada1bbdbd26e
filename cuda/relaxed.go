// SPDX-License-Identifier: Apache-2.0

package cuda

import "runtime"

// CaptureModeExchanger is the driver call that sets the calling thread's
// capture mode (cuThreadExchangeStreamCaptureMode).
type CaptureModeExchanger interface {
	// ExchangeCaptureMode sets the calling OS thread's capture mode and
	// returns the previous one.
	ExchangeCaptureMode(mode CaptureMode) (CaptureMode, error)
}

// WithThreadRelaxed runs fn with the calling OS thread in relaxed capture
// mode, the goroutine held on that thread throughout: the rule for the
// driver calls that allocate (cuMemAlloc; reserving, creating and mapping
// virtual memory), which obey the thread's mode and are legal during any
// capture only in relaxed mode. It returns fn's error, or the error of
// switching to relaxed mode (fn then does not run). A failure to switch
// back does not undo fn's work (memory fn allocated would otherwise be
// lost): it goes to restoreFailed with the mode the thread had, since the
// thread may stay relaxed.
func WithThreadRelaxed(drv CaptureModeExchanger, fn func() error, restoreFailed func(prev CaptureMode, err error)) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	prev, err := drv.ExchangeCaptureMode(CaptureModeRelaxed)
	if err != nil {
		return err
	}
	err = fn()
	if _, rerr := drv.ExchangeCaptureMode(prev); rerr != nil {
		restoreFailed(prev, rerr)
	}
	return err
}
