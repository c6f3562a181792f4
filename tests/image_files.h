// PNG and JPEG files for the tests of image datasets, written by libpng and libjpeg.
#pragma once

#include <gtest/gtest.h>
#include <jpeglib.h>
#include <png.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <vector>

namespace keel::testing {

namespace image_fs = std::filesystem;

// An RGBA PNG of width x height, every pixel `rgba` unless `pixels` is given.
inline void write_png(const std::string& path, int width, int height, std::vector<uint8_t> pixels) {
  image_fs::create_directories(image_fs::path(path).parent_path());
  png_image image;
  std::memset(&image, 0, sizeof image);
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = PNG_FORMAT_RGBA;
  ASSERT_TRUE(png_image_write_to_file(&image, path.c_str(), 0, pixels.data(), 0, nullptr)) << image.message;
}

// (push_back, not insert of a braced list: GCC 12 at -O3 warns falsely on the latter, bug 105329's kin)
inline void push(std::vector<uint8_t>& v, std::initializer_list<int> values) {
  for (int x : values) v.push_back(static_cast<uint8_t>(x));
}

inline std::vector<uint8_t> solid(int width, int height, uint8_t r, uint8_t g, uint8_t b, uint8_t a = 255) {
  std::vector<uint8_t> p;
  for (int i = 0; i < width * height; ++i) push(p, {r, g, b, a});
  return p;
}

// A JPEG (quality 100) of width x height RGB pixels, row by row.
inline void write_jpeg(const std::string& path, int width, int height, const std::vector<uint8_t>& rgb) {
  image_fs::create_directories(image_fs::path(path).parent_path());
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  jpeg_compress_struct info;
  jpeg_error_mgr err;
  info.err = jpeg_std_error(&err);
  jpeg_create_compress(&info);
  jpeg_stdio_dest(&info, f);
  info.image_width = static_cast<JDIMENSION>(width);
  info.image_height = static_cast<JDIMENSION>(height);
  info.input_components = 3;
  info.in_color_space = JCS_RGB;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, 100, TRUE);
  jpeg_start_compress(&info, TRUE);
  while (info.next_scanline < info.image_height) {
    JSAMPROW rows[1] = {const_cast<uint8_t*>(&rgb[static_cast<size_t>(info.next_scanline) * width * 3])};
    jpeg_write_scanlines(&info, rows, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  std::fclose(f);
}

// A JPEG of one colour.
inline void write_jpeg(const std::string& path, int width, int height, uint8_t r, uint8_t g, uint8_t b) {
  std::vector<uint8_t> rgb;
  for (int i = 0; i < width * height; ++i) push(rgb, {r, g, b});
  write_jpeg(path, width, height, rgb);
}

// width x height pixels of `channels` bytes each, from a fixed pseudo-random sequence (pictures
// that do not compress to almost nothing).
inline std::vector<uint8_t> noise(int width, int height, int channels) {
  std::vector<uint8_t> p(static_cast<size_t>(width) * height * channels);
  uint32_t x = 12345;
  for (uint8_t& v : p) v = static_cast<uint8_t>((x = x * 1664525u + 1013904223u) >> 24);
  return p;
}

}  // namespace keel::testing
