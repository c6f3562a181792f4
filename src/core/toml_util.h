// TOML text parsed into a table, a syntax error thrown as one keel::Error line naming where and
// the line ("cluster file x.toml:12: expected ..."): what every TOML reader of Keel shares.
#pragma once

#include <toml++/toml.h>

#include <sstream>
#include <string>

#include "core/error.h"

namespace keel {

inline toml::table parse_toml(const std::string& text, const std::string& where) {
  try {
    return toml::parse(text, where);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << where << ":" << e.source().begin.line << ": " << e.description();
    throw Error(msg.str());
  }
}

}  // namespace keel
