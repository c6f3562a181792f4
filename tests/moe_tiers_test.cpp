// A mixture of experts over the memory tiers (the llama-moe-tiny preset at the toy's size: 2 MoE
// blocks of 4 experts, top-2, one shared expert): a small compute tier with host DRAM and NVMe
// trains the bytes of the run in memory and resumes exactly; the planner of experts' homes by
// routing share (store/expert_homes.h) against a brute-force answer. On 2 ranks (expert groups,
// ZeRO-3): tests/moe_tiers_parallel_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/fileio.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "model/moe.h"
#include "optim/adamw.h"
#include "store/expert_homes.h"
#include "store/placement.h"
#include "store/tiered_memory.h"
#include "moe_runs.h"
#include "store/tiers.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// 2 micro-batches of 2 sequences of 32 tokens per step; chunks of 64 KiB (an expert's weights
// are 48 KiB: a chunk of its own).
class MoeTiers : public testing::MoeRuns {
 protected:
  static void SetUpTestSuite() {
    start_suite("keel-moe-tiers", kSteps, "--set store.chunk_bytes=65536 --set runtime.threads=1");
    const testing::CommandResult memory = train("memory", "");
    ASSERT_EQ(memory.exit_code, 0) << memory.output;
  }
  static constexpr int kSteps = 8;
  static testing::CommandResult train(const std::string& run, const std::string& extra) {
    return MoeRuns::train(0, run, extra);
  }
  // A compute tier of 1 MiB for 2.3 MiB of state: most pages live on host DRAM and NVMe.
  static std::string tiers(const std::string& extra = "") { return one_mib_tiers(extra); }
  // `extra` trained into `reference` in memory and into `run` through the tiers with the experts
  // homed by routing share every 2 steps: the same bytes, no stale refetch, and not float32's
  // bytes (the suite's "memory": `extra` changes what is trained).
  static void expect_by_frequency_trains_bytes_in_memory(const std::string& reference, const std::string& run,
                                                         const std::string& extra) {
    testing::CommandResult r = train(reference, extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = train(run, extra + tiers("--set tier.experts=by_frequency --set tier.experts_every=2"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tier.experts = by_frequency"), std::string::npos) << r.output;
    expect_same_training(reference, run);
    for (const json& s : lines(run)) EXPECT_EQ(s.at("tier_stale_refetches").get<int>(), 0);
    EXPECT_NE(testing::checkpoint_bytes(at(reference) + "/ckpt"), testing::checkpoint_bytes(at("memory") + "/ckpt"))
        << extra << " trained float32's bytes";
  }
};

// The tiered runs (prefetch on and off, io_uring and the thread pool, the experts homed by
// routing share) train the bytes of the run in memory, with traffic through both off-device
// tiers, and report every expert's figures each step.
TEST_F(MoeTiers, ASmallComputeTierTrainsTheBytesOfTrainingInMemory) {
  for (const std::string& variant : {std::string(""), std::string("--set tier.prefetch=false --set tier.engine=threads"),
                                     std::string("--set tier.experts=by_frequency --set tier.experts_every=2")}) {
    SCOPED_TRACE(variant);
    const testing::CommandResult r = train("tiered", tiers(variant));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("keel: tiered memory: device 1 MiB"), std::string::npos) << r.output;
    expect_same_training("memory", "tiered");  // weights, moments, every loss and block's routing
    for (const json& s : lines("tiered")) {
      EXPECT_EQ(s.at("tier_stale_refetches").get<int>(), 0);
      EXPECT_GT(s.at("tier_nvme_read_bytes").get<double>() + s.at("tier_host_read_bytes").get<double>(), 0);
      EXPECT_LE(s.at("tier_device_resident_bytes").get<double>(), 1 << 20);
      ASSERT_EQ(s.at("tier_experts").size(), 2u) << s;
      for (const json& block : s.at("tier_experts")) {
        EXPECT_EQ(block.at("experts").size(), 4u);
        for (const char* key : {"acquires", "hits", "stall_ms", "read_bytes", "home"})
          EXPECT_EQ(block.at(key).size(), 4u) << key;
        for (size_t e = 0; e < 4; ++e) EXPECT_LE(block.at("hits")[e].get<int>(), block.at("acquires")[e].get<int>());
      }
      EXPECT_GE(s.at("tier_expert_hit_rate").get<double>(), 0.0);
      EXPECT_LE(s.at("tier_expert_hit_rate").get<double>(), 1.0);
    }
    EXPECT_TRUE(fs::is_empty(at("nvme"))) << "the tier's file outlived the run";
    fs::remove_all(at("tiered"));
  }
}

// A tiered run resumed from its step-4 checkpoint (loaded page by page into the tiers) ends with
// the uninterrupted run's bytes.
TEST_F(MoeTiers, ResumesThroughTheTiersToTheSameBytes) {
  testing::CommandResult r = train("resumed", tiers("--set train.checkpoint_every=4"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::remove_all(at("resumed") + "/ckpt/step-00000008");
  r = train("resumed", tiers("--set train.checkpoint_every=4 --set train.resume=auto"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  expect_same_checkpoint("memory", "resumed");
  fs::remove_all(at("resumed"));
}

// Routing-aware leases, at one block over real tiers: with its routing bias keeping expert 3 of
// 4 from every token, a forward and backward pass never touch expert 3's parameter or gradient
// pages (no acquire, no byte read, still absent), touch each chosen expert's once per pass kind,
// and give the gradients of the same model in memory, bit for bit.
TEST(MoeTierLeases, UnchosenExpertsPagesAreNotTouched) {
  const Config c = testing::one_moe_block_config();
  const ModelConfig& m = c.model;
  const int B = 2, T = 8;
  Rng rng(7);
  std::vector<int> in(B * T), tg(B * T);
  for (int i = 0; i < B * T; ++i) in[i] = static_cast<int>(rng.below(64)), tg[i] = static_cast<int>(rng.below(64));
  auto run = [&](bool tiered, std::vector<float>* grads) {
    ChunkStore store(4096);
    GPT model(m, store);
    store.finalize();
    model.init_weights(5);
    MoeFeedForward* moe = model.layer(1).moe();
    EXPECT_NE(moe, nullptr);
    moe->routing_bias()[3] = -1e9f;  // expert 3 is never chosen
    testing::TempDir dir("keel-moe-leases");
    TierConfig t;
    t.device_mib = 1;
    t.host_mib = 4;
    t.nvme_dir = dir.path();
    t.attention = t.norm = t.embedding = Tier::host;  // everything off the device: every touch shows
    t.ffn = Tier::nvme;
    std::unique_ptr<TieredMemory> tiers = tiered ? std::make_unique<TieredMemory>(t, store, false) : nullptr;
    model.allocate(B, T);
    store.zero_grads();
    model.forward(Batch{in.data(), tg.data(), B, T, 1.0f / (B * T)});
    model.backward(Batch{in.data(), tg.data(), B, T, 1.0f / (B * T)});
    if (tiers) {
      int chosen = 0;
      for (const Chunk& ch : store.chunks()) {
        if (ch.expert < 0) continue;
        for (Plane p : {Plane::param, Plane::grad}) {
          const PageCounters k = tiers->manager().take_page_counters({ch.id, p});
          if (ch.expert == 3) {
            EXPECT_EQ(k.acquires, 0u) << "chunk " << ch.id;
            EXPECT_EQ(k.bytes_read, 0u) << "chunk " << ch.id;
            EXPECT_FALSE(tiers->manager().present({ch.id, p}));
          } else {
            EXPECT_EQ(k.acquires, 1u) << "chunk " << ch.id << " expert " << ch.expert;
            chosen += p == Plane::param;
          }
        }
      }
      EXPECT_GT(chosen, 0);
      tiers->manager().drain();
    }
    for (int id = 0; id < static_cast<int>(store.tensors().size()); ++id) {
      const PageLease use = store.use_tensor(id, {Plane::grad});
      const std::span<const float> g = store.view(id, Plane::grad);
      grads->insert(grads->end(), g.begin(), g.end());
    }
  };
  std::vector<float> memory, tiered;
  run(false, &memory);
  run(true, &tiered);
  ASSERT_EQ(memory.size(), tiered.size());
  EXPECT_EQ(std::memcmp(memory.data(), tiered.data(), memory.size() * sizeof(float)), 0);
}

// Experts moved to host DRAM by rehome_pages (tier.experts = "by_frequency") are fetched, kept
// and counted as experts the placement homed there: two runs of a two-block model through real
// tiers with deferred AdamW updates (as a tiered run's), one with its experts placed on host
// DRAM, one with them placed on NVMe and re-homed to host DRAM after step 2, touch and hit every
// expert page alike from step 4 on (per page and step, exact), hit every first touch there (the
// optimizer's update of an expert is on the schedule, and the block's hint brings the chosen
// experts in), and train the same bytes. Every transfer completes before the next operation
// (the expert products are tiny): the counts do not depend on the machine's speed.
TEST(MoeTierLeases, ReHomedExpertsHitAsExpertsPlacedThere) {
  const Config c = testing::moe_blocks_config(2, MoeBalance::aux);
  const ModelConfig& m = c.model;
  const int B = 2, T = 8, kRunSteps = 7, kRehomeAfter = 2, kCompareFrom = 4;
  struct Run {
    std::vector<PageCounters> counters;  // per step from kCompareFrom, per expert page
    std::vector<float> params;
  };
  auto run = [&](bool rehomed) {
    Run out;
    ChunkStore store(4096);
    GPT model(m, store);
    store.finalize();
    model.init_weights(5);
    testing::TempDir dir("keel-moe-rehomed");
    TierConfig t;
    t.device_mib = 1;
    t.host_mib = 8;
    t.nvme_dir = dir.path();
    t.attention = t.norm = t.embedding = t.ffn = Tier::host;
    t.optimizer = Tier::host;
    const Placement placed = place_pages(t, store);
    TierOptions o = tier_options(t);
    o.routed.assign(store.chunks().size() * kNumPlanes, 0);
    o.routed_host_in_place = true;
    std::vector<Tier> homes = placed.homes;
    std::vector<PageRef> experts;
    for (const Chunk& ch : store.chunks()) {
      if (ch.expert < 0) continue;
      for (Plane p : {Plane::param, Plane::grad}) {
        const size_t i = static_cast<size_t>(ch.id) * kNumPlanes + static_cast<int>(p);
        o.routed[i] = 1;
        if (rehomed) homes[i] = Tier::nvme;
        experts.push_back({ch.id, p});
      }
    }
    EXPECT_GE(experts.size(), 16u);
    TierManager manager(store, o, homes);
    TierResidency residency(manager, store);
    store.attach_residency(&residency);
    model.allocate(B, T);
    OptimConfig oc;
    AdamW adamw(oc);
    int64_t t_update = 0;
    store.set_updater([&](int chunk) { adamw.step_chunk(store, chunk, 1e-2, t_update, 1.0f); });
    Rng rng(11);
    for (int step = 1; step <= kRunSteps; ++step) {
      manager.begin_step(step > 1);  // the first step has no updates pending: unlike the rest
      std::vector<int> in(B * T), tg(B * T);
      for (int i = 0; i < B * T; ++i) in[i] = static_cast<int>(rng.below(64)), tg[i] = static_cast<int>(rng.below(64));
      const Batch batch{in.data(), tg.data(), B, T, 1.0f / (B * T)};
      // Each operation starts once the transfers before it are done.
      manager.drain();
      model.forward(batch);
      manager.drain();
      model.backward(batch);
      t_update = step;
      for (const Chunk& ch : store.chunks()) store.defer_update(ch.id);
      for (const PageRef& p : experts) {
        const PageCounters k = manager.take_page_counters(p);
        if (step >= kCompareFrom) out.counters.push_back(k);
      }
      if (rehomed && step == kRehomeAfter) {
        manager.rehome_pages(experts, std::vector<Tier>(experts.size(), Tier::host), 0);
        for (const PageRef& p : experts) EXPECT_EQ(manager.home(p), Tier::host);
      }
    }
    store.apply_pending();
    manager.drain();
    for (int id = 0; id < static_cast<int>(store.tensors().size()); ++id) {
      const PageLease use = store.use_tensor(id, {Plane::param});
      const std::span<const float> v = store.view(id, Plane::param);
      out.params.insert(out.params.end(), v.begin(), v.end());
    }
    store.attach_residency(nullptr);
    return out;
  };
  const Run placed = run(false), rehomed = run(true);
  ASSERT_EQ(placed.counters.size(), rehomed.counters.size());
  uint64_t touches = 0, hits = 0;
  for (size_t k = 0; k < placed.counters.size(); ++k) {
    EXPECT_EQ(rehomed.counters[k].acquires, placed.counters[k].acquires) << "page and step " << k;
    EXPECT_EQ(rehomed.counters[k].hits, placed.counters[k].hits) << "page and step " << k;
    touches += rehomed.counters[k].acquires, hits += rehomed.counters[k].hits;
  }
  EXPECT_GT(touches, 0u);
  EXPECT_EQ(hits, touches) << "re-homed experts' first touches that missed";
  ASSERT_EQ(placed.params.size(), rehomed.params.size());
  EXPECT_EQ(std::memcmp(placed.params.data(), rehomed.params.data(), placed.params.size() * sizeof(float)), 0);
}

// Without balancing the routers favour a few experts; tier.experts = "by_frequency" re-homes the
// experts every 2 steps by the pairs routed to each since the last plan: afterwards every
// device-homed expert's share is at least any other's divided by the hysteresis (1.25), some
// but not all are on the device, and the run's bytes are still the memory run's (above).
TEST_F(MoeTiers, ByFrequencyHomesTheMostChosenExpertsOnTheDevice) {
  const testing::CommandResult r =
      train("frequency", tiers("--set tier.experts=by_frequency --set tier.experts_every=2 --set model.moe_aux_weight=0"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tier.experts = by_frequency"), std::string::npos) << r.output;
  const std::vector<json> got = lines("frequency");
  ASSERT_EQ(got.size(), static_cast<size_t>(kSteps));
  int rehomed = 0;
  for (size_t i = 1; i < got.size(); i += 2) {  // steps 2, 4, ...: a plan from this step and the one before
    if (!got[i].contains("tier_experts_rehomed")) continue;
    rehomed++;
    std::vector<double> share;
    std::vector<std::string> home;
    for (size_t b = 0; b < 2; ++b) {
      for (size_t e = 0; e < 4; ++e) {
        share.push_back(got[i].at("moe_layers")[b].at("tokens")[e].get<double>() +
                        got[i - 1].at("moe_layers")[b].at("tokens")[e].get<double>());
        home.push_back(got[i].at("tier_experts")[b].at("home")[e].get<std::string>());
      }
    }
    const auto on_device = std::count(home.begin(), home.end(), "device");
    EXPECT_GT(on_device, 0) << got[i];
    EXPECT_LT(on_device, 8) << got[i];
    for (size_t d = 0; d < 8; ++d) {
      for (size_t o = 0; o < 8; ++o) {
        if (home[d] == "device" && home[o] != "device") {
          EXPECT_GE(share[d] * 1.25, share[o]) << "step " << i + 1 << ": expert " << d << " on the device, " << o << " not";
        }
      }
    }
  }
  EXPECT_GE(rehomed, 1) << "the first plan moves the experts off their placement";
  fs::remove_all(at("frequency"));
}

TEST_F(MoeTiers, BadValuesOfTheExpertKeysAreRefusedInOneLine) {
  const std::vector<std::string> moe = {"model.preset=llama-moe-tiny", "tier.device_mib=64", "tier.host_mib=64"};
  auto refusal = [&](std::vector<std::string> extra, bool with_moe = true) {
    std::vector<std::string> sets = with_moe ? moe : std::vector<std::string>{};
    sets.insert(sets.end(), extra.begin(), extra.end());
    const std::string why = testing::config_refusal(sets, 1);
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    return why;
  };
  EXPECT_EQ(refusal({"tier.experts=by_frequency"}), "");
  EXPECT_NE(refusal({"tier.experts=sometimes"}).find("'tier.experts': expected \"off\" or \"by_frequency\""),
            std::string::npos);
  EXPECT_NE(refusal({"tier.experts=by_frequency", "tier.device_mib=64"}, false).find("'tier.experts'"), std::string::npos);
  EXPECT_NE(refusal({"model.preset=llama-moe-tiny", "tier.experts=by_frequency"}, false).find("'tier.experts'"),
            std::string::npos);
  EXPECT_NE(refusal({"tier.experts=by_frequency", "tier.policy=adaptive"}).find("'tier.policy'"), std::string::npos);
  EXPECT_NE(refusal({"tier.experts_every=0"}).find("'tier.experts_every'"), std::string::npos);
  // (bf16 parameters: the line names the key and the plane the bf16 state keeps outside the tiers;
  // bf16 gradients alone are built)
  for (const std::vector<std::string>& state :
       {std::vector<std::string>{"runtime.param_dtype=bf16"}, {"runtime.param_dtype=bf16", "runtime.grad_dtype=bf16"}}) {
    std::vector<std::string> sets = {"tier.experts=by_frequency"};
    sets.insert(sets.end(), state.begin(), state.end());
    const std::string why = refusal(sets);
    EXPECT_NE(why.find("'runtime.param_dtype'"), std::string::npos) << why;
    EXPECT_NE(why.find("experts' parameter pages outside the memory tiers"), std::string::npos) << why;
  }
  EXPECT_EQ(refusal({"tier.experts=by_frequency", "runtime.grad_dtype=bf16"}), "");
  EXPECT_EQ(refusal({"tier.experts=by_frequency", "runtime.precision=bf16"}), "");
}

// bf16 products (runtime.precision = "bf16": the tiers hold float32 pages, the products round
// them) with the experts homed by routing share every 2 steps: the bytes of bf16 products in memory.
TEST_F(MoeTiers, ByFrequencyWithBf16ProductsTrainsTheBytesOfBf16InMemory) {
  expect_by_frequency_trains_bytes_in_memory("memory-bf16", "tiered-bf16", " --set runtime.precision=bf16 ");
  fs::remove_all(at("memory-bf16"));
  fs::remove_all(at("tiered-bf16"));
}

// bf16 gradients (runtime.grad_dtype = "bf16": the bf16 state keeps them outside the tiers) with
// the experts' parameter pages homed by routing share every 2 steps through a 1 MiB compute tier:
// the bytes of bf16 gradients in memory, re-homed at least once, every step's per-expert figures
// of parameter pages alone.
TEST_F(MoeTiers, ByFrequencyWithBf16GradientsHomesTheParameterPagesAndTrainsTheirBytesInMemory) {
  ASSERT_NO_FATAL_FAILURE(expect_by_frequency_trains_bytes_in_memory(
      "memory-bf16-grads", "freq-bf16-grads", " --set runtime.grad_dtype=bf16 --set model.moe_aux_weight=0 "));
  int rehomed = 0;
  double read = 0;
  for (const json& s : lines("freq-bf16-grads")) {
    rehomed += s.contains("tier_experts_rehomed") ? 1 : 0;
    ASSERT_EQ(s.at("tier_experts").size(), 2u) << s;
    for (const json& block : s.at("tier_experts")) {
      for (const json& bytes : block.at("read_bytes")) read += bytes.get<double>();
    }
  }
  EXPECT_GE(rehomed, 1);
  EXPECT_GT(read, 0) << "no expert parameter page was read through the tiers";
  fs::remove_all(at("memory-bf16-grads"));
  fs::remove_all(at("freq-bf16-grads"));
}

// The planner against every assignment of 5 experts to the three tiers: the plan is the one a
// greedy by (hysteresis-weighted) share gives, it never exceeds a room, and shares within the
// hysteresis of an incumbent do not move it.
TEST(ExpertHomes, TheMostChosenExpertsTakeTheDeviceThenHostWithinTheirRooms) {
  const std::vector<int64_t> bytes = {10, 10, 10, 10, 10};
  const std::vector<double> shares = {5, 40, 1, 30, 24};
  const std::vector<Tier> nowhere(5, Tier::nvme);
  ExpertHomesInput in{shares, bytes, nowhere, 20, 20, true, 1.25};
  EXPECT_EQ(plan_expert_homes(in),
            (std::vector<Tier>{Tier::host, Tier::device, Tier::nvme, Tier::device, Tier::host}));
  // Brute force: of all assignments within the rooms, the plan carries the most routed pairs on
  // the device, then on device + host.
  double best_device = 0, best_both = 0;
  for (int code = 0; code < 243; ++code) {
    double d = 0, h = 0;
    int64_t dev = 0, host = 0;
    for (int e = 0, c = code; e < 5; ++e, c /= 3) {
      if (c % 3 == 0) d += shares[e], dev += bytes[e];
      if (c % 3 == 1) h += shares[e], host += bytes[e];
    }
    if (dev > 20 || host > 20) continue;
    if (d > best_device || (d == best_device && d + h > best_both)) best_device = d, best_both = d + h;
  }
  const std::vector<Tier> plan = plan_expert_homes(in);
  double plan_device = 0, plan_both = 0;
  for (int e = 0; e < 5; ++e) {
    plan_device += plan[e] == Tier::device ? shares[e] : 0;
    plan_both += plan[e] != Tier::nvme ? shares[e] : 0;
  }
  EXPECT_EQ(plan_device, best_device);
  EXPECT_EQ(plan_both, best_both);
  // Hysteresis: expert 4 (24) holds the device against expert 3 (30 < 1.25 x 24) ...
  const std::vector<Tier> now = {Tier::host, Tier::device, Tier::nvme, Tier::host, Tier::device};
  in.current = now;
  EXPECT_EQ(plan_expert_homes(in),
            (std::vector<Tier>{Tier::host, Tier::device, Tier::nvme, Tier::host, Tier::device}));
  // ... not against 31 (> 1.25 x 24 = 30).
  const std::vector<double> moved = {5, 40, 1, 31, 24};
  in.shares = moved;
  EXPECT_EQ(plan_expert_homes(in),
            (std::vector<Tier>{Tier::host, Tier::device, Tier::nvme, Tier::device, Tier::host}));
  // An expert too large for the room left is passed over for a smaller one; without NVMe the
  // rest stays on host.
  const std::vector<int64_t> sizes = {10, 15, 10, 10, 10};
  in.bytes = sizes;
  in.current = nowhere;
  in.shares = shares;
  in.nvme = false;
  EXPECT_EQ(plan_expert_homes(in),
            (std::vector<Tier>{Tier::host, Tier::device, Tier::host, Tier::host, Tier::host}));
}

}  // namespace
}  // namespace keel
