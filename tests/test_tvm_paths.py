"""tvm-ffi's paths and version without loading tvm-ffi (``opbridge._tvm.libinfo``, ``version``): a cache key needs
only those, and ``opbridge doctor`` on a cache where modules are built imported tvm-ffi for them (CI of 2026-11-28,
once the CLI tests used the suite's cache)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from opbridge import config


def test_cache_keys_do_not_load_tvm_ffi_and_match_what_it_says() -> None:
    script = textwrap.dedent("""
        import sys
        from opbridge import _tvm, ops
        from opbridge.build import compile as compile_mod, jit
        from opbridge.build.library import build_spec
        spec = build_spec(ops.LIBRARY, "cpu")
        key = compile_mod.fingerprint(spec)
        jit.cached_artifact(spec)
        paths = (_tvm.libinfo().find_include_path(), _tvm.libinfo().find_libtvm_ffi(), _tvm.version())
        print("tvm_ffi" in sys.modules)
        import tvm_ffi
        print(paths == (tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_libtvm_ffi(), tvm_ffi.__version__))
        print(compile_mod.fingerprint(spec) == key)
    """)
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(config.cache_dir())}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"], done.stdout + done.stderr
