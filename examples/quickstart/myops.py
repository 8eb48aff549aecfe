import opbridge

lib = opbridge.Library("myops", sources=["scale.cc"])

@lib.op("scale(Tensor x, float alpha) -> Tensor", shape=opbridge.like("x"), dtypes=["float32"],
        backward=lambda grad, x, alpha: (scale(grad, alpha),))
def scale(x, alpha):          # the NumPy reference *is* the declaration
    return x * alpha

import torch
print(scale(torch.ones(3), 2.0))            # eager; builds on first use (3-6 s, then cached)
print(torch.ops.myops.scale(torch.ones(3), 2.0))
