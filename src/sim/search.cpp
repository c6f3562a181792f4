#include "sim/search.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "runtime/job_config.h"

namespace keel::sim {

std::string Candidate::describe() const {
  char s[200];
  std::snprintf(s, sizeof s, "TP %d x PP %d x DP %d, ZeRO-%d, %s, %d micro-batches of %d, sync %s%s%s", tensor, pipeline,
                prediction.data, zero, pipeline > 1 ? to_string(schedule) : "one stage", micro_batches,
                prediction.micro_batch, to_string(codec), recompute ? ", recompute" : "", tiers ? ", memory tiers" : "");
  return s;
}

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

}  // namespace

SearchResult search_layouts(const Config& base, const Cluster& cluster) {
  Config resolved = base;
  resolve_job_config(resolved, cluster.devices());
  const int64_t sequences = static_cast<int64_t>(resolved.train.batch_size) * resolved.train.grad_accum *
                            (cluster.devices() / std::max(1, resolved.parallel.pipeline));
  const int layers = base.model.n_layer + 2;
  SearchResult out;
  out.least_gib = 1e300;
  for (int tp : divisors(cluster.devices_per_node)) {
    if (base.model.n_head % tp != 0 || cluster.devices() % tp != 0) continue;
    for (int pp : divisors(cluster.devices() / tp)) {
      if (pp > layers) continue;
      const int dp = cluster.devices() / tp / pp;
      if (sequences % dp != 0) continue;
      const int per_replica = static_cast<int>(sequences / dp);
      using S = ScheduleKind;
      const std::vector<S> schedules =
          pp == 1 ? std::vector<S>{S::one_f_one_b} : std::vector<S>{S::one_f_one_b, S::interleaved, S::zb_h1, S::zb_v};
      for (int m : divisors(per_replica)) {
        if (per_replica / m > 16) continue;
        for (const ScheduleKind schedule : schedules) {
          for (int zero = 0; zero <= 2; ++zero) {
            for (const SyncCodec codec : {SyncCodec::none, SyncCodec::hybrid}) {
              if (zero == 2 && codec != SyncCodec::none) continue;  // Keel: no codecs with ZeRO-2
              for (bool recompute : {false, true}) {
                Config c = base;
                c.parallel.pipeline = pp;
                c.parallel.data = 0;
                c.parallel.schedule = schedule;
                c.parallel.virtual_stages = 0;
                c.parallel.micro_batches = 0;
                c.parallel.stage_boundaries = "";
                c.parallel.zero = zero;
                c.sync.codec = codec;
                c.train.global_batch_size = 0;
                c.train.batch_size = per_replica / m;
                c.train.grad_accum = m;
                Candidate cand{tp, pp, zero, m, schedule, codec, recompute, false, {}};
                try {
                  resolve_job_config(c, cluster.devices() / tp);
                  cand.prediction = predict_step(c, cluster, SimLayout{tp, recompute, ""});
                  cand.prediction.timeline = {};  // thousands of candidates: keep the figures only
                } catch (const Error&) {
                  continue;  // a layout Keel refuses
                }
                out.tried++;
                out.least_gib = std::min(out.least_gib, cand.prediction.memory.total_gib());
                if (!cand.prediction.fits) {
                  try {  // the same layout with its pages over device, host and NVMe
                    // (coarser pages than a single prediction's: thousands of layouts are replayed)
                    cand.prediction = predict_step(c, cluster, SimLayout{tp, recompute, "", true, 64});
                    cand.prediction.timeline = {};
                    cand.tiers = true;
                  } catch (const Error&) {
                  }
                }
                if (!cand.prediction.fits) {
                  out.rejected++;
                  continue;
                }
                out.ranked.push_back(std::move(cand));
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(out.ranked.begin(), out.ranked.end(), [](const Candidate& a, const Candidate& b) {
    return a.prediction.samples_per_s > b.prediction.samples_per_s;
  });
  return out;
}

}  // namespace keel::sim
