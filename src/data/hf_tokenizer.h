// Hugging Face tokenizer.json (the `tokenizers` library's file), BPE models in the shapes of
// GPT-2's and Llama 3's byte-level BPE and Llama 2's / TinyLlama's SentencePiece-style BPE, giving
// the ids the library gives (encode without a post-processor's special tokens):
//   1. Text that is not valid UTF-8 is first decoded as Python decodes bytes with errors="replace"
//      (each maximal invalid sequence becomes U+FFFD): the library takes Unicode strings.
//   2. Added tokens (added_tokens[]) are matched as the library matches them, leftmost and longest
//      first: those with normalized = false in the text, then those with normalized = true (the
//      default for non-special ones) in each other piece's normalized text, as the normalizer
//      writes their content; single_word: only with no word character (\w) touching either end;
//      lstrip / rstrip: the whitespace before / after it is part of the match. Each is its id;
//      the text between them goes through the rest.
//   3. The normalizer: null, Prepend, Replace (a string pattern), NFC / NFD / NFKC / NFKD, Sequence.
//   4. The pre-tokenizer: null, Split (a Regex or String pattern; behaviour Isolated, Removed,
//      MergedWithPrevious, MergedWithNext or Contiguous; not inverted), ByteLevel (a space put
//      before each piece that has none with add_prefix_space; GPT-2's pattern when use_regex; each
//      byte as the printable character GPT-2 maps it to), Metaspace (spaces as the replacement
//      character, prepended with prepend_scheme always, or first: only to the piece that starts
//      the text; split: cut before each replacement character), Sequence. Patterns are the
//      file's own, run by ICU with \s and \S as Unicode White_Space (Oniguruma's meaning).
//   5. The BPE model on each piece: its characters looked up in the vocabulary (unknown ones as
//      <0xXX> byte tokens with byte_fallback, else unk_token, consecutive ones fused with
//      fuse_unk, else dropped as the library drops them), then the lowest-ranked merge applied
//      first (leftmost among equals) until none applies; with ignore_merges a piece that is itself
//      a token is that token.
// Anything else (another model type, dropout, subword prefixes, an unknown normalizer or
// pre-tokenizer) is refused when the file is read, in one line naming the file and the field.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

class HfTokenizer {
 public:
  // Reads and validates a tokenizer.json. Errors name `path` and the field.
  static HfTokenizer load(const std::string& path);
  // The same from the file's text (`where` names it in errors).
  static HfTokenizer parse(const std::string& json_text, const std::string& where);
  ~HfTokenizer();
  HfTokenizer(HfTokenizer&&) noexcept;
  HfTokenizer& operator=(HfTokenizer&&) noexcept;

  // The ids of `text` (any bytes), without the post-processor's special tokens.
  std::vector<int> encode(std::string_view text) const;
  // The text of `ids` through the file's decoder (ByteLevel; Replace, ByteFallback, Fuse, Strip,
  // Metaspace; none: the tokens joined; a normalized added token as its normalized content). An id
  // outside the vocabulary is a keel::Error.
  std::string decode(const std::vector<int>& ids) const;
  // Ids cover [0, vocab_size()): the vocabulary and the added tokens.
  int vocab_size() const;
  // The token that starts a document in Keel's shards: the special token the post-processor puts
  // first (Llama's BOS), else the added token <|endoftext|> (GPT-2's), else -1.
  int document_token() const;

 private:
  struct Impl;
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `text` as valid UTF-8: each maximal invalid subsequence replaced by U+FFFD (Python's
// bytes.decode("utf-8", errors="replace")). Valid text comes back unchanged.
std::string utf8_replace_invalid(std::string_view text);

}  // namespace keel
