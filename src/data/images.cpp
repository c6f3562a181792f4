#include "data/images.h"

#include "data/tokenizer.h"

#include <jpeglib.h>
#include <png.h>
#include <xxhash.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fileio.h"
#include "core/text.h"

namespace keel {

namespace fs = std::filesystem;

namespace {

constexpr int kMaxSide = 16384;
constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'I', 'M', 'G', '1'};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

Rgba decode_png(const std::string& path) {
  const FileStream file = open_regular_stream(path, "image");
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_stdio(&image, file.get())) {
    throw Error("image " + path + ": not a readable PNG (" + image.message + ")");
  }
  image.format = PNG_FORMAT_RGBA;
  if (image.width < 1 || image.height < 1 || image.width > kMaxSide || image.height > kMaxSide) {
    const std::string size = std::to_string(image.width) + " x " + std::to_string(image.height);
    png_image_free(&image);
    throw Error("image " + path + ": " + size + " pixels (expected 1.." + std::to_string(kMaxSide) + " a side)");
  }
  Rgba out;
  out.width = static_cast<int>(image.width), out.height = static_cast<int>(image.height);
  out.pixels.resize(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, out.pixels.data(), 0, nullptr)) {
    const std::string why = image.message;
    png_image_free(&image);
    throw Error("image " + path + ": corrupt PNG (" + why + ")");
  }
  return out;
}

struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
};

void jpeg_fail(j_common_ptr info) {
  JpegError* e = reinterpret_cast<JpegError*>(info->err);
  (*info->err->format_message)(info, e->message);
  std::longjmp(e->jump, 1);
}

// libjpeg's warnings are damaged data it decodes around (a file cut short is padded with grey,
// bytes between markers are skipped): an image with one is corrupt, like one with an error.
void jpeg_message(j_common_ptr info, int level) {
  if (level < 0) jpeg_fail(info);
}

Rgba decode_jpeg(const std::string& path) {
  const FileStream file = open_regular_stream(path, "image");
  jpeg_decompress_struct info;
  JpegError err;
  info.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_message;  // (trace messages, level >= 0, are not printed)
  Rgba out;
  std::vector<uint8_t> row;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&info);
    throw Error("image " + path + ": corrupt JPEG (" + err.message + ")");
  }
  jpeg_create_decompress(&info);
  jpeg_stdio_src(&info, file.get());
  jpeg_read_header(&info, TRUE);
  info.out_color_space = JCS_RGB;
  if (info.image_width < 1 || info.image_height < 1 || info.image_width > kMaxSide || info.image_height > kMaxSide) {
    const std::string size = std::to_string(info.image_width) + " x " + std::to_string(info.image_height);
    jpeg_destroy_decompress(&info);
    throw Error("image " + path + ": " + size + " pixels (expected 1.." + std::to_string(kMaxSide) + " a side)");
  }
  jpeg_start_decompress(&info);
  out.width = static_cast<int>(info.output_width), out.height = static_cast<int>(info.output_height);
  out.pixels.resize(static_cast<size_t>(out.width) * out.height * 4);
  row.resize(static_cast<size_t>(out.width) * info.output_components);
  while (info.output_scanline < info.output_height) {
    const int y = static_cast<int>(info.output_scanline);
    JSAMPROW rows[1] = {row.data()};
    jpeg_read_scanlines(&info, rows, 1);
    for (int x = 0; x < out.width; ++x) {
      uint8_t* p = &out.pixels[(static_cast<size_t>(y) * out.width + x) * 4];
      for (int c = 0; c < 3; ++c) p[c] = row[static_cast<size_t>(x) * info.output_components + (info.output_components == 3 ? c : 0)];
      p[3] = 255;
    }
  }
  jpeg_finish_decompress(&info);
  jpeg_destroy_decompress(&info);
  return out;
}

// Weights of a 1-D resample from `in` samples to `out`: for each output sample, the input samples
// it covers and their weights (summing to 1). Box filter when shrinking; linear when enlarging.
struct Tap {
  int first = 0;
  std::vector<float> weights;
};
std::vector<Tap> resample_taps(int in, int out) {
  std::vector<Tap> taps(static_cast<size_t>(out));
  const double scale = static_cast<double>(in) / out;
  for (int o = 0; o < out; ++o) {
    Tap& t = taps[static_cast<size_t>(o)];
    if (scale >= 1) {
      const double lo = o * scale, hi = (o + 1) * scale;
      t.first = static_cast<int>(lo);
      for (int i = t.first; i < in && i < hi; ++i) {
        const double w = std::min<double>(hi, i + 1) - std::max<double>(lo, i);
        t.weights.push_back(static_cast<float>(w / scale));
      }
    } else {
      const double centre = (o + 0.5) * scale - 0.5;
      const int i0 = std::clamp(static_cast<int>(std::floor(centre)), 0, in - 1);
      const int i1 = std::min(i0 + 1, in - 1);
      const double f = std::clamp(centre - i0, 0.0, 1.0);
      t.first = i0;
      if (i1 == i0) {
        t.weights = {1.0f};  // at an edge: the edge sample
      } else {
        t.weights = {static_cast<float>(1 - f), static_cast<float>(f)};
      }
    }
  }
  return taps;
}

// A file name's bytes as text: each byte that is not part of valid UTF-8 becomes U+FFFD. (Names
// are bytes on Linux; captions are text to tokenize, and the dataset's files are JSON.)
std::string utf8_text(const std::string& name) {
  using nlohmann::json;
  return json::parse(json(name).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

// A name's words: '-', '_' and '.' as spaces, one space between words.
std::string caption_words(const std::string& stem) {
  std::string out;
  for (char c : stem) {
    const bool space = c == '-' || c == '_' || c == '.' || c == ' ';
    if (space && (out.empty() || out.back() == ' ')) continue;
    out += space ? ' ' : c;
  }
  return trim(out);
}

struct Found {
  std::string caption, category, source;  // source: path below the source directory
  int width = 0, height = 0;               // before resizing
  std::vector<uint8_t> rgb;                // size x size x 3
};

void write_split(const std::string& dir, const std::string& split, const std::vector<const Found*>& records, int size) {
  std::string header(32, '\0');
  std::memcpy(header.data(), kMagic, 8);
  const uint32_t fields[6] = {1, static_cast<uint32_t>(records.size()), static_cast<uint32_t>(size),
                              static_cast<uint32_t>(size), 3, 0};
  std::memcpy(header.data() + 8, fields, sizeof fields);
  std::string body = header;
  std::string lines;
  for (size_t i = 0; i < records.size(); ++i) {
    body.append(reinterpret_cast<const char*>(records[i]->rgb.data()), records[i]->rgb.size());
    const nlohmann::json j = {{"caption", records[i]->caption}, {"category", records[i]->category},
                              {"source", records[i]->source}, {"width", records[i]->width}, {"height", records[i]->height}};
    lines += j.dump() + "\n";
  }
  write_file_atomic(dir + "/" + split + ".img", {ByteRange{body.data(), body.size()}});
  write_file_atomic(dir + "/" + split + ".jsonl", {ByteRange{lines.data(), lines.size()}});
}

}  // namespace

Rgba decode_image(const std::string& path) {
  const std::string ext = lower(fs::path(path).extension().string());
  if (ext == ".png") return decode_png(path);
  if (ext == ".jpg" || ext == ".jpeg") return decode_jpeg(path);
  throw Error("image " + path + ": expected a .png, .jpg or .jpeg file");
}

std::vector<uint8_t> square_rgb(const Rgba& image, int size) {
  check(size >= 1 && size <= 4096, "image size: expected 1..4096, found " + std::to_string(size));
  // Over white, as floats.
  const int side = std::min(image.width, image.height);
  const int x0 = (image.width - side) / 2, y0 = (image.height - side) / 2;
  std::vector<float> rgb(static_cast<size_t>(side) * side * 3);
  for (int y = 0; y < side; ++y) {
    for (int x = 0; x < side; ++x) {
      const uint8_t* p = &image.pixels[(static_cast<size_t>(y + y0) * image.width + (x + x0)) * 4];
      const float a = p[3] / 255.0f;
      for (int c = 0; c < 3; ++c) rgb[(static_cast<size_t>(y) * side + x) * 3 + c] = p[c] * a + 255.0f * (1 - a);
    }
  }
  const std::vector<Tap> taps = resample_taps(side, size);
  // Rows first (side x size), then columns (size x size).
  std::vector<float> wide(static_cast<size_t>(side) * size * 3, 0.0f);
  for (int y = 0; y < side; ++y) {
    for (int o = 0; o < size; ++o) {
      const Tap& t = taps[static_cast<size_t>(o)];
      for (size_t k = 0; k < t.weights.size(); ++k) {
        for (int c = 0; c < 3; ++c) {
          wide[(static_cast<size_t>(y) * size + o) * 3 + c] += t.weights[k] * rgb[(static_cast<size_t>(y) * side + t.first + k) * 3 + c];
        }
      }
    }
  }
  std::vector<uint8_t> out(static_cast<size_t>(size) * size * 3);
  for (int o = 0; o < size; ++o) {
    const Tap& t = taps[static_cast<size_t>(o)];
    for (int x = 0; x < size; ++x) {
      for (int c = 0; c < 3; ++c) {
        float v = 0;
        for (size_t k = 0; k < t.weights.size(); ++k) v += t.weights[k] * wide[((t.first + k) * size + x) * 3 + c];
        out[(static_cast<size_t>(o) * size + x) * 3 + c] = static_cast<uint8_t>(std::clamp(std::lround(v), 0L, 255L));
      }
    }
  }
  return out;
}

ImageDatasetResult build_image_dataset(const ImageDatasetOptions& o) {
  check(!o.from.empty() && fs::is_directory(o.from), "data images --from: not a directory: '" + o.from + "'");
  check(!o.out.empty(), "data images: missing --out DATASET");
  check(o.size >= 1 && o.size <= 4096, "data images --size: expected 1..4096, found " + std::to_string(o.size));
  check(o.val_fraction >= 0 && o.val_fraction < 1,
        "data images --val-fraction: expected >= 0 and < 1, found " + std::to_string(o.val_fraction));
  check(!fs::exists(fs::path(o.out) / "meta.json"), "data images --out: " + o.out + " already holds a dataset (meta.json)");
  ImageDatasetResult result;
  // Every image file once (links as the file they name), by caption: the largest of each.
  std::map<std::string, Found> by_caption;
  std::map<std::string, bool> seen_targets;
  std::vector<std::pair<fs::path, fs::file_type>> files;  // with the type of what each names
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(o.from, fs::directory_options::skip_permission_denied)) {
    const std::string ext = lower(e.path().extension().string());
    if (ext != ".png" && ext != ".jpg" && ext != ".jpeg") continue;
    std::error_code ec;
    files.emplace_back(e.path(), e.status(ec).type());
  }
  std::sort(files.begin(), files.end());
  const fs::path root = fs::canonical(o.from);
  for (const auto& [p, type] : files) {
    // A FIFO, device or socket (or a directory) with an image's name is not opened: a FIFO
    // would wait for a writer forever.
    if (type != fs::file_type::regular && type != fs::file_type::not_found) {
      if (o.strict) throw Error(not_regular_file_message("image", p.string(), type));
      result.skipped.push_back(p.lexically_relative(o.from).string() + ": not a regular file (" + file_kind(type) + ")");
      continue;
    }
    std::error_code ec;
    const fs::path target = fs::canonical(p, ec);
    if (ec) {
      result.skipped.push_back(fs::relative(p, o.from).string() + ": " + ec.message());
      continue;
    }
    if (seen_targets[target.string()]) continue;
    seen_targets[target.string()] = true;
    // The caption comes from the file itself, not from a link's name (an icon theme's links are
    // older aliases of the same picture).
    Found f;
    const bool inside = std::mismatch(root.begin(), root.end(), target.begin(), target.end()).first == root.end();
    f.source = utf8_text(inside ? fs::relative(target, root).string() : fs::relative(p, o.from).string());
    f.category = target.parent_path() == root ? "" : utf8_text(target.parent_path().filename().string());
    const std::string words = caption_words(utf8_text(target.stem().string()));
    if (words.empty()) {
      result.skipped.push_back(f.source + ": no words in its name for a caption");
      continue;
    }
    f.caption = f.category.empty() ? words : words + " (" + caption_words(f.category) + ")";
    try {
      const Rgba img = decode_image(target.string());
      f.width = img.width, f.height = img.height;
      auto it = by_caption.find(f.caption);
      if (it != by_caption.end() && static_cast<int64_t>(f.width) * f.height <= static_cast<int64_t>(it->second.width) * it->second.height) {
        result.duplicates++;  // a smaller (or equal) copy of one kept
        continue;
      }
      f.rgb = square_rgb(img, o.size);
    } catch (const Error& e) {
      if (o.strict) throw;
      result.skipped.push_back(e.what());
      continue;
    }
    auto it = by_caption.find(f.caption);
    if (it == by_caption.end()) {
      by_caption.emplace(f.caption, std::move(f));
    } else {
      result.duplicates++;  // the kept copy was smaller
      it->second = std::move(f);
    }
  }
  check(!by_caption.empty(), "data images --from: no readable .png, .jpg or .jpeg images under " + o.from);
  std::vector<const Found*> split[2];
  const uint64_t cut = static_cast<uint64_t>(o.val_fraction * 1e6);
  for (const auto& entry : by_caption) split[XXH3_64bits(entry.first.data(), entry.first.size()) % 1000000 < cut ? 1 : 0].push_back(&entry.second);
  // The captions' tokenizer first: a vocabulary the captions cannot fill fails before anything is written.
  std::vector<std::string> captions;
  for (const Found* f : split[0]) captions.push_back(f->caption);
  check(!captions.empty(), "data images --val-fraction: every caption was held out; nothing left to train on");
  check(o.vocab_size >= 257 && o.vocab_size <= 65536,
        "data images --vocab-size: expected 257..65536, found " + std::to_string(o.vocab_size));
  // At most that many tokens: a few hundred captions run out of distinct pairs sooner.
  const Tokenizer tokenizer = Tokenizer::train(captions, o.vocab_size, /*at_most=*/true);
  fs::create_directories(o.out);
  write_split(o.out, "train", split[0], o.size);
  write_split(o.out, "val", split[1], o.size);
  result.train = static_cast<int64_t>(split[0].size()), result.val = static_cast<int64_t>(split[1].size());
  tokenizer.save(o.out + "/tokenizer.json");
  const nlohmann::json meta = {{"format", "keel image-caption dataset 1"}, {"size", o.size}, {"channels", 3},
                               {"train", result.train}, {"val", result.val}, {"val_fraction", o.val_fraction},
                               {"vocab_size", o.vocab_size},
                               {"from", fs::absolute(o.from).string()}, {"duplicates", result.duplicates},
                               {"skipped", result.skipped.size()},
                               {"skipped_first", std::vector<std::string>(result.skipped.begin(), result.skipped.begin() + std::min<size_t>(result.skipped.size(), 20))}};
  // (Paths in it are kept as they are, but for bytes that are not UTF-8: see utf8_text.)
  const std::string text = meta.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  write_file_atomic(o.out + "/meta.json", {ByteRange{text.data(), text.size()}});  // last: a dataset is complete once it exists
  return result;
}

ImageSplit read_image_split(const std::string& dataset, const std::string& split) {
  const std::string path = dataset + "/" + split + ".img";
  const std::string bytes = read_text_file(path);
  check(bytes.size() >= 32 && std::memcmp(bytes.data(), kMagic, 8) == 0, "image split " + path + ": not a Keel image file");
  uint32_t f[6];
  std::memcpy(f, bytes.data() + 8, sizeof f);
  check(f[0] == 1, "image split " + path + ": version " + std::to_string(f[0]) + " (expected 1)");
  ImageSplit s;
  s.count = static_cast<int>(f[1]), s.height = static_cast<int>(f[2]), s.width = static_cast<int>(f[3]), s.channels = static_cast<int>(f[4]);
  const size_t want = 32 + static_cast<size_t>(s.count) * s.height * s.width * s.channels;
  check(bytes.size() == want, "image split " + path + ": " + std::to_string(bytes.size()) + " bytes, its header says " + std::to_string(want));
  s.pixels.assign(bytes.begin() + 32, bytes.end());
  const std::string lines = read_text_file(dataset + "/" + split + ".jsonl");
  size_t at = 0;
  while (at < lines.size()) {
    const size_t end = lines.find('\n', at);
    s.captions.push_back(nlohmann::json::parse(lines.substr(at, end - at)).at("caption").get<std::string>());
    at = end == std::string::npos ? lines.size() : end + 1;
  }
  check(static_cast<int>(s.captions.size()) == s.count,
        "image split " + dataset + "/" + split + ".jsonl: " + std::to_string(s.captions.size()) + " captions for " + std::to_string(s.count) + " images");
  return s;
}

}  // namespace keel
