"""A shape rule that gives the wrong thing is the op's error, naming the rule, in every framework.

Before, a rule returning ``(shape, dtype)`` or None raised a bare AttributeError or TypeError from
``OpDef.output_specs``; one giving two Specs for one output reached the kernel ("Mismatched number
of arguments") or generated code ("too many values to unpack"); a float dimension was refused by
NumPy and JAX but made a tensor in torch and Paddle; a dtype name such as "fp32" failed inside the
framework (``module 'torch' has no attribute 'fp32'``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge import Spec

sys.path.insert(0, str(Path(__file__).parent))
from _split_sum import REPEAT_FIRST_CC

RULES: list[tuple[str, Any, type[Exception], str]] = [
    ("pair", lambda x: (x.shape, x.dtype), TypeError,
     r"pair: its shape rule must return opbridge.Spec\(shape, dtype\) \(declared at .*\), got tuple of tuple, "),
    ("none", lambda x: None, TypeError,
     r"none: its shape rule must return opbridge.Spec\(shape, dtype\) .*got NoneType"),
    ("two", lambda x: (Spec(x.shape, x.dtype), Spec(x.shape, x.dtype)), ValueError,
     r"two: its shape rule gave 2 Spec\(s\), but the schema returns 1 new tensor\(s\)"),
    ("zero", lambda x: (), ValueError, r"zero: its shape rule gave 0 Spec\(s\), but the schema returns 1"),
    ("float_dim", lambda x: Spec((x.shape[0] / 1,), x.dtype), TypeError,
     r"float_dim: its shape rule gave output 0 the shape \(3.0,\); dimensions must be ints, got float 3.0"),
    ("int_shape", lambda x: Spec(3, x.dtype), TypeError,
     r"int_shape: its shape rule gave output 0 the shape 3; a shape is a tuple of ints"),
    ("dtype_name", lambda x: Spec(x.shape, "fp32"), ValueError,
     r"dtype_name: its shape rule gave output 0 the dtype 'fp32'; name one of bfloat16, bool, "),
]


def test_output_specs_names_what_a_rule_got_wrong() -> None:
    lib = opbridge.Library("shape_rules_unit", sources=())
    for name, rule, exc, message in RULES:
        lib.op(f"{name}(Tensor x) -> Tensor", shape=rule)(lambda x: x)
        with pytest.raises(exc, match=message):
            lib.ops[name].output_specs([np.ones((3, 2), np.float32)])
    lib.op("fine(Tensor x) -> (Tensor, Tensor)",
           shape=lambda x: [Spec((x.shape[0],), "int64"), Spec(list(x.shape), x.dtype)])(lambda x: (x, x))
    assert lib.ops["fine"].output_specs([np.ones((3, 2), np.float32)]) == (
        Spec((3,), "int64"), Spec([3, 2], np.dtype("float32")))


@pytest.fixture(scope="module")
def bad_rules(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    root = tmp_path_factory.mktemp("shape_rules")
    (root / "rep.cc").write_text("#include <opbridge/opbridge.h>\nusing tvm::ffi::TensorView;\n" + REPEAT_FIRST_CC)
    lib = opbridge.Library("shape_rules_calls", sources=["rep.cc"], root=root, dtypes=["float32"])
    lib.op("repeat_first(Tensor x, int n) -> Tensor", shape=lambda x, n: Spec((n / 1,), x.dtype))(
        lambda x, n: np.full(n, x.reshape(-1)[0], x.dtype))
    return lib


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_a_float_dimension_is_refused_in_every_framework(bad_rules: opbridge.Library, framework: str) -> None:
    x = np.full(2, 3.0, np.float32)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        x = torch.from_numpy(x)
    elif framework == "jax":
        jnp = pytest.importorskip("jax.numpy")
        pytest.importorskip("jax_tvm_ffi")
        x = jnp.asarray(x)
    op = bad_rules.ops["repeat_first"].call
    for _ in range(2):  # the first call and one that a fast path may take
        with pytest.raises(TypeError, match=r"repeat_first: its shape rule gave output 0 the shape \(3.0,\); "
                                            r"dimensions must be ints, got float"):
            op(x, 3)


def test_check_op_skips_compile_for_a_returned_alias_and_says_why(tmp_path: Path) -> None:
    """``-> Tensor(a!)`` runs eagerly, but torch.compile and opcheck refuse a custom op whose output
    aliases an input ("Found a custom (non-ATen) operator whose output has alias annotations"):
    check_op reports why it skips them rather than failing with torch's message."""
    pytest.importorskip("torch")
    from opbridge.testing import check_op

    (tmp_path / "scale_.cc").write_text("""
#include <opbridge/opbridge.h>
void scale__cpu(opbridge::TensorView x, double alpha) {
  OPB_CHECK_DTYPE("scale_", x, opbridge::kFloat32);
  OPB_CHECK_CONTIGUOUS("scale_", x);
  float* p = static_cast<float*>(x.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) p[i] *= float(alpha);
}
OPBRIDGE_EXPORT(scale__cpu);
""")
    lib = opbridge.Library("alias_return_check", sources=["scale_.cc"], root=tmp_path, dtypes=["float32"])

    @lib.op("scale_(Tensor(a!) x, float alpha) -> Tensor(a!)")
    def scale_(x: np.ndarray, alpha: float) -> np.ndarray:
        x *= alpha
        return x

    report = check_op(scale_, [{"x": np.arange(6, dtype=np.float32).reshape(2, 3), "alpha": 2.0}],
                      framework="torch", check_grad=False, check_gradcheck=False)
    assert report.checks["forward"] == 1
    assert "opcheck" not in report.checks and "compile" not in report.checks
    assert any("returns an argument it writes (-> Tensor(a!))" in s for s in report.skipped), report.skipped
