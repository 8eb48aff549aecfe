"""``opbridge new``: scaffold an op or a plugin project.

Wiring (in ``opbridge.cli.build_parser``)::

    from opbridge.scaffold import cli as scaffold_cli
    scaffold_cli.register(sub)

Examples::

    opbridge new my_op --schema "my_op(Tensor x, float alpha) -> Tensor" --out my_op
    opbridge new --from gelu_custom.json --out gelu       # msopgen-style prototype (JSON or YAML)
    opbridge new my_op --cuda --out my_op                 # a CUDA kernel too, checks shared in my_op.h
    opbridge new --project my-plugin                      # a whole plugin project
    opbridge new my_op --schema "..." --out my-plugin     # add an op to that project
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from opbridge._cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, err
from opbridge.errors import OpbridgeError


def _specs(args: argparse.Namespace) -> list[Any]:
    from opbridge import scaffold

    dtypes = scaffold.parse_dtypes(args.dtypes)
    # an op added to a project joins the project's library: its name need not make a namespace
    namespace = args.namespace or (None if args.project else scaffold.project_package(args.out or Path(".")))
    if args.from_file is not None:
        if args.op or args.schema:
            raise scaffold.ScaffoldError("give either --from PROTO or OP [--schema ...], not both")
        protos = scaffold.load_prototype(args.from_file)
        return [dataclasses.replace(scaffold.to_spec(p, namespace=namespace,
                                                     origin=f"prototype {args.from_file.name}"), cuda=args.cuda)
                for p in protos]
    if args.op is None:
        return []
    return [scaffold.from_schema(args.op, args.schema, dtypes=dtypes, namespace=namespace, cuda=args.cuda)]


def run(args: argparse.Namespace) -> int:
    """Handle ``opbridge new``; return the exit status."""
    from opbridge import scaffold

    try:
        specs = _specs(args)
        if args.project:
            if len(specs) > 1:
                raise scaffold.ScaffoldError("--project starts with one op; add the others with --out")
            written = scaffold.new_project(args.project, args.out or Path("."),
                                           spec=specs[0] if specs else None, force=args.force, cuda=args.cuda)
            first = specs[0] if specs else scaffold.from_schema("identity", scaffold.STARTER_SCHEMA, cuda=args.cuda)
            steps = scaffold.next_steps(first, (args.out or Path(".")) / args.project)
        elif not specs:
            err("name an op (OP --schema ...), a prototype (--from) or --project NAME")
            return EXIT_USAGE
        else:
            written, steps = [], []
            # run in a project's root, an op joins the project (as with --out .), not a folder of its own there
            here = Path(".") if scaffold.project_package(Path(".")) is not None else None
            for spec in specs:
                out = args.out or here or Path(spec.name)
                written += scaffold.new_op(spec, out, force=args.force)
                steps += scaffold.next_steps(spec, out)
    except FileNotFoundError as e:
        err(str(e))
        return EXIT_USAGE
    except OpbridgeError as e:
        err(str(e))
        return EXIT_FAILURE if "failed" in str(e) else EXIT_USAGE
    for line in [*map(str, written), *steps]:
        print(line)
    return EXIT_OK


def register(subparsers: Any) -> None:
    """Add the ``new`` subcommand to *subparsers*."""
    p = subparsers.add_parser(
        "new", help="scaffold an op (kernel, declaration, test, benchmark) or a plugin project",
        description="Generate an op's C++ kernel (checks, dtype dispatch, OPBRIDGE_EXPORT), its declaration, "
                    "a test and a benchmark, which build and pass as generated; or a whole plugin project "
                    "(--project) that `pip install .` builds.",
    )
    p.add_argument("op", nargs="?", help="the op's name")
    p.add_argument("--schema", help='its schema, e.g. "my_op(Tensor x, float alpha) -> Tensor" '
                                    "(default: (Tensor x) -> Tensor)")
    p.add_argument("--from", dest="from_file", type=Path, metavar="PROTO",
                   help="an op prototype as Ascend's msopgen reads it: .json or .yaml with op, input_desc, "
                        "output_desc, attr")
    p.add_argument("--project", metavar="NAME", help="create the plugin project NAME (in --out, default .)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="where to write (default: the project, in a project's root; else ./OP); a project's "
                        "root adds the op to the project")
    p.add_argument("--dtypes",
                   help="dtypes the kernel accepts, comma-separated (default float32,float16,bfloat16)")
    p.add_argument("--cuda", action="store_true",
                   help="also write a CUDA kernel (csrc/OP.cu) and the argument checks both kernels share "
                        "(csrc/OP.h); `pip install .` builds it where nvcc is found")
    p.add_argument("--namespace", help="library namespace (default: the op's name, or the project's package)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=run)
