"""YAML manifests: the same declarations as the Python API, backward compiled from `derivatives`."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import opbridge
from opbridge import cases, manifest, registry
from opbridge.errors import DeclarationError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vllm_plugin"

KERNELS = """
#include <opbridge/opbridge.h>
using tvm::ffi::TensorView;
void cube_cpu(TensorView out, TensorView x) {
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] * a[i] * a[i];
}
OPBRIDGE_EXPORT(cube_cpu);
void cube_backward_cpu(TensorView out, TensorView grad, TensorView x) {
  const float* g = static_cast<const float*>(grad.data_ptr());
  const float* a = static_cast<const float*>(x.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = 3.f * a[i] * a[i] * g[i];
}
OPBRIDGE_EXPORT(cube_backward_cpu);
void mul_cpu(TensorView out, TensorView x, TensorView y) {
  const float* a = static_cast<const float*>(x.data_ptr());
  const float* b = static_cast<const float*>(y.data_ptr());
  float* o = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = a[i] * b[i];
}
OPBRIDGE_EXPORT(mul_cpu);
"""

REFS = '''
from opbridge import Spec


def cube(x):
    """``x ** 3``, elementwise."""
    return x ** 3


def cube_backward(grad, x):
    return 3 * x * x * grad


def mul(x, y):
    return x * y


def same(x, y):
    return Spec(tuple(x.shape), x.dtype)
'''

MANIFEST = """\
library:
  namespace: {ns}
  sources: ["*.cc"]
  prebuilt: nowhere_{ns}._C_ops
ops:
  - func: cube(Tensor x) -> Tensor
    shape: {{like: x}}
    reference: {refs}.cube
    tolerances: {{float32: [1e-5, 1e-6]}}
  - func: cube_backward(Tensor grad, Tensor x) -> Tensor
    kernels: {{cpu: cube_backward_cpu}}
    shape: {{like: [x]}}
    reference: {refs}.cube_backward
  - func: mul(Tensor x, Tensor y) -> Tensor
    shape: {refs}.same
    reference: {refs}.mul
derivatives:
  - name: cube(Tensor x) -> Tensor
    x: cube_backward(grad, x)
  - name: mul(Tensor x, Tensor y) -> Tensor
    x: mul(grad, y)
    y: 2 * mul(grad, x) - mul(grad, x)
"""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> opbridge.Library:
    root = tmp_path_factory.mktemp("manifest")
    ns = f"mf_{root.name[-6:].replace('-', '_')}"
    refs = f"{ns}_refs"
    (root / "k.cc").write_text(KERNELS)
    (root / f"{refs}.py").write_text(REFS)
    (root / "ops.yaml").write_text(MANIFEST.format(ns=ns, refs=refs))
    sys.path.insert(0, str(root))
    try:
        return manifest.load(root / "ops.yaml")
    finally:
        sys.path.remove(str(root))


def test_manifest_declares_what_the_python_api_declares(loaded: opbridge.Library) -> None:
    assert registry.library(loaded.namespace) is loaded
    assert loaded.python_module == __name__, "the loader's caller declares the library"
    assert [s.name for s in loaded.sources] == ["k.cc"] and loaded.prebuilt.endswith("._C_ops")
    cube = loaded.ops["cube"]
    assert str(cube.schema) == "cube(Tensor x) -> Tensor" and cube.kernels == {"cpu": "cube_cpu"}
    assert cube.tolerance("float32") == (1e-5, 1e-6), "1e-5 (a string in YAML) is read as a float"
    assert cube.doc == "``x ** 3``, elementwise." and cube.reference is not None
    assert isinstance(cube.backward, manifest.Derivative)
    assert loaded.ops["cube_backward"].backward is None
    assert loaded.ops["mul"].output_specs([np.ones(3, np.float32), np.ones(3, np.float32)])[0].shape == (3,)
    x = np.array([1.0, -2.0, 3.0], np.float32)
    np.testing.assert_array_equal(cube.call(x), x ** 3)


def test_backward_from_derivatives_runs_in_torch_autograd(loaded: opbridge.Library) -> None:
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    y = torch.tensor([4.0, 5.0, -1.0], requires_grad=True)
    out = loaded.ops["mul"].call(loaded.ops["cube"].call(x), y)
    g = torch.tensor([1.0, 2.0, 3.0])
    gx, gy = torch.autograd.grad(out, (x, y), g)
    torch.testing.assert_close(gx, 3 * x.detach() ** 2 * y.detach() * g)
    torch.testing.assert_close(gy, x.detach() ** 3 * g)


@pytest.mark.parametrize("dynamic", [False, True])
def test_arithmetic_in_a_derivative_runs_under_torch_compile(loaded: opbridge.Library, dynamic: bool) -> None:
    """mul's y formula (2 * mul(...) - mul(...)) in a compiled backward: the arithmetic on FakeTensors imports,
    which needs __import__ in the formula's builtins (before: Inductor's KeyError: '__import__')."""
    torch = pytest.importorskip("torch")
    mul = loaded.ops["mul"].call
    x = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    y = torch.tensor([4.0, 5.0, -1.0], requires_grad=True)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would not trace the formula
        torch.compile(lambda a, b: mul(a, b).sum(), fullgraph=True, dynamic=dynamic)(x, y).backward()
    torch.testing.assert_close(y.grad, x.detach())


def test_the_example_plugins_yaml_op_differentiates_in_torch() -> None:
    torch = pytest.importorskip("torch")
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    decl = importlib.import_module("vllm_plugin.ops")
    op = decl.LIBRARY.ops["silu_and_mul"]
    assert isinstance(op.backward, manifest.Derivative) and op.backward.calls == ("silu_and_mul_backward",)
    x = torch.randn(3, 10, dtype=torch.float32, requires_grad=True)
    g = torch.randn(3, 5)
    (grad,) = torch.autograd.grad(op.call(x), x, g)
    a, b = x.detach().double().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    want = torch.cat([g * b * s * (1 + a * (1 - s)), g * a * s], dim=-1)
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-5)


# -- mistakes name the file and line ---------------------------------------------------------


def _load(tmp_path: Path, text: str, library: opbridge.Library | None = None) -> opbridge.Library:
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent(text))
    return manifest.load(path, library)


@pytest.fixture
def host(tmp_path: Path) -> opbridge.Library:
    lib = opbridge.Library(f"mfh_{tmp_path.name[-6:].replace('-', '_')}", root=tmp_path)

    @lib.op("twice(Tensor x) -> Tensor", shape=opbridge.like("x"))
    def twice(x: Any) -> Any:
        return 2 * x

    return lib


@pytest.mark.parametrize(("text", "message"), [
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
         kernal: {cpu: neg_cpu}
     """, r"bad.yaml:3: an ops entry: unknown key\(s\) 'kernal'"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
     """, r"bad.yaml:3: ops entry 'neg\(Tensor x\) -> Tensor': reference is required"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.no_such_function
     """, r"bad.yaml:3: neg: reference 'numpy.no_such_function' cannot be imported"),
    ("""
     ops:
       - func: neg(Tensor x, -> Tensor
         reference: numpy.negative
     """, r"bad.yaml:3: func: neg\(Tensor x, -> Tensor"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x) -> Tensor
         x: negate(grad)
     """, r"bad.yaml:7: derivatives of neg: negate\(...\) is not an op of this library \(ops: neg, twice\)"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x) -> Tensor
         x: twice(grad).sum()
     """, r"bad.yaml:7: derivatives of neg: Attribute is not allowed"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x) -> Tensor
         x: twice(gard)
     """, r"derivatives of neg: unknown name 'gard'"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x) -> Tensor
         x: twice(grad, x)
     """, r"derivatives of neg: twice\(\) takes at most 1 positional argument \(2 given\)"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x) -> Tensor
         x: twice(y=grad)
     """, r"derivatives of neg: twice\(\) got an unexpected keyword argument 'y'"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x) -> Tensor
         x: twice()
     """, r"derivatives of neg: twice\(\) missing required argument 'x' \(schema: twice"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor y) -> Tensor
         y: twice(grad)
     """, r"bad.yaml:7: derivatives: the schema neg\(Tensor y\) -> Tensor differs from the op's"),
    ("""
     ops:
       - func: neg(Tensor x, float a) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x, float a) -> Tensor
         a: twice(grad)
     """, r"'a' is not a differentiable Tensor argument \(those are: x\)"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - name: neg(Tensor x) -> Tensor
         x: twice(result)
     """, r"'result' \(the forward output\) is not saved"),
    ("""
     library: {namespace: other}
     ops: []
     """, r"this file has a library: section, but load\(\) was given a library"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
       - func: axpy_(Tensor(a!) y, Tensor x) -> ()
         reference: numpy.add
     derivatives:
       - name: axpy_(Tensor(a!) y, Tensor x) -> ()
         x: twice(grad)
     """, r"bad.yaml:9: derivatives: axpy_ mutates its arguments in place, so it cannot be differentiated"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
         dtypes: [float32, flaot16]
     """, r"bad.yaml:3: neg: dtypes must name some of .*got \['float32', 'flaot16'\]"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
         dtypes: float32
     """, r"bad.yaml:3: neg: dtypes must be a list of names, got 'float32'"),
    # Entries that are not mappings keep no line of their own: the error names the line of the item.
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         reference: numpy.negative
       - [func, reference]
     """, r"bad.yaml:5: an ops entry must be a mapping, got list"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         reference: numpy.negative

       - neg(Tensor x) -> Tensor
     """, r"bad.yaml:6: an ops entry must be a mapping, got str"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         reference: numpy.negative
         kernels: neg_cpu
     """, r"bad.yaml:5: neg: kernels must be a mapping, got str"),
    ("""
     ops:
       - func: neg(Tensor x) -> Tensor
         shape: {like: x}
         reference: numpy.negative
     derivatives:
       - neg(Tensor x) -> Tensor
     """, r"bad.yaml:7: a derivatives entry must be a mapping, got str"),
    ("""
     ops:
       func: neg(Tensor x) -> Tensor
     """, r"bad.yaml:3: ops must be a list of mappings, got dict"),
])
def test_mistakes_are_declaration_errors_naming_file_and_line(tmp_path: Path, host: opbridge.Library,
                                                              text: str, message: str) -> None:
    with pytest.raises(DeclarationError, match=message):
        _load(tmp_path, text, host)
    assert list(host.ops) == ["twice"], "nothing is declared when the file has a mistake"


def test_op_options_as_in_library_op(tmp_path: Path, host: opbridge.Library) -> None:
    _load(tmp_path, """
        ops:
          - func: scale(Tensor a, Tensor b) -> Tensor
            shape: {like: b}
            reference: operator.mul
            dtypes: [float32, float64]
            dtype_arg: b
            row_strided: [b]
            graph_safe: false
            hints: opbridge.cases.elementwise_cases
        """, host)
    op = host.ops["scale"]
    assert op.dtypes == ("float32", "float64") and op.dtype_arg == 1 and op.row_strided == (1,)
    assert op.hints is cases.elementwise_cases and op.graph_safe is False
    assert host.ops["twice"].graph_safe is True  # the default
    with pytest.raises(DeclarationError, match=r"bad.yaml:3: neg: graph_safe must be true or false, got 'no'"):
        _load(tmp_path, """
            ops:
              - func: neg(Tensor a) -> Tensor
                shape: {like: a}
                reference: operator.neg
                graph_safe: "no"
            """, host)
    with pytest.raises(DeclarationError, match=r"neg: graph_safe must be true or false, got 1"):  # Library.op too
        host.op("neg(Tensor a) -> Tensor", shape=opbridge.like("a"), graph_safe=1)(lambda a: -a)  # type: ignore[arg-type]


def test_a_mutating_op_takes_no_backward_in_python_either(host: opbridge.Library) -> None:
    with pytest.raises(DeclarationError, match=r"inc_: mutates 'x' in place, so it cannot be differentiated"):
        host.op("inc_(Tensor(a!) x) -> ()", backward=lambda x: (None,))(lambda x: None)


def test_ops_join_an_existing_library(tmp_path: Path, host: opbridge.Library,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _load(tmp_path, """
        ops:
          - func: neg(Tensor a) -> Tensor
            kernels: {cpu: my_neg}
            shape: {like: a}
            reference: operator.neg
        derivatives:
          - name: neg(Tensor a) -> Tensor
            a: -1 * twice(grad) / 2
        """, host)
    neg = host.ops["neg"]
    assert neg.kernels == {"cpu": "my_neg"} and neg.library is host
    assert neg.backward is not None and neg.backward.calls == ("twice",)
    # The derivative calls the ops' public callables, looked up when it runs.
    monkeypatch.setattr(host.ops["twice"], "call", lambda x: 2 * x)
    (gx,) = neg.backward(np.array([1.0, 3.0]), np.zeros(2))
    np.testing.assert_array_equal(gx, [-1.0, -3.0])


def test_no_library_and_no_section_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DeclarationError, match="no library: section"):
        _load(tmp_path, "ops: []\n")
