"""The server built from its settings and run: the model loaded with its engine worker and codec
(`build_state`: everything one server, or one replica, serves from), then the HTTP app on a socket until a
graceful stop (`serve`).

`dgemma serve` (commands/serve.py) reads its flags into `ServerSettings`, the model's task among them: the
command decides it and hands the server a `CodecFactory` (the server knows no task; it reads prompts and
writes answers through the codec). How the model itself runs (device, dtype, quantisation, compiling, the
prefix cache's budget) is decided by flags every generating command shares, so the command hands that in as
a `ModelLoader`. A setting the model cannot take (a LoRA adapter that does not fit it, an address that cannot
be listened on) is a `StartupError`: one line, exit code 2.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

from dgemma.chat.codec import Codec
from dgemma.config import ConfigError, settings_not_read
from dgemma.serving.state import DEFAULT_MAX_BODY_BYTES, ServerState

# A model that reads images takes larger bodies by default: its images arrive base64-encoded in them.
IMAGE_MAX_BODY_BYTES = 32 << 20
# After a rank of a split model is lost, rank 0 answers 503 this long (its launcher usually stops it
# sooner), then exits non-zero.
LOST_RANKS_GRACE_S = 10.0


class StartupError(Exception):
    """Why the server cannot start, in one line (the command exits 2 with it)."""


class CodecFactory(Protocol):
    """The codec of the served model's task. Picklable, for the replicas (each calls it with its own copy of
    the folder)."""

    def __call__(self, folder: Path, vocab_size: int) -> Codec:
        """The codec for the model in `folder`, whose vocabulary has `vocab_size` tokens."""


@dataclass(frozen=True)
class ServerSettings:
    """What `dgemma serve`'s flags ask of the server (their help texts say more)."""

    model: str  # the model's folder
    model_id: str  # --model as given: a Hugging Face id names the served model, and replicas fetch it themselves
    revision: str | None
    served_model_name: str | None
    host: str
    port: int  # 0: a free one
    api_key: str | None
    max_batch: int
    max_queue: int
    max_length: int | None
    max_body_bytes: int | None  # None: DEFAULT_MAX_BODY_BYTES, or IMAGE_MAX_BODY_BYTES for a model that reads images
    max_images_per_request: int
    allowed_image_domains: frozenset[str]  # lower case
    automaton_cache: str | None  # a folder; None keeps the automata in memory only
    prebuild_json_object: bool
    lora: tuple[str, ...]  # NAME=PATH, as given
    shutdown_grace: float
    request_timeout: float | None  # seconds a request may run (queue time included); None: no limit
    log_level: str
    prefill_chunk: int | None
    deterministic: bool
    codec: CodecFactory  # text's, or a task's own: the command reads the task from the folder
    tp: object = None  # this rank of a split model (dgemma.parallel), None for a whole model
    # replicas on Ray Serve (replicas.py)
    replicas: int | None = None
    ray_address: str | None = None
    cpus_per_replica: float | None = None
    gpus_per_replica: float | None = None
    device: str = "auto"  # --device: whether a replica reserves a GPU by default
    tensor_parallel: int | None = None  # with replicas: each replica a split server of this many ranks
    command_line: tuple[str, ...] = ()  # `serve ...` as typed: what a split replica runs again
    # --step-cache and its settings, as SamplingConfig.replace keywords (None keeps generation_config.json's)
    step_cache: dict = field(default_factory=dict)
    # --sampler and block refinement's and DDIM's settings, the same way: the requests' defaults
    sampler: dict = field(default_factory=dict)

    @property
    def served_name(self) -> str:
        """The `model` clients send: --served-model-name, else the Hugging Face id, else the folder's name."""
        from dgemma.weights.hub import is_hub_id

        typed = self.model_id  # the id, when the folder came from the Hugging Face cache
        return self.served_model_name or (typed if is_hub_id(typed) and not Path(typed).exists()
                                          else Path(self.model).resolve().name)


class ModelLoader(Protocol):
    """How the model runs, as the command's flags say."""

    def load(self, folder: str):
        """The model in `folder`, eager, on its device (this rank's slices of a split model)."""

    def prefix_cache_bytes(self, model) -> int:
        """The prefix cache's budget."""

    def compile_mode(self, model) -> str | None:
        """The mode the step compiles in, in the background once serving (lifecycle); None: it stays eager."""

    def announce(self, model):
        """The loader's start lines (the dtype it chose and why), once the server's settings are checked: a
        setting the model cannot take is the only line of a failed start."""


def serve(settings: ServerSettings, loader: ModelLoader) -> int:
    """Build the state, listen, and serve until SIGTERM or Ctrl-C has drained the server (lifecycle.py).
    Returns the exit code: 1 when the ranks of a split model were lost."""
    import uvicorn

    from dgemma.serving.app import create_app
    from dgemma.serving.lifecycle import FLUSH_SECONDS, GracefulServer

    server = None

    def lost_ranks():
        print(f"dgemma serve: {state.worker.fatal}; answering 503 to new work until stopped", file=sys.stderr,
              flush=True)
        stop = threading.Timer(LOST_RANKS_GRACE_S, lambda: setattr(server, "should_exit", True))
        stop.daemon = True  # a server stopped sooner (SIGTERM) exits without waiting for it
        stop.start()

    state = build_state(settings, loader, on_fatal=lost_ranks)
    if state is None:  # a rank other than 0 of a split model: it stepped with rank 0 until told to stop
        return 0
    sock = _listen(settings.host, settings.port)
    announce(settings, state.codec.task + (", images" if state.images else ""), sock.getsockname()[1])
    # uvicorn's access log is replaced by the app's own, which names each request's X-Request-Id (middleware.py)
    config = uvicorn.Config(create_app(state), log_level=settings.log_level, access_log=False,
                            log_config=_log_config(settings.log_level), timeout_graceful_shutdown=FLUSH_SECONDS)
    server = GracefulServer(config, state, grace_seconds=settings.shutdown_grace)
    server.run(sockets=[sock])
    if state.worker.fatal:  # the other ranks are gone (a SIGTERM from the launcher ends them first)
        from dgemma.engine.lockstep import LOST_RANKS_EXIT

        _exit_now_if_compiling(state.background_compile, LOST_RANKS_EXIT)
        return LOST_RANKS_EXIT
    if settings.tp is not None:  # the lifespan stopped the engine thread: tell the other ranks
        _stop_the_other_ranks(state.worker.engine)
    _exit_now_if_compiling(state.background_compile)
    return 0


def _exit_now_if_compiling(background, code: int = 0):
    """A compile in progress has nothing to keep: exit with `code` now rather than wait for it, and rather than
    let the interpreter finalize around its thread, which is inside torch's C++ code while it traces (a thread
    that takes the GIL during finalization there aborts the process: "terminate called without an active
    exception")."""
    if background is not None and background.running:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen before uvicorn starts, so the port is known (port 0) and clients that connect early wait
    in the backlog instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def _stop_the_other_ranks(engine):
    from dgemma.engine.lockstep import RanksLost

    engine.close()
    try:
        engine.step()
    except RanksLost:  # they were stopped already (the launcher passes a SIGTERM on to every rank)
        pass


def announce(settings: ServerSettings, what: str, port: int):
    """The line clients and scripts wait for: the served name, what serves it, and the address."""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        print("dgemma serve: warning: listening beyond this machine without --api-key", file=sys.stderr)
    print(f"dgemma serve: {settings.served_name} ({what}, batch {settings.max_batch}, queue {settings.max_queue}) "
          f"on http://{host}:{port}", flush=True)


def _log_config(level: str) -> dict:
    """uvicorn's logging setup, with the "dgemma.access" and "dgemma.serve" loggers on its stderr handler."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for name in ("dgemma.access", "dgemma.serve"):
        config["loggers"][name] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def build_state(settings: ServerSettings, loader: ModelLoader, on_fatal=None) -> ServerState | None:
    """The model loaded, its engine worker and codec: everything one server (or one replica) serves from.
    None on the ranks other than 0 of a split model, once rank 0 has told them to stop; `on_fatal()` runs on
    rank 0 when the ranks are lost."""
    from dgemma.engine import Engine
    from dgemma.serving.worker import EngineWorker
    from dgemma.structured import set_disk_cache

    folder = Path(settings.model)
    model = loader.load(settings.model)  # compiled in the background once serving (lifecycle.py)
    adapters = _load_adapters(settings, model)
    try:
        sampling = model.sampling_config.replace(**settings.step_cache, **settings.sampler)
    except ConfigError as e:  # e.g. DDIM's corrector with the step cache
        raise StartupError(str(e)) from None
    unread = settings_not_read(sampling.sampler, settings.sampler, as_flags=True)
    if unread:
        raise StartupError(unread)
    refusal = model.step_cache_refusal(1 if adapters else 0)  # the server's default applies to every request
    if sampling.step_cache and refusal is not None:
        raise StartupError(f"--step-cache on: {refusal}")
    codec = settings.codec(folder, model.config.vocab_size)
    images = _image_reader(settings, folder, model) if codec.task == "text" else None
    set_disk_cache(settings.automaton_cache)
    engine_args = dict(max_batch=settings.max_batch, max_queue=settings.max_queue, max_length=settings.max_length,
                       prefix_cache_bytes=loader.prefix_cache_bytes(model), prefill_chunk=settings.prefill_chunk,
                       deterministic=settings.deterministic)
    engine_class = Engine
    if settings.tp is None or settings.tp.rank == 0:
        loader.announce(model)
    mode = _compile_mode(loader, model, adapters)  # before any engine steps: on a split model, a collective
    if mode is not None and sampling.step_cache and (settings.tp is None or settings.tp.rank == 0):
        print("dgemma serve: the step cache's steps run eagerly (requests without it: compiled)", file=sys.stderr)
    if settings.tp is not None:
        from dgemma.engine.lockstep import LockstepEngine

        if settings.tp.rank != 0:  # the other ranks step with rank 0 until it says stop
            engine = LockstepEngine(model, **engine_args)
            rank = SimpleNamespace(model=model, engine=engine, max_batch=settings.max_batch,
                                   max_length=engine.max_length, between_steps=None)
            background = _background_compile(settings, rank, mode)  # the same compile and warm-up as rank 0's
            engine.follow()
            _exit_now_if_compiling(background)
            return None
        engine_class = LockstepEngine
    worker = EngineWorker(model, **engine_args, engine_class=engine_class, on_fatal=on_fatal,
                          request_timeout=settings.request_timeout)
    background = _background_compile(settings, worker, mode)
    if settings.prebuild_json_object and codec.task == "text":
        _prebuild_json_object(codec)
    max_body_bytes = settings.max_body_bytes or (IMAGE_MAX_BODY_BYTES if images else DEFAULT_MAX_BODY_BYTES)
    return ServerState(worker=worker, codec=codec, model_name=settings.served_name, sampling=sampling,
                       canvas_length=model.config.canvas_length, api_key=settings.api_key,
                       max_body_bytes=max_body_bytes, images=images,
                       step_kind=background.kind if background is not None else None, background_compile=background,
                       adapters=adapters, adapter_paths=tuple(v.partition("=")[2] for v in settings.lora))


def _compile_mode(loader: ModelLoader, model, adapters: tuple[str, ...]) -> str | None:
    """The compiled step's mode, or None when the step stays eager (a split model: rank 0's on every rank)."""
    if adapters:
        print("dgemma serve: LoRA adapters run on the eager step", file=sys.stderr)
        return None
    return loader.compile_mode(model)


def _background_compile(settings: ServerSettings, worker, mode: str | None):
    """The compiled step, built while the eager one answers (lifecycle.py); None when the step stays eager."""
    if mode is None:
        return None
    from dgemma.serving.lifecycle import BackgroundCompile

    background = BackgroundCompile(worker, mode)
    if settings.tp is not None:  # the ranks switch together, at a lockstep step (dgemma/engine/lockstep.py)
        worker.engine.compile_switch = background
    else:
        worker.between_steps = background.between_steps
    background.start()
    return background


def _load_adapters(settings: ServerSettings, model) -> tuple[str, ...]:
    """--lora NAME=PATH (repeatable): each adapter, a PEFT folder (`dgemma train --lora` writes one as
    RUN/adapter), read and installed on the model; the engine then runs every request in one batch, each row
    with its own adapter (dgemma.model.adapters.RowLoRALinear), and a request's `model` field picks it by NAME.
    A StartupError (one line) for a malformed flag, a name served twice, or an adapter that does not fit."""
    if not settings.lora:
        return ()
    from dgemma.model.adapters import AdapterError, install_adapters
    from dgemma.weights.peft import read_peft_adapter

    flags: list[tuple[str, Path]] = []
    for value in settings.lora:
        name, sep, path = value.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise StartupError(f"--lora {value!r}: expected NAME=PATH")
        if name == settings.served_name or name in {n for n, _ in flags}:
            raise StartupError(f"--lora {name!r}: the name is already served")
        flags.append((name, Path(path)))
    try:
        install_adapters(model, [read_peft_adapter(name, path) for name, path in flags])
    except (AdapterError, OSError, KeyError, ValueError) as e:
        raise StartupError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return tuple(name for name, _ in flags)


def _prebuild_json_object(codec):
    """json_object's automaton, built on a thread of its own; a request that needs it meanwhile waits for this
    build rather than starting another."""

    def build():
        start = time.perf_counter()
        try:
            codec.constraint("json_object")
        except Exception as e:  # the server still serves everything else
            print(f"dgemma serve: json_object automaton not built: {e}", file=sys.stderr, flush=True)
            return
        print(f"dgemma serve: json_object automaton ready ({time.perf_counter() - start:.1f} s)", file=sys.stderr,
              flush=True)

    threading.Thread(target=build, name="prebuild-json-object", daemon=True).start()


def _image_reader(settings: ServerSettings, folder: Path, model):
    """How the server takes images for this model, or None when it has no vision tower."""
    from dgemma.images import ImageError, ImageProcessor
    from dgemma.serving.image_urls import ImageLimits, ImageReader

    if model.vision_tower is None:
        return None
    try:
        processor = ImageProcessor.from_folder(folder)
    except ImageError as e:
        raise StartupError(f"{folder}: image processor settings: {e}") from None
    return ImageReader(processor, model.config, ImageLimits(max_images=settings.max_images_per_request,
                                                            allowed_domains=settings.allowed_image_domains))
