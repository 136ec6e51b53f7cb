"""``fdp launch``'s settings: its command line, checked into a frozen config."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import uuid


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What ``fdp launch`` runs, and how.

    Attributes:
      script: the training script (or module, with ``module=True``).
      script_args: its arguments.
      module: run ``script`` as ``python -m script``.
      nproc_per_node: worker processes on this host.
      nnodes: hosts in the run.
      node_rank: this host's index, ``0 <= node_rank < nnodes``.
      master_addr: the coordinator's host (the host of node 0).
      master_port: the coordinator's port; ``None``: a free port (one host only).
      max_restarts: times the whole group is restarted after a failure.
      log_dir: write each worker's output to ``log_dir/attempt_K/rank_N.log``
        (``K`` counts attempts from 1) instead of to the console.
      tee: with ``log_dir``, show the output on the console as well.
      console_ranks: the ranks whose output the console shows (None: all).
      run_id: names the run (``FDP_RUN_ID``); a worker joins only a coordinator
        of its own run. Random on one host; with several hosts, the same on every
        host (by default derived from the coordinator's address and the sizes).
      monitor_interval: seconds between checks of the workers.
      grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
      hang_timeout: seconds a worker may hold up a peer that waits for it (in a
        step, a host collective, at a store key, before the first step), stay
        stopped by a signal, or block in a host callback inside a step, before
        it is declared hung and the group is stopped; compiling and the exit
        after the script never count; 0 turns hang detection off (the idle
        limit too).
      idle_timeout: seconds a pause with no such evidence (every worker alive,
        between steps or all in one step, none waiting for a peer: an
        evaluation, a synchronous checkpoint) may last after the first step
        before it counts as a hang; never while a worker is inside
        ``fdp.runtime.busy()``; 0: never.
      bind_gpus: give each local worker its own GPU(s) via
        ``CUDA_VISIBLE_DEVICES`` when the host has GPUs.
      bind_cpus: without GPUs, pin each local worker to its share of CPU cores
        and set its thread counts to match.
    """

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    log_dir: str | None = None
    tee: bool = False
    console_ranks: tuple[int, ...] | None = None
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    monitor_interval: float = 0.1
    grace_period: float = 5.0
    hang_timeout: float = 30.0
    idle_timeout: float = 600.0
    bind_gpus: bool = True
    bind_cpus: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(bool(self.script), "a script (or -m module) to run is required.")
        need(self.nproc_per_node >= 1, f"--nproc-per-node must be >= 1, got {self.nproc_per_node}.")
        need(self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}.")
        need(
            0 <= self.node_rank < self.nnodes,
            f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, "
            f"got {self.node_rank}.",
        )
        need(self.max_restarts >= 0, f"--max-restarts must be >= 0, got {self.max_restarts}.")
        need(
            self.master_port is None or 0 < self.master_port < 65536,
            f"--master-port must be in 1..65535, got {self.master_port}.",
        )
        need(
            self.nnodes == 1 or self.master_port is not None,
            f"--nnodes {self.nnodes} needs --master-port (and --master-addr, the host of node 0) "
            "so that every node finds the same coordinator.",
        )
        need(
            not self.tee or self.log_dir is not None,
            "--tee shows the output on the console as well as in the log files: it needs "
            "--log-dir DIR.",
        )
        need(
            self.console_ranks is None or self.console_ranks[-1] < self.world_size,
            f"--console-ranks must name ranks below the world size {self.world_size}, "
            f"got {self.console_ranks}.",
        )
        need(self.monitor_interval > 0, "--monitor-interval must be > 0.")
        need(self.grace_period >= 0, "--grace-period must be >= 0.")
        need(
            self.hang_timeout >= 0 and self.hang_timeout != float("inf"),
            f"--hang-timeout must be a number of seconds >= 0 (0: off), got {self.hang_timeout}.",
        )
        need(
            self.idle_timeout >= 0 and self.idle_timeout != float("inf"),
            f"--idle-timeout must be a number of seconds >= 0 (0: never), got {self.idle_timeout}.",
        )

    @property
    def world_size(self) -> int:
        """Processes in the whole run."""
        return self.nnodes * self.nproc_per_node


def parse_ranks(text: str) -> tuple[int, ...] | None:
    """``--console-ranks``'s value: ``'all'`` is None, else the ranks, sorted.

    Example:
      >>> parse_ranks("all"), parse_ranks("2,0")
      (None, (0, 2))

    Raises:
      ValueError: ``text`` is neither ``all`` nor comma-separated ranks >= 0.
    """
    if text.strip().lower() == "all":
        return None
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        ranks = []
    if not ranks or ranks[0] < 0:
        raise ValueError(
            f"--console-ranks must be 'all' or ranks >= 0 separated by commas (e.g. 0 or 0,3), "
            f"got {text!r}."
        )
    return tuple(ranks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``fdp launch``'s options and the script to ``parser``.

    Each option has one name with dashes and, as torchrun, one with underscores;
    the help text shows the first.
    """
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=1,
        metavar="N",
        help="workers on this host (default: %(default)s)",
    )
    parser.add_argument(
        "--nnodes", type=int, default=1, metavar="M", help="hosts in the run (default: %(default)s)"
    )
    parser.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        metavar="I",
        help="this host's index, 0..M-1 (default: %(default)s)",
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="ADDR",
        help="host of node 0, where the coordinator runs (default: 127.0.0.1 on one host; "
        "required with --nnodes > 1)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        metavar="PORT",
        help="coordinator port (default: a free port on one host; required with --nnodes > 1)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        metavar="R",
        help="restart the whole group up to R times after a failure (default: %(default)s)",
    )
    parser.add_argument(
        "--log-dir",
        "--log_dir",
        default=None,
        metavar="DIR",
        help="write each worker's output to DIR/attempt_K/rank_N.log (K from 1) instead of "
        "the console (default: the console only)",
    )
    parser.add_argument(
        "--tee",
        action="store_true",
        help="with --log-dir, write the log files and show the output on the console too",
    )
    parser.add_argument(
        "--console-ranks",
        "--console_ranks",
        default="all",
        metavar="RANKS",
        help="whose output the console shows: 'all' or ranks such as 0 or 0,3; log files "
        "get every rank's (default: %(default)s)",
    )
    parser.add_argument(
        "--run-id",
        "--run_id",
        default=None,
        metavar="ID",
        help="run name (FDP_RUN_ID); workers join only a coordinator of the same run "
        "(default: random on one host; with --nnodes > 1, derived from --master-addr, "
        "--master-port and the sizes, the same on every host)",
    )
    parser.add_argument("--monitor-interval", type=float, default=0.1, help=argparse.SUPPRESS)
    parser.add_argument(
        "--grace-period",
        "--grace_period",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds from SIGTERM to SIGKILL when stopping workers (default: %(default)s)",
    )
    parser.add_argument(
        "--hang-timeout",
        "--hang_timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a worker may hold up a peer that waits for it (in a step, a host "
        "collective, at a store key), stay stopped, or block in a host callback before it is "
        "declared hung and the group stopped; compiling and the exit never count; 0: off, "
        "with the idle limit (default: %(default)s)",
    )
    parser.add_argument(
        "--idle-timeout",
        "--idle_timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a pause with no evidence of a hang (every worker alive and between "
        "steps, none waiting for a peer: an evaluation, a checkpoint) may last before it "
        "counts as one, as NCCL's 10-minute watchdog; never while a worker is inside "
        "fdp.runtime.busy(); 0: never (default: %(default)s)",
    )
    parser.add_argument(
        "--no-gpu-binding",
        dest="bind_gpus",
        action="store_false",
        help="leave CUDA_VISIBLE_DEVICES alone (default: one share of the GPUs per worker)",
    )
    parser.add_argument(
        "--no-cpu-binding",
        dest="bind_cpus",
        action="store_false",
        help="do not pin CPU-only workers to a share of the cores (default: pinned)",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the script as a module (python -m)"
    )
    # Optional here so that a missing script is reported by name (from_namespace).
    # What follows the script is not parsed here: the parser (fdp.launch._cli.Parser
    # with script_args=True) hands it to the script unchanged, as the namespace's
    # script_args.
    parser.add_argument(
        "script",
        nargs="?",
        help="the training script (or module with -m); every argument after it is the "
        "script's, passed to it unchanged",
    )


def from_namespace(args: argparse.Namespace) -> LaunchConfig:
    """The config from parsed arguments.

    Raises:
      ValueError: the options are out of range or inconsistent.
    """
    if not args.script:
        raise ValueError(
            "a training script is required: fdp launch [options] script.py [script args], "
            "or -m package.module [args]."
        )
    if args.nnodes > 1 and args.master_addr is None:
        raise ValueError(
            f"--nnodes {args.nnodes} needs --master-addr: the address of node 0, which every "
            "node can reach."
        )
    fields = dict(
        script=args.script,
        script_args=tuple(getattr(args, "script_args", ())),
        module=args.module,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr or "127.0.0.1",
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        tee=args.tee,
        console_ranks=parse_ranks(args.console_ranks),
        monitor_interval=args.monitor_interval,
        grace_period=args.grace_period,
        hang_timeout=args.hang_timeout,
        idle_timeout=args.idle_timeout,
        bind_gpus=args.bind_gpus,
        bind_cpus=args.bind_cpus,
    )
    if args.run_id:
        fields["run_id"] = args.run_id
    elif args.nnodes > 1:
        # Every host's agent must hand its workers the same id (fdp.init checks it
        # against the coordinator's), so derive it from what all hosts are given.
        shared = f"{fields['master_addr']}:{args.master_port}/{args.nnodes}x{args.nproc_per_node}"
        fields["run_id"] = hashlib.sha256(shared.encode()).hexdigest()[:12]
    return LaunchConfig(**fields)
