"""What MindSpore graph mode supports, MindSpore's dtypes by name, and generated files in the cache.

Shared by the eager path (:mod:`.eager`), the aot shim (:mod:`.shim`), the
primitive (:mod:`.primitive`) and the graph substitutes (:mod:`.graph`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mindspore.common import dtype as mstype

from opbridge.build.cache import cache_root

if TYPE_CHECKING:
    from opbridge.declare import OpDef

#: schema scalar type -> (MindSpore dtype it travels as into an aot entry point, its kind there)
SCALARS: dict[str, tuple[Any, str]] = {
    "float": (mstype.float64, "kFloatArg"),
    "int": (mstype.int64, "kIntArg"),
    "bool": (mstype.bool_, "kBoolArg"),
}

#: MindSpore dtype -> (its name: in op declarations and in the aot ABI, bytes per element)
DTYPES: dict[Any, tuple[str, int]] = {
    mstype.float16: ("float16", 2),
    mstype.bfloat16: ("bfloat16", 2),
    mstype.float32: ("float32", 4),
    mstype.float64: ("float64", 8),
    mstype.int8: ("int8", 1),
    mstype.int16: ("int16", 2),
    mstype.int32: ("int32", 4),
    mstype.int64: ("int64", 8),
    mstype.uint8: ("uint8", 1),
    mstype.uint16: ("uint16", 2),
    mstype.uint32: ("uint32", 4),
    mstype.uint64: ("uint64", 8),
    mstype.bool_: ("bool", 1),
    mstype.complex64: ("complex64", 8),
    mstype.complex128: ("complex128", 16),
}


def ms_dtype(d: Any) -> Any:
    """A MindSpore element dtype from a dtype object or a name like ``"int64"``."""
    if isinstance(d, mstype.TensorType):
        return d.element_type()
    if isinstance(d, str):
        return mstype.bool_ if d == "bool" else getattr(mstype, d)
    return d


def dtype_name(d: Any) -> str:
    """The opbridge name (``"float32"``, ``"bfloat16"``, ...) of a MindSpore dtype."""
    d = ms_dtype(d)
    found = DTYPES.get(d)
    return found[0] if found is not None else str(d).lower()


def unsupported_reason(op: OpDef) -> str | None:
    """Why *op* cannot run inside a MindSpore graph, or None when it can."""
    if "cpu" not in op.kernels:
        return "it declares no cpu kernel"
    if op.schema.is_mutating or any(r.type.alias is not None for r in op.schema.returns):
        return "it mutates its arguments in place, which MindSpore graphs cannot express"
    for a in op.schema.arguments:
        t = a.type
        if t.is_tensor and t.optional:
            return f"argument '{a.name}' is an optional Tensor"
        if t.is_tensor:
            continue
        if t.is_list or t.optional or t.base not in SCALARS:
            return f"argument '{a.name}' has type {t}; graph mode passes Tensor, float, int and bool"
    return None


def write_source(stem: str, text: str, suffix: str = ".py") -> Path:
    """Write generated source into ``<cache>/mindspore/<stem>-<hash><suffix>`` (atomically) and return its path.

    MindSpore parses graph code from its file, so generated graph functions
    live there rather than in memory.
    """
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = cache_root() / "mindspore" / f"{stem}-{digest}{suffix}"
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


#: Serialises building and loading the aot modules and the graph substitutes.
LOCK = threading.RLock()
