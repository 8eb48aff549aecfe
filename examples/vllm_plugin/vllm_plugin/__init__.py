"""vllm_plugin: a vLLM-style kernel plugin built with opbridge.

Call the ops through :mod:`vllm_plugin._custom_ops` (typed wrappers; importing
it loads nothing until an op is first called), or as
``torch.ops.vllm_plugin.<op>`` once :mod:`vllm_plugin.ops` is imported.
``pip install .`` compiles every kernel in ``csrc/`` into one module,
``vllm_plugin/_C_ops.so``.
"""

__version__ = "0.1.0"
