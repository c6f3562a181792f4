#include "runtime/kv_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/clock.h"
#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace keel {

namespace {

// -log softmax(logits[0..V))[target], in double.
float nll_of(const float* logits, int V, int target) {
  const float mx = *std::max_element(logits, logits + V);
  double sum = 0;
  for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(logits[v]) - mx);
  return static_cast<float>(std::log(sum) + mx - logits[target]);
}

}  // namespace

KvCacheOptions KvCacheOptions::from(const GenerateConfig& g) {
  KvCacheOptions o;
  o.block_tokens = g.kv_block;
  o.cache_bytes = g.kv_cache_mib << 20;
  o.device_bytes = g.kv_device_mib << 20;
  o.tier = g.kv_tier;
  o.nvme_dir = g.kv_nvme_dir;
  o.prefix_reuse = g.prefix_reuse;
  o.prefill_chunk = g.prefill_chunk;
  return o;
}

KvCache::KvCache(GPT& model, const KvCacheOptions& options) : model_(model), options_(options) {
  const ModelConfig& m = model.config();
  check(model.whole(), "KV cache: the model must be whole (not a pipeline stage)");
  check(model.allocated_B() >= 1 && model.allocated_T() >= 1, "KV cache: the model has no activations allocated");
  check(options.block_tokens >= 1 && options.block_tokens <= 1024,
        "generate.kv_block: expected 1..1024 tokens, found " + std::to_string(options.block_tokens));
  check(options.prefill_chunk >= 1, "generate.prefill_chunk: expected >= 1, found " + std::to_string(options.prefill_chunk));
  layers_ = m.n_layer;
  kv_dim_ = m.kv_dim();
  max_pass_ = std::min(options.prefill_chunk, model.allocated_T());
  const int64_t page_floats = 2LL * options.block_tokens * kv_dim_;
  // A page per (layer, slot): chunks of exactly one page, each on its own 4 KiB boundary.
  const int64_t page_bytes = (page_floats * 4 + 4095) / 4096 * 4096;
  slot_bytes_ = page_bytes * layers_;
  slots_ = static_cast<int>(std::min<int64_t>(options.cache_bytes / slot_bytes_, 1 << 20));
  check(slots_ >= 1, "generate.kv_cache_mib: " + std::to_string(options.cache_bytes >> 20) +
                         " MiB cannot hold one KV block (" + std::to_string(slot_bytes_) + " bytes over " +
                         std::to_string(layers_) + " layers)");
  store_ = std::make_unique<ChunkStore>(page_bytes);
  for (int l = 0; l < layers_; ++l) {
    for (int s = 0; s < slots_; ++s) {
      store_->add(TensorSpec{"kv." + std::to_string(l) + "." + std::to_string(s), {page_bytes / 4}, l, ChunkKind::attention, false});
    }
  }
  store_->finalize(/*touch_params=*/false);
  check(static_cast<int>(store_->chunks().size()) == layers_ * slots_, "KV cache: a block did not get a chunk of its own");
  if (options.device_bytes > 0) {
    TierOptions t;
    t.device_bytes = options.device_bytes;
    t.host_bytes = options.tier == KvTier::host ? static_cast<int64_t>(slots_) * slot_bytes_ : 0;
    t.nvme_dir = options.tier == KvTier::nvme ? options.nvme_dir : "";
    t.params_only = true;
    t.async_host = true;  // a hinted host block is copied while this layer computes
    // The passes of a sequence grow by a token each: no step repeats, so no recorded schedule;
    // the cache hints the next layer's blocks itself.
    t.lookahead = 0;
    // A pass pins one layer's blocks of the sequence (the longest: max_seq_len tokens), and the
    // tier manager wants room for a few pages beside them.
    const int64_t blocks = (model.config().max_seq_len + options.block_tokens - 1) / options.block_tokens + 1;
    const int64_t need = (blocks + 4) * page_bytes;
    check(options.device_bytes >= need, "generate.kv_device_mib: " + std::to_string(options.device_bytes >> 20) +
                                            " MiB cannot hold one layer's KV blocks of a " +
                                            std::to_string(model.config().max_seq_len) + "-token sequence (" +
                                            std::to_string((need + (1 << 20) - 1) >> 20) + " MiB)");
    const Tier home = options.tier == KvTier::host ? Tier::host : Tier::nvme;
    tiers_ = std::make_unique<TierManager>(*store_, t, std::vector<Tier>(store_->chunks().size() * kNumPlanes, home));
    residency_ = std::make_unique<TierResidency>(*tiers_, *store_);
    store_->attach_residency(residency_.get());
  }
  free_.reserve(slots_);
  for (int s = slots_ - 1; s >= 0; --s) free_.push_back(s);
}

KvCache::~KvCache() {
  if (tiers_) tiers_->drain();
}

KvCache::Sequence::~Sequence() { cache_.close(*this); }

std::unique_ptr<KvCache::Sequence> KvCache::open() {
  stats_.sequences++;
  return std::unique_ptr<Sequence>(new Sequence(*this));
}

void KvCache::close(Sequence& s) {
  for (size_t b = 0; b < s.slots_.size(); ++b) {
    if (s.nodes_[b] >= 0) {
      release_node(s.nodes_[b]);
    } else {
      free_slot(s.slots_[b]);
    }
  }
  s.slots_.clear();
  s.nodes_.clear();
}

uint64_t KvCache::key(int parent, std::span<const int> tokens) const {
  return XXH3_64bits_withSeed(tokens.data(), tokens.size_bytes(), static_cast<uint64_t>(parent + 1));
}

int KvCache::find(int parent, std::span<const int> tokens) const {
  auto [it, end] = index_.equal_range(key(parent, tokens));
  for (; it != end; ++it) {
    const Node& n = nodes_[it->second];
    if (n.live && n.parent == parent && std::equal(tokens.begin(), tokens.end(), n.tokens.begin())) return it->second;
  }
  return -1;
}

int KvCache::take_slot() {
  if (free_.empty()) {
    // Evict the least recently used sealed block that nothing uses or extends.
    int victim = -1;
    for (int i = 0; i < static_cast<int>(nodes_.size()); ++i) {
      const Node& n = nodes_[i];
      if (n.live && n.users == 0 && n.children == 0 && (victim < 0 || n.last_use < nodes_[victim].last_use)) victim = i;
    }
    if (victim < 0) {
      throw Error("generate.kv_cache_mib: the KV cache's " + std::to_string(slots_) + " blocks of " +
                  std::to_string(options_.block_tokens) + " tokens are all in use (" +
                  std::to_string((static_cast<int64_t>(slots_) * slot_bytes_) >> 20) + " MiB): raise it");
    }
    Node& n = nodes_[victim];
    auto [it, end] = index_.equal_range(key(n.parent, n.tokens));
    for (; it != end; ++it) {
      if (it->second == victim) {
        index_.erase(it);
        break;
      }
    }
    if (n.parent >= 0) nodes_[n.parent].children--;
    free_slot(n.slot);
    n = Node();
    free_nodes_.push_back(victim);
    stats_.evicted++;
  }
  const int s = free_.back();
  free_.pop_back();
  return s;
}

void KvCache::free_slot(int slot) {
  // Its bytes are dead: with tiers, nothing is written back and the next use starts from zero.
  if (tiers_) {
    for (int l = 0; l < layers_; ++l) tiers_->discard_to_zero(PageRef{chunk_of(l, slot), Plane::param});
  }
  free_.push_back(slot);
}

void KvCache::release_node(int node) {
  Node& n = nodes_[node];
  n.users--;
  n.last_use = ++clock_;
}

void KvCache::seal(Sequence& s, int block, const float* logits_row) {
  const int kb = options_.block_tokens, V = model_.config().vocab_size;
  const int parent = block == 0 ? -1 : s.nodes_[block - 1];
  const std::span<const int> tokens(s.tokens_.data() + static_cast<int64_t>(block) * kb, kb);
  const int existing = find(parent, tokens);
  if (existing >= 0) {  // the same block sealed by another sequence: share it, free ours
    free_slot(s.slots_[block]);
    s.slots_[block] = nodes_[existing].slot;
    s.nodes_[block] = existing;
    nodes_[existing].users++;
    nodes_[existing].last_use = ++clock_;
    return;
  }
  int id;
  if (!free_nodes_.empty()) {
    id = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    id = static_cast<int>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& n = nodes_[id];
  n.live = true;
  n.parent = parent;
  n.slot = s.slots_[block];
  n.users = 1;
  n.children = 0;
  n.last_use = ++clock_;
  n.tokens.assign(tokens.begin(), tokens.end());
  n.nll.assign(s.nll_.begin() + static_cast<int64_t>(block) * kb, s.nll_.begin() + static_cast<int64_t>(block + 1) * kb);
  n.last_logits.assign(logits_row, logits_row + V);
  if (parent >= 0) nodes_[parent].children++;
  index_.emplace(key(parent, tokens), id);
  s.nodes_[block] = id;
  stats_.sealed++;
}

void KvCache::extend(Sequence& s, std::span<const int> tokens) {
  check(!tokens.empty(), "KV cache: extend by no tokens");
  size_t at = reuse(s, tokens);
  while (at < tokens.size()) {
    const size_t n = std::min<size_t>(tokens.size() - at, static_cast<size_t>(max_pass_));
    compute(s, tokens.subspan(at, n));
    at += n;
  }
}

void KvCache::extend_many(std::span<const Extension> extensions) {
  std::vector<size_t> at(extensions.size());
  for (size_t i = 0; i < extensions.size(); ++i) {
    check(!extensions[i].tokens.empty(), "KV cache: extend by no tokens");
    for (size_t j = 0; j < i; ++j) check(extensions[j].sequence != extensions[i].sequence, "KV cache: a sequence extended twice in one pass");
    at[i] = reuse(*extensions[i].sequence, extensions[i].tokens);
  }
  // Passes of up to max_pass_ rows: each sequence's remaining tokens in order, the sequences in turn.
  size_t next = 0;
  while (true) {
    std::vector<Extension> pass;
    int rows = 0;
    for (size_t k = 0; k < extensions.size() && rows < max_pass_; ++k) {
      const size_t i = (next + k) % extensions.size();
      const size_t left = extensions[i].tokens.size() - at[i];
      if (left == 0) continue;
      const size_t n = std::min<size_t>(left, static_cast<size_t>(max_pass_ - rows));
      pass.push_back(Extension{extensions[i].sequence, extensions[i].tokens.subspan(at[i], n)});
      at[i] += n;
      rows += static_cast<int>(n);
      if (at[i] < extensions[i].tokens.size()) next = i;  // a sequence cut short opens the next pass
    }
    if (pass.empty()) break;
    compute_packed(pass);
  }
}

size_t KvCache::reuse(Sequence& s, std::span<const int> tokens) {
  const int kb = options_.block_tokens;
  size_t at = 0;
  // Whole blocks from the radix tree while the sequence ends on a block boundary.
  if (options_.prefix_reuse) {
    while (s.length() % kb == 0 && tokens.size() - at >= static_cast<size_t>(kb)) {
      const int parent = s.slots_.empty() ? -1 : s.nodes_.back();
      if (!s.slots_.empty() && parent < 0) break;  // after a private block nothing is shared
      stats_.lookups++;
      const int node = find(parent, tokens.subspan(at, kb));
      if (node < 0) break;
      stats_.hits++;
      Node& n = nodes_[node];
      n.users++;
      n.last_use = ++clock_;
      s.slots_.push_back(n.slot);
      s.nodes_.push_back(node);
      s.tokens_.insert(s.tokens_.end(), n.tokens.begin(), n.tokens.end());
      s.nll_.insert(s.nll_.end(), n.nll.begin(), n.nll.end());
      s.last_logits_ = n.last_logits;
      s.reused_ += kb;
      stats_.reused_tokens += kb;
      stats_.tokens += kb;
      at += kb;
    }
  }
  return at;
}

void KvCache::compute_packed(std::span<const Extension> parts) {
  if (parts.size() == 1) {  // one sequence: the plain pass
    compute(*parts[0].sequence, parts[0].tokens);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int Vp = model_.config().padded_vocab_size;
  Packed packed;
  packed.parts.assign(parts.begin(), parts.end());
  packed.out_stride = model_.config().n_embd;
  std::vector<int> inputs, p0s, firsts;  // firsts: each part's first row of the logits
  packed.select = !options_.all_logits;
  for (const Extension& e : parts) {
    const int p0 = begin_extension(*e.sequence, e.tokens);
    const int n = static_cast<int>(e.tokens.size());
    p0s.push_back(p0);
    firsts.push_back(packed.select ? static_cast<int>(packed.rows.size()) : static_cast<int>(inputs.size()));
    if (packed.select) wanted_rows(p0, n, static_cast<int>(inputs.size()), packed.rows);
    inputs.insert(inputs.end(), e.tokens.begin(), e.tokens.end());
    for (int r = 0; r < n; ++r) packed.pos.push_back(p0 + r);
  }
  check(static_cast<int>(inputs.size()) <= max_pass_, "KV cache: a packed pass longer than prefill_chunk");
  if (tiers_) tiers_->begin_step(false);
  model_.forward(Batch{inputs.data(), nullptr, 1, static_cast<int>(inputs.size()), 0.0f, &packed});
  const float* logits = model_.logits();
  for (size_t i = 0; i < parts.size(); ++i) {
    finish_extension(*parts[i].sequence, parts[i].tokens, p0s[i], logits + static_cast<int64_t>(firsts[i]) * Vp);
  }
  stats_.compute_ms += ms_since(t0);
}

void KvCache::Packed::attend(MatmulPrecision precision, int block, const float* qkv, int ldq, float* out, int n,
                             int window) {
  int row = 0;
  for (const Extension& e : parts) {
    Sequence& s = *e.sequence;
    const int m = static_cast<int>(e.tokens.size());
    s.pos0_ = pos[row];
    s.attend(precision, block, qkv + static_cast<int64_t>(row) * ldq, ldq, out + static_cast<int64_t>(row) * out_stride, m,
             window);
    row += m;
  }
  check(row == n, "KV cache: a packed pass's rows do not match its parts");
}

int KvCache::begin_extension(Sequence& s, std::span<const int> tokens) {
  const int kb = options_.block_tokens, n = static_cast<int>(tokens.size());
  const int p0 = s.length();
  // The first new token's log-likelihood comes from the logits after the last one.
  if (!options_.all_logits) {
    s.nll_.push_back(std::numeric_limits<float>::quiet_NaN());
  } else {
    s.nll_.push_back(p0 == 0 ? 0.0f : nll_of(s.last_logits_.data(), model_.config().vocab_size, tokens[0]));
  }
  s.tokens_.insert(s.tokens_.end(), tokens.begin(), tokens.end());
  while (static_cast<int>(s.slots_.size()) * kb < p0 + n) {
    s.slots_.push_back(take_slot());
    s.nodes_.push_back(-1);
  }
  return p0;
}

void KvCache::wanted_rows(int p0, int n, int base, std::vector<int>& rows) const {
  const int kb = options_.block_tokens;
  if (options_.prefix_reuse) {
    for (int b = p0 / kb; b < (p0 + n) / kb; ++b) {
      const int r = (b + 1) * kb - 1 - p0;  // the block's last row
      if (r < n - 1) rows.push_back(base + r);
    }
  }
  rows.push_back(base + n - 1);
}

void KvCache::finish_extension(Sequence& s, std::span<const int> tokens, int p0, const float* logits) {
  const int kb = options_.block_tokens, n = static_cast<int>(tokens.size());
  const int V = model_.config().vocab_size, Vp = model_.config().padded_vocab_size;
  std::vector<int> rows;  // without all_logits: the rows `logits` holds, in order
  if (options_.all_logits) {
    for (int r = 0; r + 1 < n; ++r) s.nll_.push_back(nll_of(logits + static_cast<int64_t>(r) * Vp, V, tokens[r + 1]));
  } else {
    s.nll_.insert(s.nll_.end(), static_cast<size_t>(n - 1), std::numeric_limits<float>::quiet_NaN());
    wanted_rows(p0, n, 0, rows);
  }
  auto row = [&](int r) {  // row r's logits
    if (options_.all_logits) return logits + static_cast<int64_t>(r) * Vp;
    const auto it = std::lower_bound(rows.begin(), rows.end(), r);
    check(it != rows.end() && *it == r, "KV cache: a row's logits were not computed");
    return logits + static_cast<int64_t>(it - rows.begin()) * Vp;
  };
  const float* last = row(n - 1);
  s.last_logits_.assign(last, last + V);
  if (options_.prefix_reuse) {
    for (int b = p0 / kb; b < (p0 + n) / kb; ++b) {
      if (s.nodes_[b] >= 0) continue;
      if (b > 0 && s.nodes_[b - 1] < 0) break;  // sealed blocks extend sealed blocks only
      seal(s, b, row((b + 1) * kb - 1 - p0));
    }
  }
  stats_.tokens += n;
  stats_.computed_tokens += n;
}

void KvCache::compute(Sequence& s, std::span<const int> tokens) {
  const auto t0 = std::chrono::steady_clock::now();
  const int p0 = begin_extension(s, tokens);
  s.pos0_ = p0;
  s.select_ = !options_.all_logits;
  s.rows_.clear();
  if (s.select_) wanted_rows(p0, static_cast<int>(tokens.size()), 0, s.rows_);
  if (tiers_) tiers_->begin_step(false);
  model_.forward(Batch{s.tokens_.data() + p0, nullptr, 1, static_cast<int>(tokens.size()), 0.0f, &s});
  finish_extension(s, tokens, p0, model_.logits());
  stats_.compute_ms += ms_since(t0);
}

void KvCache::Sequence::attend(MatmulPrecision precision, int block, const float* qkv, int ldq, float* out, int n,
                               int window) {
  KvCache& c = cache_;
  const ModelConfig& m = c.model_.config();
  const int kb = c.options_.block_tokens, kv = c.kv_dim_, C = m.n_embd;
  const int first = (window > 0 ? std::max(0, pos0_ - window + 1) : 0) / kb, last = (pos0_ + n - 1) / kb;
  const int written_from = pos0_ / kb;
  std::vector<PageRef> read, written;
  for (int b = first; b <= last; ++b) {
    (b >= written_from ? written : read).push_back(PageRef{c.chunk_of(block, slots_[b]), Plane::param});
  }
  const PageLease lease(&c.store_->residency(), read, written);
  if (c.tiers_ && block + 1 < c.layers_) {  // the next layer's blocks, fetched while this one computes
    std::vector<PageRef> next;
    for (int b = first; b <= last; ++b) next.push_back(PageRef{c.chunk_of(block + 1, slots_[b]), Plane::param});
    c.store_->residency().hint(next);
  }
  std::vector<const float*> pages(static_cast<size_t>(last) + 1, nullptr);
  for (int b = first; b <= last; ++b) pages[b] = c.store_->chunk_view(c.chunk_of(block, slots_[b]), Plane::param).data();
  for (int r = 0; r < n; ++r) {
    const int p = pos0_ + r;
    float* page = const_cast<float*>(pages[p / kb]);
    const float* row = qkv + static_cast<int64_t>(r) * ldq;
    std::memcpy(page + static_cast<int64_t>(p % kb) * kv, row + C, sizeof(float) * kv);                     // key
    std::memcpy(page + static_cast<int64_t>(kb + p % kb) * kv, row + C + kv, sizeof(float) * kv);         // value
  }
  ops::paged_attention_forward(precision, out, qkv, ldq, n, pos0_, pages.data(), kb, m.n_head, m.n_kv_head,
                               m.head_size(), window);
}

std::string KvCache::summary() const {
  const KvCacheStats& s = stats_;
  char line[512];
  std::snprintf(line, sizeof line,
                "KV cache: %llu sequences, %llu tokens (%llu reused from %llu of %llu blocks looked up, %llu computed "
                "in %.0f ms), %llu blocks sealed, %llu evicted; pool %d blocks of %d tokens (%.1f MiB), %d free",
                static_cast<unsigned long long>(s.sequences), static_cast<unsigned long long>(s.tokens),
                static_cast<unsigned long long>(s.reused_tokens), static_cast<unsigned long long>(s.hits),
                static_cast<unsigned long long>(s.lookups), static_cast<unsigned long long>(s.computed_tokens), s.compute_ms,
                static_cast<unsigned long long>(s.sealed), static_cast<unsigned long long>(s.evicted), slots_,
                options_.block_tokens, static_cast<double>(slots_) * slot_bytes_ / (1 << 20), free_slots());
  std::string out = line;
  if (tiers_) {
    const TierStats& t = tiers_->stats();
    const Tier home = options_.tier == KvTier::host ? Tier::host : Tier::nvme;
    const TierCounters& h = t.tier[static_cast<int>(home)];
    std::snprintf(line, sizeof line, "; tiers: device %.1f MiB budget, %s-homed hit rate %.3f, %.1f MiB fetched, %.1f MiB written back, %.1f ms stalled",
                  static_cast<double>(options_.device_bytes) / (1 << 20), tier_name(home), h.hit_rate(),
                  static_cast<double>(h.bytes_read) / (1 << 20), static_cast<double>(h.bytes_written) / (1 << 20), h.stall_ms);
    out += line;
  }
  return out;
}

}  // namespace keel
