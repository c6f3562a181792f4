#include "runtime/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Drops the lines of steps after `step` (they will be replayed) and lines cut short by a crash;
// recovery events stay (they describe the run's history).
void trim(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::istringstream in(read_text_file(path));
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      const json j = json::parse(line);
      if (j.contains("step") && j.at("step").get<int64_t>() > step && !j.contains("event")) continue;
      if (j.value("event", "") == "checkpoint" && j.at("step").get<int64_t>() > step) continue;
    } catch (const json::exception&) {
      continue;
    }
    kept += line + '\n';
  }
  write_file_atomic(path, {ByteRange{kept.data(), kept.size()}});
}

}  // namespace

Metrics::Metrics(const Config& config, Communicator& world) : config_(config), world_(world) {}

void Metrics::replace_sources(const std::vector<MetricsSource*>& old, const std::vector<MetricsSource*>& now) {
  check(old.size() == now.size(), "metrics: " + std::to_string(now.size()) + " sources to replace " +
                                      std::to_string(old.size()));
  for (size_t i = 0; i < old.size(); ++i) std::replace(sources_.begin(), sources_.end(), old[i], now[i]);
}

void Metrics::open(bool keep, int64_t step) {
  if (!world_.is_root()) return;
  const std::string path = config_.train.run_dir + "/metrics.jsonl";
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  // (A FIFO here would block the open for writing until someone read it.)
  if (fs::exists(st) && !fs::is_regular_file(st)) throw Error(not_regular_file_message("file", path, st.type()));
  if (keep) trim(path, step);
  file_.open(path, keep ? std::ios::app : std::ios::trunc);
  check(file_.good(), "run directory " + config_.train.run_dir + ": cannot write metrics.jsonl");
}

void Metrics::log(const json& line) {
  if (!world_.is_root()) return;
  // (Strings from outside, paths and names, may hold bytes that are not UTF-8: each becomes U+FFFD.)
  file_ << line.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  file_.flush();
  if (!line.contains("loss") || line.contains("event")) {
    for (StepLineSink* sink : sinks_) sink->observe_event(line);
  }
}

void Metrics::print_startup() const {
  if (!world_.is_root()) return;
  for (const MetricsSource* s : sources_) s->print_startup();
}

void Metrics::step(const StepStats& s, double moments_mb) {
  json line = {{"step", s.step}, {"loss", s.loss}, {"lr", s.lr}, {"grad_norm", s.grad_norm}, {"ms", s.ms},
               {"tokens_per_s", s.tokens_per_s}, {"mfu", s.mfu}, {"matmul_efficiency", s.matmul_efficiency}};
  line["peak_rss_mb"] = s.peak_rss_mb;
  if (s.ckpt_stall_ms > 0) line["ckpt_stall_ms"] = s.ckpt_stall_ms;
  line["moments_mb"] = moments_mb;
  const bool curriculum = !config_.train.seq_len_schedule.empty();
  if (curriculum) line["seq_len"] = s.seq_len;
  for (MetricsSource* source : sources_) source->add_step_fields(s.ms, line);
  log(line);
  if (world_.is_root()) {
    for (StepLineSink* sink : sinks_) sink->observe_step(line);
  }
  const TrainConfig& t = config_.train;
  if (!world_.is_root() || !(s.step % t.log_every == 0 || s.step == t.steps || s.step == 1)) return;
  std::printf("step %6lld/%d | loss %.4f | lr %.2e | norm %6.3f | %7.1f ms | %7.0f tok/s | MFU %5.1f%%",
              static_cast<long long>(s.step), t.steps, s.loss, s.lr, s.grad_norm, s.ms, s.tokens_per_s, 100 * s.mfu);
  if (curriculum) std::printf(" | T %d", s.seq_len);
  for (const MetricsSource* source : sources_) {
    const std::string fragment = source->progress_fragment(s.ms);
    if (!fragment.empty()) std::printf(" | %s", fragment.c_str());
  }
  std::printf("\n");
  std::fflush(stdout);
}

void Metrics::evaluation(int64_t step, double loss) {
  char text[96];
  std::snprintf(text, sizeof text, "val loss %.4f | val ppl %.2f", loss, std::exp(loss));
  evaluation(step, {{"val_loss", loss}, {"val_ppl", std::exp(loss)}}, text);
}

void Metrics::evaluation(int64_t step, const nlohmann::json& fields, const std::string& text) {
  if (world_.is_root()) {
    std::printf("step %6lld | %s\n", static_cast<long long>(step), text.c_str());
    std::fflush(stdout);
  }
  nlohmann::json line = {{"step", step}};
  line.update(fields);
  log(line);
}

void Metrics::print_summaries() const {
  if (!world_.is_root()) return;
  for (const MetricsSource* s : sources_) s->print_summary();
  std::fflush(stdout);
}

}  // namespace keel
