// `keel simulate --probe yes`: what one thread of this machine does that a cluster file describes
// (sim/cluster.h): its streaming memory bandwidth (device.hbm_gbps, what AdamW's pass over the
// planes runs at) and the throughput of Keel's gradient codecs (the [codecs] section), so that a
// cluster file for the machine Keel runs on learns what the optimizer and HybridGC cost there.
#pragma once

#include <string>

#include "core/config.h"

namespace keel::sim {

// Each lossy codec at `sync`'s parameters (keep ratios, block) on a buffer of `floats` normal
// values, one thread: the best of `repeats` of an encoding with error feedback and of one
// decode-add, in GB/s of float32 input. Returns the TOML lines "<codec>_encode = X" and
// "<codec>_decode = Y".
std::string probe_codecs(const SyncConfig& sync, size_t floats = size_t{4} << 20, int repeats = 5);

// A triad a = b + s c over three buffers of `floats` floats (64 MiB each by default), best of
// `repeats`: GB/s of the 12 bytes per element read and written.
double probe_memory_gbps(size_t floats = size_t{16} << 20, int repeats = 5);

// Both, as a cluster file's TOML: a [device] section with hbm_gbps and a [codecs] section.
std::string probe_machine(const SyncConfig& sync);

}  // namespace keel::sim
