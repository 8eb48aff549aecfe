// opbridge bench build: x + y on float32 CPU tensors, as a torch extension (load_inline).
#include <torch/extension.h>

torch::Tensor add(torch::Tensor x, torch::Tensor y) {
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu(), "add: CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && y.scalar_type() == torch::kFloat, "add: float32 expected");
  TORCH_CHECK(x.sizes() == y.sizes(), "add: shapes differ");
  auto xc = x.contiguous(), yc = y.contiguous();
  auto out = torch::empty_like(xc);
  const float* a = xc.data_ptr<float>();
  const float* b = yc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n = xc.numel();
#pragma omp parallel for if (n > 65536)
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
  return out;
}
