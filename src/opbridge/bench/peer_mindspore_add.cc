// opbridge bench frameworks: float32 x + y on CPU as a MindSpore CustomOpBuilder op.
#include "ms_extension/api.h"

class AddRunner : public ms::pynative::PyboostRunner {
 public:
  using PyboostRunner::PyboostRunner;
  void LaunchKernel() override {
    const float *a = inputs()[0].data_ptr<float>();
    const float *b = inputs()[1].data_ptr<float>();
    float *o = outputs()[0].data_ptr<float>();
    const size_t n = outputs()[0].numel();
    for (size_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
  }
};

ms::Tensor add_impl(const ms::Tensor &x, const ms::Tensor &y) {
  if (x.data_type() != mindspore::kNumberTypeFloat32 || y.data_type() != mindspore::kNumberTypeFloat32) {
    MS_LOG(EXCEPTION) << "add: float32 expected";
  }
  if (x.shape() != y.shape()) {
    MS_LOG(EXCEPTION) << "add: shapes differ";
  }
  ms::Tensor out(x.data_type(), x.shape());
  auto runner = std::make_shared<AddRunner>("OpbBenchAdd");
  runner->Run({x, y}, {out});
  return out;
}

py::object add(const ms::Tensor &x, const ms::Tensor &y) {
  return ms::pynative::PyboostRunner::Call<1>(add_impl, x, y);
}

PYBIND11_MODULE(MS_EXTENSION_NAME, m) {
  m.def("add", &add, "x + y (float32, CPU)", pybind11::arg("x"), pybind11::arg("y"));
}
