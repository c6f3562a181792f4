#include "ckpt/checkpoint.h"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/env.h"
#include "core/error.h"
#include "core/fileio.h"

namespace keel {

using nlohmann::json;

namespace {

constexpr Plane kSavedPlanes[] = {Plane::param, Plane::adam_m, Plane::adam_v};
constexpr int kZstdLevel = 1;  // fast: checkpoints are written often

const char* plane_key(Plane p) {
  switch (p) {
    case Plane::param: return "param";
    case Plane::adam_m: return "adam_m";
    case Plane::adam_v: return "adam_v";
    case Plane::grad: return "grad";
  }
  return "?";
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

uint64_t checksum(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

json model_json(const ModelConfig& m) {
  return {{"n_layer", m.n_layer},       {"n_head", m.n_head},
          {"n_embd", m.n_embd},         {"vocab_size", m.vocab_size},
          {"padded_vocab_size", m.padded_vocab_size}, {"max_seq_len", m.max_seq_len}};
}

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "/" + b; }

std::string parent_of(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  std::string name = p.filename().string();
  if (name.empty()) return parent_of(p.parent_path().string());
  return p.has_parent_path() ? p.parent_path().string() : ".";
}

std::string name_of(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  const std::string name = p.filename().string();
  return name.empty() ? p.parent_path().filename().string() : name;
}

// "step-00000040" -> (40, 0), "step-00000040.2" -> (40, 2); false if not a checkpoint name.
bool parse_checkpoint_name(const std::string& name, int64_t* step = nullptr, int* attempt = nullptr) {
  auto digits = [](const std::string& s) {
    return !s.empty() && s.size() <= 15 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (name.size() < 13 || name.compare(0, 5, "step-") != 0) return false;
  const size_t dot = name.find('.');
  const std::string number = name.substr(5, dot == std::string::npos ? std::string::npos : dot - 5);
  const std::string rest = dot == std::string::npos ? "" : name.substr(dot);
  if (number.size() < 8) return false;
  if (!digits(number) || (!rest.empty() && (rest[0] != '.' || !digits(rest.substr(1))))) return false;
  if (step != nullptr) *step = std::stoll(number);
  if (attempt != nullptr) *attempt = rest.empty() ? 0 : std::stoi(rest.substr(1));
  return true;
}

bool is_checkpoint_name(const std::string& name) { return parse_checkpoint_name(name); }

// Reads and checks a manifest; format 1 (one file per plane) is rewritten into format 2's records.
json read_manifest(const std::string& dir) {
  Env& env = Env::get();
  const std::string path = dir + "/manifest.json";
  check(env.exists(dir), "checkpoint " + dir + ": not found");
  check(env.exists(path), "checkpoint " + dir + ": no manifest.json (an incomplete checkpoint is not a checkpoint)");
  json m;
  try {
    m = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    throw Error("checkpoint " + path + ": not valid JSON (" + e.what() + ")");
  }
  try {
    const std::string format = m.at("format").get<std::string>();
    check(format == "keel-checkpoint", "checkpoint " + path + ": expected format keel-checkpoint, found " + format);
    const int version = m.at("version").get<int>();
    check(version == 1 || version == kCheckpointFormatVersion,
          "checkpoint " + path + ": expected format version 1 or " + std::to_string(kCheckpointFormatVersion) +
              ", found " + std::to_string(version));
    if (version == 1) {
      const std::string self = name_of(dir);
      for (json& c : m.at("chunks")) {
        json planes = json::object();
        for (Plane p : kSavedPlanes) {
          const std::string file = std::string(plane_key(p)) + ".bin";
          const int64_t offset = c.at("offset").get<int64_t>(), numel = c.at("numel").get<int64_t>();
          const std::string sum = c.at("checksum").at(file).get<std::string>();
          planes[plane_key(p)] = {{"in", self},       {"file", file}, {"at", offset * 4}, {"bytes", numel * 4},
                                  {"enc", "raw"},     {"sum", sum},   {"stored_sum", sum}};
        }
        c["planes"] = planes;
      }
      m["ranks"] = json::array({{{"rank", 0}, {"data", m.at("data")}}});
    }
    m.at("chunks");
    m.at("step");
  } catch (const json::exception& e) {
    throw Error("checkpoint " + path + ": malformed manifest (" + e.what() + ")");
  }
  return m;
}

// Manifests of one root by checkpoint name, read once (bases of XOR records, referenced data).
class ManifestCache {
 public:
  explicit ManifestCache(std::string root) : root_(std::move(root)) {}
  const json& get(const std::string& name) {
    auto it = cache_.find(name);
    if (it != cache_.end()) return it->second;
    const std::string dir = join(root_, name);
    check(Env::get().exists(dir + "/manifest.json"),
          "checkpoint " + dir + ": missing, but a newer checkpoint depends on it");
    return cache_.emplace(name, read_manifest(dir)).first->second;
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
  std::map<std::string, json> cache_;
};

// Reads one stored record {in, file, at, bytes, enc (raw or zstd; xor-zstd gives the XOR delta),
// stored_sum[, sum]} of `numel` floats under checkpoint root `root` into out, verifying the
// stored checksum and, with check_sum, the checksum of the decoded floats. `what` names it.
void read_record(const std::string& root, const json& rec, float* out, size_t numel, const std::string& what,
                 bool check_sum) {
  const std::string path = join(join(root, rec.at("in").get<std::string>()), rec.at("file").get<std::string>());
  const std::string enc = rec.at("enc").get<std::string>();
  const uint64_t at = rec.at("at").get<uint64_t>(), bytes = rec.at("bytes").get<uint64_t>();
  const size_t raw_bytes = numel * sizeof(float);
  std::vector<char> stored;
  try {
    stored = Env::get().read_range(path, at, static_cast<size_t>(bytes));
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (" + what + ")");
  }
  const std::string stored_sum = hex64(checksum(stored.data(), stored.size()));
  check(stored_sum == rec.at("stored_sum").get<std::string>(),
        "checkpoint file " + path + ": " + what + " is corrupt (checksum " + stored_sum + ", manifest says " +
            rec.at("stored_sum").get<std::string>() + ")");
  if (enc == "raw") {
    check(stored.size() == raw_bytes, "checkpoint file " + path + ": " + what + " has " +
                                          std::to_string(stored.size()) + " bytes, expected " +
                                          std::to_string(raw_bytes));
    std::memcpy(out, stored.data(), raw_bytes);
  } else if (enc == "zstd" || enc == "xor-zstd") {
    const size_t n = ZSTD_decompress(out, raw_bytes, stored.data(), stored.size());
    check(!ZSTD_isError(n) && n == raw_bytes, "checkpoint file " + path + ": " + what + " does not decompress (" +
                                                  (ZSTD_isError(n) ? ZSTD_getErrorName(n) : "wrong size") + ")");
  } else {
    throw Error("checkpoint file " + path + ": " + what + " has unknown encoding '" + enc + "'");
  }
  if (check_sum) {
    const std::string sum = hex64(checksum(out, raw_bytes));
    check(sum == rec.at("sum").get<std::string>(), "checkpoint file " + path + ": " + what +
                                                       " decodes to the wrong bytes (checksum " + sum +
                                                       ", manifest says " + rec.at("sum").get<std::string>() + ")");
  }
}

// The residual record of rank `rank` in manifest m (nullptr if it saved none).
const json* residual_record(const json& m, int rank) {
  for (const json& r : m.at("ranks")) {
    if (r.at("rank").get<int>() == rank && r.contains("residual")) return &r.at("residual");
  }
  return nullptr;
}

std::vector<float> read_residual_record(const std::string& root, const json& rec, int rank) {
  std::vector<float> out(rec.at("numel").get<size_t>());
  read_record(root, rec, out.data(), out.size(), "compression residual of rank " + std::to_string(rank), true);
  return out;
}

// Decodes the record of (chunk, plane) of checkpoint `name` into out[0 .. numel), verifying
// stored and decoded checksums. XOR records decode their base first (a chain of at most
// full_every - 1 links).
void decode(ManifestCache& cache, const std::string& name, int chunk, Plane plane, float* out, int64_t numel,
            int depth = 0) {
  check(depth < 10000, "checkpoint " + join(cache.root(), name) + ": XOR chain too long (a cycle?)");
  const json& m = cache.get(name);
  const json& chunks = m.at("chunks");
  check(chunk < static_cast<int>(chunks.size()), "checkpoint " + join(cache.root(), name) + ": no chunk " +
                                                     std::to_string(chunk));
  const json& rec = chunks[chunk].at("planes").at(plane_key(plane));
  const std::string what = "chunk " + std::to_string(chunk) + " " + plane_key(plane);
  const std::string enc = rec.at("enc").get<std::string>();
  if (enc == "xor-zstd") {
    std::vector<float> delta(static_cast<size_t>(numel));
    read_record(cache.root(), rec, delta.data(), static_cast<size_t>(numel), what, false);
    decode(cache, rec.at("base").get<std::string>(), chunk, plane, out, numel, depth + 1);
    uint32_t* o = reinterpret_cast<uint32_t*>(out);
    const uint32_t* d = reinterpret_cast<const uint32_t*>(delta.data());
    for (int64_t i = 0; i < numel; ++i) o[i] ^= d[i];
  } else if (enc == "raw" || enc == "zstd") {
    read_record(cache.root(), rec, out, static_cast<size_t>(numel), what, false);
  } else {
    throw Error("checkpoint " + join(cache.root(), name) + ": " + what + " has unknown encoding '" + enc + "'");
  }
  const std::string path = join(join(cache.root(), rec.at("in").get<std::string>()), rec.at("file").get<std::string>());
  const size_t raw_bytes = static_cast<size_t>(numel) * sizeof(float);
  const std::string sum = hex64(checksum(out, raw_bytes));
  check(sum == rec.at("sum").get<std::string>(), "checkpoint file " + path + ": " + what +
                                                     " decodes to the wrong bytes (checksum " + sum +
                                                     ", manifest says " + rec.at("sum").get<std::string>() + ")");
}

// Checks that a manifest describes this store's layout.
void check_layout(const json& m, const std::string& dir, const ChunkStore& store, const Config& config) {
  const json want = model_json(config.model);
  if (m.at("model") != want || m.at("chunk_bytes").get<int64_t>() != config.store.chunk_bytes) {
    throw Error("checkpoint " + dir + ": written for model " + m.at("model").dump() + " with chunk_bytes " +
                m.at("chunk_bytes").dump() + ", this run has " + want.dump() + " with chunk_bytes " +
                std::to_string(config.store.chunk_bytes));
  }
  const json& chunks = m.at("chunks");
  check(m.at("numel").get<int64_t>() == store.numel() && chunks.size() == store.chunks().size(),
        "checkpoint " + dir + ": expected " + std::to_string(store.chunks().size()) + " chunks of " +
            std::to_string(store.numel()) + " elements, found " + std::to_string(chunks.size()) + " of " +
            m.at("numel").dump());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& c = store.chunks()[i];
    check(chunks[i].at("offset").get<int64_t>() == c.offset && chunks[i].at("numel").get<int64_t>() == c.numel,
          "checkpoint " + dir + ": chunk " + std::to_string(i) + " layout differs from this model's");
  }
}

TrainState load_one(const std::string& dir, ChunkStore& store, const Config& config, LoadMode mode, int world_size) {
  const std::string root = parent_of(dir), name = name_of(dir);
  ManifestCache cache(root);
  const json& m = cache.get(name);
  TrainState state;
  try {
    check_layout(m, dir, store, config);
    if (mode == LoadMode::resume && m.contains("trajectory_hash")) {
      const std::string want = hex64(config.trajectory_hash(world_size));
      const std::string got = m.at("trajectory_hash").get<std::string>();
      check(got == want, "checkpoint " + dir + ": written by a different run (trajectory hash " + got +
                             ", this run " + want + ": model, optimizer, seed or tokens per step differ)");
    }
    state.dir = dir;
    state.step = m.at("step").get<int64_t>();
    state.config_toml = m.at("config").get<std::string>();
    state.peak_gflops = m.value("peak_gflops", 0.0);
    for (const json& r : m.at("ranks")) {
      RankState rs;
      rs.rank = r.at("rank").get<int>();
      rs.data.epoch = r.at("data").at("epoch").get<uint64_t>();
      rs.data.index = r.at("data").at("index").get<uint64_t>();
      if (r.contains("residual")) {
        rs.has_residual = true;
        rs.residual_layout = r.at("residual").at("layout").get<std::string>();
      }
      state.ranks.push_back(rs);
    }
    check(!state.ranks.empty(), "checkpoint " + dir + ": no rank state");
    state.data = state.ranks[0].data;

    const int n = static_cast<int>(store.chunks().size());
    for (Plane p : kSavedPlanes) {
      if (mode == LoadMode::params && p != Plane::param) continue;
      const auto [first, last] = p == Plane::param ? std::pair<int, int>{0, n} : store.moment_chunks();
      for (int c = first; c < last; ++c) {
        const PageLease use = store.use_chunk(c, {}, {p});  // with tiers: loaded into its tier page by page
        std::span<float> out = store.chunk_view(c, p);
        decode(cache, name, c, p, out.data(), static_cast<int64_t>(out.size()));
      }
    }
    const json& chunks = m.at("chunks");
    for (int c = 0; c < n; ++c) store.set_version(c, chunks[c].at("version").get<uint64_t>());
  } catch (const json::exception& e) {
    throw Error("checkpoint " + dir + ": malformed manifest (" + e.what() + ")");
  }
  return state;
}

// Names of the checkpoints `name` needs to be read: itself, where its records live, and the
// bases of its XOR records, transitively.
void needed_by(ManifestCache& cache, const std::string& name, std::set<std::string>& out) {
  if (!out.insert(name).second) return;
  const json& m = cache.get(name);
  for (const json& c : m.at("chunks")) {
    for (const auto& [plane, rec] : c.at("planes").items()) {
      needed_by(cache, rec.at("in").get<std::string>(), out);
      if (rec.contains("base")) needed_by(cache, rec.at("base").get<std::string>(), out);
    }
  }
}

void apply_retention(const std::string& root, int keep) {
  Env& env = Env::get();
  const std::vector<std::string> complete = list_checkpoints(root);
  ManifestCache cache(root);
  std::set<std::string> needed;
  for (size_t i = 0; i < complete.size() && static_cast<int>(i) < keep; ++i) {
    try {
      needed_by(cache, name_of(complete[i]), needed);
    } catch (const Error&) {
      // A kept checkpoint that cannot be resolved is not a reason to delete anything it might need.
      return;
    }
  }
  for (const std::string& entry : env.list_dir(root)) {
    if (!is_checkpoint_name(entry) || needed.count(entry) > 0) continue;
    env.remove(join(root, entry));
  }
}

}  // namespace

std::string checkpoint_name(int64_t step, int attempt) {
  char buf[48];
  if (attempt == 0) {
    std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  } else {
    std::snprintf(buf, sizeof buf, "step-%08lld.%d", static_cast<long long>(step), attempt);
  }
  return buf;
}

int next_checkpoint_attempt(const std::string& root, int64_t step) {
  int next = 0;
  for (const std::string& name : Env::get().list_dir(root)) {
    int64_t s = 0;
    int a = 0;
    if (parse_checkpoint_name(name, &s, &a) && s == step) next = std::max(next, a + 1);
  }
  return next;
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  Env& env = Env::get();
  std::vector<std::pair<std::pair<int64_t, int>, std::string>> found;
  for (const std::string& name : env.list_dir(root)) {
    int64_t step = 0;
    int attempt = 0;
    if (parse_checkpoint_name(name, &step, &attempt) && env.exists(join(join(root, name), "manifest.json"))) {
      found.push_back({{step, attempt}, join(root, name)});
    }
  }
  std::sort(found.rbegin(), found.rend());  // newest (highest step, then latest attempt) first
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

void remove_incomplete_checkpoints(const std::string& root) {
  Env& env = Env::get();
  for (const std::string& name : env.list_dir(root)) {
    if (is_checkpoint_name(name) && !env.exists(join(join(root, name), "manifest.json"))) env.remove(join(root, name));
  }
}

std::vector<std::string> checkpoint_candidates(const std::string& path) {
  std::vector<std::string> all = list_checkpoints(path);
  if (Env::get().exists(path + "/manifest.json")) {
    if (all.empty()) return {path};
    // A root that is itself a checkpoint: format 1 wrote run_dir/ckpt as the checkpoint. It takes
    // its place among the newer step-* ones by step (ties: the step-* one is newer).
    int64_t step = -1;
    try {
      step = read_manifest(path).at("step").get<int64_t>();
    } catch (const std::exception&) {
    }
    size_t at = 0;
    while (at < all.size()) {
      int64_t s = 0;
      if (parse_checkpoint_name(name_of(all[at]), &s) && s < step) break;
      at++;
    }
    all.insert(all.begin() + static_cast<std::ptrdiff_t>(at), path);
  }
  check(!all.empty(), "checkpoint " + path + ": not found (no manifest.json here, no complete step-* directory under it)");
  return all;
}

Config read_checkpoint_config(const std::string& path) {
  const std::string dir = checkpoint_candidates(path).front();
  const json m = read_manifest(dir);
  Config c;
  try {
    c = Config::parse(m.at("config").get<std::string>(), "checkpoint " + dir + " config");
  } catch (const json::exception& e) {
    throw Error("checkpoint " + dir + ": malformed manifest (" + e.what() + ")");
  }
  // The writer's layout (ranks, global batch) does not constrain a reader of the model.
  c.parallel.data = 0;
  c.train.global_batch_size = 0;
  c.resolve();
  return c;
}

TrainState load_checkpoint(const std::string& path, ChunkStore& store, const Config& config, LoadMode mode,
                           int world_size, const std::function<void(const std::string&)>& rejected) {
  const std::vector<std::string> candidates = checkpoint_candidates(path);
  for (size_t i = 0; i < candidates.size(); ++i) {
    try {
      return load_one(candidates[i], store, config, mode, world_size);
    } catch (const Error& e) {
      if (i + 1 == candidates.size()) throw;
      if (rejected) rejected(e.what());
    }
  }
  throw Error("checkpoint " + path + ": no usable checkpoint");
}

int64_t verify_checkpoint(const std::string& path) {
  const std::vector<std::string> dirs = checkpoint_candidates(path);
  int64_t records = 0;
  for (const std::string& dir : dirs) {
    ManifestCache cache(parent_of(dir));
    const std::string name = name_of(dir);
    try {
      const json& chunks = cache.get(name).at("chunks");
      std::vector<float> buf;
      for (size_t c = 0; c < chunks.size(); ++c) {
        buf.resize(chunks[c].at("numel").get<size_t>());
        for (Plane p : kSavedPlanes) {
          decode(cache, name, static_cast<int>(c), p, buf.data(), static_cast<int64_t>(buf.size()));
          records++;
        }
      }
      for (const json& r : cache.get(name).at("ranks")) {
        if (!r.contains("residual")) continue;
        read_residual_record(parent_of(dir), r.at("residual"), r.at("rank").get<int>());
        records++;
      }
    } catch (const json::exception& e) {
      throw Error("checkpoint " + dir + ": malformed manifest (" + e.what() + ")");
    }
  }
  return records;
}

CheckpointInfo describe_checkpoint(const std::string& dir) {
  const json m = read_manifest(dir);
  CheckpointInfo info;
  info.dir = dir;
  info.name = name_of(dir);
  try {
    info.step = m.at("step").get<int64_t>();
    info.version = m.at("version").get<int>();
    info.kind = m.value("kind", "full");
    info.base = m.value("base", "");
    if (m.contains("layout")) {
      info.world = m.at("layout").at("world").get<int>();
      info.zero = m.at("layout").at("zero").get<int>();
    }
    for (const json& c : m.at("chunks")) {
      for (const auto& [plane, rec] : c.at("planes").items()) {
        info.records++;
        info.raw_bytes += static_cast<double>(c.at("numel").get<int64_t>()) * sizeof(float);
        if (rec.at("in").get<std::string>() != info.name) {
          info.elsewhere++;
          continue;
        }
        info.own_bytes += rec.at("bytes").get<double>();
        const std::string enc = rec.at("enc").get<std::string>();
        (enc == "raw" ? info.raw : enc == "zstd" ? info.zstd : info.xor_zstd)++;
      }
    }
  } catch (const json::exception& e) {
    throw Error("checkpoint " + dir + ": malformed manifest (" + e.what() + ")");
  }
  return info;
}


std::vector<float> read_rank_residual(const std::string& dir, int rank) {
  const json m = read_manifest(dir);
  try {
    const json* rec = residual_record(m, rank);
    check(rec != nullptr, "checkpoint " + dir + ": rank " + std::to_string(rank) + " saved no compression residual");
    return read_residual_record(parent_of(dir), *rec, rank);
  } catch (const json::exception& e) {
    throw Error("checkpoint " + dir + ": malformed manifest (" + e.what() + ")");
  }
}

std::vector<float> read_checkpoint_plane(const std::string& dir, Plane plane) {
  ManifestCache cache(parent_of(dir));
  const std::string name = name_of(dir);
  try {
    const json& m = cache.get(name);
    std::vector<float> out(m.at("numel").get<size_t>(), 0.0f);
    const json& chunks = m.at("chunks");
    for (size_t c = 0; c < chunks.size(); ++c) {
      const int64_t offset = chunks[c].at("offset").get<int64_t>(), numel = chunks[c].at("numel").get<int64_t>();
      check(offset >= 0 && offset + numel <= static_cast<int64_t>(out.size()), "checkpoint " + dir + ": bad chunk table");
      decode(cache, name, static_cast<int>(c), plane, out.data() + offset, numel);
    }
    return out;
  } catch (const json::exception& e) {
    throw Error("checkpoint " + dir + ": malformed manifest (" + e.what() + ")");
  }
}

// ---------------------------------------------------------------------------------------------
// Writing

CheckpointWriter::CheckpointWriter(const ChunkStore& store, const CheckpointConfig& config, int rank, int first_chunk,
                                   int last_chunk, bool preallocate)
    : store_(store), config_(config), rank_(rank), first_(first_chunk), last_(last_chunk) {
  const int n = static_cast<int>(store.chunks().size());
  check(0 <= first_ && first_ <= last_ && last_ <= n, "checkpoint writer: bad chunk range");
  const auto [mfirst, mlast] = store.moment_chunks();
  check(first_ >= mfirst && last_ <= mlast, "checkpoint writer: this rank does not hold the moments it must write");
  begin_offset_ = first_ < n ? store.chunks()[first_].offset : store.numel();
  const int64_t end = last_ < n ? store.chunks()[last_].offset : store.numel();
  numel_ = end - begin_offset_;
  if (preallocate && store.residency().always_present()) {  // where pages move, checkpoints stream
    snapshot_.assign(static_cast<size_t>(numel_) * 3, 0.0f);
    if (config_.delta && config_.full_every > 1) base_.assign(snapshot_.size(), 0.0f);
  }
}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

bool CheckpointWriter::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return job_done_;
}

void CheckpointWriter::begin(const std::string& root, int64_t step, const RankState& state, int attempt,
                             std::vector<float>* residual) {
  check(!in_flight_, "checkpoint writer: begin() while the previous checkpoint is not finished");
  if (thread_.joinable()) thread_.join();
  if (root != root_) base_name_.clear();  // a new root has no base to be differential against
  root_ = root;
  step_ = step;
  name_ = checkpoint_name(step, attempt);
  state_ = state;
  check(!state.has_residual || residual != nullptr, "checkpoint writer: residual announced but not given");
  if (state.has_residual) std::swap(residual_, *residual);
  full_ = base_name_.empty() || taken_ % config_.full_every == 0;
  taken_++;
  // The snapshot: this rank's flat range of every saved plane, and the chunks' versions. Where
  // the store's pages move (memory tiers) there is none (the state does not fit in memory by
  // design): the write streams chunk by chunk under leases, synchronously, and changed chunks are
  // stored whole (no XOR against a base copy, which would need the memory too).
  streaming_ = !store_.residency().always_present();
  if (!streaming_) {
    snapshot_.resize(static_cast<size_t>(numel_) * 3);
    for (int i = 0; i < 3; ++i) {
      if (numel_ == 0) break;
      std::span<const float> src = store_.range_view(kSavedPlanes[i], begin_offset_, numel_);
      std::memcpy(snapshot_.data() + static_cast<size_t>(i) * numel_, src.data(), src.size_bytes());
    }
  } else {
    snapshot_.clear();
    base_.clear();
  }
  snapshot_versions_.clear();
  for (int c = first_; c < last_; ++c) snapshot_versions_.push_back(store_.chunks()[c].version);
  in_flight_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_done_ = false;
  }
  if (config_.async && !streaming_) {
    thread_ = std::thread([this] { write_job(); });
  } else {
    write_job();
  }
}

void CheckpointWriter::write_job() {
  const auto t0 = std::chrono::steady_clock::now();
  json part = {{"rank", rank_}, {"name", name_}, {"step", step_}, {"full", full_}, {"base", full_ ? "" : base_name_},
               {"first", first_}, {"last", last_}};
  part["data"] = {{"epoch", state_.data.epoch}, {"index", state_.data.index}};
  try {
    Env& env = Env::get();
    const std::string dir = join(root_, name_);
    const std::string file = "r" + std::to_string(rank_) + ".bin";
    env.create_dirs(dir);
    std::unique_ptr<WritableFile> out = env.create(join(dir, file));
    const json base = base_records_.empty() ? json::object() : json::parse(base_records_);
    json chunks = json::object();
    uint64_t at = 0;
    int records = 0, unchanged = 0, xor_records = 0;
    std::vector<char> packed, packed_xor;
    std::vector<float> delta;
    // Appends one record of n floats: raw, zstd when smaller, or (given the same floats of the
    // last committed checkpoint) XOR against them + zstd when smaller still.
    auto write_record = [&](const float* data, size_t n, const float* xor_base) {
      const size_t raw_bytes = n * sizeof(float);
      const char* stored = reinterpret_cast<const char*>(data);
      size_t stored_bytes = raw_bytes;
      std::string enc = "raw";
      if (config_.compress) {
        packed.resize(ZSTD_compressBound(raw_bytes));
        const size_t z = ZSTD_compress(packed.data(), packed.size(), data, raw_bytes, kZstdLevel);
        if (!ZSTD_isError(z) && z < stored_bytes) {
          stored = packed.data();
          stored_bytes = z;
          enc = "zstd";
        }
      }
      if (xor_base != nullptr) {
        delta.resize(n);
        const uint32_t* x = reinterpret_cast<const uint32_t*>(data);
        const uint32_t* y = reinterpret_cast<const uint32_t*>(xor_base);
        uint32_t* d = reinterpret_cast<uint32_t*>(delta.data());
        for (size_t j = 0; j < n; ++j) d[j] = x[j] ^ y[j];
        packed_xor.resize(ZSTD_compressBound(raw_bytes));
        const size_t z = ZSTD_compress(packed_xor.data(), packed_xor.size(), delta.data(), raw_bytes, kZstdLevel);
        if (!ZSTD_isError(z) && z < stored_bytes) {
          stored = packed_xor.data();
          stored_bytes = z;
          enc = "xor-zstd";
        }
      }
      out->append(stored, stored_bytes);
      json rec = {{"in", name_},
                  {"file", file},
                  {"at", at},
                  {"bytes", stored_bytes},
                  {"enc", enc},
                  {"sum", hex64(checksum(data, raw_bytes))},
                  {"stored_sum", hex64(checksum(stored, stored_bytes))}};
      at += stored_bytes;
      return rec;
    };
    for (int c = first_; c < last_; ++c) {
      const Chunk& chunk = store_.chunks()[c];
      const int k = c - first_;
      json planes = json::object();
      PageLease use;  // streaming: the chunk's planes, fetched from their tiers while written
      if (streaming_ && (full_ || snapshot_versions_[k] != base_versions_[k])) {
        use = store_.use_chunk(c, {kSavedPlanes[0], kSavedPlanes[1], kSavedPlanes[2]});
      }
      for (int i = 0; i < 3; ++i) {
        const Plane p = kSavedPlanes[i];
        const size_t at_chunk = static_cast<size_t>(i) * numel_ + (chunk.offset - begin_offset_);
        records++;
        if (!full_ && snapshot_versions_[k] == base_versions_[k]) {
          // Unchanged since the last checkpoint: point at the bytes already on disk.
          planes[plane_key(p)] = base.at(std::to_string(c)).at("planes").at(plane_key(p));
          unchanged++;
          continue;
        }
        const bool xor_delta = !full_ && config_.delta && !base_.empty();
        const float* data = streaming_ ? store_.chunk_view(c, p).data() : snapshot_.data() + at_chunk;
        json rec = write_record(data, static_cast<size_t>(chunk.numel), xor_delta ? base_.data() + at_chunk : nullptr);
        if (rec.at("enc") == "xor-zstd") {
          rec["base"] = base_name_;
          xor_records++;
        }
        planes[plane_key(p)] = rec;
      }
      chunks[std::to_string(c)] = {{"version", snapshot_versions_[k]}, {"planes", planes}};
    }
    if (state_.has_residual) {
      // Compression residuals: this rank's own state, always written whole (they change every step).
      json rec = write_record(residual_.data(), residual_.size(), nullptr);
      rec["numel"] = residual_.size();
      rec["layout"] = state_.residual_layout;
      part["residual"] = rec;
    }
    out->sync();
    out->close();
    env.sync_dir(dir);
    part["ok"] = true;
    part["chunks"] = chunks;
    part["written_bytes"] = at;
    part["records"] = records;
    part["unchanged"] = unchanged;
    part["xor"] = xor_records;
  } catch (const std::exception& e) {
    part["ok"] = false;
    part["error"] = e.what();
  }
  part["write_ms"] = ms_since(t0);
  std::string text = part.dump();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    part_ = std::move(text);
    job_done_ = true;
  }
  cv_.notify_all();
}

std::string CheckpointWriter::finish() {
  check(in_flight_, "checkpoint writer: finish() without begin()");
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return job_done_; });
  }
  if (thread_.joinable()) thread_.join();
  return part_;
}

void CheckpointWriter::committed(bool ok) {
  in_flight_ = false;
  if (!ok) {
    base_name_.clear();  // the next checkpoint is full
    return;
  }
  const json part = json::parse(part_);
  base_name_ = name_;
  base_records_ = part.at("chunks").dump();
  base_versions_ = snapshot_versions_;
  // XOR deltas are taken against the bytes of the last committed checkpoint.
  if (config_.delta && config_.full_every > 1) {
    std::swap(snapshot_, base_);
  }
}

std::string publish_checkpoint(const std::string& root, const std::vector<std::string>& parts, const ChunkStore& store,
                               const Config& config, int world_size, double peak_gflops, int keep,
                               CheckpointStats* stats) {
  Env& env = Env::get();
  const int n = static_cast<int>(store.chunks().size());
  std::vector<json> ps;
  std::string name;
  for (const std::string& text : parts) {
    ps.push_back(json::parse(text));
    name = ps.back().at("name").get<std::string>();
  }
  const std::string dir = join(root, name);
  std::string failure;
  for (const json& p : ps) {
    if (!p.at("ok").get<bool>() && failure.empty()) {
      failure = "rank " + std::to_string(p.at("rank").get<int>()) + ": " + p.at("error").get<std::string>();
    }
  }
  CheckpointStats s;
  s.name = name;
  s.full = ps.at(0).at("full").get<bool>();
  for (const json& p : ps) s.write_ms = std::max(s.write_ms, p.at("write_ms").get<double>());
  if (failure.empty()) {
    try {
      json chunks = json::array();
      json ranks = json::array();
      json writers = json::array();
      std::vector<const json*> records(static_cast<size_t>(n), nullptr);
      for (const json& p : ps) {
        json rank = {{"rank", p.at("rank")}, {"data", p.at("data")}};
        if (p.contains("residual")) {
          rank["residual"] = p.at("residual");
          s.raw_bytes += p.at("residual").at("numel").get<double>() * sizeof(float);
        }
        ranks.push_back(rank);
        writers.push_back({p.at("first"), p.at("last")});
        for (const auto& [key, value] : p.at("chunks").items()) {
          const int c = std::stoi(key);
          check(c >= 0 && c < n && records[c] == nullptr, "chunk " + key + " written twice or out of range");
          records[c] = &value;
        }
        s.written_bytes += p.at("written_bytes").get<double>();
        s.records += p.at("records").get<int>();
        s.unchanged += p.at("unchanged").get<int>();
        s.xor_records += p.at("xor").get<int>();
      }
      for (const Chunk& c : store.chunks()) {
        check(records[c.id] != nullptr, "chunk " + std::to_string(c.id) + " written by no rank");
        json tensors = json::array();
        for (const Segment& seg : c.segments) {
          tensors.push_back({store.tensors()[seg.tensor].spec.name, seg.tensor_offset, seg.numel, seg.offset - c.offset});
        }
        chunks.push_back({{"id", c.id},
                          {"layer", c.layer},
                          {"kind", kind_name(c.kind)},
                          {"version", records[c.id]->at("version")},
                          {"offset", c.offset},
                          {"numel", c.numel},
                          {"tensors", tensors},
                          {"planes", records[c.id]->at("planes")}});
        s.raw_bytes += 3.0 * static_cast<double>(c.numel) * sizeof(float);
      }
      json manifest = {{"format", "keel-checkpoint"},
                       {"version", kCheckpointFormatVersion},
                       {"name", name},
                       {"step", ps[0].at("step")},
                       {"kind", s.full ? "full" : "diff"},
                       {"base", ps[0].at("base")},
                       {"shape_hash", hex64(config.shape_hash())},
                       {"trajectory_hash", hex64(config.trajectory_hash(world_size))},
                       {"model", model_json(config.model)},
                       {"chunk_bytes", config.store.chunk_bytes},
                       {"numel", store.numel()},
                       {"layout", {{"world", world_size}, {"zero", config.parallel.zero}, {"writers", writers}}},
                       {"ranks", ranks},
                       {"peak_gflops", peak_gflops},
                       {"sizes", {{"raw_bytes", s.raw_bytes}, {"written_bytes", s.written_bytes}}},
                       {"config", config.to_toml()},
                       {"chunks", chunks}};
      const std::string text = manifest.dump(1);
      write_file_atomic(join(dir, "manifest.json"), {ByteRange{text.data(), text.size()}});
      env.sync_dir(dir);
      env.sync_dir(root);
    } catch (const std::exception& e) {
      failure = e.what();
      try {
        env.remove(join(dir, "manifest.json"));
      } catch (const Error&) {
      }
    }
  }
  if (!failure.empty()) {
    try {
      env.remove(dir);
    } catch (const Error&) {
    }
  } else {
    apply_retention(root, keep);
  }
  if (stats != nullptr) *stats = s;
  return failure;
}

std::string save_checkpoint(const std::string& root, const ChunkStore& store, const Config& config,
                            const RankState& state, int64_t step, double peak_gflops) {
  CheckpointConfig cc = config.checkpoint;
  cc.async = false;
  CheckpointWriter writer(store, cc, 0, 0, static_cast<int>(store.chunks().size()));
  remove_incomplete_checkpoints(root);
  writer.begin(root, step, state, next_checkpoint_attempt(root, step));
  const std::string part = writer.finish();
  const std::string failure = publish_checkpoint(root, {part}, store, config, 1, peak_gflops, cc.keep, nullptr);
  check(failure.empty(), "checkpoint " + join(root, writer.name()) + ": not written: " + failure);
  writer.committed(true);
  return join(root, writer.name());
}

}  // namespace keel
