"""Self-check for the CPU kernels in src/opbridge/csrc (add, gelu, rms_norm).

Plain script (not collected by pytest):  python tests/kernels_selfcheck.py [--no-bench]

Builds the three kernel files into one tvm-ffi module, checks every kernel and
dtype (float64 included, at a bound float32 arithmetic could not meet) against
float64 references, checks that bad inputs raise TypeError /
ValueError naming the op and argument, measures opbridge::fast_tanh against
float64 tanh, and times float32 (4096, 4096) kernels against torch in GB/s.
"""

from __future__ import annotations

import math
import os
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
import tvm_ffi
import tvm_ffi.cpp

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "opbridge" / "csrc"
INCLUDE = ROOT / "src" / "opbridge" / "include"
BUILD = pathlib.Path(os.environ.get("OPB_SELFCHECK_BUILD", "/tmp/kbuild"))
CFLAGS = ["-O3", "-fopenmp", "-fvisibility=hidden"]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# max |err| / (atol + rtol * |ref|) must be <= 1; float64 computes in double, so a
# kernel that went through float32 (~1e-7 relative) fails its bound
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2),
       torch.float64: (1e-12, 1e-12)}
SHAPES = [(1,), (7,), (3, 769), (5, 5125), (0, 16), (4, 0), (2, 3, 129), (33, 4099), (4096, 4096)]
BIG = (4096, 4096)

FAILURES: list[str] = []


def check(cond: bool, what: str) -> None:
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def build():
    BUILD.mkdir(parents=True, exist_ok=True)
    kernels = tvm_ffi.cpp.build(
        "opb_kernels",
        sources=[str(CSRC / f) for f in ("add.cc", "gelu.cc", "rms_norm.cc")],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(INCLUDE)],
        build_directory=str(BUILD),
    )
    # math.h probe: the ISA-dispatched loop (what kernels run here) and a
    # baseline x86-64 loop (no FMA), since contraction changes the last bits.
    probe_src = BUILD / "math_probe.cc"
    probe_src.write_text(
        "#include <opbridge/math.h>\n"
        "using tvm::ffi::TensorView;\n"
        "namespace {\n"
        "template <int F> OPB_ALWAYS_INLINE float fn(float x) {\n"
        "  return F == 0 ? opbridge::fast_tanh(x) : F == 1 ? opbridge::fast_exp(x) : opbridge::fast_sigmoid(x);\n}\n"
        "template <int F> OPB_TARGET_CLONES void best(float* o, const float* x, int64_t n) {\n"
        "#pragma omp simd\n"
        "  for (int64_t i = 0; i < n; ++i) o[i] = fn<F>(x[i]);\n}\n"
        "template <int F> void base(float* o, const float* x, int64_t n) {\n"
        "#pragma omp simd\n"
        "  for (int64_t i = 0; i < n; ++i) o[i] = fn<F>(x[i]);\n}\n"
        "}\n"
        "void math_probe(TensorView out, TensorView x, int64_t f, bool dispatched) {\n"
        "  float* o = opbridge::data_ptr<float>(out);\n"
        "  const float* a = opbridge::data_ptr<const float>(x);\n"
        "  const int64_t n = x.numel();\n"
        "  if (f == 0) (dispatched ? best<0> : base<0>)(o, a, n);\n"
        "  if (f == 1) (dispatched ? best<1> : base<1>)(o, a, n);\n"
        "  if (f == 2) (dispatched ? best<2> : base<2>)(o, a, n);\n}\n"
        "OPBRIDGE_EXPORT(math_probe);\n"
    )
    probe = tvm_ffi.cpp.build(
        "opb_math_probe",
        sources=[str(probe_src)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(INCLUDE)],
        build_directory=str(BUILD / "probe"),
    )
    return tvm_ffi.load_module(kernels), tvm_ffi.load_module(probe)


# ---------------------------------------------------------------- references (float64)
C = math.sqrt(2.0 / math.pi)


def ref_gelu(x):
    return 0.5 * x * (1 + torch.tanh(C * (x + 0.044715 * x**3)))


def ref_gelu_backward(g, x):
    t = torch.tanh(C * (x + 0.044715 * x**3))
    return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * C * (1 + 3 * 0.044715 * x * x))


def ref_rms_norm(x, w, eps):
    r = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) if x.shape[-1] else x
    return x * r * w


def ref_rms_norm_backward(g, x, w, eps):
    h = x.shape[-1]
    if x.numel() == 0:
        return torch.zeros_like(x), torch.zeros_like(w)
    r = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    dot = (g * w * x).sum(-1, keepdim=True)
    gx = r * g * w - x * r**3 * dot / h
    gw = (g * x * r).reshape(-1, h).sum(0)
    return gx, gw


def close(name, got, ref, dtype, scale=1.0):
    atol, rtol = TOL[dtype]
    got = got.double()
    if got.numel() == 0:
        check(got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
        return 0.0
    err = ((got - ref).abs() / (atol * scale + rtol * ref.abs())).max().item()
    check(err <= 1.0 and not math.isnan(err), f"{name}: normalised error {err:.3g} > 1")
    return err


def empty_like_nan(t):
    return torch.full_like(t, float("nan"))


# ---------------------------------------------------------------- correctness
def check_kernels(m):
    gen = torch.Generator().manual_seed(0)
    worst = {}
    for dtype in DTYPES:
        for shape in SHAPES:
            if shape == BIG and dtype != torch.float32:
                continue
            tag = f"{str(dtype)[6:]}{list(shape)}"
            x = (torch.randn(shape, generator=gen) * 3).to(dtype)
            y = torch.randn(shape, generator=gen).to(dtype)
            g = torch.randn(shape, generator=gen).to(dtype)
            xd, yd, gd = x.double(), y.double(), g.double()

            out = empty_like_nan(x)
            m.add_cpu(out, x, y)
            e_add = close(f"add {tag}", out, xd + yd, dtype)

            out = empty_like_nan(x)
            m.gelu_cpu(out, x)
            e_gelu = close(f"gelu {tag}", out, ref_gelu(xd), dtype)

            out = empty_like_nan(x)
            m.gelu_backward_cpu(out, g, x)
            e_gelub = close(f"gelu_backward {tag}", out, ref_gelu_backward(gd, xd), dtype)

            h = shape[-1]
            w = (torch.rand(h, generator=gen) + 0.5).to(dtype)
            wd = w.double()
            eps = 1e-6
            out = empty_like_nan(x)
            m.rms_norm_cpu(out, x, w, eps)
            e_rms = close(f"rms_norm {tag}", out, ref_rms_norm(xd, wd, eps), dtype)

            gx, gw = empty_like_nan(x), empty_like_nan(w)
            m.rms_norm_backward_cpu(gx, gw, g, x, w, eps)
            rgx, rgw = ref_rms_norm_backward(gd, xd, wd, eps)
            e_rgx = close(f"rms_norm_backward grad_x {tag}", gx, rgx, dtype)
            # grad_weight sums over rows: absolute tolerance scales with sqrt(rows)
            rows = max(x.numel() // max(h, 1), 1)
            e_rgw = close(f"rms_norm_backward grad_weight {tag}", gw, rgw, dtype, scale=math.sqrt(rows))
            if x.numel() == 0:
                check(bool((gw.double() == 0).all()), f"rms_norm_backward {tag}: grad_weight not zero")
            for k, e in (("add", e_add), ("gelu", e_gelu), ("gelu_backward", e_gelub), ("rms_norm", e_rms),
                         ("rms_norm_backward.grad_x", e_rgx), ("rms_norm_backward.grad_weight", e_rgw)):
                worst[(k, dtype)] = max(worst.get((k, dtype), 0.0), e)

    # the backward formula itself, against autograd
    x = torch.randn(6, 37, dtype=torch.float64, requires_grad=True)
    w = torch.rand(37, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 37, dtype=torch.float64)
    (ref_rms_norm(x, w, 1e-6) * g).sum().backward()
    rgx, rgw = ref_rms_norm_backward(g, x.detach(), w.detach(), 1e-6)
    check(torch.allclose(rgx, x.grad) and torch.allclose(rgw, w.grad), "rms_norm_backward reference vs autograd")
    xg = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    ref_gelu(xg).backward(g.new_ones(1000))
    check(torch.allclose(ref_gelu_backward(torch.ones(1000, dtype=torch.float64), xg.detach()), xg.grad),
          "gelu_backward reference vs autograd")

    # in-place (out aliases an input) and eps edge values
    x = torch.randn(64, 513)
    y = torch.randn(64, 513)
    ref = x + y
    m.add_cpu(x, x, y)
    check(torch.equal(x, ref), "add in place")
    x = torch.randn(3, 8)
    out = empty_like_nan(x)
    m.rms_norm_cpu(out, x, torch.ones(8), 0.0)
    close("rms_norm eps=0", out, ref_rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 0.0), torch.float32)

    print("worst normalised error (<= 1 passes):")
    for (k, dtype), e in sorted(worst.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        print(f"  {k:32s} {str(dtype)[6:]:9s} {e:.3f}")


def check_conversions(m):
    """Bit-exact 16-bit load/store against torch's conversions, via add(x, y)."""
    for dtype in (torch.float16, torch.bfloat16):
        allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        zeros = torch.zeros_like(allbits)
        gen = torch.Generator().manual_seed(1)
        pairs = [(allbits, zeros)]
        for _ in range(4):
            a = torch.randint(-32768, 32768, (1 << 20,), generator=gen, dtype=torch.int32).to(torch.int16).view(dtype)
            b = torch.randint(-32768, 32768, (1 << 20,), generator=gen, dtype=torch.int32).to(torch.int16).view(dtype)
            pairs.append((a, b))
        bad = 0
        for a, b in pairs:
            out = torch.empty_like(a)
            m.add_cpu(out, a, b)
            ref = (a.float() + b.float()).to(dtype)
            nan = torch.isnan(ref)
            bad += int((torch.isnan(out) != nan).sum())
            bad += int((out.view(torch.int16) != ref.view(torch.int16))[~nan].sum())
        check(bad == 0, f"{dtype} conversions: {bad} mismatches vs torch")
        print(f"{str(dtype)[6:]} load/store bit-exact vs torch on all 65536 values + 4M random sums: "
              f"{'ok' if bad == 0 else f'{bad} mismatches'}")


def check_math(probe):
    """Max error of math.h's fast_tanh / fast_exp / fast_sigmoid vs float64."""
    grids = [
        ("fast_tanh", 0, np.tanh, np.linspace(-10.0, 10.0, 2_000_001), "[-10, 10]"),
        ("fast_exp", 1, np.exp, np.linspace(-87.0, 88.0, 2_000_001), "[-87, 88]"),
        ("fast_sigmoid", 2, lambda v: 1 / (1 + np.exp(-v)), np.linspace(-80.0, 80.0, 2_000_001), "[-80, 80]"),
    ]
    for name, f, ref_fn, grid, where in grids:
        x32 = torch.from_numpy(grid.astype(np.float32))
        ref = ref_fn(x32.numpy().astype(np.float64))  # error of the function, not of rounding x
        for dispatched in (True, False):
            out = torch.empty_like(x32)
            probe.math_probe(out, x32, f, dispatched)
            d = np.abs(out.numpy().astype(np.float64) - ref)
            nz = ref != 0
            a, r = d.max(), (d[nz] / np.abs(ref[nz])).max()
            check(r < 1e-6 if name != "fast_tanh" else a < 1e-6, f"{name} error too large: abs {a:.3g} rel {r:.3g}")
            print(f"{name:12s} max error on {len(grid):,} points of {where} vs float64 "
                  f"({'ISA-dispatched' if dispatched else 'baseline x86-64'}): abs {a:.3g}, rel {r:.3g}")

    def run(f, vals):
        x = torch.tensor(vals, dtype=torch.float32)
        out = torch.empty_like(x)
        probe.math_probe(out, x, f, True)
        return out.tolist()

    inf, nan = float("inf"), float("nan")
    t = run(0, [nan, inf, -inf, 0.0, -0.0, 1e-30, 3e-4, 1e30])
    check(math.isnan(t[0]) and t[1] == 1.0 and t[2] == -1.0 and t[7] == 1.0, f"fast_tanh specials {t}")
    check(t[3] == 0.0 and math.copysign(1, t[4]) < 0 and t[5] == np.float32(1e-30) and t[6] == np.float32(3e-4),
          f"fast_tanh small values {t}")
    e = run(1, [nan, inf, -inf, 0.0, 88.7, 89.0, -103.0, -105.0, -90.0])
    check(math.isnan(e[0]) and e[1] == inf and e[2] == 0.0 and e[3] == 1.0, f"fast_exp specials {e}")
    check(abs(e[4] / math.exp(float(np.float32(88.7))) - 1) < 1e-6 and e[5] == inf and e[7] == 0.0, f"fast_exp range ends {e}")
    check(0 < e[6] < 1e-44 and abs(e[8] / math.exp(-90.0) - 1) < 1e-3, f"fast_exp subnormal results {e}")
    sg = run(2, [nan, inf, -inf, 0.0, -200.0])
    check(math.isnan(sg[0]) and sg[1] == 1.0 and sg[2] == 0.0 and sg[3] == 0.5 and sg[4] == 0.0, f"fast_sigmoid specials {sg}")


# ---------------------------------------------------------------- bad inputs
def check_errors(m):
    f32 = lambda *s: torch.randn(*s)  # noqa: E731
    x, y = f32(4, 4096), f32(4, 4096)
    w = f32(4096)
    cases = [
        # (op, argument, expected exception, call)
        ("add", "x", TypeError, lambda: m.add_cpu(torch.empty(4, 4, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool))),
        ("add", "x", TypeError, lambda: m.add_cpu(torch.empty(4, 4, dtype=torch.int16), torch.ones(4, 4, dtype=torch.int16), torch.ones(4, 4, dtype=torch.int16))),
        ("add", "y", TypeError, lambda: m.add_cpu(torch.empty_like(x), x, y.half())),
        ("add", "y", ValueError, lambda: m.add_cpu(torch.empty_like(x), x, f32(4, 4095))),
        ("add", "x", ValueError, lambda: m.add_cpu(torch.empty(4096, 4), x.t(), f32(4096, 4))),
        ("add", "out", ValueError, lambda: m.add_cpu(f32(4, 4095), x, y)),
        ("add", "out", TypeError, lambda: m.add_cpu(torch.empty_like(x).half(), x, y)),
        ("add", "out", ValueError, lambda: m.add_cpu(f32(4096, 4).t(), x, y)),
        ("gelu", "x", TypeError, lambda: m.gelu_cpu(torch.empty(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))),
        ("gelu", "out", TypeError, lambda: m.gelu_cpu(torch.empty_like(x).bfloat16(), x)),
        ("gelu", "x", ValueError, lambda: m.gelu_cpu(torch.empty(4096, 4), x.t())),
        ("gelu", "out", ValueError, lambda: m.gelu_cpu(f32(5), x)),
        ("gelu_backward", "grad", TypeError, lambda: m.gelu_backward_cpu(torch.empty_like(x), y.half(), x)),
        ("gelu_backward", "x", TypeError, lambda: m.gelu_backward_cpu(torch.empty_like(x), y, torch.ones(4, 4096, dtype=torch.int32))),
        ("gelu_backward", "grad", ValueError, lambda: m.gelu_backward_cpu(torch.empty_like(x), f32(4, 4095), x)),
        ("gelu_backward", "grad", ValueError, lambda: m.gelu_backward_cpu(torch.empty(4096, 4), f32(4, 4096).t(), f32(4096, 4))),
        ("gelu_backward", "grad_x", ValueError, lambda: m.gelu_backward_cpu(f32(4096), y, x)),
        ("rms_norm", "weight", ValueError, lambda: m.rms_norm_cpu(torch.empty_like(x), x, f32(4095), 1e-6)),
        ("rms_norm", "weight", ValueError, lambda: m.rms_norm_cpu(torch.empty_like(x), x, f32(1, 4096), 1e-6)),
        ("rms_norm", "weight", TypeError, lambda: m.rms_norm_cpu(torch.empty_like(x), x, w.half(), 1e-6)),
        ("rms_norm", "weight", ValueError, lambda: m.rms_norm_cpu(torch.empty_like(x), x, f32(8192)[::2], 1e-6)),
        ("rms_norm", "x", TypeError, lambda: m.rms_norm_cpu(torch.empty(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.int32), 1e-6)),
        ("rms_norm", "x", ValueError, lambda: m.rms_norm_cpu(torch.empty(4, 4096), f32(4096, 4).t(), w, 1e-6)),
        ("rms_norm", "x", ValueError, lambda: m.rms_norm_cpu(torch.empty(()), torch.ones(()), f32(1), 1e-6)),
        ("rms_norm", "eps", ValueError, lambda: m.rms_norm_cpu(torch.empty_like(x), x, w, -1e-6)),
        ("rms_norm", "eps", ValueError, lambda: m.rms_norm_cpu(torch.empty_like(x), x, w, float("nan"))),
        ("rms_norm", "out", ValueError, lambda: m.rms_norm_cpu(f32(4, 4095), x, w, 1e-6)),
        ("rms_norm", "out", TypeError, lambda: m.rms_norm_cpu(torch.empty_like(x).half(), x, w, 1e-6)),
        ("rms_norm_backward", "grad", ValueError, lambda: m.rms_norm_backward_cpu(torch.empty_like(x), torch.empty_like(w), f32(4, 4095), x, w, 1e-6)),
        ("rms_norm_backward", "grad", TypeError, lambda: m.rms_norm_backward_cpu(torch.empty_like(x), torch.empty_like(w), y.half(), x, w, 1e-6)),
        ("rms_norm_backward", "weight", ValueError, lambda: m.rms_norm_backward_cpu(torch.empty_like(x), f32(4095), y, x, f32(4095), 1e-6)),
        ("rms_norm_backward", "grad_weight", ValueError, lambda: m.rms_norm_backward_cpu(torch.empty_like(x), f32(4095), y, x, w, 1e-6)),
        ("rms_norm_backward", "grad_weight", TypeError, lambda: m.rms_norm_backward_cpu(torch.empty_like(x), torch.empty_like(w).half(), y, x, w, 1e-6)),
        ("rms_norm_backward", "grad_x", ValueError, lambda: m.rms_norm_backward_cpu(f32(4, 4095), torch.empty_like(w), y, x, w, 1e-6)),
        ("rms_norm_backward", "eps", ValueError, lambda: m.rms_norm_backward_cpu(torch.empty_like(x), torch.empty_like(w), y, x, w, -1.0)),
    ]
    for op, arg, exc, call in cases:
        try:
            call()
        except exc as e:
            msg = str(e)
            ok = msg.startswith(f"{op}: {arg} ") or msg.startswith(f"{op}: {arg}:")
            check(ok, f"{op}/{arg}: message does not name op and argument: {msg!r}")
            continue
        except Exception as e:
            check(False, f"{op}/{arg}: expected {exc.__name__}, got {type(e).__name__}: {e}")
            continue
        check(False, f"{op}/{arg}: expected {exc.__name__}, nothing raised")
    # the exact wording promised for a wrong weight size
    try:
        m.rms_norm_cpu(torch.empty_like(x), x, f32(4095), 1e-6)
    except ValueError as e:
        want = "rms_norm: weight must have size 4096 in dim 0 (x's last dim), got shape (4095,)"
        check(str(e) == want, f"weight-size message {str(e)!r} != {want!r}")
    print(f"bad-input cases: {len(cases)} checked")


# ---------------------------------------------------------------- bandwidth
def run_bench(m, rounds=6, calls=4):
    """Contenders of one op alternate in rounds, so a busy neighbour on this
    shared machine slows both rather than whichever happened to run then."""
    n = BIG[0] * BIG[1]
    x, y, g = torch.randn(BIG), torch.randn(BIG), torch.randn(BIG)
    w = torch.rand(BIG[1]) + 0.5
    gw = torch.empty_like(w)
    o, o2 = torch.empty_like(x), torch.empty_like(x)
    t = 4 * n  # bytes of one (4096, 4096) float32 tensor
    groups = [
        ("copy", 2 * t, [("torch o.copy_(x) (STREAM-copy-like)", lambda: o.copy_(x))]),
        ("add", 3 * t, [("opbridge add_cpu", lambda: m.add_cpu(o, x, y)),
                        ("torch.add(x, y, out=o)", lambda: torch.add(x, y, out=o))]),
        ("gelu", 2 * t, [("opbridge gelu_cpu", lambda: m.gelu_cpu(o, x)),
                         ("torch aten.gelu.out (tanh)", lambda: torch.ops.aten.gelu.out(x, approximate="tanh", out=o))]),
        ("gelu_backward", 3 * t, [
            ("opbridge gelu_backward_cpu", lambda: m.gelu_backward_cpu(o, g, x)),
            ("torch aten.gelu_backward.grad_input", lambda: torch.ops.aten.gelu_backward.grad_input(g, x, approximate="tanh", grad_input=o))]),
        ("rms_norm", 2 * t, [("opbridge rms_norm_cpu", lambda: m.rms_norm_cpu(o, x, w, 1e-6)),
                             ("torch F.rms_norm (allocates out)", lambda: torch.nn.functional.rms_norm(x, (BIG[1],), w, 1e-6))]),
        ("rms_norm_backward", 3 * t, [("opbridge rms_norm_backward_cpu", lambda: m.rms_norm_backward_cpu(o2, gw, g, x, w, 1e-6))]),
    ]
    print(f"\nfloat32 {BIG}, {torch.get_num_threads()} threads; GB/s = (bytes read + written) / time; "
          f"{rounds} rounds x {calls} calls, contenders alternating")
    for op, nbytes, contenders in groups:
        times = {name: [] for name, _ in contenders}
        for _, fn in contenders:
            fn()  # warm up: page in outputs, start the thread team
        for _ in range(rounds):
            for name, fn in contenders:
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            med, best = statistics.median(ts), min(ts)
            print(f"  {op:18s} {name:40s} median {med * 1e3:7.2f} ms {nbytes / med / 1e9:6.1f} GB/s"
                  f"   best {best * 1e3:7.2f} ms {nbytes / best / 1e9:6.1f} GB/s")


def main():
    t0 = time.time()
    m, probe = build()
    print(f"built in {time.time() - t0:.1f}s: {BUILD}")
    check_math(probe)
    check_conversions(m)
    check_kernels(m)
    check_errors(m)
    if "--no-bench" not in sys.argv:
        run_bench(m)
    if FAILURES:
        print(f"\n{len(FAILURES)} FAILURE(S)")
        sys.exit(1)
    print("\nALL CHECKS PASSED")


if __name__ == "__main__":
    main()
