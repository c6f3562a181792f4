#include "core/config.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::error_of;

TEST(Config, DefaultsResolveToTheD4Preset) {
  Config c = Config::load("", {});
  c.resolve();
  EXPECT_EQ(c.model.n_layer, 4);
  EXPECT_EQ(c.model.n_embd, 256);
  EXPECT_EQ(c.model.vocab_size, 8192);
  EXPECT_EQ(c.model.padded_vocab_size, 8192);
}

TEST(Config, PresetsAndExplicitOverrides) {
  Config c = Config::load("", {"model.preset=gpt2-124m", "model.n_layer=2"});
  c.resolve();
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.n_embd, 768);
  EXPECT_EQ(c.model.padded_vocab_size, 50304);
  for (const char* name : {"gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "tiny", "d4", "d6", "d12"}) {
    Config p = Config::load("", {std::string("model.preset=") + name});
    EXPECT_NO_THROW(p.resolve()) << name;
  }
}

TEST(Config, FileThenCommandLine) {
  testing::TempDir dir;
  testing::write_text(dir / "a.toml", "[train]\nbatch_size = 3\nseq_len = 32\n[optim]\nlr = 1e-4\n");
  Config c = Config::load(dir / "a.toml", {"train.batch_size=5"});
  c.resolve();
  EXPECT_EQ(c.train.batch_size, 5);
  EXPECT_EQ(c.train.seq_len, 32);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-4);
}

TEST(Config, TomlRoundTrip) {
  testing::TempDir dir;
  Config c = Config::load("", {"model.preset=tiny", "optim.lr=0.00123", "train.run_dir=x y"});
  c.resolve();
  testing::write_text(dir / "r.toml", c.to_toml());
  Config d = Config::load(dir / "r.toml", {});
  d.resolve();
  EXPECT_EQ(c.to_toml(), d.to_toml());
  EXPECT_EQ(c.shape_hash(), d.shape_hash());
}

TEST(Config, UnknownKeyNamesTheKeyAndTheKnownOnes) {
  testing::TempDir dir;
  testing::write_text(dir / "bad.toml", "[train]\nlearning_rate = 1.0\n");
  const std::string msg = error_of([&] { Config::load(dir / "bad.toml", {}); });
  EXPECT_NE(msg.find("train.learning_rate"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bad.toml"), std::string::npos) << msg;
  EXPECT_NE(msg.find("batch_size"), std::string::npos) << msg;
  EXPECT_NE(error_of([] { Config::load("", {"nosuch.key=1"}); }).find("[nosuch]"), std::string::npos);
  // The unknown section's error lists every section there is, not a hand-kept subset.
  const std::string sections = error_of([] { Config::load("", {"nosuch.key=1"}); });
  for (const char* s : {"[model]", "[clip]", "[monitor]", "[generate]", "[store]", "[runtime]"}) {
    EXPECT_NE(sections.find(s), std::string::npos) << s << " missing from: " << sections;
  }
}

TEST(Config, MistypedValues) {
  testing::TempDir dir;
  testing::write_text(dir / "bad.toml", "[train]\nbatch_size = \"eight\"\n");
  const std::string msg = error_of([&] { Config::load(dir / "bad.toml", {}); });
  EXPECT_NE(msg.find("train.batch_size"), std::string::npos) << msg;
  EXPECT_NE(msg.find("integer"), std::string::npos) << msg;
  EXPECT_NE(error_of([] { Config::load("", {"train.batch_size=8x"}); }).find("integer"), std::string::npos);
  EXPECT_NE(error_of([] { Config::load("", {"optim.lr=fast"}); }).find("number"), std::string::npos);
  EXPECT_NE(error_of([] { Config::load("", {"train.batch_size"}); }).find("section.key=value"), std::string::npos);
}

TEST(Config, SyntaxErrorNamesFileAndLine) {
  testing::TempDir dir;
  testing::write_text(dir / "bad.toml", "[train]\nbatch_size = = 3\n");
  const std::string msg = error_of([&] { Config::load(dir / "bad.toml", {}); });
  EXPECT_NE(msg.find("bad.toml:2"), std::string::npos) << msg;
}

TEST(Config, ImpossibleSizes) {
  Config c = Config::load("", {"model.n_embd=100", "model.n_head=3"});
  const std::string msg = error_of([&] { c.resolve(); });
  EXPECT_NE(msg.find("model.n_head"), std::string::npos) << msg;
  EXPECT_NE(msg.find("divisor"), std::string::npos) << msg;
  Config d = Config::load("", {"train.seq_len=5000", "model.max_seq_len=256"});
  EXPECT_NE(error_of([&] { d.resolve(); }).find("train.seq_len"), std::string::npos);
  Config e = Config::load("", {"model.preset=gpt5"});
  EXPECT_NE(error_of([&] { e.resolve(); }).find("gpt2-124m"), std::string::npos);
  // Above 65,536 tokens shards hold uint32 ids (Llama 3's 128,256 resolves); 2^24 is the ceiling.
  Config f = Config::load("", {"model.vocab_size=20000000"});
  EXPECT_NE(error_of([&] { f.resolve(); }).find("model.vocab_size: expected 2..16777216"), std::string::npos);
  Config g = Config::load("", {"model.vocab_size=128256"});
  g.resolve();
  EXPECT_EQ(g.model.padded_vocab_size, 128256);
}

// The optimizer computes in float32: a learning rate (or eps, weight decay, final rate) that rounds
// to 0 or to a denormal there, or a beta that rounds to 1, would train nothing without a word.
TEST(Config, OptimizerSettingsFloat32WouldLoseAreRefused) {
  for (const auto& [set, key] : std::vector<std::pair<std::string, std::string>>{
           {"optim.lr=1e-50", "optim.lr"},
           {"optim.lr=1e-40", "optim.lr"},  // a denormal float
           {"optim.lr=1e39", "optim.lr"},
           {"optim.eps=1e-50", "optim.eps"},
           {"optim.weight_decay=1e-46", "optim.weight_decay"},
           {"optim.min_lr_ratio=1e-40", "optim.min_lr_ratio"},  // 3e-3 * 1e-40: a denormal final rate
           {"optim.beta1=0.99999999999", "optim.beta1"},       // 1.0f
           {"optim.beta2=0.999999999", "optim.beta2"}}) {
    Config c = Config::load("", {set});
    const std::string msg = error_of([&] { c.resolve(); });
    EXPECT_NE(msg.find("config key '" + key + "'"), std::string::npos) << set << ": " << msg;
    EXPECT_NE(msg.find("float32"), std::string::npos) << set << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([] {
              Config c = Config::load("", {"optim.lr=1e-50"});
              c.resolve();
            }).find("found 1e-50"),
            std::string::npos);
  // Small but normal, and the zeros that mean "off", stay accepted.
  Config ok = Config::load("", {"optim.lr=1e-30", "optim.min_lr_ratio=0", "optim.weight_decay=0", "optim.eps=1e-30",
                                "optim.beta1=0", "optim.beta2=0.9999"});
  EXPECT_EQ(error_of([&] { ok.resolve(); }), "");
}

TEST(Config, MissingFile) {
  EXPECT_NE(error_of([] { Config::load("/nonexistent/x.toml", {}); }).find("not found"), std::string::npos);
}

}  // namespace
}  // namespace keel
