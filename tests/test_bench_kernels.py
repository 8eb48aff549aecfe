"""``opbridge bench kernels`` on a tiny configuration: result structure, files, verification.

No timing is asserted: only that every candidate was verified and timed,
that the JSON, CSV and PNG files are written and well formed, that the
peak-memory measurement ran, and that a wrong candidate (or a wrong op)
makes the benchmark fail instead of reporting its speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import struct
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from opbridge import bench  # noqa: E402
from opbridge.bench import kernels  # noqa: E402
from opbridge.cli import build_parser  # noqa: E402
from opbridge.ops import LIBRARY  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OPS = ("add", "rms_norm")
SIZES = ("4x64", "3x130")
DTYPES = ("float32", "bfloat16")


def _args(out: Path, *extra: str) -> argparse.Namespace:
    argv = ["bench", "kernels", "--quick", "--ops", ",".join(OPS), "--sizes", ",".join(SIZES),
            "--dtypes", ",".join(DTYPES), "--rounds", "2", "--target-ms", "0.2", "--stream-n", "65536",
            "--memory-size", "64x1024", "--local-stream-mib", "0", "--out", str(out), *extra]
    return build_parser().parse_args(argv)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench-kernels") / "results"
    return kernels.run(_args(out))


def test_registered_with_the_cli() -> None:
    assert bench.BENCHES["kernels"] == "opbridge.bench.kernels"
    assert bench.load("kernels") is kernels
    args = _args(Path("unused"))
    assert args.bench == "kernels" and args.quick and args.func is not None


def test_result_structure(result: dict[str, Any]) -> None:
    assert result["benchmark"] == "kernels" and result["quick"] is True
    for key in ("machine", "settings", "stream", "ops", "skipped_ops", "cases", "memory", "summary", "files",
                "wall_seconds"):
        assert key in result, key
    for key in ("cpu_model", "python", "torch", "numpy", "tvm_ffi", "date", "torch_threads"):
        assert key in result["machine"], key
    stream = result["stream"]
    assert stream["copy_gbps"] > 0 and len(stream["passes"]) == 2
    assert set(stream["passes"][0]["kernels"]) == {"copy", "scale", "add", "triad", "sum"}

    cases = result["cases"]
    assert len(cases) == len(OPS) * len(SIZES) * len(DTYPES)
    assert {(c["op"], c["size"], c["dtype"]) for c in cases} == {
        (o, s, d) for o in OPS for s in SIZES for d in DTYPES}
    for c in cases:
        cands = c["candidates"]
        expected = {kernels.OURS_OUT, kernels.OURS_NEW, kernels.EAGER_NEW, kernels.EAGER_OUT}
        if c["dtype"] == "float32":
            expected.add(kernels.REF)
        assert set(cands) == expected, (c["op"], c["size"], c["dtype"])
        assert set(c["skipped"]) >= {kernels.COMPILE_NEW, kernels.COMPILE_OUT}  # --quick compiles nothing
        for row in cands.values():
            assert 0 < row["p20_us"] <= row["p50_us"] <= row["p80_us"]
            assert row["gbps"] > 0 and row["frac_stream_copy"] > 0 and row["rounds"] >= 1
            assert row["frac_stream_copy_local"] > 0  # --local-stream-mib 0: every case times a copy beside it
        assert c["stream_copy_local"]["gbps"] > 0
        assert c["bytes"]["total"] == c["bytes"]["read"] + c["bytes"]["written"] > 0
        assert set(c["speedups"]) == expected - {kernels.OURS_OUT, kernels.OURS_NEW}
        assert all(v["speedup"] > 0 for v in c["speedups"].values())

    add = next(c for c in cases if c["op"] == "add" and c["size"] == "4x64" and c["dtype"] == "float32")
    assert add["bytes"] == {"read": 2 * 4 * 64 * 4, "written": 4 * 64 * 4, "total": 3 * 4 * 64 * 4}
    assert set(result["summary"]) == {"large_float32_frac_stream_copy", "large_float32_frac_stream_copy_run",
                                      "large_new_speedup_vs_eager", "speedup_vs_compile", "small_speedup_vs_eager"}
    assert "STREAM" in kernels.format_text(result)


def test_memory_section(result: dict[str, Any]) -> None:
    mem = result["memory"]
    assert mem["size"] == [64, 1024] and mem["rows"]
    for row in mem["rows"]:
        assert row["op"] in OPS
        assert row["peak_extra_bytes"] >= 0 and row["beyond_io_bytes"] >= 0
    for op in OPS:  # forward kernels allocate no temporary the size of their input
        assert mem["ops"][op]["kind"] == "forward" and mem["ops"][op]["ok"], mem["ops"][op]
    new = next(r for r in mem["rows"] if r["op"] == "add" and r["candidate"] == kernels.OURS_NEW
               and r["dtype"] == "float32")
    assert new["new_output_bytes"] == 64 * 1024 * 4


def test_files(result: dict[str, Any]) -> None:
    files = result["files"]
    doc = json.loads(Path(files["json"]).read_text())
    assert doc["cases"] == result["cases"] and doc["machine"] == result["machine"]

    with open(files["csv"], newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == kernels.CSV_FIELDS
        rows = list(reader)
    assert len(rows) == sum(len(c["candidates"]) for c in result["cases"])
    assert {r["candidate"] for r in rows} >= {kernels.OURS_OUT, kernels.OURS_NEW, kernels.EAGER_NEW}
    assert all(float(r["p50_us"]) > 0 and float(r["gbps"]) > 0 for r in rows)

    plots = [Path(p) for p in files["plots"]]
    assert sorted(p.name for p in plots) == sorted(f"{op}.png" for op in OPS)
    for p in plots:
        data = p.read_bytes()
        assert data[:8] == PNG_SIGNATURE
        length, kind = struct.unpack(">I4s", data[8:16])
        width, height = struct.unpack(">II", data[16:24])
        assert kind == b"IHDR" and length == 13 and width > 100 and height > 100
        assert data[-8:-4] == b"IEND"


def _run_add_only(tmp_path: Path) -> dict[str, Any]:
    argv = ["bench", "kernels", "--quick", "--ops", "add", "--sizes", "3x130", "--dtypes", "float32",
            "--rounds", "1", "--target-ms", "0.1", "--stream-n", "65536", "--no-memory", "--no-plots",
            "--out", str(tmp_path / "out")]
    return kernels.run(build_parser().parse_args(argv))


def test_a_wrong_reference_fails_verification(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LIBRARY.ops["add"], "reference", lambda x, y: x - y)
    with pytest.raises(bench.BenchError, match="numpy_ref"):
        _run_add_only(tmp_path)


def test_a_wrong_op_fails_verification(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def wrong_add(x: Any, y: Any, *, out: Any = None) -> Any:
        return torch.sub(x, y) if out is None else torch.sub(x, y, out=out)

    monkeypatch.setattr(LIBRARY.ops["add"], "call", wrong_add)
    with pytest.raises(bench.BenchError, match="disagrees with opbridge"):
        _run_add_only(tmp_path)


def test_bad_options_are_bench_errors(tmp_path: Path) -> None:
    parser = build_parser()
    with pytest.raises(bench.BenchError, match="size"):
        kernels.settings(parser.parse_args(["bench", "kernels", "--sizes", "4by4"]))
    with pytest.raises(bench.BenchError, match="no op"):
        kernels.plan(kernels.settings(parser.parse_args(["bench", "kernels", "--ops", "nope",
                                                         "--out", str(tmp_path)])))
