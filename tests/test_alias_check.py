"""The per-op alias check that adapters generate agrees with ``check_no_alias``, its definition."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from opbridge.call.overlap import alias_check_source, check_no_alias, make_alias_check
from opbridge.schema import parse_schema

SCHEMA = "f(Tensor(a!) a, Tensor b, Tensor(b!)? c, int n, Tensor? d, Tensor(c!) e) -> ()"


def _op(schema: str) -> Any:
    """The part of an OpDef the checks read."""
    parsed = parse_schema(schema)
    return SimpleNamespace(schema=parsed, name=parsed.name, qualname=f"t::{parsed.name}", row_strided=())


def _outcome(check: Any, args: tuple[Any, ...]) -> str | None:
    try:
        check(args)
    except ValueError as e:
        return str(e)
    return None


def test_generated_check_matches_check_no_alias() -> None:
    """Random spans over a few bytes (many overlaps, touching and empty spans, absent optionals)."""
    op = _op(SCHEMA)
    spans: dict[int, tuple[int, int]] = {}
    fast = make_alias_check(op, spans.__getitem__)
    rng = random.Random(0)
    raised = 0
    for _ in range(5000):
        spans.clear()
        for t in range(5):
            start = rng.randrange(8)
            spans[t] = (start, start + rng.choice([0, 0, 1, 2, 3]))
        args = (0, 1, None if rng.random() < 0.3 else 2, 7, None if rng.random() < 0.3 else 3, 4)
        want = _outcome(lambda a: check_no_alias(op, a, spans.__getitem__), args)
        assert _outcome(fast, args) == want, (spans, args)
        raised += want is not None
    assert 1000 < raised < 4000, "the cases should exercise both outcomes"


def test_error_names_first_pair_in_schema_order() -> None:
    op = _op(SCHEMA)
    spans = {0: (0, 4), 1: (10, 14), 2: (20, 24), 3: (3, 4), 4: (13, 21)}  # e hits b and c; d hits a
    with pytest.raises(ValueError, match=r"^f: mutated argument 'a' overlaps argument 'd' in memory; pass "
                                         r"separate tensors$"):
        make_alias_check(op, spans.__getitem__)((0, 1, 2, 7, 3, 4))
    with pytest.raises(ValueError, match=r"^f: mutated argument 'c' overlaps argument 'e' in memory"):
        make_alias_check(op, spans.__getitem__)((0, 1, 2, 7, None, 4))


def test_nothing_to_check_without_mutation() -> None:
    op = _op("g(Tensor x, Tensor y) -> Tensor")
    assert alias_check_source(op, ["x", "y"], "{s}, {e} = _span({t})", "") == ""
    make_alias_check(op, lambda t: (0, 8))((object(), object()))


def test_views_that_interleave_without_sharing_an_element_are_apart() -> None:
    """vLLM's query and key are column slices of one qkv tensor: their byte spans interleave, their
    elements do not; the exact test (layout.shares_memory) lets them through, a real overlap not."""
    import numpy as np

    from opbridge.call.layout import shares_memory

    qkv = np.zeros((5, 48), np.float32)
    q, k = qkv[:, :16], qkv[:, 16:32]
    exact = shares_memory(lambda a: (a.__array_interface__["data"][0], a.shape, a.strides, a.itemsize))
    assert not exact(q, k) and exact(q, qkv[:, 15:31]) and exact(q, q[::-1])
    op = _op("g(Tensor(a!) q, Tensor k) -> ()")

    def span(a: Any) -> tuple[int, int]:
        start = a.__array_interface__["data"][0]
        return start, start + (a.shape[0] - 1) * a.strides[0] + a.shape[1] * a.itemsize

    with pytest.raises(ValueError, match="overlaps"):  # byte spans alone: a false overlap
        check_no_alias(op, (q, k), span)
    check_no_alias(op, (q, k), span, exact)
    with pytest.raises(ValueError, match="mutated argument 'q' overlaps argument 'k'"):
        check_no_alias(op, (q, qkv[:, 15:31]), span, exact)


def test_row_strided_arguments_are_judged_exactly() -> None:
    """Arguments an op declares row_strided may be rows at a stride: the generated check reaches every
    row and tells rows that interleave from rows that meet, as check_no_alias with the exact test does."""
    import numpy as np

    from opbridge.call.layout import NDARRAY_SHARES

    op = _op(SCHEMA)
    op.row_strided = (0, 2, 4, 5)
    buf = np.zeros(256, np.uint8)

    def rows(rng: random.Random) -> Any:
        n, width = rng.randint(0, 4), rng.randint(1, 6)
        step, start = width + rng.randint(0, 5), rng.randrange(40)
        return np.lib.stride_tricks.as_strided(buf[start:], (n, width), (step, 1))

    def span(a: Any) -> tuple[int, int]:
        lo = a.__array_interface__["data"][0]
        return (lo, lo) if a.size == 0 else np.lib.array_utils.byte_bounds(a)

    fast = make_alias_check(op, span, exact=NDARRAY_SHARES)
    unsure = make_alias_check(op, span)  # no exact test: every span hit goes to check_no_alias
    rng = random.Random(1)
    raised = 0
    for _ in range(3000):
        args = (rows(rng), rows(rng), None if rng.random() < 0.3 else rows(rng), 7,
                None if rng.random() < 0.3 else rows(rng), rows(rng))
        want = _outcome(lambda a: check_no_alias(op, a, span, NDARRAY_SHARES), args)
        assert _outcome(fast, args) == want
        assert _outcome(make_alias_check(op, span, np.may_share_memory, NDARRAY_SHARES), args) == want
        raised += want is not None
        assert _outcome(unsure, args) == _outcome(lambda a: check_no_alias(op, a, span), args)
    assert 500 < raised < 2500, "the cases should exercise both outcomes"
