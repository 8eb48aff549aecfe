"""``opbridge new`` fuzzed (hypothesis): drawn schemas and dtypes scaffold ops whose tests pass as generated.

Each example draws what ``opbridge new`` takes (a dispatching tensor, read or
written in place, more tensors of its shape, an optional tensor, int, float,
bool, str and list scalars with or without defaults, keyword-only ones, one
or two outputs) and a set of dtypes, scaffolds the op, and runs the test file
it wrote (the check_op matrix and fuzz_op in NumPy and torch) in a fresh
process. Where nvcc is, half of them also get ``--cuda``: the CUDA kernel
must compile and load, its parameters checked against the schema (no GPU
needed). Each example compiles a kernel, so CI runs 2 fixed ones;
``OPBRIDGE_FUZZ_EXAMPLES=N`` runs N random ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opbridge.build.toolchain import nvcc_path
from opbridge.scaffold import cli as scaffold_cli

_NVCC = nvcc_path() is not None  # then half the drawn ops also get a CUDA kernel, compiled and loaded

_EXAMPLES = int(os.environ.get("OPBRIDGE_FUZZ_EXAMPLES", "0") or 0)
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
_SCALARS = {  # type: default literals
    "int": ["0", "3", "-2"], "float": ["0.5", "1e-06", "-2.0"], "bool": ["True", "False"], "str": ['"a"'],
    "int[]": ["[1, 2]", "[]"], "float[]": ["[0.5]"], "int[2]": ["[1, 1]"],
}


@st.composite
def ops(draw: st.DrawFn) -> tuple[str, str, list[str], bool]:
    name = "op_" + draw(st.text(alphabet="abcdefghij", min_size=1, max_size=4))
    inplace = draw(st.booleans())
    if inplace:
        name += "_"
    args = [f"Tensor{'(a!)' if inplace else ''} x"]
    for i in range(draw(st.integers(0, 2))):
        args.append(f"Tensor t{i}")
    if draw(st.booleans()):
        args.append("Tensor? w")
    scalars = draw(st.lists(st.sampled_from(sorted(_SCALARS)), max_size=3))
    positional, keyword = [], []
    for i, typ in enumerate(scalars):
        default = draw(st.one_of(st.none(), st.sampled_from(_SCALARS[typ])))
        (keyword if draw(st.booleans()) else positional).append(f"{typ} s{i}" + ("" if default is None
                                                                                   else f"={default}"))
    positional.sort(key=lambda a: "=" in a)  # defaulted positional arguments last
    args += positional + (["*", *keyword] if keyword else [])
    returns = "()" if inplace else draw(st.sampled_from(["Tensor", "(Tensor, Tensor)"]))
    dtypes = draw(st.lists(st.sampled_from(_DTYPES), min_size=1, max_size=3, unique=True))
    cuda = _NVCC and draw(st.booleans())
    return name, f"{name}({', '.join(args)}) -> {returns}", dtypes, cuda


@settings(max_examples=_EXAMPLES or 2, derandomize=not _EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=ops())
def test_scaffolded_ops_pass_their_own_tests(tmp_path_factory: object,
                                            spec: tuple[str, str, list[str], bool]) -> None:
    name, schema, dtypes, cuda = spec
    out = Path(tmp_path_factory.mktemp("fuzzed_op")) / name  # type: ignore[attr-defined]
    parser = argparse.ArgumentParser()
    scaffold_cli.register(parser.add_subparsers())
    argv = ["new", name, "--schema", schema, "--dtypes", ",".join(dtypes), "--out", str(out)]
    args = parser.parse_args([*argv, "--cuda"] if cuda else argv)
    assert args.func(args) == 0, f"opbridge new {name} --schema {schema!r} --dtypes {dtypes} failed"
    env = {**os.environ, "OPBRIDGE_NO_PROGRESS": "1", "PYTHONPATH": os.pathsep.join(
        [str(out), str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(out)],
                         cwd=out, env=env, capture_output=True, text=True, check=False, timeout=900)
    assert res.returncode == 0, (f"the generated tests of {schema!r} (dtypes {dtypes}) fail:\n"
                                 + "\n".join((res.stdout + res.stderr).splitlines()[-40:]))
    if cuda:  # no GPU needed: nvcc compiles the CUDA kernel, and loading it checks its signature
        load = (f"from {name}_op import {name}; from opbridge import loader; "
                f"loader.kernel({name}.opdef, 'cuda')")
        res = subprocess.run([sys.executable, "-c", load], cwd=out, env={**env, "OPBRIDGE_CUDA_ARCHS": "80"},
                             capture_output=True, text=True, check=False, timeout=900)
        assert res.returncode == 0, (f"the generated CUDA kernel of {schema!r} (dtypes {dtypes}) does not build "
                                     "or load:\n" + "\n".join((res.stdout + res.stderr).splitlines()[-40:]))
