"""The ``fdp`` command line: ``fdp version``, ``fdp launch``, ``fdp info``, ``fdp describe``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from fdp._version import __version__
from fdp.launch import _cli as launch_cli

Command = Callable[[argparse.Namespace], int]


def _version(args: argparse.Namespace) -> int:
    del args
    print(f"fdp {__version__}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from fdp.observe._info import format_info, info

    report = info()
    print(json.dumps(report, indent=2) if args.json else format_info(report))
    return 0


def _describe(args: argparse.Namespace) -> int:
    from fdp.observe._demo_models import parameter_shapes
    from fdp.observe._describe import bucket_report

    try:
        report = bucket_report(
            parameter_shapes(args.model, args.dtype),
            bucket_cap_mb=args.bucket_cap_mb,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
        )
    except ValueError as e:  # a cap that is not a positive number of MiB
        print(f"fdp describe: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "dtype": args.dtype, **report.as_dict()}, indent=2))
    else:
        print(f"model {args.model!r} ({args.dtype}), buckets in reduce order")
        print(report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fdp`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="fdp", description="PyTorch DDP's behaviour for JAX.")
    parser.add_argument("--version", action="version", version=f"fdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print fdp's version").set_defaults(run=_version)
    launch = sub.add_parser(
        "launch",
        help="start the worker processes of a training script (torchrun)",
        description=launch_cli.DESCRIPTION,
    )
    launch_cli.add_arguments(launch)
    launch.set_defaults(run=lambda args: launch_cli.run(args, launch))
    info = sub.add_parser(
        "info",
        help="print versions, devices, environment and collectives (for bug reports)",
    )
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=_info)
    describe = sub.add_parser(
        "describe",
        help="print the gradient buckets of a demo model",
        description="Print DDP's gradient buckets for a small built-in Flax model.",
    )
    describe.add_argument("--model", choices=("mlp", "cnn", "transformer"), default="mlp")
    describe.add_argument("--bucket-cap-mb", type=float, default=25.0, metavar="MB")
    describe.add_argument("--first-bucket-cap-mb", type=float, default=1.0, metavar="MB")
    describe.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    describe.add_argument("--json", action="store_true", help="print JSON")
    describe.set_defaults(run=_describe)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fdp`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
