"""Benchmarks run by ``opbridge bench <name>``.

Each benchmark is a module that provides:

``DESCRIPTION``
    One paragraph, shown by ``opbridge bench <name> --help``.
``add_arguments(parser)``
    Adds its own options. The CLI adds ``--json`` and ``--quick`` to every
    benchmark itself.
``run(args) -> dict``
    Runs the measurement and returns a JSON-serialisable result. Progress
    goes to stderr; failures raise :class:`BenchError`.
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
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from opbridge.errors import OpbridgeError

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
    """Choices that a word of comma-separated values is in when each of its values is (argparse checks
    each word of a list option before its action splits it)."""

    def __contains__(self, word: object) -> bool:
        values = _values(word)
        return bool(values) and all(tuple.__contains__(self, v) for v in values)


class ListOption(argparse.Action):
    """A list option that takes its values as words, comma-separated, or both (``--ops add gelu``,
    ``--ops add,gelu``), as every list option of ``opbridge`` does."""

    def __init__(self, option_strings: list[str], dest: str, choices: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "+")
        super().__init__(option_strings, dest, choices=None if choices is None else _Choices(choices), **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [v for word in values for v in _values(word)])


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


def positive(kind: Callable[[str], N]) -> Callable[[str], N]:
    """An argparse ``type``: the text read as *kind* (``int`` or ``float``), above zero, else a usage error
    naming the option (``argument --rounds: must be a positive integer, got '0'``)."""
    what = "integer" if kind is int else "number"

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be a positive {what}, got {text!r}")
        return value

    parse.__name__ = f"positive {what}"
    return parse


#: The argparse types of counts (rounds, repeats, calls) and of durations and sizes.
POSITIVE_INT, POSITIVE_FLOAT = positive(int), positive(float)


def exit_status(result: dict[str, Any]) -> int:
    """The exit status of a benchmark command after printing *result*: 1 if it says ``"ok": false``, else 0."""
    return 1 if result.get("ok") is False else 0


__all__ = ["BENCHES", "POSITIVE_FLOAT", "POSITIVE_INT", "Bench", "BenchError", "exit_status", "load", "positive"]
