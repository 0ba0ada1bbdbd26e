// SPDX-License-Identifier: Apache-2.0

package allocator

import "github.com/cudapool/cudapool/pools"

// ParseConfigUpdate applies s on top of base the way PyTorch applies
// torch.cuda.memory._set_allocator_settings at run time: max_split_size_mb,
// roundup_power2_divisions and garbage_collection_threshold first return to
// their defaults (PyTorch's parser resets them on every call), then the keys
// in s are applied; every other setting keeps its value unless s names it.
// per_process_memory_fraction is accepted but, as in PyTorch, only read when
// the allocator is created: an update never changes a device's fraction
// (set_per_process_memory_fraction does). On error base is returned
// unchanged.
func ParseConfigUpdate(base Config, s string) (Config, []string, error) {
	cfg := base
	def := pools.DefaultConfig()
	cfg.Pools.MaxSplitSize = def.MaxSplitSize
	cfg.Pools.RoundupDivisions = def.RoundupDivisions
	cfg.Pools.GCThreshold = def.GCThreshold
	out, warnings, err := parseOnto(cfg, s)
	if err != nil {
		return base, warnings, err
	}
	out.MemoryFraction, out.MemoryFractionSet = 0, false
	return out, warnings, nil
}
