"""The package's shape (issue 18): one-way imports, small modules, C++ kept out of Python."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "opbridge"
MAX_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    big = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (each holds two things; split it): {big}"


def test_no_import_cycle() -> None:
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("opbridge", include_external_packages=False, exclude_type_checking_imports=True)
    cyclic = []
    for m in sorted(graph.modules):
        for n in graph.find_modules_directly_imported_by(m):
            if n != m and graph.chain_exists(importer=n, imported=m):
                cyclic.append((m, n))
    assert not cyclic, f"import cycles (pairs that reach each other): {cyclic[:10]}"


_CXX = re.compile(r"^\s*(#include\s*[<\"]|extern \"C\"|template\s*<|__global__\s)", re.M)


def test_no_cxx_source_in_python_strings() -> None:
    found = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if _CXX.search(p.read_text())]
    assert not found, f"C++ held in Python strings (keep it in a .cc/.tmpl file read at run time): {found}"


def test_the_torch_shims_cache_key_covers_every_header_it_includes() -> None:
    """A header the shim includes but its key leaves out would let an edited header reuse a stale shim."""
    import re

    from opbridge.adapters.torch.native import build

    local = {p.name for p in build.SOURCES if p.parent == build.SOURCE.parent}
    ours = {f"opbridge/{p.name}" for p in build.SOURCES if p.parent == build.INCLUDE_DIR / "opbridge"}
    for src in build.SOURCES:
        for quoted, angled in re.findall(r'#include\s+(?:"([^"]+)"|<(opbridge/[^>]+)>)', src.read_text()):
            assert (quoted in local) if quoted else (angled in ours), f"{src.name} includes {quoted or angled}"


def test_every_file_the_package_reads_at_run_time_ships_in_the_wheel() -> None:
    """Kernel sources, headers and templates are read at run time (JIT builds, the C entries):
    each must match a pyproject package-data pattern, or an installed opbridge lacks it."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((SRC.parent.parent / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["opbridge"]
    files = [p.relative_to(SRC) for p in SRC.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
             and "__pycache__" not in p.parts]
    missing = [str(f) for f in files if not any(f.match(pat) and len(f.parts) == len(Path(pat).parts)
                                                 for pat in patterns)]
    assert files and not missing, f"not in pyproject's [tool.setuptools.package-data]: {missing}"
