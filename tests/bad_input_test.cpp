// Bad input, as a careless or hostile user gives it, through the real `keel` binary:
// - a FIFO, a device or a socket where Keel reads a file (checkpoint records and manifests, token
//   shards, corpus text, tokenizers, images, configs, llm.c and llama2.c files, metrics) is refused
//   in one line naming it ("not a regular file (a FIFO)"), and never waited on;
// - a file name that is not UTF-8, a metrics value of the wrong type, a perplexity past the largest
//   double: no internal error, and what Keel prints as JSON is JSON;
// - settings float32 would round to nothing are refused.
// Every command runs under `timeout`, so a regression that blocks fails instead of hanging.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/fileio.h"
#include "image_files.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

// `keel ARGS`, killed after two minutes: a command that blocks comes back as exit 137.
CommandResult keel_bounded(const std::string& args) {
  return testing::run_command("timeout -s KILL 120 " + std::string(KEEL_BINARY) + " " + args);
}

enum class Special { fifo, device, socket };
constexpr Special kSpecials[] = {Special::fifo, Special::device, Special::socket};

// How Keel names each kind in its refusal.
std::string refusal(Special s) {
  switch (s) {
    case Special::fifo: return "not a regular file (a FIFO)";
    case Special::device: return "not a regular file (a character device)";
    case Special::socket: return "not a regular file (a socket)";
  }
  return "";
}

// Replaces whatever is at `path` with a special file: a FIFO (nobody writes to it), a link to
// /dev/zero (endless zeros), or an AF_UNIX socket nobody listens on.
void make_special(const std::string& path, Special s) {
  fs::remove_all(path);
  if (s == Special::fifo) {
    ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path << ": " << std::strerror(errno);
  } else if (s == Special::device) {
    fs::create_symlink("/dev/zero", path);
  } else {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    ASSERT_LT(path.size(), sizeof addr.sun_path) << path;
    std::strcpy(addr.sun_path, path.c_str());
    const int rc = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    ::close(fd);  // (the socket file stays; opening it fails with ENXIO)
    ASSERT_EQ(rc, 0) << path << ": " << std::strerror(errno);
  }
}

// The command finished (was not killed), failed, and said in one line that `path` is not a
// regular file of kind `s`.
void expect_refused(const CommandResult& r, const std::string& path, Special s) {
  EXPECT_NE(r.exit_code, 137) << "killed after blocking: " << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
  EXPECT_TRUE(contains(r.output, path + ": " + refusal(s))) << r.output;
}

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 4);
  }
  // A toy run of 4 steps into dir/run, with checkpoints at 2 and 4.
  CommandResult train(const std::string& run, const std::string& extra = "") {
    return keel_bounded("train --config " + dir / "toy.toml" + " --set train.run_dir=" + dir / run +
                        " --set train.checkpoint_every=2 " + extra);
  }
  testing::TempDir dir{"keel-bad-input"};
};

TEST_F(BadInput, ConfigFileThatIsNotARegularFileIsRefused) {
  for (Special s : kSpecials) {
    const std::string path = dir / "special.toml";
    make_special(path, s);
    expect_refused(keel_bounded("train --config " + path), path, s);
  }
}

TEST_F(BadInput, TokenShardThatIsNotARegularFileIsRefused) {
  for (Special s : kSpecials) {
    const std::string path = dir / "special.bin";
    make_special(path, s);
    expect_refused(train("run", "--set data.train=" + path), path, s);
    expect_refused(keel_bounded("eval --llmc " + testing::source_path("tests/fixtures/tiny_gpt2.bin") + " --seq 8 --data " + path),
                   path, s);
  }
}

TEST_F(BadInput, CorpusTextThatIsNotARegularFileIsRefused) {
  testing::write_text(dir / "text.txt", "one document\n%\nanother document\n%\na third\n");
  for (Special s : kSpecials) {
    const std::string path = dir / "special.txt";
    make_special(path, s);
    expect_refused(keel_bounded("tokenize --input " + dir / "text.txt" + " --input " + path + " --vocab-size 260 --out " +
                                dir / "tok"),
                   path, s);
  }
  // In a directory of text, special files are not text to read: passed over like subdirectories.
  fs::create_directories(dir / "texts");
  testing::write_text(dir / "texts/a.txt", "one document\n%\nanother document\n%\na third\n");
  make_special(dir / "texts/b.txt", Special::fifo);
  make_special(dir / "texts/c.txt", Special::device);
  make_special(dir / "texts/d.txt", Special::socket);
  const CommandResult r = keel_bounded("tokenize --input " + dir / "texts" + " --vocab-size 260 --out " + dir / "tok2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "3 documents")) << r.output;
}

TEST_F(BadInput, TokenizerThatIsNotARegularFileIsRefused) {
  for (Special s : kSpecials) {
    const std::string path = dir / "special.json";
    make_special(path, s);
    expect_refused(keel_bounded("export --tokenizer " + path + " --out " + dir / "tokenizer.bin"), path, s);
  }
}

TEST_F(BadInput, ImportsThatAreNotRegularFilesAreRefused) {
  for (Special s : kSpecials) {
    const std::string path = dir / "special-model.bin";
    make_special(path, s);
    expect_refused(keel_bounded("import --llmc " + path + " --out " + dir / "imported"), path, s);
    expect_refused(keel_bounded("import --llama2c " + path + " --out " + dir / "imported"), path, s);
    expect_refused(keel_bounded("eval --llmc " + path), path, s);
  }
}

// A checkpoint's record or manifest replaced by a special file: `keel checkpoints --verify` reports
// that checkpoint as failed and goes on; `train.resume=auto` rejects it in one line, resumes from
// the one before, and finishes.
TEST_F(BadInput, CheckpointFilesThatAreNotRegularFilesAreRefused) {
  ASSERT_EQ(train("run").exit_code, 0);
  const std::string newest = testing::newest_checkpoint(dir / "run/ckpt");
  ASSERT_TRUE(fs::exists(newest + "/r0.bin")) << newest;
  for (Special s : kSpecials) {
    for (const char* file : {"r0.bin", "manifest.json"}) {
      SCOPED_TRACE(std::string(file) + " as " + refusal(s));
      const std::string copy = dir / "copy";
      fs::remove_all(copy);
      fs::copy(dir / "run", copy, fs::copy_options::recursive);
      const std::string path = copy + "/ckpt/" + fs::path(newest).filename().string() + "/" + file;
      make_special(path, s);
      const CommandResult listed = keel_bounded("checkpoints --dir " + copy + "/ckpt --verify yes");
      EXPECT_EQ(listed.exit_code, 1) << listed.output;  // (a checkpoint failed)
      EXPECT_TRUE(contains(listed.output, path + ": " + refusal(s))) << listed.output;
      if (std::string(file) != "r0.bin") continue;
      const CommandResult resumed = keel_bounded("train --config " + dir / "toy.toml" + " --set train.run_dir=" + copy +
                                                 " --set train.checkpoint_every=2 --set train.steps=6 --set train.resume=auto");
      EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
      EXPECT_TRUE(contains(resumed.output, "checkpoint rejected: file " + path + ": " + refusal(s))) << resumed.output;
    }
  }
}

TEST_F(BadInput, MetricsThatAreNotARegularFileAreRefused) {
  ASSERT_EQ(train("run").exit_code, 0);
  for (Special s : kSpecials) {
    const std::string path = dir / "run/metrics.jsonl";
    make_special(path, s);
    expect_refused(keel_bounded("report --dir " + dir / "run" + " --out " + dir / "report.html"), path, s);
  }
}

// What a run writes into its directory (config.toml, metrics.jsonl) is never a special file put
// there: a FIFO would block the writer until someone read it, a device would take the bytes.
TEST_F(BadInput, RunDirectoryFilesThatAreNotRegularFilesAreRefused) {
  for (Special s : kSpecials) {
    for (const char* file : {"config.toml", "metrics.jsonl"}) {
      SCOPED_TRACE(std::string(file) + " as " + refusal(s));
      const std::string run = dir / "run";
      fs::remove_all(run);
      fs::create_directories(run);
      make_special(run + "/" + file, s);
      const CommandResult r = train("run");
      EXPECT_NE(r.exit_code, 137) << "killed after blocking: " << r.output;
      EXPECT_NE(r.exit_code, 0) << r.output;
      EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
      EXPECT_TRUE(contains(r.output, run + "/" + file + ": " + refusal(s))) << r.output;
      EXPECT_FALSE(fs::exists(run + "/ckpt")) << r.output;
    }
  }
}

// `keel data images` skips and counts a special file with an image's name (never opening it), or
// refuses it with --strict.
TEST_F(BadInput, ImagesThatAreNotRegularFilesAreSkippedAndCounted) {
  testing::write_png(dir / "src/one.png", 4, 4, testing::solid(4, 4, 10, 20, 30));
  testing::write_jpeg(dir / "src/two.jpg", 4, 4, 200, 10, 10);
  make_special(dir / "src/fifo.png", Special::fifo);
  make_special(dir / "src/zero.jpg", Special::device);
  make_special(dir / "src/socket.jpeg", Special::socket);
  const CommandResult r = keel_bounded("data images --from " + dir / "src" + " --out " + dir / "ds" + " --size 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "fifo.png: " + refusal(Special::fifo))) << r.output;
  EXPECT_TRUE(contains(r.output, "zero.jpg: " + refusal(Special::device))) << r.output;
  EXPECT_TRUE(contains(r.output, "socket.jpeg: " + refusal(Special::socket))) << r.output;
  const nlohmann::json meta = nlohmann::json::parse(read_text_file(dir / "ds/meta.json"));
  EXPECT_EQ(meta.at("skipped"), 3) << meta;
  EXPECT_EQ(meta.at("train").get<int>() + meta.at("val").get<int>(), 2) << meta;
  for (const std::string name : {"fifo.png", "zero.jpg", "socket.jpeg"}) {
    SCOPED_TRACE(name);
    fs::create_directories(dir / ("only-" + name));
    testing::write_png(dir / ("only-" + name) + "/one.png", 4, 4, testing::solid(4, 4, 10, 20, 30));
    fs::rename(dir / ("src/" + name), dir / ("only-" + name) + "/" + name);
    const CommandResult strict = keel_bounded("data images --from " + dir / ("only-" + name) + " --out " +
                                              dir / ("strict-" + name) + " --strict yes");
    const Special s = name == "fifo.png" ? Special::fifo : name == "zero.jpg" ? Special::device : Special::socket;
    expect_refused(strict, dir / ("only-" + name) + "/" + name, s);
  }
}

// A file name that is not UTF-8 (Latin-1 "café", as an old archive leaves it) gives an image whose
// caption and source say U+FFFD for the byte; the dataset's JSON stays JSON.
TEST_F(BadInput, ImageNamesThatAreNotUtf8BecomeCaptions) {
  const std::string latin1 = std::string("caf") + '\xe9' + "-au-lait";
  testing::write_png(dir / ("src/" + latin1 + ".png"), 4, 4, testing::solid(4, 4, 10, 20, 30));
  testing::write_png(dir / ("src/" + latin1 + "-" + '\xff' + "/green.png"), 4, 4, testing::solid(4, 4, 0, 200, 0));
  const CommandResult r =
      keel_bounded("data images --from " + dir / "src" + " --out " + dir / "ds" + " --size 4 --val-fraction 0");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json meta = nlohmann::json::parse(read_text_file(dir / "ds/meta.json"));
  EXPECT_EQ(meta.at("train"), 2) << meta;
  std::vector<nlohmann::json> lines;
  const std::string jsonl = read_text_file(dir / "ds/train.jsonl");
  for (size_t at = 0; at < jsonl.size();) {
    const size_t end = jsonl.find('\n', at);
    lines.push_back(nlohmann::json::parse(jsonl.substr(at, end - at)));
    at = end + 1;
  }
  ASSERT_EQ(lines.size(), 2u);
  const std::string fffd = "\xef\xbf\xbd";
  std::set<std::string> captions, sources;
  for (const nlohmann::json& l : lines) {
    captions.insert(l.at("caption").get<std::string>());
    sources.insert(l.at("source").get<std::string>());
  }
  EXPECT_EQ(captions, (std::set<std::string>{"caf" + fffd + " au lait", "green (caf" + fffd + " au lait " + fffd + ")"}));
  EXPECT_EQ(sources, (std::set<std::string>{"caf" + fffd + "-au-lait.png", "caf" + fffd + "-au-lait-" + fffd + "/green.png"}));
}

// A run directory whose name is not UTF-8 (Latin-1 "café") trains, resumes (the metrics line
// naming the checkpoint it resumed from holds U+FFFD for the byte) and reports.
TEST_F(BadInput, RunDirectoryNamedInLatin1TrainsResumesAndReports) {
  const std::string run = std::string("caf") + '\xe9';
  ASSERT_EQ(train(run).exit_code, 0);
  const CommandResult r = train(run, "--set train.steps=6 --set train.resume=auto");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string text = read_text_file(dir / (run + "/metrics.jsonl"));
  bool resumed = false;
  for (size_t at = 0; at < text.size();) {
    const size_t end = text.find('\n', at);
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(text.substr(at, end - at))) << text.substr(at, end - at);
    if (j.contains("resumed_from")) {
      resumed = true;
      EXPECT_EQ(j.at("resumed_from"), dir / "caf\xef\xbf\xbd/ckpt/step-00000004") << j;
    }
    at = end + 1;
  }
  EXPECT_TRUE(resumed) << text;
  const CommandResult report = keel_bounded("report --dir " + dir / run);
  EXPECT_EQ(report.exit_code, 0) << report.output;
}

// A metrics line with a string where a number belongs costs that value, not the report: the
// report is written, and says which line and field it skipped; so is a line that is not JSON
// (but the last, which a running job may be writing).
TEST_F(BadInput, ReportSkipsMistypedMetricsValuesAndSaysWhich) {
  ASSERT_EQ(train("run").exit_code, 0);
  const std::string metrics = dir / "run/metrics.jsonl";
  std::string text = read_text_file(metrics);
  const int lines = testing::count_lines(text);
  text += "{\"step\": \"five\", \"loss\": 2.5, \"ms\": 10}\n";
  text += "not json at all\n";
  text += "{\"step\": 6, \"loss\": \"low\", \"ms\": [1], \"model\": {\"n_layer\": \"two\"}}\n";
  text += "{\"step\": 7, \"lo";  // being written
  testing::write_text(metrics, text);
  const CommandResult r = keel_bounded("report --dir " + dir / "run" + " --out " + dir / "report.html");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string at = metrics + " line ";
  for (const std::string& said : {at + std::to_string(lines + 1) + ": field 'step': expected a number, found a string",
                                  at + std::to_string(lines + 2) + ": not JSON; line skipped",
                                  at + std::to_string(lines + 3) + ": field 'loss': expected a number, found a string",
                                  at + std::to_string(lines + 3) + ": field 'ms': expected a number, found an array",
                                  at + std::to_string(lines + 3) + ": field 'model.n_layer': expected a number"}) {
    EXPECT_TRUE(contains(r.output, said)) << said << "\n" << r.output;
  }
  EXPECT_FALSE(contains(r.output, at + std::to_string(lines + 4))) << r.output;
  EXPECT_TRUE(contains(r.output, "5 values or lines skipped")) << r.output;
  const std::string html = read_text_file(dir / "report.html");
  EXPECT_TRUE(contains(html, "<h2>Training</h2>"));
  EXPECT_TRUE(contains(html, "5 values or lines of metrics.jsonl"));
}

// A pipeline trace is read like any other file: a pid of 2^31 - 1 costs one row of the chart, not
// two billion (the report once drew a row per pid up to the largest); events whose pid, ts or dur
// is not a number are skipped and counted; a trace that is not JSON costs the chart only.
TEST_F(BadInput, ReportDrawsAHostilePipelineTraceInBoundedSpace) {
  ASSERT_EQ(train("run").exit_code, 0);
  const std::string trace = dir / "run/pipeline_trace.json";
  testing::write_text(trace, R"({"traceEvents": [
    {"ph": "X", "name": "F0", "pid": 2147483647, "ts": 0, "dur": 10},
    {"ph": "X", "name": "B0", "pid": 0, "ts": 10, "dur": 20},
    {"ph": "X", "name": "W0", "pid": -5, "ts": 30, "dur": 5},
    {"ph": "X", "name": "F1", "pid": "one", "ts": 0, "dur": 10},
    {"ph": "X", "name": "F2", "pid": 1, "ts": "late", "dur": 10},
    {"ph": "X", "name": 7, "pid": 1, "ts": 3, "dur": -1},
    "not an event", 42]})");
  CommandResult r = keel_bounded("report --dir " + dir / "run" + " --out " + dir / "report.html");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "pipeline_trace.json: 3 events without a numeric pid, ts or dur; skipped")) << r.output;
  std::string html = read_text_file(dir / "report.html");
  EXPECT_LT(html.size(), 1u << 20);
  EXPECT_TRUE(contains(html, "Pipeline step"));
  for (const char* row : {">rank -5<", ">rank 0<", ">rank 2147483647<"}) EXPECT_TRUE(contains(html, row)) << row;
  EXPECT_FALSE(contains(html, ">rank 1<"));

  testing::write_text(trace, "{\"traceEvents\": [");
  r = keel_bounded("report --dir " + dir / "run" + " --out " + dir / "report.html");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "pipeline_trace.json: not a JSON trace; no pipeline chart")) << r.output;
  html = read_text_file(dir / "report.html");
  EXPECT_TRUE(contains(html, "<h2>Training</h2>"));
  EXPECT_FALSE(contains(html, "Pipeline step"));
}

// `keel eval` prints JSON, also when the perplexity, e^loss, is past the largest double: a model
// whose final layer norm's gain is scaled up 10^4 times is confidently wrong, with a loss in the
// thousands, and its perplexity is printed as null.
TEST_F(BadInput, EvalPrintsJsonWhenThePerplexityOverflows) {
  std::vector<char> model = read_file(testing::source_path("tests/fixtures/tiny_gpt2.bin"));
  const ModelConfig m = read_llmc_model_config(testing::source_path("tests/fixtures/tiny_gpt2.bin"));
  // The file ends with the final layer norm's weight and bias (C floats each).
  float* gain = reinterpret_cast<float*>(model.data() + model.size()) - 2 * m.n_embd;
  for (int i = 0; i < m.n_embd; ++i) gain[i] *= 1e4f;
  write_file(dir / "loud.bin", model.data(), model.size());
  const std::string data = " --data " + testing::source_path("tests/fixtures/tiny_tokens.bin") + " --batch 1 --seq 8 --batches 2";
  for (const std::string& file : {testing::source_path("tests/fixtures/tiny_gpt2.bin"), dir / "loud.bin"}) {
    const CommandResult r = keel_bounded("eval --llmc " + file + data);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(r.output)) << r.output;
    const double loss = j.at("loss").get<double>();
    EXPECT_EQ(j.at("data"), testing::source_path("tests/fixtures/tiny_tokens.bin"));
    if (file == dir / "loud.bin") {
      EXPECT_GT(loss, 710) << r.output;  // e^710 > the largest double
      EXPECT_TRUE(j.at("perplexity").is_null()) << r.output;
    } else {
      EXPECT_LT(loss, 20) << r.output;
      EXPECT_NEAR(j.at("perplexity").get<double>(), std::exp(loss), 1e-9 * std::exp(loss)) << r.output;
    }
  }
}

// Prompts for `keel generate`: a FIFO named as the file is refused like every reader's, and "-"
// reads a pipe on standard input, giving the texts the same prompts in a file give.
TEST_F(BadInput, GeneratePromptsFromAFileOrStandardInputNeverFromASpecialFile) {
  // A 290-token tokenizer of a few sentences, and the toy run over its vocabulary.
  fs::create_directories(dir / "text");
  for (int i = 0; i < 10; ++i) {
    testing::write_text(dir / ("text/" + std::to_string(i) + ".txt"), "The cat sat on the mat number " + std::to_string(i) + " and a bird flew by.\n");
  }
  const CommandResult tokenized =
      keel_bounded("tokenize --input " + dir / "text" + " --out " + dir / "tok" + " --vocab-size 290");
  ASSERT_EQ(tokenized.exit_code, 0) << tokenized.output;
  const CommandResult trained =
      train("run", "--set model.vocab_size=290 --set data.tokenizer=" + dir / "tok/tokenizer.json");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  testing::write_text(dir / "prompts.txt", "The\nA cat\n");
  const std::string generate = "generate --checkpoint " + dir / "run/ckpt" + " --tokens 6 --seed 5 --prompts ";
  const CommandResult from_file = keel_bounded(generate + dir / "prompts.txt");
  ASSERT_EQ(from_file.exit_code, 0) << from_file.output;
  const CommandResult from_pipe = testing::run_command("cat " + dir / "prompts.txt" + " | timeout -s KILL 120 " +
                                                       std::string(KEEL_BINARY) + " " + generate + "- 2>/dev/null");
  ASSERT_EQ(from_pipe.exit_code, 0) << from_pipe.output;
  // The texts of each line (not its timing).
  const auto texts = [](const std::string& out) {
    std::vector<std::string> t;
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] != '{') continue;
      t.push_back(nlohmann::json::parse(line).at("text").get<std::string>());
    }
    return t;
  };
  EXPECT_EQ(texts(from_pipe.output).size(), 2u) << from_pipe.output;
  EXPECT_EQ(texts(from_pipe.output), texts(from_file.output)) << from_file.output;
  make_special(dir / "fifo.txt", Special::fifo);
  expect_refused(keel_bounded(generate + dir / "fifo.txt"), dir / "fifo.txt", Special::fifo);
}

// optim.lr = 1e-50 is 0 in float32, where the optimizer computes: refused, not a run that trains nothing.
TEST_F(BadInput, LearningRateFloat32RoundsToZeroIsRefused) {
  const CommandResult r = train("run", "--set optim.lr=1e-50");
  EXPECT_EQ(r.exit_code, 2) << r.output;  // (bad input)
  EXPECT_EQ(testing::count_lines(r.output), 1) << r.output;
  EXPECT_TRUE(contains(r.output, "config key 'optim.lr'")) << r.output;
  EXPECT_TRUE(contains(r.output, "found 1e-50")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "run/ckpt"));
}

}  // namespace
}  // namespace keel
