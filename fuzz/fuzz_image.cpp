// Images for image-caption datasets (data/images.h): PNG through libpng, JPEG through libjpeg,
// then Keel's crop and resize. Any input either decodes to an image of the size it claims or is
// refused with keel::Error.
#include <cstdint>

#include "core/error.h"
#include "data/images.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const char* name : {"image.png", "image.jpg"}) {
    const std::string path = keel::fuzz::write_input(name, data, size);
    try {
      const keel::Rgba image = keel::decode_image(path);
      if (image.pixels.size() != static_cast<size_t>(image.width) * image.height * 4) __builtin_trap();
      if (image.width <= 256 && image.height <= 256) {  // (larger claimed sizes only cost the fuzzer time)
        const std::vector<uint8_t> rgb = keel::square_rgb(image, 8);
        if (rgb.size() != 8 * 8 * 3) __builtin_trap();
      }
    } catch (const keel::Error&) {
    }
  }
  return 0;
}
