// Compressed data-parallel gradient sync (HybridGC) as a user runs it: the depth policy and its
// errors; `keel launch` with every codec, the hybrid policy, warm-up, deterministic bytes, far
// fewer bytes on the wire, per-layer metrics, and error-feedback residuals that survive a resume.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "comm/sync_policy.h"
#include "core/config.h"
#include "core/error.h"
#include "core/fileio.h"
#include "runtime/job_config.h"
#include "test_util.h"

namespace keel {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// The policy

TEST(SyncPolicy, DefaultIsTheSeedsSplitByIndexForDeepModelsAndDense2BitForShallowOnes) {
  const std::vector<SyncRule> deep = parse_sync_policy(default_sync_policy(48));
  for (int b = 0; b < 48; ++b) {
    const CodecKind want = b <= 10 ? CodecKind::sign1 : b <= 30 ? CodecKind::quant2_topk : CodecKind::fp16;
    EXPECT_EQ(policy_codec(deep, b, 48), want) << "block " << b;
  }
  // Shallower models: dense 2-bit everywhere (1-bit costs them too much loss, as measured).
  EXPECT_EQ(default_sync_policy(12), "0.0-:quant2-topk");
  const std::vector<SyncRule> shallow = parse_sync_policy(default_sync_policy(12));
  for (int b = 0; b < 12; ++b) EXPECT_EQ(policy_codec(shallow, b, 12), CodecKind::quant2_topk) << "block " << b;
}

TEST(SyncPolicy, ParsesIndexAndFractionRanges) {
  const auto idx = parse_sync_policy(" 0-1 : sign1 , 2-2:topk,3-:fp16");
  EXPECT_EQ(policy_codec(idx, 0, 6), CodecKind::sign1);
  EXPECT_EQ(policy_codec(idx, 2, 6), CodecKind::topk);
  EXPECT_EQ(policy_codec(idx, 5, 6), CodecKind::fp16);
  const auto frac = parse_sync_policy("0.0-0.5:randk,0.5-1.0:bf16");
  EXPECT_EQ(policy_codec(frac, 1, 4), CodecKind::randk);  // depth 0.25
  EXPECT_EQ(policy_codec(frac, 2, 4), CodecKind::bf16);   // depth 0.5
  EXPECT_EQ(policy_codec(frac, 3, 4), CodecKind::bf16);
}

TEST(SyncPolicy, BadPoliciesNameTheKeyAndTheEntry) {
  auto fails = [](const std::string& policy, const std::string& needle, int n_layer = 4) {
    try {
      const auto rules = parse_sync_policy(policy);
      for (int b = 0; b < n_layer; ++b) policy_codec(rules, b, n_layer);
      ADD_FAILURE() << policy << " was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("sync.policy"), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
  };
  fails("0-3:zip", "unknown gradient codec \"zip\"");
  fails("0-3", "no ':codec'");
  fails("3:sign1", "no LO-HI range");
  fails("a-3:sign1", "not numbers");
  fails("0-1:sign1", "block 2 of 4 is covered by no range");
  fails("0-2:sign1,2-:fp16", "block 2 of 4 is covered by more than one range");
  fails("0-0.5:sign1,2-:fp16", "mixes block indices and depth fractions");
  fails("0.5-0.2:sign1", "0 <= LO < HI <= 1");
  fails("0-1:sign1,,2-:fp16", "empty");
}

TEST(SyncPolicy, ChunksGetTheirLayersCodecUnlessTheirKindIsOverridden) {
  Config c;
  c.model.preset = "tiny";
  c.sync.codec = SyncCodec::hybrid;
  c.sync.policy = "0-0:sign1,1-:quant2-topk";
  c.sync.norm = CodecKind::none;
  c.sync.quant2_keep = 0.05;
  resolve_job_config(c, 2);
  ChunkStore store(c.store.chunk_bytes);
  GPT model(c.model, store);
  store.finalize();
  const std::vector<CodecParams> codecs = sync_chunk_codecs(c.sync, c.model.n_layer, store);
  ASSERT_EQ(codecs.size(), store.chunks().size());
  for (const Chunk& chunk : store.chunks()) {
    const CodecParams& p = codecs[chunk.id];
    if (chunk.kind == ChunkKind::norm) {
      EXPECT_EQ(p.kind, CodecKind::none) << chunk.id;
    } else if (chunk.layer <= 1) {  // embeddings take block 0's codec
      EXPECT_EQ(p.kind, CodecKind::sign1) << chunk.id;
    } else {
      EXPECT_EQ(p.kind, CodecKind::quant2_topk) << chunk.id;
      EXPECT_EQ(p.keep, 0.05);
    }
  }
}

TEST(SyncPolicy, ConfigRefusesWhatCannotWork) {
  auto refused = [](const std::vector<std::string>& sets, const std::string& needle, int world = 2) {
    const std::string why = testing::config_refusal(sets, world);
    EXPECT_NE(why.find(needle), std::string::npos) << (why.empty() ? "accepted: " + sets.back() : why);
  };
  refused({"sync.codec=zip"}, "sync.codec");
  refused({"sync.codec=sign1", "parallel.zero=2"}, "needs parallel.zero 0 or 1");
  refused({"sync.codec=sign1", "sync.policy=0-:fp16"}, "applies only with sync.codec = \"hybrid\"");
  refused({"sync.codec=hybrid", "sync.policy=0-1:sign1"}, "covered by no range");
  refused({"sync.codec=topk", "sync.topk_keep=0"}, "sync.topk_keep");
  refused({"sync.codec=quant2-topk", "sync.quant2_keep=1.01"}, "sync.quant2_keep");
  refused({"sync.codec=sign1", "sync.sign1_keep=1.5"}, "sync.sign1_keep");
  refused({"sync.codec=sign1", "sync.block=0"}, "sync.block");
  refused({"sync.codec=sign1", "sync.warmup_steps=-1"}, "sync.warmup_steps");
  refused({"sync.norm=fp32"}, "sync.norm");
  refused({"sync.shape=ring"}, "sync.shape");
}

// ---------------------------------------------------------------------------------------------
// Training with compressed sync

class CompressedSync : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 20);
  }
  // Two uncompressed warm-up steps unless `extra` says otherwise (a later --set wins).
  testing::CommandResult train(int ranks, const std::string& run, const std::string& extra = "") {
    return testing::run_keel("launch -n " + std::to_string(ranks) + " -- train --config " + dir / "toy.toml" +
                             " --set train.run_dir=" + dir / run + " --set sync.warmup_steps=2 " + extra);
  }
  std::vector<json> steps(const std::string& run) {
    std::vector<json> out;
    const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
    for (size_t start = 0; start < text.size();) {
      const size_t end = text.find('\n', start);
      json j = json::parse(text.substr(start, end - start));
      if (j.contains("loss")) out.push_back(j);
      start = end + 1;
    }
    return out;
  }
  std::vector<char> params(const std::string& run) { return testing::checkpoint_bytes(dir / (run + "/ckpt")); }
  testing::TempDir dir{"keel-hybridgc"};
};

TEST_F(CompressedSync, HybridLearnsSendsFarFewerBytesAndReportsEveryLayer) {
  // An explicit split, so that two codecs share the run (the toy model is shallow: its default
  // is dense 2-bit everywhere).
  const auto r = train(2, "hybrid", "--set sync.codec=hybrid --set sync.policy=0-0:sign1,1-:quant2-topk --set train.log_every=5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("compressed sync \"hybrid\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("x smaller), codec"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("compressed sync over this run"), std::string::npos) << r.output;
  const std::vector<json> s = steps("hybrid");
  ASSERT_EQ(s.size(), 20u);
  EXPECT_LT(s.back()["loss"].get<double>(), 0.8 * s.front()["loss"].get<double>());
  for (const json& j : s) {
    // Two warm-up steps, then compressed. The toy model's tensors are small, so headers and
    // scales weigh more than on real models.
    if (j["step"].get<int>() <= 2) {
      EXPECT_DOUBLE_EQ(j["sync_ratio"].get<double>(), 1.0) << j.dump();
    } else {
      EXPECT_GT(j["sync_ratio"].get<double>(), 4.0) << j.dump();
    }
    EXPECT_NEAR(j["sync_ratio"].get<double>(), j["sync_uncompressed_bytes"].get<double>() / j["sync_sent_bytes"].get<double>(), 1e-9);
    EXPECT_GE(j["sync_encode_ms"].get<double>(), 0);
    EXPECT_GE(j["sync_decode_ms"].get<double>(), 0);
    double raw = 0, wire = 0;
    std::set<std::string> codecs;
    for (const json& l : j["sync_layers"]) {
      raw += l["raw_bytes"].get<double>();
      wire += l["wire_bytes"].get<double>();
      codecs.insert(l["codec"].get<std::string>());
    }
    EXPECT_EQ(j["sync_layers"].size(), 4u);  // embeddings, 2 blocks, final norm
    EXPECT_DOUBLE_EQ(raw, j["sync_payload_bytes"].get<double>());
    EXPECT_NEAR(wire, j["sync_sent_bytes"].get<double>(), 1e-6 * wire);
    const std::set<std::string> want =
        j["step"].get<int>() <= 2 ? std::set<std::string>{"none"} : std::set<std::string>{"sign1", "quant2-topk"};
    EXPECT_EQ(codecs, want);
  }
}

TEST_F(CompressedSync, EveryCodecTrainsAndTheSameLayoutTwiceGivesTheSameBytes) {
  for (const char* codec : {"fp16", "bf16", "sign1", "quant2-topk", "topk", "randk"}) {
    const std::string set = std::string("--set train.steps=6 --set sync.codec=") + codec;
    ASSERT_EQ(train(2, std::string("a-") + codec, set).exit_code, 0) << codec;
    const std::vector<json> s = steps(std::string("a-") + codec);
    ASSERT_EQ(s.size(), 6u) << codec;
    for (const json& j : s) EXPECT_TRUE(std::isfinite(j["loss"].get<double>())) << codec;
    EXPECT_LT(s.back()["loss"].get<double>(), s.front()["loss"].get<double>()) << codec;
  }
  // Random sparsification and three ranks: every rank's random choices are seeded; both shapes
  // of the dense sum.
  const std::string set = "--set sync.codec=hybrid --set sync.policy=0-0:sign1,1-:randk --set sync.sign1_keep=0.5";
  ASSERT_EQ(train(3, "x", set).exit_code, 0);
  ASSERT_EQ(train(3, "y", set).exit_code, 0);
  EXPECT_EQ(params("x"), params("y"));
  ASSERT_EQ(train(3, "g", set + " --set sync.shape=gather").exit_code, 0);
  EXPECT_NE(params("x"), params("g"));
  std::vector<double> lx, ly;
  for (const json& j : steps("x")) lx.push_back(j["loss"]);
  for (const json& j : steps("y")) ly.push_back(j["loss"]);
  EXPECT_EQ(lx, ly);
}

TEST_F(CompressedSync, WarmUpStepsAreExactlyUncompressed) {
  ASSERT_EQ(train(2, "plain", "--set train.steps=8").exit_code, 0);
  ASSERT_EQ(train(2, "warm", "--set train.steps=8 --set sync.codec=sign1 --set sync.warmup_steps=5").exit_code, 0);
  const std::vector<json> a = steps("plain"), b = steps("warm");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  // Steps 1-5 sync uncompressed: the same losses through step 6 (whose loss precedes its sync).
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>()) << "step " << i + 1;
  for (size_t i = 0; i < 5; ++i) EXPECT_DOUBLE_EQ(b[i]["sync_ratio"].get<double>(), 1.0) << "step " << i + 1;
  EXPECT_GT(b[5]["sync_ratio"].get<double>(), 4.0);
  EXPECT_NE(a[6]["loss"].get<double>(), b[6]["loss"].get<double>());
}

TEST_F(CompressedSync, ResidualsAreSavedAndAResumeReplaysToTheSameBytes) {
  // A global batch that 2 and 3 ranks share.
  const std::string batch = "--set train.global_batch_size=12 --set sync.codec=hybrid ";
  const std::string set = batch + "--set train.steps=12";
  ASSERT_EQ(train(2, "straight", set).exit_code, 0);
  ASSERT_EQ(train(2, "half", batch + "--set train.steps=6").exit_code, 0);
  // The checkpoint holds each rank's residuals and verifies.
  const std::string ckpt = testing::newest_checkpoint(dir / "half/ckpt");
  const json manifest = json::parse(read_text_file(ckpt + "/manifest.json"));
  for (const json& rank : manifest["ranks"]) EXPECT_TRUE(rank.contains("residual")) << rank.dump();
  const auto verified = testing::run_keel("checkpoints --dir " + dir / "half/ckpt" + " --verify yes");
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
  auto r = train(2, "resumed", set + " --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("residuals dropped"), std::string::npos) << r.output;
  EXPECT_EQ(params("straight"), params("resumed"));
  // Another layout of codecs (another keep ratio): the residuals do not fit; dropped, and said so.
  r = train(2, "other", set + " --set sync.quant2_keep=0.02 --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("compression residuals dropped"), std::string::npos) << r.output;
  // Another world size: resharded weights and moments, residuals start from zero, said so.
  r = train(3, "three", set + " --set train.resume=" + dir / "half/ckpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("error feedback starts from zero"), std::string::npos) << r.output;
}

TEST_F(CompressedSync, ZeroOneWithCompressionMatchesZeroZero) {
  const std::string set = "--set sync.codec=hybrid --set train.steps=8";
  ASSERT_EQ(train(2, "z0", set).exit_code, 0);
  ASSERT_EQ(train(2, "z1", set + " --set parallel.zero=1").exit_code, 0);
  EXPECT_EQ(params("z0"), params("z1"));
  const auto r = train(2, "z2", set + " --set parallel.zero=2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("needs parallel.zero 0 or 1"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace keel
