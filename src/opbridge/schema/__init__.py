"""PyTorch function-schema strings, parsed without importing ``torch``.

:func:`parse_schema` reads the syntax accepted by ``torch.library.Library.define``, e.g.
``"rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor"``, into frozen
dataclasses (:class:`Schema`, :class:`Argument`, :class:`Return`, :class:`Type`) that
render back canonically, bind Python calls (:meth:`Schema.bind`) and type-check
non-tensor argument values (:func:`check_value`).

The parser lives in :mod:`opbridge.schema.parser`, the dataclasses and value checks in
:mod:`opbridge.schema.model`; this stage imports only :mod:`opbridge.errors` and the
standard library.
"""

from __future__ import annotations

from opbridge.schema.model import (
    NO_DEFAULT,
    Alias,
    Argument,
    Return,
    Schema,
    SchemaError,
    Type,
    check_value,
)
from opbridge.schema.parser import parse_schema

__all__ = ["NO_DEFAULT", "Alias", "Argument", "Return", "Schema", "SchemaError", "Type", "check_value",
           "parse_schema"]
