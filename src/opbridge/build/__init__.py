"""Build stage: turn a library's sources into one tvm-ffi module (JIT, cached)."""

from opbridge.build.compile import BuildSpec, toolchain_fingerprint
from opbridge.build.jit import build, cached_artifact

__all__ = ["BuildSpec", "build", "cached_artifact", "toolchain_fingerprint"]
