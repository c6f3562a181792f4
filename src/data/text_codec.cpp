#include "data/text_codec.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/fileio.h"
#include "data/hf_tokenizer.h"
#include "data/tokenizer.h"

namespace keel {

struct TextCodec::Impl {
  std::optional<Tokenizer> keel;
  std::optional<HfTokenizer> hf;
};

namespace {

// A tokenizer.json: a JSON object with a "model" field (Keel's JSON has "format": "keel-bpe").
bool hf_text(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || text[first] != '{') return false;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("model");
}

}  // namespace

TextCodec::TextCodec(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TextCodec::~TextCodec() = default;
TextCodec::TextCodec(TextCodec&&) noexcept = default;
TextCodec& TextCodec::operator=(TextCodec&&) noexcept = default;

bool TextCodec::is_hf_tokenizer(const std::string& path) { return hf_text(read_text_file(path)); }

std::string TextCodec::choose_path(const std::string& data_tokenizer, const std::string& hf_dir) {
  std::error_code ec;
  if (!data_tokenizer.empty() && std::filesystem::is_regular_file(data_tokenizer, ec) && is_hf_tokenizer(data_tokenizer)) {
    return data_tokenizer;
  }
  if (!hf_dir.empty()) {
    const std::string own = (std::filesystem::path(hf_dir) / "tokenizer.json").string();
    if (std::filesystem::is_regular_file(own, ec)) return own;
  }
  return data_tokenizer;
}

TextCodec TextCodec::load(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  const std::string text = read_text_file(path);
  if (hf_text(text)) {
    impl->hf = HfTokenizer::parse(text, "tokenizer " + path);
  } else {
    impl->keel = Tokenizer::load(path);
  }
  return TextCodec(std::move(impl));
}

std::vector<int> TextCodec::encode(std::string_view text) const {
  return impl_->hf ? impl_->hf->encode(text) : impl_->keel->encode(text);
}

std::string TextCodec::decode(const std::vector<int>& ids) const {
  return impl_->hf ? impl_->hf->decode(ids) : impl_->keel->decode(ids);
}

int TextCodec::vocab_size() const { return impl_->hf ? impl_->hf->vocab_size() : impl_->keel->vocab_size(); }

int TextCodec::document_token() const {
  return impl_->hf ? impl_->hf->document_token() : impl_->keel->eot_token();
}

bool TextCodec::can_encode() const { return impl_->hf ? true : impl_->keel->can_encode(); }

bool TextCodec::is_hf() const { return impl_->hf.has_value(); }

}  // namespace keel
