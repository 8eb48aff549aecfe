// add(Tensor x, Tensor y) -> Tensor on CUDA: elementwise, same shape, no broadcasting.
#include <opbridge/cuda.h>
#include <opbridge/cuda_map.h>
#include <opbridge/ops/add.h>

using opbridge::TensorView;

void add_cuda(TensorView out, TensorView x, TensorView y) {
  const char* op = "add";
  opbridge::add::check_tensors(op, kDLCUDA, out, x, y);

  const int64_t n = x.numel();
  if (n == 0) return;
  opbridge::cuda::Context ctx(op, x);
  OPB_DISPATCH_FLOATING_AND_INT(op, x.dtype(), S, [&] {
    using T = opbridge::cuda::device_t<S>;
    opbridge::cuda::map(ctx, opbridge::data_ptr<T>(out), opbridge::data_ptr<const T>(x),
                        opbridge::data_ptr<const T>(y), n, opbridge::add::Sum{});
  });
}
OPBRIDGE_EXPORT(add_cuda);
