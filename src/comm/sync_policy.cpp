#include "comm/sync_policy.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "core/error.h"
#include "core/text.h"

namespace keel {

namespace {

bool parse_number(const std::string& text, double* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || errno != 0 || !std::isfinite(v) || v < 0) return false;
  *out = v;
  return true;
}

}  // namespace

std::string default_sync_policy(int n_layer) {
  if (n_layer >= 32) return "0-10:sign1,11-30:quant2-topk,31-:fp16";
  // Measured on the default job (bench/compression.py, docs/architecture.md): 1-bit anywhere in a
  // shallow model costs 2.5-3.5 % of final validation loss, dense 2-bit about 1 %.
  return "0.0-:quant2-topk";
}

std::vector<SyncRule> parse_sync_policy(const std::string& text, const std::string& key) {
  std::vector<SyncRule> rules;
  std::stringstream in(text);
  std::string entry;
  auto bad = [&](const std::string& why) {
    return Error("config key '" + key + "': entry '" + trim(entry) + "': " + why +
                 " (expected LO-HI:codec entries separated by commas, e.g. \"0-10:sign1,11-:fp16\" "
                 "or \"0.0-0.5:sign1,0.5-:quant2-topk\")");
  };
  bool any_fraction = false, any_index = false;
  while (std::getline(in, entry, ',')) {
    const std::string e = trim(entry);
    if (e.empty()) throw bad("empty");
    const size_t colon = e.find(':');
    if (colon == std::string::npos) throw bad("no ':codec'");
    const std::string range = trim(e.substr(0, colon));
    const size_t dash = range.find('-');
    if (dash == std::string::npos) throw bad("no LO-HI range");
    SyncRule r;
    r.codec = parse_codec(trim(e.substr(colon + 1)), key);
    const std::string lo = trim(range.substr(0, dash)), hi = trim(range.substr(dash + 1));
    r.fraction = lo.find('.') != std::string::npos || hi.find('.') != std::string::npos;
    r.open = hi.empty();
    if (!parse_number(lo, &r.lo) || (!r.open && !parse_number(hi, &r.hi))) throw bad("bounds are not numbers >= 0");
    if (r.fraction) {
      if (r.lo > 1 || (!r.open && (r.hi > 1 || r.hi <= r.lo))) throw bad("fractions need 0 <= LO < HI <= 1");
      if (r.open) r.hi = 1;
      any_fraction = true;
    } else {
      if (r.lo != std::floor(r.lo) || (!r.open && (r.hi != std::floor(r.hi) || r.hi < r.lo))) {
        throw bad("block indices need whole numbers LO <= HI");
      }
      any_index = true;
    }
    rules.push_back(r);
  }
  if (rules.empty()) throw Error("config key '" + key + "': empty policy");
  if (any_fraction && any_index) {
    throw Error("config key '" + key + "': mixes block indices and depth fractions (write every bound of one kind)");
  }
  return rules;
}

CodecKind policy_codec(const std::vector<SyncRule>& rules, int block, int n_layer) {
  int matches = 0;
  CodecKind kind = CodecKind::none;
  const double depth = n_layer > 0 ? static_cast<double>(block) / n_layer : 0.0;
  for (const SyncRule& r : rules) {
    bool hit;
    if (r.fraction) {
      hit = depth >= r.lo && (depth < r.hi || (r.hi >= 1.0 && depth <= 1.0));
    } else {
      hit = block >= r.lo && (r.open || block <= r.hi);
    }
    if (hit) {
      kind = r.codec;
      matches++;
    }
  }
  check(matches == 1, "config key 'sync.policy': block " + std::to_string(block) + " of " + std::to_string(n_layer) +
                          (matches == 0 ? " is covered by no range" : " is covered by more than one range"));
  return kind;
}

void validate_sync_config(const SyncConfig& s, int n_layer, int zero) {
  const bool hybrid = s.codec == SyncCodec::hybrid;
  if (!s.policy.empty() && !hybrid) {
    throw Error("config key 'sync.policy': applies only with sync.codec = \"hybrid\" (found codec \"" +
                std::string(to_string(s.codec)) + "\")");
  }
  if (hybrid) {
    const std::vector<SyncRule> rules = parse_sync_policy(s.policy.empty() ? default_sync_policy(n_layer) : s.policy);
    for (int b = 0; b < n_layer; ++b) policy_codec(rules, b, n_layer);
  }
  auto keep_ok = [](double k) { return k > 0 && k <= 1; };
  auto fmt = [](double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  };
  check(keep_ok(s.sign1_keep), "config key 'sync.sign1_keep': expected 0 < keep <= 1, found " + fmt(s.sign1_keep));
  check(keep_ok(s.quant2_keep), "config key 'sync.quant2_keep': expected 0 < keep <= 1, found " + fmt(s.quant2_keep));
  check(keep_ok(s.topk_keep), "config key 'sync.topk_keep': expected 0 < keep <= 1, found " + fmt(s.topk_keep));
  check(keep_ok(s.randk_keep), "config key 'sync.randk_keep': expected 0 < keep <= 1, found " + fmt(s.randk_keep));
  check(s.block >= 1, "config key 'sync.block': expected >= 1, found " + std::to_string(s.block));
  check(s.warmup_steps >= 0, "config key 'sync.warmup_steps': expected >= 0, found " + std::to_string(s.warmup_steps));
  check(!sync_compressed(s) || zero < 2,
        "config key 'sync.codec': compressed sync (\"" + std::string(to_string(s.codec)) +
            "\") needs parallel.zero 0 or 1 (ZeRO-2's gradient reduce-scatter is not compressed)");
}

CodecParams sync_codec_params(const SyncConfig& s, CodecKind kind) {
  CodecParams p;
  p.kind = kind;
  p.block = s.block;
  switch (kind) {
    case CodecKind::sign1: p.keep = s.sign1_keep; break;
    case CodecKind::quant2_topk: p.keep = s.quant2_keep; break;
    case CodecKind::topk: p.keep = s.topk_keep; break;
    case CodecKind::randk: p.keep = s.randk_keep; break;
    default: p.keep = 1.0; break;
  }
  return p;
}

std::vector<CodecParams> sync_chunk_codecs(const SyncConfig& s, int n_layer, const ChunkStore& store) {
  std::vector<CodecParams> out;
  const bool hybrid = s.codec == SyncCodec::hybrid;
  const CodecKind uniform = hybrid ? CodecKind::none : uniform_codec(s.codec);
  std::vector<SyncRule> rules;
  if (hybrid) rules = parse_sync_policy(s.policy.empty() ? default_sync_policy(n_layer) : s.policy);
  for (const Chunk& c : store.chunks()) {
    CodecKind kind = uniform;
    if (sync_compressed(s)) {
      if (hybrid) {
        const int block = std::clamp(c.layer - 1, 0, n_layer - 1);
        kind = policy_codec(rules, block, n_layer);
      }
      const std::optional<CodecKind>* override_kind = nullptr;
      switch (c.kind) {
        case ChunkKind::embedding: override_kind = &s.embedding; break;
        case ChunkKind::attention: override_kind = &s.attention; break;
        case ChunkKind::ffn: override_kind = &s.ffn; break;
        case ChunkKind::norm: override_kind = &s.norm; break;
        case ChunkKind::head: override_kind = &s.head; break;
      }
      if (override_kind->has_value()) kind = **override_kind;
    }
    out.push_back(sync_codec_params(s, kind));
  }
  return out;
}

}  // namespace keel
