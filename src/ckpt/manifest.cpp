#include "ckpt/manifest.h"

#include <xxhash.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/env.h"
#include "core/error.h"
#include "core/fileio.h"

namespace keel {

using nlohmann::json;

namespace {

uint64_t parse_hex64(const json& j, const char* field) {
  const std::string s = j.get<std::string>();
  const bool ok = !s.empty() && s.size() <= 16 &&
                  s.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos;
  if (!ok) throw Error(std::string("field '") + field + "': expected a 64-bit hex checksum, found \"" + s + "\"");
  return std::stoull(s, nullptr, 16);
}

Encoding parse_encoding(const std::string& s) {
  if (s == "raw") return Encoding::raw;
  if (s == "zstd") return Encoding::zstd;
  if (s == "xor-zstd") return Encoding::xor_zstd;
  throw Error("unknown encoding '" + s + "'");
}

json record_json(const Record& r) {
  json j = {{"in", r.in},
            {"file", r.file},
            {"at", r.at},
            {"bytes", r.bytes},
            {"enc", encoding_name(r.enc)},
            {"sum", hex64(r.sum)},
            {"stored_sum", hex64(r.stored_sum)}};
  if (r.enc == Encoding::xor_zstd) j["base"] = r.base;
  return j;
}

Record parse_record(const json& j) {
  Record r;
  r.in = j.at("in").get<std::string>();
  r.file = j.at("file").get<std::string>();
  r.at = j.at("at").get<uint64_t>();
  r.bytes = j.at("bytes").get<uint64_t>();
  r.enc = parse_encoding(j.at("enc").get<std::string>());
  r.sum = parse_hex64(j.at("sum"), "sum");
  r.stored_sum = parse_hex64(j.at("stored_sum"), "stored_sum");
  if (r.enc == Encoding::xor_zstd) r.base = j.at("base").get<std::string>();
  return r;
}

json residual_json(const ResidualRecord& r) {
  json j = record_json(r.record);
  j["numel"] = r.numel;
  j["layout"] = r.layout;
  if (!r.keys.empty()) j["keys"] = r.keys;
  return j;
}

ResidualRecord parse_residual(const json& j) {
  ResidualRecord r;
  r.record = parse_record(j);
  r.numel = j.at("numel").get<uint64_t>();
  r.layout = j.at("layout").get<std::string>();
  r.keys = j.value("keys", "");
  return r;
}

json model_json(const ModelShape& m) {
  json j = {{"n_layer", m.n_layer},       {"n_head", m.n_head},
            {"n_embd", m.n_embd},         {"vocab_size", m.vocab_size},
            {"padded_vocab_size", m.padded_vocab_size}, {"max_seq_len", m.max_seq_len}};
  if (m.family != Family::gpt2) {
    j["family"] = to_string(m.family);
    j["n_kv_head"] = m.n_kv_head;
    j["ffn_hidden"] = m.ffn_hidden;
    j["rope_theta"] = m.rope_theta;
    j["tie_embeddings"] = m.tie_embeddings;
  }
  return j;
}

ModelShape parse_model(const json& j) {
  ModelShape m;
  m.n_layer = j.at("n_layer").get<int>();
  m.n_head = j.at("n_head").get<int>();
  m.n_embd = j.at("n_embd").get<int>();
  m.vocab_size = j.at("vocab_size").get<int>();
  m.padded_vocab_size = j.at("padded_vocab_size").get<int>();
  m.max_seq_len = j.at("max_seq_len").get<int>();
  m.family = parse_enum<Family>(j.value("family", std::string("gpt2")), "model.family");
  m.n_kv_head = j.value("n_kv_head", m.n_head);
  m.ffn_hidden = j.value("ffn_hidden", m.n_embd > 0 && m.n_embd <= 65536 ? 4 * m.n_embd : 0);  // (no overflow)
  m.rope_theta = j.value("rope_theta", 0.0);
  m.tie_embeddings = j.value("tie_embeddings", true);
  return m;
}

LoaderPosition parse_position(const json& j) {
  return LoaderPosition{j.at("epoch").get<uint64_t>(), j.at("index").get<uint64_t>(), j.value("offset", uint64_t{0})};
}

std::string name_of(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  const std::string name = p.filename().string();
  return name.empty() ? p.parent_path().filename().string() : name;
}

Manifest parse(const json& j, const std::string& dir) {
  Manifest m;
  const std::string format = j.at("format").get<std::string>();
  check(format == "keel-checkpoint", "expected format keel-checkpoint, found " + format);
  m.version = j.at("version").get<int>();
  check(m.version >= 1 && m.version <= kCheckpointFormatVersion,
        "expected format version 1 to " + std::to_string(kCheckpointFormatVersion) + ", found " +
            std::to_string(m.version));
  if (m.version >= 3) {
    json unsealed = j;
    const std::string stated = unsealed.at("checksum").get<std::string>();
    unsealed.erase("checksum");
    const std::string text = unsealed.dump(1);
    const std::string actual = hex64(XXH3_64bits(text.data(), text.size()));
    check(stated == actual, "its own checksum does not match (" + actual + ", it says " + stated +
                                "): the manifest was altered or damaged");
  }
  m.name = j.value("name", name_of(dir));
  m.step = j.at("step").get<int64_t>();
  m.kind = j.value("kind", "full");
  m.base = j.value("base", "");
  m.shape_hash = j.value("shape_hash", "");
  m.trajectory_hash = j.value("trajectory_hash", "");
  m.run_id = j.value("run", "");
  m.model = parse_model(j.at("model"));
  m.chunk_bytes = j.at("chunk_bytes").get<int64_t>();
  m.numel = j.at("numel").get<int64_t>();
  if (j.contains("layout")) {
    const json& l = j.at("layout");
    m.world = l.at("world").get<int>();
    m.zero = l.at("zero").get<int>();
    for (const json& w : l.at("writers")) m.writers.emplace_back(w.at(0).get<int>(), w.at(1).get<int>());
  }
  m.peak_gflops = j.value("peak_gflops", 0.0);
  if (j.contains("sizes")) {
    m.raw_bytes = j.at("sizes").at("raw_bytes").get<double>();
    m.written_bytes = j.at("sizes").at("written_bytes").get<double>();
  }
  m.config_toml = j.at("config").get<std::string>();
  const std::string self = name_of(dir);
  for (const json& c : j.at("chunks")) {
    ManifestChunk mc;
    mc.id = c.at("id").get<int>();
    mc.layer = c.at("layer").get<int>();
    mc.kind = c.at("kind").get<std::string>();
    mc.offset = c.at("offset").get<int64_t>();
    mc.numel = c.at("numel").get<int64_t>();
    for (const json& t : c.at("tensors")) {
      mc.tensors.push_back(TensorPiece{t.at(0).get<std::string>(), t.at(1).get<int64_t>(), t.at(2).get<int64_t>(),
                                       t.at(3).get<int64_t>()});
    }
    mc.records.version = c.at("version").get<uint64_t>();
    for (int i = 0; i < kNumSavedPlanes; ++i) {
      const char* key = saved_plane_key(kSavedPlanes[i]);
      Record& r = mc.records.planes[i];
      if (m.version == 1) {
        // Format 1: one file per plane, the whole flat plane raw; the checksum is of the chunk's floats.
        const std::string file = std::string(key) + ".bin";
        r.in = self;
        r.file = file;
        r.at = static_cast<uint64_t>(mc.offset) * sizeof(float);
        r.bytes = static_cast<uint64_t>(mc.numel) * sizeof(float);
        r.enc = Encoding::raw;
        r.sum = r.stored_sum = parse_hex64(c.at("checksum").at(file), "checksum");
      } else {
        r = parse_record(c.at("planes").at(key));
      }
    }
    m.chunks.push_back(std::move(mc));
  }
  // The chunk table: ascending, inside the flat space, each chunk at most a chunk's worth of
  // floats (plus the alignment of the last). What readers allocate from it stays bounded by it.
  check(m.chunk_bytes >= 4096 && m.chunk_bytes <= (int64_t{1} << 40), "chunk_bytes: expected 4096..2^40, found " +
                                                                          std::to_string(m.chunk_bytes));
  check(m.numel >= 0, "numel: expected >= 0, found " + std::to_string(m.numel));
  int64_t end = 0;
  for (size_t i = 0; i < m.chunks.size(); ++i) {
    const ManifestChunk& c = m.chunks[i];
    check(c.offset >= end && c.numel >= 0 && c.numel <= m.chunk_bytes / 4 + 1024 && c.offset + c.numel <= m.numel,
          "chunk " + std::to_string(i) + ": elements [" + std::to_string(c.offset) + ", +" + std::to_string(c.numel) +
              ") do not fit the chunk table");
    end = c.offset + c.numel;
  }
  if (m.version == 1) {
    m.ranks.push_back(ManifestRank{0, parse_position(j.at("data")), std::nullopt, std::nullopt});
  } else {
    for (const json& r : j.at("ranks")) {
      ManifestRank mr;
      mr.rank = r.at("rank").get<int>();
      mr.data = parse_position(r.at("data"));
      if (r.contains("residual")) mr.residual = parse_residual(r.at("residual"));
      if (r.contains("carried")) mr.carried = parse_residual(r.at("carried"));
      m.ranks.push_back(std::move(mr));
    }
  }
  for (const ManifestRank& r : m.ranks) {
    check(!r.residual || r.residual->numel <= static_cast<uint64_t>(2 * m.numel + 1024),
          "rank " + std::to_string(r.rank) + ": a compression residual of " +
              std::to_string(r.residual ? r.residual->numel : 0) + " floats for a state of " + std::to_string(m.numel));
    // (Gradient prediction carries up to five arrays the size of a rank's chunks, which may hold a
    // replica of a tied tensor beside its own, and an LSTM state of 89 floats a chunk.)
    check(!r.carried || r.carried->numel <= static_cast<uint64_t>(12 * m.numel) + 1024 * m.chunks.size() + 4096,
          "rank " + std::to_string(r.rank) + ": a carried step state of " +
              std::to_string(r.carried ? r.carried->numel : 0) + " floats for a state of " + std::to_string(m.numel));
  }
  return m;
}

// A little-endian byte writer and reader for parts.
struct Out {
  std::string bytes;
  template <typename T>
  void pod(const T& v) {
    bytes.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void str(const std::string& s) {
    pod(static_cast<uint64_t>(s.size()));
    bytes.append(s);
  }
  void record(const Record& r) {
    str(r.in), str(r.file), pod(r.at), pod(r.bytes), pod(static_cast<uint8_t>(r.enc)), pod(r.sum), pod(r.stored_sum);
    str(r.base);
  }
};

struct In {
  const std::string& bytes;
  size_t at = 0;
  template <typename T>
  T pod() {
    T v;
    check(at + sizeof v <= bytes.size(), "checkpoint part: truncated");
    std::memcpy(&v, bytes.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::string str() {
    const uint64_t n = pod<uint64_t>();
    check(n <= bytes.size() - at, "checkpoint part: truncated");
    std::string s = bytes.substr(at, n);
    at += n;
    return s;
  }
  Record record() {
    Record r;
    r.in = str();
    r.file = str();
    r.at = pod<uint64_t>();
    r.bytes = pod<uint64_t>();
    const uint8_t enc = pod<uint8_t>();
    check(enc <= 2, "checkpoint part: bad encoding");
    r.enc = static_cast<Encoding>(enc);
    r.sum = pod<uint64_t>();
    r.stored_sum = pod<uint64_t>();
    r.base = str();
    return r;
  }
};

constexpr uint32_t kPartMagic = 0x4b43505au;  // "KCPZ"

}  // namespace

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

const char* encoding_name(Encoding e) {
  switch (e) {
    case Encoding::raw: return "raw";
    case Encoding::zstd: return "zstd";
    case Encoding::xor_zstd: return "xor-zstd";
  }
  return "?";
}

const char* saved_plane_key(Plane p) {
  switch (p) {
    case Plane::param: return "param";
    case Plane::adam_m: return "adam_m";
    case Plane::adam_v: return "adam_v";
    case Plane::grad: return "grad";
  }
  return "?";
}

ModelShape ModelShape::of(const ModelConfig& m) {
  ModelShape s{m.n_layer, m.n_head, m.n_embd, m.vocab_size, m.padded_vocab_size, m.max_seq_len};
  s.family = m.family.value_or(Family::gpt2);
  s.n_kv_head = m.n_kv_head > 0 ? m.n_kv_head : m.n_head;
  s.ffn_hidden = m.ffn_hidden > 0 ? m.ffn_hidden : (m.n_embd > 0 && m.n_embd <= 65536 ? 4 * m.n_embd : 0);
  s.rope_theta = m.rope_theta;
  s.tie_embeddings = m.tie_embeddings.value_or(true);
  return s;
}

std::string ModelShape::describe() const { return model_json(*this).dump(); }

Manifest read_manifest(const std::string& dir) {
  Env& env = Env::get();
  const std::string path = dir + "/manifest.json";
  check(env.exists(dir), "checkpoint " + dir + ": not found");
  check(env.exists(path), "checkpoint " + dir + ": no manifest.json (an incomplete checkpoint is not a checkpoint)");
  json j;
  try {
    j = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    throw Error("checkpoint " + path + ": not valid JSON (" + e.what() + ")");
  }
  try {
    return parse(j, dir);
  } catch (const json::exception& e) {
    throw Error("checkpoint " + path + ": malformed manifest (" + e.what() + ")");
  } catch (const Error& e) {
    throw Error("checkpoint " + path + ": " + e.what());
  }
}

void write_manifest(const std::string& dir, const Manifest& m) {
  json chunks = json::array();
  for (const ManifestChunk& c : m.chunks) {
    json tensors = json::array();
    for (const TensorPiece& t : c.tensors) tensors.push_back({t.name, t.tensor_offset, t.numel, t.chunk_offset});
    json planes = json::object();
    for (int i = 0; i < kNumSavedPlanes; ++i) planes[saved_plane_key(kSavedPlanes[i])] = record_json(c.records.planes[i]);
    chunks.push_back({{"id", c.id},
                      {"layer", c.layer},
                      {"kind", c.kind},
                      {"version", c.records.version},
                      {"offset", c.offset},
                      {"numel", c.numel},
                      {"tensors", tensors},
                      {"planes", planes}});
  }
  json ranks = json::array();
  for (const ManifestRank& r : m.ranks) {
    json rank = {{"rank", r.rank}, {"data", {{"epoch", r.data.epoch}, {"index", r.data.index}}}};
    if (r.data.offset > 0) rank["data"]["offset"] = r.data.offset;  // (a curriculum's part-read window)
    if (r.residual) rank["residual"] = residual_json(*r.residual);
    if (r.carried) rank["carried"] = residual_json(*r.carried);
    ranks.push_back(rank);
  }
  json writers = json::array();
  for (const auto& [first, last] : m.writers) writers.push_back({first, last});
  const json j = {{"format", "keel-checkpoint"},
                  {"version", m.version},
                  {"name", m.name},
                  {"step", m.step},
                  {"kind", m.kind},
                  {"base", m.base},
                  {"shape_hash", m.shape_hash},
                  {"trajectory_hash", m.trajectory_hash},
                  {"run", m.run_id},
                  {"model", model_json(m.model)},
                  {"chunk_bytes", m.chunk_bytes},
                  {"numel", m.numel},
                  {"layout", {{"world", m.world}, {"zero", m.zero}, {"writers", writers}}},
                  {"ranks", ranks},
                  {"peak_gflops", m.peak_gflops},
                  {"sizes", {{"raw_bytes", m.raw_bytes}, {"written_bytes", m.written_bytes}}},
                  {"config", m.config_toml},
                  {"chunks", chunks}};
  const std::string text = seal_manifest(j.dump(1));
  write_file_atomic(dir + "/manifest.json", {ByteRange{text.data(), text.size()}});
}

std::string seal_manifest(const std::string& json_text) {
  json j = json::parse(json_text);
  j.erase("checksum");
  const std::string unsealed = j.dump(1);
  j["checksum"] = hex64(XXH3_64bits(unsealed.data(), unsealed.size()));
  return j.dump(1);
}

std::string encode_part(const CheckpointPart& p) {
  Out o;
  o.pod(kPartMagic);
  o.pod(p.rank), o.str(p.name), o.pod(p.step), o.pod(static_cast<uint8_t>(p.full)), o.str(p.base);
  o.pod(p.first), o.pod(p.last), o.pod(p.data.epoch), o.pod(p.data.index), o.pod(p.data.offset);
  o.pod(static_cast<uint8_t>(p.ok)), o.str(p.error);
  o.pod(static_cast<uint64_t>(p.chunks.size()));
  for (const auto& [id, c] : p.chunks) {
    o.pod(id), o.pod(c.version);
    for (const Record& r : c.planes) o.record(r);
  }
  for (const std::optional<ResidualRecord>* r : {&p.residual, &p.carried}) {
    o.pod(static_cast<uint8_t>(r->has_value()));
    if (*r) o.record((*r)->record), o.pod((*r)->numel), o.str((*r)->layout), o.str((*r)->keys);
  }
  o.pod(p.written_bytes), o.pod(p.records), o.pod(p.unchanged), o.pod(p.xor_records), o.pod(p.write_ms);
  return std::move(o.bytes);
}

CheckpointPart decode_part(const std::string& bytes) {
  In in{bytes};
  check(in.pod<uint32_t>() == kPartMagic, "checkpoint part: not an encoded part");
  CheckpointPart p;
  p.rank = in.pod<int>();
  p.name = in.str();
  p.step = in.pod<int64_t>();
  p.full = in.pod<uint8_t>() != 0;
  p.base = in.str();
  p.first = in.pod<int>();
  p.last = in.pod<int>();
  p.data.epoch = in.pod<uint64_t>();
  p.data.index = in.pod<uint64_t>();
  p.data.offset = in.pod<uint64_t>();
  p.ok = in.pod<uint8_t>() != 0;
  p.error = in.str();
  const uint64_t n = in.pod<uint64_t>();
  check(n <= bytes.size(), "checkpoint part: bad chunk count");
  for (uint64_t i = 0; i < n; ++i) {
    std::pair<int, ChunkRecords> c;
    c.first = in.pod<int>();
    c.second.version = in.pod<uint64_t>();
    for (Record& r : c.second.planes) r = in.record();
    p.chunks.push_back(std::move(c));
  }
  for (std::optional<ResidualRecord>* out : {&p.residual, &p.carried}) {
    if (in.pod<uint8_t>() == 0) continue;
    ResidualRecord r;
    r.record = in.record();
    r.numel = in.pod<uint64_t>();
    r.layout = in.str();
    r.keys = in.str();
    *out = std::move(r);
  }
  p.written_bytes = in.pod<uint64_t>();
  p.records = in.pod<int>();
  p.unchanged = in.pod<int>();
  p.xor_records = in.pod<int>();
  p.write_ms = in.pod<double>();
  check(in.at == bytes.size(), "checkpoint part: trailing bytes");
  return p;
}

}  // namespace keel
