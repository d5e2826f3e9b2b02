"""`dgemma serve`: an OpenAI-compatible HTTP server with a playground page: one engine for all requests, or
N replicas of it behind one endpoint on Ray Serve (--replicas)."""

from __future__ import annotations

import functools
import os
import socket
import sys
from pathlib import Path

from dgemma.commands import _tensor_parallel
from dgemma.commands._common import (
    UsageError,
    add_model_arguments,
    compile_mode,
    load_from_args,
    add_prefix_cache_arguments,
    non_negative_float,
    positive_int,
    prefix_cache_bytes,
    wants_compile,
)


# After a rank of a split model is lost, rank 0 answers 503 this long (its launcher usually stops it
# sooner), then exits non-zero.
LOST_RANKS_GRACE_S = 10.0


def add_arguments(p):
    add_model_arguments(p, compile_by_default=True)
    _tensor_parallel.add_arguments(p)
    add_prefix_cache_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one; the chosen port is printed)")
    p.add_argument("--api-key", default=os.environ.get("DGEMMA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DGEMMA_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the Hugging Face id, or the folder name)")
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="requests denoised together in one forward; the KV cache is allocated for this many")
    p.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests allowed to wait for a batch slot; more get HTTP 429 with Retry-After")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="positions per request, prompt plus output (default: the model's context, at most 8192)")
    p.add_argument("--max-body-bytes", type=positive_int, default=None,
                   help="larger request bodies get HTTP 413 (default 4 MiB; 32 MiB for a model that reads images, "
                        "which arrive base64-encoded in the body)")
    p.add_argument("--max-images-per-request", type=positive_int, default=8,
                   help="chat requests with more images get HTTP 400")
    p.add_argument("--allowed-image-domains", default="", metavar="HOST,HOST",
                   help="hosts whose http(s) image URLs the server may fetch for a client (exact names, comma "
                        "separated; default none: images come as data URLs)")
    p.add_argument("--automaton-cache", default=_default_automaton_cache(), metavar="DIR",
                   help="keep the token automata of JSON schemas, regexes and tool calls here, so a restarted server "
                        "does not build them again ('none': memory only; default %(default)s)")
    p.add_argument("--prebuild-json-object", action="store_true",
                   help="build response_format json_object's automaton when the server starts, in the background "
                        "(minutes at Gemma's vocabulary; read from --automaton-cache when it is there)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a LoRA adapter (a PEFT folder, as `dgemma train --lora` writes RUN/adapter) under the "
                        "model name NAME, beside the base model; repeatable. Runs the eager step")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long running requests may go on before their streams are ended "
                        "with an error event (new requests get 503 meanwhile; default %(default)s)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="the server's log level ('info' logs every request with its X-Request-Id)")
    g = p.add_argument_group("replicas on Ray Serve (pip install 'dgemma[ray]'; see docs/serving.md)")
    g.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="serve with N whole engines (each its own process, model and batch) behind one endpoint")
    g.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="the Ray cluster to deploy on (`ray start --head` prints it; 'auto': the one on this "
                        "machine); default: a private Ray instance on this machine, stopped with the server")
    g.add_argument("--cpus-per-replica", type=non_negative_float, default=None, metavar="N",
                   help="Ray CPUs each replica reserves, also its torch threads (default: on this machine its "
                        "cores shared out among the replicas; on a cluster 1)")
    g.add_argument("--gpus-per-replica", type=non_negative_float, default=None, metavar="N",
                   help="GPUs each replica reserves (default 1 when --device is cuda, or auto on a machine "
                        "with CUDA; else 0)")


def run(args):
    if args.replicas is not None or args.ray_address is not None:
        return _run_replicas(args)
    import uvicorn

    from dgemma.serving.app import create_app

    _check_arguments(args)
    server = None

    def lost_ranks():
        print(f"dgemma serve: {state.worker.fatal}; answering 503 to new work until stopped", file=sys.stderr,
              flush=True)
        import threading

        threading.Timer(LOST_RANKS_GRACE_S, lambda: setattr(server, "should_exit", True)).start()

    state = build_state(args, on_fatal=lost_ranks)
    if state is None:  # a rank other than 0 of a split model: it stepped with rank 0 until told to stop
        return 0
    # Bind and listen before uvicorn starts, so the port is known (--port 0) and clients that connect
    # early wait in the backlog instead of being refused.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    sock.listen(2048)
    port = sock.getsockname()[1]
    _announce(args, state.codec.task + (", images" if state.images else ""), port)
    from dgemma.serving.shutdown import FLUSH_SECONDS, GracefulServer

    # uvicorn's access log is replaced by the app's own, which names each request's X-Request-Id (traffic.py)
    config = uvicorn.Config(create_app(state), log_level=args.log_level, access_log=False,
                            log_config=_log_config(args.log_level), timeout_graceful_shutdown=FLUSH_SECONDS)
    GracefulServer(config, state, grace_seconds=args.shutdown_grace).run(sockets=[sock])
    worker = state.worker
    if worker.fatal:
        return 1
    if getattr(args, "tp", None) is not None:  # the lifespan stopped the engine thread: tell the other ranks
        from dgemma.engine.lockstep import RanksLost

        worker.engine.close()
        try:
            worker.engine.step()
        except RanksLost:  # they were stopped already (the launcher passes a SIGTERM on to every rank)
            pass
    if state.background_compile is not None and state.background_compile.running:
        sys.stdout.flush()  # a compile in progress has nothing to keep: don't wait for it
        sys.stderr.flush()
        os._exit(0)
    return 0


def _log_config(level: str) -> dict:
    """uvicorn's logging setup, with the "dgemma.access" and "dgemma.serve" loggers on its stderr handler."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for name in ("dgemma.access", "dgemma.serve"):
        config["loggers"][name] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def _adapters(args, model, name: str) -> tuple[str, ...]:
    """--lora NAME=PATH: each adapter read and installed on the model (serving/adapters.py); exit 2 with one line
    for one that does not fit it."""
    if not args.lora:
        return ()
    from dgemma.serving.adapters import load_adapters, parse_lora_flags

    try:
        return load_adapters(model, parse_lora_flags(args.lora, name))
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_arguments(args):
    """What can be checked before any weight is read (and, with --replicas, before Ray starts)."""
    from dgemma.model.checkpoint import model_config
    from dgemma.tasks import read_task

    folder = Path(args.model)
    if not folder.is_dir():
        raise UsageError(f"no such model folder: {folder}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {args.port}")
    try:
        read_task(folder)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.shutdown_grace < 0:
        raise UsageError(f"--shutdown-grace must be >= 0 seconds, got {args.shutdown_grace}")
    context = model_config(folder)[1].max_position_embeddings
    if args.max_length is not None and args.max_length > context:
        raise UsageError(f"--max-length {args.max_length} is more than the model's context of {context}")


def _run_replicas(args):
    """`--replicas N`: N replicas of this server on Ray Serve (dgemma/serving/replicas.py)."""
    if getattr(args, "tensor_parallel", None):
        raise UsageError("--replicas and --tensor-parallel do not combine yet: each replica is one process")
    try:
        import ray  # noqa: F401  (the extra's presence, checked before anything is loaded)
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        raise UsageError("--replicas and --ray-address run on Ray Serve, which is not installed: "
                         "pip install 'dgemma[ray]'") from None
    try:
        from dgemma.serving import replicas
    except ImportError as e:  # ray without its serve extra
        raise UsageError(f"Ray Serve does not import ({e}): pip install 'dgemma[ray]'") from None
    _check_arguments(args)
    count, local = args.replicas or 1, args.ray_address is None
    plan = _replica_plan(args, replicas, local)
    port = _port_for_ray(args.host, args.port)
    resources = replicas.start_ray(args.ray_address)
    for name, each in (("CPU", plan.cpus), ("GPU", plan.gpus)):
        if count * each > resources.get(name, 0):
            raise UsageError(f"{count} replicas of {each:g} {name}s need {count * each:g}; the Ray cluster has "
                             f"{resources.get(name, 0):g} (--cpus-per-replica, --gpus-per-replica)")
    print(f"dgemma serve: starting {count} replicas on Ray Serve ({plan.cpus:g} CPUs, {plan.gpus:g} GPUs each)",
          file=sys.stderr, flush=True)
    announce = functools.partial(_announce, args, f"{count} replicas", port)
    try:
        return replicas.serve_replicas(functools.partial(build_replica_state, args), plan, host=args.host,
                                       port=port, announce=announce, local=local)
    except RuntimeError as e:  # Ray Serve gave up on the replicas (3 failed starts): say what they raised
        raise UsageError(f"the replicas did not start: {_last_error_line(str(e))}") from None


def _replica_plan(args, replicas, local: bool):
    import os

    count = args.replicas or 1
    cpus = args.cpus_per_replica
    if cpus is None:
        cpus = max(1, len(os.sched_getaffinity(0)) // count) if local else 1
    return replicas.ReplicaPlan(replicas=count, cpus=cpus, gpus=_gpus_per_replica(args),
                                max_ongoing=args.max_batch + args.max_queue)


def ray_app(flags: dict):
    """Ray Serve's application builder, for Ray's own tools: `serve run dgemma.commands.serve:ray_app
    model=DIR replicas=2 quantize=int8` on a running cluster, or a `serve deploy` config whose `args` are
    these flags without their dashes. Ray's tools then own the HTTP address and the application's life."""
    import argparse

    from dgemma.model.hub import resolve_model
    from dgemma.serving import replicas

    parser = argparse.ArgumentParser(prog="ray_app", exit_on_error=False)
    add_arguments(parser)
    argv = []
    for name, value in flags.items():
        flag, text = "--" + name.replace("_", "-"), str(value).lower()
        if text in ("true", "false"):  # a switch: given or not
            argv += [flag] if text == "true" else []
        else:
            argv += [flag, str(value)]
    args = parser.parse_args(argv)
    args.model_name, args.model = args.model, str(resolve_model(args.model, args.revision))
    _check_arguments(args)
    return replicas.application(functools.partial(build_replica_state, args), _replica_plan(args, replicas, False))


def _last_error_line(message: str) -> str:
    """'TokenizerError: no tokenizer in DIR ...' from a message that holds a replica's traceback, else its last line."""
    import re

    errors = re.findall(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception): .+)$", message, flags=re.MULTILINE)
    return errors[-1] if errors else message.strip().splitlines()[-1]


def build_replica_state(args):
    """`build_state` in a replica: a model given as a Hugging Face id is fetched into this node's cache."""
    from dgemma.model.hub import is_hub_id, resolve_model

    typed = getattr(args, "model_name", args.model)
    if not Path(args.model).is_dir() and is_hub_id(typed):
        args.model = str(resolve_model(typed, args.revision))
    return build_state(args)


def _gpus_per_replica(args) -> float:
    if args.gpus_per_replica is not None:
        return args.gpus_per_replica
    if args.device.startswith("cuda"):
        return 1
    if args.device == "auto":
        import torch

        return 1 if torch.cuda.is_available() else 0
    return 0


def _port_for_ray(host: str, port: int) -> int:
    """`port` if it is free on this machine (0: a free one), for Ray Serve's proxy, which cannot report a port it
    picked itself and fails in its own process when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        return sock.getsockname()[1]


def build_state(args, on_fatal=None):
    """The model loaded, its engine worker and codec: everything one server (or one replica) serves from.
    None on the ranks other than 0 of a split model (--tensor-parallel), once rank 0 has told them to stop;
    `on_fatal()` runs on rank 0 when the ranks are lost."""
    from dgemma.engine import Engine
    from dgemma.chat.codec import TextCodec
    from dgemma.serving.state import ServerState
    from dgemma.serving.worker import EngineWorker
    from dgemma.structured import set_disk_cache
    from dgemma.tasks import read_task, task_codec
    from dgemma.tokenizer import Tokenizer

    folder = Path(args.model)
    task = read_task(folder)
    model = load_from_args(args, compile=False)  # compiled in the background once serving (fast_start.py)
    adapters = _adapters(args, model, served_name(args))
    vocab_size = model.config.vocab_size
    codec = TextCodec(Tokenizer.from_folder(folder), vocab_size) if task == "text" else task_codec(task, vocab_size)
    images = _image_reader(args, folder, model) if task == "text" else None
    set_disk_cache(None if args.automaton_cache.lower() == "none" else args.automaton_cache)
    engine_args = dict(max_batch=args.max_batch, max_queue=args.max_queue, max_length=args.max_length,
                       prefix_cache_bytes=prefix_cache_bytes(args, model, "serve"), prefill_chunk=args.prefill_chunk,
                       deterministic=args.deterministic)
    engine_class = Engine
    if getattr(args, "tp", None) is not None:
        from dgemma.engine.lockstep import LockstepEngine

        if args.tp.rank != 0:  # the other ranks step with rank 0 until it says stop
            LockstepEngine(model, **engine_args).follow()
            return None
        engine_class = LockstepEngine
    worker = EngineWorker(model, **engine_args, engine_class=engine_class, on_fatal=on_fatal)
    background = None
    if adapters:
        print("dgemma serve: LoRA adapters run on the eager step", file=sys.stderr)
    elif getattr(args, "tp", None) is None and wants_compile(args, model):  # the eager step answers meanwhile
        from dgemma.serving.fast_start import BackgroundCompile

        background = BackgroundCompile(worker, compile_mode(args, model))
        worker.between_steps = background.between_steps
        background.start()
    if args.prebuild_json_object and codec.task == "text":
        _prebuild_json_object(codec)
    return ServerState(worker=worker, codec=codec, model_name=served_name(args), sampling=model.sampling_config,
                       canvas_length=model.config.canvas_length, api_key=args.api_key or None,
                       max_body_bytes=args.max_body_bytes or (32 << 20 if images else 4 << 20), images=images,
                       step_kind=background.kind if background is not None else None, background_compile=background,
                       adapters=adapters, adapter_paths=tuple(v.partition("=")[2] for v in args.lora))


def served_name(args) -> str:
    from dgemma.model.hub import is_hub_id

    typed = getattr(args, "model_name", args.model)  # the id, when the folder came from the Hugging Face cache
    return args.served_model_name or (typed if is_hub_id(typed) and not Path(typed).exists()
                                      else Path(args.model).resolve().name)


def _announce(args, what: str, port: int):
    """The line clients and scripts wait for: the served name, what serves it, and the address."""
    host = f"[{args.host}]" if ":" in args.host else args.host
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print("dgemma serve: warning: listening beyond this machine without --api-key", file=sys.stderr)
    print(f"dgemma serve: {served_name(args)} ({what}, batch {args.max_batch}, queue {args.max_queue}) "
          f"on http://{host}:{port}", flush=True)


def _default_automaton_cache() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma" / "automata")


def _prebuild_json_object(codec):
    """json_object's automaton, built on a thread of its own; a request that needs it meanwhile waits for this
    build rather than starting another."""
    import threading

    def build():
        import time

        start = time.perf_counter()
        try:
            codec.constraint("json_object")
        except Exception as e:  # the server still serves everything else
            print(f"dgemma serve: json_object automaton not built: {e}", file=sys.stderr, flush=True)
            return
        print(f"dgemma serve: json_object automaton ready ({time.perf_counter() - start:.1f} s)", file=sys.stderr,
              flush=True)

    threading.Thread(target=build, name="prebuild-json-object", daemon=True).start()


def _image_reader(args, folder: Path, model):
    """How the server takes images for this model, or None when it has no vision tower."""
    from dgemma.images import ImageError, ImageProcessor
    from dgemma.serving.image_urls import ImageLimits, ImageReader

    if model.vision_tower is None:
        return None
    domains = frozenset(d.strip().lower() for d in args.allowed_image_domains.split(",") if d.strip())
    try:
        processor = ImageProcessor.from_folder(folder)
    except ImageError as e:
        raise UsageError(f"{folder}: image processor settings: {e}") from None
    return ImageReader(processor, model.config,
                       ImageLimits(max_images=args.max_images_per_request, allowed_domains=domains))
