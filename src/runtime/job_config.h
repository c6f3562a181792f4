// A job's whole configuration, resolved and validated: core's sections (Config::resolve), then
// each component's own section with the component's validator (the pipeline's [parallel] keys,
// [sync], [tier]), then the combinations that are not supported together yet. Every command that
// runs a job calls this; core never includes a component to check its section.
#pragma once

#include "core/config.h"

namespace keel {

// Throws keel::Error naming the offending key, as Config::resolve does.
void resolve_job_config(Config& config, int world_size = 1);

}  // namespace keel
