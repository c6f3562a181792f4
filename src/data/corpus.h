// A text corpus: reading documents from files and turning them into a tokenizer plus
// train/validation token shards, the input of a training run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

// Reads text files into documents, in argument order. A file in fortune format (recognised by
// containing "\n%\n"; documents are separated by lines that are exactly "%") gives one document
// per fortune; any other file is one document. Empty and whitespace-only documents are dropped.
// A directory means every regular file directly in it, sorted by name, skipping names ending in
// ".dat" or ".u8" and symlinks whose target is already included. A missing or unreadable path
// gives a keel::Error naming it.
std::vector<std::string> read_documents(const std::vector<std::string>& paths);

struct TokenizeResult {
  size_t train_tokens;  // tokens in train.bin, one eot per document included
  size_t val_tokens;    // tokens in val.bin
  size_t documents;     // documents in both splits together
  int vocab_size;
};

// Splits documents into train and validation, trains a tokenizer on the training documents,
// encodes each document as [eot, tokens...], and writes out_dir/tokenizer.json,
// out_dir/train.bin and out_dir/val.bin (creating out_dir). A document goes to validation when
// a hash of (its index, seed) falls below val_fraction; each split gets at least one document.
// Requires at least 2 documents, val_fraction in (0, 1) and vocab_size in [257, 65536].
// Deterministic: the same inputs give byte-identical files.
TokenizeResult tokenize_corpus(const std::vector<std::string>& documents, const std::string& out_dir, int vocab_size,
                               double val_fraction, uint64_t seed);

// A tokenizer given rather than trained (a Hugging Face tokenizer.json): each document becomes
// [document_token, encode(document)...].
struct DocumentEncoder {
  std::function<std::vector<int>(std::string_view)> encode;
  int document_token = 0;
  int vocab_size = 0;
};
// The same split and shards with `encoder` (nothing trained, no tokenizer written): out_dir/train.bin
// and out_dir/val.bin, uint32 tokens when the vocabulary exceeds 65,536 (data/shard.h).
TokenizeResult encode_corpus(const std::vector<std::string>& documents, const std::string& out_dir,
                             const DocumentEncoder& encoder, double val_fraction, uint64_t seed);

}  // namespace keel
