// opbridge's settings as C++ reads them: the same rules as the Python side's (opbridge/config.py).
#pragma once

#include <cctype>
#include <cstring>
#include <string>

namespace opbridge {

// A yes/no setting's value, read as config._flag reads it: 1 for 1/true/yes/on, 0 for 0/false/no/off
// (any case, blanks around), `unset` for no value or an empty one, -1 for anything else (which the
// caller reports as an error naming the setting: a misspelt value must not silently mean the default).
inline int yes_no(const char* value, int unset) {
  if (value == nullptr) return unset;
  std::string v(value);
  const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!v.empty() && blank(v.back())) v.pop_back();
  size_t start = 0;
  while (start < v.size() && blank(v[start])) ++start;
  v.erase(0, start);
  if (v.empty()) return unset;
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* yes : {"1", "true", "yes", "on"}) {
    if (v == yes) return 1;
  }
  for (const char* no : {"0", "false", "no", "off"}) {
    if (v == no) return 0;
  }
  return -1;
}

}  // namespace opbridge
