// Compiled into every opbridge module: the module-wide list of exported
// kernels and their signatures, and the CPU threading policy in force (1:
// OpenMP team, 0: caller-runs pool).
#include <opbridge/export_list.h>
#include <opbridge/threading.h>
extern "C" __attribute__((visibility("default"))) const char* __opbridge_exports() {
  return ::opbridge::detail::ExportList::Global().names.c_str();
}
extern "C" __attribute__((visibility("default"))) const char* __opbridge_signatures() {
  return ::opbridge::detail::ExportList::Global().signatures.c_str();
}
extern "C" __attribute__((visibility("default"))) int __opbridge_threading() {
  return int(::opbridge::threading());
}
