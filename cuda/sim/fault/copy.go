// SPDX-License-Identifier: Apache-2.0

package fault

import "github.com/cudapool/cudapool/cuda"

// The copy engine (pinned host memory, copy streams, asynchronous copies),
// which pausing memory with its contents uses.

func (d *Driver) HostAlloc(dev int, size uint64) (cuda.HostPtr, error) {
	if err := d.inject("HostAlloc"); err != nil {
		return 0, err
	}
	return d.Sim.HostAlloc(dev, size)
}

func (d *Driver) HostFree(dev int, p cuda.HostPtr) error {
	if err := d.inject("HostFree"); err != nil {
		return err
	}
	return d.Sim.HostFree(dev, p)
}

func (d *Driver) StreamCreate(dev int) (cuda.Stream, error) {
	if err := d.inject("StreamCreate"); err != nil {
		return 0, err
	}
	return d.Sim.StreamCreate(dev)
}

func (d *Driver) StreamDestroy(dev int, s cuda.Stream) error {
	if err := d.inject("StreamDestroy"); err != nil {
		return err
	}
	return d.Sim.StreamDestroy(dev, s)
}

func (d *Driver) MemcpyDtoHAsync(dev int, dst cuda.HostPtr, src cuda.Ptr, size uint64, s cuda.Stream) error {
	if err := d.inject("MemcpyDtoHAsync"); err != nil {
		return err
	}
	return d.Sim.MemcpyDtoHAsync(dev, dst, src, size, s)
}

func (d *Driver) MemcpyHtoDAsync(dev int, dst cuda.Ptr, src cuda.HostPtr, size uint64, s cuda.Stream) error {
	if err := d.inject("MemcpyHtoDAsync"); err != nil {
		return err
	}
	return d.Sim.MemcpyHtoDAsync(dev, dst, src, size, s)
}

func (d *Driver) StreamSynchronize(dev int, s cuda.Stream) error {
	if err := d.inject("StreamSynchronize"); err != nil {
		return err
	}
	return d.Sim.StreamSynchronize(dev, s)
}
