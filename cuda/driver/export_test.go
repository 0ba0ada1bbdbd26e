// SPDX-License-Identifier: Apache-2.0

//go:build linux && cgo

package driver

// OpenLibrary opens a driver library by path (the tests load a fake one).
var OpenLibrary = openLibrary

// PCIBusID exposes pciBusID.
func (d *Driver) PCIBusID(dev int) (string, error) { return d.pciBusID(dev) }

// ResolveCaptureInfo re-resolves cuStreamGetCaptureInfo at another API
// version (13000 yields the v3 ABI on CUDA 13 drivers). Not concurrently
// with other calls.
func (d *Driver) ResolveCaptureInfo(version int) error { return d.resolveCaptureInfo(version) }
