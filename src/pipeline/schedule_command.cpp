#include "pipeline/schedule_command.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "pipeline/schedule.h"

namespace keel::pipeline {

ScheduleChoice choose_schedule(const Config& config, const ScheduleOptions& o) {
  const ParallelConfig& p = config.parallel;
  const int T = config.train.seq_len;
  ScheduleChoice c;
  c.measured_costs = !config.parallel.layer_costs.empty();
  const PartitionerKind kind = o.partitioner.value_or(c.measured_costs ? PartitionerKind::dp : config.parallel.partitioner);
  c.problem = problem_for(config);
  PartitionProblem& problem = c.problem;
  if (config.runtime.slow_rank >= 0 && config.runtime.slow_factor > 1) {  // a what-if: that rank that much slower
    problem.rank_slowdown.assign(static_cast<size_t>(p.pipeline), 1.0);
    problem.rank_slowdown[static_cast<size_t>(config.runtime.slow_rank % p.pipeline)] = config.runtime.slow_factor;
  }
  const std::unique_ptr<Partitioner> partitioner = make_partitioner(kind, config.train.seed);
  c.static_cut = StaticPartitioner().cut(problem, {});
  // The cut a run had before its load shifted: where the agent starts, scored beside the others.
  c.start_cut = c.static_cut;
  if (o.start_cut.has_value()) {
    const std::string& given = *o.start_cut;
    check(!given.empty(), "schedule --start-cut: expected the first layers of stages 1.. (\"3,6\"), found nothing");
    try {
      c.start_cut = cut_stages(layer_costs(config.model, T), static_cast<int>(c.static_cut.size()), given);
    } catch (const Error& e) {
      throw Error("schedule --start-cut " + given + ": " + e.what());
    }
  }
  if (!p.stage_boundaries.empty()) {
    c.stages = startup_cut(config);
    c.how = "parallel.stage_boundaries";
  } else if (kind == PartitionerKind::qlearning) {
    // The agent's decisions from the static cut: how many it takes to come within 5 % of the
    // exact partitioner's simulated span; the best cut it reached.
    const int decisions = o.decisions;
    check(decisions >= 1, "schedule --decisions: expected >= 1, found " + std::to_string(decisions));
    const double optimum = score_cut(problem, DpPartitioner().cut(problem, {})).span;
    int within = -1;
    c.stages = learn_cut(*partitioner, problem, c.start_cut, decisions, optimum, &within);
    c.how = "qlearning, " + std::to_string(decisions) + " decisions" + (o.start_cut.has_value() ? " from " + *o.start_cut : "") +
            ": " + (within < 0 ? "never within 5 % of dp" : "within 5 % of dp after " + std::to_string(within));
  } else {
    c.stages = partitioner->cut(problem, c.static_cut);
    c.how = to_string(kind);
  }
  c.chosen = score_cut(problem, c.stages);
  c.base = score_cut(problem, c.static_cut);
  c.plan = plan(config, c.stages, micro_batches(config));
  return c;
}

void print_schedule(const Config& config, const ScheduleChoice& c, const ScheduleOptions& o) {
  const ParallelConfig& p = config.parallel;
  const int T = config.train.seq_len;
  const LayerCosts& measured = c.problem.costs;
  const std::vector<LayerRange>& stages = c.stages;
  const Plan& plan = c.plan;
  Costs costs;
  costs.comm = measured.message_ms >= 0 ? measured.message_ms : 0;
  for (const LayerRange& r : stages) {
    double cf = 0, cb = 0, cw = 0;
    for (int i = r.first; i <= r.last; ++i) cf += measured.forward[i], cb += measured.backward_input[i], cw += measured.backward_weight[i];
    costs.forward.push_back(cf);
    costs.backward_input.push_back(cb);
    costs.backward_weight.push_back(cw);
  }
  const Schedule& schedule = plan.schedule;
  const Timeline t = simulate(schedule, costs);
  if (o.json) {
    nlohmann::json out = {{"schedule", kind_name(schedule.spec.kind)}, {"ranks", schedule.spec.ranks},
                          {"partitioner", c.how}, {"boundaries", boundaries_of(stages)},
                          {"span", c.chosen.span}, {"static_span", c.base.span},
                          {"start_span", score_cut(c.problem, c.start_cut).span}, {"stage_bytes", c.chosen.stage_bytes},
                          {"stages", schedule.num_stages()}, {"micro_batches", schedule.spec.micro},
                          {"micro_batch", plan.micro_batch}, {"bubble", t.bubble}, {"makespan", t.makespan},
                          {"rank_bubble", t.rank_bubble}, {"peak_in_flight", plan.check.peak_in_flight},
                          {"peak_activation_bytes", plan.check.peak_bytes}};
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  std::printf("schedule %s: %d ranks, %d stages, %d micro-batches of %d x %d tokens; valid\n",
              kind_name(schedule.spec.kind), schedule.spec.ranks, schedule.num_stages(), schedule.spec.micro,
              plan.micro_batch, T);
  std::printf("cut by %s: boundaries %s, simulated span %.4g (the static FLOP cut %s: %.4g, %+.1f %%)\n", c.how.c_str(),
              boundaries_of(stages).c_str(), c.chosen.span, boundaries_of(c.static_cut).c_str(), c.base.span,
              100 * (c.base.span / c.chosen.span - 1));
  for (int r = 0; r < schedule.spec.ranks; ++r) {
    std::string layers;
    for (int st : schedule.stages_of(r)) {
      layers += (layers.empty() ? "" : ", ") + std::to_string(stages[st].first) + "-" + std::to_string(stages[st].last);
    }
    std::printf("  rank %d: layers %s, at most %d micro-batches in flight (%.1f MB of activations), simulated bubble %.1f%%\n",
                r, layers.c_str(), plan.check.peak_in_flight[r], plan.check.peak_bytes[r] / 1e6, 100 * t.rank_bubble[r]);
  }
  std::printf("simulated bubble %.1f%%, step %.3g %s (%s)\n%s", 100 * t.bubble, t.makespan,
              c.measured_costs ? "ms" : "forward passes", c.measured_costs ? "measured costs" : "costs from layer FLOPs; messages free",
              gantt(t, o.width).c_str());
  if (!o.trace.empty()) {
    const std::string trace = chrome_trace(t, std::string("keel schedule ") + to_string(p.schedule));
    write_file_atomic(o.trace, {ByteRange{trace.data(), trace.size()}});
    std::printf("Chrome trace: %s\n", o.trace.c_str());
  }
}

}  // namespace keel::pipeline
