#include "comm/sync_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "comm/sync_policy.h"

namespace keel {

SyncReport::SyncReport(const Config& config, Communicator& dp, const GradSync& sync)
    : config_(config), dp_(dp), sync_(sync) {}

void SyncReport::take(const SyncStats& stats) {
  last_ = stats;
  if (dp_.size() == 1) return;
  // The least wait is what backward did not hide; the spread is waiting for a slower peer.
  double maxima[2] = {-stats.exposed_ms, stats.exposed_ms};
  dp_.allreduce_max(maxima, 2);
  last_.exposed_min_ms = -maxima[0];
  last_.imbalance_ms = maxima[1] + maxima[0];
  constexpr size_t kJitterWindow = 20;
  latencies_ms_.push_back(stats.latency_ms);
  if (latencies_ms_.size() > kJitterWindow) latencies_ms_.pop_front();
  double mean = 0, var = 0;
  for (double x : latencies_ms_) mean += x;
  mean /= static_cast<double>(latencies_ms_.size());
  for (double x : latencies_ms_) var += (x - mean) * (x - mean);
  jitter_ = mean > 0 ? std::sqrt(var / static_cast<double>(latencies_ms_.size())) / mean : 0;
  if (!sync_.compression_configured()) return;
  for (const LayerSyncStats& l : stats.layers) {
    LayerSyncStats& total = totals_[l.layer];
    total.layer = l.layer;
    total.raw_bytes += l.raw_bytes;
    total.wire_bytes += l.wire_bytes;
    if (l.codec != CodecKind::none) total.codec = l.codec;  // the codec once compression started
  }
  encode_ms_ += stats.encode_ms;
  decode_ms_ += stats.decode_ms;
}

void SyncReport::print_startup() const {
  if (dp_.size() == 1) return;
  // (context parallelism: the data-parallel group spans data x context, each context rank a part of
  // every sequence)
  const int C = std::max(1, config_.parallel.context);
  const std::string split =
      C > 1 ? " (" + std::to_string(dp_.size() / C) + " data x " + std::to_string(C) + " context)" : std::string();
  std::printf("keel: data parallel over %d ranks%s, %d gradient buckets of up to %.1f MiB, ZeRO-%d\n", dp_.size(),
              split.c_str(), sync_.num_buckets(), config_.parallel.bucket_bytes / 1048576.0, config_.parallel.zero);
  if (!sync_.compression_configured()) return;
  const SyncConfig& sc = config_.sync;
  const bool hybrid = sc.codec == SyncCodec::hybrid;
  std::printf("keel: compressed sync \"%s\"%s%s: %d of %d buckets through codecs, error feedback on", to_string(sc.codec),
              hybrid ? ", policy " : "",
              hybrid ? (sc.policy.empty() ? default_sync_policy(config_.model.n_layer) : sc.policy).c_str() : "",
              sync_.num_compressed_buckets(), sync_.num_buckets());
  if (sc.warmup_steps > 0) std::printf(", first %d steps uncompressed", sc.warmup_steps);
  std::printf("\n");
}

void SyncReport::add_step_fields(double step_ms, nlohmann::json& line) {
  if (dp_.size() == 1) return;
  const SyncStats& s = last_;
  line["ranks"] = dp_.size();
  line["sync_payload_bytes"] = s.payload_bytes;
  line["sync_sent_bytes"] = s.sent_bytes;
  line["sync_exposed_ms"] = s.exposed_min_ms;
  line["sync_imbalance_ms"] = s.imbalance_ms;
  line["sync_latency_ms"] = s.latency_ms;
  line["sync_jitter"] = jitter_;
  if (!sync_.compression_configured()) return;
  line["sync_uncompressed_bytes"] = s.uncompressed_bytes;
  line["sync_ratio"] = s.sent_bytes > 0 ? s.uncompressed_bytes / s.sent_bytes : 1.0;
  line["sync_encode_ms"] = s.encode_ms;
  line["sync_decode_ms"] = s.decode_ms;
  line["sync_codec_share"] = step_ms > 0 ? (s.encode_ms + s.decode_ms) / step_ms : 0.0;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerSyncStats& l : s.layers) {
    layers.push_back({{"layer", l.layer}, {"codec", to_string(l.codec)}, {"raw_bytes", l.raw_bytes}, {"wire_bytes", l.wire_bytes}});
  }
  line["sync_layers"] = layers;
}

std::string SyncReport::progress_fragment(double step_ms) const {
  if (dp_.size() == 1) return "";
  const SyncStats& s = last_;
  char buf[320];
  int n = std::snprintf(buf, sizeof buf, "sync %.2f MB sent", s.sent_bytes / 1e6);
  if (s.compressed) {
    n += std::snprintf(buf + n, sizeof buf - n, " (%.1fx smaller), codec %.1f ms (%.1f%%)",
                       s.sent_bytes > 0 ? s.uncompressed_bytes / s.sent_bytes : 1.0, s.encode_ms + s.decode_ms,
                       step_ms > 0 ? 100 * (s.encode_ms + s.decode_ms) / step_ms : 0.0);
  }
  std::snprintf(buf + n, sizeof buf - n, ", %.1f ms exposed, %.1f ms imbalance, latency %.1f ms +-%.0f%%",
                s.exposed_min_ms, s.imbalance_ms, s.latency_ms, 100 * jitter_);
  return buf;
}

void SyncReport::print_summary() const {
  if (totals_.empty()) return;
  const int n_layer = config_.model.n_layer;
  // Ratios are against what a ring all-reduce of float32 sends.
  const double ring = 2.0 * (dp_.size() - 1) / dp_.size();
  std::printf("keel: compressed sync over this run (rank 0: MB of float32 gradient, MB sent)\n");
  std::printf("  %-14s %-12s %10s %10s %8s\n", "layer", "codec", "raw MB", "sent MB", "ratio");
  double raw = 0, wire = 0;
  for (const auto& [layer, l] : totals_) {
    const std::string name =
        l.layer == 0 ? "embeddings" : l.layer > n_layer ? "final norm" : "block " + std::to_string(l.layer - 1);
    std::printf("  %-14s %-12s %10.1f %10.2f %7.1fx\n", name.c_str(), to_string(l.codec), l.raw_bytes / 1e6,
                l.wire_bytes / 1e6, l.wire_bytes > 0 ? l.raw_bytes * ring / l.wire_bytes : 0.0);
    raw += l.raw_bytes * ring;
    wire += l.wire_bytes;
  }
  std::printf("  total: %.1f MB sent instead of %.1f MB (%.1f %% fewer bytes), codec time %.0f ms encode + %.0f ms decode\n",
              wire / 1e6, raw / 1e6, raw > 0 ? 100 * (1 - wire / raw) : 0.0, encode_ms_, decode_ms_);
  std::fflush(stdout);
}

}  // namespace keel
