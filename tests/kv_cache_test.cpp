// The KV cache (runtime/kv_cache.h): cached passes compute what whole-window passes compute,
// greedy cached generation gives the tokens uncached generation gives, reused prefixes give the
// log-likelihoods computing them again gives, tiered blocks give the very same bytes as blocks
// kept in memory, and the pool evicts what no sequence uses. Both families, with and without
// grouped-query heads and sliding windows; the licences in /usr/share/common-licenses (long
// documents, several sharing their text) through `keel score`.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "runtime/generate.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

namespace keel {
namespace {

struct Model {
  ModelConfig config;
  std::unique_ptr<ChunkStore> store;
  std::unique_ptr<GPT> gpt;
};

// A model whose logits are far from uniform (weights scaled up), so greedy choices have margins
// well above float rounding.
Model make_model(const std::string& preset, const std::string& window = "", int n_kv_head = 0, int T = 96,
                 bool bf16 = false) {
  Config c;
  c.model.preset = preset;
  c.model.vocab_size = 96;
  c.model.max_seq_len = T;
  c.model.attention_window = window;
  if (n_kv_head > 0) c.model.n_kv_head = n_kv_head;
  c.train.seq_len = T;
  c.resolve(1);
  Model m;
  m.config = c.model;
  m.store = std::make_unique<ChunkStore>(1 << 20);
  m.gpt = bf16 ? std::make_unique<GPT>(m.config, *m.store, std::vector<LayerRange>{}, false,
                                       MathMode::uniform(MatmulPrecision::bf16))
              : std::make_unique<GPT>(m.config, *m.store);
  m.store->finalize();
  m.gpt->init_weights(11);
  for (float& w : m.store->range_view(Plane::param, 0, m.store->numel())) w *= 4.0f;
  m.gpt->allocate(1, T);
  return m;
}

std::vector<int> random_tokens(int n, int V, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> t(n);
  for (int& x : t) x = static_cast<int>(rng.below(V));
  return t;
}

// Log-likelihoods of every token of `tokens` from one whole-window pass (no cache).
std::vector<float> window_nll(GPT& model, const std::vector<int>& tokens) {
  const int n = static_cast<int>(tokens.size()), V = model.config().vocab_size, Vp = model.config().padded_vocab_size;
  model.forward(Batch{tokens.data(), nullptr, 1, n, 0.0f});
  std::vector<float> nll(n, 0.0f);
  for (int p = 1; p < n; ++p) {
    const float* row = model.logits() + static_cast<int64_t>(p - 1) * Vp;
    const float mx = *std::max_element(row, row + V);
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - mx);
    nll[p] = static_cast<float>(std::log(sum) + mx - row[tokens[p]]);
  }
  return nll;
}

struct Case {
  std::string preset, window;
  int n_kv_head;
};

class KvCacheModels : public ::testing::TestWithParam<Case> {};

TEST_P(KvCacheModels, CachedPassesMatchWholeWindowPasses) {
  const Case& k = GetParam();
  Model m = make_model(k.preset, k.window, k.n_kv_head);
  const std::vector<int> tokens = random_tokens(90, 96, 3);
  const std::vector<float> want = window_nll(*m.gpt, tokens);
  for (int block : {1, 7, 16, 64}) {
    for (int chunk : {1, 5, 90}) {
      KvCacheOptions o;
      o.block_tokens = block;
      o.prefill_chunk = chunk;
      o.cache_bytes = 64 << 20;
      KvCache cache(*m.gpt, o);
      auto seq = cache.open();
      cache.extend(*seq, std::span<const int>(tokens).subspan(0, 50));
      cache.extend(*seq, std::span<const int>(tokens).subspan(50));
      ASSERT_EQ(seq->length(), 90);
      for (int p = 1; p < 90; ++p) {
        ASSERT_NEAR(seq->nll()[p], want[p], 2e-4 * (1 + std::abs(want[p]))) << "block " << block << " chunk " << chunk << " p " << p;
      }
    }
  }
}

TEST_P(KvCacheModels, GreedyCachedGenerationGivesTheUncachedTokens) {
  const Case& k = GetParam();
  Model m = make_model(k.preset, k.window, k.n_kv_head);
  const std::vector<int> prompt = random_tokens(13, 96, 4);
  SampleOptions o;
  o.max_new_tokens = 80;  // 93 tokens: inside the context of 96
  o.temperature = 0;
  Rng r1(1), r2(1);
  const std::vector<int> uncached = generate(*m.gpt, 96, prompt, o, r1);
  KvCacheOptions ko;
  ko.block_tokens = 16;
  ko.cache_bytes = 16 << 20;
  KvCache cache(*m.gpt, ko);
  const std::vector<int> cached = generate_cached(cache, 96, prompt, o, r2);
  EXPECT_EQ(cached, uncached);
  // Not a degenerate repetition: the model's choices vary.
  EXPECT_GT(std::set<int>(uncached.begin() + 13, uncached.end()).size(), 5u);
}

// Packed passes (several sequences side by side, KvCache::extend_many) leave each sequence as
// extending it alone does: the same log-likelihoods and last logits, to within float rounding.
TEST_P(KvCacheModels, PackedPassesMatchSequencesAlone) {
  const Case& k = GetParam();
  Model m = make_model(k.preset, k.window, k.n_kv_head);
  std::vector<std::vector<int>> docs;
  for (int i = 0; i < 5; ++i) docs.push_back(random_tokens(7 + 17 * i, 96, 20 + i));
  for (int chunk : {5, 96}) {
    KvCacheOptions o;
    o.block_tokens = 16;
    o.prefill_chunk = chunk;
    o.cache_bytes = 64 << 20;
    KvCache alone(*m.gpt, o), packed(*m.gpt, o);
    std::vector<std::unique_ptr<KvCache::Sequence>> a, p;
    std::vector<KvCache::Extension> ext;
    for (const auto& d : docs) {
      a.push_back(alone.open());
      alone.extend(*a.back(), d);
      p.push_back(packed.open());
      ext.push_back(KvCache::Extension{p.back().get(), d});
    }
    packed.extend_many(ext);
    for (size_t i = 0; i < docs.size(); ++i) {
      ASSERT_EQ(p[i]->tokens(), docs[i]);
      for (size_t t = 1; t < docs[i].size(); ++t) {
        ASSERT_NEAR(p[i]->nll()[t], a[i]->nll()[t], 2e-4 * (1 + std::abs(a[i]->nll()[t]))) << "chunk " << chunk << " doc " << i;
      }
      for (int v = 0; v < 96; ++v) ASSERT_NEAR(p[i]->last_logits()[v], a[i]->last_logits()[v], 2e-4 * (1 + std::abs(a[i]->last_logits()[v])));
    }
    // One token more for each, side by side (a decode step), as alone.
    ext.clear();
    const std::vector<int> more = random_tokens(5, 96, 9);
    for (size_t i = 0; i < docs.size(); ++i) {
      alone.extend(*a[i], std::span<const int>(&more[i], 1));
      ext.push_back(KvCache::Extension{p[i].get(), std::span<const int>(&more[i], 1)});
    }
    packed.extend_many(ext);
    for (size_t i = 0; i < docs.size(); ++i) {
      const size_t t = docs[i].size();
      ASSERT_NEAR(p[i]->nll()[t], a[i]->nll()[t], 2e-4 * (1 + std::abs(a[i]->nll()[t])));
      for (int v = 0; v < 96; ++v) ASSERT_NEAR(p[i]->last_logits()[v], a[i]->last_logits()[v], 2e-4 * (1 + std::abs(a[i]->last_logits()[v])));
    }
  }
}

// Without all_logits a pass computes the head for the rows that need it only (each extension's
// last row and the last rows of blocks it seals): the last logits are those of a cache that
// computes every row, alone and packed, over reused prefixes too; the log-likelihoods are NaN;
// greedy generation gives the uncached tokens.
TEST_P(KvCacheModels, LogitsOnlyWhereSampledGiveTheSameLastLogits) {
  const Case& k = GetParam();
  Model m = make_model(k.preset, k.window, k.n_kv_head);
  std::vector<std::vector<int>> docs;
  for (int i = 0; i < 4; ++i) docs.push_back(random_tokens(9 + 19 * i, 96, 60 + i));
  docs.push_back(docs[3]);  // the same document again: its sealed blocks are reused
  docs[4].resize(40);
  for (int chunk : {5, 96}) {
    KvCacheOptions o;
    o.block_tokens = 16;
    o.prefill_chunk = chunk;
    o.cache_bytes = 64 << 20;
    KvCacheOptions sel = o;
    sel.all_logits = false;
    KvCache all(*m.gpt, o), alone(*m.gpt, sel), packed(*m.gpt, sel);
    std::vector<std::unique_ptr<KvCache::Sequence>> a, s, p;
    std::vector<KvCache::Extension> ext;
    for (const auto& d : docs) {
      a.push_back(all.open());
      all.extend(*a.back(), d);
      s.push_back(alone.open());
      alone.extend(*s.back(), d);
      p.push_back(packed.open());
      ext.push_back(KvCache::Extension{p.back().get(), d});
    }
    packed.extend_many(ext);
    EXPECT_GT(alone.stats().reused_tokens, 0u) << "the repeated document should reuse sealed blocks";
    for (size_t i = 0; i < docs.size(); ++i) {
      for (const auto* q : {s[i].get(), p[i].get()}) {
        ASSERT_EQ(q->tokens(), docs[i]);
        EXPECT_TRUE(std::isnan(q->nll().back()));
        for (int v = 0; v < 96; ++v) {
          ASSERT_NEAR(q->last_logits()[v], a[i]->last_logits()[v], 2e-4 * (1 + std::abs(a[i]->last_logits()[v])))
              << "chunk " << chunk << " doc " << i;
        }
      }
    }
  }
  const std::vector<int> prompt = random_tokens(21, 96, 4);
  SampleOptions so;
  so.max_new_tokens = 70;
  so.temperature = 0;
  Rng r1(1), r2(1);
  const std::vector<int> uncached = generate(*m.gpt, 96, prompt, so, r1);
  KvCacheOptions ko;
  ko.block_tokens = 16;
  ko.cache_bytes = 16 << 20;
  ko.all_logits = false;
  KvCache cache(*m.gpt, ko);
  EXPECT_EQ(generate_cached(cache, 96, prompt, so, r2), uncached);
}

// Batched generation (continuous batching) gives each prompt the tokens generate_cached gives it
// alone with Rng(prompt_seed(seed, i)): greedy and sampled, float32 and bf16, batches smaller and
// larger than the prompt count, prompts of different lengths that stop at different times and
// run past the context (so that sequences start again from their most recent half).
TEST_P(KvCacheModels, BatchedGenerationGivesEachPromptItsTokensAlone) {
  const Case& k = GetParam();
  for (bool bf16 : {false, true}) {
    Model m = make_model(k.preset, k.window, k.n_kv_head, 96, bf16);
    std::vector<std::vector<int>> prompts;
    for (int i = 0; i < 7; ++i) prompts.push_back(random_tokens(3 + 6 * i, 96, 40 + i));
    const int context = 48;
    for (double temperature : {0.0, 0.9}) {
      SampleOptions o;
      o.max_new_tokens = 30;
      o.temperature = temperature;
      o.top_k = 20;
      o.stop_token = 7;
      KvCacheOptions ko;
      ko.block_tokens = 16;
      ko.cache_bytes = 32 << 20;
      std::vector<std::vector<int>> want;
      {
        KvCache cache(*m.gpt, ko);
        for (int i = 0; i < 7; ++i) {
          Rng rng(prompt_seed(5, i));
          want.push_back(generate_cached(cache, context, prompts[i], o, rng));
        }
      }
      std::set<size_t> lengths;
      for (const auto& w : want) lengths.insert(w.size());
      EXPECT_GT(lengths.size(), 2u) << "the prompts should finish at different lengths";
      for (int batch : {1, 3, 7, 16}) {
        KvCache cache(*m.gpt, ko);
        std::vector<std::vector<int>> got(7);
        std::vector<int> order;
        generate_batched(cache, context, prompts, batch, o, 5, [&](int i, const std::vector<int>& t, uint64_t) {
          got.at(i) = t;
          order.push_back(i);
        });
        ASSERT_EQ(order.size(), 7u);
        for (int i = 0; i < 7; ++i) {
          EXPECT_EQ(got[i], want[i]) << "prompt " << i << " batch " << batch << " temperature " << temperature << " bf16 " << bf16;
        }
      }
    }
  }
}

TEST(KvCache, BatchedGenerationRefusesBadInput) {
  Model m = make_model("tiny");
  KvCacheOptions ko;
  ko.cache_bytes = 16 << 20;
  KvCache cache(*m.gpt, ko);
  SampleOptions o;
  auto none = [](int, const std::vector<int>&, uint64_t) {};
  EXPECT_THROW(generate_batched(cache, 48, {random_tokens(5, 96, 1)}, 0, o, 1, none), Error);
  EXPECT_THROW(generate_batched(cache, 48, {random_tokens(49, 96, 1)}, 2, o, 1, none), Error);
  EXPECT_THROW(generate_batched(cache, 48, {std::vector<int>{}}, 2, o, 1, none), Error);
}

INSTANTIATE_TEST_SUITE_P(Families, KvCacheModels,
                         ::testing::Values(Case{"tiny", "", 0}, Case{"tiny", "20", 0}, Case{"llama-tiny", "", 0},
                                           Case{"llama-tiny", "", 1}, Case{"llama-tiny", "0-0:24", 4}),
                         [](const auto& info) {
                           std::string name = info.param.preset + (info.param.window.empty() ? "" : "_window") +
                                              (info.param.n_kv_head ? "_kv" + std::to_string(info.param.n_kv_head) : "");
                           for (char& c : name) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return name;
                         });

TEST(KvCache, SharedPrefixesAreReusedAndGiveTheSameLikelihoods) {
  Model m = make_model("llama-tiny");
  std::vector<int> a = random_tokens(80, 96, 5), b = a;
  for (int p = 50; p < 80; ++p) b[p] = (a[p] + 1) % 96;  // b shares a's first 50 tokens
  KvCacheOptions o;
  o.block_tokens = 16;
  o.prefill_chunk = 32;
  o.cache_bytes = 16 << 20;
  KvCache cache(*m.gpt, o);
  { auto s = cache.open(); cache.extend(*s, a); EXPECT_EQ(s->reused_tokens(), 0u); }
  auto s = cache.open();
  cache.extend(*s, b);
  EXPECT_EQ(s->reused_tokens(), 48u);  // three whole blocks of 16
  EXPECT_EQ(cache.stats().hits, 3u);
  const std::vector<float> want = window_nll(*m.gpt, b);
  for (int p = 1; p < 80; ++p) ASSERT_NEAR(s->nll()[p], want[p], 2e-4 * (1 + std::abs(want[p]))) << p;
  // A prompt that is all cached blocks still has its next-token logits.
  auto s2 = cache.open();
  cache.extend(*s2, std::span<const int>(a).subspan(0, 64));
  EXPECT_EQ(s2->reused_tokens(), 64u);
  m.gpt->forward(Batch{a.data(), nullptr, 1, 64, 0.0f});
  const float* row = m.gpt->logits() + static_cast<int64_t>(63) * m.config.padded_vocab_size;
  for (int v = 0; v < 96; ++v) ASSERT_NEAR(s2->last_logits()[v], row[v], 1e-3 * (1 + std::abs(row[v])));
  // Without reuse nothing is looked up.
  o.prefix_reuse = false;
  KvCache plain(*m.gpt, o);
  { auto t = plain.open(); plain.extend(*t, a); }
  auto t = plain.open();
  plain.extend(*t, b);
  EXPECT_EQ(t->reused_tokens(), 0u);
  EXPECT_EQ(plain.stats().lookups, 0u);
}

TEST(KvCache, TieredBlocksGiveTheSameBytesAsBlocksInMemory) {
  Model m = make_model("llama-tiny", "", 0, 512);
  const std::vector<int> tokens = random_tokens(500, 96, 6);
  KvCacheOptions o;
  o.block_tokens = 16;
  o.prefill_chunk = 64;
  o.cache_bytes = 8 << 20;
  auto run = [&](const KvCacheOptions& opts, std::string* summary) {
    KvCache cache(*m.gpt, opts);
    auto s = cache.open();
    cache.extend(*s, std::span<const int>(tokens).subspan(0, 300));
    for (int p = 300; p < 500; ++p) cache.extend(*s, std::span<const int>(tokens).subspan(p, 1));
    if (summary) *summary = cache.summary();
    if (cache.tiers() != nullptr) {
      const TierStats& t = cache.tiers()->stats();
      const TierCounters& home = t.tier[static_cast<int>(opts.tier == KvTier::host ? Tier::host : Tier::nvme)];
      EXPECT_GT(home.bytes_read, 0u) << "blocks were never fetched back: the budget held them all";
      EXPECT_GT(t.evictions, 0u);
      EXPECT_LE(t.peak_device_bytes, opts.device_bytes);
    }
    return std::make_pair(s->nll(), s->last_logits());
  };
  const auto in_memory = run(o, nullptr);
  testing::TempDir dir;
  o.device_bytes = 160 << 10;  // the blocks of a few layers' passes; the sequence needs 512 KiB
  for (const std::string tier : {"host", "nvme"}) {
    o.tier = parse_enum<KvTier>(tier, "generate.kv_tier");
    o.nvme_dir = dir.path();
    std::string summary;
    const auto tiered = run(o, &summary);
    std::printf("%s\n", summary.c_str());
    EXPECT_EQ(tiered.first, in_memory.first) << tier;  // bit-identical
    EXPECT_EQ(tiered.second, in_memory.second) << tier;
  }
}

TEST(KvCache, FullPoolEvictsUnusedBlocksAndRefusesWhenNoneIsFree) {
  Model m = make_model("tiny");
  KvCacheOptions o;
  o.block_tokens = 8;
  o.cache_bytes = 1;  // below one block
  EXPECT_NE(testing::error_of([&] { KvCache c(*m.gpt, o); }).find("generate.kv_cache_mib"), std::string::npos);
  KvCacheOptions p = o;
  p.cache_bytes = 1 << 20;
  o.cache_bytes = KvCache(*m.gpt, p).slot_bytes() * 12;  // 12 blocks = 96 tokens
  KvCache cache(*m.gpt, o);
  ASSERT_EQ(cache.slots(), 12);
  for (uint64_t d = 0; d < 5; ++d) {  // 5 documents of 64 tokens: 40 blocks through 12 slots
    const std::vector<int> doc = random_tokens(64, 96, 100 + d);
    auto s = cache.open();
    cache.extend(*s, doc);
    const std::vector<float> want = window_nll(*m.gpt, doc);
    for (int p = 1; p < 64; ++p) ASSERT_NEAR(s->nll()[p], want[p], 2e-4 * (1 + std::abs(want[p])));
  }
  EXPECT_GT(cache.stats().evicted, 0u);
  auto a = cache.open(), b = cache.open();
  cache.extend(*a, random_tokens(64, 96, 1));
  const std::string err = testing::error_of([&] { cache.extend(*b, random_tokens(64, 96, 2)); });
  EXPECT_NE(err.find("generate.kv_cache_mib"), std::string::npos) << err;
}

// keel score over the licences: a tokenizer and a small model trained on them, then every licence
// scored through the cache. GPL, LGPL and GFDL are links to GPL-3, LGPL-3 and GFDL-1.3: their
// whole blocks come from the cache, and their losses equal their targets'.
TEST(KvCache, ScoresTheLicencesWithReuse) {
  testing::TempDir dir;
  const std::string d = dir.path();
  ASSERT_EQ(testing::run_keel("tokenize --input /usr/share/common-licenses --out " + d + "/data --vocab-size 512").exit_code, 0);
  const std::string train = "train --set model.preset=llama-tiny --set model.max_seq_len=256 --set train.seq_len=256 "
                            "--set train.batch_size=2 --set train.steps=20 --set train.sample_tokens=0 --set train.eval_batches=1 "
                            "--set data.train=" + d + "/data/train.bin --set data.val=" + d + "/data/val.bin --set data.tokenizer=" + d +
                            "/data/tokenizer.json --set train.run_dir=" + d + "/run";
  const testing::CommandResult t = testing::run_keel(train);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const std::string ckpt = testing::newest_checkpoint(d + "/run/ckpt");
  const testing::CommandResult s = testing::run_keel("score --checkpoint " + ckpt + " --documents /usr/share/common-licenses --set generate.kv_block=32");
  ASSERT_EQ(s.exit_code, 0) << s.output;
  std::map<std::string, nlohmann::json> docs;
  nlohmann::json summary;
  std::istringstream lines(s.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("event")) {
      summary = j;
    } else {
      docs[std::filesystem::path(j.at("document").get<std::string>()).filename().string()] = j;
    }
  }
  ASSERT_GE(docs.size(), 15u) << s.output;
  for (const auto& [link, target] : std::map<std::string, std::string>{{"GPL", "GPL-3"}, {"LGPL", "LGPL-3"}, {"GFDL", "GFDL-1.3"}}) {
    ASSERT_TRUE(docs.count(link) && docs.count(target)) << link;
    const nlohmann::json &a = docs[link], &b = docs[target];
    EXPECT_EQ(a.at("tokens"), b.at("tokens"));
    EXPECT_NEAR(a.at("loss").get<double>(), b.at("loss").get<double>(), 1e-5) << link;
    // The later of the two (in sorted order) reused every whole block of every window.
    const nlohmann::json& later = link < target ? b : a;
    const int64_t tokens = later.at("tokens").get<int64_t>(), windows = (tokens + 255) / 256;
    EXPECT_GE(later.at("reused_tokens").get<int64_t>(), tokens - windows * 32) << link;
  }
  EXPECT_GT(summary.at("reused_tokens").get<int64_t>(), 5000);
  EXPECT_GT(summary.at("saved_ms").get<double>(), 0.0);
  std::printf("%s\n", summary.dump().c_str());
  // --batch 5: windows scored side by side give each document the same loss.
  const testing::CommandResult s5 = testing::run_keel("score --checkpoint " + ckpt +
                                                      " --documents /usr/share/common-licenses --set generate.kv_block=32 --batch 5");
  ASSERT_EQ(s5.exit_code, 0) << s5.output;
  std::istringstream lines5(s5.output);
  size_t compared = 0;
  for (std::string line; std::getline(lines5, line);) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("event")) continue;
    const nlohmann::json& one = docs.at(std::filesystem::path(j.at("document").get<std::string>()).filename().string());
    EXPECT_EQ(j.at("tokens"), one.at("tokens"));
    EXPECT_NEAR(j.at("loss").get<double>(), one.at("loss").get<double>(), 1e-5) << line;
    ++compared;
  }
  EXPECT_EQ(compared, docs.size());
  // keel generate --prompts --batch: each prompt's sampled text whatever the batch.
  {
    std::ofstream prompts(d + "/prompts.txt");
    for (const char* p : {"This License", "the GNU General Public License", "You may", "Copyright (C) 2007 Free Software",
                          "Permission is granted", "THE SOFTWARE"}) {
      prompts << p << "\n";
    }
  }
  std::vector<std::string> texts;
  for (int batch : {1, 4, 6}) {
    const testing::CommandResult g = testing::run_keel("generate --checkpoint " + ckpt + " --prompts " + d +
                                                       "/prompts.txt --tokens 12 --temperature 0.9 --top-k 5 --batch " + std::to_string(batch));
    ASSERT_EQ(g.exit_code, 0) << g.output;
    std::istringstream glines(g.output);
    std::string all;
    int index = 0;
    for (std::string line; std::getline(glines, line);) {
      if (line.empty() || line[0] != '{') continue;
      const nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_EQ(j.at("prompt").get<int>(), index++);
      all += j.at("text").get<std::string>() + "\n";
    }
    EXPECT_EQ(index, 6) << g.output;
    texts.push_back(all);
  }
  EXPECT_EQ(texts[1], texts[0]);
  EXPECT_EQ(texts[2], texts[0]);
  {
    std::ofstream empty(d + "/empty.txt");
  }
  const testing::CommandResult no_prompt = testing::run_keel("generate --checkpoint " + ckpt + " --prompts " + d + "/empty.txt");
  EXPECT_NE(no_prompt.exit_code, 0);
  EXPECT_NE(no_prompt.output.find("holds no prompt"), std::string::npos) << no_prompt.output;
  const testing::CommandResult zero = testing::run_keel("generate --checkpoint " + ckpt + " --prompts " + d + "/prompts.txt --batch 0");
  EXPECT_NE(zero.exit_code, 0);
  EXPECT_NE(zero.output.find("--batch expected >= 1"), std::string::npos) << zero.output;
  {
    std::ofstream longer(d + "/long.txt");
    for (int i = 0; i < 200; ++i) longer << "the GNU General Public License ";
    longer << "\n";
  }
  const testing::CommandResult too_long = testing::run_keel("generate --checkpoint " + ckpt + " --prompts " + d + "/long.txt");
  EXPECT_NE(too_long.exit_code, 0);
  EXPECT_NE(too_long.output.find("is longer than the model's context of 256 tokens"), std::string::npos) << too_long.output;
  // Bad input: one line, non-zero exit.
  const testing::CommandResult bad = testing::run_keel("score --checkpoint " + ckpt + " --documents " + d + "/missing");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("is not a directory"), std::string::npos) << bad.output;
  const testing::CommandResult bad_set = testing::run_keel("score --checkpoint " + ckpt + " --documents " + d + " --set generate.kv_block=0");
  EXPECT_NE(bad_set.exit_code, 0);
  EXPECT_NE(bad_set.output.find("generate.kv_block"), std::string::npos) << bad_set.output;
}

}  // namespace
}  // namespace keel
