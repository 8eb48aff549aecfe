#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void scale_cpu(TensorView out, TensorView x, double alpha) {   // outputs first
  OPB_CHECK_DTYPE("scale", x, opbridge::kFloat32);
  OPB_CHECK_SAME_SHAPE("scale", out, x);
  const float* a = opbridge::data_ptr<const float>(x);   // the first element (DLPack's byte_offset too)
  float* o = opbridge::data_ptr<float>(out);
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] * float(alpha);
}
OPBRIDGE_EXPORT(scale_cpu);
