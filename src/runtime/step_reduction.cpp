#include "runtime/step_reduction.h"

#include <span>
#include <utility>

#include "core/rank_figures.h"

namespace keel {

std::vector<double> reduce_step_maxima(Communicator& world, const std::vector<MetricsSource*>& sources,
                                       std::vector<double> values) {
  const size_t given = values.size();
  const int ranks = world.size(), me = world.rank();
  std::vector<std::pair<RankFigures*, size_t>> figured;  // each source and where its table starts
  for (MetricsSource* source : sources) {
    RankFigures* f = dynamic_cast<RankFigures*>(source);
    const int k = f != nullptr ? f->rank_figure_count() : 0;
    if (k == 0) continue;
    figured.emplace_back(f, values.size());
    values.resize(values.size() + static_cast<size_t>(ranks) * k, 0.0);
    f->rank_figures(std::span<double>(values).subspan(figured.back().second + static_cast<size_t>(me) * k, k));
  }
  world.allreduce_max(values.data(), values.size());
  for (const auto& [f, at] : figured) {
    f->take_rank_figures(std::span<const double>(values).subspan(at, static_cast<size_t>(ranks) * f->rank_figure_count()));
  }
  values.resize(given);
  return values;
}

}  // namespace keel
