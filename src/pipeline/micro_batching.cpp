#include "pipeline/micro_batching.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "pipeline/layout.h"

namespace keel::pipeline {

void add_stage_times(const std::vector<Interval>& timeline, StageTimes& out) {
  int stages = static_cast<int>(out.forward.size());
  for (const Interval& iv : timeline) stages = std::max(stages, iv.instr.stage + 1);
  out.forward.resize(stages, 0.0);
  out.backward_input.resize(stages, 0.0);
  out.backward_weight.resize(stages, 0.0);
  std::vector<double> sum(3 * stages, 0.0);
  std::vector<int> count(3 * stages, 0);
  for (const Interval& iv : timeline) {
    const int k = iv.instr.op == Op::forward ? 0 : iv.instr.op == Op::backward_input ? 1 : iv.instr.op == Op::backward_weight ? 2 : -1;
    if (k < 0 || iv.instr.stage < 0) continue;
    sum[3 * iv.instr.stage + k] += iv.end - iv.start;
    count[3 * iv.instr.stage + k]++;
  }
  for (int s = 0; s < stages; ++s) {
    std::vector<double>* ops[3] = {&out.forward, &out.backward_input, &out.backward_weight};
    for (int k = 0; k < 3; ++k) {
      if (count[3 * s + k] > 0) (*ops[k])[s] = sum[3 * s + k] / count[3 * s + k];
    }
  }
}

int probe_micro_batches(const Config& config, int first) {
  const std::vector<int> allowed = allowed_micro_batches(config);
  int best = first;
  double distance = 1e300;
  for (int m : allowed) {
    if (m <= first) continue;
    if (std::abs(m - 2.0 * first) < distance) best = m, distance = std::abs(m - 2.0 * first);
  }
  if (best != first) return best;
  for (int m : allowed) {
    if (m < first) best = m;  // the largest below
  }
  return best;
}

namespace {

// t = overhead + per_sequence * b through two points, both parts kept non-negative.
struct Linear {
  double overhead = 0, per_sequence = 0;
  double at(double b) const { return overhead + per_sequence * b; }
};

Linear fit(double b0, double t0, double b1, double t1) {
  Linear l;
  l.per_sequence = (t1 - t0) / (b1 - b0);
  l.overhead = t0 - l.per_sequence * b0;
  if (l.per_sequence < 0 || l.overhead < 0) {  // noise: fall back to proportional
    l.overhead = 0;
    l.per_sequence = (t0 + t1) / (b0 + b1);
  }
  return l;
}

}  // namespace

MicroBatchChoice choose_micro_batches(const Config& config, const std::vector<LayerRange>& stages,
                                      const StageTimes& a, const StageTimes& b) {
  check(a.micro_batch != b.micro_batch, "dynamic micro-batches: two measurements of the same micro-batch size");
  const int S = static_cast<int>(stages.size());
  std::vector<Linear> f(S), bi(S), w(S);
  double overhead = 0, per_sequence = 0;
  for (int s = 0; s < S; ++s) {
    f[s] = fit(a.micro_batch, a.forward[s], b.micro_batch, b.forward[s]);
    bi[s] = fit(a.micro_batch, a.backward_input[s], b.micro_batch, b.backward_input[s]);
    w[s] = fit(a.micro_batch, a.backward_weight[s], b.micro_batch, b.backward_weight[s]);
    overhead += f[s].overhead + bi[s].overhead + w[s].overhead;
    per_sequence += f[s].per_sequence + bi[s].per_sequence + w[s].per_sequence;
  }
  const int sequences = config.train.batch_size * config.train.grad_accum;
  MicroBatchChoice best;
  std::string others;
  for (int m : allowed_micro_batches(config)) {
    Plan p;
    try {
      p = plan(config, stages, m);
    } catch (const Error&) {
      char note[64];
      std::snprintf(note, sizeof note, "%s%d: over the activation bound", others.empty() ? "" : ", ", m);
      others += note;
      continue;
    }
    const double mb = static_cast<double>(sequences) / m;
    Costs costs;
    for (int s = 0; s < S; ++s) {
      costs.forward.push_back(f[s].at(mb));
      costs.backward_input.push_back(bi[s].at(mb));
      costs.backward_weight.push_back(w[s].at(mb));
    }
    const Timeline t = simulate(p.schedule, costs);
    char note[64];
    std::snprintf(note, sizeof note, "%s%d: %.1f ms", others.empty() ? "" : ", ", m, t.makespan);
    others += note;
    if (best.micro_batches == 0 || t.makespan < best.predicted_ms) {
      best.micro_batches = m;
      best.predicted_ms = t.makespan;
      best.predicted_bubble = t.bubble;
    }
  }
  check(best.micro_batches > 0, "config key 'parallel.activation_mib': no micro-batch count fits the bound");
  char line[256];
  std::snprintf(line, sizeof line,
                "%d micro-batches of %d sequences: the shortest simulated step (%.1f ms, bubble %.1f%%); measured "
                "cost of a micro-batch through every stage's F, B and W: %.2f ms + %.2f ms per sequence; simulated: ",
                best.micro_batches, sequences / best.micro_batches, best.predicted_ms, 100 * best.predicted_bubble,
                overhead, per_sequence);
  best.reason = line + others;
  return best;
}

}  // namespace keel::pipeline
