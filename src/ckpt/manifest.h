// The typed form of a checkpoint's manifest.json, and of the part each rank's writer contributes.
//
// A manifest is parsed and checked once, here (read_manifest: every field, every record, format 1
// rewritten into format 2's records), and written once, here (write_manifest); everything else in
// src/ckpt/ works on these structs. A rank's part travels from its writer thread to the
// checkpointer as a struct and from rank to rank as a compact binary encoding (encode_part /
// decode_part), never as JSON text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config.h"
#include "data/loader.h"
#include "store/residency.h"

namespace keel {

// Format 3: format 2 plus the manifest's own checksum ("checksum": XXH3 of the manifest as
// written without that field). Formats 1 and 2 still load.
inline constexpr int kCheckpointFormatVersion = 3;

enum class Encoding : uint8_t { raw = 0, zstd = 1, xor_zstd = 2 };
const char* encoding_name(Encoding e);  // "raw", "zstd", "xor-zstd" (the manifest's "enc")
// A checksum or hash as the manifest spells it: 16 lower-case hex digits.
std::string hex64(uint64_t v);

// One stored array of floats: a plane of a chunk, a rank's compression residuals, or the state
// its step engine carries from step to step (core/carried_state.h).
struct Record {
  std::string in;           // the checkpoint (directory name under the root) whose file holds it
  std::string file;         // e.g. "r0.bin"
  uint64_t at = 0;          // byte offset in the file
  uint64_t bytes = 0;       // stored bytes
  Encoding enc = Encoding::raw;
  uint64_t sum = 0;         // XXH3 of the decoded floats
  uint64_t stored_sum = 0;  // XXH3 of the stored bytes
  std::string base;         // xor_zstd: the checkpoint whose record of the same plane it XORs
};

// A rank's own record beside the chunks: compression residuals, or (with the same fields)
// carried step state, whose `layout` is the step engine's description and `keys` empty.
struct ResidualRecord {
  Record record;
  uint64_t numel = 0;
  std::string layout;  // the bucket layout the residuals belong to
  std::string keys;    // what each bucket's residual covers (GradSync::residual_keys; "" in older checkpoints)
};

// The saved planes of a chunk, in this order: params, AdamW m, AdamW v.
inline constexpr Plane kSavedPlanes[] = {Plane::param, Plane::adam_m, Plane::adam_v};
inline constexpr int kNumSavedPlanes = 3;
const char* saved_plane_key(Plane p);  // "param", "adam_m", "adam_v"

struct ChunkRecords {
  uint64_t version = 0;
  Record planes[kNumSavedPlanes];
};

struct TensorPiece {
  std::string name;
  int64_t tensor_offset = 0, numel = 0, chunk_offset = 0;
};

struct ManifestChunk {
  int id = 0, layer = 0;
  std::string kind;
  int64_t offset = 0, numel = 0;
  std::vector<TensorPiece> tensors;
  ChunkRecords records;
};

struct ManifestRank {
  int rank = 0;
  LoaderPosition data;
  std::optional<ResidualRecord> residual;
  std::optional<ResidualRecord> carried;  // the step engine's carried state ("carried")
};

// The model section as a checkpoint records it (what its shape depends on).
struct ModelShape {
  int n_layer = 0, n_head = 0, n_embd = 0, vocab_size = 0, padded_vocab_size = 0, max_seq_len = 0;
  // The family and its options (manifests of GPT-2 runs, and those written before llama, omit them).
  Family family = Family::gpt2;
  int n_kv_head = 0, ffn_hidden = 0;
  double rope_theta = 0;
  bool tie_embeddings = true;
  static ModelShape of(const ModelConfig& m);
  bool operator==(const ModelShape&) const = default;
  std::string describe() const;  // as JSON text, for messages
};

struct Manifest {
  int version = kCheckpointFormatVersion;
  std::string name;
  int64_t step = 0;
  std::string kind = "full", base;          // "full" or "diff" (against `base`)
  std::string shape_hash, trajectory_hash;  // hex; "" where an old manifest has none
  // The run that wrote it (RunDirectory::run_id): which run directory's checkpoints it belongs to.
  // "" in manifests written before runs had ids, and in tools' checkpoints (keel import).
  std::string run_id;
  ModelShape model;
  int64_t chunk_bytes = 0, numel = 0;
  int world = 1, zero = 0;                  // the writers' layout
  std::vector<std::pair<int, int>> writers; // chunks [first, last) per writing rank
  std::vector<ManifestRank> ranks;
  double peak_gflops = 0;
  double raw_bytes = 0, written_bytes = 0;
  std::string config_toml;
  std::vector<ManifestChunk> chunks;
};

// Reads and checks dir/manifest.json. Throws keel::Error naming the file and what is wrong: not
// found, not JSON, another format or version, a missing or mistyped field, an unknown encoding.
Manifest read_manifest(const std::string& dir);
// Writes dir/manifest.json atomically (temporary name, fsync, rename).
void write_manifest(const std::string& dir, const Manifest& m);
// Manifest JSON text (its "checksum" field, if any, ignored) sealed with its checksum: what a
// tool that rewrites a manifest on purpose writes back.
std::string seal_manifest(const std::string& json_text);

// One rank's part of a checkpoint: what its writer wrote (or the error that stopped it).
struct CheckpointPart {
  int rank = 0;
  std::string name;
  int64_t step = 0;
  bool full = true;
  std::string base;
  int first = 0, last = 0;  // the chunks it writes
  LoaderPosition data;
  bool ok = false;
  std::string error;
  std::vector<std::pair<int, ChunkRecords>> chunks;  // by chunk id, ascending
  std::optional<ResidualRecord> residual;
  std::optional<ResidualRecord> carried;
  uint64_t written_bytes = 0;
  int records = 0, unchanged = 0, xor_records = 0;
  double write_ms = 0;
};

// A part as bytes for the trip to rank 0, and back. decode_part throws keel::Error on bytes that
// are not an encoded part.
std::string encode_part(const CheckpointPart& part);
CheckpointPart decode_part(const std::string& bytes);

}  // namespace keel
