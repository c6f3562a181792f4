// Figures a component reports for every rank in the step line (one list per figure, in rank
// order), carried by the step's one reduction over the world (the maximum of every rank's peak
// memory and stop signal that runtime/trainer.cpp takes once the step's passes are done) rather
// than by a collective of the component's own: each rank writes its figures into its own row of
// a table of every rank's, zeros elsewhere, and the maximum over the ranks is the whole table
// (figures are never negative). Metrics only: what a rank holds or moves does not change.
#pragma once

#include <span>

namespace keel {

class RankFigures {
 public:
  virtual ~RankFigures() = default;
  // How many figures each rank adds to this step's reduction: the same on every rank of the
  // world (0: none).
  virtual int rank_figure_count() const = 0;
  // This rank's figures (rank_figure_count() of them, each >= 0), measured now (after the step's
  // passes and update, before its line).
  virtual void rank_figures(std::span<double> out) const = 0;
  // Every rank's figures, row r (rank_figure_count() values) world rank r's, for the step's line.
  virtual void take_rank_figures(std::span<const double> all) = 0;
};

}  // namespace keel
