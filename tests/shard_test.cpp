// Tests for token shards (data/shard.h) and for the corpus pipeline that writes them
// (data/corpus.h).
#include "data/shard.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/corpus.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

using keel::testing::TempDir;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Expects fn to throw a one-line keel::Error containing each of needles.
template <typename Fn>
void expect_error_mentioning(Fn&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected keel::Error mentioning " << needles.front();
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& needle : needles) EXPECT_NE(what.find(needle), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << "message is not one line: " << what;
  }
}

// A shard's bytes built independently of write_token_shard, with magic and version overridable.
std::string shard_bytes(const std::vector<uint16_t>& tokens, int32_t magic = 20240520, int32_t version = 1) {
  int32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint16_t));
  return bytes;
}

// --- shards --------------------------------------------------------------------------------

TEST(Shard, WriteReadRoundTrip) {
  TempDir dir;
  std::vector<uint16_t> tokens(10000);
  std::mt19937 rng(3);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng());
  tokens[0] = 0;
  tokens[1] = 65535;
  const std::string path = dir / "train.bin";
  write_token_shard(path, tokens);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(read_token_shard(path), tokens);
  EXPECT_EQ(read_token_shard(path, 65535), tokens);
  // Byte layout is exactly llm.c's.
  EXPECT_EQ(read_bytes(path), shard_bytes(tokens));
}

TEST(Shard, EmptyShardRoundTrips) {
  TempDir dir;
  const std::string path = dir / "empty.bin";
  write_token_shard(path, {});
  EXPECT_EQ(fs::file_size(path), 1024u);
  EXPECT_TRUE(read_token_shard(path).empty());
}

TEST(Shard, OverwritesAnExistingShard) {
  TempDir dir;
  const std::string path = dir / "x.bin";
  write_token_shard(path, {1, 2, 3, 4, 5});
  write_token_shard(path, {9});
  EXPECT_EQ(read_token_shard(path), (std::vector<uint16_t>{9}));
}

TEST(Shard, WriteIntoMissingDirectoryNamesThePath) {
  TempDir dir;
  const std::string path = dir / "no_such_dir/x.bin";
  expect_error_mentioning([&] { write_token_shard(path, {1}); }, {path});
}

TEST(Shard, CorruptFilesNameThePath) {
  TempDir dir;
  const std::vector<uint16_t> tokens = {5, 6, 7, 8};

  const std::string missing = dir / "missing.bin";
  expect_error_mentioning([&] { read_token_shard(missing); }, {missing});

  const std::string short_header = dir / "short_header.bin";
  write_bytes(short_header, shard_bytes(tokens).substr(0, 500));
  expect_error_mentioning([&] { read_token_shard(short_header); }, {short_header, "1024-byte header", "500"});

  const std::string truncated = dir / "truncated.bin";
  const std::string good = shard_bytes(tokens);
  write_bytes(truncated, good.substr(0, good.size() - 3));
  expect_error_mentioning([&] { read_token_shard(truncated); }, {truncated, "truncated"});

  const std::string trailing = dir / "trailing.bin";
  write_bytes(trailing, good + "ab");
  expect_error_mentioning([&] { read_token_shard(trailing); }, {trailing, "trailing"});

  const std::string garbage = dir / "garbage.bin";
  std::string noise(4096, '\0');
  std::mt19937 rng(5);
  for (char& c : noise) c = static_cast<char>(rng());
  write_bytes(garbage, noise);
  expect_error_mentioning([&] { read_token_shard(garbage); }, {garbage, "magic"});

  const std::string wrong_magic = dir / "wrong_magic.bin";
  write_bytes(wrong_magic, shard_bytes(tokens, 12345));
  expect_error_mentioning([&] { read_token_shard(wrong_magic); },
                          {"shard " + wrong_magic + ": expected magic 20240520, found 12345"});

  const std::string wrong_version = dir / "wrong_version.bin";
  write_bytes(wrong_version, shard_bytes(tokens, 20240520, 2));
  expect_error_mentioning([&] { read_token_shard(wrong_version); }, {wrong_version, "version 1", "found 2"});

  const std::string negative_count = dir / "negative_count.bin";
  std::string bytes = shard_bytes(tokens);
  const int32_t minus_one = -1;
  std::memcpy(&bytes[8], &minus_one, sizeof(minus_one));  // header[2], the token count
  write_bytes(negative_count, bytes);
  expect_error_mentioning([&] { read_token_shard(negative_count); }, {negative_count});

  const std::string directory = dir / "a_directory";
  fs::create_directory(directory);
  expect_error_mentioning([&] { read_token_shard(directory); }, {directory});
}

TEST(Shard, TokenAboveMaxNamesPositionAndValue) {
  TempDir dir;
  const std::string path = dir / "x.bin";
  write_token_shard(path, {1, 2, 300, 4});
  EXPECT_EQ(read_token_shard(path, 300).size(), 4u);
  expect_error_mentioning([&] { read_token_shard(path, 299); }, {path, "300", "position 2"});
}

// --- corpus --------------------------------------------------------------------------------

TEST(Corpus, SplitsFortuneFilesAndReadsOthersWhole) {
  TempDir dir;
  const std::string fortunes = dir / "quotes";
  write_bytes(fortunes, "First fortune,\ntwo lines.\n%\nSecond one.\n%\n%\n  \n%\nLast, no newline");
  const std::string plain = dir / "essay.txt";
  write_bytes(plain, "A plain file.\n% is not alone on this line\n");
  const auto docs = read_documents({fortunes, plain});
  EXPECT_EQ(docs, (std::vector<std::string>{"First fortune,\ntwo lines.\n", "Second one.\n", "Last, no newline",
                                            "A plain file.\n% is not alone on this line\n"}));
}

TEST(Corpus, DirectorySkipsIndexFilesAndDuplicateLinks) {
  TempDir dir;
  write_bytes(dir / "b_text", "bee\n%\nbuzz\n");
  write_bytes(dir / "a_text", "ant");
  write_bytes(dir / "b_text.dat", std::string("\x00\x01\x02", 3));
  fs::create_symlink(dir / "b_text", dir / "b_text.u8");
  fs::create_symlink(dir / "b_text", dir / "a_link");  // target read anyway
  fs::create_directory(dir / "subdir");
  write_bytes(dir / "empty", "\n\n");
  const auto docs = read_documents({dir.path()});
  EXPECT_EQ(docs, (std::vector<std::string>{"ant", "bee\n", "buzz\n"}));
}

TEST(Corpus, MissingPathIsAnError) {
  TempDir dir;
  const std::string missing = dir / "nope";
  expect_error_mentioning([&] { read_documents({missing}); }, {missing});
}

std::vector<std::string> sample_documents() {
  std::vector<std::string> docs;
  for (int i = 0; i < 40; ++i)
    docs.push_back("Document number " + std::to_string(i) + " talks about the weather, the river and the " +
                   (i % 2 ? "mill." : "bridge over the water."));
  return docs;
}

TEST(Corpus, TokenizeWritesDeterministicShardsAndTokenizer) {
  TempDir dir;
  const auto docs = sample_documents();
  const std::string out_a = dir / "a";
  const std::string out_b = dir / "b/nested";
  const TokenizeResult a = tokenize_corpus(docs, out_a, 300, 0.2, 42);
  tokenize_corpus(docs, out_b, 300, 0.2, 42);
  for (const char* name : {"tokenizer.json", "train.bin", "val.bin"})
    EXPECT_EQ(read_bytes(out_a + "/" + name), read_bytes(out_b + "/" + name)) << name;

  EXPECT_EQ(a.documents, docs.size());
  EXPECT_EQ(a.vocab_size, 300);
  const auto train = read_token_shard(out_a + "/train.bin", 299);
  const auto val = read_token_shard(out_a + "/val.bin", 299);
  EXPECT_EQ(train.size(), a.train_tokens);
  EXPECT_EQ(val.size(), a.val_tokens);

  // Every document appears exactly once, as [eot, tokens...], in one of the splits.
  const Tokenizer tok = Tokenizer::load(out_a + "/tokenizer.json");
  size_t eots = 0;
  std::string text;
  for (const auto* shard : {&train, &val}) {
    ASSERT_FALSE(shard->empty());
    EXPECT_EQ(shard->front(), tok.eot_token());
    for (uint16_t t : *shard) {
      eots += t == tok.eot_token();
      text += tok.decode_token(t);
    }
  }
  EXPECT_EQ(eots, docs.size());
  size_t doc_bytes = 0;
  for (const auto& d : docs) doc_bytes += d.size();
  EXPECT_EQ(text.size(), doc_bytes);

  // A different seed gives a different split.
  const TokenizeResult c = tokenize_corpus(docs, dir / "c", 300, 0.2, 7);
  EXPECT_NE(read_bytes(out_a + "/val.bin"), read_bytes(dir / "c/val.bin"));
  EXPECT_EQ(c.documents, docs.size());
}

TEST(Corpus, EachSplitGetsADocument) {
  TempDir dir;
  const auto docs = sample_documents();
  const TokenizeResult tiny = tokenize_corpus(docs, dir / "tiny", 270, 1e-9, 1);
  EXPECT_GT(tiny.val_tokens, 0u);
  const TokenizeResult huge = tokenize_corpus(docs, dir / "huge", 270, 1 - 1e-9, 1);
  EXPECT_GT(huge.train_tokens, 0u);
  EXPECT_THROW(tokenize_corpus({"only one"}, dir / "one", 257, 0.1, 1), Error);
  EXPECT_THROW(tokenize_corpus(docs, dir / "bad", 300, 0.0, 1), Error);
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// data.shuffle = false reads training batches in file order (llm.c's order), epoch after epoch;
// shuffled, the same windows come in another order.
TEST(Loader, ShuffleOffReadsWindowsInFileOrder) {
  testing::TempDir dir;
  std::vector<uint16_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % 50);
  write_token_shard(dir / "t.bin", tokens);
  DataLoader ordered(dir / "t.bin", 2, 8, 64, false, 1337);
  DataLoader shuffled(dir / "t.bin", 2, 8, 64, true, 1337);
  DataLoader reference(dir / "t.bin", 2, 8, 64, false, 1337);
  const uint64_t n = ordered.num_windows();
  ASSERT_GT(n, 4u);
  bool differs = false;
  for (uint64_t k = 0; k < 2 * n; ++k) {
    const Batch a = ordered.next();
    const std::vector<int> got(a.inputs, a.inputs + 16);
    const Batch w = reference.window(k % n);
    EXPECT_EQ(got, std::vector<int>(w.inputs, w.inputs + 16)) << "batch " << k;
    const Batch s = shuffled.next();
    differs |= std::vector<int>(s.inputs, s.inputs + 16) != got;
  }
  EXPECT_TRUE(differs);
}

// Shuffled, a batch's sequences come from all over the shard, not from one stretch of B x T
// consecutive tokens: an epoch permutes the shard's sequences of T tokens (each read whole, with
// its next token as the last target), every sequence at most once per epoch.
TEST(Loader, ShuffledBatchesDrawSequencesFromAllOverTheShard) {
  testing::TempDir dir;
  std::vector<uint16_t> tokens(1001);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);  // a token names its place
  write_token_shard(dir / "t.bin", tokens);
  const int B = 4, T = 8;
  DataLoader loader(dir / "t.bin", B, T, 1024, true, 1337);
  const uint64_t windows = loader.num_windows();
  ASSERT_EQ(windows, 31u);  // 125 sequences of 8 (+1) tokens: 31 batches of 4, one sequence left out
  std::set<int> seen;
  uint64_t one_stretch = 0;  // batches whose sequences are consecutive in the shard
  for (uint64_t k = 0; k < windows; ++k) {
    const Batch b = loader.next();
    bool consecutive = true;
    for (int s = 0; s < B; ++s) {
      const int start = b.inputs[s * T];
      ASSERT_EQ(start % T, 0) << "batch " << k << " sequence " << s;
      for (int i = 0; i < T; ++i) {
        ASSERT_EQ(b.inputs[s * T + i], start + i) << "batch " << k << " sequence " << s;
        ASSERT_EQ(b.targets[s * T + i], start + i + 1) << "batch " << k << " sequence " << s;
      }
      EXPECT_TRUE(seen.insert(start).second) << "sequence at " << start << " twice in an epoch";
      if (s > 0 && start != b.inputs[(s - 1) * T] + T) consecutive = false;
    }
    one_stretch += consecutive;
  }
  EXPECT_EQ(seen.size(), windows * B);
  EXPECT_LT(one_stretch, windows / 4) << "shuffled batches are stretches of consecutive text";
}

// A curriculum's shorter sequences come from the same windows (cut at the longest length): each
// window read in parts, in order, rank r's share the one-rank batch's sequences r*B..; a length
// change mid-window moves to the next aligned part (or window); a saved position resumes mid-window.
TEST(Loader, ShorterLengthsReadEachWindowInPartsAndResumeMidWindow) {
  testing::TempDir dir;
  std::vector<uint16_t> tokens(2000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 7) % 61);
  write_token_shard(dir / "t.bin", tokens);
  auto inputs = [](const Batch& b) { return std::vector<int>(b.inputs, b.inputs + static_cast<size_t>(b.B) * b.T); };
  auto targets = [](const Batch& b) { return std::vector<int>(b.targets, b.targets + static_cast<size_t>(b.B) * b.T); };
  // Windows of 2 x 8 tokens, in file order: window w starts at token 16 w.
  DataLoader loader(dir / "t.bin", 2, 8, 64, false, 1);
  auto expect_from = [&](const Batch& b, size_t start, const std::string& what) {
    ASSERT_EQ(b.T, 4) << what;
    ASSERT_EQ(b.B, 2) << what;
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(b.inputs[i], tokens[start + i]) << what << " token " << i;
      EXPECT_EQ(b.targets[i], tokens[start + i + 1]) << what << " token " << i;
    }
  };
  expect_from(loader.next(4), 0, "window 0, part 0");
  EXPECT_EQ(loader.position().index, 0u);
  EXPECT_EQ(loader.position().offset, 8u);
  const LoaderPosition mid = loader.position();
  expect_from(loader.next(4), 8, "window 0, part 1");
  EXPECT_EQ(loader.position().index, 1u);
  EXPECT_EQ(loader.position().offset, 0u);
  expect_from(loader.next(4), 16, "window 1, part 0");
  // The full length does not fit what is left of window 1: window 2, whole.
  const Batch whole = loader.next();
  EXPECT_EQ(whole.T, 8);
  EXPECT_EQ(inputs(whole), std::vector<int>(tokens.begin() + 32, tokens.begin() + 48));
  EXPECT_EQ(loader.position().index, 3u);
  // Resumed mid-window: the same stream.
  DataLoader resumed(dir / "t.bin", 2, 8, 64, false, 1);
  resumed.set_position(mid);
  expect_from(resumed.next(4), 8, "resumed window 0, part 1");
  EXPECT_THROW(loader.next(3), Error);                                  // not a divisor of the windows' length
  EXPECT_THROW(resumed.set_position(LoaderPosition{0, 0, 16}), Error);  // past the window
  // Two data-parallel ranks of batch 1 read the one-rank batch's two sequences, shuffled too, at
  // lengths changing mid-window, over several epochs.
  DataLoader one(dir / "t.bin", 2, 8, 64, true, 9);
  DataLoader r0(dir / "t.bin", 1, 8, 64, true, 9, 0, 2), r1(dir / "t.bin", 1, 8, 64, true, 9, 1, 2);
  for (int k = 0; k < 300; ++k) {
    const int T = k % 5 < 3 ? 2 : (k % 5 == 3 ? 4 : 8);
    const Batch a = one.next(T);
    std::vector<int> in = inputs(a), tg = targets(a);
    const Batch b0 = r0.next(T);
    std::vector<int> in_r = inputs(b0), tg_r = targets(b0);
    const Batch b1 = r1.next(T);
    const std::vector<int> in1 = inputs(b1), tg1 = targets(b1);
    in_r.insert(in_r.end(), in1.begin(), in1.end());
    tg_r.insert(tg_r.end(), tg1.begin(), tg1.end());
    ASSERT_EQ(in, in_r) << "batch " << k;
    ASSERT_EQ(tg, tg_r) << "batch " << k;
  }
  EXPECT_GT(one.position().epoch, 0u);
}

}  // namespace
}  // namespace keel
