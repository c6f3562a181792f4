// Helpers shared by Keel's tests: temporary directories and running the keel binary.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <array>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/llmc.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "model/gpt.h"
#include "runtime/job_config.h"
#include "store/chunk_store.h"

extern char** environ;

namespace keel::testing {

// The message of the keel::Error `f` throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A fresh directory under /tmp, removed with everything in it when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "keel-test") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            (tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// The newest complete checkpoint under a checkpoint root (run_dir/ckpt).
inline std::string newest_checkpoint(const std::string& root) {
  const std::vector<std::string> all = list_checkpoints(root);
  if (all.empty()) throw Error("no checkpoint under " + root);
  return all.front();
}

// One plane of the newest checkpoint under root, decoded, as bytes.
inline std::vector<char> checkpoint_bytes(const std::string& root, Plane plane = Plane::param) {
  const std::vector<float> v = read_checkpoint_plane(newest_checkpoint(root), plane);
  const char* p = reinterpret_cast<const char*>(v.data());
  return std::vector<char>(p, p + v.size() * sizeof(float));
}

// Every step line of a run's metrics.jsonl (the lines with a training loss), in order.
inline std::vector<nlohmann::json> step_lines(const std::string& metrics_jsonl) {
  std::vector<nlohmann::json> out;
  const std::string text = read_text_file(metrics_jsonl);
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
    if (j.contains("loss") && !j.contains("event")) out.push_back(std::move(j));
    at = end + 1;
  }
  return out;
}

// The training loss of every step line of a run's metrics.jsonl, in order.
inline std::vector<double> step_losses(const std::string& metrics_jsonl) {
  std::vector<double> out;
  const std::string text = read_text_file(metrics_jsonl);
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    const nlohmann::json j = nlohmann::json::parse(text.substr(at, end - at));
    if (j.contains("loss") && !j.contains("event")) out.push_back(j.at("loss").get<double>());
    at = end + 1;
  }
  return out;
}

// Per-tensor relative L2 distance between the final weights of the newest checkpoints under two
// checkpoint roots (the same model), keyed by tensor name.
inline std::map<std::string, double> weight_distance(const std::string& root_a, const std::string& root_b) {
  const auto manifest = nlohmann::json::parse(read_text_file(newest_checkpoint(root_a) + "/manifest.json"));
  const std::vector<char> pa = checkpoint_bytes(root_a), pb = checkpoint_bytes(root_b);
  const float* x = reinterpret_cast<const float*>(pa.data());
  const float* y = reinterpret_cast<const float*>(pb.data());
  std::map<std::string, std::pair<double, double>> sums;
  for (const auto& chunk : manifest["chunks"]) {
    for (const auto& t : chunk["tensors"]) {
      const std::string name = t[0];
      const int64_t numel = t[2], off = chunk["offset"].get<int64_t>() + t[3].get<int64_t>();
      // The key third of each attn.qkv.b has an exactly-zero true gradient (softmax ignores a
      // shift shared by all keys). Both runs feed rounding noise of ~1e-9 there to Adam, which
      // turns it into steps of ~lr: those entries cannot agree and are left out here.
      const bool qkv_bias = name.ends_with("attn.qkv.b");
      for (int64_t i = 0; i < numel; ++i) {
        if (qkv_bias && i >= numel / 3 && i < 2 * numel / 3) continue;
        auto& [d, w] = sums[name];
        d += (x[off + i] - y[off + i]) * static_cast<double>(x[off + i] - y[off + i]);
        w += x[off + i] * static_cast<double>(x[off + i]);
      }
    }
  }
  std::map<std::string, double> out;
  for (const auto& [name, s] : sums) out[name] = std::sqrt(s.first / std::max(s.second, 1e-30));
  return out;
}

// A learnable toy language (repeating patterns with a little noise, vocabulary 64) as
// dir/train.bin and dir/val.bin, for in-process Trainer tests.
inline void write_toy_shards(const std::string& dir) {
  Rng rng(7);
  auto make = [&](size_t n) {
    std::vector<uint16_t> t(n);
    for (size_t i = 0; i < n; ++i) {
      t[i] = static_cast<uint16_t>(rng.uniform() < 0.1 ? rng.below(64) : (i * 7 + i / 13) % 64);
    }
    return t;
  };
  write_token_shard(dir + "/train.bin", make(20000));
  write_token_shard(dir + "/val.bin", make(3000));
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Calls `ready` every `every_ms` until it returns true (then true) or `seconds` have passed (then
// false): a bound on a hang, never a timing assertion.
template <typename Ready>
bool poll_until(Ready ready, double seconds, int every_ms = 20) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!ready()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(every_ms));
  }
  return true;
}

// Runs a shell command, capturing its output.
inline CommandResult run_command(const std::string& command) {
  CommandResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Runs the keel binary built with the tests.
inline CommandResult run_keel(const std::string& args) { return run_command(std::string(KEEL_BINARY) + " " + args); }

inline std::string source_path(const std::string& relative) { return std::string(KEEL_SOURCE_DIR) + "/" + relative; }

inline void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Number of lines in s (errors must be one line).
inline int count_lines(const std::string& s) {
  int lines = 0;
  for (char c : s) lines += c == '\n';
  return lines + (!s.empty() && s.back() != '\n');
}

// The tiny random GPT-2 of tests/fixtures (made by tests/reference/gpt2_reference.py), loaded
// through the llm.c importer into a store of small chunks (tensors span several), with the
// fixture's first B x T tokens as a batch.
struct TinyFixture {
  ModelConfig config;
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<GPT> model;
  std::vector<int> inputs, targets;
  int B = 0, T = 0;

  TinyFixture(int batch, int seq) : B(batch), T(seq) {
    const std::string model_path = source_path("tests/fixtures/tiny_gpt2.bin");
    config = read_llmc_model_config(model_path);
    store = std::make_unique<ChunkStore>(4096);
    model = std::make_unique<GPT>(config, *store);
    store->finalize();
    import_llmc(model_path, *store, config);
    const std::vector<uint16_t> tokens = read_token_shard(source_path("tests/fixtures/tiny_tokens.bin"));
    const size_t N = static_cast<size_t>(B) * T;
    if (tokens.size() < N + 1) throw Error("tiny_tokens.bin holds fewer than B*T+1 tokens");
    inputs.assign(tokens.begin(), tokens.begin() + N);
    targets.assign(tokens.begin() + 1, tokens.begin() + N + 1);
    model->allocate(B, T);
  }
  Batch batch(float grad_scale) { return Batch{inputs.data(), targets.data(), B, T, grad_scale}; }
};

// A learnable toy language for end-to-end tests: repeating patterns with 10 % noise, vocabulary
// 64. Writes dir/train.bin (40,000 tokens) and dir/val.bin (5,000 tokens) in llm.c's format.
inline void write_toy_corpus(const std::string& dir) {
  Rng rng(5);
  auto make = [&](size_t n) {
    std::vector<uint16_t> t(n);
    for (size_t i = 0; i < n; ++i) {
      t[i] = static_cast<uint16_t>(rng.uniform() < 0.1 ? rng.below(64) : (i * 7 + i / 13) % 64);
    }
    return t;
  };
  write_token_shard(dir + "/train.bin", make(40000));
  write_token_shard(dir + "/val.bin", make(5000));
}

// dir/toy.toml: a 2-layer, 64-wide model on the toy corpus, `steps` steps of 4 x 32 tokens.
inline void write_toy_config(const std::string& dir, int steps) {
  write_text(dir + "/toy.toml",
             "[model]\npreset = \"tiny\"\nvocab_size = 64\nn_embd = 64\nn_head = 4\nmax_seq_len = 32\n"
             "[train]\nbatch_size = 4\nseq_len = 32\nsteps = " + std::to_string(steps) +
             "\neval_batches = 2\nsample_tokens = 0\nlog_every = 100\n[optim]\nlr = 3e-3\nwarmup_steps = 5\n"
             "[data]\ntrain = \"" + dir + "/train.bin\"\nval = \"" + dir + "/val.bin\"\ntokenizer = \"\"\n"
             "[runtime]\npeak_gflops = 100\n[parallel]\nbucket_bytes = 65536\n");
}

// Why a job of `world` ranks refuses the configuration `sets` (key=value overrides of the
// built-in defaults): the error resolve_job_config throws, or "" when it accepts it.
inline std::string config_refusal(const std::vector<std::string>& sets, int world) {
  try {
    Config c = Config::load("", sets);
    resolve_job_config(c, world);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// The arguments of `keel` that train the toy model (write_toy_config) in dir with `ranks` ranks
// (0 = plain `keel train`, no MPI) and per-rank batch b into dir/run.
inline std::string toy_train_args(const TempDir& dir, int ranks, int b, const std::string& run,
                                  const std::string& extra = "") {
  const std::string args = "train --config " + dir / "toy.toml" + " --set train.batch_size=" + std::to_string(b) +
                           " --set train.run_dir=" + dir / run + " " + extra;
  return ranks == 0 ? args : "launch -n " + std::to_string(ranks) + " -- " + args;
}

// Process ids of the running `keel train --config CONFIG` processes (the ranks of a job), ascending.
inline std::vector<pid_t> keel_train_pids(const std::string& config) {
  const CommandResult r = run_command("pgrep -f '^" + std::string(KEEL_BINARY) + " train --config " + config + "' | sort -n");
  std::vector<pid_t> pids;
  for (size_t p = 0; p < r.output.size();) {
    const size_t e = r.output.find('\n', p);
    if (e > p) pids.push_back(std::stoi(r.output.substr(p, e - p)));
    p = e == std::string::npos ? e : e + 1;
  }
  return pids;
}

// A keel command (usually `keel launch`) running in the background with extra environment variables, its stdout and
// stderr going to a log file.
class KeelJob {
 public:
  KeelJob(const std::vector<std::string>& args, const std::string& log, const std::vector<std::string>& extra_env)
      : log_(log) {
    std::vector<std::string> words = {KEEL_BINARY};
    words.insert(words.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    std::vector<std::string> env(extra_env);
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('=') + 1);
      if (std::none_of(extra_env.begin(), extra_env.end(), [&](const std::string& x) { return x.starts_with(name); })) {
        env.push_back(entry);
      }
    }
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    if (posix_spawn(&pid_, KEEL_BINARY, &actions, nullptr, argv.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
  }
  // A job a failed assertion left running: stop it (the launcher forwards SIGTERM to mpirun,
  // which ends the ranks), and kill it if it does not stop.
  ~KeelJob() {
    if (pid_ <= 0 || exit_code_ >= 0) return;
    ::kill(pid_, SIGTERM);
    if (wait(30) < 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // The launcher's exit code, or -1 while it is still running after `seconds`.
  int wait(double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (;;) {
      int status = 0;
      if (exit_code_ < 0 && ::waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (exit_code_ >= 0 || std::chrono::steady_clock::now() >= until) return exit_code_;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  bool running() { return wait(0) < 0; }
  std::string output() const { return std::filesystem::exists(log_) ? read_text_file(log_) : ""; }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int exit_code_ = -1;
};

}  // namespace keel::testing
