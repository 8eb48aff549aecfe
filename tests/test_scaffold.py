"""`opbridge new`: generated ops and projects build and pass their own tests as generated."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opbridge import scaffold
from opbridge.build.toolchain import nvcc_path
from opbridge.scaffold import cli as scaffold_cli
from opbridge.scaffold.kernel import render_kernel
from opbridge.scaffold.spec import ScaffoldError

GELU_PROTO = {  # seed 003's msopgen prototype
    "op": "GELUCustom",
    "input_desc": [{"name": "x", "type": "float16", "format": "ND", "dynamic_shape": True}],
    "output_desc": [{"name": "y", "type": "float16", "format": "ND", "dynamic_shape": True}],
    "attr": [],
    "kernel_name": "gelu_custom",
    "need_check_supported": True,
}
ADD_PROTO_YAML = """\
- op: AddCustom
  input_desc:
    - {name: x, param_type: required, format: [ND], type: [fp16, float]}
    - {name: y, param_type: required, format: [ND], type: [fp16, float]}
  output_desc:
    - {name: z, param_type: required, format: [ND], type: [fp16, float]}
  attr:
    - {name: axes, param_type: required, type: list_int}
    - {name: alpha, param_type: optional, type: float, default_value: "1.0"}
"""


def _env(tmp_path: Path) -> dict[str, str]:
    # OPBRIDGE_TORCH_NATIVE=0: a private cache would otherwise start a background build of torch's dispatcher
    # shim (30 CPU-seconds) at the first torch call, which these short-lived programs never get to use.
    return {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path / "cache"), "OPBRIDGE_NO_PROGRESS": "1",
            "OPBRIDGE_TORCH_NATIVE": "0"}


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert res.returncode == 0, f"{cmd} in {cwd} failed:\n{res.stdout[-4000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_generated_ops_build_and_pass_their_tests_and_benchmarks(tmp_path: Path) -> None:
    out = tmp_path / "ops"
    specs = [
        scaffold.from_schema("pair_op", "(Tensor x, Tensor y, Tensor? w, float alpha=0.5, bool flag=True) "
                                        "-> (Tensor, Tensor)", dtypes=("float32", "float16")),
        scaffold.from_schema("bump_", "(Tensor(a!) x, int[] dims, str tag) -> ()",
                             dtypes=("float32", "int32")),
        scaffold.to_spec(GELU_PROTO),
    ]
    (tmp_path / "add.yaml").write_text(ADD_PROTO_YAML)
    specs += [scaffold.to_spec(p) for p in scaffold.load_prototype(tmp_path / "add.yaml")]
    for spec in specs:
        scaffold.new_op(spec, out)
    kinds = (("test_", ".py"), ("bench_", ".py"), ("", "_op.py"))
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted(
        f"{kind}{s.name}{ext}" for s in specs for kind, ext in kinds)
    env = _env(tmp_path)
    report = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "error", str(out)],
                  out, env)
    assert "passed" in report and "failed" not in report, report
    _skips_are_for_the_gpu_alone(report)  # every framework of this environment runs each generated test
    for spec in specs[:2]:
        _run([sys.executable, f"bench_{spec.name}.py", "--quick", "--json", str(tmp_path / "b.json")],
             out, env)
        doc = json.loads((tmp_path / "b.json").read_text())
        assert set(doc["results"]) >= {"opbridge (numpy)", "reference (numpy)"} and "machine" in doc


def test_prototypes_map_to_schemas_and_dtypes(tmp_path: Path) -> None:
    gelu = scaffold.to_spec(GELU_PROTO)
    assert str(gelu.schema) == "gelu_custom(Tensor x) -> Tensor"
    assert (gelu.dtypes, gelu.namespace) == (("float16",), "gelu_custom")
    (tmp_path / "add.yaml").write_text(ADD_PROTO_YAML)
    (add,) = [scaffold.to_spec(p) for p in scaffold.load_prototype(tmp_path / "add.yaml")]
    assert str(add.schema) == "add_custom(Tensor x, Tensor y, int[] axes, float alpha=1.0) -> Tensor"
    assert add.dtypes == ("float32", "float16")
    (tmp_path / "bad.yaml").write_text(ADD_PROTO_YAML + "    - {name: k, type: int}\n")
    with pytest.raises(ScaffoldError, match="attr k has no default but follows one that has"):
        scaffold.to_spec(scaffold.load_prototype(tmp_path / "bad.yaml")[0])


@pytest.mark.parametrize(("proto", "message"), [
    ({"op": "Cat", "input_desc": [{"name": "xs", "param_type": "dynamic", "type": "float"}]}, "is dynamic"),
    ({"op": "Mm", "input_desc": [{"name": "x", "type": "float16", "format": "FRACTAL_NZ"}]},
     "FRACTAL_NZ' is a device-specific layout"),
    ({"op": "Odd", "input_desc": [{"name": "x", "type": "int8"}]}, "dtype 'int8' has no CPU kernel type"),
    ({"op": "Mix", "input_desc": [{"name": "x", "type": "float16"}, {"name": "i", "type": "int32"}]},
     "the inputs share no dtype"),
    ({"op": "Attr", "input_desc": [{"name": "x", "type": "float"}],
      "attr": [{"name": "t", "type": "tensor"}]}, "type 'tensor' is not supported"),
])
def test_unsupported_prototypes_say_why(proto: dict[str, object], message: str) -> None:
    with pytest.raises(ScaffoldError, match=message):
        scaffold.to_spec(proto)


@pytest.mark.parametrize(("name", "schema", "message"), [
    ("cat", "(Tensor[] xs) -> Tensor", "argument .xs. has type Tensor\\[\\]"),
    ("cast", "(Tensor x, ScalarType t) -> Tensor", "ScalarType"),
    ("other", "named(Tensor x) -> Tensor", "the schema names the op 'named', the command 'other'"),
    ("kw", "(Tensor x, int new) -> Tensor", "new are C\\+\\+ keywords"),
    ("alias_", "(Tensor(a!) x) -> Tensor(a!)", "aliases an input, which torch.compile cannot functionalize"),
])
def test_unsupported_schemas_say_why(name: str, schema: str, message: str) -> None:
    with pytest.raises(ScaffoldError, match=message):
        spec = scaffold.from_schema(name, schema)
        render_kernel(spec, "x.py")


def test_kernel_validates_dispatches_and_exports() -> None:
    spec = scaffold.from_schema("mix", "(Tensor x, Tensor? w, int numel, float op) -> Tensor",
                                dtypes=("float32", "float16", "int64"))
    text = render_kernel(spec, "mix_op.py")
    assert "void mix_cpu(TensorView out, TensorView x, Optional<TensorView> w, int64_t numel, double op)" \
        in text
    assert 'const char* op_ = "mix";' in text, "locals are renamed away from argument names"
    assert "OPB_CHECK_DTYPE(op_, x, opbridge::kFloat32, opbridge::kFloat16, opbridge::kInt64);" in text
    assert '::opbridge::check_same_shape(op_, "w", w.value(), "x", x);' in text
    assert "opbridge::dispatch<float, opbridge::half, int64_t>(op_, x.dtype(), [&](auto tag) {" in text
    assert "run(typename decltype(tag)::type{});" in text
    assert "const int64_t numel_ = x.numel();" in text and text.rstrip().endswith("OPBRIDGE_EXPORT(mix_cpu);")


def test_existing_files_are_not_overwritten(tmp_path: Path) -> None:
    spec = scaffold.from_schema("once", None)
    scaffold.new_op(spec, tmp_path)
    with pytest.raises(ScaffoldError, match="refusing to overwrite"):
        scaffold.new_op(spec, tmp_path)
    scaffold.new_op(spec, tmp_path, force=True)


def _nothing_of_compiled(cache: Path, namespace: str) -> None:
    """The installed project compiled nothing of its own at run time: nothing in *cache* is its library's, nor
    the JAX handler shim its AOT module carries (opbridge.aot.build.ADAPTER_SOURCES). (opbridge's C entries,
    which only speed calls up, may be built there once per machine, in the background.)"""
    built = sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) if cache.exists() else []
    assert not [p for p in built if namespace in p or "opbridge_jax_handler" in p], \
        f"the installed project compiled at run time: {built}"


def _skips_are_for_the_gpu_alone(report: str) -> None:
    """Every skip in a ``pytest -rs`` *report* is a CUDA test on this GPU-less machine (or without nvcc), or a
    MindSpore one (MindSpore has its own environment)."""
    skips = [line for line in report.splitlines() if line.startswith("SKIPPED")]
    assert all(line.endswith(("no CUDA GPU", "(no csrc/*.cu)")) or "framework='mindspore' needs mindspore" in line
               for line in skips), report


def test_cuda_ops_share_their_checks_and_build_for_both_devices(tmp_path: Path) -> None:
    out = tmp_path / "ops"
    specs = [
        scaffold.from_schema("pair_op", "(Tensor x, Tensor y, Tensor? w, float alpha=0.5) -> (Tensor, Tensor)",
                             dtypes=("float32", "float16", "int32"), cuda=True),
        scaffold.from_schema("bump_", "(Tensor(a!) x, int[] dims) -> ()", dtypes=("float32",), cuda=True),
    ]
    for spec in specs:
        scaffold.new_op(spec, out)
    for spec in specs:
        name = spec.name
        cc, cu, h = ((out / "csrc" / f"{name}{ext}").read_text() for ext in (".cc", ".cu", ".h"))
        # The checks live once, in the header, and both kernels call them for their device.
        assert f"{name}_check(op, kDLCPU, " in cc and f'#include "{name}.h"' in cc
        assert f"{name}_check(op, kDLCUDA, " in cu and f'#include "{name}.h"' in cu
        assert "OPB_CHECK" not in cc and "OPB_CHECK" not in cu
        assert "OPB_CHECK_DEVICE(op, x, device);" in h and f"OPBRIDGE_EXPORT({name}_cuda);" in cu
        assert f'sources=["csrc/{name}.cc", "csrc/{name}.cu"]' in (out / f"{name}_op.py").read_text()
    assert "OPB_CHECK_DEVICE_LIKE(op, device, out0, x);" in (out / "csrc" / "pair_op.h").read_text()
    assert '::opbridge::check_device_like(op, device, "w", w.value(), "x", x);' in (
        out / "csrc" / "pair_op.h").read_text()
    env = {**_env(tmp_path), "OPBRIDGE_CUDA_ARCHS": "90"}
    report = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "error", str(out)],
                  out, env)
    assert "passed" in report and "failed" not in report, report
    _skips_are_for_the_gpu_alone(report)
    if nvcc_path() is None:
        pytest.skip("no nvcc: the CUDA kernels were generated, not compiled")
    code = ("import json, sys; import pair_op_op, bump__op; from opbridge import loader; "
            "print(json.dumps({m.LIBRARY.namespace: [loader.exports(loader.build(m.LIBRARY, 'cuda')), "
            "{n: o.kernels for n, o in m.LIBRARY.ops.items()}] for m in (pair_op_op, bump__op)}))")
    built = json.loads(_run([sys.executable, "-c", code], out, env).strip().splitlines()[-1])
    assert built == {
        "pair_op": [["pair_op_cuda"], {"pair_op": {"cpu": "pair_op_cpu", "cuda": "pair_op_cuda"}}],
        "bump_": [["bump__cuda"], {"bump_": {"cpu": "bump__cpu", "cuda": "bump__cuda"}}],
    }


def test_project_installs_with_pip_and_passes_its_tests_and_takes_new_ops(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    parser = argparse.ArgumentParser()
    scaffold_cli.register(parser.add_subparsers())
    args = parser.parse_args(["new", "--project", "demo-plugin", "--out", str(tmp_path)])
    assert args.func(args) == 0
    root = tmp_path / "demo-plugin"
    args = parser.parse_args(["new", "halve_", "--schema", "halve_(Tensor(a!) x, float by=2.0) -> ()", "--cuda"])
    with pytest.MonkeyPatch.context() as m:  # run in the project's root, without --out: the op joins the project
        m.chdir(root)
        assert args.func(args) == 0
    assert not (root / "halve_").exists()
    assert (root / "csrc" / "halve_.cc").is_file() and (root / "demo_plugin" / "ops" / "halve_.py").is_file()
    assert (root / "csrc" / "halve_.cu").is_file() and (root / "csrc" / "halve_.h").is_file()
    # identity has no CUDA kernel: it names its kernels, so the library's CUDA sources give it none.
    assert 'kernels={"cpu": "identity_cpu"}' in (root / "demo_plugin" / "ops" / "identity.py").read_text()
    wrappers = (root / "demo_plugin" / "_custom_ops.py").read_text()
    assert "def halve_(x: Tensor, by: float = 2.0) -> tuple[Tensor] | None:" in wrappers and "def identity(" in wrappers
    env = {**_env(tmp_path), "OPBRIDGE_CUDA_ARCHS": "90"}
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
          "--target", str(site), str(root)], tmp_path, env)
    # Where nvcc is, the CUDA kernels ship compiled beside the CPU ones (no GPU needed to build them).
    modules = ["_C_ops.so", "_C_ops_cuda.so"] if nvcc_path() else ["_C_ops.so"]
    assert sorted(p.name for p in (site / "demo_plugin").glob("*.so")) == modules
    report = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(root / "tests")],
                  site, {**env, "PYTHONPATH": str(site)})
    assert "failed" not in report, report
    _skips_are_for_the_gpu_alone(report)
    _nothing_of_compiled(tmp_path / "cache", "demo_plugin")


def test_cli_from_prototype_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proto = tmp_path / "gelu_custom.json"
    proto.write_text(json.dumps(GELU_PROTO))
    parser = argparse.ArgumentParser()
    scaffold_cli.register(parser.add_subparsers())
    args = parser.parse_args(["new", "--from", str(proto), "--out", str(tmp_path / "g")])
    assert args.func(args) == 0
    kernel = (tmp_path / "g" / "csrc" / "gelu_custom.cc").read_text()
    assert "OPB_CHECK_DTYPE(op, x, opbridge::kFloat16);" in kernel
    args = parser.parse_args(["new"])
    assert args.func(args) == 2
    args = parser.parse_args(["new", "x", "--dtypes", "float8"])
    assert args.func(args) == 2
    assert "unknown dtype(s) ['float8']" in capsys.readouterr().err


def test_next_steps_are_printed_and_the_kernel_edited_as_its_comment_says_doubles_16_bit_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "twice"
    parser = argparse.ArgumentParser()
    scaffold_cli.register(parser.add_subparsers())
    args = parser.parse_args(["new", "twice", "--out", str(out)])  # float32, float16 and bfloat16
    assert args.func(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:4] == [str(out / f) for f in ("csrc/twice.cc", "twice_op.py", "test_twice.py", "bench_twice.py")]
    steps = printed[4:]
    assert steps[0] == f"next steps, in {out}:" and len(steps) == 4, printed
    assert steps[1].startswith("  python -m pytest test_twice.py  # ")
    assert steps[2].startswith("  python bench_twice.py --quick   # ")
    assert steps[3].startswith("  the kernel is in csrc/twice.cc: a placeholder; replace it and the reference in "
                               "twice_op.py together")
    # The first natural edit, as the comment in the kernel's loop shows it: `x[i] * 2` would not compile for
    # opbridge::half and opbridge::bfloat16, which have no operators.
    kernel = out / "csrc" / "twice.cc"
    text = kernel.read_text()
    (comment,) = [line for line in text.splitlines() if "16-bit T has no operators" in line]
    example = comment.rsplit("e.g. ", 1)[1].rstrip(".")
    assert example == "to_compute(x[i]) * 2", comment
    copy = "opbridge::from_compute<T>(opbridge::to_compute(x[i]));"
    assert copy in text
    kernel.write_text(text.replace(copy, f"opbridge::from_compute<T>(opbridge::{example});"))
    declaration = out / "twice_op.py"
    declaration.write_text(declaration.read_text().replace("return x.copy()", "return x * 2"))
    code = ("import numpy as np; from twice_op import twice; x = np.linspace(-3, 3, 37)\n"
            "for d in ('float32', 'float16'):\n"
            "    got = twice(x.astype(d)); assert got.dtype == d and (got == 2 * x.astype(d)).all(), (d, got)\n"
            "try:\n    import torch\nexcept ImportError:\n    pass\n"
            "else:\n    t = torch.from_numpy(x).to(torch.bfloat16); assert torch.equal(twice(t), t * 2)\n"
            "print('ok')")
    env = _env(tmp_path)
    assert _run([sys.executable, "-c", code], out, env).strip() == "ok"  # the one build
    # The benchmark, as printed, verifies the kernel against the doubled reference before timing it.
    bench = steps[2].split("#")[0].split()
    report = _run([sys.executable, *bench[1:]], out, env)
    assert "opbridge (numpy)" in report, report


@pytest.mark.skipif(nvcc_path() is None, reason="the script builds the CUDA module: needs nvcc")
def test_gpu_check_plugin_script_builds_both_modules_and_passes(tmp_path: Path) -> None:
    # gpu-check.sh's plugin step, here without a GPU: the CUDA comparisons skip, the rest runs.
    root = Path(__file__).resolve().parent.parent
    env = {**_env(tmp_path), "PYTHON": sys.executable, "OPBRIDGE_CUDA_ARCHS": "90"}
    report = _run(["bash", str(root / "scripts" / "gpu-check-plugin.sh"), str(tmp_path / "work")], root, env)
    assert "_C_ops_cuda.so" in report and "gpu-check-plugin: ok" in report, report
    _skips_are_for_the_gpu_alone(report)


def test_a_cuda_op_added_to_a_project_whose_library_ignores_cu_files_warns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scaffold.new_project("old-plugin", tmp_path)
    library = tmp_path / "old-plugin" / "old_plugin" / "ops" / "_library.py"
    text = library.read_text()
    # What `opbridge new --project` wrote before --cuda existed: the .cc files alone.
    library.write_text(text.replace('[*(_ROOT / "csrc").glob("*.cc"), *(_ROOT / "csrc").glob("*.cu")]',
                                    '(_ROOT / "csrc").glob("*.cc")'))
    assert library.read_text() != text
    capsys.readouterr()
    scaffold.new_op(scaffold.from_schema("twice", None, cuda=True), tmp_path / "old-plugin")
    assert "old_plugin's library does not compile twice.cu: add the file(s) to the sources" in capsys.readouterr().err
    scaffold.new_op(scaffold.from_schema("thrice", None), tmp_path / "old-plugin")
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(("name", "text", "message"), [
    ("bad.json", "nonsense", r"bad.json: not valid JSON \(Expecting value"),
    ("bad.yaml", "op: [unclosed", r"bad.yaml: not valid YAML \("),
    ("gone.json", None, r"gone.json: cannot read the prototype file \(No such file or directory\)"),
])
def test_a_malformed_prototype_file_says_why(tmp_path: Path, name: str, text: str | None, message: str) -> None:
    """Not a json/yaml parser traceback: a ScaffoldError naming the file (opbridge new prints it, exit 2)."""
    from opbridge.scaffold.prototype import load_prototype

    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(ScaffoldError, match=message):
        load_prototype(tmp_path / name)
