// Configuration choices (core/config.h): every key with a closed set of values is an enum parsed
// once, printed with its spelling, refused in one line naming the key; no component compares a
// config field with a string.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "core/config.h"
#include "core/error.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::error_of;

// parse(to_string(v)) == v for every value, the spellings distinct, and the table a permutation of
// the enum's values 0..n-1 (no value left without a spelling, none spelled twice).
template <ConfigEnum E>
void expect_round_trip(const char* enum_name) {
  std::set<std::string> spellings;
  std::set<int> values;
  for (const E v : enum_values<E>()) {
    EXPECT_EQ(parse_enum<E>(to_string(v)), v) << enum_name << " " << to_string(v);
    EXPECT_EQ(parse_enum<E>(std::string(to_string(v)), "key"), v) << enum_name;
    spellings.insert(to_string(v));
    values.insert(static_cast<int>(v));
  }
  const size_t n = enum_values<E>().size();
  EXPECT_EQ(spellings.size(), n) << enum_name << ": a spelling used twice";
  EXPECT_EQ(values.size(), n) << enum_name << ": a value spelled twice";
  EXPECT_EQ(*values.begin(), 0) << enum_name;
  EXPECT_EQ(*values.rbegin(), static_cast<int>(n) - 1) << enum_name << ": a value without a spelling";
  EXPECT_EQ(parse_enum<E>("no-such-value"), std::nullopt) << enum_name;
  EXPECT_EQ(parse_enum<E>(""), std::nullopt) << enum_name;
}

TEST(ConfigChoices, EveryEnumRoundTripsThroughItsSpelling) {
  expect_round_trip<Family>("Family");
  expect_round_trip<RopeScaling>("RopeScaling");
  expect_round_trip<Attention>("Attention");
  expect_round_trip<Precision>("Precision");
  expect_round_trip<ScheduleKind>("ScheduleKind");
  expect_round_trip<PartitionerKind>("PartitionerKind");
  expect_round_trip<PredictGradients>("PredictGradients");
  expect_round_trip<CodecKind>("CodecKind");
  expect_round_trip<SyncCodec>("SyncCodec");
  expect_round_trip<SumShape>("SumShape");
  expect_round_trip<Tier>("Tier");
  expect_round_trip<IoEngine>("IoEngine");
  expect_round_trip<TierPolicy>("TierPolicy");
  expect_round_trip<KvTier>("KvTier");
  expect_round_trip<ImageTower>("ImageTower");
  expect_round_trip<VisualQuant>("VisualQuant");
  expect_round_trip<GradBalance>("GradBalance");
  // sync.codec's single codecs are the codecs themselves.
  for (const CodecKind k : enum_values<CodecKind>()) {
    EXPECT_STREQ(to_string(*parse_enum<SyncCodec>(to_string(k))), to_string(k));
    EXPECT_EQ(uniform_codec(*parse_enum<SyncCodec>(to_string(k))), k);
  }
}

// Every choice key of the config, with the spellings its enum has ("" first where the key may be unset).
struct ChoiceKey {
  std::string key;
  std::vector<std::string> spellings;
};

template <ConfigEnum E>
std::vector<std::string> spellings_of(bool may_be_unset) {
  std::vector<std::string> out;
  if (may_be_unset) out.push_back("");
  for (const E v : enum_values<E>()) out.push_back(to_string(v));
  return out;
}

std::vector<ChoiceKey> choice_keys() {
  return {
      {"model.family", spellings_of<Family>(true)},
      {"model.rope_scaling", spellings_of<RopeScaling>(false)},
      {"model.attention", spellings_of<Attention>(false)},
      {"parallel.schedule", spellings_of<ScheduleKind>(false)},
      {"parallel.partitioner", spellings_of<PartitionerKind>(false)},
      {"parallel.predict_gradients", spellings_of<PredictGradients>(false)},
      {"sync.codec", spellings_of<SyncCodec>(false)},
      {"sync.embedding", spellings_of<CodecKind>(true)},
      {"sync.attention", spellings_of<CodecKind>(true)},
      {"sync.ffn", spellings_of<CodecKind>(true)},
      {"sync.norm", spellings_of<CodecKind>(true)},
      {"sync.head", spellings_of<CodecKind>(true)},
      {"sync.shape", spellings_of<SumShape>(false)},
      {"tier.engine", spellings_of<IoEngine>(false)},
      {"tier.embedding", spellings_of<Tier>(false)},
      {"tier.attention", spellings_of<Tier>(false)},
      {"tier.ffn", spellings_of<Tier>(false)},
      {"tier.norm", spellings_of<Tier>(false)},
      {"tier.optimizer", spellings_of<Tier>(true)},
      {"tier.policy", spellings_of<TierPolicy>(false)},
      {"runtime.precision", spellings_of<Precision>(false)},
      {"generate.kv_tier", spellings_of<KvTier>(false)},
      {"clip.image_tower", spellings_of<ImageTower>(true)},
      {"clip.visual_quant", spellings_of<VisualQuant>(false)},
      {"clip.grad_balance", spellings_of<GradBalance>(false)},
  };
}

// `key = "value"` in a TOML file; to_toml writes `key = 'value'` (a literal string).
std::string toml_line(const std::string& key, const std::string& value, char quote = '"') {
  return key.substr(key.find('.') + 1) + " = " + quote + value + quote + "\n";
}

TEST(ConfigChoices, EverySpellingIsReadFromSetAndFilesAndWrittenBackTheSame) {
  testing::TempDir dir;
  for (const ChoiceKey& k : choice_keys()) {
    const std::string section = k.key.substr(0, k.key.find('.'));
    for (const std::string& spelling : k.spellings) {
      const Config from_set = Config::load("", {k.key + "=" + spelling});
      const std::string toml = from_set.to_toml();
      const std::string section_text = toml.substr(toml.find("[" + section + "]\n"));
      EXPECT_NE(section_text.find("\n" + toml_line(k.key, spelling, '\'')), std::string::npos) << k.key << " = " << spelling;
      testing::write_text(dir / "c.toml", "[" + section + "]\n" + toml_line(k.key, spelling));
      EXPECT_EQ(Config::load(dir / "c.toml", {}).to_toml(), toml) << k.key << " = " << spelling;
      EXPECT_EQ(Config::load("", {k.key + "=\"" + spelling + "\""}).to_toml(), toml) << k.key << " (quoted)";
    }
  }
}

TEST(ConfigChoices, ABadValueIsOneLineNamingTheKeyTheValueAndTheChoices) {
  testing::TempDir dir;
  for (const ChoiceKey& k : choice_keys()) {
    const std::string from_set = error_of([&] { Config::load("", {k.key + "=bogus-value"}); });
    EXPECT_NE(from_set.find(k.key), std::string::npos) << from_set;
    EXPECT_NE(from_set.find("\"bogus-value\""), std::string::npos) << from_set;
    EXPECT_NE(from_set.find(k.spellings.back()), std::string::npos) << from_set << ": the choices are named";
    EXPECT_EQ(from_set.find('\n'), std::string::npos) << from_set;
    const std::string section = k.key.substr(0, k.key.find('.'));
    testing::write_text(dir / "bad.toml", "[" + section + "]\n" + toml_line(k.key, "bogus-value"));
    const std::string from_file = error_of([&] { Config::load(dir / "bad.toml", {}); });
    EXPECT_NE(from_file.find("bad.toml"), std::string::npos) << from_file;
    EXPECT_NE(from_file.find(k.key), std::string::npos) << from_file;
    EXPECT_EQ(from_file.find('\n'), std::string::npos) << from_file;
    // Not a string at all: the file's mistyped value, as for any string key.
    testing::write_text(dir / "typed.toml", "[" + section + "]\n" + k.key.substr(k.key.find('.') + 1) + " = 3\n");
    const std::string typed = error_of([&] { Config::load(dir / "typed.toml", {}); });
    EXPECT_NE(typed.find("expects a string"), std::string::npos) << typed;
  }
  // The wording the suites and users know, unchanged.
  EXPECT_EQ(error_of([] { Config::load("", {"runtime.precision=fp16"}); }),
            "config key 'runtime.precision': expected \"fp32\" or \"bf16\", found \"fp16\"");
  EXPECT_EQ(error_of([] { Config::load("", {"model.family=mamba"}); }),
            "model.family: expected \"gpt2\" or \"llama\", found \"mamba\"");
  EXPECT_EQ(error_of([] { Config::load("", {"tier.ffn=gpu"}); }),
            "config key 'tier.ffn': unknown tier \"gpu\" (expected one of: device, host, nvme)");
}

TEST(ConfigChoices, JsonWritesAChoiceAsItsSpelling) {
  EXPECT_EQ(nlohmann::json(ScheduleKind::zb_h1).dump(), "\"zb-h1\"");
  const nlohmann::json line = {{"codec", SyncCodec::quant2_topk}, {"precision", Precision::bf16}};
  EXPECT_EQ(line.dump(), R"({"codec":"quant2-topk","precision":"bf16"})");
}

// Every key of the configuration, as its TOML spells it (the section's key names).
std::set<std::string> config_key_names() {
  Config c = Config::load("", {});
  c.resolve();
  std::set<std::string> keys;
  std::istringstream in(c.to_toml());
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find(" = ");
    if (!line.empty() && line[0] != '[' && eq != std::string::npos) keys.insert(line.substr(0, eq));
  }
  return keys;
}

// A comparison of a config field (`x.KEY`, `x->KEY`) with a string literal, either way round.
std::regex comparison_of_config_field_with_literal() {
  std::string keys;
  for (const std::string& k : config_key_names()) keys += (keys.empty() ? "" : "|") + k;
  return std::regex("(?:\\.|->)(" + keys + ")\\b\\)?\\s*[!=]=\\s*\"|\"\\s*[!=]=\\s*[A-Za-z_][\\w.>-]*(?:\\.|->)(" + keys +
                    ")\\b");
}

TEST(ConfigChoices, ThePatternCatchesConfigComparisonsAndNotFileFormats) {
  const std::regex pattern = comparison_of_config_field_with_literal();
  for (const char* caught : {R"(if (config_.runtime.precision == "bf16") {)", R"(p.schedule != "1f1b")",
                             R"("auto" == config.train.resume)", R"(std::string(c.sync.codec) != "none")",
                             R"(t->policy == "adaptive")"}) {
    EXPECT_TRUE(std::regex_search(std::string(caught), pattern)) << caught;
  }
  for (const char* left : {R"(if (j.value("event", "") == "checkpoint") {)", R"(check(format == "keel-checkpoint", "x");)",
                           R"(if (method != "GET" && !head_only) {)", R"(if (ext == ".png") return decode_png(path);)",
                           R"(config.runtime.precision == Precision::bf16)"}) {
    EXPECT_FALSE(std::regex_search(std::string(left), pattern)) << left;
  }
}

// Comparisons the pattern finds that are not about the configuration, each with why.
const std::vector<std::pair<std::string, std::string>> kAllowed = {
    // ResNetSpec::block is the model's residual block kind ("basic" | "bottleneck"), set by
    // resnet_preset from clip.image_tower; the pattern sees the name of sync.block.
    {"src/model/resnet.cpp", ".block == \"bottleneck\""},
    {"src/model/resnet.cpp", ".block == \"basic\""},
};

TEST(ConfigChoices, NoComponentComparesAConfigFieldWithAString) {
  const std::regex pattern = comparison_of_config_field_with_literal();
  const std::filesystem::path src = testing::source_path("src");
  std::vector<std::string> found;
  int files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(src)) {
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || (ext != ".cpp" && ext != ".h")) continue;
    const std::string relative = "src/" + std::filesystem::relative(entry.path(), src).generic_string();
    if (relative == "src/core/config.cpp" || relative == "src/core/config.h") continue;  // where choices are parsed
    ++files;
    std::ifstream in(entry.path());
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      if (!std::regex_search(line, pattern)) continue;
      const bool allowed = std::any_of(kAllowed.begin(), kAllowed.end(), [&](const auto& a) {
        return a.first == relative && line.find(a.second) != std::string::npos;
      });
      if (!allowed) found.push_back(relative + ":" + std::to_string(number) + ": " + line);
    }
  }
  EXPECT_GT(files, 50) << "the sources were not found under " << src;
  std::string all;
  for (const std::string& f : found) all += f + "\n";
  EXPECT_TRUE(found.empty()) << "config fields compared with strings (parse the choice in core/config, compare enums):\n"
                             << all;
}

}  // namespace
}  // namespace keel
