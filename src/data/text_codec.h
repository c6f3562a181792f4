// The text side of a language model, whichever tokenizer file it was trained with: Keel's own
// (its JSON, llm.c's or llama2.c's tokenizer.bin, data/tokenizer.h) or a Hugging Face
// tokenizer.json (data/hf_tokenizer.h). `keel generate`, `keel score` and training's text samples
// read text through it, so a model imported from Hugging Face and trained on shards `keel tokenize
// --tokenizer tokenizer.json` wrote speaks with that tokenizer.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

class TextCodec {
 public:
  // A Hugging Face tokenizer.json (a JSON object with a "model" field) or a file Tokenizer::load
  // reads. Errors are those readers' one-line keel::Errors naming `path`.
  static TextCodec load(const std::string& path);
  // The tokenizer a model's text goes through: `data_tokenizer` (the data.tokenizer key) when it is
  // a tokenizer.json, else HF_DIR/tokenizer.json when the model came from a Hugging Face directory
  // (`hf_dir`, "" if not) that has one, else `data_tokenizer` ("" = none).
  static std::string choose_path(const std::string& data_tokenizer, const std::string& hf_dir);
  // True when `path` holds a JSON object with a "model" field (the tokenizers library's file).
  static bool is_hf_tokenizer(const std::string& path);
  ~TextCodec();
  TextCodec(TextCodec&&) noexcept;
  TextCodec& operator=(TextCodec&&) noexcept;

  // The ids of `text`, without a document token. keel::Error when !can_encode().
  std::vector<int> encode(std::string_view text) const;
  // The text of `ids` (a document token and special tokens decode to nothing).
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  // The token that starts each document in Keel's shards (and so ends the previous one): a Keel
  // tokenizer's end-of-text token; a tokenizer.json's HfTokenizer::document_token() (Llama's BOS,
  // GPT-2's <|endoftext|>). A prompt starts with it, and generation stops when the model emits it.
  // -1 when the file has none.
  int document_token() const;
  bool can_encode() const;
  bool is_hf() const;

 private:
  struct Impl;
  explicit TextCodec(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel
