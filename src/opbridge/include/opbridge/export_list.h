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
  // "name=signature" per kernel, comma-separated; a signature is the return
  // ('v' void, 'r' a value), ':' and one code per argument (see export.h's
  // kind_code), which the loader checks against the op's schema.
  std::string signatures;
  int add(const char* name, const char* signature) {
    if (!names.empty()) {
      names += ",";
      signatures += ",";
    }
    names += name;
    signatures += name;
    signatures += "=";
    signatures += signature;
    return 0;
  }
};
}  // namespace detail
}  // namespace opbridge
