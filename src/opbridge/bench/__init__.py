"""Benchmarks run by ``opbridge bench <name>``.

Each benchmark is a module that provides:

``DESCRIPTION``
    One paragraph, shown by ``opbridge bench <name> --help``.
``add_arguments(parser)``
    Adds its own options, checked by argparse where it can (``type=``,
    ``choices=``, :class:`ListOption` for lists). The CLI adds ``--json``
    and ``--quick`` to every benchmark itself.
``run(args) -> dict``
    Runs the measurement and returns a JSON-serialisable result. Progress
    goes to stderr; failures raise :class:`BenchError` (exit status 1). An
    option's value argparse cannot judge (an op that is not declared) or
    options that do not go together raise :class:`UsageError` first, before
    any work and whether or not the machine could run the benchmark: exit
    status 2, with the benchmark's usage.
``format_text(result) -> str``
    Renders a result as a readable report.

A result with ``"ok": false`` (a candidate computed a wrong result, and the
benchmark went on to report the rest) makes the command exit non-zero after
printing it: :func:`exit_status`.

The shared core: :mod:`.timing` (interleaved rounds, percentiles, GB/s),
:mod:`.candidates` (opbridge's calls and their peers), :mod:`.verify`
(checks against opbridge's result or a float64 reference), :mod:`.report`
(progress, JSON, CSV, plots) and :mod:`.subproc` (fresh-process measurements).

To add a benchmark, write such a module and list it in :data:`BENCHES`.
Benchmark modules import frameworks (torch, ...) only inside ``run``, so
listing them for ``--help`` stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

from opbridge.errors import OpbridgeError, UsageError

#: benchmark name -> module implementing it
BENCHES: dict[str, str] = {
    "overhead": "opbridge.bench.overhead",
    "build": "opbridge.bench.build",
    "kernels": "opbridge.bench.kernels",
    "latency": "opbridge.bench.latency",
    "gpu": "opbridge.bench.gpu",
    "jax-gpu": "opbridge.bench.jax_gpu",
    "frameworks": "opbridge.bench.frameworks",
    "outputs": "opbridge.bench.outputs",
}


def _values(word: object) -> list[str]:
    """The comma-separated values of one word of a list option."""
    return [v.strip() for v in str(word).split(",") if v.strip()]


class _Choices(tuple):  # type: ignore[type-arg]
    """A list option's choices: what argparse checks a word against once :class:`_Words` has read it (a list of
    values, each of them checked there already)."""

    def __contains__(self, values: object) -> bool:
        items = values if isinstance(values, list) else _values(values)
        return bool(items) and all(tuple.__contains__(self, v) for v in items)


class _Words:
    """The argparse ``type`` of a list option: one word read as its comma-separated values, each read by *item*
    (default ``str``) and, with *choices*, checked against them; a word without a value is refused."""

    def __init__(self, item: Callable[[str], Any] | None, choices: Sequence[Any] | None) -> None:
        self.item, self.choices = item, choices
        self.__name__ = getattr(item, "__name__", "value")  # argparse names the type in some messages

    def __call__(self, word: str) -> list[Any]:
        values = _values(word)
        if not values:
            raise argparse.ArgumentTypeError(f"expected a value, got {word!r}")
        read = [self.item(v) if self.item is not None else v for v in values]
        bad = [v for v in read if self.choices is not None and v not in self.choices]
        if bad:
            raise argparse.ArgumentTypeError(f"invalid choice: {bad[0]!r} (choose from "
                                             f"{', '.join(map(repr, self.choices or ()))})")
        return read


class ListOption(argparse.Action):
    """A list option: its values as words, comma-separated, or both (``--ops add gelu``, ``--ops add,gelu``), and
    repeated (``--ops add --ops gelu``), each value once, as every list option of ``opbridge`` takes them.

    ``type=`` reads each value (``--rows 8,4096`` with ``type=POSITIVE_INT``: ``[8, 4096]``; a bad one is a usage
    error naming the option); ``choices=`` checks each; ``nargs="*"`` lets the option be given without a value
    (an empty list).
    """

    def __init__(self, option_strings: list[str], dest: str, type: Callable[[str], Any] | None = None,
                 choices: Sequence[Any] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "+")
        #: What reads each value (None: the text itself).
        self.item_type = type
        super().__init__(option_strings, dest, type=_Words(type, choices),
                         choices=None if choices is None else _Choices(choices), **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest, None)
        earlier = [] if earlier is self.default or earlier is None else list(earlier)  # given before: added to
        setattr(namespace, self.dest, list(dict.fromkeys([*earlier, *(v for word in values for v in word)])))


class BenchError(OpbridgeError, RuntimeError):
    """A benchmark could not run, or a candidate computed a wrong result."""


class Bench(Protocol):
    """The interface of a benchmark module (see the module docstring)."""

    DESCRIPTION: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> dict[str, Any]: ...

    def format_text(self, result: dict[str, Any]) -> str: ...


def load(name: str) -> Bench:
    """Import and return the benchmark module called *name*.

    Raises
    ------
    BenchError
        If no benchmark of that name exists.
    """
    try:
        module = BENCHES[name]
    except KeyError:
        raise BenchError(f"no benchmark {name!r}; available: {', '.join(BENCHES)}") from None
    return cast(Bench, importlib.import_module(module))


N = TypeVar("N", int, float)


def positive(kind: Callable[[str], N], zero: bool = False) -> Callable[[str], N]:
    """An argparse ``type``: the text read as *kind* (``int`` or ``float``), above zero (with *zero*: not below
    it), else a usage error naming the option (``argument --rounds: must be a positive integer, got '0'``)."""
    what = ("non-negative " if zero else "positive ") + ("integer" if kind is int else "number")

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (value >= 0 if zero else value > 0) or math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be a {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


#: The argparse types of counts (rounds, repeats, calls) and of durations and sizes.
POSITIVE_INT, POSITIVE_FLOAT = positive(int), positive(float)
#: ... and of indices and thresholds, where zero means something (GPU 0).
NON_NEGATIVE_INT, NON_NEGATIVE_FLOAT = positive(int, zero=True), positive(float, zero=True)


def check_declared(ops: Sequence[str] | None) -> None:
    """Refuse an ``--ops`` name that no op of the built-in library has (:class:`UsageError`, naming those it has):
    every benchmark checks its ``--ops`` so, before it imports a framework or looks for a device."""
    from opbridge import ops as builtin

    unknown = [n for n in ops or () if n not in builtin.LIBRARY.ops]
    if unknown:
        raise UsageError(f"--ops: no op {', '.join(map(repr, unknown))} in the opbridge library; declared: "
                         f"{', '.join(builtin.LIBRARY.ops)}")


def exit_status(result: dict[str, Any]) -> int:
    """The exit status of a benchmark command after printing *result*: 1 if it says ``"ok": false``, else 0."""
    return 1 if result.get("ok") is False else 0


__all__ = ["BENCHES", "NON_NEGATIVE_FLOAT", "NON_NEGATIVE_INT", "POSITIVE_FLOAT", "POSITIVE_INT", "Bench", "BenchError",
           "ListOption", "UsageError", "check_declared", "exit_status", "load", "positive"]
