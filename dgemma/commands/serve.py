"""`dgemma serve`: an OpenAI-compatible HTTP server with a playground page: one engine for all requests, or
N replicas of it behind one endpoint on Ray Serve (--replicas).

Here the flags are defined, checked and read into the server's settings; dgemma/serving/server.py builds the
server from them and runs it (serving/replicas.py the replicas)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dgemma.commands import _tensor_parallel
from dgemma.commands._common import (
    UsageError,
    add_model_arguments,
    add_prefix_cache_arguments,
    add_sampler_arguments,
    add_step_cache_arguments,
    agree,
    compile_mode,
    load_from_args,
    non_negative_float,
    positive_float,
    positive_int,
    prefix_cache_bytes,
    sampler_overrides,
    step_cache_overrides,
    wants_compile,
)


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
    p.add_argument("--request-timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="end a request that has run this long (queue time included) with HTTP 504 (a stream: an "
                        "error event) and free its batch row (default: no limit)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="the server's log level ('info' logs every request with its X-Request-Id)")
    add_sampler_arguments(p.add_argument_group("the sampler: the requests' default (each request may set sampler "
                                               "and its settings)"))
    add_step_cache_arguments(p.add_argument_group("the step cache (each request may set step_cache)"))
    g = p.add_argument_group("replicas on Ray Serve (pip install 'dgemma[ray]'; see docs/serving.md)")
    g.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="serve with N whole engines (each its own process, model and batch; with --tensor-parallel M, each "
                        "a split server of M ranks) behind one endpoint")
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
    from dgemma.serving import server

    _check_arguments(args)
    try:
        return server.serve(settings(args), ModelFromFlags(args))
    except server.StartupError as e:
        raise UsageError(str(e)) from None


def settings(args):
    """The flags as the server's settings (dgemma/serving/server.py), with the codec of the model's task."""
    from dgemma.serving.server import ServerSettings
    from dgemma.tasks import read_task, task_codec

    domains = frozenset(d.strip().lower() for d in args.allowed_image_domains.split(",") if d.strip())
    return ServerSettings(
        model=args.model, model_id=getattr(args, "model_name", args.model), revision=args.revision,
        served_model_name=args.served_model_name, host=args.host, port=args.port, api_key=args.api_key or None,
        max_batch=args.max_batch, max_queue=args.max_queue, max_length=args.max_length,
        max_body_bytes=args.max_body_bytes, max_images_per_request=args.max_images_per_request,
        allowed_image_domains=domains,
        automaton_cache=None if args.automaton_cache.lower() == "none" else args.automaton_cache,
        prebuild_json_object=args.prebuild_json_object, lora=tuple(args.lora), shutdown_grace=args.shutdown_grace,
        request_timeout=args.request_timeout, log_level=args.log_level, prefill_chunk=args.prefill_chunk,
        deterministic=args.deterministic, codec=functools.partial(task_codec, read_task(args.model)),
        tp=getattr(args, "tp", None), replicas=args.replicas, ray_address=args.ray_address,
        cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica, device=args.device,
        step_cache=step_cache_overrides(args), sampler=dict(sampler=args.sampler, **sampler_overrides(args)),
        tensor_parallel=args.tensor_parallel,
        command_line=tuple(getattr(args, "argv", ())))


@dataclass(frozen=True)
class ModelFromFlags:
    """The server's ModelLoader: the model as --device, --dtype, --quantize, --compile... and --prefix-cache-gib
    say. Picklable, for the replicas."""

    args: argparse.Namespace

    def load(self, folder: str):
        args = argparse.Namespace(**{**vars(self.args), "model": folder})
        model = load_from_args(args, compile=False)
        self.args.dtype_choice = args.dtype_choice  # said in announce, once the server's settings are checked
        return model

    def announce(self, model):
        print(f"dtype: {self.args.dtype_choice}", file=sys.stderr, flush=True)

    def prefix_cache_bytes(self, model) -> int:
        return prefix_cache_bytes(self.args, model, "serve")

    def compile_mode(self, model) -> str | None:
        """The compiled step's mode, or None for eager (a split model: rank 0's answer on every rank)."""
        return compile_mode(self.args, model) if agree(self.args, lambda: wants_compile(self.args, model)) else None


def _check_arguments(args):
    """What can be checked before any weight is read (and, with --replicas, before Ray starts)."""
    from dgemma.tasks import read_task
    from dgemma.weights.checkpoint import model_config

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
    from dgemma.serving.server import StartupError

    _check_replica_arguments(args)
    try:
        return replicas.serve_replicas(settings(args), ModelFromFlags(args))
    except StartupError as e:
        raise UsageError(str(e)) from None


def ray_app(flags: dict):
    """Ray Serve's application builder, for Ray's own tools: `serve run dgemma.commands.serve:ray_app
    model=DIR replicas=2 quantize=int8` on a running cluster, or a `serve deploy` config whose `args` are
    these flags without their dashes. Ray's tools then own the HTTP address and the application's life."""
    from dgemma.serving import replicas
    from dgemma.weights.hub import resolve_model

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
    args.argv = ["serve", *argv]  # what a split replica runs again
    args.model_name, args.model = args.model, str(resolve_model(args.model, args.revision))
    _check_replica_arguments(args)
    return replicas.application(settings(args), ModelFromFlags(args))


def _check_replica_arguments(args):
    """`_check_arguments`, and with --tensor-parallel N the split's constraints: each replica is a split server,
    and a split that cannot be made is one line before Ray starts."""
    _check_arguments(args)
    if (args.tensor_parallel or 1) > 1:
        _tensor_parallel.check_before_launch(args, args.tensor_parallel)


def _default_automaton_cache() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dgemma" / "automata")
