"""Load stage: find (prebuilt, cached) or build a library's module, and its kernels."""

from __future__ import annotations

import importlib.util
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge import config
from opbridge.build import jit
from opbridge.build.library import (
    KNOWN_DEVICES,
    build_spec,
    check_kernels,
    exports,
    is_current,
    missing_kernel,
    signatures,
)
from opbridge.errors import BackendUnavailableError, DeclarationError

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef
    from opbridge.schema import Type

__all__ = ["KNOWN_DEVICES", "build", "build_spec", "exports", "kernel", "load", "loaded_path", "threading_policy"]

_LOCK = threading.Lock()
_MODULES: dict[tuple[str, str], Any] = {}
_PATHS: dict[tuple[str, str], Path] = {}
#: (namespace, device) -> each exported kernel's signature (empty for modules that record none).
_SIGNATURES: dict[tuple[str, str], dict[str, str]] = {}
#: (namespace, kernel, device) of the kernels whose signature was checked against their op's schema.
_CHECKED: set[tuple[str, str, str]] = set()
#: (namespace, device) of the modules loaded from an installed AOT build.
_PREBUILT: set[tuple[str, str]] = set()


def _prebuilt_path(lib: Library, device: str) -> Path | None:
    """The AOT module for *lib* and *device*, if it was built and installed; never raises."""
    name = lib.prebuilt_module(device)
    if name is None:
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin)
    if lib.sources and all(s.exists() for s in lib.sources):
        # A source tree (editable install): a module built from older sources is stale.
        if not is_current(lib, path, device):
            return None
    return path


def build(lib: Library, device: str = "cpu", force: bool = False) -> Path:
    """Build (or reuse) *lib*'s module for *device* and return its path.

    Raises
    ------
    DeclarationError
        If the module does not export a kernel an op of *lib* declares for *device*
        (:func:`~opbridge.build.library.check_kernels`: a misspelt kernel name fails here).
    """
    path = jit.build(build_spec(lib, device), force=force)
    check_kernels(lib, device, path)
    return path


def load(lib: Library, device: str = "cpu") -> Any:
    """Return *lib*'s loaded module for *device*: prebuilt, else cached, else built now."""
    key = (lib.namespace, device)
    mod = _MODULES.get(key)
    if mod is not None:
        return mod
    with _LOCK:
        mod = _MODULES.get(key)
        if mod is None:
            from opbridge._tvm import tvm_ffi

            config.threading()  # a misspelt OPBRIDGE_THREADING fails here, not silently
            prebuilt = _prebuilt_path(lib, device)
            note = lib.missing_module_note(device) if prebuilt is None else ""
            if note:  # an installed package without this device's module, and no sources to build it
                raise BackendUnavailableError(f"library {lib.namespace!r} has no {device} sources{note}")
            if prebuilt is not None:  # the check of every declared kernel, once per module load
                check_kernels(lib, device, prebuilt, "prebuilt")
            path = prebuilt or build(lib, device)
            mod = tvm_ffi().load_module(str(path))
            if prebuilt is not None:
                _PREBUILT.add(key)
            _MODULES[key] = mod
            _PATHS[key] = path
    return mod


def threading_policy(lib: Library) -> str:
    """The threading policy in force in *lib*'s loaded CPU module: ``"omp"`` or ``"pool"``."""
    import ctypes

    from opbridge._tvm import load_library

    fn = load_library(loaded_path(lib, "cpu"))["__opbridge_threading"]
    fn.restype = ctypes.c_int
    return "omp" if fn() == 1 else "pool"


def loaded_prebuilt(lib: Library, device: str = "cpu") -> bool:
    """Whether *lib*'s *device* module was loaded from an installed AOT build (nothing was compiled)."""
    return (lib.namespace, device) in _PREBUILT


def loaded_path(lib: Library, device: str = "cpu") -> Path:
    """Path of the module :func:`load` loaded for *lib* and *device*."""
    load(lib, device)
    return _PATHS[(lib.namespace, device)]


def kernel(op: OpDef, device: str) -> Any:
    """Return *op*'s compiled kernel for *device* as a callable tvm-ffi function."""
    name = op.kernels.get(device)
    if name is None:
        raise BackendUnavailableError(
            f"{op.name}: no {device} kernel declared (available: {', '.join(op.kernels) or 'none'})"
            f"{op.library.missing_module_note(device)}"
        )
    mod = load(op.library, device)
    try:
        fn = mod[name]
    except (AttributeError, KeyError, RuntimeError):  # an op declared after its module was loaded
        path = _PATHS[(op.library.namespace, device)]
        try:
            exported = exports(path)
        except (AttributeError, OSError):
            exported = []
        raise DeclarationError(
            f"{missing_kernel(op, device, exported, 'loaded')}\n  module: {path}\n  it exports: "
            f"{', '.join(sorted(exported)) or 'nothing'} (export it with OPBRIDGE_EXPORT({name}))"
        ) from None
    checked = (op.library.namespace, name, device)
    if checked not in _CHECKED:
        key = (op.library.namespace, device)
        sigs = _SIGNATURES.get(key)
        if sigs is None:
            sigs = _SIGNATURES[key] = signatures(_PATHS[key])
        if name in sigs:
            check_signature(op, name, sigs[name])
        _CHECKED.add(checked)
    return fn


#: Kernel argument letters (``export.h``'s ``kind_letter``) as C++ types, for messages.
_LETTER_TYPES = {"T": "TensorView", "O": "Optional<TensorView>", "X": "tvm::ffi::Tensor",
                 "Y": "Optional<tvm::ffi::Tensor>", "d": "double", "f": "float", "l": "int64_t", "i": "int32_t",
                 "n": "an unsigned or narrower integer", "b": "bool", "s": "tvm::ffi::String",
                 "a": "tvm::ffi::Any", "o": "another type"}
#: The letter a kernel takes each schema scalar type as (a list: ``[`` and this letter, an optional
#: value: ``?`` before it). Left unchecked, converted by tvm-ffi's own rules (whose error names the
#: kernel, not the op): ``Tensor[]`` and ``ScalarType`` arguments, and a type the recording has no
#: letter for (``o``: a nested list, a tvm-ffi ``Tuple``, ``Variant`` or ``Map``) taken for a list,
#: a ``str`` or an optional scalar, which is also how modules built before opbridge recorded
#: those record every list, string and optional scalar.
_SCALAR_LETTERS = {"float": "d", "int": "l", "bool": "b", "str": "s"}
#: What a narrower kernel type than the schema's does to the values it is passed.
_NARROW = {("f", "d"): "which would round every value to float precision silently",
           ("i", "l"): "which would truncate values beyond its range silently",
           ("n", "l"): "which would truncate values beyond its range silently"}
#: One argument's code in a recorded signature: ``?`` (optional) and ``[`` (a list) before a letter.
_CODE = re.compile(r"[?\[]*.")


def _type_name(code: str) -> str:
    """The C++ type a recorded argument *code* stands for, for messages."""
    if code.startswith("?"):
        return f"Optional<{_type_name(code[1:])}>"
    if code.startswith("["):
        return f"tvm::ffi::Array<{_type_name(code[1:])}>"
    return _LETTER_TYPES.get(code, code)


def _allowed(t: Type) -> tuple[str, ...]:
    """The codes a kernel may take schema type *t* as, the one to advise first; empty if unchecked."""
    if t.is_tensor:
        return ("O",) if t.optional else ("T",)
    letter = _SCALAR_LETTERS.get(t.base)
    if letter is None:  # Tensor[], ScalarType
        return ()
    codes = ("[" + letter, "[a") if t.is_list else (letter,)
    unknown = ("o",) if t.is_list or t.optional or t.base == "str" else ()
    # Any takes every value; an optional kernel parameter also takes a value that is always given.
    if t.optional:
        return (*(f"?{c}" for c in codes), "?a", "a", *unknown)
    return (*codes, "a", *(f"?{c}" for c in codes), *unknown)


def _expected(op: OpDef) -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, schema type, allowed codes) of each argument the adapters pass *op*'s kernel."""
    outs = [r.name or ("out" if op.n_outputs == 1 else f"out{i}")
            for i, r in enumerate(r for r in op.schema.returns if r.type.alias is None)]
    args: list[tuple[str, str, tuple[str, ...]]] = [(name, "Tensor", ("T",)) for name in outs]
    args += [(a.name, str(a.type), _allowed(a.type)) for a in op.schema.arguments]
    return args


def check_signature(op: OpDef, name: str, signature: str) -> None:
    """Check that kernel *name*'s exported *signature* takes what *op*'s schema passes it.

    Each tensor, scalar (``float`` as ``double``, ``int`` as ``int64_t``: a narrower type
    would round or truncate silently), ``str`` and list of them, optional or not, is checked;
    ``Tensor[]`` and ``ScalarType`` are not (tvm-ffi converts them by its own rules), nor are
    kernels of a module built before opbridge recorded signatures.

    Raises
    ------
    DeclarationError
        Naming the kernel's parameters, what the schema passes (new outputs
        first, then the schema's arguments in order) and the first mismatch.
    """
    returns, _, letters = signature.partition(":")
    codes = _CODE.findall(letters)
    expected = _expected(op)
    takes = ", ".join(_type_name(c) for c in codes)
    passes = ", ".join(f"{kind} {arg}" for arg, kind, _ in expected)
    where = (f"{op.name}: kernel {name}({takes}) does not take what the schema {str(op.schema)!r} passes it: "
             f"({passes}), the new outputs first, then the schema's arguments in order")
    owning = [i for i, c in enumerate(codes) if c in ("X", "Y")]
    if owning:
        i = owning[0]
        raise DeclarationError(
            f"{where}; argument #{i} is {_LETTER_TYPES[codes[i]]}, an owning tensor, but opbridge passes "
            f"tensors as views (its C entries hold no tensor object to give): take "
            f"{'Optional<TensorView>' if codes[i] == 'Y' else 'TensorView'} (opbridge::TensorView) instead")
    if returns != "v":
        raise DeclarationError(f"{where}; it returns a value, but kernels write their outputs into the "
                               f"tensors passed first (destination passing) and return void")
    if len(codes) != len(expected):
        raise DeclarationError(f"{where}; it takes {len(codes)} argument(s), the schema passes {len(expected)}")
    for i, (code, (arg, kind, allowed)) in enumerate(zip(codes, expected, strict=True)):
        if allowed and code not in allowed:
            want = allowed[0]
            narrow = _NARROW.get((code[-1:], want[-1]), "") if code[:-1] == want[:-1] else ""
            raise DeclarationError(f"{where}; argument #{i} ({kind} {arg}) arrives as {_type_name(want)}, the "
                                   f"kernel takes {_type_name(code)}{', ' + narrow if narrow else ''}: take "
                                   f"{_type_name(want)}")
