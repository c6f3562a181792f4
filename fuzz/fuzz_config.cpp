// TOML configs and --set overrides: parse, resolve, and the resolved config's TOML must parse
// back to the same TOML (what run_dir/config.toml relies on).
#include <string>

#include "core/config.h"
#include "core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // The first line, if it looks like one, is also tried as a --set override.
  const size_t nl = text.find('\n');
  const std::string first = text.substr(0, nl);
  try {
    keel::Config c = keel::Config::parse(text, "fuzz");
    if (first.find('=') != std::string::npos && first.find('.') != std::string::npos) {
      try {
        c.set(first);
      } catch (const keel::Error&) {
      }
    }
    for (int world : {1, 2, 4}) {
      keel::Config r = c;
      try {
        r.resolve(world);
      } catch (const keel::Error&) {
        continue;
      }
      const std::string toml = r.to_toml();
      const keel::Config back = keel::Config::parse(toml, "fuzz round trip");
      if (back.to_toml() != toml) __builtin_trap();
      (void)r.trajectory_hash(world);
    }
  } catch (const keel::Error&) {
  }
  return 0;
}
