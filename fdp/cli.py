"""The ``fdp`` command line: ``version``, ``launch``, ``info``, ``describe``, ``gpu-compiler``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from fdp._version import __version__
from fdp.launch import _cli as launch_cli

Command = Callable[[argparse.Namespace], int]
# The GPUs fdp.observe.gpu_mesh knows (fdp/observe/_gpu.py), named here so that building
# the parser imports nothing.
GPU_TARGET_NAMES = ("h100_sxm", "a100_sxm_80")


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
    import jax

    from fdp.observe._demo_models import parameter_shapes
    from fdp.observe._describe import bucket_report

    if args.gpu:
        return _describe_gpu(args)
    try:
        shapes = parameter_shapes(args.model, args.dtype)
        report = bucket_report(
            shapes, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=args.first_bucket_cap_mb
        )
    except ValueError as e:  # an unknown model, or a cap that is not a positive number of MiB
        print(f"fdp describe: error: {e}", file=sys.stderr)
        return 2
    dtypes = sorted({str(leaf.dtype) for leaf in jax.tree.leaves(shapes)})
    dtype = args.dtype or ", ".join(dtypes)
    if args.json:
        print(json.dumps({"model": args.model, "dtype": dtype, **report.as_dict()}, indent=2))
    else:
        print(f"model {args.model!r} ({dtype}), buckets in reduce order")
        print(report)
    return 0


def _describe_gpu(args: argparse.Namespace) -> int:
    from fdp.observe._demo_models import gpu_step
    from fdp.observe._describe import bucket_report
    from fdp.observe._gpu_report import gpu_program_report

    try:
        step, compiled = gpu_step(
            args.model,
            args.gpu,
            devices=args.devices,
            bucket_cap_mb=args.bucket_cap_mb,
            first_bucket_cap_mb=args.first_bucket_cap_mb,
        )
    except (ValueError, RuntimeError) as e:  # not a built-in model; no GPU compiler here
        print(f"fdp describe: error: {e}", file=sys.stderr)
        return 2
    print(f"model {args.model!r}, the step's buckets in reduce order (its gradient-ready order)")
    print(bucket_report(step))
    print(gpu_program_report(compiled, args.gpu, step.plan))
    return 0


def _gpu_compiler(args: argparse.Namespace) -> int:
    from fdp.observe._gpu import compiler_dir, gpu_compiler_status, install_compiler

    if args.install:
        try:
            print(f"installed XLA's GPU compiler in {install_compiler()}")
        except RuntimeError as e:
            print(f"fdp gpu-compiler: error: {e}", file=sys.stderr)
            return 1
    status = gpu_compiler_status()
    print(status or f"XLA's GPU compiler loads (folder: {compiler_dir()})")
    return 0 if status is None else 1


DESCRIBE = """\
Print DDP's gradient buckets for a model's parameters: a small built-in Flax model, or
your own through MODULE:FUNCTION, a function of no arguments returning the parameters
(run under jax.eval_shape, so only shapes are built; the module is imported as
python -m would, from the current directory or PYTHONPATH). Example:
  fdp describe --model mypkg.models:init_params --bucket-cap-mb 5"""


def build_parser() -> argparse.ArgumentParser:
    """The ``fdp`` argument parser with every subcommand."""
    parser = launch_cli.Parser(prog="fdp", description="PyTorch DDP's behaviour for JAX.")
    parser.add_argument("--version", action="version", version=f"fdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print fdp's version")
    version.set_defaults(run=_version, parser=version)
    launch = sub.add_parser(
        "launch",
        help="start the worker processes of a training script (torchrun)",
        usage=launch_cli.USAGE,
        description=launch_cli.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        script_args=True,  # what follows the script is the script's (launch_cli.Parser)
    )
    launch_cli.add_arguments(launch)
    launch.set_defaults(run=lambda args: launch_cli.run(args, launch), parser=launch)
    info = sub.add_parser(
        "info",
        help="print versions, devices, environment and collectives (for bug reports)",
    )
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=_info, parser=info)
    describe = sub.add_parser(
        "describe",
        help="print the gradient buckets of a model (built-in or module:function)",
        description=DESCRIBE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    describe.add_argument(
        "--model",
        default="mlp",
        metavar="MODEL",
        help="mlp (the digits demo's MLP), cnn (a small convolutional net), transformer "
        "(a two-block encoder), or MODULE:FUNCTION returning your parameters "
        "(default: %(default)s)",
    )
    describe.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        metavar="MB",
        help="cap of each bucket after a dtype's first, as DDP's bucket_cap_mb "
        "(default: %(default)s)",
    )
    describe.add_argument(
        "--first-bucket-cap-mb",
        type=float,
        default=1.0,
        metavar="MB",
        help="cap of each dtype's first bucket, the first to be reduced (default: %(default)s)",
    )
    describe.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast the floating-point parameters to this dtype (default: the model's own; "
        "float32 for the built-in models)",
    )
    describe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    describe.add_argument(
        "--gpu",
        choices=sorted(GPU_TARGET_NAMES),
        default=None,
        help="also compile the built-in model's train step for GPUs of this kind with XLA's "
        "GPU compiler (no GPU needed; fdp gpu-compiler) and describe the program",
    )
    describe.add_argument(
        "--devices", type=int, default=8, metavar="N", help="GPUs for --gpu (default: 8)"
    )
    describe.set_defaults(run=_describe, parser=describe)
    gpu = sub.add_parser(
        "gpu-compiler",
        help="say whether XLA's GPU compiler loads here (for compiling without a GPU)",
        description="XLA's GPU compiler compiles fdp's step for a GPU on a machine without "
        "one (fdp.observe.gpu_mesh). It is the CUDA plugin of jaxlib's version, kept in a "
        "folder of its own ($FDP_GPU_COMPILER_DIR, default ~/.cache/fdp/gpu-compiler/...). "
        "Exit status 0 when it loads.",
    )
    gpu.add_argument(
        "--install", action="store_true", help="install it first (about 480 MB, from PyPI)"
    )
    gpu.set_defaults(run=_gpu_compiler, parser=gpu)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fdp`` console script."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    # An unknown option is reported with its subcommand's usage, not the top level's.
    hint = launch_cli.HINT if args.command == "launch" else None
    launch_cli.reject_unknown(getattr(args, "parser", parser), extras, hint)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
