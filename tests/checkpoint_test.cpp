// Properties of the differential, reshardable checkpoint format (version 2): what a run leaves
// on disk, that differential and XOR-chained checkpoints decode to exactly the trainer's state,
// retention, detection of corruption with a fall-back to the previous good checkpoint, exact
// resume, resharding across ranks and ZeRO stages, and faults injected through KEEL_FAULT.
#include "ckpt/checkpoint.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "core/env.h"
#include "core/error.h"
#include "core/fileio.h"
#include "core/rng.h"
#include "data/shard.h"
#include "ckpt/run_directory.h"
#include "runtime/trainer.h"
#include "test_util.h"

namespace keel {
namespace {

using testing::error_of;

namespace fs = std::filesystem;
using nlohmann::json;

// ---- helpers ------------------------------------------------------------------------------------

json manifest_of(const std::string& dir) { return json::parse(read_text_file(dir + "/manifest.json")); }

using testing::write_toy_shards;

// A 2-layer, 32-wide model in chunks of 8 KiB (a few dozen chunks), for the in-process Trainer.
Config toy_config(const std::string& dir, int steps) {
  Config c =
      Config::load("", {"model.preset=tiny", "model.vocab_size=64", "model.n_embd=32", "model.n_head=2",
                        "train.batch_size=4", "train.seq_len=16", "train.grad_accum=2", "train.eval_batches=2",
                        "train.sample_tokens=0", "train.log_every=1000", "train.eval_every=0", "optim.warmup_steps=2",
                        "runtime.peak_gflops=100", "optim.lr=1e-2", "store.chunk_bytes=8192"});
  c.train.steps = steps;
  c.train.run_dir = dir + "/run";
  c.data.train = dir + "/train.bin";
  c.data.val = dir + "/val.bin";
  c.data.tokenizer = "";
  c.resolve();
  return c;
}

std::vector<char> store_bytes(const ChunkStore& store, Plane plane) {
  std::span<const float> v = store.range_view(plane, 0, store.numel());
  const char* p = reinterpret_cast<const char*>(v.data());
  return std::vector<char>(p, p + v.size_bytes());
}

std::vector<char> plane_bytes(const std::string& dir, Plane plane) {
  const std::vector<float> v = read_checkpoint_plane(dir, plane);
  const char* p = reinterpret_cast<const char*>(v.data());
  return std::vector<char>(p, p + v.size() * sizeof(float));
}

// Equal bytes; on failure, where the first differing float is (not a dump of every byte).
::testing::AssertionResult same_bytes(const std::vector<char>& a, const std::vector<char>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " bytes vs " << b.size();
  const auto diff = std::mismatch(a.begin(), a.end(), b.begin());
  if (diff.first == a.end()) return ::testing::AssertionSuccess();
  const size_t i = static_cast<size_t>(diff.first - a.begin()) / sizeof(float);
  float x = 0, y = 0;
  std::memcpy(&x, a.data() + i * sizeof(float), sizeof x);
  std::memcpy(&y, b.data() + i * sizeof(float), sizeof y);
  return ::testing::AssertionFailure() << "float " << i << " of " << a.size() / sizeof(float) << " differs: " << x
                                       << " vs " << y;
}

constexpr Plane kSaved[] = {Plane::param, Plane::adam_m, Plane::adam_v};
const char* plane_name(Plane p) { return p == Plane::param ? "param" : p == Plane::adam_m ? "adam_m" : "adam_v"; }

// Checkpoint directory names under root, oldest first (complete or not).
std::vector<std::string> step_dirs(const std::string& root) {
  std::vector<std::string> out;
  if (!fs::exists(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> names_of(const std::vector<std::string>& dirs) {
  std::vector<std::string> out;
  for (const std::string& d : dirs) out.push_back(fs::path(d).filename().string());
  return out;
}

// The checkpoints `name` needs, by the manifests on disk: itself, where its records live, the
// bases of its XOR records, transitively.
void referenced(const std::string& root, const std::string& name, std::set<std::string>& out) {
  if (!out.insert(name).second) return;
  const json m = manifest_of(root + "/" + name);
  for (const json& c : m.at("chunks")) {
    for (const auto& [plane, rec] : c.at("planes").items()) {
      referenced(root, rec.at("in").get<std::string>(), out);
      if (rec.contains("base")) referenced(root, rec.at("base").get<std::string>(), out);
    }
  }
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

// A record of manifest m stored in its own r0.bin (not copied from an older checkpoint), if any.
const json* own_record(const json& m) {
  for (const json& c : m.at("chunks")) {
    for (const auto& [plane, rec] : c.at("planes").items()) {
      if (rec.at("in") == m.at("name") && rec.at("file") == "r0.bin" && rec.at("bytes").get<uint64_t>() > 16) {
        return &rec;
      }
    }
  }
  return nullptr;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---- in-process: the Trainer and the library ----------------------------------------------------

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override { write_toy_shards(dir.path()); }
  std::string root() const { return dir / "run/ckpt"; }
  std::string at(int64_t step) const { return root() + "/" + checkpoint_name(step); }
  testing::TempDir dir{"keel-cptest"};
};

TEST_F(Checkpoint, RunLeavesCompleteCheckpointsOfTheCurrentFormatThatVerify) {
  Config c = toy_config(dir.path(), 8);
  c.train.checkpoint_every = 2;
  c.checkpoint.keep = 10;
  Trainer t(c);
  t.run();
  const ChunkStore& store = t.store();
  const int n = static_cast<int>(store.chunks().size());
  EXPECT_EQ(step_dirs(root()),
            (std::vector<std::string>{"step-00000002", "step-00000004", "step-00000006", "step-00000008"}));
  EXPECT_EQ(names_of(list_checkpoints(root())),
            (std::vector<std::string>{"step-00000008", "step-00000006", "step-00000004", "step-00000002"}));
  for (int64_t step : {2, 4, 6, 8}) {
    SCOPED_TRACE(at(step));
    // Only the run's mark, the data and the manifest: no temporary left behind.
    std::set<std::string> files;
    for (const auto& e : fs::directory_iterator(at(step))) files.insert(e.path().filename().string());
    EXPECT_EQ(files, (std::set<std::string>{run_marker(read_run_id(dir / "run")), "manifest.json", "r0.bin"}));
    const json m = manifest_of(at(step));
    EXPECT_EQ(m.at("format"), "keel-checkpoint");
    EXPECT_EQ(m.at("version"), kCheckpointFormatVersion);
    EXPECT_EQ(m.at("step"), step);
    EXPECT_EQ(m.at("name"), checkpoint_name(step));
    EXPECT_EQ(m.at("trajectory_hash"), hex64(c.trajectory_hash(1)));
    EXPECT_EQ(m.at("layout").at("world"), 1);
    EXPECT_EQ(m.at("layout").at("zero"), 0);
    EXPECT_EQ(m.at("layout").at("writers"), json::array({json::array({0, n})}));
    ASSERT_EQ(m.at("ranks").size(), 1u);
    EXPECT_EQ(m.at("ranks")[0].at("rank"), 0);
    // The loader's position: grad_accum windows per step, within the first epoch.
    EXPECT_EQ(m.at("ranks")[0].at("data").at("epoch"), 0);
    EXPECT_EQ(m.at("ranks")[0].at("data").at("index"), step * c.train.grad_accum);
    EXPECT_EQ(m.at("numel"), store.numel());
    ASSERT_EQ(m.at("chunks").size(), static_cast<size_t>(n));
    std::map<std::string, int64_t> covered;  // tensor name -> elements described
    for (int i = 0; i < n; ++i) {
      const json& chunk = m.at("chunks")[i];
      const Chunk& sc = store.chunks()[i];
      EXPECT_EQ(chunk.at("offset"), sc.offset);
      EXPECT_EQ(chunk.at("numel"), sc.numel);
      EXPECT_EQ(chunk.at("layer"), sc.layer);
      EXPECT_EQ(chunk.at("version"), step) << "chunk " << i << ": every chunk is updated every step";
      ASSERT_FALSE(chunk.at("tensors").empty());
      for (const json& tensor : chunk.at("tensors")) covered[tensor[0].get<std::string>()] += tensor[2].get<int64_t>();
      for (const char* plane : {"param", "adam_m", "adam_v"}) {
        const json& rec = chunk.at("planes").at(plane);
        for (const char* key : {"in", "file", "at", "bytes", "enc", "sum", "stored_sum"}) {
          EXPECT_TRUE(rec.contains(key)) << "chunk " << i << " " << plane << ": no " << key << " in " << rec.dump();
        }
        EXPECT_EQ(rec.at("sum").get<std::string>().size(), 16u);
        EXPECT_EQ(rec.at("stored_sum").get<std::string>().size(), 16u);
      }
    }
    for (const TensorInfo& info : store.tensors()) EXPECT_EQ(covered[info.spec.name], info.numel) << info.spec.name;
    EXPECT_EQ(verify_checkpoint(at(step)), 3 * n);
  }
  EXPECT_EQ(verify_checkpoint(root()), 4 * 3 * n);  // a root: every checkpoint under it
  // The newest decodes to the trainer's final state.
  for (Plane p : kSaved) EXPECT_TRUE(same_bytes(plane_bytes(at(8), p), store_bytes(store, p))) << plane_name(p);
}

TEST_F(Checkpoint, DirectoryWithoutManifestIsNotACheckpointAndTheRunsOwnIsRemovedAtStartUp) {
  std::vector<char> params;
  {
    Trainer t(toy_config(dir.path(), 4));
    t.step();
    t.save(root());
    params = store_bytes(t.store(), Plane::param);
  }
  // What a crash during one of the run's writes leaves: its mark, data, perhaps a temporary
  // manifest, no manifest.
  const std::string run_id = read_run_id(dir / "run");
  ASSERT_EQ(run_id.size(), 16u);
  EXPECT_TRUE(fs::is_directory(at(1) + "/" + run_marker(run_id)));
  auto leave_incomplete = [&] {
    fs::create_directories(at(9) + "/" + run_marker(run_id));
    fs::copy_file(at(1) + "/r0.bin", at(9) + "/r0.bin");
    fs::copy_file(at(1) + "/manifest.json", at(9) + "/manifest.json.tmp");
  };
  leave_incomplete();
  fs::create_directories(root() + "/notes");  // not a checkpoint name: not ours to remove
  EXPECT_EQ(names_of(list_checkpoints(root())), std::vector<std::string>{"step-00000001"});
  EXPECT_EQ(testing::newest_checkpoint(root()), at(1));
  EXPECT_THROW(verify_checkpoint(at(9)), Error);
  EXPECT_TRUE(remove_interrupted_checkpoints(root(), "0123456789abcdef").removed.empty());  // another run's
  EXPECT_TRUE(fs::exists(at(9)));
  EXPECT_EQ(remove_interrupted_checkpoints(root(), run_id).removed, std::vector<std::string>{"step-00000009"});
  EXPECT_FALSE(fs::exists(at(9)));
  EXPECT_TRUE(fs::exists(at(1) + "/manifest.json"));
  EXPECT_TRUE(fs::exists(root() + "/notes"));

  // The trainer cleans up at start-up and resumes from the complete one.
  leave_incomplete();
  Config c = toy_config(dir.path(), 4);
  c.train.resume = "auto";
  Trainer t(c);
  EXPECT_FALSE(fs::exists(at(9)));
  EXPECT_EQ(t.resumed_from(), at(1));
  EXPECT_EQ(t.steps_done(), 1);
  EXPECT_TRUE(same_bytes(store_bytes(t.store(), Plane::param), params));
}

// Saves after every step of one Trainer and checks each checkpoint against the store right away
// and again at the end (a later checkpoint must not disturb an earlier one).
TEST_F(Checkpoint, DiffCheckpointsFollowFullEveryAndDecodeToTheTrainersStateExactly) {
  Config c = toy_config(dir.path(), 10);
  c.checkpoint.keep = 100;
  ASSERT_EQ(c.checkpoint.full_every, 4);
  Trainer t(c);
  std::map<int64_t, std::array<std::vector<char>, 3>> state;
  int xor_records = 0;
  for (int64_t step = 1; step <= 9; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    t.step();
    t.save(root());
    const json m = manifest_of(at(step));
    const bool full = (step - 1) % 4 == 0;
    EXPECT_EQ(m.at("kind"), full ? "full" : "diff");
    if (!full) {
      EXPECT_EQ(m.at("base"), checkpoint_name(step - 1));
    }
    for (const json& chunk : m.at("chunks")) {
      for (const auto& [plane, rec] : chunk.at("planes").items()) {
        // Every chunk changed: every record is this checkpoint's own.
        EXPECT_EQ(rec.at("in"), checkpoint_name(step)) << plane;
        if (rec.at("enc") == "xor-zstd") {
          EXPECT_FALSE(full) << "a full checkpoint must not depend on another";
          EXPECT_EQ(rec.at("base"), checkpoint_name(step - 1));
          xor_records++;
        }
      }
    }
    for (int i = 0; i < 3; ++i) {
      state[step][i] = store_bytes(t.store(), kSaved[i]);
      EXPECT_TRUE(same_bytes(plane_bytes(at(step), kSaved[i]), state[step][i])) << plane_name(kSaved[i]);
    }
  }
  EXPECT_GT(xor_records, 0) << "no record was stored as an XOR delta";
  for (const auto& [step, planes] : state) {
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(same_bytes(plane_bytes(at(step), kSaved[i]), planes[i]))
          << "step " << step << " " << plane_name(kSaved[i]);
    }
  }
  EXPECT_EQ(verify_checkpoint(root()), 9 * 3 * static_cast<int64_t>(t.store().chunks().size()));
}

TEST_F(Checkpoint, WithoutDeltaAndCompressionRecordsAreTheRawFloats) {
  Config c = toy_config(dir.path(), 4);
  c.checkpoint.delta = false;
  c.checkpoint.compress = false;
  Trainer t(c);
  for (int64_t step = 1; step <= 3; ++step) {
    t.step();
    t.save(root());
    SCOPED_TRACE(at(step));
    const json m = manifest_of(at(step));
    EXPECT_EQ(m.at("kind"), step == 1 ? "full" : "diff");
    const std::vector<char> file = read_file(at(step) + "/r0.bin");
    uint64_t own_bytes = 0;
    for (const json& chunk : m.at("chunks")) {
      const int id = chunk.at("id").get<int>();
      for (Plane p : kSaved) {
        const json& rec = chunk.at("planes").at(plane_name(p));
        EXPECT_EQ(rec.at("enc"), "raw");
        EXPECT_FALSE(rec.contains("base"));
        EXPECT_EQ(rec.at("sum"), rec.at("stored_sum"));
        ASSERT_EQ(rec.at("in"), checkpoint_name(step));
        const uint64_t offset = rec.at("at").get<uint64_t>(), bytes = rec.at("bytes").get<uint64_t>();
        std::span<const float> want = t.store().chunk_view(id, p);
        ASSERT_EQ(bytes, want.size_bytes());
        ASSERT_LE(offset + bytes, file.size());
        // The file holds the floats themselves, where the record says.
        EXPECT_EQ(0, std::memcmp(file.data() + offset, want.data(), bytes)) << "chunk " << id << " " << plane_name(p);
        EXPECT_EQ(rec.at("stored_sum"), hex64(XXH3_64bits(want.data(), bytes)));
        own_bytes += bytes;
      }
    }
    EXPECT_EQ(own_bytes, file.size());
    for (Plane p : kSaved) EXPECT_TRUE(same_bytes(plane_bytes(at(step), p), store_bytes(t.store(), p)));
  }
}

TEST_F(Checkpoint, WithFrozenLayersADiffCheckpointWritesOnlyWhatChangedAndDecodesExactly) {
  Config c = toy_config(dir.path(), 4);
  c.optim.freeze_layers = c.model.n_layer + 1;  // everything but the final norm is frozen
  Trainer t(c);
  int frozen = 0;
  for (const Chunk& chunk : t.store().chunks()) frozen += chunk.layer < c.optim.freeze_layers;
  ASSERT_GT(frozen, 0);
  for (int64_t step = 1; step <= 3; ++step) {
    t.step();
    t.save(root());
    for (Plane p : kSaved)
      EXPECT_TRUE(same_bytes(plane_bytes(at(step), p), store_bytes(t.store(), p))) << step << plane_name(p);
  }
  const json full = manifest_of(at(1));
  EXPECT_EQ(full.at("kind"), "full");
  for (int64_t step : {2, 3}) {
    SCOPED_TRACE(at(step));
    const json m = manifest_of(at(step));
    EXPECT_EQ(m.at("kind"), "diff");
    int elsewhere = 0, own = 0;
    for (const json& chunk : m.at("chunks")) {
      const bool is_frozen = chunk.at("layer").get<int>() < c.optim.freeze_layers;
      EXPECT_EQ(chunk.at("version"), is_frozen ? 0 : step);
      for (const auto& [plane, rec] : chunk.at("planes").items()) {
        if (is_frozen) {
          // Unchanged since the full checkpoint: the very record written then.
          EXPECT_EQ(rec, full.at("chunks")[chunk.at("id").get<int>()].at("planes").at(plane));
          EXPECT_EQ(rec.at("in"), "step-00000001");
          elsewhere++;
        } else {
          EXPECT_EQ(rec.at("in"), checkpoint_name(step));
          own++;
        }
      }
    }
    EXPECT_EQ(elsewhere, 3 * frozen);
    EXPECT_GT(own, 0);
    const double written = m.at("sizes").at("written_bytes").get<double>();
    EXPECT_LT(written, 0.1 * full.at("sizes").at("written_bytes").get<double>());
    EXPECT_EQ(static_cast<double>(fs::file_size(at(step) + "/r0.bin")), written);
  }
  EXPECT_GT(verify_checkpoint(root()), 0);
}

TEST_F(Checkpoint, RetentionKeepsTheNewestAndWhatTheyReferenceOnly) {
  Config c = toy_config(dir.path(), 10);
  c.checkpoint.keep = 2;
  c.checkpoint.full_every = 3;  // full at steps 1, 4, 7
  c.optim.freeze_layers = 1;    // the embeddings' records point back to the last full checkpoint
  Trainer t(c);
  std::map<int64_t, std::set<std::string>> expected_at_least = {
      {5, {"step-00000004", "step-00000005"}},
      {6, {"step-00000004", "step-00000005", "step-00000006"}},
      {8, {"step-00000007", "step-00000008"}}};
  for (int64_t step = 1; step <= 8; ++step) {
    SCOPED_TRACE("after the checkpoint of step " + std::to_string(step));
    t.step();
    t.save(root());
    std::set<std::string> want;
    const std::vector<std::string> complete = names_of(list_checkpoints(root()));
    for (size_t i = 0; i < complete.size() && i < 2; ++i) referenced(root(), complete[i], want);
    const std::vector<std::string> present = step_dirs(root());
    EXPECT_EQ(std::set<std::string>(present.begin(), present.end()), want);
    if (expected_at_least.count(step)) {
      EXPECT_EQ(want, expected_at_least[step]);
    }
    for (const std::string& name : present) EXPECT_NO_THROW(verify_checkpoint(root() + "/" + name)) << name;
  }
  EXPECT_FALSE(fs::exists(at(6)));
  EXPECT_FALSE(fs::exists(at(1)));
  for (Plane p : kSaved) EXPECT_TRUE(same_bytes(plane_bytes(at(8), p), store_bytes(t.store(), p))) << plane_name(p);
}

// ---- corruption -----------------------------------------------------------------------------------

class CheckpointCorruption : public Checkpoint {
 protected:
  // Checkpoints at steps 2 (full), 3 and 4 (differential) under root(); keeps step 3's state.
  void SetUp() override {
    Checkpoint::SetUp();
    Trainer t(toy_config(dir.path(), 6));
    t.step();
    t.step();
    t.save(root());
    t.step();
    t.save(root());
    for (Plane p : kSaved) step3_.push_back(store_bytes(t.store(), p));
    t.step();
    t.save(root());
    ASSERT_EQ(manifest_of(at(4)).at("kind"), "diff");
    ASSERT_EQ(verify_checkpoint(root()), 3 * 3 * static_cast<int64_t>(t.store().chunks().size()));
  }

  // The newest checkpoint (step 4) is damaged: verification fails with one line holding every
  // needle (unless `by_verify` is false: a checkpoint of another run is sound in itself);
  // resuming from the root and with "auto" reports it on one line and continues from step 3; an
  // explicit resume of step 4 itself fails with the same reason.
  // `auto_needles` (when not empty): what "auto" reports instead (another run's checkpoint found
  // among this run's own is rejected by its run id before anything else is read).
  void expect_detected_with_fallback(const std::vector<std::string>& needles, bool by_verify = true,
                                     const std::vector<std::string>& auto_needles = {}) {
    if (by_verify) {
      const std::string why = error_of([&] { verify_checkpoint(at(4)); });
      ASSERT_FALSE(why.empty()) << "verify_checkpoint accepted the damaged checkpoint";
      EXPECT_EQ(testing::count_lines(why), 1) << why;
      for (const std::string& needle : needles) EXPECT_TRUE(contains(why, needle)) << needle << " in: " << why;
    }
    for (const std::string& resume : {root(), std::string("auto")}) {
      SCOPED_TRACE("train.resume = " + resume);
      Config c = toy_config(dir.path(), 6);
      c.train.resume = resume;
      ::testing::internal::CaptureStderr();
      std::unique_ptr<Trainer> t;
      std::string error;
      try {
        t = std::make_unique<Trainer>(c);
      } catch (const Error& e) {
        error = e.what();
      }
      const std::string log = ::testing::internal::GetCapturedStderr();
      ASSERT_TRUE(t) << error << "\n" << log;
      EXPECT_EQ(t->resumed_from(), at(3));
      EXPECT_EQ(t->steps_done(), 3);
      EXPECT_EQ(testing::count_lines(log), 1) << log;
      EXPECT_TRUE(contains(log, "checkpoint rejected")) << log;
      for (const std::string& needle : resume == "auto" && !auto_needles.empty() ? auto_needles : needles) {
        EXPECT_TRUE(contains(log, needle)) << needle << " in: " << log;
      }
      // Whatever the rejected load wrote into the store is gone: step 3's state exactly.
      for (int i = 0; i < 3; ++i)
        EXPECT_TRUE(same_bytes(store_bytes(t->store(), kSaved[i]), step3_[i])) << plane_name(kSaved[i]);
      for (const Chunk& chunk : t->store().chunks()) EXPECT_EQ(chunk.version, 3u) << "chunk " << chunk.id;
    }
    Config c = toy_config(dir.path(), 6);
    c.train.resume = at(4);
    const std::string explicit_why = error_of([&] { Trainer t(c); });
    ASSERT_FALSE(explicit_why.empty()) << "an explicit resume of the damaged checkpoint succeeded";
    EXPECT_EQ(testing::count_lines(explicit_why), 1) << explicit_why;
    for (const std::string& needle : needles) {
      EXPECT_TRUE(contains(explicit_why, needle)) << needle << " in: " << explicit_why;
    }
  }

  std::vector<std::vector<char>> step3_;
};

TEST_F(CheckpointCorruption, FlippedByteIsDetectedAndResumeFallsBackToThePreviousCheckpoint) {
  const json m = manifest_of(at(4));
  const json* rec = own_record(m);
  ASSERT_NE(rec, nullptr);
  flip_byte(at(4) + "/r0.bin", (*rec)["at"].get<uint64_t>() + (*rec)["bytes"].get<uint64_t>() / 2);
  expect_detected_with_fallback({at(4) + "/r0.bin", "corrupt"});
}

TEST_F(CheckpointCorruption, TruncatedFileIsDetectedAndResumeFallsBackToThePreviousCheckpoint) {
  const std::string file = at(4) + "/r0.bin";
  fs::resize_file(file, fs::file_size(file) / 2);
  expect_detected_with_fallback({file});
}

TEST_F(CheckpointCorruption, MissingFileIsDetectedAndResumeFallsBackToThePreviousCheckpoint) {
  const std::string file = at(4) + "/r0.bin";
  fs::remove(file);
  expect_detected_with_fallback({file});
}

TEST_F(CheckpointCorruption, TruncatedManifestIsDetectedAndResumeFallsBackToThePreviousCheckpoint) {
  const std::string file = at(4) + "/manifest.json";
  fs::resize_file(file, fs::file_size(file) / 2);
  expect_detected_with_fallback({file});
}

// Nothing usable: "auto" starts afresh, in exactly the state of a run that never saw a
// checkpoint (whatever the failed loads wrote is gone); an explicit root is an error.
TEST_F(CheckpointCorruption, WhenNoCheckpointIsUsableAutoStartsAfreshExactlyLikeAFreshRun) {
  for (int64_t step : {2, 3, 4}) {
    // The last record of the file: every earlier record loads before the damage is found.
    const json m = manifest_of(at(step));
    uint64_t end = 0;
    for (const json& c : m.at("chunks")) {
      for (const auto& [plane, r] : c.at("planes").items()) {
        if (r.at("in") == m.at("name")) end = std::max(end, r.at("at").get<uint64_t>() + r.at("bytes").get<uint64_t>());
      }
    }
    ASSERT_GT(end, 0u);
    flip_byte(at(step) + "/r0.bin", end - 1);
  }
  std::array<std::vector<char>, 3> fresh;
  {
    Config c = toy_config(dir.path(), 6);
    c.train.run_dir = dir / "fresh";
    Trainer t(c);
    t.step();
    t.step();
    for (int i = 0; i < 3; ++i) fresh[i] = store_bytes(t.store(), kSaved[i]);
  }
  Config c = toy_config(dir.path(), 6);
  c.train.resume = root();
  const std::string why = error_of([&] { Trainer t(c); });
  EXPECT_TRUE(contains(why, "no usable checkpoint")) << why;
  c.train.resume = "auto";
  ::testing::internal::CaptureStderr();
  Trainer t(c);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(log, "starting from step 0")) << log;
  EXPECT_EQ(t.resumed_from(), "");
  EXPECT_EQ(t.steps_done(), 0);
  for (const Chunk& chunk : t.store().chunks()) EXPECT_EQ(chunk.version, 0u) << "chunk " << chunk.id;
  t.step();
  t.step();
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(same_bytes(store_bytes(t.store(), kSaved[i]), fresh[i])) << plane_name(kSaved[i]);
}

TEST_F(CheckpointCorruption, CheckpointOfAnotherRunIsRejectedByItsTrajectoryHash) {
  // The same model shape, another learning rate: its own consistent full checkpoint at step 4.
  Config other = toy_config(dir.path(), 6);
  other.optim.lr = 2e-2;
  other.checkpoint.full_every = 1;
  other.train.run_dir = dir / "other";
  ASSERT_NE(other.trajectory_hash(1), toy_config(dir.path(), 6).trajectory_hash(1));
  {
    Trainer t(other);
    for (int i = 0; i < 4; ++i) t.step();
    t.save(dir / "other/ckpt");
  }
  const std::string theirs = dir / "other/ckpt/step-00000004";
  ASSERT_EQ(manifest_of(theirs).at("kind"), "full");
  // The whole directory swapped in: every record verifies, only the hash tells.
  fs::remove_all(at(4));
  fs::copy(theirs, at(4));
  EXPECT_NO_THROW(verify_checkpoint(at(4)));
  expect_detected_with_fallback({at(4), "trajectory hash"}, false, {at(4), "written by run"});
}

TEST_F(CheckpointCorruption, ManifestOfAnotherRunIsRejected) {
  Config other = toy_config(dir.path(), 6);
  other.train.seed = 99;
  other.train.run_dir = dir / "other";
  {
    Trainer t(other);
    for (int i = 0; i < 4; ++i) t.step();
    t.save(dir / "other/ckpt");
  }
  fs::copy_file(dir / "other/ckpt/step-00000004/manifest.json", at(4) + "/manifest.json",
                fs::copy_options::overwrite_existing);
  expect_detected_with_fallback({at(4)});
}

// A differential checkpoint's XOR records decode against the base checkpoint's bytes: damage
// there must fail the dependent checkpoint, never decode it silently wrong.
TEST_F(CheckpointCorruption, DamagedBaseOfAnXorChainFailsTheDependentCheckpoint) {
  const json m3 = manifest_of(at(3));
  const json* xor_rec = nullptr;
  int chunk = -1;
  std::string plane;
  for (const json& c : m3.at("chunks")) {
    for (const auto& [p, rec] : c.at("planes").items()) {
      if (xor_rec == nullptr && rec.at("enc") == "xor-zstd") {
        xor_rec = &rec;
        chunk = c.at("id").get<int>();
        plane = p;
      }
    }
  }
  ASSERT_NE(xor_rec, nullptr) << "step 3 has no XOR record";
  ASSERT_EQ(xor_rec->at("base"), "step-00000002");
  const json base = manifest_of(at(2)).at("chunks")[chunk].at("planes").at(plane);
  ASSERT_EQ(base.at("in"), "step-00000002");
  flip_byte(at(2) + "/" + base.at("file").get<std::string>(),
            base.at("at").get<uint64_t>() + base.at("bytes").get<uint64_t>() / 2);
  const std::string why = error_of([&] { verify_checkpoint(at(3)); });
  EXPECT_TRUE(contains(why, at(2) + "/r0.bin")) << why;
  const Plane p = plane == "param" ? Plane::param : plane == "adam_m" ? Plane::adam_m : Plane::adam_v;
  EXPECT_THROW(read_checkpoint_plane(at(3), p), Error);
}

// The same, with the base record rewritten consistently (its checksums match the damaged bytes):
// only the dependent record's checksum of the decoded data can tell.
TEST_F(Checkpoint, ConsistentlyRewrittenBaseFailsTheDependentXorRecord) {
  Config c = toy_config(dir.path(), 4);
  c.checkpoint.compress = false;  // the full checkpoint's records are raw floats, easy to rewrite
  {
    Trainer t(c);
    t.step();
    t.save(root());
    t.step();
    t.save(root());
  }
  json m2 = manifest_of(at(2));
  int chunk = -1;
  std::string plane;
  for (const json& ch : m2.at("chunks")) {
    for (const auto& [p, rec] : ch.at("planes").items()) {
      if (chunk < 0 && rec.at("enc") == "xor-zstd") chunk = ch.at("id").get<int>(), plane = p;
    }
  }
  ASSERT_GE(chunk, 0) << "no XOR record in the differential checkpoint";
  json m1 = manifest_of(at(1));
  json& base = m1.at("chunks")[chunk].at("planes").at(plane);
  ASSERT_EQ(base.at("enc"), "raw");
  const uint64_t offset = base.at("at").get<uint64_t>(), bytes = base.at("bytes").get<uint64_t>();
  flip_byte(at(1) + "/r0.bin", offset + bytes / 2);
  const std::vector<char> data = Env::posix().read_range(at(1) + "/r0.bin", offset, bytes);
  base["sum"] = base["stored_sum"] = hex64(XXH3_64bits(data.data(), data.size()));
  testing::write_text(at(1) + "/manifest.json", seal_manifest(m1.dump(1)));
  EXPECT_NO_THROW(verify_checkpoint(at(1)));  // consistent in itself
  const std::string why = error_of([&] { verify_checkpoint(at(2)); });
  EXPECT_TRUE(contains(why, "wrong bytes")) << why;
  EXPECT_TRUE(contains(why, at(2))) << why;
}

// The manifest is parsed into its struct once and written from it: reading a published manifest
// and writing it back gives the same JSON, and a field with a wrong value is named in the error.
TEST_F(Checkpoint, ManifestRoundTripsThroughItsStructAndBadFieldsAreNamed) {
  Config c = toy_config(dir.path(), 4);
  {
    Trainer t(c);
    t.step();
    t.save(root());
    t.step();
    t.save(root());
  }
  const json on_disk = manifest_of(at(2));
  const Manifest m = read_manifest(at(2));
  EXPECT_EQ(m.name, "step-00000002");
  EXPECT_EQ(m.kind, "diff");
  EXPECT_EQ(m.base, "step-00000001");
  ASSERT_EQ(m.chunks.size(), on_disk.at("chunks").size());
  fs::create_directories(dir / "copy");
  write_manifest(dir / "copy", m);
  EXPECT_EQ(manifest_of(dir / "copy"), on_disk);

  // Any edit that does not reseal the manifest fails its own checksum.
  json bad = on_disk;
  bad.at("chunks")[0].at("planes").at("param")["at"] = 8;
  testing::write_text(at(2) + "/manifest.json", bad.dump(1));
  EXPECT_TRUE(contains(error_of([&] { read_manifest(at(2)); }), "own checksum does not match"));
  // Resealed (a tool rewriting it on purpose), each field is still checked.
  bad = on_disk;
  bad.at("chunks")[0].at("planes").at("param")["enc"] = "lz4";
  testing::write_text(at(2) + "/manifest.json", seal_manifest(bad.dump(1)));
  const std::string why = error_of([&] { read_manifest(at(2)); });
  EXPECT_TRUE(contains(why, at(2) + "/manifest.json")) << why;
  EXPECT_TRUE(contains(why, "unknown encoding 'lz4'")) << why;
  bad = on_disk;
  bad.at("chunks")[0].at("planes").at("adam_m")["sum"] = "not-hex";
  testing::write_text(at(2) + "/manifest.json", seal_manifest(bad.dump(1)));
  EXPECT_TRUE(contains(error_of([&] { read_manifest(at(2)); }), "not-hex"));
}

// A rank's part crosses to rank 0 as bytes: every field survives the trip, and bytes that are not
// a whole part are refused rather than read past their end.
TEST(CheckpointPartEncoding, EveryFieldSurvivesAndTruncatedBytesAreRefused) {
  CheckpointPart p;
  p.rank = 3;
  p.name = "step-00000012.1";
  p.step = 12;
  p.full = false;
  p.base = "step-00000010";
  p.first = 5;
  p.last = 9;
  p.data = LoaderPosition{2, 77, 96};
  p.ok = true;
  ChunkRecords r;
  r.version = 41;
  for (int i = 0; i < kNumSavedPlanes; ++i) {
    r.planes[i] = Record{"step-00000012.1", "r3.bin", 4096u * i, 1000u + i, Encoding::xor_zstd, 0xabcdefu + i,
                         0x123456789abcdefull, "step-00000010"};
  }
  p.chunks = {{5, r}, {6, r}};
  p.residual = ResidualRecord{r.planes[0], 250, "buckets:4", "L3#0:200+50:topk/0.01/256:D2"};
  p.written_bytes = 123456;
  p.records = 12;
  p.unchanged = 6;
  p.xor_records = 3;
  p.write_ms = 17.25;
  const std::string bytes = encode_part(p);
  const CheckpointPart q = decode_part(bytes);
  EXPECT_EQ(q.rank, 3);
  EXPECT_EQ(q.name, p.name);
  EXPECT_EQ(q.step, 12);
  EXPECT_FALSE(q.full);
  EXPECT_EQ(q.base, p.base);
  EXPECT_EQ(q.first, 5);
  EXPECT_EQ(q.last, 9);
  EXPECT_EQ(q.data.epoch, 2u);
  EXPECT_EQ(q.data.index, 77u);
  EXPECT_EQ(q.data.offset, 96u);
  EXPECT_TRUE(q.ok);
  ASSERT_EQ(q.chunks.size(), 2u);
  EXPECT_EQ(q.chunks[1].first, 6);
  EXPECT_EQ(q.chunks[1].second.version, 41u);
  for (int i = 0; i < kNumSavedPlanes; ++i) {
    const Record& a = q.chunks[1].second.planes[i];
    EXPECT_EQ(a.at, 4096u * i);
    EXPECT_EQ(a.bytes, 1000u + i);
    EXPECT_EQ(a.enc, Encoding::xor_zstd);
    EXPECT_EQ(a.sum, 0xabcdefu + i);
    EXPECT_EQ(a.stored_sum, 0x123456789abcdefull);
    EXPECT_EQ(a.base, "step-00000010");
    EXPECT_EQ(a.file, "r3.bin");
  }
  ASSERT_TRUE(q.residual.has_value());
  EXPECT_EQ(q.residual->numel, 250u);
  EXPECT_EQ(q.residual->keys, p.residual->keys);
  EXPECT_EQ(q.residual->layout, "buckets:4");
  EXPECT_EQ(q.written_bytes, 123456u);
  EXPECT_EQ(q.records, 12);
  EXPECT_EQ(q.unchanged, 6);
  EXPECT_EQ(q.xor_records, 3);
  EXPECT_EQ(q.write_ms, 17.25);
  for (size_t cut : {size_t{0}, size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_THROW(decode_part(bytes.substr(0, cut)), Error) << cut;
  }
  EXPECT_THROW(decode_part(bytes + "x"), Error);
}

// Saving the same state twice (a tool or a caller saving after run() did) never rewrites the
// published directory (its records may be what newer checkpoints point into): the second save is
// a later attempt, and both decode to the trainer's state.
TEST_F(Checkpoint, SavingTheSameStepTwiceLeavesBothCheckpointsSound) {
  Trainer t(toy_config(dir.path(), 4));
  t.step();
  t.save(root());
  ASSERT_NO_THROW(verify_checkpoint(at(1)));
  const std::string first_manifest = read_text_file(at(1) + "/manifest.json");
  t.save(root());
  const std::string again = root() + "/" + checkpoint_name(1, 1);
  EXPECT_EQ(names_of(list_checkpoints(root())), (std::vector<std::string>{checkpoint_name(1, 1), checkpoint_name(1)}));
  EXPECT_EQ(read_text_file(at(1) + "/manifest.json"), first_manifest);
  for (const std::string& d : {at(1), again}) {
    SCOPED_TRACE(d);
    const std::string why = error_of([&] {
      verify_checkpoint(d);
      for (Plane p : kSaved) EXPECT_TRUE(same_bytes(plane_bytes(d, p), store_bytes(t.store(), p))) << plane_name(p);
    });
    EXPECT_TRUE(why.empty()) << why;
  }
}

// The previous release's format 1: the checkpoint is run_dir/ckpt itself, one file per plane.
void write_version1_checkpoint(const std::string& dir, const ChunkStore& store, const Config& config, int64_t step,
                               LoaderPosition data) {
  fs::create_directories(dir);
  json chunks = json::array();
  for (const Chunk& c : store.chunks()) {
    json tensors = json::array();
    for (const Segment& seg : c.segments) {
      tensors.push_back({store.tensors()[seg.tensor].spec.name, seg.tensor_offset, seg.numel, seg.offset - c.offset});
    }
    json sums = json::object();
    for (Plane p : kSaved) {
      std::span<const float> v = store.chunk_view(c.id, p);
      sums[std::string(plane_name(p)) + ".bin"] = hex64(XXH3_64bits(v.data(), v.size_bytes()));
    }
    chunks.push_back({{"id", c.id},
                      {"layer", c.layer},
                      {"kind", kind_name(c.kind)},
                      {"version", c.version},
                      {"offset", c.offset},
                      {"numel", c.numel},
                      {"checksum", sums},
                      {"tensors", tensors}});
  }
  for (Plane p : kSaved) {
    std::span<const float> all = store.range_view(p, 0, store.numel());
    write_file(dir + "/" + plane_name(p) + ".bin", all.data(), all.size_bytes());
  }
  const ModelConfig& m = config.model;
  const json manifest = {{"format", "keel-checkpoint"},
                         {"version", 1},
                         {"step", step},
                         {"shape_hash", hex64(config.shape_hash())},
                         {"model",
                          {{"n_layer", m.n_layer},
                           {"n_head", m.n_head},
                           {"n_embd", m.n_embd},
                           {"vocab_size", m.vocab_size},
                           {"padded_vocab_size", m.padded_vocab_size},
                           {"max_seq_len", m.max_seq_len}}},
                         {"chunk_bytes", config.store.chunk_bytes},
                         {"numel", store.numel()},
                         {"data", {{"epoch", data.epoch}, {"index", data.index}}},
                         {"config", config.to_toml()},
                         {"chunks", chunks}};
  testing::write_text(dir + "/manifest.json", manifest.dump(1));
}

// A run directory of the previous release holds a format-1 checkpoint in run_dir/ckpt itself. It
// loads; once the upgraded trainer has written newer checkpoints next to it, resume = "auto"
// continues from the newest of those, not from the old one.
TEST_F(Checkpoint, Version1CheckpointLoadsAndNewerCheckpointsTakePrecedence) {
  Config c = toy_config(dir.path(), 8);
  std::array<std::vector<char>, 3> step3;
  int64_t chunks = 0;
  {
    Trainer t(c);
    chunks = static_cast<int64_t>(t.store().chunks().size());
    for (int i = 0; i < 3; ++i) t.step();
    write_version1_checkpoint(root(), t.store(), c, 3, LoaderPosition{0, 3u * c.train.grad_accum});
    for (int i = 0; i < 3; ++i) step3[i] = store_bytes(t.store(), kSaved[i]);
  }
  EXPECT_EQ(verify_checkpoint(root()), 3 * chunks);
  c.train.resume = "auto";
  {
    Trainer t(c);
    EXPECT_EQ(t.resumed_from(), root());
    EXPECT_EQ(t.steps_done(), 3);
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(same_bytes(store_bytes(t.store(), kSaved[i]), step3[i])) << plane_name(kSaved[i]);
    t.step();
    t.step();
    t.save(root());
  }
  ASSERT_EQ(testing::newest_checkpoint(root()), at(5));
  Trainer t(c);
  EXPECT_EQ(t.resumed_from(), at(5));
  EXPECT_EQ(t.steps_done(), 5);
}

// ---- exact resume -------------------------------------------------------------------------------

TEST_F(Checkpoint, ResumeFromADiffCheckpointIsBitIdenticalToAnUninterruptedRun) {
  std::array<std::vector<char>, 3> straight;
  {
    Trainer t(toy_config(dir.path(), 8));
    for (int i = 0; i < 8; ++i) t.step();
    for (int i = 0; i < 3; ++i) straight[i] = store_bytes(t.store(), kSaved[i]);
  }
  for (bool async : {true, false}) {
    SCOPED_TRACE(async ? "async" : "synchronous");
    fs::remove_all(dir / "run");
    Config c = toy_config(dir.path(), 8);
    c.checkpoint.async = async;
    c.train.checkpoint_every = 2;
    {
      Trainer t(c);  // the background write overlaps the next steps
      t.run();
      for (int i = 0; i < 3; ++i)
        EXPECT_TRUE(same_bytes(store_bytes(t.store(), kSaved[i]), straight[i])) << plane_name(kSaved[i]);
    }
    // Lose the last two: the newest left is step 4, a differential one (XOR against step 2).
    fs::remove_all(at(8));
    fs::remove_all(at(6));
    ASSERT_EQ(manifest_of(at(4)).at("kind"), "diff");
    c.train.resume = "auto";
    Trainer t(c);
    ASSERT_EQ(t.resumed_from(), at(4));
    while (t.steps_done() < 8) t.step();
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(same_bytes(store_bytes(t.store(), kSaved[i]), straight[i])) << plane_name(kSaved[i]);
    for (const Chunk& chunk : t.store().chunks()) EXPECT_EQ(chunk.version, 8u) << "chunk " << chunk.id;
  }
}

// ---- through the keel binary: resharding across processes, injected faults ----------------------

// toy.toml: 2 layers, 64 wide, 10 chunks; 8 sequences of 32 tokens per step on any number of ranks.
class CheckpointProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_toy_corpus(dir.path());
    testing::write_toy_config(dir.path(), 8);
  }
  // `keel train` (ranks = 0) or `keel launch -n ranks -- train` into dir/run, with KEEL_FAULT = fault.
  testing::CommandResult train(int ranks, const std::string& run, const std::string& extra,
                               const std::string& fault = "") {
    const std::string args = "train --config " + dir / "toy.toml" +
                             " --set train.batch_size=" + std::to_string(ranks == 0 ? 8 : 8 / ranks) +
                             " --set train.run_dir=" + dir / run + " " + extra;
    const std::string keel =
        std::string(KEEL_BINARY) + " " + (ranks == 0 ? args : "launch -n " + std::to_string(ranks) + " -- " + args);
    return testing::run_command(fault.empty() ? keel : "KEEL_FAULT=" + fault + " " + keel);
  }
  std::string root(const std::string& run) const { return dir / (run + "/ckpt"); }
  std::string at(const std::string& run, int64_t step) const { return root(run) + "/" + checkpoint_name(step); }
  testing::TempDir dir{"keel-cpproc"};
};

// The state and data position of the newest checkpoint under each root are the same, byte for byte.
void expect_same_newest_state(const std::string& a, const std::string& b) {
  for (Plane p : kSaved) {
    EXPECT_TRUE(same_bytes(testing::checkpoint_bytes(a, p), testing::checkpoint_bytes(b, p)))
        << plane_name(p) << ": " << a << " vs " << b;
  }
  const json ma = manifest_of(testing::newest_checkpoint(a)), mb = manifest_of(testing::newest_checkpoint(b));
  EXPECT_EQ(ma.at("step"), mb.at("step"));
  EXPECT_EQ(ma.at("ranks")[0].at("data"), mb.at("ranks")[0].at("data"));
  for (size_t c = 0; c < ma.at("chunks").size(); ++c) EXPECT_EQ(ma["chunks"][c]["version"], mb["chunks"][c]["version"]);
}

TEST_F(CheckpointProcess, ReshardsAcrossRanksAndZeroStagesByteForByte) {
  const std::string steps = "--set train.steps=6 ";
  // Writers: 2 ranks under ZeRO-1 and ZeRO-2, one rank; differential checkpoints at 2, 4, 6.
  for (const auto& [run, ranks, zero] :
       std::vector<std::tuple<std::string, int, int>>{{"w2z1", 2, 1}, {"w2z2", 2, 2}, {"w1", 0, 0}}) {
    auto r = train(ranks, run, steps + "--set train.checkpoint_every=2 --set parallel.zero=" + std::to_string(zero));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json m = manifest_of(at(run, 6));
    EXPECT_EQ(m.at("kind"), "diff") << run;
    EXPECT_EQ(m.at("layout").at("world"), ranks == 0 ? 1 : ranks) << run;
    EXPECT_EQ(m.at("ranks").size(), static_cast<size_t>(ranks == 0 ? 1 : ranks)) << run;
    EXPECT_EQ(fs::exists(at(run, 6) + "/r1.bin"), ranks == 2) << run;
    EXPECT_GT(verify_checkpoint(root(run)), 0);
  }
  // Readers run no step (train.steps = the checkpoint's step): their final save re-writes the state.
  for (const auto& [from, ranks, zero] : std::vector<std::tuple<std::string, int, int>>{
           {"w2z1", 0, 0}, {"w2z1", 2, 2}, {"w2z2", 0, 0}, {"w2z2", 2, 0}, {"w1", 2, 2}, {"w1", 2, 1}}) {
    const std::string run = "r-" + from + "-" + std::to_string(ranks) + "z" + std::to_string(zero);
    SCOPED_TRACE(run);
    auto r =
        train(ranks, run, steps + "--set parallel.zero=" + std::to_string(zero) + " --set train.resume=" + root(from));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "resumed from " + at(from, 6) + " at step 6")) << r.output;
    ASSERT_EQ(testing::newest_checkpoint(root(run)), at(run, 6));
    EXPECT_EQ(manifest_of(at(run, 6)).at("layout").at("world"), ranks == 0 ? 1 : ranks);
    expect_same_newest_state(root(from), root(run));
  }
}

// The reference for the fault tests: 8 steps, checkpoints at 2, 4, 6 (async) and 8.
class CheckpointFault : public CheckpointProcess {
 protected:
  void SetUp() override {
    CheckpointProcess::SetUp();
    auto r = train(0, "ref", kArgs);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ASSERT_EQ(step_dirs(root("ref")),
              (std::vector<std::string>{"step-00000002", "step-00000004", "step-00000006", "step-00000008"}));
    const json m = manifest_of(at("ref", 4));
    for (const json& c : m.at("chunks")) {
      for (const auto& [plane, rec] : c.at("planes").items()) own_records_ += rec.at("in") == m.at("name");
    }
    ASSERT_GT(own_records_, 0);
  }
  // After a run whose checkpoint at step 4 failed: it reported the failure naming the newest
  // checkpoint (step 2), finished, left no step-4 directory, and its later checkpoints are sound
  // and independent of step 4.
  void expect_skipped_step4(const testing::CommandResult& r, const std::string& run) {
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "checkpoint step-00000004 not written")) << r.output;
    EXPECT_TRUE(contains(r.output, "newest checkpoint: " + at(run, 2))) << r.output;
    EXPECT_TRUE(contains(r.output, "after 8 steps")) << r.output;
    EXPECT_FALSE(fs::exists(at(run, 4))) << r.output;
    EXPECT_EQ(step_dirs(root(run)), (std::vector<std::string>{"step-00000002", "step-00000006", "step-00000008"}));
    std::set<std::string> needed;
    referenced(root(run), "step-00000008", needed);
    EXPECT_EQ(needed.count("step-00000004"), 0u);
    EXPECT_NO_THROW(verify_checkpoint(root(run)));
    // The failed checkpoint did not disturb training.
    expect_same_newest_state(root("ref"), root(run));
  }
  static constexpr const char* kArgs = "--set train.checkpoint_every=2 ";
  int own_records_ = 0;
};

// Operations on paths containing ckpt/step-00000004, one rank: create_dirs, create r0.bin, one
// append per record, sync, close, sync_dir; the manifest: create, append, sync, close, rename;
// sync_dir.
TEST_F(CheckpointFault, IoErrorAtAnyOperationOfACheckpointSkipsItAndTheRunContinues) {
  const int a = own_records_;
  const std::vector<std::pair<int, std::string>> ops = {{1, "create_dirs"},
                                                        {2, "create r0.bin"},
                                                        {3, "first append"},
                                                        {2 + a, "last append"},
                                                        {3 + a, "sync"},
                                                        {4 + a, "close"},
                                                        {5 + a, "sync_dir"},
                                                        {6 + a, "create manifest"},
                                                        {7 + a, "append manifest"},
                                                        {8 + a, "sync manifest"},
                                                        {9 + a, "close manifest"},
                                                        {10 + a, "rename manifest"},
                                                        {11 + a, "sync_dir after rename"}};
  for (const auto& [op, what] : ops) {
    SCOPED_TRACE(what + " (op " + std::to_string(op) + ")");
    const std::string run = "fail" + std::to_string(op);
    auto r = train(0, run, kArgs, "fail:op=" + std::to_string(op) + ":path=ckpt/step-00000004");
    EXPECT_TRUE(contains(r.output, "injected I/O error")) << r.output;
    expect_skipped_step4(r, run);
  }
  // The manifest's own count: step 2's create, append, sync, close, rename, then step 4's.
  auto r = train(0, "failm", kArgs, "fail:op=10:path=manifest");  // (no "manifest" in the run's path)
  EXPECT_TRUE(contains(r.output, "step-00000004/manifest.json")) << r.output;
  expect_skipped_step4(r, "failm");
  // A later run resumes from the root.
  r = train(0, "resumed", "--set train.steps=10 --set train.resume=" + root("fail3"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + at("fail3", 8) + " at step 8")) << r.output;
}

TEST_F(CheckpointFault, FullDiskSkipsCheckpointsUntilThereIsRoomAndAutoResumeReplaysExactly) {
  // Room for the checkpoint of step 2 (data and manifest) and a little more: none after it fits.
  const uint64_t room = fs::file_size(at("ref", 2) + "/r0.bin") + fs::file_size(at("ref", 2) + "/manifest.json") + 4096;
  auto r = train(0, "full", kArgs, "full:bytes=" + std::to_string(room) + ":path=ckpt");
  // The final state is not on disk: not a success (exit 3), and the summary names what is.
  EXPECT_EQ(r.exit_code, 3) << r.output;
  for (int step : {4, 6, 8}) {
    EXPECT_TRUE(contains(r.output, "checkpoint " + checkpoint_name(step) + " not written")) << r.output;
  }
  EXPECT_TRUE(contains(r.output, "No space left on device")) << r.output;
  EXPECT_TRUE(contains(r.output, "the final checkpoint (step 8) was not written; newest checkpoint: " + at("full", 2)))
      << r.output;
  EXPECT_TRUE(contains(r.output, "after 8 steps, ")) << r.output;
  EXPECT_TRUE(contains(r.output, "; checkpoint " + at("full", 2) + "\n")) << r.output;
  EXPECT_FALSE(contains(r.output, "checkpoint " + at("full", 8))) << r.output;
  EXPECT_EQ(step_dirs(root("full")), std::vector<std::string>{"step-00000002"});
  EXPECT_NO_THROW(verify_checkpoint(root("full")));
  // With room again, resume=auto continues from step 2 and ends where the reference ended.
  r = train(0, "full", kArgs + std::string("--set train.resume=auto"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + at("full", 2) + " at step 2")) << r.output;
  expect_same_newest_state(root("ref"), root("full"));
}

TEST_F(CheckpointFault, KillDuringACheckpointLeavesNoCheckpointAndAutoResumeReplaysExactly) {
  for (const std::string& fault : {std::string("kill:op=3:path=ckpt/step-00000004"),  // first append of r0.bin
                                   std::string("kill:op=10:path=manifest")}) {        // step 4's manifest rename
    SCOPED_TRACE(fault);
    const std::string run = fault.find("manifest") != std::string::npos ? "killm" : "killd";
    auto r = train(0, run, kArgs, fault);
    EXPECT_EQ(r.exit_code, 128 + 9) << r.output;  // SIGKILL
    ASSERT_TRUE(fs::exists(at(run, 4)));
    EXPECT_FALSE(fs::exists(at(run, 4) + "/manifest.json"));
    EXPECT_EQ(testing::newest_checkpoint(root(run)), at(run, 2));
    EXPECT_NO_THROW(verify_checkpoint(root(run)));
    // The leftover is cleaned at start-up and never used; training continues from step 2.
    // (checkpoint_every = 3: this run writes no step 4 of its own.)
    r = train(0, run, "--set train.checkpoint_every=3 --set train.resume=auto");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "resumed from " + at(run, 2) + " at step 2")) << r.output;
    EXPECT_FALSE(fs::exists(at(run, 4)));
    expect_same_newest_state(root("ref"), root(run));
  }
}

// A complete checkpoint stays intact until a newer one replaces it. Re-running a finished job
// (resume=auto, train.steps = the newest checkpoint's step, as a restart after the final save
// does) writes nothing: its checkpoint is already the state, so no later attempt of the same step
// piles up, and a fault armed for such a write is never reached.
TEST_F(CheckpointFault, ReRunningAFinishedJobWritesNothingAndKeepsTheCompleteCheckpoint) {
  for (const std::string& fault :
       {std::string("kill:op=3:path=ckpt/step-00000008"), std::string("fail:op=3:path=ckpt/step-00000008")}) {
    SCOPED_TRACE(fault);
    const std::string run = fault.substr(0, 4);
    fs::copy(dir / "ref", dir / run, fs::copy_options::recursive);
    ASSERT_NO_THROW(verify_checkpoint(at(run, 8)));
    const std::vector<std::string> before = step_dirs(root(run));
    auto r = train(0, run, kArgs + std::string("--set train.resume=auto"), fault);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_FALSE(contains(r.output, "injected")) << r.output;
    EXPECT_EQ(step_dirs(root(run)), before);
    EXPECT_TRUE(contains(r.output, "; checkpoint " + at(run, 8) + "\n")) << r.output;
    EXPECT_NO_THROW(verify_checkpoint(at(run, 8)));
    r = train(0, run, "--set train.resume=auto");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "resumed from " + at(run, 8) + " at step 8")) << r.output;
  }
}

// Every rank must load the same checkpoint. Under ZeRO-1 rank 1 alone reads its moments from
// r1.bin: damage there makes rank 1 reject the newest checkpoint, and every rank falls back to the
// previous one together; the job then ends exactly where an undisturbed one did.
TEST_F(CheckpointProcess, ACheckpointOneRankRejectsIsSkippedByAllRanks) {
  const std::string args = "--set parallel.zero=1 --set train.checkpoint_every=2 --set train.steps=6 ";
  auto r = train(2, "ref2", args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  fs::copy(dir / "ref2", dir / "hurt", fs::copy_options::recursive);
  const json m = manifest_of(at("hurt", 6));
  const json* moment = nullptr;
  for (const json& c : m.at("chunks")) {
    const json& rec = c.at("planes").at("adam_v");
    if (moment == nullptr && rec.at("in") == m.at("name") && rec.at("file") == "r1.bin") moment = &rec;
  }
  ASSERT_NE(moment, nullptr);
  flip_byte(at("hurt", 6) + "/r1.bin", moment->at("at").get<uint64_t>() + moment->at("bytes").get<uint64_t>() / 2);
  r = train(2, "hurt", args + "--set train.resume=auto");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] checkpoint rejected")) << r.output;
  EXPECT_TRUE(contains(r.output, at("hurt", 6) + "/r1.bin")) << r.output;
  EXPECT_TRUE(contains(r.output, "resumed from " + at("hurt", 4) + " at step 4")) << r.output;
  expect_same_newest_state(root("ref2"), root("hurt"));
}

// A write failing on one rank of two fails that checkpoint for all; the next ones are sound.
TEST_F(CheckpointFault, IoErrorOnOneRankSkipsTheCheckpointForTheWholeJob) {
  auto ref = train(2, "ref2", kArgs + std::string("--set parallel.zero=1"));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  auto r = train(2, "rank1", kArgs + std::string("--set parallel.zero=1"), "fail:op=3:path=ckpt/step-00000004:rank=1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "checkpoint step-00000004 not written: rank 1")) << r.output;
  EXPECT_FALSE(fs::exists(at("rank1", 4)));
  EXPECT_EQ(step_dirs(root("rank1")), (std::vector<std::string>{"step-00000002", "step-00000006", "step-00000008"}));
  EXPECT_NO_THROW(verify_checkpoint(root("rank1")));
  expect_same_newest_state(root("ref2"), root("rank1"));
}

}  // namespace
}  // namespace keel
