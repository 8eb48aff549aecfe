"""The ``ops.Custom(func_type="aot")`` primitive of one op: shapes from the declaration, errors by dry run.

MindSpore infers an aot op's output shapes in Python while it compiles (or
records) a call; :class:`OpCustom` answers from the op's declared shape rule.
The kernel's own argument checks run there too: the entry point is called
once on zero-filled buffers of the inferred shapes ("dry run", cached per
signature, skipped above :data:`opbridge.call.core.DRY_RUN_MAX_BYTES`), so a bad call raises the
kernel's ``TypeError`` / ``ValueError`` naming op and argument from the
compile, instead of MindSpore's ``RuntimeError`` when the graph runs. Under
``mindspore.ops.vmap`` the primitive gives MindSpore its own rule
(:meth:`OpCustom.get_vmap_rule`, :mod:`.vmap`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mindspore import Tensor, ops
from mindspore.common import dtype as mstype

from opbridge.adapters.mindspore.shim import AotModule, aot_module
from opbridge.adapters.mindspore.support import DTYPES, dtype_name, ms_dtype
from opbridge.adapters.mindspore.vmap import make_rule
from opbridge.call import unpassable
from opbridge.call.core import dry_run_fits, dtype_error

if TYPE_CHECKING:
    from opbridge.declare import OpDef

_STATE = threading.local()


class _Meta:
    """Shape and dtype of a tensor, for the declared shape rule."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: Sequence[int], dtype: Any) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype


def check_call(op: OpDef, args: Sequence[Any], dry_run: bool = True,
               module: AotModule | None = None) -> tuple[Any, ...]:
    """Output specs of *op* for *args*, after running its kernel's checks on them.

    *args* are, in schema order, anything with ``.shape``/``.dtype`` for
    tensors and Python values for scalars. The dtype of ``op.dtype_arg``
    must be one the op declares. Unless *dry_run* is false, the shapes are
    static and inputs plus outputs fit in :data:`opbridge.call.core.DRY_RUN_MAX_BYTES` (else an error
    surfaces as MindSpore's RuntimeError when the graph runs), the op's
    entry point runs on zero-filled buffers of these shapes and dtypes and
    its error (``TypeError`` / ``ValueError`` naming op and argument) is
    raised here. Builds the wrapper module (*module*, default: the library's
    current one) if needed.
    """
    lead = op.schema.arguments[op.dtype_arg]
    got = dtype_name(args[op.dtype_arg].dtype)
    if got not in op.dtypes:
        raise dtype_error(op, lead.name, got)
    module = module or aot_module(op.library)
    specs = op.output_specs(args)
    tensors = [(a, tuple(int(d) for d in x.shape), ms_dtype(x.dtype))
               for a, x in zip(op.schema.arguments, args, strict=True) if a.type.is_tensor]
    outputs = [(tuple(int(d) for d in s.shape), ms_dtype(s.dtype)) for s in specs]
    for a, _, dtype in tensors:
        if dtype not in DTYPES:  # the op's TypeError naming it, as in PyNative and every framework
            raise unpassable.error(op, a.name, unpassable.Unpassable(
                f"dtype {dtype_name(dtype)}", f"opbridge's graph entry points take "
                f"{', '.join(name for name, _ in DTYPES.values())} only", f'astype("{got}")'))
    for _, dtype in outputs:
        if dtype not in DTYPES:
            raise TypeError(f"{op.name}: output dtype {dtype} cannot be passed to a kernel")
    shapes = [s for _, s, _ in tensors] + [s for s, _ in outputs]
    dynamic = any(d < 0 for s in shapes for d in s)
    total = sum(int(np.prod(s, dtype=np.int64)) * DTYPES[d][1] for _, s, d in tensors)
    total += sum(int(np.prod(s, dtype=np.int64)) * DTYPES[d][1] for s, d in outputs)
    if dry_run and not dynamic and dry_run_fits(total):
        inputs = [(tuple(x.shape), ms_dtype(x.dtype)) if a.type.is_tensor else x
                  for a, x in zip(op.schema.arguments, args, strict=True)]
        module.dry_run(op, inputs, outputs)
    else:
        module.ready()
    return specs


class checked:  # noqa: N801 - used as ``with checked():``
    """Within the block primitives skip their dry run: the caller ran :func:`check_call` on real values."""

    def __enter__(self) -> None:
        self.prev = getattr(_STATE, "checked", False)
        _STATE.checked = True

    def __exit__(self, *exc: object) -> None:
        _STATE.checked = self.prev


class OpCustom(ops.Custom):  # type: ignore[misc]
    """``ops.Custom`` for one op: inference from the declaration, validation by a dry run."""

    def __init__(self, op: OpDef, module: AotModule, bprop: Callable[..., Any]) -> None:
        self.opdef = op
        self.aot = module
        super().__init__(f"{module.path}:opb_ms_{op.name}", out_shape=self._unused, out_dtype=self._unused,
                         func_type="aot", bprop=bprop)
        self.add_prim_attr("opbridge_op", op.qualname)
        self._vmap_rule: Callable[..., Any] | None = None

    def get_vmap_rule(self) -> Callable[..., Any]:
        """The rule MindSpore's ``vmap`` asks this primitive for (:mod:`.vmap`): one call over the declared rows."""
        if self._vmap_rule is None:
            self._vmap_rule = make_rule(self)
        return self._vmap_rule

    @staticmethod
    def _unused(*_: Any) -> None:  # pragma: no cover - __infer__ is overridden
        return None

    def __infer__(self, *args: Any) -> dict[str, Any]:
        op = self.opdef
        schema_args = op.schema.arguments
        if len(args) != len(schema_args):
            raise TypeError(f"{op.name}: the graph primitive takes {len(schema_args)} inputs, "
                            f"got {len(args)}")
        metas: list[Any] = []
        for a, info in zip(schema_args, args, strict=True):
            if a.type.is_tensor:
                if not isinstance(info["dtype"], mstype.TensorType):
                    raise TypeError(f"{op.name}: argument '{a.name}' must be a mindspore.Tensor, "
                                    f"got {info['dtype']}")
                if any(d < 0 for d in info["shape"]):
                    # MindSpore re-infers aot ops of dynamic shape only through a C++ infer function.
                    raise NotImplementedError(
                        f"{op.name}: argument '{a.name}' has a dynamic shape {list(info['shape'])} in this "
                        f"graph; opbridge ops in MindSpore graphs need static shapes")
                metas.append(_Meta(info["shape"], ms_dtype(info["dtype"])))
            else:
                # A constant's value is known while compiling; otherwise check with the default.
                value = info.get("value")
                if isinstance(value, Tensor):
                    value = value.asnumpy().reshape(()).item()
                elif value is None:
                    value = a.default if a.has_default else (False if a.type.base == "bool" else 0)
                metas.append(value)
        specs = check_call(op, metas, dry_run=not getattr(_STATE, "checked", False), module=self.aot)
        shapes = [list(s.shape) for s in specs]
        out_dtypes = [mstype.TensorType(ms_dtype(s.dtype)) for s in specs]
        if len(specs) == 1:
            return {"shape": shapes[0], "dtype": out_dtypes[0], "value": None}
        return {"shape": tuple(shapes), "dtype": tuple(out_dtypes), "value": None}


_OpCustom = OpCustom  # the name before the split into modules
