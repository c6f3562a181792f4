#include "pipeline/partitioner.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "core/error.h"
#include "pipeline/layout.h"

namespace keel::pipeline {

namespace {

std::vector<int> firsts_of(const std::vector<LayerRange>& cut) {
  std::vector<int> f;
  for (const LayerRange& r : cut) f.push_back(r.first);
  return f;
}

std::vector<LayerRange> cut_of(const std::vector<int>& firsts, int L) {
  std::vector<LayerRange> cut;
  for (size_t s = 0; s < firsts.size(); ++s) {
    cut.push_back({firsts[s], s + 1 < firsts.size() ? firsts[s + 1] - 1 : L - 1});
  }
  return cut;
}

// Micro-batches each stage keeps in flight at its peak under the schedule (its rank's peak shared
// by the rank's stages).
std::vector<int> in_flight_per_stage(const Schedule& schedule) {
  const ScheduleSpec& spec = schedule.spec;
  const ScheduleCheck check = validate(schedule);
  std::vector<int> out(static_cast<size_t>(schedule.num_stages()), 1);
  for (int r = 0; r < spec.ranks; ++r) {
    const std::vector<int> mine = schedule.stages_of(r);
    for (int s : mine) out[s] = std::max(1, (check.peak_in_flight[r] + static_cast<int>(mine.size()) - 1) /
                                                static_cast<int>(mine.size()));
  }
  return out;
}

// A message's latency on the simulator: given, or the measured send / receive time per
// micro-batch spread over its messages (an activation and a gradient per boundary).
double message_ms(const PartitionProblem& p) {
  if (p.costs.message_ms >= 0) return p.costs.message_ms;
  double total = 0;
  for (double c : p.costs.comm) total += c;
  const int boundaries = std::max(1, p.stages() - 1);
  return total / (2.0 * boundaries);
}

constexpr double kExhaustive = 20000;

// Calls f with every cut of L layers into S non-empty stages.
void every_cut(int L, int S, const std::function<void(const std::vector<LayerRange>&)>& f) {
  std::vector<int> first(static_cast<size_t>(S), 0);
  std::function<void(int, int)> place = [&](int s, int from) {
    if (s == S) {
      f(cut_of(first, L));
      return;
    }
    for (int b = from; b <= L - (S - s); ++b) {
      first[s] = b;
      place(s + 1, b + 1);
    }
  };
  place(1, 1);
}

}  // namespace

std::vector<double> PartitionProblem::stage_slowdown() const {
  std::vector<double> out(static_cast<size_t>(stages()), 1.0);
  if (rank_slowdown.empty()) return out;
  const Schedule s = make_schedule(schedule);
  for (int i = 0; i < stages(); ++i) out[i] = rank_slowdown.at(s.stage_rank[i]);
  return out;
}

std::string boundaries_of(const std::vector<LayerRange>& cut) {
  std::string s;
  for (size_t i = 1; i < cut.size(); ++i) s += (i > 1 ? "," : "") + std::to_string(cut[i].first);
  return s;
}

namespace {

// The schedule of a spec and its stages' peak in flight, built once per spec on this thread: a
// partitioner scores thousands of cuts of one schedule (the cut changes costs, not the lists).
struct PreparedSchedule {
  ScheduleSpec spec;
  Schedule schedule;
  std::vector<int> in_flight;
  bool ready = false;
};
const PreparedSchedule& prepared(const ScheduleSpec& spec) {
  thread_local PreparedSchedule last;
  const bool same = last.ready && last.spec.kind == spec.kind && last.spec.ranks == spec.ranks &&
                    last.spec.micro == spec.micro && last.spec.virtual_stages == spec.virtual_stages;
  if (!same) {
    last.ready = false;
    last.schedule = make_schedule(spec);
    last.in_flight = in_flight_per_stage(last.schedule);
    last.spec = spec;
    last.ready = true;
  }
  return last;
}

}  // namespace

CutScore score_cut(const PartitionProblem& p, const std::vector<LayerRange>& cut) {
  const LayerCosts& c = p.costs;
  const PreparedSchedule& ready = prepared(p.schedule);
  const Schedule& schedule = ready.schedule;
  const std::vector<int>& in_flight = ready.in_flight;
  const std::vector<double> slow = p.stage_slowdown();
  Costs costs;
  costs.comm = message_ms(p);
  CutScore score;
  for (size_t s = 0; s < cut.size(); ++s) {
    double f = 0, b = 0, w = 0, params = 0, act = 0;
    for (int i = cut[s].first; i <= cut[s].last; ++i) {
      f += c.forward[i], b += c.backward_input[i], w += c.backward_weight[i];
      params += c.param_bytes[i], act += c.activation_bytes[i];
    }
    f *= slow[s], b *= slow[s], w *= slow[s];
    costs.forward.push_back(f);  // per micro-batch: one instruction of the schedule
    costs.backward_input.push_back(b);
    costs.backward_weight.push_back(w);
    score.max_stage = std::max(score.max_stage, f + b + w);
    score.stage_bytes.push_back(static_cast<int64_t>(4 * params + in_flight[s] * act));
    if (p.stage_memory_cap > 0 && score.stage_bytes.back() > p.stage_memory_cap) score.fits = false;
  }
  const Timeline t = simulate(schedule, costs);
  score.span = t.makespan;
  score.bubble = t.bubble;
  return score;
}

PartitionProblem problem_for(const Config& config) { return problem_for(config, LayerCosts{}); }

PartitionProblem problem_for(const Config& config, const LayerCosts& measured) {
  const ParallelConfig& par = config.parallel;
  // The costs' length (measured ones say theirs); activations at the longest length a curriculum
  // reaches: what a stage's memory must hold.
  const int T = measured.seq_len > 0 ? measured.seq_len : config.train.seq_len, L = config.model.n_layer + 2;
  const int longest = config.train.longest_seq_len();
  PartitionProblem p;
  p.flops = layer_costs(config.model, T);
  p.schedule = {par.schedule, par.pipeline, micro_batches(config), virtual_stages(par)};
  p.stage_memory_cap = par.stage_memory_mib << 20;
  if (measured.layers() > 0) {
    p.costs = measured;
  } else if (!par.layer_costs.empty()) {
    p.costs = read_layer_costs(par.layer_costs, L);
  } else {
    double total = 0;
    for (double c : p.flops) total += c;
    std::vector<double> third(p.flops);
    for (double& c : third) c /= 3 * total;
    p.costs.forward = p.costs.backward_input = p.costs.backward_weight = third;
    p.costs.comm = p.costs.activation_bytes = p.costs.param_bytes = std::vector<double>(L, 0.0);
    p.costs.message_ms = 0;
    p.costs.seq_len = T;
  }
  // Bytes the costs do not carry: the model's (a registry of its tensors, nothing allocated).
  ChunkStore registry(config.store.chunk_bytes);
  register_layout(registry, model_layout(config.model));
  registry.finalize_layout();
  std::vector<double> params(static_cast<size_t>(L), 0.0);
  for (const Chunk& c : registry.chunks()) params[c.layer] += static_cast<double>(c.numel) * sizeof(float);
  const int micro_batch = config.train.batch_size * config.train.grad_accum / p.schedule.micro;
  const double stretch = p.costs.seq_len > 0 ? static_cast<double>(longest) / p.costs.seq_len : 1.0;
  for (int i = 0; i < L; ++i) {
    if (p.costs.param_bytes[i] <= 0) p.costs.param_bytes[i] = params[i];
    if (p.costs.activation_bytes[i] <= 0) {
      p.costs.activation_bytes[i] = static_cast<double>(
          GPT::slot_bytes_for(config.model, {i, i}, micro_batch, longest, config.runtime.precision == Precision::bf16,
                              recompute_plan(config.train, config.model.n_layer)));
    } else {
      p.costs.activation_bytes[i] *= stretch;  // (linear in the length)
    }
  }
  return p;
}

std::vector<double> measured_rank_slowdown(const PartitionProblem& p, const std::vector<LayerRange>& cut, double noise,
                                           double floor_ms) {
  const Schedule schedule = make_schedule(p.schedule);
  const int L = p.costs.layers();
  std::vector<std::vector<double>> ratios(static_cast<size_t>(p.schedule.ranks)), ms(ratios.size());
  for (size_t s = 0; s < cut.size(); ++s) {
    for (int i = std::max(1, cut[s].first); i <= std::min(L - 2, cut[s].last); ++i) {
      if (p.flops.at(static_cast<size_t>(i)) > 0 && p.costs.forward[i] > 0) {
        ratios[static_cast<size_t>(schedule.stage_rank[s])].push_back(p.costs.forward[i] / p.flops[i]);
        ms[static_cast<size_t>(schedule.stage_rank[s])].push_back(p.costs.forward[i]);
      }
    }
  }
  auto median_of = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> median(ratios.size(), 0.0);
  double fastest = 0;
  int measured = 0;
  bool long_enough = true;
  for (size_t r = 0; r < ratios.size(); ++r) {
    if (ratios[r].empty()) continue;
    median[r] = median_of(ratios[r]);
    long_enough = long_enough && median_of(ms[r]) >= floor_ms;
    fastest = measured++ == 0 ? median[r] : std::min(fastest, median[r]);
  }
  std::vector<double> out(ratios.size(), 1.0);
  if (measured < 2 || !long_enough) return out;
  for (size_t r = 0; r < ratios.size(); ++r) {
    if (median[r] > 0 && median[r] / fastest >= noise) out[r] = median[r] / fastest;
  }
  return out;
}

std::vector<LayerRange> learn_cut(Partitioner& agent, const PartitionProblem& p, std::vector<LayerRange> start,
                                  int decisions, double optimum, int* within) {
  std::vector<LayerRange> best = start, now = std::move(start);
  double best_span = score_cut(p, now).span;
  if (within != nullptr) *within = best_span <= 1.05 * optimum ? 0 : -1;
  for (int d = 1; d <= decisions; ++d) {
    now = agent.cut(p, now);
    const CutScore sc = score_cut(p, now);
    if (sc.fits && sc.span < best_span) best = now, best_span = sc.span;
    if (within != nullptr && *within < 0 && sc.span <= 1.05 * optimum) *within = d;
  }
  return best;
}

std::vector<LayerRange> startup_cut(const Config& config) {
  const ParallelConfig& par = config.parallel;
  const int S = par.pipeline * virtual_stages(par);
  if (!par.stage_boundaries.empty() ||
      (par.partitioner == PartitionerKind::static_ && par.layer_costs.empty() && par.stage_memory_mib == 0)) {
    return cut_stages(layer_costs(config.model, config.train.seq_len), S, par.stage_boundaries);
  }
  const PartitionProblem p = problem_for(config);
  const std::vector<LayerRange> start = StaticPartitioner().cut(p, {});
  const std::unique_ptr<Partitioner> partitioner = make_partitioner(par.partitioner, config.train.seed);
  if (par.partitioner == PartitionerKind::qlearning) return learn_cut(*partitioner, p, start, 50);
  return partitioner->cut(p, start);
}

std::unique_ptr<Partitioner> make_partitioner(PartitionerKind kind, uint64_t seed) {
  switch (kind) {
    case PartitionerKind::static_: return std::make_unique<StaticPartitioner>();
    case PartitionerKind::dp: return std::make_unique<DpPartitioner>();
    case PartitionerKind::qlearning: return std::make_unique<QLearningPartitioner>(seed);
  }
  throw Error("parallel.partitioner: no such partitioner");
}

std::vector<LayerRange> StaticPartitioner::cut(const PartitionProblem& p, const std::vector<LayerRange>&) {
  return cut_stages(p.flops, p.stages(), "");
}

std::vector<LayerRange> min_max_cut(const PartitionProblem& p) {
  const int L = p.costs.layers(), S = p.stages();
  check(S >= 1 && S <= L, "partitioner: " + std::to_string(S) + " stages for " + std::to_string(L) + " layers");
  const std::vector<double> cost = p.costs.total();
  const std::vector<int> in_flight = in_flight_per_stage(make_schedule(p.schedule));
  const std::vector<double> slow = p.stage_slowdown();
  std::vector<double> prefix(L + 1, 0), params(L + 1, 0), act(L + 1, 0);
  for (int i = 0; i < L; ++i) {
    prefix[i + 1] = prefix[i] + cost[i];
    params[i + 1] = params[i] + p.costs.param_bytes[i];
    act[i + 1] = act[i] + p.costs.activation_bytes[i];
  }
  auto fits = [&](int s, int j, int i) {  // stage s = layers j..i-1
    if (p.stage_memory_cap <= 0) return true;
    return 4 * (params[i] - params[j]) + in_flight[s] * (act[i] - act[j]) <= static_cast<double>(p.stage_memory_cap);
  };
  // best[s][i]: the least possible largest stage cutting layers 0..i-1 into s stages that fit.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(S + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> from(S + 1, std::vector<int>(L + 1, -1));
  best[0][0] = 0;
  for (int s = 1; s <= S; ++s) {
    for (int i = s; i <= L; ++i) {
      for (int j = s - 1; j < i; ++j) {
        if (best[s - 1][j] == inf || !fits(s - 1, j, i)) continue;
        const double c = std::max(best[s - 1][j], slow[s - 1] * (prefix[i] - prefix[j]));
        if (c < best[s][i]) best[s][i] = c, from[s][i] = j;
      }
    }
  }
  if (best[S][L] == inf) {
    throw Error("config key 'parallel.stage_memory_mib': no cut of the " + std::to_string(L) + " layers into " +
                std::to_string(S) + " stages keeps every stage within " +
                std::to_string(p.stage_memory_cap >> 20) + " MiB (parameters, gradients, moments and activations in flight)");
  }
  std::vector<int> firsts(S, 0);
  for (int s = S, i = L; s >= 1; --s) {
    firsts[s - 1] = from[s][i];
    i = from[s][i];
  }
  return cut_of(firsts, L);
}

std::vector<LayerRange> DpPartitioner::cut(const PartitionProblem& p, const std::vector<LayerRange>&) {
  const int L = p.costs.layers(), S = p.stages();
  // Scored on the simulator: every cut that fits when there are few (at most kExhaustive), else
  // from the min-max cut, the best single-boundary move while one shortens the span.
  std::vector<LayerRange> cut = min_max_cut(p);
  double span = score_cut(p, cut).span;
  double count = 1;  // cuts of L layers into S stages: C(L - 1, S - 1)
  for (int k = 1; k < S; ++k) count = count * (L - k) / k;
  if (count <= kExhaustive) {
    every_cut(L, S, [&](const std::vector<LayerRange>& c) {
      const CutScore sc = score_cut(p, c);
      if (sc.fits && sc.span < span * (1 - 1e-9)) cut = c, span = sc.span;
    });
    return cut;
  }
  for (bool moved = true; moved;) {
    moved = false;
    std::vector<LayerRange> best = cut;
    for (int b = 1; b < S; ++b) {
      for (int d : {-1, 1}) {
        std::vector<int> f = firsts_of(cut);
        f[b] += d;
        if (f[b] <= f[b - 1] || (b + 1 < S ? f[b] >= f[b + 1] : f[b] >= L)) continue;
        const std::vector<LayerRange> c = cut_of(f, L);
        const CutScore sc = score_cut(p, c);
        if (sc.fits && sc.span < span * (1 - 1e-9)) best = c, span = sc.span, moved = true;
      }
    }
    cut = best;
  }
  return cut;
}

namespace {

double squares(const PartitionProblem& p, const std::vector<LayerRange>& cut) {
  const std::vector<double> cost = p.costs.total(), slow = p.stage_slowdown();
  double sum = 0;
  for (size_t s = 0; s < cut.size(); ++s) {
    double c = 0;
    for (int i = cut[s].first; i <= cut[s].last; ++i) c += cost[i];
    c *= slow[s];
    sum += c * c;
  }
  return sum > 0 ? sum : 1;
}

}  // namespace

std::vector<double>& QLearningPartitioner::q(const std::string& state, int actions) {
  std::vector<double>& v = table_[state];
  if (v.empty()) v.assign(static_cast<size_t>(actions), 0.0);
  return v;
}

std::string QLearningPartitioner::state_of(const PartitionProblem& p, const std::vector<LayerRange>& cut,
                                           double span) const {
  const std::vector<double> cost = p.costs.total(), slow = p.stage_slowdown();
  std::vector<double> stage;
  double mean = 0;
  for (size_t k = 0; k < cut.size(); ++k) {
    const LayerRange& r = cut[k];
    double c = 0;
    for (int i = r.first; i <= r.last; ++i) c += cost[i];
    c *= slow[k];
    stage.push_back(c);
    mean += c / cut.size();
  }
  std::string s;
  for (double c : stage) {
    const int bucket = std::clamp(static_cast<int>(std::lround(mean > 0 ? (c - mean) / mean / 0.1 : 0)), -2, 2);
    s += static_cast<char>('2' + bucket);
  }
  const int trend = last_span_ <= 0 ? 1 : span < last_span_ * 0.99 ? 0 : span > last_span_ * 1.01 ? 2 : 1;
  s += '/';
  s += static_cast<char>('0' + trend);
  return s;
}

std::vector<LayerRange> QLearningPartitioner::cut(const PartitionProblem& p, const std::vector<LayerRange>& current) {
  constexpr double kAlpha = 0.5, kGamma = 0.9;
  const int L = p.costs.layers(), S = static_cast<int>(current.size());
  const int actions = 2 * (S - 1) + 1;  // 0 = keep; 2k-1 / 2k: boundary k one layer left / right
  auto apply = [&](int a) -> std::vector<LayerRange> {
    if (a == 0) return current;
    const int b = (a + 1) / 2, d = a % 2 == 1 ? -1 : 1;
    std::vector<int> f = firsts_of(current);
    f[b] += d;
    if (f[b] <= f[b - 1] || (b + 1 < S ? f[b] >= f[b + 1] : f[b] >= L)) return {};  // empties a stage
    return cut_of(f, L);
  };
  const CutScore now = score_cut(p, current);
  const std::string state = state_of(p, current, now.span);
  // Counterfactual moves on the simulator: every action's reward and next state, learnt from.
  std::vector<double> reward(static_cast<size_t>(actions), -std::numeric_limits<double>::infinity());
  std::vector<std::vector<LayerRange>> next(static_cast<size_t>(actions));
  for (int a = 0; a < actions; ++a) {
    next[a] = apply(a);
    if (next[a].empty()) continue;
    const CutScore sc = a == 0 ? now : score_cut(p, next[a]);
    if (!sc.fits) continue;
    // What the move saves, relative to the current cut (the same scale at every load; keeping
    // earns 0); the stages' sum of squares breaks ties where two stages share the largest cost
    // (a move that helps one alone leaves the span as it was).
    reward[a] = (1 - sc.span / now.span) + 0.1 * (1 - squares(p, next[a]) / squares(p, current));
    const std::string s2 = state_of(p, next[a], sc.span);
    const std::vector<double>& q2 = q(s2, actions);
    const double future = *std::max_element(q2.begin(), q2.end());
    std::vector<double>& qs = q(state, actions);
    qs[a] += kAlpha * (reward[a] + kGamma * future - qs[a]);
  }
  const std::vector<double>& qs = q(state, actions);
  const double epsilon = std::max(0.05, 0.5 * std::pow(0.85, decisions_));
  decisions_++;
  int chosen = 0;
  if (rng_.uniform() < epsilon) {
    std::vector<int> allowed;
    for (int a = 0; a < actions; ++a) {
      if (std::isfinite(reward[a])) allowed.push_back(a);
    }
    if (allowed.empty()) return current;  // nothing fits: nothing to learn from here
    chosen = allowed[rng_.below(allowed.size())];
  } else {
    for (int a = 1; a < actions; ++a) {
      if (std::isfinite(reward[a]) && qs[a] > qs[chosen]) chosen = a;
    }
  }
  last_span_ = now.span;
  return next[chosen];
}

}  // namespace keel::pipeline
