"""MindSpore graph mode: every op as an ``ops.Custom(func_type="aot")`` primitive.

Inside ``ms.jit`` / ``GRAPH_MODE`` MindSpore compiles Python source; it cannot
run opbridge's eager dispatch (a dict lookup on ``type(x)`` and a tvm-ffi
call). So each op gets, derived from its declaration:

1. **An AOT entry point** ``opb_ms_<op>`` with MindSpore's signature
   ``int f(int nparam, void** params, int* ndims, int64_t** shapes,
   const char** dtypes, void* stream, void* extra)`` (inputs, then outputs).
   It wraps each tensor in a ``DLTensor`` (dtype parsed from MindSpore's
   dtype string), reads each scalar argument and calls the op's compiled
   tvm-ffi kernel ``__tvm_ffi_<kernel>`` through the packed C ABI, in
   destination-passing order ``kernel(*outputs, *schema_args)``. All entry
   points of a library are generated into one C++ file and built with
   opbridge's build machinery (:class:`~opbridge.build.compile.BuildSpec`,
   :func:`opbridge.build.jit.build`, cached by content) into
   ``<namespace>_ms_aot.so``, which is then published under a name derived
   from the generated source (``ops.Custom`` names the file before it is
   built). The wrapper does not link the kernel library:
   Python resolves each ``__tvm_ffi_<kernel>`` symbol in the already-loaded
   kernel module and hands the address to ``opb_ms_bind``, so the wrapper's
   source, and therefore its cache entry, depends on the schemas alone.

   *Scalars.* ``ops.Custom`` hands an AOT kernel only tensors (a Python
   float passed straight to it arrives as a float32 tensor), and attributes
   reach it only through MindSpore's C++ ``AotExtra`` class, whose ABI
   (``std::string`` arguments, old libstdc++ ABI) opbridge does not want to
   depend on. So a ``float`` argument travels as a 0-d float64 tensor
   (``int`` as int64, ``bool`` as bool), made with ``Tensor(value, float64)``;
   the entry point reads it back and passes a tvm-ffi float/int/bool. A
   double handed to a graph as an argument keeps its precision (MindSpore
   itself keeps float literals of graph source in float32), and a scalar
   that varies at run time works too.

   *Errors.* A kernel error (``TypeError`` / ``ValueError`` with the op's and
   the argument's name) never aborts: the entry point catches it through
   ``TVMFFIErrorMoveFromRaised``, records kind and message (readable with
   ``opb_ms_error_kind`` / ``opb_ms_error_message``), prints them to stderr
   and returns 1, which MindSpore turns into a ``RuntimeError``. To raise the
   kernel's own ``TypeError`` / ``ValueError`` instead, the primitive's
   shape inference (run by MindSpore while compiling, in Python) calls the
   entry point once on zero-filled buffers of the inferred shapes, with the
   scalars' values when they are constants ("dry run"; cached per
   signature, skipped above :data:`opbridge.call.core.DRY_RUN_MAX_BYTES`), and raises that
   error from the compile. A call recorded for gradients in PyNative mode
   runs the same check on its real arguments first.

2. **A graph substitute** with the op's exact Python signature, which calls
   the primitive. MindSpore's parser replaces any object found in
   ``mindspore.graph._parse.resources.convert_object_map`` by its value when
   it resolves a name, so ``opbridge.ops.<op>`` (and ``from ... import``
   aliases of it) written inside a graph resolve to the substitute. Its
   source is generated into a file in opbridge's cache (MindSpore parses
   source, and reports errors against it); everything it uses is a closure
   variable, which the parser resolves.

3. **A bprop** generated from the declared backward: ``bprop(*inputs, out,
   dout)`` calls ``op.backward(*douts, *args)`` (scalars converted back with
   ``.item()``), maps ``None`` to zeros and gives the scalar inputs zero
   gradients. The declared backward is written with opbridge ops, which
   resolve to their own substitutes when MindSpore compiles it. A backward
   declared as a ``lambda`` inside the ``Library.op(...)`` call cannot be
   parsed by MindSpore ("Parse Lambda Function Fail"), so its expression is
   re-read from its source file and re-emitted as a ``def`` with the
   lambda's globals and closure as closure variables. An op without a
   backward gets a bprop that raises ``NotImplementedError`` naming the op
   (MindSpore never silently returns zero gradients for it).

4. **A vmap rule**, the primitive's own ``get_vmap_rule()`` (:mod:`.vmap`),
   which MindSpore asks before its rules by primitive name (under which every
   ``ops.Custom`` is "Custom"): a batch over the declared ``rows`` runs as
   one call, any other batch through MindSpore's general, per-element rule.

Limits (``NotImplementedError`` while compiling): ops that mutate arguments
in place, and ``Tensor?``, ``Tensor[]``, ``str``, list and ``ScalarType``
arguments (they still run eagerly in PyNative mode); dynamic shapes
(MindSpore re-infers an AOT op's shapes at run time only through a C++
infer function, which a Python shape rule cannot provide).
"""

from opbridge.adapters.mindspore.graph import custom_op, graph_function, opdef_of, register
from opbridge.adapters.mindspore.lambdas import parseable
from opbridge.adapters.mindspore.primitive import OpCustom, check_call, checked
from opbridge.adapters.mindspore.shim import AotModule, aot_module, graph_ops, wrapper_source
from opbridge.adapters.mindspore.support import ms_dtype, unsupported_reason

__all__ = [
    "AotModule",
    "OpCustom",
    "aot_module",
    "check_call",
    "checked",
    "custom_op",
    "graph_function",
    "graph_ops",
    "ms_dtype",
    "opdef_of",
    "parseable",
    "register",
    "unsupported_reason",
    "wrapper_source",
]

_opdef = opdef_of  # names before the split into modules
_OpCustom = OpCustom
