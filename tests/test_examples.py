"""The README's examples are the files in examples/, and they run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart"


def _readme_blocks() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    blocks = {}
    for _lang, body in re.findall(r"```(cpp|python)\n(.*?)```", text, re.S):
        first, rest = body.split("\n", 1)
        blocks[first.lstrip("/# ").strip()] = rest
    return blocks


@pytest.mark.parametrize("name", ["scale.cc", "myops.py", "other_frameworks.py"])
def test_readme_quickstart_is_the_example_file(name: str) -> None:
    assert _readme_blocks()[name] == (QUICKSTART / name).read_text()


def test_readme_links_lead_somewhere() -> None:
    """Every relative link of the README and the docs names a file that is there."""
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), (doc.name, target)


def test_quickstart_is_short() -> None:
    lines = sum(len([ln for ln in (QUICKSTART / n).read_text().splitlines() if ln.strip()])
                for n in ("scale.cc", "myops.py"))
    assert lines < 25


def test_quickstart_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "myops.py"], cwd=QUICKSTART, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["tensor([2., 2., 2.])"] * 2


def test_quickstart_in_numpy_and_jax_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # myops.py's own lines use it
    pytest.importorskip("jax")
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "other_frameworks.py"], cwd=QUICKSTART, env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["tensor([2., 2., 2.])"] * 2 + ["[2. 2. 2.]"] * 3
