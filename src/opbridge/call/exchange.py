"""The tensor entry (``exchange_entry.cc``): an op's public callable in C on other frameworks' tensors.

It reads a tensor type one of two ways: through DLPack's C exchange table
where the type exports one (``__dlpack_c_exchange_api__``: Paddle's), or
through the methods its Python API shares with torch's (``data_ptr()``,
``shape``, ``dtype``, ``is_contiguous()``, ``stride()``: MindSpore's;
``method_arrays.h``), making new outputs with the framework's own allocator.

An adapter asks :func:`install` for each op on its first call, describing
its tensors once (:class:`Framework`, with :class:`Methods` for the second
way). Once the entry library is loaded (built in the background once per
Python version: :class:`opbridge.call.c_entry.CEntry`), the op's public
callable calls the entry first for arguments of that exact type (and its
``out=`` builtin for a call with ``out=`` one such tensor); the entry runs
what the adapter's Python fast path would (CPU tensors, contiguous or
declared rows at a stride, a declared dtype, nothing to record for autograd,
small outputs) and returns ``NotImplemented`` for the rest, which the
adapter's own call then takes as before. ``OPBRIDGE_EXCHANGE_ENTRY=0`` turns
it off.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opbridge import config
from opbridge._tvm import capsule_pointer, load_library
from opbridge.call import c_entry, callable, memory

if TYPE_CHECKING:
    from opbridge.build.compile import BuildSpec
    from opbridge.declare import OpDef

SOURCE = Path(__file__).with_name("exchange_entry.cc")


def exchange_table(array_type: type) -> int | None:
    """The address of *array_type*'s DLPack exchange table, or None where it has none."""
    capsule = getattr(array_type, "__dlpack_c_exchange_api__", None)
    if capsule is None:
        return None
    try:
        address: int | None = capsule_pointer(capsule, b"dlpack_exchange_api")
    except ValueError:  # not a capsule of that name
        return None
    return address


class Library:
    """The loaded entry library."""

    def __init__(self, path: Path) -> None:
        lib = load_library(path, python_api=True)  # its entry points hold the GIL and may set Python errors
        lib.opb_ex_entry.argtypes = [ctypes.py_object, ctypes.c_void_p, ctypes.py_object, ctypes.py_object,
                                     ctypes.py_object, ctypes.py_object, ctypes.c_void_p, ctypes.py_object,
                                     ctypes.py_object, ctypes.py_object, ctypes.py_object, ctypes.py_object,
                                     ctypes.py_object, ctypes.c_int, ctypes.py_object, ctypes.c_int64]
        lib.opb_ex_entry.restype = ctypes.py_object
        lib.opb_ex_method_entry.argtypes = [*[ctypes.py_object] * 9, ctypes.c_void_p, *[ctypes.py_object] * 6,
                                            ctypes.c_int, ctypes.py_object, ctypes.c_int64]
        lib.opb_ex_method_entry.restype = ctypes.py_object
        lib.opb_ex_calls.argtypes = [ctypes.py_object]
        lib.opb_ex_calls.restype = ctypes.c_int64
        lib.opb_ex_live.restype = ctypes.c_int64
        self.lib = lib
        self.path = path

    def entry(self, op: OpDef, kernel: Any, framework: Framework) -> tuple[Callable[..., Any], Callable[..., Any], Any]:
        """*op*'s builtins on *framework*'s tensors (the call; the call with ``out=`` last) and the capsule of
        its state (for :meth:`calls`)."""
        facts = (kernel, kernel.__chandle__(), *c_entry.op_facts(op, framework.dtype_name), memory.MIN_BYTES)
        m = framework.methods
        if m is not None:
            dtypes = [(d, c_entry.dl_code(name)) for d, name in m.dtypes.items()]
            fn, fn_out, capsule = self.lib.opb_ex_method_entry(
                framework.tensor_type, framework.grad_enabled, m.before, m.new_output, m.host[0], m.host[1],
                m.unready, dtypes, *facts)
            return fn, fn_out, capsule
        table = exchange_table(framework.tensor_type)
        if table is None:
            raise TypeError(f"{framework.tensor_type!r} has no DLPack exchange table")
        fn, fn_out, capsule = self.lib.opb_ex_entry(
            framework.tensor_type, table, framework.grad_enabled, framework.no_grad_attr, framework.bump, *facts)
        return fn, fn_out, capsule

    def calls(self, capsule: Any) -> int:
        """How many calls the entry of *capsule*'s op completed itself."""
        return int(self.lib.opb_ex_calls(capsule))

    def live(self) -> int:
        """How many outputs the entry made that their framework has not freed yet."""
        return int(self.lib.opb_ex_live())


class Methods:
    """How the entry reads a tensor type that has no exchange table, through its methods (``method_arrays.h``).

    *dtypes* maps each framework dtype object the entry takes to its name
    (``"float32"``; the framework keeps one object per dtype, compared by
    identity); *new_output* ``(shape, code) -> tensor | None`` makes a new
    contiguous CPU tensor (*code*: :func:`opbridge.call.c_entry.dl_code`; None
    leaves the call to the Python path); *before* ``() -> None`` runs before a
    call reads any tensor (MindSpore: wait for queued work), or None; *host*
    is the attribute naming a tensor's device and its value for host memory;
    *unready* names an attribute true while a tensor has no memory yet, or None.
    """

    def __init__(self, dtypes: dict[Any, str], new_output: Callable[[tuple[int, ...], int], Any],
                 before: Callable[[], None] | None, host: tuple[str, str], unready: str | None) -> None:
        self.dtypes, self.new_output, self.before, self.host, self.unready = dtypes, new_output, before, host, unready


class Framework:
    """What the entry needs to know of one framework's tensors.

    *name* keys its prelude in the op's callable; *tensor_type* is the type
    the entry takes (exactly for the dispatching tensor; the others may be a
    subclass: a model's parameters); *grad_enabled* ``() -> bool`` says whether the
    framework records gradients now, and *no_grad_attr* names the tensor
    attribute that is true when a tensor needs none (then the entry takes the
    call: nothing to record; None: any recording leaves the call to Python);
    *bump* names a method to call on each argument the kernel wrote (Paddle's
    inplace version), or None; *dtype_name* names a framework dtype
    (``"float32"``). *methods*: read the tensors through their methods
    (:class:`Methods`); None: through the type's DLPack exchange table.
    """

    def __init__(self, name: str, tensor_type: type, grad_enabled: Callable[[], bool], no_grad_attr: str | None,
                 bump: str | None, dtype_name: Callable[[Any], str], methods: Methods | None = None) -> None:
        self.name, self.tensor_type, self.grad_enabled = name, tensor_type, grad_enabled
        self.no_grad_attr, self.bump, self.dtype_name, self.methods = no_grad_attr, bump, dtype_name, methods

    def readable(self) -> bool:
        """Whether the entry can read this framework's tensors (methods, or an exchange table)."""
        return self.methods is not None or exchange_table(self.tensor_type) is not None


def spec() -> BuildSpec:
    """The entry's build: this interpreter's headers, its ABI in the defines (the key)."""
    from opbridge.build.compile import BuildSpec

    abi = sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag
    return BuildSpec(name="opbridge_exchange_entry", sources=(SOURCE,),
                     include_dirs=(Path(sysconfig.get_paths()["include"]),), cflags=(f"-DOPB_PYTHON_ABI={abi}",),
                     flags_for_sources_only=True)  # its runtime unit: NumPy's entry's object


#: When the entry is built and loaded.
ENTRY: c_entry.CEntry[Library] = c_entry.CEntry(
    "the tensor C entry", __name__, spec, Library, config.exchange_entry,
    "Paddle and MindSpore calls stay on their Python fast path")

#: qualname, framework name -> (the library, the op's state): :func:`entry_calls` reads the counter.
ENTRIES: dict[tuple[str, str], tuple[Library, Any]] = {}
#: (qualname, framework name) of every op :func:`install` was asked for
_ASKED: set[tuple[str, str]] = set()


def entry_calls(op: OpDef, framework: str) -> int | None:
    """How many calls of *op* on *framework*'s tensors the entry completed itself (None: none here)."""
    got = ENTRIES.get((op.qualname, framework))
    return None if got is None else got[0].calls(got[1])


def install(op: OpDef, kernel: Any, framework: Framework) -> None:
    """Put the entry first in *op*'s public callable for *framework*'s tensors, once it is loaded.

    Nothing happens where the entry cannot read the tensor type, the kernel
    is not a tvm-ffi function, or the entry cannot run the op
    (:func:`opbridge.call.c_entry.takes`). Once per op and framework: a
    later call (the adapter's call for a subclass) changes nothing.
    """
    key = (op.qualname, framework.name)
    if key in _ASKED or not framework.readable() or not hasattr(kernel, "__chandle__"):
        return
    _ASKED.add(key)

    def with_entry(lib: Library) -> None:
        try:
            fn, fn_out, state = lib.entry(op, kernel, framework)
        except TypeError:  # a table of another DLPack major version: the Python path stays
            return
        ENTRIES[(op.qualname, framework.name)] = (lib, state)
        key = f"_ex_{framework.name}"
        callable.install_prelude(op, key, c_entry.prelude_source(op, f"{key}_T", f"{key}_c"),
                                 {f"{key}_T": framework.tensor_type, f"{key}_c": fn, f"{key}_co": fn_out},
                                 out_prelude=c_entry.out_prelude_source(op, f"{key}_T", f"{key}_co"), first=True)

    ENTRY.when_ready(op, with_entry)
