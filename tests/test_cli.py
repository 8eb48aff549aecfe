"""Tests for the ``opbridge`` command line and the benchmark helpers.

Commands that build, import user modules or import torch run in a
subprocess (``python -m opbridge.cli``) with a private cache; cheap ones
(``--help``, usage errors) call :func:`opbridge.cli.main` in-process. No test
asserts on a timing, only on the structure of the output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from opbridge import cli, config
from opbridge.bench import timing
from opbridge.cli import main
from opbridge.ops import LIBRARY

SUBCOMMANDS = [
    [],
    ["list"],
    ["build"],
    ["doctor"],
    ["codegen"],
    ["new"],
    ["bench"],
    ["bench", "overhead"],
    ["bench", "build"],
]

BROKEN_CC = """\
#include <opbridge/opbridge.h>
void bad_cpu(opbridge::TensorView out, opbridge::TensorView x) {
  this is not C++;
}
OPBRIDGE_EXPORT(bad_cpu);
"""

USER_LIBRARY = """\
from opbridge import Library, like

lib = Library("{ns}", sources=["{src}"])


@lib.op("{op}(Tensor x) -> Tensor", shape=like("x"))
def {op}(x):
    return x
"""


@pytest.fixture(scope="module")
def cli_env() -> dict[str, str]:
    """Environment for CLI subprocesses: the suite's JIT cache, where the other tests build the same modules (a
    cache of this module's own cost CI 130 CPU-seconds of builds); a test that needs a cache in a given state
    makes its own."""
    env = dict(os.environ)
    env["OPBRIDGE_CACHE_DIR"] = str(config.cache_dir())
    env["OPBRIDGE_NO_PROGRESS"] = "1"
    env.pop("OPBRIDGE_VERBOSE", None)
    return env


def run_cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opbridge.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def write_user_library(directory: Path, ns: str, op: str, source: str, code: str) -> Path:
    (directory / source).write_text(code)
    module = directory / f"{ns}_decl.py"
    module.write_text(USER_LIBRARY.format(ns=ns, src=source, op=op))
    return module


# -- usage -----------------------------------------------------------------------


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=lambda a: " ".join(a) or "opbridge")
def test_help_exits_0_with_a_description(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: opbridge")
    assert len(out.splitlines()) > 3  # usage, blank, description, options


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["list", "--bogus"],
    ["build", "--device", "tpu"],
    ["bench"],
    ["bench", "nope"],
    ["bench", "overhead", "--repeat", "many"],
    ["build", "--library", "no_such_namespace"],
    ["list", "--import", "no_such_module_for_opbridge_tests"],
    ["list", "--import", "/no/such/file.py"],
], ids=lambda a: " ".join(a) or "no-command")
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = list(sub.choices)
    assert {"list", "build", "doctor", "codegen", "new", "bench", "demo"} <= set(commands)
    for command in commands:
        assert main([command, "--help"]) == 0, command
        assert capsys.readouterr().out.startswith(f"usage: opbridge {command}")


def test_demo_help_shows_the_demos_options_and_passes_them_on(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from opbridge import demo

    for flag in ("--help", "-h"):
        assert main(["demo", flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: opbridge demo") and "--frameworks" in out and "--rounds" in out
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(demo, "run", lambda args: seen.append(args) or 0)
    assert main(["demo", "--frameworks", "numpy,torch", "--rounds", "2"]) == 0
    assert (seen[0].frameworks, seen[0].rounds, seen[0].number) == (["numpy", "torch"], 2, 200)
    assert main(["demo", "--frameworks", "nope"]) == 2  # checked before anything builds
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_python_dash_m_opbridge_is_the_opbridge_command(cli_env: dict[str, str]) -> None:
    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *argv], env=cli_env, capture_output=True, text=True,
                              timeout=120, check=False)

    import opbridge

    version = run("-m", "opbridge", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"opbridge {opbridge.__version__}"
    usage = run("-m", "opbridge", "frobnicate")
    assert usage.returncode == 2
    assert usage.stderr.startswith("usage: opbridge")
    by_module = run("-m", "opbridge", "list", "--json")
    by_cli = run("-m", "opbridge.cli", "list", "--json")
    assert by_module.returncode == 0, by_module.stderr
    assert json.loads(by_module.stdout) == json.loads(by_cli.stdout)
    from importlib.metadata import entry_points

    scripts = {ep.name: ep for ep in entry_points(group="console_scripts")}
    if "opbridge" in scripts:  # installed (editable or not): the console script runs cli.main
        assert scripts["opbridge"].load() is main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import opbridge

    assert main(["--version"]) == 0
    assert opbridge.__version__ in capsys.readouterr().out


def test_bench_registry_modules_follow_the_interface() -> None:
    from opbridge import bench

    for name in bench.BENCHES:
        mod = bench.load(name)
        assert mod.DESCRIPTION and callable(mod.add_arguments) and callable(mod.run)
        assert callable(mod.format_text)
    with pytest.raises(bench.BenchError, match="no benchmark"):
        bench.load("nope")


# -- list and doctor ------------------------------------------------------------------


def test_list_and_help_import_no_framework(cli_env: dict[str, str], tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import contextlib, io, sys
        from opbridge.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["list"]) == 0
            assert main(["doctor", "--json"]) in (0, 1)
        heavy = ("torch", "jax", "paddle", "mindspore", "tvm_ffi")
        print(sorted(m for m in heavy if m in sys.modules))
    """)
    # On an empty cache and on the suite's, where the C entries are built: doctor computes their cache keys,
    # which need tvm-ffi's paths and version (_tvm.libinfo, _tvm.version), not tvm_ffi loaded.
    for cache in (str(tmp_path / "cache"), cli_env["OPBRIDGE_CACHE_DIR"]):
        proc = subprocess.run([sys.executable, "-c", script], env={**cli_env, "OPBRIDGE_CACHE_DIR": cache},
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "[]", cache


def test_list_json_has_exactly_the_registered_ops(cli_env: dict[str, str]) -> None:
    proc = run_cli(cli_env, "list", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert isinstance(rows, list)
    by_name = {r["qualname"]: r for r in rows}
    assert len(by_name) == len(rows)
    assert set(by_name) == {op.qualname for op in LIBRARY.ops.values()}
    for op in LIBRARY.ops.values():
        row = by_name[op.qualname]
        assert row["namespace"] == "opbridge"
        assert row["name"] == op.name
        assert row["schema"] == str(op.schema)
        assert row["devices"] == sorted(op.kernels)
        assert row["backward"] is (op.backward is not None)
        assert row["shape"] == cli._shape_rule(op)
        assert row["dtypes"] == list(op.dtypes) and row["dtypes"], "declared dtypes are listed"


def test_a_reader_that_leaves_early_ends_the_command_quietly(cli_env: dict[str, str]) -> None:
    """`opbridge list | head -1`: no BrokenPipeError traceback, SIGPIPE's status as a shell tool exits with."""
    read, write = os.pipe()
    os.close(read)  # the reader has left before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "opbridge.cli", "list", "--json"], env=cli_env, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


def test_list_text(cli_env: dict[str, str]) -> None:
    proc = run_cli(cli_env, "list")
    assert proc.returncode == 0, proc.stderr
    assert "opbridge::rms_norm" in proc.stdout
    assert "rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor" in proc.stdout
    lines = proc.stdout.splitlines()
    details = lines[lines.index(next(li for li in lines if li.startswith("opbridge::rms_norm "))) + 1]
    assert f"dtypes: {', '.join(LIBRARY.ops['rms_norm'].dtypes)};" in details


def _made_by_a_factory() -> object:
    def rule(x: object) -> object:
        return x

    return rule


def test_list_names_shape_rules_readably() -> None:
    def op(rule: object) -> argparse.Namespace:
        return argparse.Namespace(shape=rule)  # all shape_rule reads

    halved = cli.shape_rule(LIBRARY.ops["silu_and_mul"])  # made by a factory, named and documented there
    assert halved == "silu_and_mul_shape (x's shape with the last dim halved, in x's dtype)"
    assert cli.shape_rule(LIBRARY.ops["add"]) == "like('x')"
    assert cli.shape_rule(op(textwrap.dedent)) == "textwrap.dedent"  # a module's own function
    assert cli.shape_rule(op(_made_by_a_factory())) == f"rule (in {__name__}._made_by_a_factory)"
    assert cli.shape_rule(op(lambda x: x)) == f"lambda (in {__name__}.test_list_names_shape_rules_readably)"


def test_list_shows_an_ops_own_dtypes(cli_env: dict[str, str], tmp_path: Path) -> None:
    module = tmp_path / "dtypelib_decl.py"
    (tmp_path / "k.cc").write_text("// not compiled by list\n")
    module.write_text(textwrap.dedent("""
        from opbridge import Library, like

        lib = Library("dtypelib", sources=["k.cc"], dtypes=("float64", "float32"))

        @lib.op("wide(Tensor x) -> Tensor", shape=like("x"))
        def wide(x):
            return x

        @lib.op("count(Tensor x) -> Tensor", shape=like("x"), dtypes=("int32", "int64"))
        def count(x):
            return x
    """))
    proc = run_cli(cli_env, "list", "--json", "--import", str(module))
    assert proc.returncode == 0, proc.stderr
    rows = {r["qualname"]: r for r in json.loads(proc.stdout)}
    assert rows["dtypelib::wide"]["dtypes"] == ["float64", "float32"]  # the library's
    assert rows["dtypelib::count"]["dtypes"] == ["int32", "int64"]  # the op's own
    text = run_cli(cli_env, "list", "--import", str(module))
    assert "dtypes: int32, int64;" in text.stdout and "dtypes: float64, float32;" in text.stdout


def test_list_import_adds_user_libraries(cli_env: dict[str, str], tmp_path: Path) -> None:
    module = write_user_library(tmp_path, "userlib", "ident", "ident.cc", "// not compiled by list\n")
    by_path = run_cli(cli_env, "list", "--json", "--import", str(module))
    assert by_path.returncode == 0, by_path.stderr
    names = {r["qualname"] for r in json.loads(by_path.stdout)}
    assert "userlib::ident" in names and "opbridge::add" in names
    by_name = run_cli({**cli_env, "PYTHONPATH": str(tmp_path)}, "list", "--json", "--import", module.stem)
    assert by_name.returncode == 0, by_name.stderr
    assert "userlib::ident" in {r["qualname"] for r in json.loads(by_name.stdout)}


def test_doctor_shows_the_cuda_settings(cli_env: dict[str, str]) -> None:
    # OPBRIDGE_CUDA_FLAGS changes what the CUDA kernels are: doctor says so beside nvcc
    env = {**cli_env, "OPBRIDGE_CUDA_ARCHS": "90", "OPBRIDGE_CUDA_FLAGS": "-DOPB_RMS_NORM_STAGES=3"}
    line = next(x for x in run_cli(env, "doctor").stdout.splitlines() if " nvcc " in x)
    assert line.endswith("(archs 90; OPBRIDGE_CUDA_FLAGS -DOPB_RMS_NORM_STAGES=3)"), line
    doc = json.loads(run_cli({**env, "OPBRIDGE_CUDA_FLAGS": "-DX='open"}, "doctor", "--json").stdout)
    assert doc["nvcc"]["flags"].startswith("error: OPBRIDGE_CUDA_FLAGS must split as shell words")


def test_doctor_json(cli_env: dict[str, str]) -> None:
    proc = run_cli(cli_env, "doctor", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == (0 if doc["ok"] else 1)
    assert set(doc) >= {"ok", "python", "opbridge", "tvm_ffi", "cxx", "ninja", "nvcc", "cuda_gpu",
                        "ascend", "cache", "frameworks"}
    assert doc["python"]["executable"] and doc["python"]["version"]
    assert set(doc["frameworks"]) == {"torch", "jax", "jax_tvm_ffi", "paddle", "mindspore", "numpy"}
    for fw in doc["frameworks"].values():
        assert fw["installed"] is (fw["version"] is not None)
    assert doc["frameworks"]["numpy"]["installed"]
    assert doc["cache"]["dir"] == cli_env["OPBRIDGE_CACHE_DIR"]
    assert isinstance(doc["cuda_gpu"]["present"], bool)
    assert doc["nvcc"]["path"] is None or doc["nvcc"]["version"]
    assert isinstance(doc["nvcc"]["archs"], list) and "flags" in doc["nvcc"]
    assert doc["ascend"]["found"] in (True, False)
    native = doc["torch_native"]
    if doc["frameworks"]["torch"]["installed"]:
        assert native["path"].startswith(cli_env["OPBRIDGE_CACHE_DIR"]), native
        # the suite's cache: another test may be building the shim in the background now
        assert native["state"] == "built" if native["built"] else native["state"].startswith(
            ("not built yet", "being built in the background now")), native


def test_doctor_says_whether_the_numpy_entry_is_built(cli_env: dict[str, str]) -> None:
    doc = json.loads(run_cli(cli_env, "doctor", "--json").stdout)
    entry = doc["numpy_entry"]
    assert entry["state"] == "built" if entry["built"] else entry["state"].startswith("not built yet"), entry
    assert not entry["built"] or entry["path"].startswith(cli_env["OPBRIDGE_CACHE_DIR"])
    proc = run_cli({**cli_env, "OPBRIDGE_NUMPY_NATIVE": "0"}, "doctor")
    assert "numpy entry off (OPBRIDGE_NUMPY_NATIVE=0)" in proc.stdout, proc.stdout


def test_doctor_speaks_of_the_tensor_entry_only_for_the_frameworks_that_use_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor entry serves Paddle and MindSpore only: without either, doctor advised building it (and flagged
    it "--"), though `opbridge build` does not build it then; with one of them, it named both."""
    from opbridge.cli import doctor

    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    installed: set[str] = {"numpy"}

    def frameworks() -> dict[str, dict[str, Any]]:
        return {name: {"distribution": dist, "installed": name in installed, "version": "1" if name in installed
                       else None} for name, dist in doctor.FRAMEWORKS.items()}

    monkeypatch.setattr(doctor, "_frameworks", frameworks)
    report = doctor.doctor_report()
    entry = report["exchange_entry"]
    assert entry["applies"] is False and not entry["built"] and entry["path"] is None
    assert entry["state"] == "not used: only Paddle and MindSpore calls use it, and neither is installed"
    line = next(line for line in doctor._doctor_lines(report) if "tensor entry" in line)
    assert line == "    tensor entry " + entry["state"], line  # neither "ok" nor "--": nothing to do here
    installed.add("paddle")
    entry = doctor._exchange_entry(frameworks())
    assert entry["applies"] and entry["state"].startswith("not built yet: `opbridge build` compiles it")
    assert "first Paddle call" in entry["state"] and "MindSpore" not in entry["state"], entry
    monkeypatch.setenv("OPBRIDGE_EXCHANGE_ENTRY", "0")
    off = doctor._exchange_entry(frameworks())["state"]
    assert off == "off (OPBRIDGE_EXCHANGE_ENTRY=0): Paddle calls take the Python fast path", off
    installed.add("mindspore")
    assert "Paddle and MindSpore calls" in doctor._exchange_entry(frameworks())["state"]


def test_doctor_names_a_misspelt_setting_and_an_unknown_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value every op's first call would refuse makes doctor fail; a name no setting has, which does nothing,
    is named with the closest settings. Both were silent ("core toolchain usable", exit 0)."""
    from opbridge.cli import doctor

    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    for name in [n for n in os.environ if n.startswith("OPBRIDGE_") and n != "OPBRIDGE_CACHE_DIR"]:
        monkeypatch.delenv(name)
    assert config.problems() == ([], {})
    monkeypatch.setenv("OPBRIDGE_THREADING", "pol")
    monkeypatch.setenv("OPBRIDGE_VERBOSEE", "1")
    monkeypatch.setenv("OPBRIDGE_NOTHING_LIKE_IT", "1")
    report = doctor.doctor_report()
    assert not report["ok"]
    assert report["settings"] == {"errors": ["OPBRIDGE_THREADING must be one of omp, pool, got 'pol'"],
                                  "unknown": {"OPBRIDGE_NOTHING_LIKE_IT": [],
                                              "OPBRIDGE_VERBOSEE": ["OPBRIDGE_VERBOSE"]}}
    lines = doctor._doctor_lines(report)
    assert "-- settings    OPBRIDGE_THREADING must be one of omp, pool, got 'pol'" in lines
    assert ("   settings    OPBRIDGE_VERBOSEE is no opbridge setting, so it does nothing (did you mean "
            "OPBRIDGE_VERBOSE?)") in lines
    assert lines[-1].startswith("settings NOT valid")


def test_doctor_says_when_the_torch_shim_is_being_built(cli_env: dict[str, str], tmp_path: Path) -> None:
    """A detached build holds the shim's lock: doctor says it is being built, not that nobody built it."""
    pytest.importorskip("torch")
    import fcntl

    cli_env = {**cli_env, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache")}  # where no shim is built
    doc = json.loads(run_cli(cli_env, "doctor", "--json").stdout)["torch_native"]
    assert not doc["built"], doc
    lock = Path(doc["path"] + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        held = json.loads(run_cli(cli_env, "doctor", "--json").stdout)["torch_native"]
    assert held["state"].startswith("being built in the background now"), held
    free = json.loads(run_cli(cli_env, "doctor", "--json").stdout)["torch_native"]
    assert free["state"].startswith("not built yet"), free


def test_doctor_says_when_the_torch_native_kernels_are_off(cli_env: dict[str, str]) -> None:
    pytest.importorskip("torch")
    proc = run_cli({**cli_env, "OPBRIDGE_TORCH_NATIVE": "0"}, "doctor")
    assert "torch shim  off (OPBRIDGE_TORCH_NATIVE=0)" in proc.stdout, proc.stdout


def test_doctor_says_what_large_outputs_get(cli_env: dict[str, str]) -> None:
    proc = run_cli({**cli_env, "OPBRIDGE_OUTPUT_CACHE_MB": "64", "OPBRIDGE_OUTPUT_CACHE_IDLE_MS": "250"}, "doctor")
    assert "outputs     4 MiB and more: 2 MiB-aligned, recycled, up to 64 MiB held, released after 250 ms" in (
        proc.stdout), proc.stdout
    proc = run_cli({**cli_env, "OPBRIDGE_OUTPUT_CACHE_MB": "0", "OPBRIDGE_HUGEPAGES": "0"}, "doctor", "--json")
    out = json.loads(proc.stdout)["outputs"]
    assert out["recycling"] is False and out["cache_bytes"] == 0
    assert "not recycled (OPBRIDGE_OUTPUT_CACHE_MB=0)" in out["state"] and "advice off" in out["pages"]
    proc = run_cli({**cli_env, "OPBRIDGE_OUTPUT_CACHE_MB": "lots"}, "doctor")
    assert "--  outputs     misconfigured: OPBRIDGE_OUTPUT_CACHE_MB must be a whole number" in proc.stdout, (
        proc.stdout)


def test_doctor_text_reports_an_unsafe_cache(cli_env: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    proc = run_cli({**cli_env, "OPBRIDGE_CACHE_DIR": str(cache)}, "doctor")
    assert "NOT PRIVATE" in proc.stdout
    assert "world-writable" in proc.stdout


def test_a_cache_that_cannot_be_made_is_one_clear_error(cli_env: dict[str, str], tmp_path: Path) -> None:
    """OPBRIDGE_CACHE_DIR through a file: an op's first call ended in pathlib's FileNotFoundError or
    NotADirectoryError traceback, `opbridge build` printed the reason four times over (with three warnings),
    and doctor said "ok"."""
    (tmp_path / "a-file").write_text("")
    env = {**cli_env, "OPBRIDGE_CACHE_DIR": str(tmp_path / "a-file" / "cache")}
    doctor = run_cli(env, "doctor")
    assert "--  cache" in doctor.stdout and "a-file is not a directory" in doctor.stdout, doctor.stdout
    assert doctor.returncode == 1 and "cache directory NOT usable" in doctor.stdout.splitlines()[-1], doctor.stdout
    build = run_cli(env, "build")
    assert build.returncode == 1 and "Traceback" not in build.stderr and "Warning" not in build.stderr
    assert build.stderr.strip().splitlines() == [
        f"opbridge: error: cannot create the cache directory {tmp_path / 'a-file' / 'cache'}: Not a directory. Set "
        "OPBRIDGE_CACHE_DIR to a directory you can write (`opbridge doctor` shows the one in use)"]
    fuzz = run_cli(env, "fuzz", "--ops", "add", "--examples", "2", "--frameworks", "numpy")
    assert fuzz.returncode != 0 and fuzz.stderr.strip().splitlines()[-1].startswith(
        "opbridge: error: cannot create the cache directory"), fuzz.stderr  # one prefix, as every command's
    call = subprocess.run([sys.executable, "-c", "import numpy as np, opbridge, opbridge.ops as ops\n"
                           "try:\n    ops.add(np.ones(2, np.float32), np.ones(2, np.float32))\n"
                           "except opbridge.CacheError as e:\n    print(isinstance(e, OSError), e)"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    assert call.stdout.startswith("True cannot create the cache directory"), call.stdout + call.stderr


def test_doctor_fails_on_a_cache_it_cannot_write_or_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only cache directory (or one to be made in a read-only folder) passed as "ok": the first build
    failed. Doctor tries: it makes a folder there and locks a file in it, as every build does."""
    import errno
    import fcntl
    import tempfile

    from opbridge.cli import doctor

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o700)
    ro.chmod(0o500)
    if os.geteuid() == 0:  # root writes through a read-only mode: refuse as the kernel refuses anyone else
        def refused(*args: Any, **kwargs: Any) -> str:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

        monkeypatch.setattr(tempfile, "mkdtemp", refused)
    try:
        monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(ro))
        cache = doctor._cache()
        assert cache["ok"] is False and cache["error"].startswith(f"cannot be written: {ro} is not writable"), cache
        monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(ro / "cache"))
        cache = doctor._cache()
        assert cache["ok"] is False and cache["error"].startswith(f"cannot be created: {ro} is not writable"), cache
        assert "set OPBRIDGE_CACHE_DIR to a directory you can write" in cache["error"]
    finally:
        ro.chmod(0o700)
    assert list(ro.iterdir()) == []  # nothing made, nothing left
    monkeypatch.undo()
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path / "fine"))
    assert doctor._cache()["ok"] is True and not (tmp_path / "fine").exists()
    real = fcntl.flock

    def no_locks(fd: int, operation: int) -> None:  # a filesystem without flock (some network mounts)
        if operation & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_locks)
    cache = doctor._cache()
    assert cache["ok"] is False and "cannot be locked" in cache["error"], cache
    assert list(tmp_path.iterdir()) == [ro]


# -- build -----------------------------------------------------------------------------


def test_build_prints_the_module_path(cli_env: dict[str, str]) -> None:
    proc = run_cli(cli_env, "build")
    assert proc.returncode == 0, proc.stderr
    line = next(li for li in proc.stdout.splitlines() if li.startswith("opbridge (cpu): "))
    path = Path(line.split(": ", 1)[1].rsplit(" (", 1)[0])
    assert path.suffix == ".so" and path.is_file()
    assert path.is_relative_to(config.cache_dir())


def test_build_of_a_broken_library_exits_1_with_file_and_line(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    module = write_user_library(tmp_path, "brokenlib", "bad", "broken.cc", BROKEN_CC)
    proc = run_cli(cli_env, "build", "--import", str(module), "--library", "brokenlib")
    assert proc.returncode == 1
    assert f"{tmp_path / 'broken.cc'}:3:" in proc.stderr
    assert "command:" in proc.stderr
    assert "Traceback" not in proc.stderr
    verbose = run_cli(cli_env, "build", "-v", "--import", str(module), "--library", "brokenlib")
    assert verbose.returncode == 1
    # -v echoes every compiler command (the object store compiles each unit itself, no ninja log).
    assert "-c " in verbose.stderr and "broken.cc" in verbose.stderr


def test_an_error_line_gets_its_prefix_once(cli_env: dict[str, str], tmp_path: Path) -> None:
    """`build --device cuda` of a library without CUDA sources printed "opbridge: error: library 'x' (cuda):" over
    "opbridge: library 'x' has no cuda sources": the message carried a prefix of its own. Now only `err` adds one,
    and no exception opbridge raises starts with it."""
    import builtins
    import re

    module = write_user_library(tmp_path, "cpuonlylib", "ident", "ident.cc", "// never compiled here\n")
    for aot in ([], ["--aot", "--out", str(tmp_path / "out")]):
        proc = run_cli(cli_env, "build", "--device", "cuda", *aot, "--import", str(module), "--library", "cpuonlylib")
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("opbridge: error: library 'cpuonlylib' (cuda"))
        assert lines[at + 1] == "library 'cpuonlylib' has no cuda sources", proc.stderr
        assert proc.stderr.count("opbridge:") == 1, proc.stderr
    src = Path(cli.__file__).resolve().parents[1]
    prefixed = [f"{path.relative_to(src)}: {m.group(0)!r}" for path in sorted(src.rglob("*.py"))
                for m in re.finditer(r"\b(\w+(?:Error|Exception))\(\s*f?[\"']opbridge: ", path.read_text())
                if not hasattr(builtins, m.group(1))]  # a built-in exception reaches no `err`: it may say whose
    assert not prefixed, prefixed


# -- bench ------------------------------------------------------------------------------


#: A usage error of each benchmark's own: a value argparse cannot judge, or options that do not go together.
#: Each exited 1 (as a benchmark that failed), and `bench gpu --ops nope` without a GPU exited 0.
BENCH_USAGE = [
    ["gpu", "--ops", "nope"],
    ["gpu", "--no-large", "--size", "8", "8"],
    ["gpu", "--quick", "--rows"],
    ["gpu", "--rows", "8,x"],
    ["gpu", "--device", "-1"],
    ["jax-gpu", "--ops", "add,nope"],
    ["jax-gpu", "--no-large", "--no-per-call"],
    ["kernels", "--sizes", "small,4by4"],
    ["kernels", "--dtypes", "float64", "int8"],
    ["kernels", "--ops", "nope"],
    ["kernels", "--ops", "add", "--all-ops"],
    ["kernels", "--no-memory", "--memory-size", "small"],
    ["kernels", "--local-stream-mib", "-1"],
    ["frameworks", "--ops", "rms_norm", "nope", "--frameworks", "numpy"],
    ["frameworks", "--ops", "add", "--parity"],
    ["frameworks", "--row-seconds", "1"],
    ["frameworks", "--frameworks", "mindspore", "--ms-python", "/nonexistent/python"],
    ["overhead", "--no-compile", "--compile-backend", "eager"],
    ["overhead", "--quick", "--compile-backend", "nope"],
    ["gpu", "--bogus"],
    ["overhead", "--bogus", "1"],
]


@pytest.mark.parametrize("argv", BENCH_USAGE, ids=" ".join)
def test_a_bench_usage_error_exits_2_with_the_benchmarks_usage(argv: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """And an unknown option too: it printed the top-level usage (`usage: opbridge [-h] [--version] COMMAND`)."""
    if argv[-1] == "nope" and argv[0] == "overhead":
        pytest.importorskip("torch")
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert f"\nusage: opbridge bench {argv[0]} [-h]" in f"\n{err}", err  # after a progress line at most
    first, *rest = err[err.index(f"\nopbridge bench {argv[0]}: error: ") + 1:].splitlines()
    assert not rest and "Traceback" not in err, err  # one line, after the usage
    assert any(word in first for word in argv if word.startswith("--") and word != "--quick"), first  # names it


def test_bench_overhead_quick_json(cli_env: dict[str, str]) -> None:
    from opbridge.bench import overhead

    proc = run_cli(cli_env, "bench", "overhead", "--json", "--quick")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["quick"] is True
    assert {"cpu_model", "cpu_count", "python", "torch", "tvm_ffi", "date"} <= set(doc["machine"])
    assert set(doc["natives"]) <= {"torch native kernels", "NumPy C entry"}  # built before the timing
    assert set(doc["stats_us"]) == set(overhead.CANDIDATES)
    for row in doc["stats_us"].values():
        assert {"p20", "p50", "p80"} <= set(row)
    for key in ("opbridge/torch.add", "torch.ops.opbridge.add/torch.add", "torch.ops.aten.add/torch.add",
                "custom_op/torch.add",
                "torch.library.impl/torch.add", "tvm_ffi_raw/torch.add", "np.add/torch.add",
                "opbridge_numpy/torch.add", "opbridge_numpy/np.add"):
        assert isinstance(doc["ratios"][key], float)
    comp = doc["compile"]
    assert comp["backend"] == "aot_eager"
    assert set(comp["stats_us"]) == set(overhead.COMPILED)
    assert isinstance(comp["ratios"]["compiled_opbridge/compiled_torch"], float)


def test_bench_build_quick_json(cli_env: dict[str, str], tmp_path: Path) -> None:
    # Its own TMPDIR: the benchmark's caches must be gone when it exits (no background build still
    # writing into them, which once made their removal fail). OPBRIDGE_TORCH_NATIVE=0: no build of torch's
    # shim into the warm-start cache (30 CPU-seconds; the warm starts on torch tensors then take the Python path).
    env = {**cli_env, "TMPDIR": str(tmp_path), "OPBRIDGE_TORCH_NATIVE": "0"}
    proc = run_cli(env, "bench", "build", "--json", "--quick", "--repeat", "1", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.glob("opbridge-bench-build-*"))
    doc = json.loads(proc.stdout)
    cold = doc["cold_seconds"]
    assert isinstance(cold["opbridge_cold"], float) and isinstance(cold["tvm_ffi_cold"], float)
    assert cold["torch_load_inline"] is None
    assert doc["cold_repeat"] == 1 and len(doc["cold"]["opbridge_cold"]["samples"]) == 1
    assert doc["cold"]["torch_load_inline"] == {"skipped": "--quick"}
    assert isinstance(doc["cold_cpu_seconds"]["opbridge_cold"], float)
    for suffix in ("", " (cpu)"):
        assert isinstance(doc["ratios"]["opbridge_cold/tvm_ffi_cold" + suffix], float)
        assert doc["ratios"]["torch_load_inline/opbridge_cold" + suffix] is None
    warm = doc["warm_start"]
    assert warm["populate_seconds"] > 0
    for kind in ("torch", "numpy"):
        assert {"import_opbridge_ms", "import_ops_ms", "first_call_ms", "total_ms"} <= set(warm[kind])
    assert isinstance(warm["numpy"]["torch_in_sys_modules_after"], bool)
    assert isinstance(warm["import_tvm_ffi"]["tvm_ffi_imports_torch"], bool)
    assert "bench build:" in proc.stderr  # progress goes to stderr


# -- timing helpers --------------------------------------------------------------------------


def test_interleaved_rotates_the_order_every_round() -> None:
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    samples = timing.interleaved(fns, rounds=4, number=2, warmup=0)
    assert list(samples) == ["a", "b", "c"]
    assert all(len(v) == 4 and all(s >= 0 for s in v) for v in samples.values())
    rounds = ["".join(calls[i:i + 6:2]) for i in range(0, len(calls), 6)]
    assert rounds == ["abc", "bca", "cab", "abc"]
    with pytest.raises(ValueError):
        timing.interleaved(fns, rounds=0, number=1)


def test_summary_percentiles_in_microseconds() -> None:
    stats = timing.summary({"x": [i * 1e-6 for i in range(1, 101)]})
    assert stats["x"]["p50"] == pytest.approx(50.5)
    assert stats["x"]["p20"] == pytest.approx(20.8)
    assert stats["x"]["p80"] == pytest.approx(80.2)
    assert stats["x"]["rounds"] == 100
    assert timing.ratio({"a": {"p50": 3.0}, "b": {"p50": 2.0}}, "a", "b") == 1.5


def test_machine_info_needs_no_framework() -> None:
    info = timing.machine_info()
    assert {"platform", "cpu_model", "cpu_count", "python", "torch", "tvm_ffi", "date"} <= set(info)
    assert timing.dist_version("no-such-distribution-opbridge") is None


def test_a_missing_optional_dependency_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A command needing a framework or tool that is not installed says which and how to get it (exit 1);
    a missing module that is not an optional dependency (a bug) keeps its traceback."""
    from opbridge.bench import latency

    def needs_torch(args: argparse.Namespace) -> dict[str, object]:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(latency, "run", needs_torch)
    assert main(["bench", "latency", "--quick"]) == 1
    assert "bench latency needs torch, which is not installed here (pip install opbridge[torch])" in (
        capsys.readouterr().err)

    def internal(args: argparse.Namespace) -> dict[str, object]:
        raise ModuleNotFoundError("No module named 'opbridge.nowhere'", name="opbridge.nowhere")

    monkeypatch.setattr(latency, "run", internal)
    with pytest.raises(ModuleNotFoundError, match=r"opbridge\.nowhere"):
        main(["bench", "latency", "--quick"])


def test_fuzz_that_fuzzes_nothing_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """Every requested framework skipped: exit 1 and say so, so that a CI job does not pass having tested nothing."""
    from opbridge.testing.harness import get

    missing = next((fw for fw in ("mindspore", "paddle", "jax") if get(fw).skip_reason() is not None), None)
    if missing is None:
        pytest.skip("every framework is installed here")
    assert main(["fuzz", "--frameworks", missing, "--ops", "add", "--examples", "2"]) == 1
    assert "nothing was fuzzed" in capsys.readouterr().out


def test_fuzz_says_why_a_check_did_not_apply(capsys: pytest.CaptureFixture[str]) -> None:
    """The text output gives each skipped check's reason (they were in --json only)."""
    assert main(["fuzz", "--frameworks", "numpy", "--ops", "add", "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "numpy opbridge::add: 5 check(s) ran, 0 failed, 2 did not apply\n  aliasing: add writes no argument\n" \
           "  scalars: add has no int, float or bool argument\n" in out, out


def test_check_op_without_torch_names_the_numpy_framework(tmp_path: Path) -> None:
    script = ("import sys; sys.modules['torch'] = None\n"
              "from opbridge import ops\nfrom opbridge.testing import check_op\n"
              "try:\n    check_op(ops.add)\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "framework='torch' (the default) needs torch" in run.stdout and "framework='numpy'" in run.stdout, (
        run.stdout + run.stderr)


def test_codegen_without_a_library_of_yours_says_so(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "opbridge", "codegen"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 2 and "no library of yours is declared: pass --import MODULE" in run.stderr, run.stderr


def test_build_natives_builds_what_a_framework_would_in_the_background() -> None:
    """`opbridge build` and the demo build the native entries up front (aot.natives): here NumPy's C entry
    for NumPy alone, loaded, so NumPy calls start native; the labels are the ones SERVES maps."""
    from opbridge.adapters.numpy import native
    from opbridge.aot import natives

    if not native.ENTRY.enabled():
        pytest.skip("OPBRIDGE_NUMPY_NATIVE=0")
    built = natives.build_natives(("numpy",))
    assert [b.label for b in built] == ["NumPy C entry"], built
    assert built[0].path is not None and built[0].path.is_file(), built[0].why_not
    assert native.loaded() is not None
    assert {fw for serves in natives.SERVES.values() for fw in serves} == {"torch", "numpy", "paddle", "mindspore"}


@pytest.mark.parametrize("argv", [
    ["fuzz", "--frameworks", "numpy,torch", "--ops", "add", "gelu"],
    ["fuzz", "--frameworks", "numpy", "torch", "--ops", "add,gelu"],
    ["fuzz", "--frameworks", "numpy,", "torch", "--ops", "add", "--ops", "add,gelu"],
    ["fuzz", "--frameworks", "numpy", "--frameworks", "torch,numpy", "--ops", "add", "--ops", "gelu"],
])
def test_list_options_take_words_commas_or_both(argv: list[str]) -> None:
    """Every list option of opbridge takes its values as words, comma-separated, or both, and repeated; each
    value once."""
    from opbridge.cli import build_parser

    args = build_parser().parse_args(argv)
    assert (args.frameworks, args.ops) == (["numpy", "torch"], ["add", "gelu"])


def test_list_options_check_each_value(capsys: pytest.CaptureFixture[str]) -> None:
    from opbridge.cli import build_parser

    for argv in (["fuzz", "--frameworks", "numpy,tensorflow"], ["bench", "gpu", "--dtypes", "float32", "int8"],
                 ["bench", "frameworks", "--frameworks", ","]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    ok = build_parser().parse_args(["bench", "kernels", "--out", "o", "--dtypes", "float32,bfloat16", "--ops", "add"])
    assert (ok.dtypes, ok.ops) == (["float32", "bfloat16"], ["add"])
    sizes = build_parser().parse_args(["bench", "kernels", "--sizes", "small,3x130", "--sizes", "odd"]).sizes
    assert sizes == [("small", (8, 4096)), ("3x130", (3, 130)), ("odd", (257, 5125))]


def _numeric_options(parser: Any, path: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """Every option of *parser* and its subcommands that reads a number: (``"bench gpu --rounds"``, its type)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _numeric_options(sub, (*path, name))
        elif action.option_strings and getattr(action, "item_type", action.type) not in (None, str, Path):
            found.append((" ".join((*path, action.option_strings[-1])), getattr(action, "item_type", action.type)))
    return found


# Options where zero or a negative number means something: how much to keep, which device.
_NOT_POSITIVE = {"cache prune --keep", "cache prune --max-mb", "bench gpu --device", "bench kernels --local-stream-mib"}
# Options with a type of their own that refuses what is not positive.
_OWN_CHECK = {"bench latency --shape", "bench kernels --sizes", "bench kernels --memory-size"}


def test_every_count_and_duration_option_refuses_zero_negative_and_nan(capsys: pytest.CaptureFixture[str]) -> None:
    """`opbridge demo --rounds 0` was a ZeroDivision-like traceback from the timing core; every other command
    checked its own numbers after parsing, each in its own words. Now one argparse type says it, by option."""
    from opbridge.bench import POSITIVE_FLOAT, POSITIVE_INT
    from opbridge.cli import build_parser

    options = dict(_numeric_options(build_parser()))
    assert {"demo --rounds", "demo --number", "fuzz --examples", "bench gpu --rounds"} <= set(options)
    positive = {o for o, kind in options.items() if kind in (POSITIVE_INT, POSITIVE_FLOAT)}
    unchecked = set(options) - positive - _NOT_POSITIVE - _OWN_CHECK
    assert not unchecked, f"numeric options without a positive type (or a reason to have none): {unchecked}"
    for option in sorted(positive | _OWN_CHECK):
        *command, flag = option.split()
        nargs = 2 if option.endswith("--size") else 1
        for bad in ("0", "-1", "nan", "x"):
            with pytest.raises(SystemExit) as info:
                build_parser().parse_args([*command, flag, *[bad] * nargs])
            assert info.value.code == 2, option
        assert f"argument {flag}: must be" in capsys.readouterr().err, option


def test_doctor_reports_misspelt_settings_instead_of_failing(cli_env: dict[str, str]) -> None:
    env = {**cli_env, "OPBRIDGE_TORCH_NATIVE": "maybe", "OPBRIDGE_NUMPY_NATIVE": "2", "OPBRIDGE_HUGEPAGES": "nah",
           "OPBRIDGE_CUDA_ARCHS": "sm90"}
    proc = run_cli(env, "doctor")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr  # 1: the settings are wrong
    for name in ("OPBRIDGE_TORCH_NATIVE", "OPBRIDGE_NUMPY_NATIVE", "OPBRIDGE_HUGEPAGES", "OPBRIDGE_CUDA_ARCHS"):
        assert f"{name} must" in proc.stdout, (name, proc.stdout)


def test_fuzz_on_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Not five failed checks ("Torch not compiled with CUDA enabled"), but one line saying why."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["fuzz", "--frameworks", "torch", "--device", "cuda", "--ops", "add", "--examples", "2"]) == 1
    assert "--device cuda: torch sees no CUDA GPU here" in capsys.readouterr().err


def test_build_out_without_aot_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--out is for --aot builds; a JIT build ignored it and went into the cache."""
    assert main(["build", "--out", str(tmp_path / "mods")]) == 2
    assert "--out DIR is for --aot builds" in capsys.readouterr().err
    assert not (tmp_path / "mods").exists()
