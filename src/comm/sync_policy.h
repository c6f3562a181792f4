// Which codec each chunk's gradient travels with (HybridGC): a policy by layer depth, overrides by
// chunk kind, the codecs' parameters. Everything here is a pure function of the config and the
// model's layout, so every rank computes the same plan.
#pragma once

#include <string>
#include <vector>

#include "comm/codec.h"
#include "comm/compressed_allreduce.h"
#include "core/config.h"
#include "store/chunk_store.h"

namespace keel {

// One "LO-HI:codec" entry of sync.policy.
struct SyncRule {
  bool fraction = false;  // bounds are depth fractions in [0, 1] (else block indices)
  double lo = 0, hi = 0;  // block indices: lo..hi inclusive; fractions: [lo, hi)
  bool open = false;      // "LO-": everything from lo up
  CodecKind codec = CodecKind::none;
};

// The policy used when sync.policy is empty: the seed's split (blocks 0-10 sign1, 11-30
// quant2-topk, 31 and up fp16) by block index for models of 32 blocks or more, and the same
// split as depth fractions (11/32, 31/32) for shallower ones.
std::string default_sync_policy(int n_layer);

// Parses a policy string. Throws keel::Error naming `key` and the offending entry.
std::vector<SyncRule> parse_sync_policy(const std::string& text, const std::string& key = "sync.policy");

// The codec a policy gives transformer block `block` (0-based) of `n_layer`. Throws unless
// exactly one rule covers it.
CodecKind policy_codec(const std::vector<SyncRule>& rules, int block, int n_layer);

// Checks every sync.* key for a model of n_layer blocks trained with ZeRO stage `zero`; throws
// keel::Error naming the key.
void validate_sync_config(const SyncConfig& sync, int n_layer, int zero);

// True when sync.codec asks for any compression.
inline bool sync_compressed(const SyncConfig& sync) { return sync.codec != SyncCodec::none; }

// The parameters of `kind` under this config (keep ratios, block size).
CodecParams sync_codec_params(const SyncConfig& sync, CodecKind kind);

// The codec of every chunk of store (index = chunk id). Chunk layers are 0 = embeddings,
// 1..n_layer = blocks, n_layer + 1 = the final norm. With sync.codec = "none" all are none.
std::vector<CodecParams> sync_chunk_codecs(const SyncConfig& sync, int n_layer, const ChunkStore& store);

}  // namespace keel
