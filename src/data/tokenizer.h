// Byte-level BPE tokenizer in the style of GPT-2: text is split into pre-tokens by a
// hand-written equivalent of GPT-2's regex, each pre-token's bytes start as tokens 0..255,
// and learned merges join adjacent tokens inside a pre-token (never across one). The last
// id is a special end-of-text token that encode never produces.
//
// Two file formats:
//   - Keel JSON (read and written):
//     {"format":"keel-bpe","version":1,"vocab_size":N,"eot":N-1,"merges":[[a,b],...]}
//     where merge i creates token 256+i from tokens a and b (both < 256+i).
//   - llm.c's gpt2_tokenizer.bin (read only, decode only): 256 x uint32 header
//     (magic 20240328, version 1 or 2, vocab size, eot in version 2), then per token a
//     uint8 length and that many bytes. It carries no merges, so it cannot encode.
//   - llama2.c's tokenizer.bin (read and written): int32 max_token_length, then per token a
//     float32 score, an int32 length and that many bytes, to the end of the file. Loaded, it
//     encodes as llama2.c's run.c does (a leading " " token, each UTF-8 character looked up,
//     unknown bytes as SentencePiece's <0xXX> tokens at id byte + 3, then the adjacent pair whose
//     joined bytes are a token of the highest score merged, until none is) and decodes pieces
//     ("<0xXX>" as that byte, <s> and </s> as nothing, a space after <s> dropped); token 1 (<s>,
//     what llama2.c puts before each document) plays the end-of-text role. Written from a Keel
//     BPE tokenizer (save_llama2c), merge i scores -i and bytes 0: run.c decodes its tokens
//     exactly; its encoder approximates Keel's (no pre-token boundaries, a leading space, and
//     its byte fallback assumes SentencePiece's byte tokens, which a Keel vocabulary lacks).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace keel {

// Splits text into GPT-2 pre-tokens: contractions ('s 't 're 've 'm 'll 'd), ` ?letters+`,
// ` ?digits+`, ` ?other+`, and whitespace runs, where a whitespace run followed by a
// non-space leaves its last character to start the next pre-token. Bytes >= 0x80 count as
// letters. Guarantees the pieces are non-empty and concatenate back to text; the views point
// into text.
std::vector<std::string_view> pretokenize(std::string_view text);

class Tokenizer {
 public:
  // Trains byte-level BPE on documents: 256 byte tokens, then vocab_size - 257 merges, then
  // the end-of-text token as id vocab_size - 1. Requires vocab_size in [257, 65536] and text
  // with enough distinct adjacent pairs to learn that many merges (else keel::Error).
  // Each step merges the most frequent pair; ties go to the smallest (left, right) ids, so
  // the same documents always give the same merges. With at_most, vocab_size is a ceiling: a
  // text whose distinct pairs run out first (a few hundred captions) gets the merges it has, and
  // the end-of-text token follows the last of them.
  static Tokenizer train(const std::vector<std::string>& documents, int vocab_size, bool at_most = false);

  // Loads a tokenizer saved by save(), or llm.c's gpt2_tokenizer.bin (recognised by its
  // magic). Any malformed file gives a keel::Error naming path.
  static Tokenizer load(const std::string& path);

  // Writes the Keel JSON format to path (via path.tmp and a rename, so a crash never leaves
  // a half-written file at path). Requires can_encode() (an llm.c tokenizer has no merges
  // to save).
  void save(const std::string& path) const;

  // Writes llama2.c's tokenizer.bin (atomically). Requires can_encode() (a Keel BPE tokenizer).
  void save_llama2c(const std::string& path) const;

  // Encodes text to token ids, never emitting eot_token(). Throws keel::Error if
  // can_encode() is false.
  std::vector<int> encode(std::string_view text) const;

  // Concatenates decode_token over ids. Throws keel::Error for an id outside [0, vocab_size()).
  std::string decode(const std::vector<int>& ids) const;

  // The bytes of one token; the end-of-text token decodes to "". Throws keel::Error for an
  // id outside [0, vocab_size()).
  std::string decode_token(int id) const;

  int vocab_size() const { return static_cast<int>(token_bytes_.size()); }
  int eot_token() const { return eot_token_; }

  // True when this tokenizer has merges (trained or loaded from Keel JSON); false for an
  // llm.c tokenizer file, which can only decode.
  bool can_encode() const { return can_encode_; }
  // True for a llama2.c vocabulary (scored pieces): its encoding is run.c's, not lossless.
  bool scored() const { return !scores_.empty(); }

  // The learned merges in order: merges()[i] = (left, right) creates token 256 + i.
  const std::vector<std::pair<int, int>>& merges() const { return merges_; }

 private:
  Tokenizer() = default;

  // Builds token_bytes_ and merged_token_ from merges_ and vocab_size.
  void build_from_merges(int vocab_size);
  // Applies the merges to one pre-token's bytes, appending the resulting ids to out.
  void encode_pretoken(std::string_view piece, std::vector<int>& out) const;
  // Throws keel::Error unless id is in [0, vocab_size()).
  void check_token_id(int id) const;
  // llama2.c's tokenizer.bin, if `bytes` parses as one (else false, `tok` untouched).
  static bool load_llama2c(const std::string& bytes, const std::string& where, Tokenizer& tok);
  std::vector<int> encode_scored(std::string_view text) const;  // run.c's encoder

  std::vector<std::string> token_bytes_;            // id -> bytes; eot maps to ""
  std::vector<std::pair<int, int>> merges_;         // rank -> (left, right)
  std::unordered_map<uint64_t, int> merged_token_;  // packed (left, right) -> merged id
  int eot_token_ = -1;
  bool can_encode_ = false;
  std::vector<float> scores_;                       // llama2.c vocabularies: id -> score (else empty)
  std::vector<std::string> pieces_;                 // llama2.c vocabularies: id -> its piece as written
  std::unordered_map<std::string, int> piece_id_;   // llama2.c vocabularies: piece -> id
  std::string origin_;  // where this tokenizer came from, for error messages
};

}  // namespace keel
