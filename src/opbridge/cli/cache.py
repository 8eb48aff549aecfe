"""``opbridge cache info|prune``: what the build cache holds, and pruning it by hand.

The cache prunes itself after every build that compiled something, down to
``OPBRIDGE_OBJECT_CACHE_MB`` (see :mod:`opbridge.build.housekeeping`); this
command shows its contents and prunes harder on request.
"""

from __future__ import annotations

import argparse
from typing import Any

from opbridge.cli.common import EXIT_OK, UsageError, print_json


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _cmd_info(args: argparse.Namespace) -> int:
    from opbridge.build import housekeeping

    info = housekeeping.info()
    if args.json:
        print_json(info.as_dict())
        return EXIT_OK
    print(f"cache:   {info.root}")
    print(f"modules: {info.modules} built module(s), {_mib(info.module_bytes)}")
    for lib, n in sorted(info.libraries.items()):
        print(f"  {lib}: {n}")
    print(f"objects: {info.objects} compiled unit(s), {_mib(info.object_bytes)}")
    print(f"shims:   {info.shims} torch native shim(s), {_mib(info.shim_bytes)}")
    print(f"other:   {_mib(info.other_bytes)} (unit manifests, generated sources, locks)")
    print(f"total:   {_mib(info.total_bytes)} (bound {_mib(housekeeping.size_bound())}, "
          f"OPBRIDGE_OBJECT_CACHE_MB)")
    return EXIT_OK


def _cmd_prune(args: argparse.Namespace) -> int:
    from opbridge.build import housekeeping

    if args.keep is not None and args.keep < 0:
        raise UsageError("cache prune: --keep must be >= 0")
    if args.max_mb is not None and args.max_mb < 0:
        raise UsageError("cache prune: --max-mb must be >= 0")
    max_bytes = housekeeping.size_bound() if args.max_mb is None else int(args.max_mb * (1 << 20))
    report = housekeeping.prune(max_bytes=max_bytes, keep=args.keep, recent_s=0.0)
    modules = [e for e in report.removed if e.kind == "module"]
    shims = [e for e in report.removed if e.kind == "shim"]
    doc: dict[str, Any] = {
        "removed_modules": [str(e.path) for e in modules],
        "removed_shims": [str(e.path) for e in shims],
        "removed_objects": len(report.removed) - len(modules) - len(shims),
        "removed_temporaries": [str(p) for p in report.temporaries],
        "freed_bytes": report.freed_bytes,
        "kept_in_use": report.kept_in_use,
        "total_bytes": housekeeping.info().total_bytes,
    }
    if args.json:
        print_json(doc)
        return EXIT_OK
    print(f"removed {len(modules)} built module(s), {len(shims)} torch shim(s) and "
          f"{doc['removed_objects']} object(s), "
          f"{_mib(report.freed_bytes)}; cache now {_mib(doc['total_bytes'])}")
    if report.temporaries:
        print(f"removed {len(report.temporaries)} temporary file(s) of killed torch shim compiles")
    if report.kept_in_use:
        print(f"kept {report.kept_in_use} entry(ies) in use (a build holds its lock)")
    return EXIT_OK


def register(sub: Any) -> None:
    """Add ``opbridge cache`` (``info``, ``prune``) to the subcommands *sub*."""
    p = sub.add_parser("cache", help="show or prune the build cache",
                       description="The JIT build cache (OPBRIDGE_CACHE_DIR): built modules, compiled "
                                   "units and torch's native shims. It prunes itself to "
                                   "OPBRIDGE_OBJECT_CACHE_MB (default 1024) after each build, least recently "
                                   "used first.")
    actions = p.add_subparsers(dest="cache_action", metavar="ACTION", required=True)
    info = actions.add_parser("info", help="entries and sizes")
    info.add_argument("--json", action="store_true", help="print one JSON document")
    info.set_defaults(func=_cmd_info)
    prune = actions.add_parser("prune", help="remove least recently used entries",
                               description="Remove entries least recently used first, never one whose "
                                           "build lock is held. Without options: down to "
                                           "OPBRIDGE_OBJECT_CACHE_MB, and whatever went unused for 30 days. "
                                           "Also removes the temporaries of killed builds (a torch shim "
                                           "compile's tmp*.so a minute old with its build lock free, a module "
                                           "build's directory after an hour).")
    prune.add_argument("--keep", type=int, metavar="N",
                       help="keep each library's N most recently used builds, and the N most recently "
                            "loaded torch shims (0: none)")
    prune.add_argument("--max-mb", type=float, metavar="MB",
                       help="remove entries until the cache holds at most MB MiB (0: empty it)")
    prune.add_argument("--json", action="store_true", help="print one JSON document")
    prune.set_defaults(func=_cmd_prune)
