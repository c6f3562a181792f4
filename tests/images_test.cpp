// Image-caption datasets (data/images.h): PNG and JPEG decoded by libpng and libjpeg, resizing
// checked against hand-computed pixels, captions and the largest copy of each name kept, corrupt
// files skipped and counted (or an error with --strict), the split stable under added files, the
// same files giving the same bytes, a real icon theme read end to end, and bad input as one line.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fileio.h"
#include "data/images.h"
#include "image_files.h"
#include "test_util.h"

namespace keel {
namespace {

namespace fs = std::filesystem;
using testing::push;
using testing::solid;
using testing::write_jpeg;
using testing::write_png;

std::string file_bytes(const std::string& path) { return read_text_file(path); }

TEST(Images, ResizingIsTheAreaMeanOverWhiteOfTheCentreSquare) {
  // 2 x 2 distinct opaque colours: size 2 is the identity, size 1 the mean (rounded).
  Rgba four{2, 2, {10, 20, 30, 255, 50, 60, 70, 255, 90, 100, 110, 255, 130, 140, 151, 255}};
  EXPECT_EQ(square_rgb(four, 2), (std::vector<uint8_t>{10, 20, 30, 50, 60, 70, 90, 100, 110, 130, 140, 151}));
  EXPECT_EQ(square_rgb(four, 1), (std::vector<uint8_t>{70, 80, 90}));  // 90.25 rounds to 90
  // 4 x 2: the centre 2 x 2 (columns 1 and 2) is kept.
  Rgba wide{4, 2, {}};
  for (int y = 0; y < 2; ++y) {
    for (int x = 0; x < 4; ++x) push(wide.pixels, {x * 10, 0, 0, 255});
  }
  EXPECT_EQ(square_rgb(wide, 1), (std::vector<uint8_t>{15, 0, 0}));
  // Transparent pixels are white; half-transparent black is mid grey.
  EXPECT_EQ(square_rgb(Rgba{1, 1, {0, 0, 0, 0}}, 1), (std::vector<uint8_t>{255, 255, 255}));
  EXPECT_EQ(square_rgb(Rgba{1, 1, {0, 0, 0, 102}}, 1), (std::vector<uint8_t>{153, 153, 153}));
  // 3 x 3 shrunk to 2 x 2: each output pixel covers 1.5 x 1.5 inputs (weights 2/3 and 1/3).
  Rgba nine{3, 3, {}};
  for (int i = 0; i < 9; ++i) push(nine.pixels, {i * 30, 0, 0, 255});
  // top-left: rows 0 (2/3) and 1 (1/3), columns likewise, of values 30 * (3y + x).
  const double tl = (4.0 / 9) * 0 + (2.0 / 9) * 30 + (2.0 / 9) * 90 + (1.0 / 9) * 120;
  EXPECT_EQ(square_rgb(nine, 2)[0], static_cast<uint8_t>(std::lround(tl)));
  // Enlarging a solid image keeps it solid.
  const std::vector<uint8_t> big = square_rgb(Rgba{1, 1, {200, 100, 50, 255}}, 5);
  ASSERT_EQ(big.size(), 75u);
  for (size_t i = 0; i < big.size(); ++i) EXPECT_EQ(big[i], (std::vector<uint8_t>{200, 100, 50})[i % 3]) << i;
}

TEST(Images, PngAndJpegDecodeAndCorruptFilesNameThemselves) {
  testing::TempDir dir("keel-images-decode");
  write_png(dir / "a.png", 3, 2, solid(3, 2, 1, 2, 3, 4));
  const Rgba png = decode_image(dir / "a.png");
  EXPECT_EQ(png.width, 3);
  EXPECT_EQ(png.height, 2);
  EXPECT_EQ(png.pixels, solid(3, 2, 1, 2, 3, 4));
  write_jpeg(dir / "b.jpg", 8, 8, 200, 40, 90);
  const Rgba jpg = decode_image(dir / "b.jpg");
  ASSERT_EQ(jpg.width, 8);
  for (size_t i = 0; i < jpg.pixels.size(); i += 4) {
    EXPECT_NEAR(jpg.pixels[i], 200, 3);
    EXPECT_NEAR(jpg.pixels[i + 1], 40, 3);
    EXPECT_NEAR(jpg.pixels[i + 2], 90, 3);
    EXPECT_EQ(jpg.pixels[i + 3], 255);
  }
  testing::write_text(dir / "bad.png", "\x89PNG\r\n\x1a\n this is not a picture");
  testing::write_text(dir / "bad.jpg", "\xff\xd8\xff\xe0 nor is this");
  std::string half = file_bytes(dir / "a.png");
  testing::write_text(dir / "half.png", half.substr(0, half.size() / 2));
  for (const char* name : {"bad.png", "bad.jpg", "half.png"}) {
    const std::string e = testing::error_of([&] { decode_image(dir / name); });
    EXPECT_NE(e.find(dir / name), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

// A picture cut short is corrupt, wherever the cut: libjpeg decodes a truncated JPEG with a
// warning ("Premature end of JPEG file") and grey for the missing part, libpng stops with an error.
// In a dataset a cut file is skipped and counted, and with --strict it is an error naming it.
TEST(Images, TruncatedPicturesAreCorrupt) {
  testing::TempDir dir("keel-images-cut");
  write_jpeg(dir / "src/photo.jpg", 32, 32, testing::noise(32, 32, 3));
  write_png(dir / "src/icon.png", 32, 32, testing::noise(32, 32, 4));
  int cuts = 0;
  for (const std::string whole : {"photo.jpg", "icon.png"}) {
    const std::string ext = fs::path(whole).extension().string();
    const std::string bytes = file_bytes(dir / ("src/" + whole));
    ASSERT_GT(bytes.size(), 2000u) << whole;
    EXPECT_EQ(testing::error_of([&] { decode_image(dir / ("src/" + whole)); }), "") << whole;
    for (size_t keep = 100; keep < bytes.size(); keep += bytes.size() / 50 + 1) {
      const std::string cut = dir / ("cut/" + std::to_string(keep) + ext);
      fs::create_directories(dir / "cut");
      testing::write_text(cut, bytes.substr(0, keep));
      const std::string e = testing::error_of([&] { decode_image(cut); });
      EXPECT_NE(e.find(cut + ": corrupt " + (ext == ".jpg" ? "JPEG" : "PNG")), std::string::npos) << keep << " bytes: " << e;
      cuts++;
    }
  }
  ImageDatasetOptions o;
  o.from = dir / "src", o.out = dir / "ds", o.size = 4, o.val_fraction = 0;
  testing::write_text(dir / "src/half.jpg", file_bytes(dir / "src/photo.jpg").substr(0, 1500));
  const ImageDatasetResult r = build_image_dataset(o);
  EXPECT_EQ(r.train, 2);
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_NE(r.skipped[0].find("half.jpg: corrupt JPEG (Premature end of JPEG file)"), std::string::npos) << r.skipped[0];
  o.out = dir / "ds2", o.strict = true;
  EXPECT_NE(testing::error_of([&] { build_image_dataset(o); }).find("half.jpg: corrupt JPEG"), std::string::npos);
  EXPECT_GT(cuts, 90);
}

TEST(Images, DatasetKeepsTheLargestOfEachNameSkipsCorruptFilesAndSplitsStably) {
  testing::TempDir dir("keel-images-ds");
  const std::string src = dir / "src";
  write_png(src + "/16x16/places/user-trash.png", 16, 16, solid(16, 16, 0, 0, 255));
  write_png(src + "/32x32/places/user-trash.png", 32, 32, solid(32, 32, 255, 0, 0));  // the one kept
  write_png(src + "/32x32/actions/go_next.png", 8, 4, solid(8, 4, 0, 255, 0));
  write_jpeg(src + "/photos/red-apple.jpg", 12, 12, 220, 10, 10);
  for (int i = 0; i < 30; ++i) write_png(src + "/misc/icon-" + std::to_string(i) + ".png", 2, 2, solid(2, 2, i, i, i));
  fs::create_symlink(src + "/32x32/places/user-trash.png", src + "/32x32/places/trashcan_full.png");  // an alias
  testing::write_text(src + "/misc/broken.png", "not a png at all");

  ImageDatasetOptions o;
  o.from = src, o.out = dir / "ds", o.size = 4, o.val_fraction = 0.25;
  const ImageDatasetResult r = build_image_dataset(o);
  EXPECT_EQ(r.train + r.val, 33);
  EXPECT_GT(r.val, 0);
  EXPECT_EQ(r.duplicates, 1);
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_NE(r.skipped[0].find("broken.png"), std::string::npos) << r.skipped[0];
  const ImageSplit train = read_image_split(o.out, "train"), val = read_image_split(o.out, "val");
  EXPECT_EQ(train.count + val.count, 33);
  EXPECT_EQ(train.width, 4);
  std::set<std::string> captions(train.captions.begin(), train.captions.end());
  captions.insert(val.captions.begin(), val.captions.end());
  EXPECT_EQ(captions.size(), 33u);
  for (const std::string c : {"user trash (places)", "go next (actions)", "red apple (photos)", "icon 7 (misc)"}) {
    EXPECT_EQ(captions.count(c), 1u) << c;
  }
  EXPECT_EQ(captions.count("trashcan full (places)"), 0u);  // the alias is the same picture
  // The kept user-trash is the 32 x 32 red one.
  for (const ImageSplit* s : {&train, &val}) {
    for (int i = 0; i < s->count; ++i) {
      if (s->captions[static_cast<size_t>(i)] != "user trash (places)") continue;
      const uint8_t* p = &s->pixels[static_cast<size_t>(i) * 4 * 4 * 3];
      EXPECT_EQ(p[0], 255);
      EXPECT_EQ(p[2], 0);
    }
  }
  EXPECT_NE((file_bytes(o.out + "/train.jsonl") + file_bytes(o.out + "/val.jsonl")).find("\"source\":\"32x32/places/user-trash.png\",\"width\":32"),
            std::string::npos);

  // The same files give the same bytes; an added file moves no other caption between splits.
  ImageDatasetOptions again = o;
  again.out = dir / "ds2";
  build_image_dataset(again);
  for (const char* f : {"train.img", "val.img", "train.jsonl", "val.jsonl"}) {
    EXPECT_EQ(file_bytes(o.out + "/" + f), file_bytes(again.out + "/" + f)) << f;
  }
  write_png(src + "/misc/newcomer.png", 2, 2, solid(2, 2, 9, 9, 9));
  ImageDatasetOptions grown = o;
  grown.out = dir / "ds3";
  build_image_dataset(grown);
  const ImageSplit val3 = read_image_split(grown.out, "val");
  std::set<std::string> val_before(val.captions.begin(), val.captions.end()), val_after(val3.captions.begin(), val3.captions.end());
  val_after.erase("newcomer (misc)");
  EXPECT_EQ(val_before, val_after);

  // --strict: the corrupt file is an error naming it; an existing dataset is not overwritten.
  ImageDatasetOptions strict = o;
  strict.out = dir / "ds4", strict.strict = true;
  const std::string e = testing::error_of([&] { build_image_dataset(strict); });
  EXPECT_NE(e.find("broken.png"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(strict.out + "/meta.json"));
  const std::string before = file_bytes(o.out + "/train.img");
  EXPECT_NE(testing::error_of([&] { build_image_dataset(o); }).find("already holds a dataset"), std::string::npos);
  EXPECT_EQ(file_bytes(o.out + "/train.img"), before);
}

// A real icon theme from Debian's packages (tango-icon-theme, installed by scripts/setup.sh).
TEST(Images, TheTangoIconThemeBecomesADataset) {
  const std::string tango = "/usr/share/icons/Tango";
  if (!fs::is_directory(tango)) GTEST_SKIP() << "tango-icon-theme is not installed (scripts/setup.sh installs it)";
  testing::TempDir dir("keel-images-tango");
  const testing::CommandResult r = testing::run_keel("data images --from " + tango + " --out " + (dir / "ds") + " --size 24");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const ImageSplit train = read_image_split(dir / "ds", "train"), val = read_image_split(dir / "ds", "val");
  EXPECT_GE(train.count + val.count, 200);
  EXPECT_GT(val.count, 5);
  EXPECT_EQ(train.height, 24);
  EXPECT_EQ(train.pixels.size(), static_cast<size_t>(train.count) * 24 * 24 * 3);
  EXPECT_TRUE(std::find(train.captions.begin(), train.captions.end(), "user trash (places)") != train.captions.end() ||
              std::find(val.captions.begin(), val.captions.end(), "user trash (places)") != val.captions.end());
  // Not all white or all one colour: real pictures.
  std::set<uint8_t> values(train.pixels.begin(), train.pixels.begin() + 24 * 24 * 3 * 10);
  EXPECT_GT(values.size(), 50u);
}

TEST(Images, BadInputIsOneLine) {
  testing::TempDir dir("keel-images-bad");
  write_png(dir / "src/a/one.png", 2, 2, solid(2, 2, 1, 1, 1));
  testing::write_text(dir / "src/a/bad.png", "garbage");
  fs::create_directories(dir / "empty");
  fs::create_directories(dir / "done");
  testing::write_text(dir / "done/meta.json", "{}");
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases = {
      {"images --from " + (dir / "nowhere") + " --out " + (dir / "o1"), "data images --from: not a directory"},
      {"images --out " + (dir / "o2"), "data images: missing --from DIR"},
      {"images --from " + (dir / "src") + " --out " + (dir / "o3") + " --size 0", "data images --size: expected 1..4096"},
      {"images --from " + (dir / "src") + " --out " + (dir / "o4") + " --val-fraction 1", "data images --val-fraction"},
      {"images --from " + (dir / "empty") + " --out " + (dir / "o5"), "no readable .png, .jpg or .jpeg images"},
      {"images --from " + (dir / "src") + " --out " + (dir / "done"), "already holds a dataset"},
      {"images --from " + (dir / "src") + " --out " + (dir / "o6") + " --strict yes", "bad.png"},
      {"images --from " + (dir / "src") + " --out " + (dir / "o7") + " --strict maybe", "data images --strict: expected yes or no"},
      {"videos --from x", "data: expected a subcommand: images"},
      {"images --from " + (dir / "src") + " --colour red", "unknown option --colour"},
  };
  for (const Case& c : cases) {
    const testing::CommandResult r = testing::run_keel("data " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    const size_t at = r.output.rfind("keel: ");
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string last = r.output.substr(at);
    EXPECT_NE(last.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(std::count(last.begin(), last.end(), '\n'), 1) << last;
  }
  // Without --strict the corrupt file is skipped and counted.
  const testing::CommandResult ok = testing::run_keel("data images --from " + (dir / "src") + " --out " + (dir / "o8"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("1 files skipped"), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("bad.png"), std::string::npos) << ok.output;
}

}  // namespace
}  // namespace keel
