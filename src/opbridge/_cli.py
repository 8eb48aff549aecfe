"""What every stage's command-line code shares: the exit statuses, the one error line, the ``--import`` option.

The ``opbridge`` command (:mod:`opbridge.cli`) is assembled from subcommands that
live beside what they run, some of them below ``cli/`` in the pipeline
(``build --aot`` in :mod:`opbridge.aot.cli`, ``codegen`` in
:mod:`opbridge.codegen.cli`, ``new`` in :mod:`opbridge.scaffold.cli`); they all
print their errors and define ``--import`` through this module, so that each is
written once.
"""

from __future__ import annotations

import argparse
import sys

PROG = "opbridge"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def err(msg: str) -> None:
    """Print ``opbridge: error: <msg>`` on stderr: the one place an error line gets its prefix (the messages of
    opbridge's exceptions carry none)."""
    print(f"{PROG}: error: {msg}", file=sys.stderr)


#: The help of every command's ``--import``.
IMPORT_HELP = ("import MODULE (a dotted name, or a path to a .py file; one inside a package is imported as its "
               "package's module) first, so the libraries it declares are included; repeatable. Default, in the "
               "root of a plugin project (a pyproject.toml with [tool.opbridge] package = PKG, as `opbridge new "
               "--project` writes): PKG.ops, the project's own ops")


def add_import_option(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--import MODULE`` option (``args.imports``, a list) to a subcommand's parser."""
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE", default=[],
                        help=IMPORT_HELP)


__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "IMPORT_HELP", "PROG", "add_import_option", "err"]
