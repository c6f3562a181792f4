#include "pipeline/layout.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace keel::pipeline {

std::vector<double> layer_costs(const ModelConfig& m, int T) {
  const double C = m.n_embd, V = m.padded_vocab_size;
  std::vector<double> costs;
  costs.push_back(2 * C);                              // embedding: two row reads and an add
  // GPT-2: qkv, proj, fc, fcproj, attention; llama: qkv (grouped kv), proj, gate + up, down, attention.
  const double block = m.llama() ? 2 * C * m.qkv_dim() + 2 * C * C + 6 * C * m.ffn_hidden + 4.0 * T * C
                                 : 24 * C * C + 4.0 * T * C;
  // A mixture-of-experts block (model/moe.h): the router, the k chosen experts' SwiGLUs and the
  // shared experts' in place of the dense MLP (what one token activates).
  const double moe_block = block - 6 * C * m.ffn_hidden + 2 * C * m.moe_experts +
                           6 * C * m.moe_hidden * (static_cast<double>(m.moe_top_k) + std::max(0, m.moe_shared_experts));
  for (int l = 0; l < m.n_layer; ++l) costs.push_back(m.moe_block(l) ? moe_block : block);
  costs.push_back(2 * C * V + 5 * V);                  // tied head and the softmax cross-entropy
  return costs;
}

std::vector<LayerRange> cut_stages(const std::vector<double>& costs, int stages, const std::string& boundaries) {
  const int L = static_cast<int>(costs.size());
  check(stages >= 1 && stages <= L, "config key 'parallel.pipeline': expected at most one stage per layer (" + std::to_string(L) +
                                        " layers: embedding, " + std::to_string(L - 2) + " blocks, head), found " +
                                        std::to_string(stages) + " stages");
  std::vector<int> first;  // first layer of each stage
  if (!boundaries.empty()) {
    first.push_back(0);
    std::stringstream in(boundaries);
    std::string item;
    while (std::getline(in, item, ',')) {
      int b = -1;
      try {
        size_t used = 0;
        b = std::stoi(item, &used);
        check(used == item.size(), "");
      } catch (const std::exception&) {
        throw Error("config key 'parallel.stage_boundaries': expected comma-separated layer indices, found \"" + boundaries + "\"");
      }
      check(b > first.back() && b < L, "config key 'parallel.stage_boundaries': boundary " + std::to_string(b) +
                                           " out of range (expected increasing layer indices in 1.." +
                                           std::to_string(L - 1) + ")");
      first.push_back(b);
    }
    check(static_cast<int>(first.size()) == stages,
          "config key 'parallel.stage_boundaries': expected " + std::to_string(stages - 1) + " boundaries for " +
              std::to_string(stages) + " stages, found " + std::to_string(first.size() - 1));
  } else {
    // best[s][i]: the least possible maximum stage cost cutting layers 0..i-1 into s stages.
    std::vector<double> prefix(L + 1, 0);
    for (int i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + costs[i];
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(stages + 1, std::vector<double>(L + 1, inf));
    std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(L + 1, 0));
    best[0][0] = 0;
    for (int s = 1; s <= stages; ++s) {
      for (int i = s; i <= L; ++i) {
        for (int j = s - 1; j < i; ++j) {
          const double c = std::max(best[s - 1][j], prefix[i] - prefix[j]);
          if (c < best[s][i]) best[s][i] = c, cut[s][i] = j;
        }
      }
    }
    first.assign(stages, 0);
    for (int s = stages, i = L; s >= 1; --s) {
      first[s - 1] = cut[s][i];
      i = cut[s][i];
    }
  }
  std::vector<LayerRange> ranges;
  for (int s = 0; s < stages; ++s) ranges.push_back({first[s], s + 1 < stages ? first[s + 1] - 1 : L - 1});
  return ranges;
}

int virtual_stages(const ParallelConfig& p) {
  return p.virtual_stages > 0 ? p.virtual_stages : default_virtual_stages(p.schedule);
}

int micro_batches(const Config& c) {
  return c.parallel.micro_batches > 0 ? c.parallel.micro_batches : c.train.grad_accum;
}

void validate_pipeline_config(const ParallelConfig& p, const TrainConfig& t, int n_layer, int world_size) {
  auto s = [](auto v) { return std::to_string(v); };
  // (Config::resolve has checked that parallel.pipeline divides the world.)
  (void)world_size;
  const Kind kind = p.schedule;
  check(p.virtual_stages >= 0, "config key 'parallel.virtual_stages': expected >= 0, found " + s(p.virtual_stages));
  const int v = virtual_stages(p);
  check(kind != Kind::interleaved || v >= 2 || p.pipeline == 1,
        "config key 'parallel.virtual_stages': the interleaved schedule needs at least 2, found " + s(v));
  check(kind == Kind::interleaved || kind == Kind::zb_v || v == 1,
        "config key 'parallel.virtual_stages': schedule " + std::string(to_string(p.schedule)) + " runs one stage per rank, found " + s(v));
  check(kind != Kind::zb_v || v == 2, "config key 'parallel.virtual_stages': schedule zb-v runs 2 stages per rank, found " + s(v));
  check(p.micro_batches >= 0, "config key 'parallel.micro_batches': expected >= 0, found " + s(p.micro_batches));
  check(p.lookahead >= 0, "config key 'parallel.lookahead': expected >= 0, found " + std::to_string(p.lookahead));
  check(p.activation_mib >= 0, "config key 'parallel.activation_mib': expected >= 0, found " + s(p.activation_mib));
  check(p.stage_memory_mib >= 0, "config key 'parallel.stage_memory_mib': expected >= 0, found " + s(p.stage_memory_mib));
  check(p.repartition_every >= 0, "config key 'parallel.repartition_every': expected >= 0, found " + s(p.repartition_every));
  check(p.repartition_threshold >= 0 && p.repartition_threshold < 1,
        "config key 'parallel.repartition_threshold': expected a fraction in [0, 1), found " + std::to_string(p.repartition_threshold));
  if (p.pipeline == 1) {
    check(p.repartition_every == 0, "config key 'parallel.repartition_every': re-cutting stages only with parallel.pipeline > 1");
    check(p.partitioner == PartitionerKind::static_ && p.layer_costs.empty() && p.stage_memory_mib == 0,
          "config key 'parallel.partitioner': cutting stages (partitioner, layer_costs, stage_memory_mib) only with "
          "parallel.pipeline > 1");
    check(p.micro_batches == 0, "config key 'parallel.micro_batches': only with parallel.pipeline > 1 (use train.grad_accum)");
    check(p.stage_boundaries.empty(), "config key 'parallel.stage_boundaries': only with parallel.pipeline > 1");
    check(!p.dynamic_micro_batches, "config key 'parallel.dynamic_micro_batches': only with parallel.pipeline > 1");
    check(p.predict_gradients == PredictGradients::off, "config key 'parallel.predict_gradients': only with parallel.pipeline > 1");
    check(!p.post_validate, "config key 'parallel.post_validate': only with parallel.pipeline > 1");
    return;
  }
  // With re-cuts, stage_boundaries is the first cut and the partitioner makes the later ones.
  check(p.stage_boundaries.empty() || p.layer_costs.empty(),
        "config key 'parallel.stage_boundaries': a fixed cut, not with parallel.layer_costs");
  check(p.stage_boundaries.empty() || p.repartition_every > 0 || (p.partitioner == PartitionerKind::static_ && p.stage_memory_mib == 0),
        "config key 'parallel.stage_boundaries': a fixed cut, not with parallel.partitioner or stage_memory_mib "
        "(unless parallel.repartition_every re-cuts it)");
  if (p.repartition_every > 0) {
    check(p.predict_gradients == PredictGradients::off,
          "config key 'parallel.repartition_every': not with parallel.predict_gradients (its deferred W's cross the "
          "step boundary a re-cut moves layers at)");
    check(!p.dynamic_micro_batches, "config key 'parallel.repartition_every': not with parallel.dynamic_micro_batches (yet)");
  }
  const int stages = p.pipeline * v;
  check(stages <= n_layer + 2, "config key 'parallel.pipeline': " + s(stages) + " stages (" + s(p.pipeline) + " ranks x " + s(v) +
                                   ") for " + s(n_layer + 2) + " layers (embedding, " + s(n_layer) +
                                   " blocks, head): expected at most one stage per layer");
  const int m = p.micro_batches > 0 ? p.micro_batches : t.grad_accum;
  const int sequences = t.batch_size * t.grad_accum;
  check(sequences % m == 0, "config key 'parallel.micro_batches': " + s(m) + " micro-batches do not divide the " + s(sequences) +
                                " sequences of a step (train.batch_size " + s(t.batch_size) + " x train.grad_accum " +
                                s(t.grad_accum) + ")");
  check(p.predict_gradients == PredictGradients::off || !p.dynamic_micro_batches,
        "config key 'parallel.predict_gradients': not with parallel.dynamic_micro_batches (yet)");
  check(p.predict_gradients == PredictGradients::off || m >= 2,
        "config key 'parallel.predict_gradients': needs at least 2 micro-batches a step, found " + s(m));
  check(kind != Kind::interleaved || m % p.pipeline == 0,
        "config key 'parallel.micro_batches': the interleaved schedule needs a multiple of the " + s(p.pipeline) +
            " pipeline ranks, found " + s(m));
  // Boundaries are checked against the real layer count here, so a bad cut fails before any rank starts.
  cut_stages(std::vector<double>(n_layer + 2, 1.0), stages, p.stage_boundaries);
}

Plan plan(const Config& config, const std::vector<LayerRange>& stages, int m) {
  const ParallelConfig& p = config.parallel;
  const TrainConfig& t = config.train;
  Plan out;
  out.micro_batch = t.batch_size * t.grad_accum / m;
  out.schedule = make_schedule({p.schedule, p.pipeline, m, virtual_stages(p)});
  MemoryBound bound;
  const bool bf16 = config.runtime.precision == Precision::bf16;
  for (const LayerRange& r : stages) {
    bound.stage_bytes.push_back(GPT::slot_bytes_for(config.model, r, out.micro_batch, t.longest_seq_len(), bf16,
                                                    recompute_plan(t, config.model.n_layer)));
  }
  out.check = validate(out.schedule, bound);
  const int64_t peak = *std::max_element(out.check.peak_bytes.begin(), out.check.peak_bytes.end());
  const int64_t limit = p.activation_mib << 20;
  check(limit == 0 || peak <= limit,
        "config key 'parallel.activation_mib': schedule " + std::string(to_string(p.schedule)) + " with " + std::to_string(m) +
            " micro-batches of " + std::to_string(out.micro_batch) + " sequences needs " +
            std::to_string((peak + (1 << 20) - 1) >> 20) + " MiB of activations in flight on some rank, found a bound of " +
            std::to_string(p.activation_mib) + " MiB");
  return out;
}

std::vector<int> allowed_micro_batches(const Config& config) {
  const int sequences = config.train.batch_size * config.train.grad_accum;
  const bool interleaved = config.parallel.schedule == Kind::interleaved;
  std::vector<int> out;
  for (int m = 1; m <= sequences; ++m) {
    if (sequences % m == 0 && (!interleaved || m % config.parallel.pipeline == 0)) out.push_back(m);
  }
  return out;
}

}  // namespace keel::pipeline
