"""Build hook: ``pip install .`` compiles every declared kernel into ``vllm_plugin/_C_ops.so``.

No source list here: the build imports ``vllm_plugin.ops`` and compiles what
its library declares. Everything else is in pyproject.toml.
"""

from opbridge.aot.setuptools import cmdclass, opbridge_extension
from setuptools import setup

setup(ext_modules=[opbridge_extension("vllm_plugin", "vllm_plugin.ops")], cmdclass=cmdclass())
