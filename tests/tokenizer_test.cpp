#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;

using keel::testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Expects fn to throw keel::Error whose message contains needle (usually the file path).
template <typename Fn>
void expect_error_mentioning(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected keel::Error mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "message is not one line: " << e.what();
  }
}

std::vector<std::string> english_documents() {
  return {
      "The river ran high that spring, and the people of the valley watched it from the bridge "
      "every morning. Some of them said the water would reach the mill by the end of the week; "
      "others said it would turn before then, as it had every year they could remember.",
      "When the rain finally stopped, the children went down to the bank to look for the things "
      "the river had carried: branches, a wooden bucket, a boot without its partner, and once, "
      "to everyone's delight, a small boat that still floated.",
      "The miller was not worried. He had built the wall himself, he told anyone who asked, and "
      "he had built it to stand. He walked along the top of it in the evenings with his hands in "
      "his pockets, whistling the same three notes over and over again.",
      "In the end the water came within a hand's width of the top of the wall, held there for a "
      "night and a day, and then began to fall. The miller said nothing, but the next morning he "
      "was seen carrying stones from the field to the wall, one at a time.",
      "Numbers matter too: 1984 pages, 42 chapters, 3.14159 and 2024-05-20 should all survive. "
      "So should tabs\tand  double  spaces, newlines\n\nand trailing space   ",
  };
}

std::vector<int> concat_encode(const Tokenizer& tok, const std::vector<std::string>& docs) {
  std::vector<int> ids;
  for (const auto& d : docs) {
    const auto part = tok.encode(d);
    ids.insert(ids.end(), part.begin(), part.end());
  }
  return ids;
}

std::string bytes_of(const std::vector<std::string_view>& pieces) {
  std::string s;
  for (auto p : pieces) s += p;
  return s;
}

// --- pre-tokenization ----------------------------------------------------------------------

// Expected pieces come from Python's `regex` module running GPT-2's pattern on the same text.
TEST(Pretokenize, MatchesGpt2Regex) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(pretokenize("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pretokenize("I'm here, they'll see 'tis"),
            (V{"I", "'m", " here", ",", " they", "'ll", " see", " '", "tis"}));
  EXPECT_EQ(pretokenize("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(pretokenize("x\n\ny"), (V{"x", "\n", "\n", "y"}));
  EXPECT_EQ(pretokenize("end  "), (V{"end", "  "}));
  EXPECT_EQ(pretokenize("abc123 456!!"), (V{"abc", "123", " 456", "!!"}));
  EXPECT_EQ(pretokenize("tab\t\tx"), (V{"tab", "\t", "\t", "x"}));
  EXPECT_EQ(pretokenize(" \n x"), (V{" \n", " x"}));
  EXPECT_EQ(pretokenize("don't  'quote'"), (V{"don", "'t", " ", " '", "quote", "'"}));
  EXPECT_EQ(pretokenize("x \n\n  y"), (V{"x", " \n\n ", " y"}));
  EXPECT_TRUE(pretokenize("").empty());
}

TEST(Pretokenize, TreatsNonAsciiBytesAsLetters) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(pretokenize("h\xC3\xA9llo w\xC3\xB6rld"), (V{"h\xC3\xA9llo", " w\xC3\xB6rld"}));
  EXPECT_EQ(pretokenize("hi \xF0\x9F\x98\x80!"), (V{"hi", " \xF0\x9F\x98\x80", "!"}));
}

TEST(Pretokenize, PiecesCoverRandomBytesExactly) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::string text(rng() % 300, '\0');
    for (char& c : text) c = static_cast<char>(rng() % 256);
    const auto pieces = pretokenize(text);
    for (auto p : pieces) EXPECT_FALSE(p.empty());
    EXPECT_EQ(bytes_of(pieces), text);
  }
}

// --- training and encoding -----------------------------------------------------------------

TEST(Tokenizer, RoundTripsAsciiUtf8WhitespaceAndEmpty) {
  const Tokenizer tok = Tokenizer::train(english_documents(), 400);
  const std::vector<std::string> texts = {
      "",
      "The miller walked along the wall.",
      "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80\xF0\x9F\x9A\x80 done",
      "   leading\n\n\n\ttabs\t\t and trailing   \n",
      "\n",
      " ",
      "it's they're we've I'm you'll he'd",
  };
  for (const auto& text : texts) {
    const auto ids = tok.encode(text);
    EXPECT_EQ(tok.decode(ids), text);
    for (int id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, tok.eot_token());  // encode never emits eot
    }
  }
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode({}), "");
}

TEST(Tokenizer, RoundTripsRandomBytes) {
  const Tokenizer tok = Tokenizer::train(english_documents(), 400);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 50; ++trial) {
    std::string text(rng() % 500, '\0');
    for (char& c : text) c = static_cast<char>(rng() % 256);
    EXPECT_EQ(tok.decode(tok.encode(text)), text);
  }
}

TEST(Tokenizer, TrainingIsDeterministic) {
  const auto docs = english_documents();
  const Tokenizer a = Tokenizer::train(docs, 500);
  const Tokenizer b = Tokenizer::train(docs, 500);
  EXPECT_EQ(a.merges(), b.merges());
  EXPECT_EQ(concat_encode(a, docs), concat_encode(b, docs));
}

TEST(Tokenizer, VocabSizeIsRespectedAndEotIsLast) {
  for (int vocab : {257, 258, 300, 512}) {
    const Tokenizer tok = Tokenizer::train(english_documents(), vocab);
    EXPECT_EQ(tok.vocab_size(), vocab);
    EXPECT_EQ(tok.eot_token(), vocab - 1);
    EXPECT_EQ(tok.merges().size(), static_cast<size_t>(vocab - 257));
    EXPECT_TRUE(tok.can_encode());
    EXPECT_EQ(tok.decode_token(tok.eot_token()), "");
    EXPECT_EQ(tok.decode({tok.eot_token()}), "");
  }
}

TEST(Tokenizer, MergesCompressEnglishText) {
  const auto docs = english_documents();
  const Tokenizer tok = Tokenizer::train(docs, 600);
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  const size_t tokens = concat_encode(tok, docs).size();
  EXPECT_LT(tokens * 2, bytes) << tokens << " tokens for " << bytes << " bytes";
  // Byte-only vocabulary: exactly one token per byte.
  EXPECT_EQ(concat_encode(Tokenizer::train(docs, 257), docs).size(), bytes);
}

// Merges and encoding produced by an independent naive Python BPE (recounting every pair
// after each merge; same pre-tokenization and tie-break) on the same four documents.
TEST(Tokenizer, MatchesReferenceImplementation) {
  const std::vector<std::string> docs = {
      "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.",
      "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
      "It's 2024 and we're training 12 tiny models -- they'll learn the the the.",
      "  Indented line\n\nnew paragraph\twith\ttabs   and   spaces  ",
  };
  const std::vector<std::pair<int, int>> expected = {
      {104, 101}, {32, 115},  {32, 116},  {258, 256}, {108, 108}, {257, 101}, {260, 115}, {32, 97},
      {105, 110}, {110, 100}, {257, 256}, {32, 32},   {32, 108},  {114, 97},  {114, 101}, {261, 97},
      {263, 265}, {266, 262}, {32, 98},   {32, 100},  {32, 102},  {84, 256},  {111, 103}, {111, 120},
      {112, 97},  {112, 115}, {261, 262}, {275, 278}, {276, 279}, {32, 45},   {32, 49},   {32, 50},
      {32, 73},   {32, 106},  {32, 109},  {32, 111},  {32, 113},  {32, 114},  {32, 119},  {32, 277}};
  const Tokenizer tok = Tokenizer::train(docs, 297);
  EXPECT_EQ(tok.merges(), expected);
  EXPECT_EQ(tok.encode("the sea shells she sells"), (std::vector<int>{116, 256, 271, 273, 266, 282}));
}

TEST(Tokenizer, RejectsBadTrainingRequests) {
  EXPECT_THROW(Tokenizer::train(english_documents(), 256), Error);
  EXPECT_THROW(Tokenizer::train(english_documents(), 65537), Error);
  // Too little text for the requested merges: a clear error, not a short vocabulary.
  expect_error_mentioning([] { Tokenizer::train({"ab ab"}, 400); }, "vocab_size 400");
}

TEST(Tokenizer, DecodeRejectsOutOfRangeIds) {
  const Tokenizer tok = Tokenizer::train(english_documents(), 300);
  EXPECT_THROW(tok.decode({1, 300}), Error);
  EXPECT_THROW(tok.decode({-1}), Error);
  EXPECT_THROW(tok.decode_token(300), Error);
}

// --- files ---------------------------------------------------------------------------------

TEST(Tokenizer, SaveLoadRoundTrip) {
  TempDir dir;
  const auto docs = english_documents();
  const Tokenizer tok = Tokenizer::train(docs, 450);
  const std::string path = dir / "tokenizer.json";
  tok.save(path);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  const Tokenizer loaded = Tokenizer::load(path);
  EXPECT_EQ(loaded.vocab_size(), 450);
  EXPECT_EQ(loaded.eot_token(), 449);
  EXPECT_TRUE(loaded.can_encode());
  EXPECT_EQ(loaded.merges(), tok.merges());
  EXPECT_EQ(concat_encode(loaded, docs), concat_encode(tok, docs));
  for (int id = 0; id < tok.vocab_size(); ++id) EXPECT_EQ(loaded.decode_token(id), tok.decode_token(id));

  // Saving again gives the same bytes.
  const std::string again = dir / "again.json";
  loaded.save(again);
  std::ifstream a(path, std::ios::binary), b(again, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}), std::string(std::istreambuf_iterator<char>(b), {}));
}

// Builds an llm.c tokenizer file: 256 x uint32 header, then (uint8 length, bytes) per token.
std::string llmc_tokenizer_bytes(uint32_t magic, uint32_t version, const std::vector<std::string>& tokens,
                                 uint32_t eot) {
  uint32_t header[256] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<uint32_t>(tokens.size());
  header[3] = eot;
  std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
  for (const auto& t : tokens) {
    bytes.push_back(static_cast<char>(t.size()));
    bytes += t;
  }
  return bytes;
}

TEST(Tokenizer, LoadsLlmcTokenizerForDecoding) {
  TempDir dir;
  const std::vector<std::string> tokens = {"Hello", " world", "!", "\xF0\x9F\x98\x80", "<|endoftext|>"};
  const std::string path = dir / "gpt2_tokenizer.bin";
  write_bytes(path, llmc_tokenizer_bytes(20240328, 2, tokens, 4));
  const Tokenizer tok = Tokenizer::load(path);
  EXPECT_EQ(tok.vocab_size(), 5);
  EXPECT_EQ(tok.eot_token(), 4);
  EXPECT_FALSE(tok.can_encode());
  EXPECT_EQ(tok.decode({0, 1, 2, 3, 4}), "Hello world!\xF0\x9F\x98\x80");
  EXPECT_EQ(tok.decode_token(1), " world");
  expect_error_mentioning([&] { tok.encode("Hello"); }, path);
  EXPECT_THROW(tok.decode({5}), Error);
  EXPECT_THROW(tok.save(dir / "out.json"), Error);
}

TEST(Tokenizer, LoadsLlmcVersion1WithEot50256) {
  TempDir dir;
  std::vector<std::string> tokens(50257);
  for (int i = 0; i < 50257; ++i) tokens[i] = "t" + std::to_string(i);
  const std::string path = dir / "v1.bin";
  write_bytes(path, llmc_tokenizer_bytes(20240328, 1, tokens, 0));  // header[3] ignored in v1
  const Tokenizer tok = Tokenizer::load(path);
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.eot_token(), 50256);
  EXPECT_EQ(tok.decode({7, 50256, 12}), "t7t12");
}

TEST(Tokenizer, BadFilesNameThePath) {
  TempDir dir;
  const std::vector<std::string> tokens = {"a", "b", "c"};

  const std::string missing = dir / "missing.json";
  expect_error_mentioning([&] { Tokenizer::load(missing); }, missing);

  const std::string wrong_magic = dir / "wrong_magic.bin";
  write_bytes(wrong_magic, llmc_tokenizer_bytes(12345, 2, tokens, 2));
  expect_error_mentioning([&] { Tokenizer::load(wrong_magic); }, wrong_magic);
  expect_error_mentioning([&] { Tokenizer::load(wrong_magic); }, "12345");

  const std::string wrong_version = dir / "wrong_version.bin";
  write_bytes(wrong_version, llmc_tokenizer_bytes(20240328, 3, tokens, 2));
  expect_error_mentioning([&] { Tokenizer::load(wrong_version); }, wrong_version);

  const std::string truncated = dir / "truncated.bin";
  std::string bytes = llmc_tokenizer_bytes(20240328, 2, tokens, 2);
  write_bytes(truncated, bytes.substr(0, bytes.size() - 1));
  expect_error_mentioning([&] { Tokenizer::load(truncated); }, truncated);

  const std::string short_header = dir / "short_header.bin";
  write_bytes(short_header, bytes.substr(0, 100));
  expect_error_mentioning([&] { Tokenizer::load(short_header); }, short_header);

  const std::string trailing = dir / "trailing.bin";
  write_bytes(trailing, bytes + "xyz");
  expect_error_mentioning([&] { Tokenizer::load(trailing); }, trailing);

  const std::string bad_eot = dir / "bad_eot.bin";
  write_bytes(bad_eot, llmc_tokenizer_bytes(20240328, 2, tokens, 3));
  expect_error_mentioning([&] { Tokenizer::load(bad_eot); }, bad_eot);

  const std::string bad_json = dir / "bad.json";
  write_bytes(bad_json, "{\"format\": \"keel-bpe\",\n \"version\": 1,");
  expect_error_mentioning([&] { Tokenizer::load(bad_json); }, bad_json);

  const std::string wrong_format = dir / "wrong_format.json";
  write_bytes(wrong_format, R"({"format":"other","version":1,"vocab_size":258,"eot":257,"merges":[[1,2]]})");
  expect_error_mentioning([&] { Tokenizer::load(wrong_format); }, wrong_format);

  const std::string wrong_json_version = dir / "wrong_version.json";
  write_bytes(wrong_json_version, R"({"format":"keel-bpe","version":2,"vocab_size":258,"eot":257,"merges":[[1,2]]})");
  expect_error_mentioning([&] { Tokenizer::load(wrong_json_version); }, wrong_json_version);

  const std::string out_of_range = dir / "out_of_range.json";
  write_bytes(out_of_range,
              R"({"format":"keel-bpe","version":1,"vocab_size":259,"eot":258,"merges":[[1,2],[256,257]]})");
  expect_error_mentioning([&] { Tokenizer::load(out_of_range); }, out_of_range);
  expect_error_mentioning([&] { Tokenizer::load(out_of_range); }, "merge 1");

  const std::string negative = dir / "negative.json";
  write_bytes(negative, R"({"format":"keel-bpe","version":1,"vocab_size":258,"eot":257,"merges":[[-1,2]]})");
  expect_error_mentioning([&] { Tokenizer::load(negative); }, negative);

  const std::string wrong_count = dir / "wrong_count.json";
  write_bytes(wrong_count, R"({"format":"keel-bpe","version":1,"vocab_size":300,"eot":299,"merges":[[1,2]]})");
  expect_error_mentioning([&] { Tokenizer::load(wrong_count); }, wrong_count);

  const std::string wrong_eot = dir / "wrong_eot.json";
  write_bytes(wrong_eot, R"({"format":"keel-bpe","version":1,"vocab_size":258,"eot":0,"merges":[[1,2]]})");
  expect_error_mentioning([&] { Tokenizer::load(wrong_eot); }, wrong_eot);

  const std::string repeated = dir / "repeated.json";
  write_bytes(repeated, R"({"format":"keel-bpe","version":1,"vocab_size":259,"eot":258,"merges":[[1,2],[1,2]]})");
  expect_error_mentioning([&] { Tokenizer::load(repeated); }, repeated);

  const std::string missing_field = dir / "missing_field.json";
  write_bytes(missing_field, R"({"format":"keel-bpe","version":1,"eot":257,"merges":[[1,2]]})");
  expect_error_mentioning([&] { Tokenizer::load(missing_field); }, missing_field);
}

}  // namespace
}  // namespace keel

namespace keel {
namespace {

// Writes a tokenizer.bin in llama2.c's layout: max length, then (score, length, bytes) per token.
void write_llama2c_vocab(const std::string& path, const std::vector<std::pair<std::string, float>>& vocab) {
  std::string out(4, '\0');
  int32_t max_len = 1;
  for (const auto& [piece, score] : vocab) max_len = std::max<int32_t>(max_len, static_cast<int32_t>(piece.size()));
  std::memcpy(out.data(), &max_len, 4);
  for (const auto& [piece, score] : vocab) {
    const int32_t len = static_cast<int32_t>(piece.size());
    out.append(reinterpret_cast<const char*>(&score), 4);
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += piece;
  }
  std::ofstream(path, std::ios::binary) << out;
}

// A SentencePiece-style vocabulary as llama2.c ships it: <unk> <s> </s>, the 256 byte tokens, then
// pieces with scores. run.c's encoder: a leading " ", characters looked up (unknown bytes as
// <0xXX> at byte + 3), then the best-scoring mergeable pair, again and again.
TEST(Llama2cTokenizer, EncodesAndDecodesAsRunCDoes) {
  testing::TempDir dir("keel-llama2c-tok");
  std::vector<std::pair<std::string, float>> vocab = {{"<unk>", 0}, {"<s>", 0}, {"</s>", 0}};
  for (int b = 0; b < 256; ++b) {
    char piece[8];
    std::snprintf(piece, sizeof piece, "<0x%02X>", b);
    vocab.emplace_back(piece, 0.0f);
  }
  vocab.insert(vocab.end(), {{" ", -10}, {"a", -10}, {"b", -10}, {"ab", -1}, {" ab", -2}, {"ba", -0.5f}});
  write_llama2c_vocab(dir / "tokenizer.bin", vocab);
  const Tokenizer tok = Tokenizer::load(dir / "tokenizer.bin");
  EXPECT_EQ(tok.vocab_size(), 265);
  EXPECT_TRUE(tok.can_encode());
  EXPECT_EQ(tok.eot_token(), 1);
  // " abab": " " a b a b; "ba" (-0.5) beats "ab" (-1); then nothing joins further.
  EXPECT_EQ(tok.encode("abab"), (std::vector<int>{259, 260, 264, 261}));
  EXPECT_EQ(tok.decode(tok.encode("abab")), " abab");
  // " ab": " " a b -> "ab" (-1) -> " ab" (-2).
  EXPECT_EQ(tok.encode("ab"), (std::vector<int>{263}));
  // é is not a piece: its two UTF-8 bytes become <0xC3> <0xA9>, which decode to the bytes again.
  EXPECT_EQ(tok.encode("\xC3\xA9"), (std::vector<int>{259, 0xC3 + 3, 0xA9 + 3}));
  EXPECT_EQ(tok.decode({0xC3 + 3, 0xA9 + 3}), "\xC3\xA9");
  // After <s>, a piece's leading space is dropped.
  EXPECT_EQ(tok.decode({1, 263}), "ab");
  EXPECT_EQ(tok.decode({260, 263}), "a ab");
}

// A Keel BPE tokenizer written as tokenizer.bin: every token decodes to the same bytes, and what
// run.c's encoder makes of ASCII text decodes back to it (after the leading space it adds).
TEST(Llama2cTokenizer, AKeelTokenizerWrittenAsTokenizerBinDecodesTheSame) {
  testing::TempDir dir("keel-llama2c-tok");
  std::vector<std::string> docs;
  for (int i = 0; i < 50; ++i) docs.push_back("the cat sat on the mat and the dog sat on the log " + std::to_string(i));
  const Tokenizer keel_tok = Tokenizer::train(docs, 300);
  keel_tok.save_llama2c(dir / "tokenizer.bin");
  const Tokenizer read = Tokenizer::load(dir / "tokenizer.bin");
  ASSERT_EQ(read.vocab_size(), keel_tok.vocab_size());
  for (int id = 0; id < keel_tok.vocab_size(); ++id) EXPECT_EQ(read.decode_token(id), keel_tok.decode_token(id)) << id;
  const std::string text = "the dog sat on the cat";
  const std::vector<int> ids = read.encode(text);
  EXPECT_EQ(read.decode(ids), " " + text);
  EXPECT_LT(ids.size(), text.size());  // the merges apply
  // Truncated by one byte: not a tokenizer.bin any more, and said in one line.
  const std::string bytes = read_text_file(dir / "tokenizer.bin");
  std::ofstream(dir / "short.bin", std::ios::binary) << bytes.substr(0, bytes.size() - 1);
  const std::string e = testing::error_of([&] { Tokenizer::load(dir / "short.bin"); });
  EXPECT_NE(e.find("llama2.c's tokenizer.bin"), std::string::npos) << e;
}

}  // namespace
}  // namespace keel
