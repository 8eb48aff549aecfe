"""OpDef.backward_reads: which Tensor arguments a declared backward reads, so autograd keeps only those."""

from __future__ import annotations

import itertools
from typing import Any

import opbridge
from opbridge import ops

_NS = itertools.count()


def _op(backward: Any, schema: str = "f(Tensor x, Tensor y, float a) -> Tensor") -> opbridge.OpDef:
    lib = opbridge.Library(f"backward_reads_{next(_NS)}", sources=[])
    lib.op(schema, shape=opbridge.like("x"), backward=backward)(lambda x, y, a: x)
    return lib.ops["f"]


def test_parameters_the_code_never_loads_are_not_read() -> None:
    assert _op(lambda g, x, y, a: (g * a, g)).backward_reads == frozenset()
    assert _op(lambda g, x, y, a: (g * y, g * x)).backward_reads == {0, 1}
    assert ops.add.opdef.backward_reads == frozenset()
    assert ops.rms_norm.opdef.backward_reads == {0, 1}


def test_every_tensor_where_the_code_cannot_say() -> None:
    assert _op(lambda *a: (a[0], a[0])).backward_reads == {0, 1}  # *args

    class Backward:
        def __call__(self, g: Any, x: Any, y: Any, a: float) -> Any:
            return g, g

    assert _op(Backward()).backward_reads == {0, 1}  # no __code__ of its own


def test_a_name_used_by_a_nested_function_is_read() -> None:
    def backward(g: Any, x: Any, y: Any, a: float) -> Any:
        def scaled(t: Any) -> Any:
            return t * y
        return scaled(g), g

    assert _op(backward).backward_reads == {1}
