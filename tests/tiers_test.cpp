// The tier manager over a real chunk store and a real O_DIRECT file: pages come back with their
// newest bytes whatever tier they went to, budgets are never exceeded, prefetch follows the
// recorded schedule, and a copy behind its owner's version is refetched, never used.
#include "store/tiers.h"

#include <cstring>
#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::error_of;

constexpr int64_t kChunkBytes = 64 << 10;

// Six layers of two tensors each, some larger than a chunk: 16+ chunks.
std::unique_ptr<ChunkStore> make_store() {
  auto s = std::make_unique<ChunkStore>(kChunkBytes);
  for (int layer = 0; layer < 6; ++layer) {
    const ChunkKind kind = layer == 0 ? ChunkKind::embedding : layer % 2 ? ChunkKind::attention : ChunkKind::ffn;
    s->add(TensorSpec{"l" + std::to_string(layer) + ".a", {97, 211}, layer, kind, true});
    s->add(TensorSpec{"l" + std::to_string(layer) + ".b", {1 + 5000 * layer}, layer, kind, false});
  }
  s->finalize();
  return s;
}

// The bytes page (c, p) holds at version v.
float expected_value(int c, int p, uint64_t v, size_t j) {
  return static_cast<float>((c * 131 + p * 17 + static_cast<int>(v) * 7) % 1000) + static_cast<float>(j % 97) * 0.25f;
}

void fill(float* d, size_t n, int c, int p, uint64_t v) {
  for (size_t j = 0; j < n; ++j) d[j] = expected_value(c, p, v, j);
}

bool holds(const float* d, size_t n, int c, int p, uint64_t v) {
  for (size_t j = 0; j < n; ++j)
    if (d[j] != expected_value(c, p, v, j)) return false;
  return true;
}

// Every page at version 0.
void fill_all(ChunkStore& store) {
  for (const Chunk& c : store.chunks())
    for (int p = 0; p < kNumPlanes; ++p) {
      auto v = store.chunk_view(c.id, static_cast<Plane>(p));
      fill(v.data(), v.size(), c.id, p, 0);
    }
}

// Uses pages through the tiers as an operation would (acquire, check, maybe write, release) and
// checks that every acquire sees exactly the bytes last written, within the budgets.
class PageChecker {
 public:
  PageChecker(ChunkStore& store, TierManager& tiers, const TierOptions& o) : store_(store), tiers_(tiers), o_(o) {}
  void use(const std::vector<PageRef>& pages, bool write) {
    tiers_.acquire(pages);
    ASSERT_LE(tiers_.device_bytes_used(), o_.device_bytes);
    ASSERT_LE(tiers_.host_bytes_used(), o_.host_bytes);
    for (const PageRef& r : pages) {
      auto v = store_.chunk_view(r.chunk, r.plane);
      const int p = static_cast<int>(r.plane);
      if (zeroed_.count({r.chunk, p})) {
        ASSERT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; })) << "discarded page not zero";
      } else {
        ASSERT_TRUE(holds(v.data(), v.size(), r.chunk, p, version_[{r.chunk, p}]))
            << "stale or torn bytes: chunk " << r.chunk << " plane " << p << " version " << version_[{r.chunk, p}];
      }
      if (write) {
        fill(v.data(), v.size(), r.chunk, p, ++version_[{r.chunk, p}]);
        zeroed_.erase({r.chunk, p});
      }
    }
    tiers_.release(pages, write);
  }
  // Declares the page zero (AdamW consumed a gradient).
  void discard(PageRef r) {
    tiers_.discard_to_zero(r);
    zeroed_.insert({r.chunk, static_cast<int>(r.plane)});
  }

 private:
  ChunkStore& store_;
  TierManager& tiers_;
  TierOptions o_;
  std::map<std::pair<int, int>, uint64_t> version_;  // absent: 0
  std::set<std::pair<int, int>> zeroed_;  // pages discarded to zero since their last write
};

// Homes mixing tiers and planes: every fifth page on the device, the rest host and NVMe in turn.
std::vector<Tier> mixed_homes(const ChunkStore& s) {
  std::vector<Tier> homes;
  for (size_t c = 0; c < s.chunks().size(); ++c)
    for (size_t p = 0; p < kNumPlanes; ++p) {
      const size_t i = c * kNumPlanes + p;
      homes.push_back(i % 5 == 0 ? Tier::device : i % 2 ? Tier::host : Tier::nvme);
    }
  return homes;
}

int64_t state_bytes(const ChunkStore& s) {
  int64_t b = 0;
  for (const Chunk& c : s.chunks()) b += 4 * c.numel * kNumPlanes;
  return b;
}

// Options for pages all homed on NVMe (in `dir`) with `chunks` chunks' worth of device budget.
TierOptions all_nvme(const ChunkStore& s, const testing::TempDir& dir, int chunks) {
  TierOptions o;
  o.device_bytes = chunks * kChunkBytes;
  o.host_bytes = state_bytes(s);
  o.nvme_dir = dir.path();
  return o;
}

// (engine, prefetch, adaptive, async_host: host fetches by the copier's thread)
struct Engines : ::testing::TestWithParam<std::tuple<IoEngine, bool, bool, bool>> {};

// Training-shaped traffic (forward, backward writing gradients, an optimizer pass over every
// chunk's four planes) with a device budget of a fifth of the state: every acquire sees exactly
// the newest bytes, budgets hold, and with prefetch most first touches are hits after the first
// step (which records the schedule).
TEST_P(Engines, EveryAcquireSeesTheNewestBytesWithinBudgets) {
  const auto [engine, prefetch, adaptive, async_host] = GetParam();
  testing::TempDir dir;
  auto store = make_store();
  const int n_chunks = static_cast<int>(store->chunks().size());
  fill_all(*store);
  TierOptions o;
  const std::vector<Tier> homes = mixed_homes(*store);
  int64_t device_homed = 0;
  for (size_t i = 0; i < homes.size(); ++i)
    if (homes[i] == Tier::device) device_homed += 4 * store->chunks()[i / kNumPlanes].numel;
  o.device_bytes = device_homed + state_bytes(*store) / 6;  // the rest: a sixth of the state
  o.host_bytes = state_bytes(*store) / 2;
  o.nvme_dir = dir.path();
  o.engine = engine;
  o.prefetch = prefetch;
  o.lookahead = 3;
  o.adaptive = adaptive;
  o.async_host = async_host;
  o.reserve_bytes = o.device_bytes / 2;
  TierManager tiers(*store, o, homes);
  EXPECT_LE(tiers.device_bytes_used(), o.device_bytes);
  std::vector<std::vector<int>> layer_chunks(6);
  for (const Chunk& c : store->chunks()) layer_chunks[c.layer].push_back(c.id);

  PageChecker pages(*store, tiers, o);
  // Each operation starts once the transfers the previous one started are done, as if its
  // compute took long enough to hide them: the hit rate then measures what the policy fetched
  // ahead, not how busy the machine was (under load a prefetch still in flight reads as a miss).
  auto use = [&](const std::vector<PageRef>& refs, bool write) {
    tiers.drain();
    pages.use(refs, write);
  };
  double late_hits = 0, late_touches = 0;
  for (int step = 0; step < 5; ++step) {
    tiers.begin_step();
    for (int l = 0; l < 6; ++l) {  // forward
      std::vector<PageRef> pages;
      for (int c : layer_chunks[l]) pages.push_back({c, Plane::param});
      use(pages, false);
    }
    for (int l = 5; l >= 0; --l) {  // backward: gradients written
      std::vector<PageRef> pages;
      for (int c : layer_chunks[l]) pages.push_back({c, Plane::param}), pages.push_back({c, Plane::grad});
      use(pages, true);
    }
    for (int c = 0; c < n_chunks; ++c) {  // optimizer, which consumes the gradient
      use({{c, Plane::param}, {c, Plane::grad}, {c, Plane::adam_m}, {c, Plane::adam_v}}, true);
      if (c % 2 == 0) pages.discard({c, Plane::grad});
    }
    const TierStats s = tiers.take_step_stats();
    EXPECT_EQ(s.stale_refetches, 0u);
    const std::string note = tiers.take_rehome_note();
    if (adaptive && step == 1) {
      EXPECT_NE(note.find("re-homed"), std::string::npos) << note;
      // Parameters (used three times a step) never sit on a slower tier than a moment of the
      // same chunk (used once).
      const std::vector<Tier> h = tiers.homes();
      for (int c = 0; c < n_chunks; ++c)
        EXPECT_LE(static_cast<int>(h[c * kNumPlanes]), static_cast<int>(h[c * kNumPlanes + 2])) << "chunk " << c;
    } else {
      EXPECT_EQ(note, "");
    }
    if (step >= 2) {
      for (int t = 1; t < kNumTiers; ++t) {
        late_hits += static_cast<double>(s.tier[t].hits);
        late_touches += static_cast<double>(s.tier[t].acquires);
      }
    }
    EXPECT_GT(s.evictions, 0u) << "the budget should force evictions";
    EXPECT_GT(s.tier[static_cast<int>(Tier::nvme)].bytes_read, 0u);
    EXPECT_EQ(s.tier[static_cast<int>(Tier::device)].hits, s.tier[static_cast<int>(Tier::device)].acquires);
  }
  tiers.drain();
  if (prefetch) {
    EXPECT_GT(late_hits / late_touches, 0.5) << "prefetch should make most first touches hits";
  }
  std::printf("engine %s prefetch %d: hit rate of host and nvme pages after step 2: %.3f\n", io_engine_name(tiers.engine()),
              prefetch, late_hits / late_touches);
}

std::string engines_name(const ::testing::TestParamInfo<Engines::ParamType>& info) {
  return std::string(io_engine_name(std::get<0>(info.param))) + (std::get<1>(info.param) ? "_prefetch" : "_on_demand") +
         (std::get<2>(info.param) ? "_adaptive" : "_static") + (std::get<3>(info.param) ? "_async_host" : "");
}
INSTANTIATE_TEST_SUITE_P(Tiers, Engines,
                         ::testing::Combine(::testing::Values(IoEngine::io_uring, IoEngine::threads), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Values(false)),
                         engines_name);
INSTANTIATE_TEST_SUITE_P(AsyncHost, Engines,
                         ::testing::Combine(::testing::Values(IoEngine::threads), ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(true)),
                         engines_name);

// A disk slow to write (every write of the threads engine starts 50 ms late) keeps write-backs
// in flight while the pages they write are taken back, read, and evicted again, several times:
// what a pipeline stage's tight budget does to its parameters (read by the passes of several
// micro-batches in turn). A page taken back during its write-back and evicted again unchanged
// once gave its memory back under the write still in flight, and the page came back as zeros
// (a 2-stage tiered pipeline drifted under load). Random traffic over ten pages in four pages of
// budget, the same each step (prefetch follows it from the second step): every acquire sees the
// newest bytes. These seeds each failed before the fix.
TEST(Tiers, PagesTakenBackDuringTheirWriteBackKeepTheirBytes) {
  for (uint64_t seed : {1, 2}) {
    testing::TempDir dir;
    auto store = make_store();
    fill_all(*store);
    const int n_chunks = static_cast<int>(store->chunks().size());
    TierOptions o = all_nvme(*store, dir, 4);
    o.engine = IoEngine::threads;
    o.write_delay_us = 50000;
    o.lookahead = 8;
    TierManager tiers(*store, o, std::vector<Tier>(n_chunks * kNumPlanes, Tier::nvme));
    PageChecker pages(*store, tiers, o);
    Rng rng(seed);
    std::vector<std::pair<PageRef, bool>> traffic;  // a page, and whether it is written
    for (int k = 0; k < 40; ++k) {
      const int c = static_cast<int>(rng.below(10));
      traffic.push_back({PageRef{c, Plane::param}, rng.uniform() < 0.3});
    }
    uint64_t evictions = 0;
    for (int step = 0; step < 4; ++step) {
      tiers.begin_step();
      for (const auto& [page, write] : traffic) {
        pages.use({page}, write);
        if (::testing::Test::HasFatalFailure()) return;
      }
      evictions += tiers.take_step_stats().evictions;
    }
    EXPECT_GT(evictions, 40u) << "the budget should force evictions";
  }
}

// ZeRO-3's other ranks' pages (chunks outside the store's param_chunks()) are transient: the file
// holds slots for this rank's own pages only; another rank's page written under a lease and then
// evicted spills to scratch at the file's end and comes back with its bytes; declared zero, its
// slot is free again, and the same traffic later reuses the scratch instead of growing the file.
// A transient page never written reads zero and takes no scratch.
TEST(Tiers, OtherRanksPagesSpillToScratchThatIsReused) {
  testing::TempDir dir;
  auto store = make_store();
  const int n = static_cast<int>(store->chunks().size()), own = n / 2;
  store->shard_moments(0, own);
  store->home_params(0, own);
  for (int c = 0; c < own; ++c)
    for (int p = 0; p < kNumPlanes; ++p) {
      auto v = store->chunk_view(c, static_cast<Plane>(p));
      fill(v.data(), v.size(), c, p, 0);
    }
  int64_t own_slots = 0, others_param_slots = 0, own_param_bytes = 0;
  for (const Chunk& c : store->chunks()) {
    const int64_t slot = static_cast<int64_t>(BlockFile::align_up(4 * c.numel));
    if (c.id < own) own_slots += kNumPlanes * slot, own_param_bytes += 4 * c.numel;
    if (c.id >= own) others_param_slots += slot;
  }
  TierOptions o = all_nvme(*store, dir, 4);
  ASSERT_GT(own_param_bytes, o.device_bytes);  // reading them all evicts everything else
  TierManager tiers(*store, o, std::vector<Tier>(n * kNumPlanes, Tier::nvme));
  EXPECT_EQ(tiers.nvme_file_bytes(), own_slots);
  EXPECT_EQ(tiers.nvme_scratch_bytes(), 0);
  PageChecker pages(*store, tiers, o);
  for (int c = own; c < n; ++c) {  // (zero, as the store left them)
    pages.discard(PageRef{c, Plane::param});
    pages.discard(PageRef{c, Plane::grad});
  }
  EXPECT_EQ(tiers.nvme_scratch_bytes(), 0);
  int64_t spilled = 0;
  // Other ranks' parameters (as a gather writes them), then their gradients (as backward does,
  // before the reduce-scatter): the same slot sizes, so the second round fits the first's freed slots.
  for (Plane plane : {Plane::param, Plane::grad}) {
    for (int c = own; c < n; ++c) pages.use({PageRef{c, plane}}, true);
    for (int c = 0; c < own; ++c) pages.use({PageRef{c, Plane::param}}, false);
    tiers.drain();
    if (plane == Plane::param) spilled = tiers.nvme_scratch_bytes();
    EXPECT_EQ(tiers.nvme_scratch_bytes(), others_param_slots);  // every one evicted with bytes
    EXPECT_EQ(tiers.nvme_file_bytes(), own_slots + others_param_slots);
    for (int c = own; c < n; ++c) pages.use({PageRef{c, plane}}, false);  // back from scratch
    if (::testing::Test::HasFatalFailure()) return;
    for (int c = own; c < n; ++c) pages.discard(PageRef{c, plane});  // the lease ended / reduce-scattered
  }
  EXPECT_EQ(tiers.nvme_scratch_bytes(), spilled);  // the gradients reused the parameters' slots
  for (int c = own; c < n; ++c) pages.use({PageRef{c, Plane::param}}, false);  // zero again: no scratch read
  for (int c = 0; c < own; ++c) pages.use({PageRef{c, Plane::grad}}, false);
  tiers.drain();
  EXPECT_EQ(tiers.nvme_scratch_bytes(), spilled);
}

// A rank's own chunks that are not one range (ZeRO-3 with sharded experts: home_params' flags
// within their span): only the flagged chunks' parameter and gradient pages get slots; the
// others in the span are transient as those outside it, and one written before the weights
// settle (a draw or a load into the span) spills to scratch and comes back with its bytes.
TEST(Tiers, OnlyTheFlaggedChunksOfTheParameterSpanAreHomed) {
  testing::TempDir dir;
  auto store = make_store();
  const int n = static_cast<int>(store->chunks().size());
  std::vector<uint8_t> own(static_cast<size_t>(n), 0);
  int64_t slots = 0, others_param_slots = 0;
  for (const Chunk& c : store->chunks()) {
    const int64_t slot = static_cast<int64_t>(BlockFile::align_up(4 * c.numel));
    own[static_cast<size_t>(c.id)] = c.id % 2 == 0;
    const bool homed = own[static_cast<size_t>(c.id)] && c.id < n - 1;
    slots += (homed ? kNumPlanes : 2) * slot;  // (every chunk's moments)
    if (c.id > 0 && c.id < n - 1 && !own[static_cast<size_t>(c.id)]) others_param_slots += slot;
  }
  store->home_params(0, n - 1, own);
  EXPECT_TRUE(store->params_homed_in_part());
  EXPECT_TRUE(store->param_homed(0));
  EXPECT_FALSE(store->param_homed(1));
  EXPECT_FALSE(store->param_homed(n - 1));  // (outside the span)
  TierOptions o = all_nvme(*store, dir, 4);
  TierManager tiers(*store, o, std::vector<Tier>(n * kNumPlanes, Tier::nvme));
  EXPECT_EQ(tiers.nvme_file_bytes(), slots);
  PageChecker pages(*store, tiers, o);
  for (int c = 0; c < n; ++c) pages.discard(PageRef{c, Plane::param});  // (zero, as the store left them)
  for (int c = 1; c < n - 1; c += 2) pages.use({PageRef{c, Plane::param}}, true);  // written into the span
  for (int c = 0; c < n - 1; c += 2) pages.use({PageRef{c, Plane::param}}, false);
  tiers.drain();
  EXPECT_EQ(tiers.nvme_scratch_bytes(), others_param_slots);
  for (int c = 1; c < n - 1; c += 2) pages.use({PageRef{c, Plane::param}}, false);
}

// The schedule is the step's own (begin_step to end_step). Training-shaped steps whose optimizer
// updates are deferred into the next forward pass (the store's updater, run by the first lease of
// a pending chunk), with an evaluation (which applies the pending updates first, then runs
// forward passes) or a checkpoint (the updates alone) between some of them: the recorded schedule
// holds the recorded step's acquires only, and every later step follows it from its first
// acquire, none off it and no entry skipped, whether an evaluation or a checkpoint ran the
// updates early or not. Every acquire sees the newest bytes. (Sequence logic: no I/O timing.)
TEST(Tiers, EvaluationsAndCheckpointsBetweenStepsStayOffTheSchedule) {
  testing::TempDir dir;
  auto store = make_store();
  fill_all(*store);
  const int n_chunks = static_cast<int>(store->chunks().size());
  TierOptions o = all_nvme(*store, dir, 10);
  o.lookahead = 4;
  TierManager tiers(*store, o, std::vector<Tier>(n_chunks * kNumPlanes, Tier::nvme));
  PageChecker pages(*store, tiers, o);
  std::vector<std::vector<PageRef>> layer_params(6), layer_both(6);
  for (const Chunk& c : store->chunks()) {
    layer_params[c.layer].push_back({c.id, Plane::param});
    layer_both[c.layer].push_back({c.id, Plane::param}), layer_both[c.layer].push_back({c.id, Plane::grad});
  }
  store->set_updater([&](int c) {
    pages.use({{c, Plane::param}, {c, Plane::grad}, {c, Plane::adam_m}, {c, Plane::adam_v}}, true);
  });
  auto forward = [&] {
    for (int l = 0; l < 6; ++l) {
      for (const PageRef& p : layer_params[l]) (void)store->use_chunk(p.chunk, {}, {});  // its pending update
      pages.use(layer_params[l], false);
    }
  };
  auto step = [&] {
    tiers.begin_step(store->any_pending());
    forward();
    for (int l = 5; l >= 0; --l) pages.use(layer_both[l], true);
    for (int c = 0; c < n_chunks; ++c) store->defer_update(c);  // the optimizer step, deferred
    tiers.end_step();
    return tiers.take_step_stats();
  };
  step();  // nothing pending: not recorded
  EXPECT_EQ(tiers.schedule_length(), 0);
  step();  // recorded: every chunk's update, 6 layers forward, 6 backward
  const int64_t recorded = n_chunks + 12;
  EXPECT_EQ(tiers.schedule_length(), recorded);
  for (int k = 0; k < 6; ++k) {
    const bool evaluation = k % 3 == 0, checkpoint = k % 3 == 1;
    if (evaluation || checkpoint) store->apply_pending();
    if (evaluation) forward(), forward();
    if (::testing::Test::HasFatalFailure()) return;
    const uint64_t between = tiers.take_step_stats().between_steps;
    EXPECT_EQ(between, static_cast<uint64_t>(evaluation ? n_chunks + 12 : checkpoint ? n_chunks : 0)) << k;
    const TierStats s = step();
    EXPECT_EQ(s.off_schedule, 0u) << "step " << k << (evaluation ? " after an evaluation" : checkpoint ? " after a checkpoint" : "");
    EXPECT_EQ(s.schedule_skips, 0u) << "step " << k;
    EXPECT_EQ(s.between_steps, 0u);
    EXPECT_EQ(s.stale_refetches, 0u);
    EXPECT_EQ(tiers.schedule_length(), recorded) << "the evaluation is no part of the schedule";
  }
}

// A lookahead hint (a pipeline executor's) starts fetches before a schedule exists, nearest
// first, into free room or the room of clean pages it does not name (never a hinted or a
// modified one); once prefetch follows the recorded schedule, hints add nothing; after
// record_again() (the step changed shape) they count again until the new schedule is recorded.
// Hinted pages come back with their bytes.
TEST(Tiers, HintsFetchAheadUntilTheScheduleTakesOver) {
  testing::TempDir dir;
  auto store = make_store();
  fill_all(*store);
  const int n_chunks = static_cast<int>(store->chunks().size());
  const TierOptions o = all_nvme(*store, dir, 6);
  TierManager tiers(*store, o, std::vector<Tier>(n_chunks * kNumPlanes, Tier::nvme));
  PageChecker pages(*store, tiers, o);
  std::vector<PageRef> all;
  for (int c = 0; c < n_chunks; ++c) all.push_back({c, Plane::param});
  tiers.begin_step();
  EXPECT_EQ(tiers.device_bytes_used(), 0);
  const int started = tiers.hint(all);
  EXPECT_GT(started, 0);
  EXPECT_LT(started, n_chunks) << "a hint never evicts a page it names";
  EXPECT_LE(tiers.device_bytes_used(), o.device_bytes);
  EXPECT_EQ(tiers.hint(all), 0) << "nothing more fits";
  tiers.drain();
  for (int c = 0; c < n_chunks; ++c) EXPECT_EQ(tiers.present(all[c]), c < started) << "hinted nearest first: " << c;
  for (int c = 0; c < n_chunks; ++c) pages.use({all[c]}, c % 3 == 0);
  const TierStats first = tiers.take_step_stats();
  EXPECT_EQ(first.tier[static_cast<int>(Tier::nvme)].hits, static_cast<uint64_t>(started)) << "the hinted pages were hits";
  EXPECT_EQ(first.hint_fetches, static_cast<uint64_t>(started));
  // The first step was recorded; from the second on, prefetch follows it and hints are moot.
  for (int step = 0; step < 2; ++step) {
    tiers.begin_step();
    for (int c = 0; c < n_chunks; ++c) {
      pages.use({all[c]}, false);
      EXPECT_EQ(tiers.hint(all), 0);
    }
  }
  tiers.record_again();
  tiers.begin_step();
  // The last step's prefetches (of the next step's first pages) and write-backs may still be in
  // flight, their pages not yet present but their room taken: which pages are present would
  // depend on I/O timing. Let them complete first.
  tiers.drain();
  // Room again (two present pages declared zero and given back): off a schedule, hints fetch.
  int freed = 0;
  for (int c = 0; c < n_chunks && freed < 2; ++c) {
    if (!tiers.present(all[c])) continue;
    pages.discard(all[c]);
    freed++;
  }
  ASSERT_EQ(freed, 2);
  // How many pages the last step left prefetched depends on when its writes completed; what a
  // hint must do does not: fill the free room with absent pages, nearest first, up to the first
  // that does not fit (every page is hinted, so none is evicted for it).
  int64_t room = o.device_bytes - tiers.device_bytes_used();
  int fits = 0;
  for (int c = 0; c < n_chunks; ++c) {
    if (tiers.present(all[c])) continue;
    const int64_t bytes = store->chunks()[c].numel * static_cast<int64_t>(sizeof(float));
    if (bytes > room) break;
    room -= bytes;
    fits++;
  }
  EXPECT_GE(fits, 2) << "the two pages given back made room";
  EXPECT_EQ(tiers.hint(all), fits);
  EXPECT_EQ(tiers.take_step_stats().hint_fetches, static_cast<uint64_t>(fits));
  // The pages a hint does not name make room: clean ones, least recently used first; a page
  // modified since its last write-back stays.
  std::vector<PageRef> absent;
  int modified = -1;
  for (int c = 0; c < n_chunks; ++c) {
    if (!tiers.present(all[c])) {
      absent.push_back(all[c]);
    } else if (modified < 0) {
      pages.use({all[c]}, true);
      modified = c;
    }
  }
  ASSERT_FALSE(absent.empty());
  ASSERT_GE(modified, 0);
  EXPECT_GT(tiers.hint(absent), 0);
  EXPECT_TRUE(tiers.present(all[modified]));
  EXPECT_LE(tiers.device_bytes_used(), o.device_bytes);
  for (int c = n_chunks - 1; c >= 0; --c) pages.use({all[c]}, false);
}

// An update at home (the optimizer running where the state lives) leaves a pinned device copy
// behind its owner: the next acquire finds it stale by version and fetches the new bytes.
TEST(Tiers, ACopyBehindItsOwnersVersionIsRefetchedNeverUsed) {
  testing::TempDir dir;
  for (Tier home : {Tier::host, Tier::nvme}) {
    auto store = make_store();
    auto v0 = store->chunk_view(3, Plane::adam_m);
    fill(v0.data(), v0.size(), 3, 2, 0);
    TierOptions o;
    o.device_bytes = state_bytes(*store) + 4 * kChunkBytes;
    o.host_bytes = state_bytes(*store);
    o.nvme_dir = dir.path();
    std::vector<Tier> homes(store->chunks().size() * kNumPlanes, Tier::device);
    homes[3 * kNumPlanes + 2] = home;
    TierManager tiers(*store, o, homes);
    const PageRef page{3, Plane::adam_m};
    EXPECT_FALSE(tiers.present(page));
    tiers.acquire({&page, 1});
    tiers.update_at_home(page, [](float* d, size_t n) { fill(d, n, 3, 2, 1); });
    auto v = store->chunk_view(3, Plane::adam_m);
    EXPECT_TRUE(holds(v.data(), v.size(), 3, 2, 0)) << "the pinned copy is the old one";
    tiers.release({&page, 1}, false);
    EXPECT_EQ(tiers.version(page), 1u);
    tiers.acquire({&page, 1});
    EXPECT_TRUE(holds(v.data(), v.size(), 3, 2, 1)) << tier_name(home);
    EXPECT_EQ(tiers.stats().stale_refetches, 1u);
    tiers.release({&page, 1}, false);
  }
}

// Routed pages (a mixture of experts' experts: acquired only when the router chose them). The
// ffn layers' parameter and gradient pages are routed, homed on host, and each step uses a
// different subset of them (hinted first, as a block does right after routing): their acquires
// stay out of the schedule, so the other pages' prefetch keeps following it (their first touches
// are hits from the third step on); a hint on the schedule fetches routed pages (and only those),
// which their acquires then find present; every acquire sees the newest bytes. Then the routed
// pages move homes (rehome_pages: to the device and to NVMe, where each has a slot), keep their
// bytes, and a move past the device budget is refused, moving nothing.
TEST(Tiers, RoutedPagesStayOffTheScheduleAndComeByHint) {
  testing::TempDir dir;
  auto store = make_store();
  fill_all(*store);
  const int n_chunks = static_cast<int>(store->chunks().size());
  TierOptions o = all_nvme(*store, dir, 6);
  o.routed.assign(static_cast<size_t>(n_chunks) * kNumPlanes, 0);
  std::vector<Tier> homes(static_cast<size_t>(n_chunks) * kNumPlanes, Tier::nvme);
  std::vector<int> routed, others;
  for (const Chunk& c : store->chunks()) {
    const bool r = c.kind == ChunkKind::ffn;
    (r ? routed : others).push_back(c.id);
    for (Plane p : {Plane::param, Plane::grad}) {
      o.routed[static_cast<size_t>(c.id) * kNumPlanes + static_cast<int>(p)] = r;
      if (r) homes[static_cast<size_t>(c.id) * kNumPlanes + static_cast<int>(p)] = Tier::host;
    }
  }
  ASSERT_GE(routed.size(), 3u);
  TierManager tiers(*store, o, homes);
  PageChecker pages(*store, tiers, o);
  uint64_t routed_touches = 0, routed_hits = 0;
  for (int step = 0; step < 5; ++step) {
    tiers.begin_step();
    for (int c : others) pages.use({{c, Plane::param}}, false);
    // The router's choice of this step: a different subset each time, hinted, then used.
    std::vector<PageRef> chosen;
    for (size_t k = 0; k < routed.size(); ++k)
      if ((k + static_cast<size_t>(step)) % 3 != 0) chosen.push_back({routed[k], Plane::param});
    const int started = tiers.hint(chosen);
    if (step >= 2) {
      EXPECT_GT(started, 0) << "on the schedule a hint still fetches routed pages";
      EXPECT_EQ(tiers.hint(std::vector<PageRef>{{others[0], Plane::param}}), 0) << "the schedule covers the rest";
    }
    std::vector<bool> present_after_hint;
    for (const PageRef& r : chosen) present_after_hint.push_back(tiers.present(r));
    for (const PageRef& r : chosen) pages.use({r}, false);
    for (size_t k = 0; k < chosen.size(); ++k) {
      const PageCounters c = tiers.take_page_counters(chosen[k]);
      EXPECT_EQ(c.acquires, 1u);
      // A page the hint brought in is kept for its acquire (the others' pages make room first).
      if (present_after_hint[k]) {
        EXPECT_EQ(c.hits, 1u) << "step " << step << " page " << k;
      }
      routed_touches += c.acquires, routed_hits += c.hits;
    }
    for (int c : others) pages.use({{c, Plane::grad}}, true);
    for (const PageRef& r : chosen) pages.use({{r.chunk, Plane::grad}}, true);
    const TierStats st = tiers.take_step_stats();
    if (step >= 2) {
      const TierCounters& nvme = st.tier[static_cast<int>(Tier::nvme)];
      EXPECT_GT(nvme.hits * 2, nvme.acquires) << "step " << step << ": prefetch lost the schedule";
    }
  }
  EXPECT_GT(routed_hits, 0u) << "of " << routed_touches;
  // Homes moved: the first routed chunk's pages to the device, the second's to NVMe.
  const std::vector<PageRef> moving = {{routed[0], Plane::param}, {routed[0], Plane::grad}, {routed[1], Plane::param},
                                       {routed[1], Plane::grad}};
  const std::vector<Tier> to = {Tier::device, Tier::device, Tier::nvme, Tier::nvme};
  const std::vector<int64_t> moved = tiers.rehome_pages(moving, to, 0);
  EXPECT_EQ(moved[static_cast<int>(Tier::device)], 2 * 4 * store->chunks()[routed[0]].numel);
  EXPECT_EQ(moved[static_cast<int>(Tier::nvme)], 2 * 4 * store->chunks()[routed[1]].numel);
  for (size_t k = 0; k < moving.size(); ++k) EXPECT_EQ(tiers.home(moving[k]), to[k]);
  for (const PageRef& r : moving) pages.use({r}, true);
  tiers.begin_step();
  for (const PageRef& r : moving) pages.use({r}, false);
  // Every routed page on the device cannot fit 6 chunks of budget: refused, nothing moved.
  std::vector<PageRef> all_routed;
  for (int c : routed) all_routed.insert(all_routed.end(), {{c, Plane::param}, {c, Plane::grad}});
  const std::string e =
      error_of([&] { tiers.rehome_pages(all_routed, std::vector<Tier>(all_routed.size(), Tier::device), 0); });
  EXPECT_NE(e.find("tier.device_bytes"), std::string::npos) << e;
  EXPECT_EQ(tiers.home({routed[2], Plane::param}), Tier::host);
  for (const PageRef& r : all_routed) pages.use({r}, false);
}

TEST(Tiers, BudgetsThatCannotHoldThePlacementAreRefused) {
  testing::TempDir dir;
  auto store = make_store();
  TierOptions o;
  o.device_bytes = kChunkBytes;  // less than one chunk's four planes
  o.host_bytes = state_bytes(*store);
  o.nvme_dir = dir.path();
  std::string e = error_of([&] { TierManager(*store, o, mixed_homes(*store)); });
  EXPECT_NE(e.find("tier.device_bytes"), std::string::npos) << e;
  o.device_bytes = state_bytes(*store);
  o.host_bytes = kChunkBytes;
  e = error_of([&] { TierManager(*store, o, mixed_homes(*store)); });
  EXPECT_NE(e.find("tier.host_bytes"), std::string::npos) << e;
  o.host_bytes = state_bytes(*store);
  o.nvme_dir = "";
  e = error_of([&] { TierManager(*store, o, mixed_homes(*store)); });
  EXPECT_NE(e.find("tier.nvme_dir"), std::string::npos) << e;
  o.nvme_dir = dir / "missing";
  e = error_of([&] { TierManager(*store, o, mixed_homes(*store)); });
  EXPECT_NE(e.find("cannot create"), std::string::npos) << e;
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

}  // namespace
}  // namespace keel
