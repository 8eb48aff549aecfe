// The module-wide list of kernels exported with OPBRIDGE_EXPORT.
// Kept free of tvm-ffi includes so the generated translation unit that
// publishes it compiles in a fraction of a second.
#pragma once

#include <string>

namespace opbridge {
namespace detail {
struct __attribute__((visibility("hidden"))) ExportList {
  static ExportList& Global() {
    static ExportList inst;
    return inst;
  }
  std::string names;
  int add(const char* name) {
    if (!names.empty()) names += ",";
    names += name;
    return 0;
  }
};
}  // namespace detail
}  // namespace opbridge
