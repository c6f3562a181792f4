// Checkpoints, simple form: a directory holding manifest.json (format version, step, the
// resolved config, data position, RNG state, and for every chunk its tensors, version and a
// checksum per plane) and one file per saved plane (param.bin, adam_m.bin, adam_v.bin) holding
// the chunks back to back. The directory is written under a temporary name and renamed into
// place, so a reader sees a whole checkpoint or none. Versioned: the differential, reshardable
// form of a later issue keeps reading format version 1.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "core/config.h"
#include "data/loader.h"
#include "store/chunk_store.h"

namespace keel {

inline constexpr int kCheckpointFormatVersion = 1;

// What a training run needs besides the chunk store to continue exactly where it stopped.
struct TrainState {
  int64_t step = 0;             // optimizer steps completed
  LoaderPosition data;          // position of the training loader
  std::string config_toml;      // the resolved config of the run that wrote it
};

// Supplies the whole flat range of one saved plane (params, adam_m or adam_v), for stores whose
// optimizer state is sharded across ranks and gathered for saving.
using PlaneSource = std::function<std::span<const float>(Plane)>;

// Writes store (params and both moments) and state to dir. Replaces an existing checkpoint at dir
// only once the new one is complete. Planes come from the store unless `source` is given.
void save_checkpoint(const std::string& dir, const ChunkStore& store, const Config& config,
                     const TrainState& state, const PlaneSource& source = nullptr);

// Reads the config stored in a checkpoint (to build a model of the right shape before loading).
Config read_checkpoint_config(const std::string& dir);

// Loads dir into store (which must have been built from a config of the same model shape and
// chunk size). With params_only, the moments are left untouched (evaluation, generation); a
// store with sharded moments receives its own shard.
// Verifies format, version, shape, file sizes and every chunk checksum before touching store;
// throws keel::Error naming the file and what differs.
TrainState load_checkpoint(const std::string& dir, ChunkStore& store, const Config& config, bool params_only);

}  // namespace keel
