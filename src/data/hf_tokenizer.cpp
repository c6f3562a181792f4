#include "data/hf_tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>
#include <unicode/utext.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "core/fileio.h"

namespace keel {

namespace {

using nlohmann::json;

// GPT-2's pre-tokenizer pattern, as ByteLevel's use_regex runs it.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Length in bytes of the UTF-8 character starting at s[i] (s is valid UTF-8).
size_t char_length(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  return std::min(n, s.size() - i);
}

// GPT-2's map of bytes to printable characters: printable Latin-1 bytes stand for themselves, the
// others (controls, space, 0x7F-0xA0, 0xAD) for 256, 257, ... in byte order. As UTF-8 strings.
const std::array<std::string, 256>& byte_chars() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      append_utf8(t[b], printable ? b : next++);
    }
    return t;
  }();
  return table;
}

std::string clip(const json& j) {
  std::string s = j.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// Field `key` of object `o` for a message, clipped ("none" when absent). A message is built before
// the check that needs it decides: a const json's operator[] on a missing key is undefined.
std::string clip_field(const json& o, const char* key) { return o.contains(key) ? clip(o.at(key)) : "none"; }

// A compiled pattern of the file, run by ICU. \s and \S take Oniguruma's Unicode meaning.
class Pattern {
 public:
  Pattern(const std::string& pattern, bool literal, const std::string& where) {
    std::string p = pattern;
    if (!literal) {
      std::string out;
      for (size_t i = 0; i < p.size(); ++i) {
        if (p[i] == '\\' && i + 1 < p.size()) {
          if (p[i + 1] == 's') out += "\\p{White_Space}";
          else if (p[i + 1] == 'S') out += "\\P{White_Space}";
          else out += p.substr(i, 2);
          ++i;
        } else {
          out += p[i];
        }
      }
      p = out;
    }
    UErrorCode status = U_ZERO_ERROR;
    UParseError parse{};
    pattern_.reset(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(p), literal ? UREGEX_LITERAL : 0, parse, status));
    check(U_SUCCESS(status) && pattern_ != nullptr,
          where + ": pattern " + json(pattern).dump() + " does not compile (" + u_errorName(status) + ")");
  }
  // [begin, end) byte offsets of every non-empty match in s (valid UTF-8).
  std::vector<std::pair<size_t, size_t>> matches(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    UErrorCode status = U_ZERO_ERROR;
    UText* text = utext_openUTF8(nullptr, s.data(), static_cast<int64_t>(s.size()), &status);
    std::unique_ptr<icu::RegexMatcher> m(pattern_->matcher(status));
    check(U_SUCCESS(status), std::string("tokenizer: cannot run a pattern (") + u_errorName(status) + ")");
    m->reset(text);
    while (m->find(status) && U_SUCCESS(status)) {
      const auto b = static_cast<size_t>(m->start64(status)), e = static_cast<size_t>(m->end64(status));
      if (e > b) out.emplace_back(b, e);
    }
    m.reset();
    utext_close(text);
    check(U_SUCCESS(status), std::string("tokenizer: a pattern failed (") + u_errorName(status) + ")");
    return out;
  }

 private:
  std::unique_ptr<icu::RegexPattern> pattern_;
};

enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// Cuts s by the matches as the library's Split does for `behavior`: the pieces' [begin, end).
std::vector<std::pair<size_t, size_t>> split(const std::string& s, const std::vector<std::pair<size_t, size_t>>& found,
                                             Behavior behavior) {
  // (begin, end, is_match) covering s
  std::vector<std::tuple<size_t, size_t, bool>> parts;
  size_t at = 0;
  for (const auto& [b, e] : found) {
    if (b > at) parts.emplace_back(at, b, false);
    parts.emplace_back(b, e, true);
    at = e;
  }
  if (at < s.size()) parts.emplace_back(at, s.size(), false);
  std::vector<std::pair<size_t, size_t>> out;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::removed:
      for (const auto& [b, e, m] : parts) {
        if (!m) out.emplace_back(b, e);
      }
      break;
    case Behavior::isolated:
      for (const auto& [b, e, m] : parts) out.emplace_back(b, e);
      break;
    case Behavior::merged_with_previous:
      for (const auto& [b, e, m] : parts) {
        if (m && !previous_match && !out.empty()) out.back().second = e;
        else out.emplace_back(b, e);
        previous_match = m;
      }
      break;
    case Behavior::merged_with_next:
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        const auto& [b, e, m] = *it;
        if (m && !previous_match && !out.empty()) out.back().first = b;
        else out.emplace_back(b, e);
        previous_match = m;
      }
      std::reverse(out.begin(), out.end());
      break;
    case Behavior::contiguous:
      for (const auto& [b, e, m] : parts) {
        if (m == previous_match && !out.empty()) out.back().second = e;
        else out.emplace_back(b, e);
        previous_match = m;
      }
      break;
  }
  std::vector<std::pair<size_t, size_t>> pieces;
  for (const auto& [b, e] : out) {
    if (e > b) pieces.emplace_back(b, e);
  }
  return pieces;
}

// The code point of the UTF-8 character at s[i] (s valid UTF-8).
uint32_t code_point(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = char_length(s, i);
  uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

// The start of the UTF-8 character that ends at s[end - 1].
size_t previous_char(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// \s and \w of the library's (Rust) regex crate: White_Space; Alphabetic, marks, decimal digits,
// connector punctuation and the joiners.
bool is_space(uint32_t cp) { return u_hasBinaryProperty(static_cast<UChar32>(cp), UCHAR_WHITE_SPACE); }
bool is_word(uint32_t cp) {
  const auto c = static_cast<UChar32>(cp);
  const int8_t type = u_charType(c);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || type == U_NON_SPACING_MARK || type == U_ENCLOSING_MARK ||
         type == U_COMBINING_SPACING_MARK || type == U_DECIMAL_DIGIT_NUMBER || type == U_CONNECTOR_PUNCTUATION ||
         u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL);
}

struct Normalizer {
  enum class Kind { prepend, replace, unicode } kind;
  std::string a, b;                             // prepend: a; replace: a -> b
  const icu::Normalizer2* unicode = nullptr;  // NFC, NFD, NFKC, NFKD
};

struct PreTokenizer {
  enum class Kind { split, byte_level, metaspace } kind;
  std::shared_ptr<Pattern> pattern;  // split; byte_level with use_regex: GPT-2's
  Behavior behavior = Behavior::isolated;
  bool add_prefix_space = false;  // byte_level: a space before each piece that has none
  std::string replacement = {};   // metaspace: the character spaces become
  enum class Prepend { always, first, never } prepend = Prepend::always;  // metaspace
  bool split_pieces = true;  // metaspace: split before each replacement character
};

// An added token: matched in the text before the normalizer (normalized = false) or in the
// normalizer's output (its `pattern` then the normalized content), with the library's options.
struct AddedToken {
  std::string content, pattern;
  int id = 0;
  bool lstrip = false, rstrip = false, single_word = false, normalized = false, special = false;
};

struct Decoder {
  enum class Kind { byte_level, replace, byte_fallback, fuse, strip, metaspace } kind;
  std::string a = {}, b = {};  // replace: a -> b; strip: a (the character); metaspace: a (the replacement)
  int start = 0, stop = 0;  // strip
  bool prepend = false;     // metaspace
};

// Reads a pattern field {"String": s} or {"Regex": r}.
std::shared_ptr<Pattern> read_pattern(const json& p, const std::string& at) {
  check(p.is_object() && p.size() == 1 && (p.contains("String") || p.contains("Regex")) && p.begin()->is_string(),
        at + ": expected {\"String\": ...} or {\"Regex\": ...}, found " + clip(p));
  return std::make_shared<Pattern>(p.begin()->get<std::string>(), p.contains("String"), at);
}

std::string string_field(const json& j, const char* key, const std::string& at) {
  check(j.contains(key) && j[key].is_string(), at + "." + key + ": expected a string, found " +
                                                   (j.contains(key) ? clip(j[key]) : std::string("none")));
  return j[key].get<std::string>();
}

}  // namespace

struct HfTokenizer::Impl {
  std::string where;
  std::unordered_map<std::string, int> vocab;
  std::vector<std::string> id_token;  // id -> its string ("" where no token has the id)
  std::unordered_map<uint64_t, std::pair<int, int>> merges;  // packed (left, right) -> (rank, merged id)
  std::vector<AddedToken> added;                            // as the file lists them
  std::vector<const AddedToken*> raw_added, normalized_added;  // each longest pattern first
  std::string raw_first_bytes, normalized_first_bytes;        // bytes that may start one's pattern
  std::vector<bool> special;                                // id -> an added special token
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  bool byte_level = false;  // a ByteLevel pre-tokenizer maps bytes to characters
  std::vector<Decoder> decoders;
  bool has_decoder = false;
  int unk = -1;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  int document_token = -1;

  void read(const json& j);
  void read_normalizer(const json& n, const std::string& at);
  void read_pre_tokenizer(const json& p, const std::string& at);
  void read_decoder(const json& d, const std::string& at);
  void read_model(const json& m);
  void read_post_processor(const json& p);
  std::string normalize(const std::string& text) const;
  // The pieces of `text` (split by the added tokens of `tokens`): (id, -1 for text), [begin, end).
  std::vector<std::tuple<int, size_t, size_t>> find_added(const std::string& text, const std::vector<const AddedToken*>& tokens,
                                                          const std::string& first_bytes) const;
  // Pre-tokenizes and encodes a piece of normalized text; `first`: it starts the input.
  void encode_piece(const std::string& text, bool first, std::vector<int>& out) const;
  void bpe(const std::string& word, std::vector<int>& out) const;
};

void HfTokenizer::Impl::read_normalizer(const json& n, const std::string& at) {
  if (n.is_null()) return;
  const std::string type = string_field(n, "type", at);
  if (type == "Sequence") {
    check(n.contains("normalizers") && n["normalizers"].is_array(), at + ".normalizers: expected an array");
    for (size_t i = 0; i < n["normalizers"].size(); ++i) read_normalizer(n["normalizers"][i], at + ".normalizers[" + std::to_string(i) + "]");
  } else if (type == "Prepend") {
    normalizers.push_back({Normalizer::Kind::prepend, string_field(n, "prepend", at), ""});
  } else if (type == "Replace") {
    check(n.contains("pattern") && n["pattern"].is_object() && n["pattern"].contains("String") && n["pattern"]["String"].is_string(),
          at + ".pattern: expected {\"String\": ...} (a Regex pattern is not supported), found " +
              (n.contains("pattern") ? clip(n["pattern"]) : std::string("none")));
    const std::string from = n["pattern"]["String"].get<std::string>();
    check(!from.empty(), at + ".pattern: expected a non-empty string");
    normalizers.push_back({Normalizer::Kind::replace, from, string_field(n, "content", at)});
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* u = type == "NFC"    ? icu::Normalizer2::getNFCInstance(status)
                                : type == "NFD"  ? icu::Normalizer2::getNFDInstance(status)
                                : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(status)
                                                 : icu::Normalizer2::getNFKDInstance(status);
    check(U_SUCCESS(status), at + ": ICU has no " + type + " normalizer (" + u_errorName(status) + ")");
    normalizers.push_back({Normalizer::Kind::unicode, "", "", u});
  } else {
    throw Error(where + ": field " + at + ".type: expected Sequence, Prepend, Replace, NFC, NFD, NFKC or NFKD, found \"" +
                type + "\" (unsupported)");
  }
}

void HfTokenizer::Impl::read_pre_tokenizer(const json& p, const std::string& at) {
  if (p.is_null()) return;
  const std::string type = string_field(p, "type", at);
  if (type == "Sequence") {
    check(p.contains("pretokenizers") && p["pretokenizers"].is_array(), at + ".pretokenizers: expected an array");
    for (size_t i = 0; i < p["pretokenizers"].size(); ++i) {
      read_pre_tokenizer(p["pretokenizers"][i], at + ".pretokenizers[" + std::to_string(i) + "]");
    }
  } else if (type == "Split") {
    check(!p.value("invert", false), where + ": field " + at + ".invert: expected false (an inverted Split is not supported)");
    const std::string b = string_field(p, "behavior", at);
    const std::pair<const char*, Behavior> names[] = {{"Removed", Behavior::removed},
                                                      {"Isolated", Behavior::isolated},
                                                      {"MergedWithPrevious", Behavior::merged_with_previous},
                                                      {"MergedWithNext", Behavior::merged_with_next},
                                                      {"Contiguous", Behavior::contiguous}};
    const auto it = std::find_if(std::begin(names), std::end(names), [&](const auto& n) { return b == n.first; });
    check(it != std::end(names), where + ": field " + at + ".behavior: expected Removed, Isolated, MergedWithPrevious, "
                                         "MergedWithNext or Contiguous, found \"" + b + "\"");
    check(p.contains("pattern"), where + ": field " + at + ".pattern: expected a pattern, found none");
    pre_tokenizers.push_back({PreTokenizer::Kind::split, read_pattern(p["pattern"], where + ": field " + at + ".pattern"), it->second});
  } else if (type == "ByteLevel") {
    PreTokenizer t{PreTokenizer::Kind::byte_level, nullptr};
    check(!p.contains("add_prefix_space") || p["add_prefix_space"].is_boolean(),
          where + ": field " + at + ".add_prefix_space: expected true or false, found " + clip_field(p, "add_prefix_space"));
    t.add_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) t.pattern = std::make_shared<Pattern>(kGpt2Pattern, false, where);
    pre_tokenizers.push_back(t);
    byte_level = true;
  } else if (type == "Metaspace") {
    PreTokenizer t{PreTokenizer::Kind::metaspace, nullptr};
    t.replacement = string_field(p, "replacement", where + ": field " + at);
    check(!t.replacement.empty() && utf8_replace_invalid(t.replacement) == t.replacement &&
              char_length(t.replacement, 0) == t.replacement.size(),
          where + ": field " + at + ".replacement: expected one character, found " + clip(p["replacement"]));
    const std::string scheme = p.contains("prepend_scheme") ? string_field(p, "prepend_scheme", where + ": field " + at) : "always";
    check(scheme == "always" || scheme == "first" || scheme == "never",
          where + ": field " + at + ".prepend_scheme: expected always, first or never, found \"" + scheme + "\"");
    t.prepend = scheme == "always" ? PreTokenizer::Prepend::always
                : scheme == "first" ? PreTokenizer::Prepend::first
                                    : PreTokenizer::Prepend::never;
    // (Older files: add_prefix_space = false is prepend_scheme never, as the library reads them.)
    if (p.contains("add_prefix_space") && p["add_prefix_space"] == false) {
      check(scheme == "never" || !p.contains("prepend_scheme"),
            where + ": field " + at + ".add_prefix_space: false does not match prepend_scheme \"" + scheme + "\"");
      t.prepend = PreTokenizer::Prepend::never;
    }
    check(!p.contains("split") || p["split"].is_null() || p["split"].is_boolean(),
          where + ": field " + at + ".split: expected true or false, found " + clip_field(p, "split"));
    t.split_pieces = p.contains("split") && p["split"].is_boolean() ? p["split"].get<bool>() : true;
    pre_tokenizers.push_back(t);
  } else {
    throw Error(where + ": field " + at + ".type: expected Sequence, Split, ByteLevel or Metaspace, found \"" + type +
                "\" (unsupported)");
  }
}

void HfTokenizer::Impl::read_decoder(const json& d, const std::string& at) {
  const std::string type = string_field(d, "type", at);
  if (type == "Sequence") {
    check(d.contains("decoders") && d["decoders"].is_array(), at + ".decoders: expected an array");
    for (size_t i = 0; i < d["decoders"].size(); ++i) read_decoder(d["decoders"][i], at + ".decoders[" + std::to_string(i) + "]");
  } else if (type == "ByteLevel") {
    decoders.push_back({Decoder::Kind::byte_level});
  } else if (type == "Replace") {
    check(d.contains("pattern") && d["pattern"].is_object() && d["pattern"].contains("String") && d["pattern"]["String"].is_string(),
          where + ": field " + at + ".pattern: expected {\"String\": ...}");
    decoders.push_back({Decoder::Kind::replace, d["pattern"]["String"].get<std::string>(), string_field(d, "content", at)});
    check(!decoders.back().a.empty(), where + ": field " + at + ".pattern: expected a non-empty string");
  } else if (type == "ByteFallback") {
    decoders.push_back({Decoder::Kind::byte_fallback});
  } else if (type == "Fuse") {
    decoders.push_back({Decoder::Kind::fuse});
  } else if (type == "Strip") {
    Decoder s{Decoder::Kind::strip, string_field(d, "content", at)};
    check(d.contains("start") && d["start"].is_number_unsigned() && d.contains("stop") && d["stop"].is_number_unsigned(),
          where + ": field " + at + ": expected non-negative start and stop");
    s.start = static_cast<int>(std::min<uint64_t>(d["start"].get<uint64_t>(), 1 << 20));
    s.stop = static_cast<int>(std::min<uint64_t>(d["stop"].get<uint64_t>(), 1 << 20));
    decoders.push_back(s);
  } else if (type == "Metaspace") {
    Decoder m{Decoder::Kind::metaspace, string_field(d, "replacement", at)};
    check(!m.a.empty(), where + ": field " + at + ".replacement: expected one character");
    m.prepend = d.value("prepend_scheme", std::string("always")) != "never" && d.value("add_prefix_space", true);
    decoders.push_back(m);
  } else {
    throw Error(where + ": field " + at + ".type: expected Sequence, ByteLevel, Replace, ByteFallback, Fuse, Strip or "
                "Metaspace, found \"" + type + "\" (unsupported)");
  }
}

void HfTokenizer::Impl::read_model(const json& m) {
  const std::string at = where + ": field model";
  check(m.is_object(), at + ": expected an object, found " + clip(m));
  const std::string type = m.value("type", std::string("BPE"));
  check(type == "BPE", at + ".type: expected \"BPE\", found \"" + type + "\" (unsupported model type)");
  check(!m.contains("dropout") || m["dropout"].is_null() || (m["dropout"].is_number() && m["dropout"].get<double>() == 0),
        at + ".dropout: expected null (dropout is for training), found " + clip_field(m, "dropout"));
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    check(!m.contains(key) || m[key].is_null() || m[key] == "", at + "." + key + ": expected null, found " + clip_field(m, key));
  }
  byte_fallback = m.value("byte_fallback", false);
  fuse_unk = m.value("fuse_unk", false);
  ignore_merges = m.value("ignore_merges", false);
  check(m.contains("vocab") && m["vocab"].is_object(), at + ".vocab: expected an object {token: id}");
  for (const auto& [token, id] : m["vocab"].items()) {
    check(id.is_number_unsigned() && id.get<uint64_t>() < (1u << 24),
          at + ".vocab." + token + ": expected an id in [0, 16777216), found " + clip(id));
    vocab[token] = static_cast<int>(id.get<uint64_t>());
  }
  if (m.contains("unk_token") && !m["unk_token"].is_null()) {
    const std::string u = string_field(m, "unk_token", "model");
    const auto it = vocab.find(u);
    check(it != vocab.end(), at + ".unk_token: \"" + u + "\" is not in the vocabulary");
    unk = it->second;
  }
  check(m.contains("merges") && m["merges"].is_array(), at + ".merges: expected an array");
  const json& merges_json = m["merges"];
  for (size_t rank = 0; rank < merges_json.size(); ++rank) {
    const json& e = merges_json[rank];
    std::string left, right;
    if (e.is_string()) {  // "left right"
      const std::string s = e.get<std::string>();
      const size_t space = s.find(' ');
      check(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
            at + ".merges[" + std::to_string(rank) + "]: expected \"left right\", found " + clip(e));
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else {
      check(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(),
            at + ".merges[" + std::to_string(rank) + "]: expected [left, right], found " + clip(e));
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    }
    const auto l = vocab.find(left), r = vocab.find(right), joined = vocab.find(left + right);
    check(l != vocab.end() && r != vocab.end() && joined != vocab.end(),
          at + ".merges[" + std::to_string(rank) + "]: " + clip(e) + " names a token not in the vocabulary");
    const uint64_t key = (static_cast<uint64_t>(l->second) << 32) | static_cast<uint32_t>(r->second);
    merges.emplace(key, std::make_pair(static_cast<int>(rank), joined->second));  // the first rank of a repeat counts
  }
}

void HfTokenizer::Impl::read_post_processor(const json& p) {
  if (p.is_null() || !p.is_object()) return;
  const std::string type = p.value("type", std::string());
  if (type == "Sequence" && p.contains("processors") && p["processors"].is_array()) {
    for (const json& q : p["processors"]) read_post_processor(q);
    return;
  }
  if (type != "TemplateProcessing" || !p.contains("single") || !p["single"].is_array() || p["single"].empty()) return;
  const json& first = p["single"][0];
  if (!first.is_object() || !first.contains("SpecialToken")) return;
  const json& name = first["SpecialToken"].value("id", json());
  check(name.is_string() && p.contains("special_tokens") && p["special_tokens"].contains(name.get<std::string>()),
        where + ": field post_processor.single[0]: a special token the post-processor's special_tokens does not define");
  const json& ids = p["special_tokens"][name.get<std::string>()].value("ids", json());
  check(ids.is_array() && ids.size() == 1 && ids[0].is_number_unsigned() && ids[0].get<uint64_t>() < id_token.size(),
        where + ": field post_processor.special_tokens." + name.get<std::string>() + ".ids: expected one id in the vocabulary");
  document_token = static_cast<int>(ids[0].get<uint64_t>());
}

void HfTokenizer::Impl::read(const json& j) {
  check(j.is_object(), where + ": expected a JSON object");
  check(j.contains("model"), where + ": field model: expected the tokenizer's model, found none");
  read_model(j["model"]);
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    check(j["added_tokens"].is_array(), where + ": field added_tokens: expected an array");
    for (size_t i = 0; i < j["added_tokens"].size(); ++i) {
      const json& t = j["added_tokens"][i];
      const std::string at = "added_tokens[" + std::to_string(i) + "]";
      check(t.is_object() && t.contains("id") && t["id"].is_number_unsigned() && t["id"].get<uint64_t>() < (1u << 24),
            where + ": field " + at + ".id: expected an id in [0, 16777216)");
      const std::string content = string_field(t, "content", where + ": field " + at);
      check(!content.empty(), where + ": field " + at + ".content: expected a non-empty string");
      AddedToken a;
      a.content = content;
      a.id = static_cast<int>(t["id"].get<uint64_t>());
      for (auto [flag, value] : {std::pair<const char*, bool*>{"lstrip", &a.lstrip}, {"rstrip", &a.rstrip},
                                 {"single_word", &a.single_word}, {"special", &a.special}, {"normalized", &a.normalized}}) {
        check(!t.contains(flag) || t[flag].is_boolean(),
              where + ": field " + at + "." + flag + ": expected true or false, found " + clip_field(t, flag));
      }
      a.lstrip = t.value("lstrip", false), a.rstrip = t.value("rstrip", false), a.single_word = t.value("single_word", false);
      a.special = t.value("special", false);
      a.normalized = t.value("normalized", !a.special);  // the library's default
      vocab.emplace(content, a.id);
      if (a.special) {
        if (special.size() <= static_cast<size_t>(a.id)) special.resize(a.id + 1);
        special[a.id] = true;
      }
      added.push_back(a);
    }
  }
  int size = 0;
  for (const auto& [token, id] : vocab) size = std::max(size, id + 1);
  id_token.assign(size, "");
  for (const auto& [token, id] : vocab) {
    if (id_token[id].empty()) id_token[id] = token;
  }
  special.resize(size);
  if (j.contains("normalizer")) read_normalizer(j["normalizer"], "normalizer");
  // A normalized added token is matched as the normalizer writes it, and decodes to that.
  for (AddedToken& a : added) {
    a.pattern = a.normalized ? normalize(a.content) : a.content;
    if (a.pattern.empty()) a.pattern = a.content;
    id_token[a.id] = a.pattern;
    (a.normalized ? normalized_added : raw_added).push_back(&a);
    std::string& first = a.normalized ? normalized_first_bytes : raw_first_bytes;
    if (first.find(a.pattern[0]) == std::string::npos) first += a.pattern[0];
  }
  // Longest first: among matches starting at one place, the longest wins.
  for (auto* list : {&raw_added, &normalized_added}) {
    std::stable_sort(list->begin(), list->end(), [](const AddedToken* a, const AddedToken* b) { return a->pattern.size() > b->pattern.size(); });
  }
  if (j.contains("pre_tokenizer")) read_pre_tokenizer(j["pre_tokenizer"], "pre_tokenizer");
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    read_decoder(j["decoder"], "decoder");
    has_decoder = true;
  }
  if (j.contains("post_processor")) read_post_processor(j["post_processor"]);
  if (document_token < 0) {
    for (const AddedToken& a : added) {
      if (a.content == "<|endoftext|>") document_token = a.id;
    }
  }
}

void HfTokenizer::Impl::bpe(const std::string& word, std::vector<int>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    const auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // The word's symbols: its characters as tokens (the library's merge_word, unknowns included).
  std::vector<int> ids;
  int pending_unk = -1;  // an unknown run not yet added (fused with the next unknown when fuse_unk)
  for (size_t i = 0; i < word.size();) {
    const size_t n = char_length(word, i);
    const std::string c = word.substr(i, n);
    i += n;
    const auto it = vocab.find(c);
    if (it != vocab.end()) {
      if (pending_unk >= 0) ids.push_back(pending_unk);
      pending_unk = -1;
      ids.push_back(it->second);
      continue;
    }
    if (byte_fallback) {
      std::vector<int> bytes;
      for (unsigned char b : c) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        const auto byte = vocab.find(name);
        if (byte == vocab.end()) break;
        bytes.push_back(byte->second);
      }
      if (bytes.size() == c.size()) {  // (a pending unknown run stays pending, as in the library)
        ids.insert(ids.end(), bytes.begin(), bytes.end());
        continue;
      }
    }
    if (unk >= 0) {
      if (pending_unk >= 0 && !fuse_unk) ids.push_back(pending_unk);
      pending_unk = unk;
    }
  }
  if (pending_unk >= 0) ids.push_back(pending_unk);

  // Merges, lowest rank first, leftmost among equal ranks; a linked list of the symbols.
  const int n = static_cast<int>(ids.size());
  std::vector<int> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  using Candidate = std::tuple<int, int, int>;  // rank, position, merged id
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  auto consider = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    const auto it = merges.find((static_cast<uint64_t>(ids[left]) << 32) | static_cast<uint32_t>(ids[next[left]]));
    if (it != merges.end()) queue.emplace(it->second.first, left, it->second.second);
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  while (!queue.empty()) {
    const auto [rank, left, merged] = queue.top();
    queue.pop();
    if (!alive[left] || next[left] < 0) continue;
    const auto it = merges.find((static_cast<uint64_t>(ids[left]) << 32) | static_cast<uint32_t>(ids[next[left]]));
    if (it == merges.end() || it->second.first != rank || it->second.second != merged) continue;  // stale
    const int right = next[left];
    ids[left] = merged;
    alive[right] = false;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    consider(prev[left]);
    consider(left);
  }
  for (int i = n > 0 ? 0 : -1; i >= 0; i = next[i]) out.push_back(ids[i]);
}

std::string HfTokenizer::Impl::normalize(const std::string& text) const {
  std::string s = text;
  for (const Normalizer& n : normalizers) {
    if (n.kind == Normalizer::Kind::prepend) {
      if (!s.empty()) s = n.a + s;
    } else if (n.kind == Normalizer::Kind::replace) {
      std::string r;
      for (size_t i = 0; i < s.size();) {
        if (s.compare(i, n.a.size(), n.a) == 0) {
          r += n.b;
          i += n.a.size();
        } else {
          r += s[i++];
        }
      }
      s = r;
    } else {
      UErrorCode status = U_ZERO_ERROR;
      const icu::UnicodeString u = n.unicode->normalize(icu::UnicodeString::fromUTF8(s), status);
      check(U_SUCCESS(status), where + ": normalization failed (" + u_errorName(status) + ")");
      s.clear();
      u.toUTF8String(s);
    }
  }
  return s;
}

std::vector<std::tuple<int, size_t, size_t>> HfTokenizer::Impl::find_added(const std::string& text,
                                                                           const std::vector<const AddedToken*>& tokens,
                                                                           const std::string& first_bytes) const {
  std::vector<std::tuple<int, size_t, size_t>> out;
  size_t from = 0;  // the end of the last piece
  // Leftmost-longest matches, each search starting where the last match (before its strips) ended.
  for (size_t i = 0; i < text.size();) {
    const AddedToken* a = nullptr;
    if (first_bytes.find(text[i]) != std::string::npos) {
      const auto it = std::find_if(tokens.begin(), tokens.end(),
                                   [&](const AddedToken* t) { return text.compare(i, t->pattern.size(), t->pattern) == 0; });
      if (it != tokens.end()) a = *it;
    }
    if (a == nullptr) {
      ++i;
      continue;
    }
    size_t start = i, stop = i + a->pattern.size();
    i = stop;
    if (a->single_word) {  // no word character touching either end
      const bool word_before = start > 0 && is_word(code_point(text, previous_char(text, start)));
      const bool word_after = stop < text.size() && is_word(code_point(text, stop));
      if (word_before || word_after) continue;
    }
    if (a->lstrip) {  // the whitespace before it, not taken by the last piece
      size_t b = start;
      while (b > 0 && is_space(code_point(text, previous_char(text, b)))) b = previous_char(text, b);
      start = std::max(b, from);
    }
    if (a->rstrip) {
      while (stop < text.size() && is_space(code_point(text, stop))) stop += char_length(text, stop);
    }
    if (from < start) out.emplace_back(-1, from, start);
    out.emplace_back(a->id, start, stop);
    from = stop;
  }
  if (from < text.size()) out.emplace_back(-1, from, text.size());
  return out;
}

void HfTokenizer::Impl::encode_piece(const std::string& text, bool first, std::vector<int>& out) const {
  std::vector<std::pair<std::string, bool>> pieces = {{text, first}};  // (piece, starts the input)
  for (const PreTokenizer& p : pre_tokenizers) {
    std::vector<std::pair<std::string, bool>> next;
    for (auto& [piece, starts] : pieces) {
      std::string s = piece;
      std::vector<std::pair<size_t, size_t>> parts;
      if (p.kind == PreTokenizer::Kind::metaspace) {
        std::string r;  // spaces as the replacement
        for (char c : s) {
          if (c == ' ') r += p.replacement;
          else r += c;
        }
        s = std::move(r);
        const bool prepend = p.prepend == PreTokenizer::Prepend::always || (p.prepend == PreTokenizer::Prepend::first && starts);
        if (prepend && s.compare(0, p.replacement.size(), p.replacement) != 0) s = p.replacement + s;
        if (p.split_pieces) {
          std::vector<std::pair<size_t, size_t>> found;
          for (size_t at = s.find(p.replacement); at != std::string::npos; at = s.find(p.replacement, at + p.replacement.size())) {
            found.emplace_back(at, at + p.replacement.size());
          }
          parts = split(s, found, Behavior::merged_with_next);
        } else if (!s.empty()) {
          parts = {{0, s.size()}};
        }
      } else {
        if (p.kind == PreTokenizer::Kind::byte_level && p.add_prefix_space && !s.empty() && s[0] != ' ') s = " " + s;
        if (p.pattern) {
          parts = split(s, p.pattern->matches(s), p.behavior);
        } else if (!s.empty()) {
          parts = {{0, s.size()}};
        }
      }
      for (const auto& [b, e] : parts) {
        std::string part = s.substr(b, e - b);
        if (p.kind == PreTokenizer::Kind::byte_level) {
          std::string mapped;
          for (unsigned char c : part) mapped += byte_chars()[c];
          part = std::move(mapped);
        }
        next.emplace_back(std::move(part), starts && b == 0);
      }
    }
    pieces = std::move(next);
  }
  for (const auto& [piece, starts] : pieces) bpe(piece, out);
}

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;
HfTokenizer::HfTokenizer(HfTokenizer&&) noexcept = default;
HfTokenizer& HfTokenizer::operator=(HfTokenizer&&) noexcept = default;

HfTokenizer HfTokenizer::parse(const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw Error(where + ": not valid JSON: " + what);
  }
  auto impl = std::make_unique<Impl>();
  impl->where = where;
  try {
    impl->read(j);
  } catch (const json::exception& e) {  // a field of an unexpected type the checks above did not foresee
    throw Error(where + ": " + e.what());
  }
  return HfTokenizer(std::move(impl));
}

HfTokenizer HfTokenizer::load(const std::string& path) { return parse(read_text_file(path), "tokenizer " + path); }

std::vector<int> HfTokenizer::encode(std::string_view raw) const {
  const Impl& t = *impl_;
  const std::string text = utf8_replace_invalid(raw);
  std::vector<int> out;
  // The added tokens matched in the text, then those matched in each other piece's normalized text.
  for (const auto& [id, b, e] : t.find_added(text, t.raw_added, t.raw_first_bytes)) {
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    const std::string normalized = t.normalize(text.substr(b, e - b));
    for (const auto& [id2, b2, e2] : t.find_added(normalized, t.normalized_added, t.normalized_first_bytes)) {
      if (id2 >= 0) out.push_back(id2);
      else t.encode_piece(normalized.substr(b2, e2 - b2), b == 0 && b2 == 0, out);
    }
  }
  return out;
}

std::string HfTokenizer::decode(const std::vector<int>& ids) const {
  const Impl& t = *impl_;
  std::vector<std::string> tokens;
  for (int id : ids) {
    check(id >= 0 && id < vocab_size() && !t.id_token[id].empty(),
          t.where + ": expected token ids of the vocabulary [0, " + std::to_string(vocab_size()) + "), found " + std::to_string(id));
    if (!t.special[id]) tokens.push_back(t.id_token[id]);  // special tokens skipped, as the library's default
  }
  if (!t.has_decoder) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i ? " " : "") + tokens[i];
    return joined;
  }
  for (const Decoder& d : t.decoders) {
    std::vector<std::string> next;
    switch (d.kind) {
      case Decoder::Kind::byte_level: {
        std::unordered_map<std::string, char> byte_of;
        for (int b = 0; b < 256; ++b) byte_of[byte_chars()[b]] = static_cast<char>(b);
        std::string joined;
        for (const std::string& token : tokens) {
          for (size_t i = 0; i < token.size();) {
            const size_t n = char_length(token, i);
            const auto it = byte_of.find(token.substr(i, n));
            joined += it != byte_of.end() ? std::string(1, it->second) : token.substr(i, n);
            i += n;
          }
        }
        next.push_back(joined);
        break;
      }
      case Decoder::Kind::replace:
        for (std::string token : tokens) {
          for (size_t at = token.find(d.a); at != std::string::npos; at = token.find(d.a, at + d.b.size())) {
            token.replace(at, d.a.size(), d.b);
          }
          next.push_back(token);
        }
        break;
      case Decoder::Kind::byte_fallback: {
        std::string bytes;
        auto flush = [&] {
          if (bytes.empty()) return;
          const std::string valid = utf8_replace_invalid(bytes);
          if (valid == bytes) {
            next.push_back(bytes);
          } else {
            for (size_t k = 0; k < bytes.size(); ++k) next.push_back("\xEF\xBF\xBD");
          }
          bytes.clear();
        };
        for (const std::string& token : tokens) {
          unsigned byte = 0;
          if (token.size() == 6 && token.compare(0, 3, "<0x") == 0 && token[5] == '>' &&
              std::sscanf(token.c_str() + 3, "%2X", &byte) == 1) {
            bytes += static_cast<char>(byte);
          } else {
            flush();
            next.push_back(token);
          }
        }
        flush();
        break;
      }
      case Decoder::Kind::fuse: {
        std::string joined;
        for (const std::string& token : tokens) joined += token;
        next.push_back(joined);
        break;
      }
      case Decoder::Kind::strip:
        for (std::string token : tokens) {
          for (int k = 0; k < d.start && token.compare(0, d.a.size(), d.a) == 0; ++k) token.erase(0, d.a.size());
          for (int k = 0; k < d.stop && token.size() >= d.a.size() &&
                          token.compare(token.size() - d.a.size(), d.a.size(), d.a) == 0;
               ++k) {
            token.erase(token.size() - d.a.size());
          }
          next.push_back(token);
        }
        break;
      case Decoder::Kind::metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          // Each replacement character is a space, in the first token none (with a prepend scheme).
          const std::string space = i == 0 && d.prepend ? "" : " ";
          std::string token = tokens[i];
          for (size_t at = token.find(d.a); at != std::string::npos; at = token.find(d.a, at + space.size())) {
            token.replace(at, d.a.size(), space);
          }
          next.push_back(token);
        }
        break;
    }
    tokens = std::move(next);
  }
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

int HfTokenizer::vocab_size() const { return static_cast<int>(impl_->id_token.size()); }

int HfTokenizer::document_token() const { return impl_->document_token; }

std::string utf8_replace_invalid(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c >= 0xE0 && c <= 0xEF) need = 2, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) need = 3, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    size_t n = 1;  // bytes of the longest valid prefix of a sequence starting at i
    while (n <= need && i + n < s.size()) {
      const unsigned char b = byte(i + n);
      const bool ok = n == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
      if (!ok) break;
      ++n;
    }
    if (need > 0 && n == need + 1) {
      out.append(s.substr(i, n));
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD for the maximal invalid subsequence
    }
    i += n;
  }
  return out;
}

}  // namespace keel
