// The step's one reduction over the world, taken once its passes and update are done (inside the
// step's time: a rank that is late or paused shows in this step's ms): the maximum over the ranks
// of the values a trainer gives (peak memory, a stop signal), followed by the per-rank figures of
// every source that reports some (core/rank_figures.h: each rank's row, zeros elsewhere), each such
// source handed its whole table afterwards. No collective of a component's own per step.
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "core/metrics_source.h"

namespace keel {

// `values`' maxima over `world`'s ranks, in order; the sources' tables taken on the way.
std::vector<double> reduce_step_maxima(Communicator& world, const std::vector<MetricsSource*>& sources,
                                       std::vector<double> values);

}  // namespace keel
