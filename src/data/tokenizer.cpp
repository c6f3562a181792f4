#include "data/tokenizer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {
namespace {

constexpr uint32_t kLlmcTokenizerMagic = 20240328;
constexpr int kByteTokens = 256;
constexpr int kMaxBpeVocabSize = 65536;  // Keel's own BPE: ids fit the uint16 shards (tokenizer.json ones may be wider)

uint64_t pack_pair(int left, int right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Character classes of the pre-tokenizer, on bytes. UTF-8 lead and continuation bytes
// (>= 0x80) are letters, so a multi-byte character never splits from the word around it.
bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_letter(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

enum class CharClass { kLetter, kDigit, kOther, kSpace };
CharClass char_class(unsigned char c) {
  if (is_letter(c)) return CharClass::kLetter;
  if (is_digit(c)) return CharClass::kDigit;
  if (is_space(c)) return CharClass::kSpace;
  return CharClass::kOther;
}

// Length of the contraction ('s 't 'm 'd 're 've 'll) starting at text[i], or 0.
size_t contraction_length(std::string_view text, size_t i) {
  if (text[i] != '\'' || i + 1 >= text.size()) return 0;
  const char c1 = text[i + 1];
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (i + 2 >= text.size()) return 0;
  const char c2 = text[i + 2];
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}

// Calls emit(piece) for each GPT-2 pre-token of text, in order. Mirrors the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// whose alternatives are tried in that order at each position.
template <typename Emit>
void for_each_pretoken(std::string_view text, Emit&& emit) {
  const size_t n = text.size();
  auto u = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  size_t i = 0;
  while (i < n) {
    if (size_t len = contraction_length(text, i)) {
      emit(text.substr(i, len));
      i += len;
      continue;
    }
    size_t start = i;
    // A single space joins the run of letters, digits or other characters that follows it.
    if (u(i) == ' ' && i + 1 < n && !is_space(u(i + 1))) ++i;
    const CharClass cls = char_class(u(i));
    if (cls != CharClass::kSpace) {
      size_t end = i + 1;
      while (end < n && char_class(u(end)) == cls) ++end;
      emit(text.substr(start, end - start));
      i = end;
      continue;
    }
    size_t end = i + 1;
    while (end < n && is_space(u(end))) ++end;
    // \s+(?!\S): a run followed by a non-space gives up its last character, which then starts
    // the next pre-token (as " word" if it is a space, or alone otherwise).
    if (end < n && end - i >= 2) --end;
    emit(text.substr(i, end - i));
    i = end;
  }
}

// Error messages are one line; parser messages may quote the file's own newlines.
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

// --- BPE training state -------------------------------------------------------------------

// A distinct pre-token, its current tokens and how often it occurs in the documents.
struct TrainingWord {
  std::vector<int> tokens;
  int64_t count;
};

// A candidate merge in the priority queue. Entries go stale when a pair's count drops; the
// queue is checked against the live count when popped (counts never grow after a pair's
// newest token is created, so a stale entry only over-estimates and is re-queued).
struct PairCandidate {
  int64_t count;
  int left, right;
  // "Less" for std::priority_queue (a max-heap): lower count, then larger ids, pop last.
  bool operator<(const PairCandidate& o) const {
    if (count != o.count) return count < o.count;
    return std::tie(left, right) > std::tie(o.left, o.right);
  }
};

}  // namespace

std::vector<std::string_view> pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  for_each_pretoken(text, [&](std::string_view piece) { pieces.push_back(piece); });
  return pieces;
}

void Tokenizer::build_from_merges(int vocab_size) {
  token_bytes_.assign(vocab_size, std::string());
  for (int b = 0; b < kByteTokens; ++b) token_bytes_[b] = std::string(1, static_cast<char>(b));
  merged_token_.clear();
  merged_token_.reserve(merges_.size() * 2);
  for (size_t rank = 0; rank < merges_.size(); ++rank) {
    const auto [left, right] = merges_[rank];
    const int id = kByteTokens + static_cast<int>(rank);
    token_bytes_[id] = token_bytes_[left] + token_bytes_[right];
    merged_token_.emplace(pack_pair(left, right), id);
  }
  eot_token_ = vocab_size - 1;
  can_encode_ = true;
}

Tokenizer Tokenizer::train(const std::vector<std::string>& documents, int vocab_size, bool at_most) {
  check(vocab_size >= kByteTokens + 1 && vocab_size <= kMaxBpeVocabSize,
        "tokenizer training: expected vocab_size in [257, 65536], found " + std::to_string(vocab_size));
  const int merges_wanted = vocab_size - kByteTokens - 1;

  // Count distinct pre-tokens once; merges then work on these, weighted by count.
  std::unordered_map<std::string_view, int64_t> piece_counts;
  for (const std::string& doc : documents)
    for_each_pretoken(doc, [&](std::string_view piece) { ++piece_counts[piece]; });
  std::vector<std::pair<std::string_view, int64_t>> pieces(piece_counts.begin(), piece_counts.end());
  std::sort(pieces.begin(), pieces.end());  // fixed word order, independent of hashing
  piece_counts.clear();

  std::vector<TrainingWord> words;
  words.reserve(pieces.size());
  for (const auto& [piece, count] : pieces) {
    if (piece.size() < 2) continue;  // a single byte has no pairs to merge
    TrainingWord w{{}, count};
    w.tokens.reserve(piece.size());
    for (unsigned char c : piece) w.tokens.push_back(c);
    words.push_back(std::move(w));
  }

  // pair -> total count over words, and pair -> words that (may) contain it. The word lists
  // can hold stale or repeated entries; they are sorted, deduplicated and re-checked on use.
  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<uint64_t, std::vector<int>> pair_words;
  for (int w = 0; w < static_cast<int>(words.size()); ++w) {
    const auto& t = words[w].tokens;
    for (size_t i = 0; i + 1 < t.size(); ++i) {
      const uint64_t p = pack_pair(t[i], t[i + 1]);
      pair_counts[p] += words[w].count;
      auto& list = pair_words[p];
      if (list.empty() || list.back() != w) list.push_back(w);
    }
  }
  std::priority_queue<PairCandidate> queue;
  for (const auto& [p, count] : pair_counts)
    queue.push({count, static_cast<int>(p >> 32), static_cast<int>(p & 0xffffffffu)});

  Tokenizer tok;
  tok.merges_.reserve(merges_wanted);
  std::vector<int> merged;
  std::vector<uint64_t> grown_pairs;
  while (static_cast<int>(tok.merges_.size()) < merges_wanted) {
    if (queue.empty() && at_most) break;
    if (queue.empty())
      throw Error("tokenizer training: expected text with enough distinct pairs for " + std::to_string(merges_wanted) +
                  " merges (vocab_size " + std::to_string(vocab_size) + "), found only " +
                  std::to_string(tok.merges_.size()) + "; use more text or a smaller vocab_size");
    const PairCandidate top = queue.top();
    queue.pop();
    const uint64_t p = pack_pair(top.left, top.right);
    const auto it = pair_counts.find(p);
    const int64_t live = it == pair_counts.end() ? 0 : it->second;
    if (live != top.count) {
      if (live > 0) queue.push({live, top.left, top.right});
      continue;
    }

    const int a = top.left, b = top.right;
    const int z = kByteTokens + static_cast<int>(tok.merges_.size());
    tok.merges_.emplace_back(a, b);

    std::vector<int> affected = std::move(pair_words[p]);
    pair_words.erase(p);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    grown_pairs.clear();
    for (int w : affected) {
      std::vector<int>& t = words[w].tokens;
      const int64_t count = words[w].count;
      merged.clear();
      for (size_t i = 0; i < t.size(); ++i) {
        if (i + 1 < t.size() && t[i] == a && t[i + 1] == b) {
          merged.push_back(z);
          ++i;
        } else {
          merged.push_back(t[i]);
        }
      }
      if (merged.size() == t.size()) continue;  // stale entry: the pair is gone from this word
      // Replace the word's pair contributions wholesale; only pairs with z can grow.
      for (size_t i = 0; i + 1 < t.size(); ++i) pair_counts[pack_pair(t[i], t[i + 1])] -= count;
      for (size_t i = 0; i + 1 < merged.size(); ++i) {
        const uint64_t q = pack_pair(merged[i], merged[i + 1]);
        pair_counts[q] += count;
        if (merged[i] == z || merged[i + 1] == z) {
          auto& list = pair_words[q];
          if (list.empty() || list.back() != w) list.push_back(w);
          grown_pairs.push_back(q);
        }
      }
      t.swap(merged);
    }
    pair_counts.erase(p);
    std::sort(grown_pairs.begin(), grown_pairs.end());
    grown_pairs.erase(std::unique(grown_pairs.begin(), grown_pairs.end()), grown_pairs.end());
    for (uint64_t q : grown_pairs)
      queue.push({pair_counts[q], static_cast<int>(q >> 32), static_cast<int>(q & 0xffffffffu)});
  }

  tok.build_from_merges(kByteTokens + static_cast<int>(tok.merges_.size()) + 1);
  tok.origin_ = "trained tokenizer";
  return tok;
}

Tokenizer Tokenizer::load(const std::string& path) {
  const std::string bytes = read_text_file(path);
  const std::string where = "tokenizer " + path;
  Tokenizer tok;
  tok.origin_ = where;

  const size_t first = bytes.find_first_not_of(" \t\r\n");
  const bool looks_like_json = first != std::string::npos && bytes[first] == '{';
  if (!looks_like_json && load_llama2c(bytes, where, tok)) return tok;
  if (!looks_like_json) {
    // llm.c binary tokenizer.
    constexpr size_t kHeaderBytes = 256 * sizeof(uint32_t);
    check(bytes.size() >= kHeaderBytes, where + ": expected Keel JSON, llama2.c's tokenizer.bin or an llm.c tokenizer with a " +
                                            std::to_string(kHeaderBytes) + "-byte header, found a " +
                                            std::to_string(bytes.size()) + "-byte file");
    uint32_t header[256];
    std::memcpy(header, bytes.data(), kHeaderBytes);
    check(header[0] == kLlmcTokenizerMagic, where + ": expected Keel JSON, llama2.c's tokenizer.bin or llm.c magic " +
                                                std::to_string(kLlmcTokenizerMagic) + ", found magic " +
                                                std::to_string(header[0]));
    check(header[1] == 1 || header[1] == 2,
          where + ": expected llm.c tokenizer version 1 or 2, found " + std::to_string(header[1]));
    const uint32_t vocab_size = header[2];
    const uint32_t eot = header[1] == 1 ? 50256 : header[3];
    check(vocab_size >= 1 && vocab_size <= static_cast<uint32_t>(kMaxBpeVocabSize),
          where + ": expected vocab size in [1, 65536], found " + std::to_string(vocab_size));
    check(eot < vocab_size, where + ": expected end-of-text token below vocab size " + std::to_string(vocab_size) +
                                ", found " + std::to_string(eot));
    tok.token_bytes_.resize(vocab_size);
    size_t pos = kHeaderBytes;
    for (uint32_t id = 0; id < vocab_size; ++id) {
      if (pos >= bytes.size())
        throw Error(where + ": truncated: expected " + std::to_string(vocab_size) + " tokens, file ends at token " +
                    std::to_string(id));
      const size_t length = static_cast<unsigned char>(bytes[pos++]);
      if (pos + length > bytes.size())
        throw Error(where + ": truncated: token " + std::to_string(id) + " needs " + std::to_string(length) +
                    " bytes, file has " + std::to_string(bytes.size() - pos) + " left");
      tok.token_bytes_[id] = bytes.substr(pos, length);
      pos += length;
    }
    check(pos == bytes.size(), where + ": expected " + std::to_string(pos) + " bytes for " +
                                   std::to_string(vocab_size) + " tokens, found " + std::to_string(bytes.size()) +
                                   " (trailing bytes)");
    tok.token_bytes_[eot].clear();  // eot decodes to "", as for Keel tokenizers
    tok.eot_token_ = static_cast<int>(eot);
    tok.can_encode_ = false;
    return tok;
  }

  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes);
  } catch (const nlohmann::json::exception& e) {
    throw Error(where + ": invalid JSON: " + one_line(e.what()));
  }
  check(j.is_object(), where + ": expected a JSON object, found " + std::string(j.type_name()));
  auto field = [&](const char* key) -> const nlohmann::json& {
    check(j.contains(key), where + ": expected field \"" + key + "\", found none");
    return j.at(key);
  };
  const auto& format = field("format");
  check(format.is_string() && format.get<std::string>() == "keel-bpe",
        where + ": expected format \"keel-bpe\", found " + one_line(format.dump()));
  const auto& version = field("version");
  check(version.is_number_integer() && version.get<int64_t>() == 1,
        where + ": expected version 1, found " + one_line(version.dump()));
  const auto& vocab_json = field("vocab_size");
  check(vocab_json.is_number_integer() && vocab_json.get<int64_t>() >= kByteTokens + 1 &&
            vocab_json.get<int64_t>() <= kMaxBpeVocabSize,
        where + ": expected vocab_size in [257, 65536], found " + one_line(vocab_json.dump()));
  const int vocab_size = static_cast<int>(vocab_json.get<int64_t>());
  const auto& eot_json = field("eot");
  check(eot_json.is_number_integer() && eot_json.get<int64_t>() == vocab_size - 1,
        where + ": expected eot " + std::to_string(vocab_size - 1) + " (vocab_size - 1), found " +
            one_line(eot_json.dump()));
  const auto& merges_json = field("merges");
  const size_t merges_wanted = static_cast<size_t>(vocab_size - kByteTokens - 1);
  check(merges_json.is_array() && merges_json.size() == merges_wanted,
        where + ": expected \"merges\" to be an array of " + std::to_string(merges_wanted) +
            " pairs (vocab_size - 257), found " +
            (merges_json.is_array() ? std::to_string(merges_json.size()) + " entries"
                                    : std::string(merges_json.type_name())));
  std::unordered_map<uint64_t, size_t> seen;
  for (size_t rank = 0; rank < merges_wanted; ++rank) {
    const auto& m = merges_json[rank];
    const int64_t limit = kByteTokens + static_cast<int64_t>(rank);  // only earlier tokens
    const bool ok = m.is_array() && m.size() == 2 && m[0].is_number_integer() && m[1].is_number_integer() &&
                    m[0].get<int64_t>() >= 0 && m[0].get<int64_t>() < limit && m[1].get<int64_t>() >= 0 &&
                    m[1].get<int64_t>() < limit;
    if (!ok)
      throw Error(where + ": merge " + std::to_string(rank) + ": expected [left, right] with ids in [0, " +
                  std::to_string(limit) + "), found " + one_line(m.dump()));
    const int left = static_cast<int>(m[0].get<int64_t>());
    const int right = static_cast<int>(m[1].get<int64_t>());
    const auto [it, fresh] = seen.emplace(pack_pair(left, right), rank);
    if (!fresh)
      throw Error(where + ": merge " + std::to_string(rank) + ": expected a new pair, found a repeat of merge " +
                  std::to_string(it->second));
    tok.merges_.emplace_back(left, right);
  }
  tok.build_from_merges(vocab_size);
  return tok;
}

void Tokenizer::save(const std::string& path) const {
  check(can_encode_, "tokenizer " + path + ": cannot save " + origin_ +
                         " in Keel format: it has no merges (llm.c tokenizers are decode-only)");
  // Hand-written rather than json::dump so each merge sits on its own line (diffable).
  std::ostringstream out;
  out << "{\"format\":\"keel-bpe\",\"version\":1,\"vocab_size\":" << vocab_size() << ",\"eot\":" << eot_token_
      << ",\"merges\":[";
  for (size_t i = 0; i < merges_.size(); ++i)
    out << (i ? ",\n" : "\n") << '[' << merges_[i].first << ',' << merges_[i].second << ']';
  out << "\n]}\n";
  const std::string text = out.str();
  write_file_atomic(path, {ByteRange{text.data(), text.size()}});
}

void Tokenizer::encode_pretoken(std::string_view piece, std::vector<int>& out) const {
  const size_t start = out.size();
  for (unsigned char c : piece) out.push_back(c);
  // Repeatedly merge the lowest-ranked (= lowest new id) pair present. A merge only creates
  // pairs of higher rank, so this equals applying every merge in rank order.
  while (out.size() - start >= 2) {
    int best = -1;
    for (size_t i = start; i + 1 < out.size(); ++i) {
      const auto it = merged_token_.find(pack_pair(out[i], out[i + 1]));
      if (it != merged_token_.end() && (best < 0 || it->second < best)) best = it->second;
    }
    if (best < 0) break;
    const auto [a, b] = merges_[best - kByteTokens];
    size_t write = start;
    for (size_t read = start; read < out.size(); ++read) {
      if (read + 1 < out.size() && out[read] == a && out[read + 1] == b) {
        out[write++] = best;
        ++read;
      } else {
        out[write++] = out[read];
      }
    }
    out.resize(write);
  }
}

std::vector<int> Tokenizer::encode(std::string_view text) const {
  check(can_encode_, origin_ + " cannot encode: it has no merges (llm.c tokenizers are decode-only)");
  if (!scores_.empty()) return encode_scored(text);
  std::vector<int> ids;
  ids.reserve(text.size() / 3 + 16);
  // Text repeats its words; caching each distinct pre-token's ids makes encoding several
  // times faster. The cache is per call so encode stays const and thread-safe.
  std::unordered_map<std::string_view, std::pair<size_t, size_t>> cache;  // -> (offset, length) in ids
  for_each_pretoken(text, [&](std::string_view piece) {
    const auto it = cache.find(piece);
    const size_t start = ids.size();
    if (it != cache.end()) {
      const auto [offset, length] = it->second;
      for (size_t k = 0; k < length; ++k) ids.push_back(ids[offset + k]);
      return;
    }
    encode_pretoken(piece, ids);
    cache.emplace(piece, std::make_pair(start, ids.size() - start));
  });
  return ids;
}

bool Tokenizer::load_llama2c(const std::string& bytes, const std::string& where, Tokenizer& tok) {
  // No magic: the file is one if it parses exactly, to its last byte, with sane lengths.
  if (bytes.size() < 4) return false;
  int32_t max_len = 0;
  std::memcpy(&max_len, bytes.data(), 4);
  if (max_len < 1 || max_len > 4096) return false;
  std::vector<std::string> pieces;
  std::vector<float> scores;
  size_t pos = 4;
  while (pos < bytes.size()) {
    if (pos + 8 > bytes.size()) return false;
    float score = 0;
    int32_t len = 0;
    std::memcpy(&score, bytes.data() + pos, 4);
    std::memcpy(&len, bytes.data() + pos + 4, 4);
    pos += 8;
    if (len < 0 || len > max_len || pos + static_cast<size_t>(len) > bytes.size() || !std::isfinite(score)) return false;
    pieces.emplace_back(bytes.substr(pos, static_cast<size_t>(len)));
    scores.push_back(score);
    pos += static_cast<size_t>(len);
  }
  if (pieces.size() < 3 || pieces.size() > static_cast<size_t>(kMaxBpeVocabSize)) return false;
  tok.token_bytes_.assign(pieces.size(), "");
  tok.piece_id_.clear();
  for (size_t id = 0; id < pieces.size(); ++id) {
    const std::string& p = pieces[id];
    // SentencePiece's byte tokens "<0xXX>" stand for that byte.
    unsigned byte = 0;
    if (p.size() == 6 && p.compare(0, 3, "<0x") == 0 && p[5] == '>' && std::sscanf(p.c_str() + 3, "%2X", &byte) == 1) {
      tok.token_bytes_[id] = std::string(1, static_cast<char>(byte));
    } else if ((id == 1 && p == "<s>") || (id == 2 && p == "</s>")) {
      tok.token_bytes_[id] = "";  // control tokens decode to nothing, as Keel's end-of-text does
    } else {
      tok.token_bytes_[id] = p;
    }
    tok.piece_id_.emplace(p, static_cast<int>(id));  // the first of equal pieces, as run.c's sorted lookup may find
  }
  tok.scores_ = std::move(scores);
  tok.pieces_ = std::move(pieces);
  tok.eot_token_ = 1;  // <s>: llama2.c puts it before every document
  tok.can_encode_ = true;
  tok.origin_ = where;
  return true;
}

std::vector<int> Tokenizer::encode_scored(std::string_view text) const {
  std::vector<int> ids;
  if (text.empty()) return ids;
  const auto space = piece_id_.find(" ");
  if (space != piece_id_.end()) ids.push_back(space->second);  // run.c's dummy prefix
  for (size_t i = 0; i < text.size();) {
    // One UTF-8 character: a lead byte and its continuation bytes (at most 4 in all).
    size_t n = 1;
    while (i + n < text.size() && n < 4 && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) ++n;
    const auto it = piece_id_.find(std::string(text.substr(i, n)));
    if (it != piece_id_.end()) {
      ids.push_back(it->second);
    } else {
      for (size_t k = 0; k < n; ++k) {
        const int id = static_cast<unsigned char>(text[i + k]) + 3;  // SentencePiece's <0xXX> tokens
        check(id < vocab_size(), origin_ + ": cannot encode byte " + std::to_string(id - 3) + " (no byte token)");
        ids.push_back(id);
      }
    }
    i += n;
  }
  // Merge the adjacent pair of the highest score whose joined bytes are a token, until none is.
  for (;;) {
    float best = -1e30f;
    int best_id = -1;
    size_t best_at = 0;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const auto it = piece_id_.find(pieces_[ids[i]] + pieces_[ids[i + 1]]);  // run.c joins the pieces
      if (it != piece_id_.end() && scores_[it->second] > best) {
        best = scores_[it->second];
        best_id = it->second;
        best_at = i;
      }
    }
    if (best_id < 0) break;
    ids[best_at] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
  }
  return ids;
}

void Tokenizer::save_llama2c(const std::string& path) const {
  check(can_encode_ && scores_.empty(), origin_ + ": only a Keel BPE tokenizer is written as llama2.c's tokenizer.bin");
  size_t max_len = 1;
  for (const std::string& t : token_bytes_) max_len = std::max(max_len, t.size());
  std::string out(4, '\0');
  const int32_t m = static_cast<int32_t>(max_len);
  std::memcpy(out.data(), &m, 4);
  for (int id = 0; id < vocab_size(); ++id) {
    const float score = id < kByteTokens ? 0.0f : -static_cast<float>(id - kByteTokens);  // earlier merges first
    const int32_t len = static_cast<int32_t>(token_bytes_[id].size());
    out.append(reinterpret_cast<const char*>(&score), 4);
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += token_bytes_[id];
  }
  write_file_atomic(path, {ByteRange{out.data(), out.size()}});
}

std::string Tokenizer::decode_token(int id) const {
  check_token_id(id);
  return token_bytes_[id];
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    check_token_id(ids[i]);
    const std::string& piece = token_bytes_[ids[i]];
    // llama2.c vocabularies: a piece after <s> (token 1) drops its leading space, as run.c's decode.
    if (!scores_.empty() && i > 0 && ids[i - 1] == 1 && !piece.empty() && piece[0] == ' ') {
      text += piece.substr(1);
    } else {
      text += piece;
    }
  }
  return text;
}

void Tokenizer::check_token_id(int id) const {
  if (id < 0 || id >= vocab_size())
    throw Error(origin_ + ": expected token id in [0, " + std::to_string(vocab_size()) + "), found " +
                std::to_string(id));
}

}  // namespace keel
