"""--tensor-parallel N on generate, chat, serve and bench: the model split over N ranks (dgemma.parallel).

Given alone, dgemma checks the split against the model's config (nothing read but config.json and the
shard headers) and starts the N ranks itself with torch.distributed's elastic launcher
(`torch.distributed.run`, standalone rendezvous on this machine), each running the same command line.
Under `torchrun --nproc-per-node N -m dgemma ...` the process is already a rank. Each rank joins the
group (NCCL on CUDA, gloo on a CPU; collectives time out after --rank-timeout seconds), loads its slices,
and runs the command; only rank 0 prints, reads the terminal and speaks HTTP. What rank 0 reads (a
prompt, a chat line, a seed it drew) reaches the other ranks through `agree`.
"""

from __future__ import annotations

import os
import sys

from dgemma.commands._common import UsageError, agree

MONITOR_S = 3.0


def add_arguments(p):
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the model over N ranks (N GPUs, or N processes on a CPU): attention heads, the "
                        "dense MLP, the experts and the vocabulary; dgemma starts the ranks itself, or runs as "
                        "one under torchrun --nproc-per-node N")
    p.add_argument("--rank-timeout", type=float, default=None, metavar="S",
                   help="seconds a rank waits for the others before giving up (default 30): how long a dead or "
                        "hung rank goes unnoticed")
    p.set_defaults(runs_split=True)  # the command runs as N ranks (`dgemma info --tensor-parallel` only plans)


def is_rank() -> bool:
    """Whether this process was started by torch.distributed's launcher (as one of several ranks)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def wanted(args) -> bool:
    """Whether this command runs split: it can (`runs_split`), and --tensor-parallel N > 1 or a launcher asks;
    not `serve --replicas`, whose replicas start split servers of their own (serving/split_replica.py)."""
    replicas = getattr(args, "replicas", None) is not None or getattr(args, "ray_address", None) is not None
    return getattr(args, "runs_split", False) and not replicas and (is_rank() or (args.tensor_parallel or 1) > 1)


def launch_or_join(args, argv: list[str]) -> int | None:
    """Start the ranks (returns the exit code when they are done), or, in a rank, join the group (returns
    None: the command runs here)."""
    ranks = args.tensor_parallel
    if is_rank():
        world = int(os.environ["WORLD_SIZE"])
        if ranks not in (None, world):
            raise UsageError(f"--tensor-parallel {ranks} under a launcher that started {world} ranks")
        args.tensor_parallel = world
        _join(args)
        return None
    check_before_launch(args, ranks)
    return _launch(ranks, argv)


def _device(args) -> str:
    from dgemma import devices

    return devices.resolve_device(args.device)


def check_before_launch(args, ranks: int):
    """The split's constraints, from config.json and the headers alone: one line and exit 2 on failure."""
    from dgemma.parallel.plan import SplitError, check_split
    from dgemma.weights.checkpoint import inspect_checkpoint

    device = _device(args)
    if args.model:
        config, _, _, stored_format = inspect_checkpoint(args.model)
    else:  # `dgemma bench --config PRESET`: random weights
        import dgemma

        config, stored_format = dgemma.get_preset(args.config), None
    try:
        check_split(config, ranks, stored_format or getattr(args, "quantize", None), device)
    except SplitError as e:
        raise UsageError(str(e)) from None


def _launch(ranks: int, argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from dgemma.engine.lockstep import LOST_RANKS_EXIT

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    # the launcher looks at its ranks every MONITOR_S: rank 0 notices a lost rank first (its next collective)
    # and answers 503 meanwhile
    launcher = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0",
                                             f"--monitor-interval={MONITOR_S}", "-m", "dgemma", *argv])
    _quiet_launcher_logs()
    try:
        run(launcher)
    except ChildFailedError as e:
        # the rank that failed first, not those the launcher then stopped (SIGTERM), nor rank 0 leaving because it
        # lost the others (LOST_RANKS_EXIT): the monitor can see both in one pass, rank 0's exit first
        rank, failure = min(e.failures.items(), key=lambda f: (f[1].signal_name() == "SIGTERM",
                                                               f[1].exitcode == LOST_RANKS_EXIT, f[1].timestamp, f[0]))
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        if failure.exitcode == LOST_RANKS_EXIT:  # rank 0 said which rank went silent, in its own line
            return 1
        print(f"dgemma: rank {rank} of {ranks} ended ({how}); the other ranks were stopped", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as e:  # SIGTERM / SIGINT to dgemma: the launcher stopped the ranks, as asked
        return 0 if e.sigval.name in ("SIGTERM", "SIGINT") else 1
    return 0


def _quiet_launcher_logs():
    """The elastic agent logs its progress and a failure report at WARNING; dgemma says it in one line."""
    import logging

    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _join(args):
    import torch

    from dgemma.parallel.group import DEFAULT_TIMEOUT_S, join
    from dgemma.processes import end_with_parent

    end_with_parent()  # a launcher killed outright cannot stop its ranks: they stop themselves

    device = _device(args)
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        args.device = f"cuda:{local}"
    args.tp = join("cuda" if device.startswith("cuda") else "cpu", args.rank_timeout or DEFAULT_TIMEOUT_S)
    # every rank draws what rank 0 draws: seeds a command picks at random come from torch's global generator
    torch.manual_seed(agree(args, lambda: int(torch.randint(0, 2**62, ()).item())))
    if args.tp.rank != 0:  # only rank 0 prints and reads the terminal
        sys.stdout = sys.stderr = open(os.devnull, "w")
        sys.stdin = open(os.devnull)
