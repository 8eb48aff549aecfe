"""setuptools integration: ``pip install .`` builds a plugin's ops into ``pkg/_C_ops.so``.

A plugin's ``setup.py`` needs two lines, and no list of sources (the
declarations are the one list)::

    from setuptools import setup
    from opbridge.aot.setuptools import cmdclass, opbridge_extensions

    setup(ext_modules=opbridge_extensions("my_plugin", "my_plugin.ops"), cmdclass=cmdclass())

That builds ``my_plugin/_C_ops.so`` from the library's ``.cc`` sources and,
where it has ``.cu`` sources and ``nvcc`` is found, ``my_plugin/_C_ops_cuda.so``
(``OPBRIDGE_AOT_DEVICES`` chooses; see :func:`opbridge_extensions`). An
installed CUDA module gives the ops their CUDA kernels with no compiler at
run time. ``opbridge_extension`` (one device) builds one of them.

``build_ext`` imports the declarations module from the source tree, takes the
:class:`~opbridge.Library` declared with ``prebuilt="my_plugin._C_ops"`` from
the registry and compiles it with opbridge's own ninja build
(:func:`opbridge.aot.build_aot`, objects kept in ``build_temp`` so a rebuild
only recompiles what changed).

The wheel is tagged ``py3-none-<platform>``: the module calls no Python C API
(tvm-ffi's ABI is plain C), so one wheel serves every Python 3 on the
platform. ``py_limited_api`` would give ``cp3X-abi3-<platform>`` instead,
which excludes Pythons older than ``cp3X`` and non-CPython interpreters, and
claims a stable-ABI extension that is not there.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from setuptools import Command, Extension
from setuptools.command.build_ext import build_ext

from opbridge import config
from opbridge.aot.build import DEFAULT_MODULE, build_aot, module_filename
from opbridge.build.toolchain import nvcc_path
from opbridge.config import AOT_DEVICE_CHOICES
from opbridge.errors import BuildError, DeclarationError

try:  # setuptools >= 70.1 ships bdist_wheel
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # pragma: no cover - older setuptools with the wheel package
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel  # type: ignore[no-redef,unused-ignore]
    except ImportError:
        import setuptools as _setuptools

        raise ImportError(
            f"opbridge's wheel builds need setuptools>=70.1 (this environment has {_setuptools.__version__}, "
            "without the wheel package): pip install -U 'setuptools>=70.1'. A build with "
            "--no-build-isolation uses the environment's own setuptools, not the one pyproject.toml asks for"
        ) from None

if TYPE_CHECKING:
    from opbridge.declare import Library

__all__ = ["BdistWheelAnyPython", "BuildOpbridgeExt", "OpbridgeExtension", "cmdclass", "opbridge_extension",
           "opbridge_extensions"]


class OpbridgeExtension(Extension):  # type: ignore[misc,unused-ignore]
    """A setuptools extension built from a declared library instead of a source list.

    Parameters
    ----------
    name
        Dotted module name: the library's ``prebuilt`` (``"pkg._C_ops"``) for
        the CPU, with ``_<device>`` appended for another device.
    declarations
        Module whose import declares the library (``"pkg.ops"``).
    device
        Device the module is built for.
    library
        The library's ``prebuilt`` name (default: *name*, the CPU module).
    """

    def __init__(self, name: str, declarations: str, device: str = "cpu", library: str | None = None) -> None:
        super().__init__(name, sources=[])
        self.declarations = declarations
        self.device = device
        #: The library's ``prebuilt`` (its CPU module's name), which finds it among the declared ones.
        self.library = library or name


def opbridge_extension(package: str, declarations_module: str, *, name: str = DEFAULT_MODULE,
                       device: str = "cpu") -> OpbridgeExtension:
    """The extension that builds *device*'s module from the library *declarations_module* declares.

    Parameters
    ----------
    package
        The plugin's package, e.g. ``"vllm_plugin"``.
    declarations_module
        The module that declares the library, e.g. ``"vllm_plugin.ops"``.
    name
        Module name inside *package* (``_C_ops``); the library must declare
        ``prebuilt="<package>.<name>"``.
    device
        ``"cpu"`` builds ``<package>.<name>``; another device builds
        ``<package>.<name>_<device>`` (``_C_ops_cuda``), where the loader looks for it.

    Returns
    -------
    OpbridgeExtension
        For ``setup(ext_modules=[...])``, with :func:`cmdclass`.
    """
    library = f"{package}.{name}"
    module = library if device == "cpu" else f"{library}_{device}"
    return OpbridgeExtension(module, declarations_module, device, library)


def opbridge_extensions(package: str, declarations_module: str, *,
                        name: str = DEFAULT_MODULE) -> list[OpbridgeExtension]:
    """One extension per device opbridge builds modules for (CPU, CUDA); ``build_ext`` builds those that apply.

    Which apply: the devices ``OPBRIDGE_AOT_DEVICES`` names, when set, and a
    device named there that cannot be built (no sources, no ``nvcc``) fails
    the build. Unset: the CPU module, and the CUDA module when the library has
    CUDA sources and ``nvcc`` is found; without ``nvcc`` the build says it
    leaves the CUDA module out, and the installed ops run on CPU tensors only.
    """
    return [opbridge_extension(package, declarations_module, name=name, device=d) for d in AOT_DEVICE_CHOICES]


def _unbuildable(lib: Library, device: str) -> str | None:
    """Why *lib*'s module for *device* cannot be built here, or None."""
    if not lib.sources_for(device):
        return f"{lib.namespace} has no {device} sources"
    if device == "cuda" and nvcc_path() is None:
        return "nvcc was not found (on PATH, under $CUDA_HOME or $CUDA_PATH)"
    return None


@contextlib.contextmanager
def _prepended(paths: list[str]) -> Iterator[None]:
    saved = list(sys.path)
    sys.path[:0] = paths
    try:
        yield
    finally:
        sys.path[:] = saved


def load_declared_library(ext: OpbridgeExtension, source_root: str | Path) -> Library:
    """Import *ext*'s declarations from *source_root* and return the library it builds.

    Raises
    ------
    DeclarationError
        If the import picks up another copy of the package, or no library
        declares ``prebuilt=ext.name``.
    """
    from opbridge import registry

    root = Path(source_root).resolve()
    with _prepended([str(root)]):
        module = importlib.import_module(ext.declarations)
    where = Path(getattr(module, "__file__", "") or "").resolve()
    if root not in where.parents:
        raise DeclarationError(
            f"{ext.declarations} was imported from {where}, not from the source tree {root}; "
            f"uninstall the other copy or build in a clean environment"
        )
    libs = [lib for lib in registry.libraries() if lib.prebuilt == ext.library]
    if len(libs) != 1:
        declared = {lib.namespace: lib.prebuilt for lib in registry.libraries()}
        raise DeclarationError(
            f"{ext.name}: expected one Library declared with prebuilt={ext.library!r} by "
            f"{ext.declarations}, found {len(libs)} (libraries and their prebuilt names: {declared})"
        )
    return libs[0]


class BuildOpbridgeExt(build_ext):  # type: ignore[misc,unused-ignore]
    """``build_ext`` that builds :class:`OpbridgeExtension` modules with opbridge's ninja build.

    Other extensions in the same ``setup()`` are built as usual.
    """

    def _opbridge_ext(self, fullname: str) -> OpbridgeExtension | None:
        for ext in self.extensions:
            if isinstance(ext, OpbridgeExtension) and ext.name == fullname:
                return ext
        return None

    def get_ext_filename(self, fullname: str) -> str:
        """``pkg/_C_ops.so``: no Python-version suffix (the module is not a CPython extension)."""
        if self._opbridge_ext(fullname) is None:
            return str(super().get_ext_filename(fullname))
        *package, last = fullname.split(".")
        return os.path.join(*package, module_filename(last))

    def _source_root(self) -> Path:
        package_dir: dict[str, str] = self.distribution.package_dir or {}
        base = Path(self.distribution.src_root or os.curdir)
        return base / package_dir.get("", "")

    def run(self) -> None:
        self.extensions: list[Extension] = [ext for ext in self.extensions if self._applies(ext)]
        super().run()

    def _applies(self, ext: Any) -> bool:
        """Whether to build *ext* (see :func:`opbridge_extensions`); says why not, or raises where it must be."""
        if not isinstance(ext, OpbridgeExtension):
            return True
        named = config.aot_devices()
        if named is not None and ext.device not in named:
            print(f"opbridge: not building {ext.name}: OPBRIDGE_AOT_DEVICES={','.join(named)}", file=sys.stderr)
            return False
        if ext.device == "cpu":
            return True
        lib = load_declared_library(ext, self._source_root())
        why = _unbuildable(lib, ext.device)
        if why is None:
            return True
        if named is not None:
            raise BuildError(f"{ext.name}: OPBRIDGE_AOT_DEVICES names {ext.device}, but {why}")
        if lib.sources_for(ext.device):
            print(f"opbridge: WARNING: building {lib.namespace} without its {ext.device} module {ext.name}: "
                  f"{why}; the installed ops will run on CPU tensors only (OPBRIDGE_AOT_DEVICES=cpu,"
                  f"{ext.device} makes this an error)", file=sys.stderr)
        return False

    def build_extension(self, ext: Any) -> None:
        if not isinstance(ext, OpbridgeExtension):
            super().build_extension(ext)
            return
        lib = load_declared_library(ext, self._source_root())
        target = Path(self.get_ext_fullpath(ext.name))
        build_dir = Path(self.build_temp) / "opbridge" / lib.namespace / ext.device
        path = build_aot(lib, target.parent, device=ext.device, name=ext.name.rpartition(".")[2],
                         build_dir=build_dir)
        print(f"opbridge: built {len(lib.ops)} ops of {lib.namespace!r} for {ext.device} into {path}")


class BdistWheelAnyPython(_bdist_wheel):  # type: ignore[misc,unused-ignore]
    """``bdist_wheel`` tagging the wheel ``py3-none-<platform>`` (see the module docstring)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False  # platform-specific, installed into platlib

    def get_tag(self) -> tuple[str, str, str]:
        platform = str(super().get_tag()[2])
        return "py3", "none", platform


def cmdclass() -> dict[str, type[Command]]:
    """``{"build_ext": BuildOpbridgeExt, "bdist_wheel": BdistWheelAnyPython}`` for ``setup(cmdclass=...)``."""
    return {"build_ext": BuildOpbridgeExt, "bdist_wheel": BdistWheelAnyPython}
