#include "ckpt/checkpoint.h"

#include <xxhash.h>
#include <zstd.h>

#include <algorithm>
#include <map>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/env.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace {

constexpr int kZstdLevel = 1;  // fast: checkpoints are written often

uint64_t checksum(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

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

// A manifest speaks for the directory it lies in only under its own name: one copied into another
// step's directory would otherwise pass for that step. (A format-1 root, run_dir/ckpt, has no
// checkpoint name to match.)
void check_named_as(const Manifest& m, const std::string& dir) {
  const std::string name = name_of(dir);
  int64_t step = 0;
  if (!parse_checkpoint_name(name, &step)) return;
  check(m.name == name && m.step == step, "checkpoint " + dir + ": its manifest is that of " + m.name + " (step " +
                                              std::to_string(m.step) + "), not of " + name +
                                              ": copied from another checkpoint");
}

// Manifests of one root by checkpoint name, read once (bases of XOR records, referenced data).
class ManifestCache {
 public:
  explicit ManifestCache(std::string root) : root_(std::move(root)) {}
  const Manifest& get(const std::string& name) {
    auto it = cache_.find(name);
    if (it != cache_.end()) return it->second;
    const std::string dir = join(root_, name);
    check(Env::get().exists(dir + "/manifest.json"),
          "checkpoint " + dir + ": missing, but a newer checkpoint depends on it");
    Manifest m = read_manifest(dir);
    check_named_as(m, dir);
    return cache_.emplace(name, std::move(m)).first->second;
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
  std::map<std::string, Manifest> cache_;
};

// Reads one stored record of `numel` floats under checkpoint root `root` into out, verifying the
// stored checksum and, with check_sum, the checksum of the decoded floats (an xor_zstd record
// decodes to its XOR delta). `what` names it.
void read_record(const std::string& root, const Record& rec, float* out, size_t numel, const std::string& what,
                 bool check_sum) {
  const std::string path = join(join(root, rec.in), rec.file);
  const size_t raw_bytes = numel * sizeof(float);
  std::vector<char> stored;
  try {
    stored = Env::get().read_range(path, rec.at, static_cast<size_t>(rec.bytes));
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (" + what + ")");
  }
  const uint64_t stored_sum = checksum(stored.data(), stored.size());
  check(stored_sum == rec.stored_sum, "checkpoint file " + path + ": " + what + " is corrupt (checksum " +
                                          hex64(stored_sum) + ", manifest says " + hex64(rec.stored_sum) + ")");
  if (rec.enc == Encoding::raw) {
    check(stored.size() == raw_bytes, "checkpoint file " + path + ": " + what + " has " +
                                          std::to_string(stored.size()) + " bytes, expected " +
                                          std::to_string(raw_bytes));
    std::memcpy(out, stored.data(), raw_bytes);
  } else {
    const size_t n = ZSTD_decompress(out, raw_bytes, stored.data(), stored.size());
    check(!ZSTD_isError(n) && n == raw_bytes, "checkpoint file " + path + ": " + what + " does not decompress (" +
                                                  (ZSTD_isError(n) ? ZSTD_getErrorName(n) : "wrong size") + ")");
  }
  if (check_sum) {
    const uint64_t sum = checksum(out, raw_bytes);
    check(sum == rec.sum, "checkpoint file " + path + ": " + what + " decodes to the wrong bytes (checksum " +
                              hex64(sum) + ", manifest says " + hex64(rec.sum) + ")");
  }
}

// The residual (or carried state) record of rank `rank` in manifest m (nullptr if it saved none).
const ResidualRecord* residual_record(const Manifest& m, int rank, bool carried = false) {
  for (const ManifestRank& r : m.ranks) {
    const std::optional<ResidualRecord>& rec = carried ? r.carried : r.residual;
    if (r.rank == rank && rec) return &*rec;
  }
  return nullptr;
}

const char* rank_record_name(bool carried) { return carried ? "carried step state" : "compression residual"; }

std::vector<float> read_residual_record(const std::string& root, const ResidualRecord& rec, int rank,
                                        bool carried = false) {
  std::vector<float> out(rec.numel);
  read_record(root, rec.record, out.data(), out.size(),
              std::string(rank_record_name(carried)) + " of rank " + std::to_string(rank), true);
  return out;
}

// Rank `rank`'s residual (or carried state) in checkpoint directory `dir`, verified.
std::vector<float> read_rank_record(const std::string& dir, int rank, bool carried) {
  const Manifest m = read_manifest(dir);
  const ResidualRecord* rec = residual_record(m, rank, carried);
  check(rec != nullptr, "checkpoint " + dir + ": rank " + std::to_string(rank) + " saved no " + rank_record_name(carried));
  return read_residual_record(parent_of(dir), *rec, rank, carried);
}

// Decodes the record of (chunk, plane) of checkpoint `name` into out[0 .. numel), verifying
// stored and decoded checksums. XOR records decode their base first (a chain of at most
// full_every - 1 links).
void decode(ManifestCache& cache, const std::string& name, int chunk, int plane, float* out, int64_t numel,
            int depth = 0) {
  check(depth < 10000, "checkpoint " + join(cache.root(), name) + ": XOR chain too long (a cycle?)");
  const Manifest& m = cache.get(name);
  check(chunk < static_cast<int>(m.chunks.size()), "checkpoint " + join(cache.root(), name) + ": no chunk " +
                                                       std::to_string(chunk));
  const Record& rec = m.chunks[chunk].records.planes[plane];
  const std::string what = "chunk " + std::to_string(chunk) + " " + saved_plane_key(kSavedPlanes[plane]);
  if (rec.enc == Encoding::xor_zstd) {
    std::vector<float> delta(static_cast<size_t>(numel));
    read_record(cache.root(), rec, delta.data(), static_cast<size_t>(numel), what, false);
    decode(cache, rec.base, chunk, plane, out, numel, depth + 1);
    uint32_t* o = reinterpret_cast<uint32_t*>(out);
    const uint32_t* d = reinterpret_cast<const uint32_t*>(delta.data());
    for (int64_t i = 0; i < numel; ++i) o[i] ^= d[i];
  } else {
    read_record(cache.root(), rec, out, static_cast<size_t>(numel), what, false);
  }
  const std::string path = join(join(cache.root(), rec.in), rec.file);
  const uint64_t sum = checksum(out, static_cast<size_t>(numel) * sizeof(float));
  check(sum == rec.sum, "checkpoint file " + path + ": " + what + " decodes to the wrong bytes (checksum " +
                            hex64(sum) + ", manifest says " + hex64(rec.sum) + ")");
}

// Checks that a manifest describes this model (shape and chunk size); returns whether its chunks
// are this store's chunks (else the store is another layout of the same model: a pipeline stage,
// or one rank loading what stages wrote, loaded tensor by tensor).
bool check_layout(const Manifest& m, const std::string& dir, const ChunkStore& store, const Config& config) {
  const ModelShape want = ModelShape::of(config.model);
  if (m.model != want || m.chunk_bytes != config.store.chunk_bytes) {
    throw Error("checkpoint " + dir + ": written for model " + m.model.describe() + " with chunk_bytes " +
                std::to_string(m.chunk_bytes) + ", this run has " + want.describe() + " with chunk_bytes " +
                std::to_string(config.store.chunk_bytes));
  }
  if (m.numel != store.numel() || m.chunks.size() != store.chunks().size()) return false;
  for (size_t i = 0; i < m.chunks.size(); ++i) {
    const Chunk& c = store.chunks()[i];
    if (m.chunks[i].offset != c.offset || m.chunks[i].numel != c.numel) return false;
    if (!c.segments.empty() && (m.chunks[i].tensors.empty() ||
                                m.chunks[i].tensors.front().name != store.tensors()[c.segments.front().tensor].spec.name)) {
      return false;
    }
  }
  return true;
}

// One plane of the store's chunks [first, last) from a checkpoint of another layout of the same
// model, tensor by tensor: every piece of a local tensor is found by name and offset among the
// manifest's chunks. Returns, per local chunk, the newest version of the chunks it drew from.
std::vector<uint64_t> load_by_tensor(ManifestCache& cache, const std::string& name, const std::string& dir,
                                     ChunkStore& store, int plane, int first, int last) {
  const Manifest& m = cache.get(name);
  struct Piece {
    int64_t tensor_offset, numel, chunk_offset;
    int chunk;
  };
  std::map<std::string, std::vector<Piece>> pieces;  // by tensor name, in tensor order
  for (size_t c = 0; c < m.chunks.size(); ++c) {
    for (const TensorPiece& t : m.chunks[c].tensors) {
      pieces[t.name].push_back(Piece{t.tensor_offset, t.numel, t.chunk_offset, static_cast<int>(c)});
    }
  }
  for (auto& [n, list] : pieces) {
    std::sort(list.begin(), list.end(), [](const Piece& a, const Piece& b) { return a.tensor_offset < b.tensor_offset; });
  }
  const Plane p = kSavedPlanes[plane];
  std::vector<uint64_t> versions(store.chunks().size(), 0);
  int decoded_chunk = -1;
  std::vector<float> decoded;
  for (int c = first; c < last; ++c) {
    const Chunk& chunk = store.chunks()[c];
    const PageLease use = store.use_chunk(c, {}, {p});
    float* out = store.chunk_view(c, p).data();
    for (const Segment& seg : chunk.segments) {
      const std::string& tensor = store.tensors()[seg.tensor].spec.name;
      const auto it = pieces.find(tensor);
      check(it != pieces.end(), "checkpoint " + dir + ": holds no tensor '" + tensor + "'");
      int64_t at = seg.tensor_offset;  // next element of the segment to fill, in tensor order
      const int64_t end = seg.tensor_offset + seg.numel;
      for (const Piece& piece : it->second) {
        if (at >= end) break;
        const int64_t lo = std::max(at, piece.tensor_offset), hi = std::min(end, piece.tensor_offset + piece.numel);
        if (hi <= lo) continue;
        check(lo == at, "checkpoint " + dir + ": tensor '" + tensor + "' has a gap at element " + std::to_string(at));
        if (piece.chunk != decoded_chunk) {
          decoded.resize(static_cast<size_t>(m.chunks[piece.chunk].numel));
          decode(cache, name, piece.chunk, plane, decoded.data(), static_cast<int64_t>(decoded.size()));
          decoded_chunk = piece.chunk;
        }
        std::copy_n(decoded.data() + piece.chunk_offset + (lo - piece.tensor_offset), hi - lo,
                    out + (seg.offset - chunk.offset) + (lo - seg.tensor_offset));
        versions[c] = std::max(versions[c], m.chunks[piece.chunk].records.version);
        at = hi;
      }
      check(at == end, "checkpoint " + dir + ": tensor '" + tensor + "' ends at element " + std::to_string(at) +
                           ", this model's needs " + std::to_string(end));
    }
  }
  return versions;
}

TrainState load_one(const std::string& dir, ChunkStore& store, const Config& config, LoadMode mode, int world_size) {
  const std::string root = parent_of(dir), name = name_of(dir);
  ManifestCache cache(root);
  const Manifest& m = cache.get(name);
  const bool same_chunks = check_layout(m, dir, store, config);
  if (mode == LoadMode::resume && !m.trajectory_hash.empty()) {
    const std::string want = hex64(config.trajectory_hash(world_size));
    check(m.trajectory_hash == want, "checkpoint " + dir + ": written by a different run (trajectory hash " +
                                         m.trajectory_hash + ", this run " + want +
                                         ": model, optimizer, seed or tokens per step differ)");
  }
  TrainState state;
  state.dir = dir;
  state.step = m.step;
  state.config_toml = m.config_toml;
  for (const ManifestRank& r : m.ranks) {
    RankState rs;
    rs.rank = r.rank;
    rs.data = r.data;
    if (r.residual) {
      rs.has_residual = true;
      rs.residual_layout = r.residual->layout;
      rs.residual_keys = r.residual->keys;
    }
    if (r.carried) {
      rs.has_carried = true;
      rs.carried_layout = r.carried->layout;
    }
    state.ranks.push_back(rs);
  }
  check(!state.ranks.empty(), "checkpoint " + dir + ": no rank state");
  state.data = state.ranks[0].data;

  const int n = static_cast<int>(store.chunks().size());
  std::vector<uint64_t> versions;
  for (int i = 0; i < kNumSavedPlanes; ++i) {
    const Plane p = kSavedPlanes[i];
    if (mode == LoadMode::params && p != Plane::param) continue;
    // Only what this store is the home of (ZeRO: a rank's moment shard; ZeRO-3: its parameter shard too).
    const auto [first, last] = p == Plane::param ? store.param_chunks() : store.moment_chunks();
    if (!same_chunks) {
      const std::vector<uint64_t> v = load_by_tensor(cache, name, dir, store, i, first, last);
      if (p == Plane::param) versions = v;
      continue;
    }
    for (int c = first; c < last; ++c) {
      const PageLease use = store.use_chunk(c, {}, {p});  // where pages move: loaded page by page
      std::span<float> out = store.chunk_view(c, p);
      decode(cache, name, c, i, out.data(), static_cast<int64_t>(out.size()));
    }
  }
  for (int c = 0; c < n; ++c) store.set_version(c, same_chunks ? m.chunks[c].records.version : versions[c]);
  return state;
}

// Names of the checkpoints `name` needs to be read: itself, where its records live, and the
// bases of its XOR records, transitively.
void needed_by(ManifestCache& cache, const std::string& name, std::set<std::string>& out) {
  if (!out.insert(name).second) return;
  const Manifest& m = cache.get(name);
  for (const ManifestChunk& c : m.chunks) {
    for (const Record& rec : c.records.planes) {
      needed_by(cache, rec.in, out);
      if (rec.enc == Encoding::xor_zstd) needed_by(cache, rec.base, out);
    }
  }
}

// Keeps the newest `keep` complete checkpoints of run `run_id`, the one just published
// (`published`: even when older ones of a higher step are there) and everything they reference;
// removes that run's others. Only complete checkpoints whose manifest names the run (or names none:
// written before runs had ids, in this root) are ever removed: another run's checkpoint, one whose
// manifest cannot be read, a directory without a manifest and a file are not this run's to delete.
void apply_retention(const std::string& root, int keep, const std::string& published, const std::string& run_id) {
  Env& env = Env::get();
  ManifestCache cache(root);
  std::vector<std::string> own;  // newest first
  for (const std::string& dir : list_checkpoints(root)) {
    try {
      const std::string& writer = cache.get(name_of(dir)).run_id;
      if (writer.empty() || writer == run_id) own.push_back(name_of(dir));
    } catch (const Error&) {
    }
  }
  std::set<std::string> needed;
  try {
    for (size_t i = 0; i < own.size() && static_cast<int>(i) < keep; ++i) needed_by(cache, own[i], needed);
    needed_by(cache, published, needed);
  } catch (const Error&) {
    // A kept checkpoint that cannot be resolved is not a reason to delete anything it might need.
    return;
  }
  for (const std::string& name : own) {
    if (needed.count(name) == 0) env.remove(join(root, name));
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

std::string run_marker(const std::string& run_id) { return "run-" + run_id; }

IncompleteCheckpoints remove_interrupted_checkpoints(const std::string& root, const std::string& run_id) {
  namespace fs = std::filesystem;
  Env& env = Env::get();
  const std::vector<std::string> complete = list_checkpoints(root);
  int64_t newest_step = -1;
  int newest_attempt = 0;
  if (!complete.empty()) parse_checkpoint_name(name_of(complete.front()), &newest_step, &newest_attempt);
  IncompleteCheckpoints out;
  for (const std::string& name : env.list_dir(root)) {
    int64_t step = 0;
    int attempt = 0;
    const std::string dir = join(root, name);
    if (!parse_checkpoint_name(name, &step, &attempt) || env.exists(join(dir, "manifest.json"))) continue;
    // Why it is not positively this run's interrupted write ("" = it is).
    std::string why;
    std::error_code ec;
    if (!fs::is_directory(fs::symlink_status(dir, ec))) {
      why = "not a directory";
    } else if (std::make_pair(step, attempt) <= std::make_pair(newest_step, newest_attempt)) {
      why = "older than the newest complete checkpoint " + name_of(complete.front());
    } else {
      const std::vector<std::string> entries = env.list_dir(dir);
      bool marked = false;
      for (const std::string& e : entries) {
        const bool data = e.size() > 5 && e[0] == 'r' && e.ends_with(".bin") &&
                          std::all_of(e.begin() + 1, e.end() - 4, [](char c) { return c >= '0' && c <= '9'; });
        if (e.starts_with("run-")) {
          if (run_id.empty() || e != run_marker(run_id)) why = "written by another run (" + e + ")";
          marked = true;
        } else if (!data && e != "manifest.json.tmp" && why.empty()) {
          why = "holds " + e + ", which no checkpoint writer writes";
        }
      }
      if (why.empty() && !marked && !entries.empty()) why = "no mark of this run's writer (" + run_marker(run_id) + ")";
    }
    if (!why.empty()) {
      out.kept.emplace_back(name, why);
      continue;
    }
    env.remove(dir);
    out.removed.push_back(name);
  }
  return out;
}

std::vector<std::string> checkpoint_candidates(const std::string& path) {
  std::vector<std::string> all = list_checkpoints(path);
  if (Env::get().exists(path + "/manifest.json")) {
    if (all.empty()) return {path};
    // A root that is itself a checkpoint: format 1 wrote run_dir/ckpt as the checkpoint. It takes
    // its place among the newer step-* ones by step (ties: the step-* one is newer).
    int64_t step = -1;
    try {
      step = read_manifest(path).step;
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
  Config c = Config::parse(read_manifest(dir).config_toml, "checkpoint " + dir + " config");
  // The writer's layout (ranks, pipeline, global batch) does not constrain a reader of the model.
  c.parallel.data = 0;
  c.parallel.pipeline = 1;
  c.parallel.tensor = 1;  // (a tensor-parallel run's checkpoint holds the whole model's layout)
  c.parallel.sequence_parallel = false;  // (a property of the tensor group's passes)
  c.parallel.context = 1;  // (every rank of a context-parallel run holds the whole model)
  c.parallel.micro_batches = 0;
  c.parallel.stage_boundaries.clear();
  c.parallel.virtual_stages = 0;
  c.train.global_batch_size = 0;
  c.resolve();
  return c;
}

void clear_loaded_state(ChunkStore& store) {
  const auto [first, last] = store.moment_chunks();
  for (int c = first; c < last; ++c) {
    const Chunk& chunk = store.chunks()[c];
    for (Plane p : {Plane::adam_m, Plane::adam_v}) store.discard(p, chunk.offset, chunk.numel);
  }
  for (const Chunk& c : store.chunks()) store.set_version(c.id, 0);
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
    const Manifest& m = cache.get(name);
    std::vector<float> buf;
    for (size_t c = 0; c < m.chunks.size(); ++c) {
      buf.resize(static_cast<size_t>(m.chunks[c].numel));
      for (int i = 0; i < kNumSavedPlanes; ++i) {
        decode(cache, name, static_cast<int>(c), i, buf.data(), static_cast<int64_t>(buf.size()));
        records++;
      }
    }
    for (const ManifestRank& r : m.ranks) {
      for (const bool carried : {false, true}) {
        const std::optional<ResidualRecord>& rec = carried ? r.carried : r.residual;
        if (!rec) continue;
        read_residual_record(parent_of(dir), *rec, r.rank, carried);
        records++;
      }
    }
  }
  return records;
}

CheckpointInfo describe_checkpoint(const std::string& dir) {
  const Manifest m = read_manifest(dir);
  check_named_as(m, dir);
  CheckpointInfo info;
  info.dir = dir;
  info.name = name_of(dir);
  info.step = m.step;
  info.version = m.version;
  info.kind = m.kind;
  info.base = m.base;
  info.world = m.world;
  info.zero = m.zero;
  for (const ManifestChunk& c : m.chunks) {
    for (const Record& rec : c.records.planes) {
      info.records++;
      info.raw_bytes += static_cast<double>(c.numel) * sizeof(float);
      if (rec.in != info.name) {
        info.elsewhere++;
        continue;
      }
      info.own_bytes += static_cast<double>(rec.bytes);
      (rec.enc == Encoding::raw ? info.raw : rec.enc == Encoding::zstd ? info.zstd : info.xor_zstd)++;
    }
  }
  return info;
}

std::vector<float> read_rank_residual(const std::string& dir, int rank) { return read_rank_record(dir, rank, false); }

std::vector<float> read_rank_carried(const std::string& dir, int rank) { return read_rank_record(dir, rank, true); }

std::vector<float> read_checkpoint_plane(const std::string& dir, Plane plane) {
  ManifestCache cache(parent_of(dir));
  const std::string name = name_of(dir);
  const Manifest& m = cache.get(name);
  int index = -1;
  for (int i = 0; i < kNumSavedPlanes; ++i) {
    if (kSavedPlanes[i] == plane) index = i;
  }
  check(index >= 0, std::string("checkpoint ") + dir + ": plane " + saved_plane_key(plane) + " is not saved");
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(m.numel, 0)), 0.0f);
  for (size_t c = 0; c < m.chunks.size(); ++c) {
    const int64_t offset = m.chunks[c].offset, numel = m.chunks[c].numel;
    check(offset >= 0 && numel >= 0 && offset + numel <= static_cast<int64_t>(out.size()),
          "checkpoint " + dir + ": bad chunk table");
    decode(cache, name, static_cast<int>(c), index, out.data() + offset, numel);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writing

CheckpointWriter::CheckpointWriter(const ChunkStore& store, const CheckpointConfig& config, int rank, int first_chunk,
                                   int last_chunk, bool preallocate, std::vector<ChunkTarget> targets, bool stream)
    : store_(store),
      config_(config),
      rank_(rank),
      first_(first_chunk),
      last_(last_chunk),
      stream_(stream),
      targets_(std::move(targets)) {
  const int n = static_cast<int>(store.chunks().size());
  check(0 <= first_ && first_ <= last_ && last_ <= n, "checkpoint writer: bad chunk range");
  check(targets_.empty() || targets_.size() == static_cast<size_t>(n), "checkpoint writer: targets for another store");
  const auto [mfirst, mlast] = store.moment_chunks();
  // (With targets, only the chunks it writes: a rank's sharded experts under ZeRO own chunks
  // spread over the store.)
  bool held = first_ >= mfirst && last_ <= mlast;
  if (!held && !targets_.empty() && stream_) {
    held = true;
    for (int c = first_; c < last_; ++c) held = held && (targets_[c].id < 0 || (c >= mfirst && c < mlast));
  }
  check(held, "checkpoint writer: this rank does not hold the moments it must write");
  begin_offset_ = first_ < n ? store.chunks()[first_].offset : store.numel();
  const int64_t end = last_ < n ? store.chunks()[last_].offset : store.numel();
  numel_ = end - begin_offset_;
  if (preallocate && !streams()) {  // where pages move (or under ZeRO-3), checkpoints stream
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
                             std::vector<float>* residual, std::vector<float>* carried) {
  check(!in_flight_, "checkpoint writer: begin() while the previous checkpoint is not finished");
  if (thread_.joinable()) thread_.join();
  if (root != root_) base_name_.clear();  // a new root has no base to be differential against
  root_ = root;
  step_ = step;
  name_ = checkpoint_name(step, attempt);
  state_ = state;
  check(!state.has_residual || residual != nullptr, "checkpoint writer: residual announced but not given");
  if (state.has_residual) std::swap(residual_, *residual);
  check(!state.has_carried || carried != nullptr, "checkpoint writer: carried state announced but not given");
  if (state.has_carried) std::swap(carried_, *carried);
  full_ = base_name_.empty() || taken_ % config_.full_every == 0;
  taken_++;
  // The snapshot: this rank's flat range of every saved plane, and the chunks' versions. Where
  // the store's pages move (memory tiers), or under ZeRO-3, there is none (the state does not fit
  // in memory twice by design): the write streams chunk by chunk under leases, synchronously (a
  // rank holds its own chunks, what it writes, plus one chunk's encoding buffer), and changed
  // chunks are stored whole (no XOR against a base copy, which would need the memory too).
  streaming_ = streams();
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
  CheckpointPart part;
  part.rank = rank_;
  part.name = name_;
  part.step = step_;
  part.full = full_;
  part.base = full_ ? "" : base_name_;
  part.first = first_;
  part.last = last_;
  part.data = state_.data;
  std::vector<ChunkRecords> written;  // by chunk of [first, last), for the next differential one
  try {
    Env& env = Env::get();
    const std::string dir = join(root_, name_);
    const std::string file = "r" + std::to_string(rank_) + ".bin";
    // The directory and the run's mark in it, before any data (one operation): what lets this run
    // know an incomplete directory as its own interrupted write (remove_interrupted_checkpoints).
    env.create_dirs(run_id_.empty() ? dir : join(dir, run_marker(run_id_)));
    std::unique_ptr<WritableFile> out = env.create(join(dir, file));
    uint64_t at = 0;
    std::vector<char> packed, packed_xor;
    std::vector<float> delta;
    // Appends one record of n floats: raw, zstd when smaller, or (given the same floats of the
    // last committed checkpoint) XOR against them + zstd when smaller still.
    auto write_record = [&](const float* data, size_t n, const float* xor_base) {
      const size_t raw_bytes = n * sizeof(float);
      const char* stored = reinterpret_cast<const char*>(data);
      size_t stored_bytes = raw_bytes;
      Record rec;
      rec.enc = Encoding::raw;
      if (config_.compress) {
        packed.resize(ZSTD_compressBound(raw_bytes));
        const size_t z = ZSTD_compress(packed.data(), packed.size(), data, raw_bytes, kZstdLevel);
        if (!ZSTD_isError(z) && z < stored_bytes) {
          stored = packed.data();
          stored_bytes = z;
          rec.enc = Encoding::zstd;
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
          rec.enc = Encoding::xor_zstd;
          rec.base = base_name_;
        }
      }
      out->append(stored, stored_bytes);
      rec.in = name_;
      rec.file = file;
      rec.at = at;
      rec.bytes = stored_bytes;
      rec.sum = checksum(data, raw_bytes);
      rec.stored_sum = checksum(stored, stored_bytes);
      at += stored_bytes;
      return rec;
    };
    written.assign(static_cast<size_t>(last_ - first_), ChunkRecords{});
    for (int c = first_; c < last_; ++c) {
      const Chunk& chunk = store_.chunks()[c];
      const int k = c - first_;
      const int id = targets_.empty() ? c : targets_[c].id;
      if (id < 0) continue;  // saved by the rank that holds the tensor's home
      const size_t numel = static_cast<size_t>(targets_.empty() ? chunk.numel : targets_[c].numel);
      const bool unchanged = !full_ && snapshot_versions_[k] == base_versions_[k];
      ChunkRecords records;
      records.version = snapshot_versions_[k];
      PageLease use;  // streaming: the chunk's planes, acquired while they are written
      if (streaming_ && !unchanged) use = store_.use_chunk(c, {kSavedPlanes[0], kSavedPlanes[1], kSavedPlanes[2]});
      for (int i = 0; i < kNumSavedPlanes; ++i) {
        const Plane p = kSavedPlanes[i];
        const size_t at_chunk = static_cast<size_t>(i) * numel_ + (chunk.offset - begin_offset_);
        part.records++;
        if (unchanged) {
          // Unchanged since the last checkpoint: point at the bytes already on disk.
          records.planes[i] = base_records_.at(static_cast<size_t>(k)).planes[i];
          part.unchanged++;
          continue;
        }
        const bool xor_delta = !full_ && config_.delta && !base_.empty();
        const float* data = streaming_ ? store_.chunk_view(c, p).data() : snapshot_.data() + at_chunk;
        records.planes[i] = write_record(data, numel, xor_delta ? base_.data() + at_chunk : nullptr);
        if (records.planes[i].enc == Encoding::xor_zstd) part.xor_records++;
      }
      written[k] = records;
      part.chunks.emplace_back(id, std::move(records));
    }
    std::sort(part.chunks.begin(), part.chunks.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    if (!targets_.empty()) {  // the range of the checkpoint's chunks it wrote
      part.first = part.chunks.empty() ? 0 : part.chunks.front().first;
      part.last = part.chunks.empty() ? 0 : part.chunks.back().first + 1;
    }
    if (state_.has_residual) {
      // Compression residuals: this rank's own state, always written whole (they change every step).
      ResidualRecord rec;
      rec.record = write_record(residual_.data(), residual_.size(), nullptr);
      rec.numel = residual_.size();
      rec.layout = state_.residual_layout;
      rec.keys = state_.residual_keys;
      part.residual = std::move(rec);
    }
    if (state_.has_carried) {
      // The step engine's carried state: the same, whole every time.
      ResidualRecord rec;
      rec.record = write_record(carried_.data(), carried_.size(), nullptr);
      rec.numel = carried_.size();
      rec.layout = state_.carried_layout;
      part.carried = std::move(rec);
    }
    out->sync();
    out->close();
    env.sync_dir(dir);
    part.ok = true;
    part.written_bytes = at;
  } catch (const std::exception& e) {
    part.ok = false;
    part.error = e.what();
    part.chunks.clear();
    part.residual.reset();
    part.carried.reset();
  }
  part.write_ms = ms_since(t0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    part_ = std::move(part);
    written_ = std::move(written);
    job_done_ = true;
  }
  cv_.notify_all();
}

const CheckpointPart& CheckpointWriter::finish() {
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
  base_name_ = name_;
  base_records_ = written_;
  base_versions_ = snapshot_versions_;
  // XOR deltas are taken against the bytes of the last committed checkpoint.
  if (config_.delta && config_.full_every > 1) {
    std::swap(snapshot_, base_);
  }
}

std::string publish_checkpoint(const std::string& root, const std::vector<CheckpointPart>& parts,
                               const ChunkStore& store, const Config& config, int world_size, double peak_gflops,
                               int keep, const std::string& run_id, CheckpointStats* stats) {
  Env& env = Env::get();
  const int n = static_cast<int>(store.chunks().size());
  check(!parts.empty(), "checkpoint: publishing without any rank's part");
  const std::string name = parts.back().name;
  const std::string dir = join(root, name);
  std::string failure;
  for (const CheckpointPart& p : parts) {
    if (!p.ok && failure.empty()) failure = "rank " + std::to_string(p.rank) + ": " + p.error;
  }
  CheckpointStats s;
  s.name = name;
  s.full = parts.front().full;
  for (const CheckpointPart& p : parts) s.write_ms = std::max(s.write_ms, p.write_ms);
  if (failure.empty()) {
    try {
      Manifest m;
      m.name = name;
      m.step = parts.front().step;
      m.kind = s.full ? "full" : "diff";
      m.base = parts.front().base;
      m.shape_hash = hex64(config.shape_hash());
      m.trajectory_hash = hex64(config.trajectory_hash(world_size));
      m.run_id = run_id;
      m.model = ModelShape::of(config.model);
      m.chunk_bytes = config.store.chunk_bytes;
      m.numel = store.numel();
      m.world = world_size;
      m.zero = config.parallel.zero;
      m.peak_gflops = peak_gflops;
      m.config_toml = config.to_toml();
      std::vector<const ChunkRecords*> records(static_cast<size_t>(n), nullptr);
      for (const CheckpointPart& p : parts) {
        ManifestRank rank{p.rank, p.data, p.residual, p.carried};
        if (p.residual) s.raw_bytes += static_cast<double>(p.residual->numel) * sizeof(float);
        if (p.carried) s.raw_bytes += static_cast<double>(p.carried->numel) * sizeof(float);
        m.ranks.push_back(std::move(rank));
        m.writers.emplace_back(p.first, p.last);
        for (const auto& [c, recs] : p.chunks) {
          check(c >= 0 && c < n && records[c] == nullptr, "chunk " + std::to_string(c) + " written twice or out of range");
          records[c] = &recs;
        }
        s.written_bytes += static_cast<double>(p.written_bytes);
        s.records += p.records;
        s.unchanged += p.unchanged;
        s.xor_records += p.xor_records;
      }
      for (const Chunk& c : store.chunks()) {
        check(records[c.id] != nullptr, "chunk " + std::to_string(c.id) + " written by no rank");
        ManifestChunk mc;
        mc.id = c.id;
        mc.layer = c.layer;
        mc.kind = kind_name(c.kind);
        mc.offset = c.offset;
        mc.numel = c.numel;
        for (const Segment& seg : c.segments) {
          mc.tensors.push_back(
              TensorPiece{store.tensors()[seg.tensor].spec.name, seg.tensor_offset, seg.numel, seg.offset - c.offset});
        }
        mc.records = *records[c.id];
        m.chunks.push_back(std::move(mc));
        s.raw_bytes += 3.0 * static_cast<double>(c.numel) * sizeof(float);
      }
      m.raw_bytes = s.raw_bytes;
      m.written_bytes = s.written_bytes;
      write_manifest(dir, m);
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
    apply_retention(root, keep, name, run_id);
  }
  if (stats != nullptr) *stats = s;
  return failure;
}

std::string save_checkpoint(const std::string& root, const ChunkStore& store, const Config& config,
                            const RankState& state, int64_t step, double peak_gflops) {
  CheckpointConfig cc = config.checkpoint;
  cc.async = false;
  // Streamed from the store chunk by chunk (a synchronous save needs no snapshot copy of the state).
  CheckpointWriter writer(store, cc, 0, 0, static_cast<int>(store.chunks().size()), false, {}, true);
  writer.begin(root, step, state, next_checkpoint_attempt(root, step));
  const std::string failure =
      publish_checkpoint(root, {writer.finish()}, store, config, 1, peak_gflops, cc.keep, "", nullptr);
  check(failure.empty(), "checkpoint " + join(root, writer.name()) + ": not written: " + failure);
  writer.committed(true);
  return join(root, writer.name());
}

}  // namespace keel
