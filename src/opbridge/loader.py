"""Load stage: find (prebuilt, cached) or build a library's module, and its kernels."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge import config
from opbridge.build import jit
from opbridge.build.library import KNOWN_DEVICES, build_spec, exports, is_current, signatures
from opbridge.errors import BackendUnavailableError, DeclarationError

if TYPE_CHECKING:
    from opbridge.declare import Library, OpDef

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
    """Build (or reuse) *lib*'s module for *device* and return its path."""
    return jit.build(build_spec(lib, device), force=force)


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
                raise BackendUnavailableError(f"opbridge: library {lib.namespace!r} has no {device} sources{note}")
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

    fn = ctypes.CDLL(str(loaded_path(lib, "cpu")))["__opbridge_threading"]
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
    except (AttributeError, KeyError, RuntimeError):
        raise DeclarationError(
            f"{op.name}: kernel {name!r} is not exported by the {device} module; it exports "
            f"{exports(_PATHS[(op.library.namespace, device)])} (export it with OPBRIDGE_EXPORT({name}))"
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
                 "b": "bool", "o": "another type"}
#: Schema types a kernel must take as one of these letters; any other (a list, a string, an
#: optional scalar) is converted by tvm-ffi's own rules and not checked here.
_SCHEMA_LETTERS = {"Tensor": "T", "Tensor?": "O", "float": "df", "int": "li", "bool": "b"}


def _expected(op: OpDef) -> list[tuple[str, str, str]]:
    """(name, schema type, allowed letters) of each argument the adapters pass *op*'s kernel."""
    outs = [r.name or ("out" if op.n_outputs == 1 else f"out{i}")
            for i, r in enumerate(r for r in op.schema.returns if r.type.alias is None)]
    args = [(name, "Tensor", "T") for name in outs]
    for a in op.schema.arguments:
        t = a.type
        key = "Tensor?" if t.is_tensor and t.optional else str(t.base) if not (t.is_list or t.optional) else ""
        args.append((a.name, str(t), _SCHEMA_LETTERS.get(key, "")))
    return args


def check_signature(op: OpDef, name: str, signature: str) -> None:
    """Check that kernel *name*'s exported *signature* takes what *op*'s schema passes it.

    Raises
    ------
    DeclarationError
        Naming the kernel's parameters, what the schema passes (new outputs
        first, then the schema's arguments in order) and the first mismatch.
    """
    returns, _, letters = signature.partition(":")
    expected = _expected(op)
    takes = ", ".join(_LETTER_TYPES.get(c, c) for c in letters)
    passes = ", ".join(f"{kind} {arg}" for arg, kind, _ in expected)
    where = (f"{op.name}: kernel {name}({takes}) does not take what the schema {str(op.schema)!r} passes it: "
             f"({passes}), the new outputs first, then the schema's arguments in order")
    owning = [i for i, c in enumerate(letters) if c in "XY"]
    if owning:
        i = owning[0]
        raise DeclarationError(
            f"{where}; argument #{i} is {_LETTER_TYPES[letters[i]]}, an owning tensor, but opbridge passes "
            f"tensors as views (its C entries hold no tensor object to give): take "
            f"{'Optional<TensorView>' if letters[i] == 'Y' else 'TensorView'} (opbridge::TensorView) instead")
    if returns != "v":
        raise DeclarationError(f"{where}; it returns a value, but kernels write their outputs into the "
                               f"tensors passed first (destination passing) and return void")
    if len(letters) != len(expected):
        raise DeclarationError(f"{where}; it takes {len(letters)} argument(s), the schema passes {len(expected)}")
    for i, (letter, (arg, kind, allowed)) in enumerate(zip(letters, expected, strict=True)):
        if allowed and letter not in allowed:
            raise DeclarationError(f"{where}; argument #{i} ({kind} {arg}) arrives as "
                                   f"{' or '.join(_LETTER_TYPES[c] for c in allowed)}, the kernel takes "
                                   f"{_LETTER_TYPES.get(letter, letter)}")
