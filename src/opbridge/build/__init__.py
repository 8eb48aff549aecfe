"""Build stage: turn a library's sources into one tvm-ffi module (JIT, cached)."""

from opbridge.build.compile import BuildSpec
from opbridge.build.jit import build, cached_artifact
from opbridge.build.toolchain import toolchain_fingerprint

__all__ = ["BuildSpec", "build", "cached_artifact", "toolchain_fingerprint"]
