#include "ckpt/checkpoint.h"

#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr Plane kSavedPlanes[] = {Plane::param, Plane::adam_m, Plane::adam_v};

const char* plane_file(Plane p) {
  switch (p) {
    case Plane::param: return "param.bin";
    case Plane::adam_m: return "adam_m.bin";
    case Plane::adam_v: return "adam_v.bin";
    case Plane::grad: return "grad.bin";
  }
  return "?";
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

json model_json(const ModelConfig& m) {
  return {{"n_layer", m.n_layer},       {"n_head", m.n_head},
          {"n_embd", m.n_embd},         {"vocab_size", m.vocab_size},
          {"padded_vocab_size", m.padded_vocab_size}, {"max_seq_len", m.max_seq_len}};
}

json read_manifest(const std::string& dir) {
  check(fs::is_directory(dir), "checkpoint " + dir + ": not found (expected a directory)");
  const std::string path = dir + "/manifest.json";
  check(fs::exists(path), "checkpoint " + dir + ": no manifest.json (an incomplete checkpoint is not a checkpoint)");
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
    check(version == kCheckpointFormatVersion, "checkpoint " + path + ": expected format version " +
                                                   std::to_string(kCheckpointFormatVersion) + ", found " +
                                                   std::to_string(version));
  } catch (const json::exception& e) {
    throw Error("checkpoint " + path + ": malformed manifest (" + e.what() + ")");
  }
  return m;
}

}  // namespace

void save_checkpoint(const std::string& dir, const ChunkStore& store, const Config& config,
                     const TrainState& state, const PlaneSource& source) {
  auto plane = [&](Plane p) {
    return source ? source(p) : store.range_view(p, 0, store.numel());
  };
  const fs::path target = fs::path(dir).lexically_normal();
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fs::create_directories(parent);
  const fs::path tmp = parent / (target.filename().string() + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  json chunks = json::array();
  for (const Chunk& c : store.chunks()) {
    json tensors = json::array();
    for (const Segment& s : c.segments) {
      tensors.push_back({store.tensors()[s.tensor].spec.name, s.tensor_offset, s.numel, s.offset - c.offset});
    }
    json sums = json::object();
    for (Plane p : kSavedPlanes) {
      const float* v = plane(p).data() + c.offset;
      sums[plane_file(p)] = hex64(XXH3_64bits(v, static_cast<size_t>(c.numel) * sizeof(float)));
    }
    chunks.push_back({{"id", c.id},
                      {"layer", c.layer},
                      {"kind", kind_name(c.kind)},
                      {"version", c.version},
                      {"offset", c.offset},
                      {"numel", c.numel},
                      {"checksum", sums},
                      {"tensors", tensors}});
  }
  for (Plane p : kSavedPlanes) {
    // Chunks are contiguous and in order, so the plane is written as one run of bytes.
    std::span<const float> all = plane(p);
    write_file((tmp / plane_file(p)).string(), all.data(), all.size_bytes());
  }
  json manifest = {{"format", "keel-checkpoint"},
                   {"version", kCheckpointFormatVersion},
                   {"step", state.step},
                   {"shape_hash", hex64(config.shape_hash())},
                   {"model", model_json(config.model)},
                   {"chunk_bytes", config.store.chunk_bytes},
                   {"numel", store.numel()},
                   {"data", {{"epoch", state.data.epoch}, {"index", state.data.index}}},
                   {"config", config.to_toml()},
                   {"chunks", chunks}};
  write_file((tmp / "manifest.json").string(), manifest.dump(1));
  sync_directory(tmp.string());

  // Swap into place: the old checkpoint is removed only after the new one is complete.
  const fs::path old = parent / (target.filename().string() + ".old-" + std::to_string(::getpid()));
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(tmp, target);
  sync_directory(parent.string());
  fs::remove_all(old);
}

Config read_checkpoint_config(const std::string& dir) {
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

TrainState load_checkpoint(const std::string& dir, ChunkStore& store, const Config& config, bool params_only) {
  const json m = read_manifest(dir);
  const std::string where = "checkpoint " + dir;
  TrainState state;
  try {
    const json want = model_json(config.model);
    if (m.at("model") != want || m.at("chunk_bytes").get<int64_t>() != config.store.chunk_bytes) {
      throw Error(where + ": written for model " + m.at("model").dump() + " with chunk_bytes " +
                  m.at("chunk_bytes").dump() + ", this run has " + want.dump() + " with chunk_bytes " +
                  std::to_string(config.store.chunk_bytes));
    }
    const json& chunks = m.at("chunks");
    check(m.at("numel").get<int64_t>() == store.numel() && chunks.size() == store.chunks().size(),
          where + ": expected " + std::to_string(store.chunks().size()) + " chunks of " +
              std::to_string(store.numel()) + " elements, found " + std::to_string(chunks.size()) + " of " +
              m.at("numel").dump());
    state.step = m.at("step").get<int64_t>();
    state.data.epoch = m.at("data").at("epoch").get<uint64_t>();
    state.data.index = m.at("data").at("index").get<uint64_t>();
    state.config_toml = m.at("config").get<std::string>();

    // Verify every plane file fully before writing anything into the store.
    std::vector<std::pair<Plane, std::vector<char>>> planes;
    for (Plane p : kSavedPlanes) {
      if (params_only && p != Plane::param) continue;
      const std::string path = dir + "/" + plane_file(p);
      check(fs::exists(path), where + ": missing " + plane_file(p));
      std::vector<char> bytes = read_file(path);
      const size_t expected = static_cast<size_t>(store.numel()) * sizeof(float);
      check(bytes.size() == expected, "checkpoint file " + path + ": expected " + std::to_string(expected) +
                                          " bytes, found " + std::to_string(bytes.size()));
      for (size_t i = 0; i < chunks.size(); ++i) {
        const Chunk& c = store.chunks()[i];
        const std::string want_sum = chunks[i].at("checksum").at(plane_file(p)).get<std::string>();
        const std::string got = hex64(XXH3_64bits(bytes.data() + c.offset * sizeof(float), c.numel * sizeof(float)));
        check(chunks[i].at("offset").get<int64_t>() == c.offset && chunks[i].at("numel").get<int64_t>() == c.numel,
              where + ": chunk " + std::to_string(i) + " layout differs from this model's");
        check(got == want_sum, "checkpoint file " + path + ": chunk " + std::to_string(i) +
                                   " is corrupt (checksum " + got + ", manifest says " + want_sum + ")");
      }
      planes.emplace_back(p, std::move(bytes));
    }
    for (auto& [p, bytes] : planes) {
      // Moments of a sharded store: only its own chunks.
      const auto [first, last] = p == Plane::param ? std::pair<int, int>{0, static_cast<int>(store.chunks().size())}
                                                   : store.moment_chunks();
      if (first >= last) continue;
      const int64_t begin = store.chunks()[first].offset;
      const int64_t end = store.chunks()[last - 1].offset + store.chunks()[last - 1].numel;
      std::memcpy(store.range_view(p, begin, end - begin).data(), bytes.data() + begin * sizeof(float),
                  static_cast<size_t>(end - begin) * sizeof(float));
    }
    for (size_t i = 0; i < chunks.size(); ++i) store.set_version(static_cast<int>(i), chunks[i].at("version").get<uint64_t>());
  } catch (const json::exception& e) {
    throw Error(where + ": malformed manifest (" + e.what() + ")");
  }
  return state;
}

}  // namespace keel
