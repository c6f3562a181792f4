#include "data/corpus.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <set>

#include "core/error.h"
#include "core/fileio.h"
#include "data/shard.h"
#include "data/tokenizer.h"

namespace keel {
namespace fs = std::filesystem;
namespace {

bool is_blank(std::string_view text) { return text.find_first_not_of(" \t\n\r\v\f") == std::string_view::npos; }

// Appends the documents of one file's text: one per fortune, or the whole text.
void append_documents(const std::string& text, std::vector<std::string>& documents) {
  auto add = [&](std::string_view doc) {
    if (!is_blank(doc)) documents.emplace_back(doc);
  };
  if (text.find("\n%\n") == std::string::npos) {
    add(text);
    return;
  }
  const std::string_view all(text);
  size_t doc_start = 0;
  size_t line_start = 0;
  while (line_start < all.size()) {
    size_t line_end = all.find('\n', line_start);
    if (line_end == std::string_view::npos) line_end = all.size();
    if (all.substr(line_start, line_end - line_start) == "%") {
      add(all.substr(doc_start, line_start - doc_start));  // keeps the fortune's last newline
      doc_start = std::min(line_end + 1, all.size());
    }
    line_start = line_end + 1;
  }
  add(all.substr(doc_start));
}

bool skipped_by_name(const std::string& name) {
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // fortune's index files (.dat) and UTF-8 alias links (.u8) are not text to train on.
  return ends_with(".dat") || ends_with(".u8");
}

// The files a directory argument stands for, sorted by name. `included` holds the canonical
// paths of files taken so far (across all arguments) and is updated.
std::vector<fs::path> files_in_directory(const fs::path& dir, std::set<fs::path>& included) {
  std::error_code ec;
  std::vector<fs::directory_entry> entries;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
  check(!ec, "corpus directory " + dir.string() + ": cannot list (" + ec.message() + ")");
  std::sort(entries.begin(), entries.end(),
            [](const auto& x, const auto& y) { return x.path().filename() < y.path().filename(); });

  // Note regular files first, so a symlink to a file later in name order is still recognised.
  struct Candidate {
    fs::path path, target;
    bool symlink;
  };
  std::vector<Candidate> candidates;
  for (const auto& entry : entries) {
    if (skipped_by_name(entry.path().filename().string()) || !entry.is_regular_file(ec)) continue;
    Candidate c{entry.path(), fs::weakly_canonical(entry.path(), ec), entry.is_symlink(ec)};
    if (!c.symlink) included.insert(c.target);
    candidates.push_back(std::move(c));
  }
  std::vector<fs::path> files;
  for (const Candidate& c : candidates) {
    if (c.symlink && !included.insert(c.target).second) continue;  // target already read
    files.push_back(c.path);
  }
  check(!files.empty(), "corpus directory " + dir.string() + ": expected text files, found none");
  return files;
}

// Maps (index, seed) to a uniform double in [0, 1); splitmix64's finaliser.
double split_hash(uint64_t index, uint64_t seed) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

}  // namespace

std::vector<std::string> read_documents(const std::vector<std::string>& paths) {
  std::vector<std::string> documents;
  std::set<fs::path> included;
  for (const std::string& arg : paths) {
    std::error_code ec;
    const fs::path path(arg);
    const auto status = fs::status(path, ec);
    check(fs::exists(status), "corpus path " + arg + ": expected a file or directory, found none");
    if (fs::is_directory(status)) {
      for (const fs::path& file : files_in_directory(path, included)) append_documents(read_text_file(file.string()), documents);
    } else {
      included.insert(fs::weakly_canonical(path, ec));
      append_documents(read_text_file(path), documents);
    }
  }
  return documents;
}

namespace {

// Which documents go to validation: those whose hash of (index, seed) falls below val_fraction;
// each split gets at least one.
std::vector<char> validation_documents(size_t n, double val_fraction, uint64_t seed) {
  check(n >= 2, "corpus: expected at least 2 documents (one per split), found " + std::to_string(n));
  check(val_fraction > 0.0 && val_fraction < 1.0,
        "corpus: expected val_fraction in (0, 1), found " + std::to_string(val_fraction));
  // Split by document, so no document straddles train and validation.
  std::vector<double> u(n);
  std::vector<char> is_val(n);
  size_t val_count = 0;
  for (size_t i = 0; i < n; ++i) {
    u[i] = split_hash(i, seed);
    is_val[i] = u[i] < val_fraction;
    val_count += is_val[i];
  }
  if (val_count == 0) is_val[std::min_element(u.begin(), u.end()) - u.begin()] = 1;
  if (val_count == n) is_val[std::max_element(u.begin(), u.end()) - u.begin()] = 0;
  return is_val;
}

// Encodes every document as [document_token, ids...] into its split and writes out_dir/train.bin
// and out_dir/val.bin (creating out_dir).
TokenizeResult write_splits(const std::vector<std::string>& documents, const std::vector<char>& is_val,
                            const std::string& out_dir, const DocumentEncoder& encoder) {
  const size_t n = documents.size();
  std::vector<std::vector<int>> encoded(n);
#pragma omp parallel for schedule(dynamic, 64)
  for (size_t i = 0; i < n; ++i) encoded[i] = encoder.encode(documents[i]);

  std::vector<uint32_t> train_tokens, val_tokens;
  for (size_t i = 0; i < n; ++i) {
    std::vector<uint32_t>& out = is_val[i] ? val_tokens : train_tokens;
    out.push_back(static_cast<uint32_t>(encoder.document_token));
    for (int id : encoded[i]) out.push_back(static_cast<uint32_t>(id));
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  check(!ec, "corpus output directory " + out_dir + ": cannot create (" + ec.message() + ")");
  const fs::path dir(out_dir);
  write_tokens((dir / "train.bin").string(), train_tokens, encoder.vocab_size);
  write_tokens((dir / "val.bin").string(), val_tokens, encoder.vocab_size);
  return {train_tokens.size(), val_tokens.size(), n, encoder.vocab_size};
}

}  // namespace

TokenizeResult tokenize_corpus(const std::vector<std::string>& documents, const std::string& out_dir, int vocab_size,
                               double val_fraction, uint64_t seed) {
  const std::vector<char> is_val = validation_documents(documents.size(), val_fraction, seed);
  // The tokenizer sees only training text, so validation loss measures unseen text.
  std::vector<std::string> train_documents;
  for (size_t i = 0; i < documents.size(); ++i)
    if (!is_val[i]) train_documents.push_back(documents[i]);
  const Tokenizer tokenizer = Tokenizer::train(train_documents, vocab_size);
  train_documents.clear();
  const DocumentEncoder encoder{[&](std::string_view text) { return tokenizer.encode(text); }, tokenizer.eot_token(),
                                tokenizer.vocab_size()};
  const TokenizeResult result = write_splits(documents, is_val, out_dir, encoder);
  tokenizer.save((fs::path(out_dir) / "tokenizer.json").string());
  return result;
}

TokenizeResult encode_corpus(const std::vector<std::string>& documents, const std::string& out_dir,
                             const DocumentEncoder& encoder, double val_fraction, uint64_t seed) {
  return write_splits(documents, validation_documents(documents.size(), val_fraction, seed), out_dir, encoder);
}

}  // namespace keel
