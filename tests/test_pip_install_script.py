"""scripts/pip-install.sh: installs by uv with pip's configuration, else by pip (a fake uv records its arguments)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pip-install.sh"


def _setup(tmp_path: Path, uv_status: int) -> tuple[Path, dict[str, str], Path]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    record = tmp_path / "uv-args"
    uv = tmp_path / "uv"
    uv.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\nexit {uv_status}\n')
    uv.chmod(0o755)
    (tmp_path / "constraints.txt").write_text("")
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = file:///a/simple file:///b/simple\n"
                    f"constraint = {tmp_path}/constraints.txt\n[install]\nfind-links = /d/wheels\n")
    env = {**os.environ, "OPBRIDGE_UV": str(uv), "PIP_CONFIG_FILE": str(conf)}
    for name in ("OPBRIDGE_NO_UV", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT"):
        env.pop(name, None)
    return venv, env, record


def test_uv_gets_pips_configuration_and_resolves_as_pip_does(tmp_path: Path) -> None:
    venv, env, record = _setup(tmp_path, 0)
    done = subprocess.run([str(SCRIPT), str(venv), "-e", ".[x]", "pkg==1"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    args = record.read_text().splitlines()
    assert args[:2] == ["pip", "install"] and args[-3:] == ["-e", ".[x]", "pkg==1"]
    assert "--compile-bytecode" in args and args[args.index("--index-strategy") + 1] == "unsafe-best-match"
    assert args[args.index("--python") + 1] == str(venv / "bin" / "python")
    pairs = set(itertools.pairwise(args))
    assert {("--extra-index-url", "file:///a/simple"), ("--extra-index-url", "file:///b/simple"),
            ("--constraint", f"{tmp_path}/constraints.txt"), ("--find-links", "/d/wheels")} <= pairs, args


def test_pip_installs_where_uv_fails_or_is_turned_off(tmp_path: Path) -> None:
    venv, env, record = _setup(tmp_path, 3)
    # `pip install --help` prints its usage: proof that pip ran, with nothing installed
    failed = subprocess.run([str(SCRIPT), str(venv), "--help"], env=env, capture_output=True, text=True)
    assert failed.returncode == 0 and "pip install [options]" in failed.stdout, failed.stdout + failed.stderr
    assert "uv failed to install into" in failed.stderr and record.exists()
    record.unlink()
    off = subprocess.run([str(SCRIPT), str(venv), "--help"], env={**env, "OPBRIDGE_NO_UV": "1"},
                         capture_output=True, text=True)
    assert off.returncode == 0 and "pip install [options]" in off.stdout and not record.exists()


def test_usage() -> None:
    assert subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True).stdout.startswith("`pip install")
    bad = subprocess.run([str(SCRIPT), "/nowhere"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage:" in bad.stderr
