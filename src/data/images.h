// Image-caption datasets for image-text training (`keel data images`): images decoded (PNG with
// libpng, JPEG with libjpeg), made square and resized, with a caption each, written as one file of
// pixels and one of captions per split.
//
// Source: a directory tree of .png / .jpg / .jpeg files whose names say what they show, such as an
// icon theme (Debian's tango-icon-theme: /usr/share/icons/Tango/32x32/places/user-trash.png) or
// a clipart collection. A file's caption is its name's words ("user-trash" -> "user trash"), with
// its directory's name as the category ("places"): "user trash (places)". One image per caption:
// where the same name and directory exist at several sizes (an icon theme's 16x16, 22x22, 32x32
// trees), the one with the most pixels is kept; symbolic links count as the file they name, once.
//
// Each image: alpha composited over white, centre-cropped to a square, resized to size x size
// with a box filter (each output pixel the area-weighted mean of the input pixels it covers;
// bilinear where it enlarges), RGB bytes. The split is by a hash of the caption (XXH3, 64 bits):
// the same files give the same split whatever order the directory lists them in, and adding files
// moves none of the others.
//
// Dataset layout (DATASET/):
//   train.img, val.img      header (32 bytes, little-endian): "KEELIMG1", uint32 version (1),
//                           uint32 count, uint32 height, uint32 width, uint32 channels (3),
//                           uint32 reserved (0); then count x height x width x channels uint8,
//                           row-major HWC, records in caption order.
//   train.jsonl, val.jsonl  one line per record, in the same order: {"caption", "category",
//                           "source" (path below the source directory), "width", "height"
//                           (before resizing)}
//   tokenizer.json          byte-level BPE trained on train's captions (data/tokenizer.h; the text
//                           tower's tokens; held-out captions encode with it too, byte by byte at worst)
//   meta.json               size, counts, the source, and what was skipped and why
// Unreadable or corrupt images and images outside 1..16384 pixels a side are skipped and counted
// (meta.json and the summary name the first few), or with `strict` are an error naming the file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace keel {

struct ImageDatasetOptions {
  std::string from;          // source directory
  std::string out;           // dataset directory (created; must not hold a dataset already)
  int size = 32;             // output side, pixels
  double val_fraction = 0.1; // share of captions held out
  bool strict = false;       // an unreadable image is an error, not a skip
  int vocab_size = 512;      // the captions' tokenizer (tokenizer.json): byte-level BPE over train's captions, at most this many tokens
};

struct ImageDatasetResult {
  int64_t train = 0, val = 0;
  int64_t duplicates = 0;                 // smaller copies of a name already kept
  std::vector<std::string> skipped;       // "path: why", every skipped file
};

ImageDatasetResult build_image_dataset(const ImageDatasetOptions& o);

// One decoded image, RGBA, 8 bits per channel. Throws keel::Error naming the file when it cannot
// be decoded.
struct Rgba {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;  // width x height x 4
};
Rgba decode_image(const std::string& path);

// `image` over white, centre-cropped to a square, resized to size x size: RGB bytes.
std::vector<uint8_t> square_rgb(const Rgba& image, int size);

// A dataset split as written (for tests and training): its records' pixels and captions.
struct ImageSplit {
  int count = 0, height = 0, width = 0, channels = 0;
  std::vector<uint8_t> pixels;
  std::vector<std::string> captions;
};
// Reads DATASET/<split>.img and .jsonl; throws keel::Error naming the file on a bad header or a
// size that does not match.
ImageSplit read_image_split(const std::string& dataset, const std::string& split);

}  // namespace keel
