#include "runtime/job_config.h"

#include <string>

#include "comm/context_parallel.h"
#include "comm/sharded_params.h"
#include "comm/sync_policy.h"
#include "comm/tensor_parallel.h"
#include "core/error.h"
#include "model/clip.h"
#include "pipeline/layout.h"
#include "store/bf16_state.h"
#include "store/placement.h"

namespace keel {

void resolve_job_config(Config& c, int world_size) {
  c.resolve(world_size);
  const int pp = c.parallel.pipeline;
  const int data_ranks = world_size / (pp * c.parallel.tensor);
  validate_context_parallel_config(c, world_size);  // first: its refusals name what it does not combine with
  validate_bf16_state_config(c, data_ranks);  // then: it refuses combinations by its own keys
  validate_zero3_config(c, data_ranks);  // first: its refusals name what ZeRO-3 does not combine with
  pipeline::validate_pipeline_config(c.parallel, c.train, c.model.n_layer, world_size);
  validate_sync_config(c.sync, c.model.n_layer, data_ranks > 1 ? c.parallel.zero : 0);
  validate_tier_config(c.tier, c.model.n_layer);
  validate_tensor_parallel_config(c);  // (before the dual encoder's checks: a CLIP run is refused first)
  validate_clip_config(c);
  check(c.runtime.slow_rank < world_size, "config key 'runtime.slow_rank': expected a world rank below " +
                                              std::to_string(world_size) + " or -1, found " + std::to_string(c.runtime.slow_rank));
  const int every = c.monitor.layer_costs_every;
  check(c.parallel.repartition_every == 0 || (every > 0 && c.parallel.repartition_every % every == 0),
        "config key 'parallel.repartition_every': expected a multiple of monitor.layer_costs_every (" +
            std::to_string(every) + "; a re-cut decides on the profiler's report), found " +
            std::to_string(c.parallel.repartition_every));
  if (pp > 1) {
    // Not yet combined with pipelines (each is a later piece of work, not a silent fallback).
    auto unsupported = [](bool ok, const std::string& key, const std::string& value) {
      if (!ok) {
        throw Error("config key '" + key + "': expected its default with parallel.pipeline > 1 (not yet supported "
                    "together), found " + value);
      }
    };
    // Both read and write whole planes outside the chunk store's leases.
    unsupported(!c.parallel.post_validate || (c.parallel.zero == 0 && c.tier.device_mib == 0),
                "parallel.post_validate (with ZeRO or tiers)", "true");
    unsupported(c.parallel.predict_gradients == PredictGradients::off || c.tier.device_mib == 0,
                "parallel.predict_gradients (with tiers)", "\"" + std::string(to_string(c.parallel.predict_gradients)) + "\"");
    // The prediction state a pipeline carries between steps is saved by disk checkpoints only (a
    // memory copy would resume without it and silently differ).
    unsupported(c.parallel.predict_gradients == PredictGradients::off || c.checkpoint.memory_every == 0,
                "checkpoint.memory_every (with parallel.predict_gradients)", std::to_string(c.checkpoint.memory_every));
  }
}

}  // namespace keel
