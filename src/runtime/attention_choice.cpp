#include "runtime/attention_choice.h"

#include <fcntl.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpointer.h"
#include "core/cpu.h"
#include "kernels/cpu/attention.h"

namespace keel {

namespace {

std::string cache_directory() {
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') return std::string(xdg) + "/keel";
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') return std::string(home) + "/.cache/keel";
  return "";
}

std::string format_ms(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", ms);
  return buf;
}

// "dense|blockwise DENSE_MS BLOCKWISE_MS KEY" from a cache file whose key is `key`.
bool read_cached(const std::string& path, const std::string& key, AttentionChoice* choice) {
  std::ifstream in(path);
  std::string kernel, dense_ms, blockwise_ms, line_key;
  if (!(in >> kernel >> dense_ms >> blockwise_ms) || !std::getline(in >> std::ws, line_key) || line_key != key) return false;
  if (kernel != "dense" && kernel != "blockwise") return false;
  choice->kernel = kernel == "dense" ? Attention::dense : Attention::blockwise;
  choice->reason = "measured earlier on this machine (dense " + dense_ms + " ms, blockwise " + blockwise_ms +
                   " ms; " + path + ")";
  return true;
}

}  // namespace

Attention attention_by_length(int seq_len) { return seq_len >= 256 ? Attention::blockwise : Attention::dense; }

Attention faster_attention(double dense_ms, double blockwise_ms, int seq_len) {
  if (dense_ms * 1.1 < blockwise_ms) return Attention::dense;
  if (blockwise_ms * 1.1 < dense_ms) return Attention::blockwise;
  return attention_by_length(seq_len);
}

std::optional<Attention> recorded_attention(const Config& config, std::string* from) {
  std::vector<std::string> candidates;
  try {
    candidates = resume_source(config).candidates();
  } catch (const std::exception&) {
    return std::nullopt;  // no checkpoint there: the resume itself says so
  }
  // The newest checkpoint whose manifest reads (an unreadable one is rejected by the resume, which
  // then takes the next older one; the checkpoints of one run share their kernel).
  for (const std::string& dir : candidates) {
    try {
      const Attention kernel = read_checkpoint_config(dir).model.attention;
      if (kernel != Attention::dense && kernel != Attention::blockwise) continue;
      if (from != nullptr) *from = dir;
      return kernel;
    } catch (const std::exception&) {
    }
  }
  return std::nullopt;
}

bool attention_measured(const Config& resolved, bool asked_auto) {
  return asked_auto && !resolved.model.window_asked() && !resolved.clip.enabled() && resolved.parallel.context == 1;
}

AttentionChoice choose_attention(const Config& config) {
  const ModelConfig& m = config.model;
  const int T = config.train.longest_seq_len(), NH = m.n_head, NKV = m.n_kv_head > 0 ? m.n_kv_head : m.n_head;
  const int hs = m.n_embd / NH, group = NH / NKV;
  const int threads = config.runtime.threads > 0 ? config.runtime.threads : omp_get_max_threads();
  const bool bf16 = config.runtime.precision == Precision::bf16;
  AttentionChoice choice;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const double dense_bytes = 4.0 * m.n_layer * config.train.batch_size * NH * static_cast<double>(T) * T;
  const double memory_bytes = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  if (dense_bytes > 0.5 * memory_bytes) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "dense would keep %.1f GiB of probabilities, over half of this machine's %.1f GiB",
                  dense_bytes / gib, memory_bytes / gib);
    choice.reason = buf;
    return choice;
  }
  std::string checkpoint;
  if (const std::optional<Attention> recorded = recorded_attention(config, &checkpoint)) {
    choice.kernel = *recorded;
    choice.reason = "as recorded in checkpoint " + checkpoint + ", which this run resumes";
    return choice;
  }
  // Below kMeasuredFromTokens the rule decides, unmeasured: attention is a small part of such a
  // step whichever kernel runs it, and a measurement there would make a job's bytes depend on its
  // thread count and machine (a one-rank run and the same job on a pipeline's ranks, with fewer
  // threads each, could measure differently and train different bytes from one seed).
  if (T < kMeasuredFromTokens) {
    choice.kernel = attention_by_length(T);
    choice.reason = "by length (" + std::to_string(T) + " tokens: measured only from " +
                    std::to_string(kMeasuredFromTokens) + ")";
    return choice;
  }
  // The probe: one batch row, whole key/value groups, at least as many query heads as threads
  // where the model has them (both kernels parallelise over heads).
  const int probe_kv = std::max(1, std::min(NKV, (threads + group - 1) / group));
  const int probe_heads = probe_kv * group;
  std::ostringstream key;
  // The kernels' revision: a decision measured on kernels since changed is measured again (2: dense
  // attention's heads on AMX tiles under bf16, kernels/cpu/amx_attention.h).
  constexpr int kKernelsRevision = 2;
  key << cpu_model_name() << " | kernels " << kKernelsRevision << " | threads " << threads << " | " << (bf16 ? "bf16" : "fp32") << " | T " << T << " | heads "
      << probe_heads << "/" << probe_kv << " x " << hs;
  const std::string dir = cache_directory();
  const std::string path =
      dir.empty() ? "" : dir + "/attention-" + std::to_string(std::hash<std::string>{}(key.str()) % 1000000007ull) + ".txt";
  if (!path.empty() && read_cached(path, key.str(), &choice)) return choice;

  const MatmulPrecision precision = bf16 ? MatmulPrecision::bf16 : MatmulPrecision::fp32;
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(threads);
  const int repeats = T >= 4096 ? 1 : T >= 1024 ? 2 : 5;
  const double dense_ms = ops::time_attention(true, precision, 1, T, probe_heads * hs, probe_heads, probe_kv, 0, repeats).total_ms();
  const double blockwise_ms =
      ops::time_attention(false, precision, 1, T, probe_heads * hs, probe_heads, probe_kv, 0, repeats).total_ms();
  omp_set_num_threads(saved_threads);
  choice.kernel = faster_attention(dense_ms, blockwise_ms, T);
  choice.reason = "measured at " + std::to_string(T) + " tokens, " + std::to_string(probe_heads) + " heads of " +
                  std::to_string(hs) + ", " + (bf16 ? "bf16" : "fp32") + ", " + std::to_string(threads) +
                  " threads: dense " + format_ms(dense_ms) + " ms, blockwise " + format_ms(blockwise_ms) + " ms" +
                  (std::max(dense_ms, blockwise_ms) <= 1.1 * std::min(dense_ms, blockwise_ms)
                       ? ", within 10 %: by length"
                       : "");
  if (path.empty()) return choice;
  // The first decision written wins (written whole to a private file, then linked into place, which
  // fails where a file is already there): a run that lost the race takes the winner's.
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string line = std::string(choice.kernel == Attention::dense ? "dense" : "blockwise") + " " +
                           format_ms(dense_ms) + " " + format_ms(blockwise_ms) + " " + key.str() + "\n";
  const std::string mine = path + "." + std::to_string(::getpid()) + ".tmp";
  bool written = false;
  if (const int fd = ::open(mine.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644); fd >= 0) {
    written = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
    written = ::close(fd) == 0 && written;
  }
  const bool linked = written && ::link(mine.c_str(), path.c_str()) == 0;
  std::filesystem::remove(mine, ec);
  if (linked) {
    choice.reason += " (cached in " + path + ")";
  } else if (AttentionChoice earlier; read_cached(path, key.str(), &earlier)) {
    return earlier;
  } else {
    choice.reason += " (not cached: " + path + " could not be written)";
  }
  return choice;
}

}  // namespace keel
