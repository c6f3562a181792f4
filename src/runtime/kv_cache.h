// The KV cache of inference: every transformer block's keys and values of a sequence, kept in
// paged blocks of `block_tokens` tokens so that a new token costs one pass over the new token
// instead of the whole context, and shared between sequences through a radix tree of blocks.
//
// Blocks. The cache owns a pool of slots; slot s holds, for each block l of the model, the keys
// and values of block_tokens positions ([2][block_tokens][kv_dim] floats: keys, then values).
// The pool is a chunk store of its own (one chunk per (layer, slot)), so that with
// `device_bytes` set the tier manager (store/tiers.h) keeps only that much of it present: every
// slot's pages live in host DRAM or an NVMe file (`tier`), the blocks a pass touches are fetched
// and pinned while it runs, the next layer's blocks are hinted (prefetched) while the current
// layer computes, and the least recently used are evicted. A sliding window never touches the
// blocks before it, so they age out of memory first. Without `device_bytes` every slot stays in
// memory.
//
// Prefix reuse. A full block is sealed into a radix tree: its key is its tokens and its parent
// (the block before it, sealed too), so a node stands for the whole prefix up to its end; lookups
// compare the tokens, never a hash alone. A sequence extended by tokens whose whole blocks are
// in the tree takes those blocks (their keys and values, the log-likelihood of each of their
// tokens, and the logits after their last token) instead of computing them. Nodes hold a count
// of the sequences using them; when the pool is full, the least recently used node that no
// sequence uses and no other node extends is evicted.
//
// What the cache computes is what the model computes on the whole window (the same kernels on
// the same numbers, summed in tile order), to within float rounding: greedy generation through
// it gives the tokens uncached generation gives (runtime/generate.h), and a reused prefix gives
// the log-likelihoods computing it again would (tested in tests/kv_cache_test.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/config.h"
#include "model/gpt.h"
#include "model/kv_context.h"
#include "store/chunk_store.h"
#include "store/tiered_memory.h"
#include "store/tiers.h"

namespace keel {

struct KvCacheOptions {
  int block_tokens = 64;        // tokens per block
  int64_t cache_bytes = 1LL << 30;  // the pool, all tiers together (rounded down to whole slots)
  int64_t device_bytes = 0;     // 0: every block in memory; else the tier manager's device budget
  KvTier tier = KvTier::host;   // home of the blocks beyond device_bytes: host | nvme
  std::string nvme_dir;         // tier = nvme: directory of the tier's file
  bool prefix_reuse = true;     // seal full blocks into the radix tree and reuse them
  int prefill_chunk = 256;      // tokens per model pass when a sequence is extended by many
  // false: a pass computes the logits of the rows that need them only (each extension's last row,
  // and the last row of each block it may seal for reuse), not of every new token: what
  // generation needs (it samples after the last token). Sequence::nll() is then NaN.
  bool all_logits = true;
  // The same from the [generate] section of a configuration.
  static KvCacheOptions from(const GenerateConfig& g);
};

struct KvCacheStats {
  uint64_t sequences = 0;
  uint64_t tokens = 0;           // positions appended to sequences
  uint64_t reused_tokens = 0;    // ... taken from sealed blocks (not computed)
  uint64_t computed_tokens = 0;  // ... computed by the model
  uint64_t lookups = 0;          // full blocks looked up in the radix tree
  uint64_t hits = 0;             // ... found
  uint64_t sealed = 0;           // blocks sealed into the tree
  uint64_t evicted = 0;          // sealed blocks evicted to free their slot
  double compute_ms = 0;         // model passes
};

class KvCache {
 public:
  // For `model` (whole, allocated for batch 1 and at least one token; the cache uses passes of up
  // to its allocated length). Throws keel::Error naming the option when the pool cannot hold one
  // block, the budget cannot hold one layer's blocks of a pass, or the NVMe file cannot be made.
  KvCache(GPT& model, const KvCacheOptions& options);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // One sequence's view of the cache: its tokens, its blocks, what the model made of them.
  class Sequence final : public KvContext {
   public:
    ~Sequence() override;
    int length() const { return static_cast<int>(tokens_.size()); }
    const std::vector<int>& tokens() const { return tokens_; }
    // -log p(token[p] | tokens before p) for p >= 1 (0 for p = 0); NaN without all_logits.
    const std::vector<float>& nll() const { return nll_; }
    // The logits [vocab_size] after the last token.
    const std::vector<float>& last_logits() const { return last_logits_; }
    uint64_t reused_tokens() const { return reused_; }
    int pos0() const override { return pos0_; }
    const std::vector<int>* logit_rows() const override { return select_ ? &rows_ : nullptr; }
    void attend(MatmulPrecision precision, int block, const float* qkv, int ldq, float* out, int n,
                int window) override;

   private:
    friend class KvCache;
    explicit Sequence(KvCache& cache) : cache_(cache) {}
    KvCache& cache_;
    std::vector<int> tokens_;
    std::vector<float> nll_, last_logits_;
    std::vector<int> slots_;  // per block of the sequence
    std::vector<int> nodes_;  // per block: its node in the radix tree, -1 while private
    int pos0_ = 0;            // first position of the pass running now
    std::vector<int> rows_;   // the pass's rows whose logits it computes (when select_)
    bool select_ = false;
    uint64_t reused_ = 0;
  };

  std::unique_ptr<Sequence> open();
  // What extend_many() appends to one sequence.
  struct Extension {
    Sequence* sequence;
    std::span<const int> tokens;  // non-empty
  };
  // Appends to several distinct sequences at once (batched generation): each first takes whole
  // blocks from the radix tree as extend() does, then their remaining tokens are packed side by
  // side into passes of up to prefill_chunk tokens in all (a sequence's tokens in order, split
  // over passes when they do not fit), so that B sequences' next tokens cost one pass of B rows.
  // Each sequence ends as extend() would leave it, to within float rounding (each row is the same
  // products over the same cached keys).
  void extend_many(std::span<const Extension> extensions);
  // Appends `tokens` (non-empty) to the sequence: whole blocks found in the radix tree are taken
  // from it (while the sequence ends on a block boundary), the rest is computed in passes of up
  // to prefill_chunk tokens. Throws keel::Error when the pool has no free slot left, or the
  // sequence would pass the model's position table.
  void extend(Sequence& s, std::span<const int> tokens);

  const KvCacheOptions& options() const { return options_; }
  int slots() const { return slots_; }
  int64_t slot_bytes() const { return slot_bytes_; }  // all layers' pages of one slot
  int free_slots() const { return static_cast<int>(free_.size()); }
  const KvCacheStats& stats() const { return stats_; }
  // The tier manager's counters (null without device_bytes).
  const TierManager* tiers() const { return tiers_.get(); }
  // One line: reuse, blocks, tiers.
  std::string summary() const;

 private:
  struct Node {
    int parent = -1, slot = -1, users = 0, children = 0;
    uint64_t last_use = 0;
    std::vector<int> tokens;         // block_tokens of them
    std::vector<float> nll;          // of each token, given everything before it
    std::vector<float> last_logits;  // after the block's last token
    bool live = false;
  };
  uint64_t key(int parent, std::span<const int> tokens) const;
  int find(int parent, std::span<const int> tokens) const;
  int take_slot();
  void free_slot(int slot);
  void release_node(int node);
  void seal(Sequence& s, int block, const float* logits_row);
  void compute(Sequence& s, std::span<const int> tokens);
  // Before a pass computes `tokens` of `s` (alone or packed): the first token's log-likelihood from
  // the logits after the last one, the tokens recorded, blocks taken. Returns the first position.
  int begin_extension(Sequence& s, std::span<const int> tokens);
  // The rows (of `s`'s n = tokens.size() rows, first at position p0) whose logits the pass must
  // compute without all_logits, appended to `rows` shifted by `base`: the last, and the last of
  // each block that may be sealed.
  void wanted_rows(int p0, int n, int base, std::vector<int>& rows) const;
  // After it: the log-likelihoods from the pass's rows `logits` (`s`'s, first at position p0), the
  // last row's logits kept, full blocks sealed for reuse, the statistics counted. `logits` holds
  // every row of `s`, or (without all_logits) the rows wanted_rows(p0, n, 0, ...) gave, in order.
  void finish_extension(Sequence& s, std::span<const int> tokens, int p0, const float* logits);
  size_t reuse(Sequence& s, std::span<const int> tokens);
  void compute_packed(std::span<const Extension> parts);
  // The context of a packed pass: each part's rows attend over their own sequence's blocks.
  class Packed final : public KvContext {
   public:
    std::vector<Extension> parts;
    std::vector<int> pos;  // per row
    int pos0() const override { return pos.empty() ? 0 : pos[0]; }
    const int* positions() const override { return pos.data(); }
    const std::vector<int>* logit_rows() const override { return select ? &rows : nullptr; }
    std::vector<int> rows;  // without all_logits: the rows whose logits the pass computes
    bool select = false;
    void attend(MatmulPrecision precision, int block, const float* qkv, int ldq, float* out, int n, int window) override;
    int out_stride = 0;
  };
  int chunk_of(int layer, int slot) const { return layer * slots_ + slot; }
  void close(Sequence& s);

  GPT& model_;
  KvCacheOptions options_;
  int layers_ = 0, kv_dim_ = 0, slots_ = 0, max_pass_ = 0;
  int64_t slot_bytes_ = 0;
  std::unique_ptr<ChunkStore> store_;
  std::unique_ptr<TierManager> tiers_;
  std::unique_ptr<TierResidency> residency_;
  std::vector<int> free_;
  std::vector<Node> nodes_;
  std::vector<int> free_nodes_;
  std::unordered_multimap<uint64_t, int> index_;  // key -> node
  uint64_t clock_ = 0;
  KvCacheStats stats_;
};

}  // namespace keel
