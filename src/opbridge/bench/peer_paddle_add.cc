// opbridge bench frameworks: x + y on float32 CPU tensors, as a Paddle custom op.
#include <vector>

#include "paddle/extension.h"

std::vector<paddle::Tensor> AddForward(const paddle::Tensor& x, const paddle::Tensor& y) {
  PD_CHECK(x.is_cpu() && y.is_cpu(), "add: CPU tensors expected");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && y.dtype() == paddle::DataType::FLOAT32,
           "add: float32 expected");
  PD_CHECK(x.shape() == y.shape(), "add: shapes differ");
  auto out = paddle::empty(x.shape(), x.dtype(), x.place());
  const float* a = x.data<float>();
  const float* b = y.data<float>();
  float* o = out.data<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
  return {out};
}

PD_BUILD_OP(opb_bench_add)
    .Inputs({"X", "Y"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(AddForward));
