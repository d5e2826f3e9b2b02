"""Replicas behind Ray Serve (`dgemma serve --replicas N`): N whole dgemma servers, one OpenAI endpoint in front.

Each replica is a Ray actor that builds what one `dgemma serve` builds from the same settings (its own model,
engine worker and codec: server.py's `build_state`) and serves the same FastAPI app (`create_app`) through Ray
Serve's ingress, lifespan included, so the engine thread starts and stops with the replica. Ray Serve's HTTP
proxy sends each request to the less busy of two replicas drawn at random, passes server-sent events through
as they are written, and starts a new replica when one dies or fails its health check (the engine thread
stopped). Every answer names the replica that wrote it in an `x-dgemma-replica` header.

With --tensor-parallel N each replica is a split server of N ranks instead (split_replica.py): the replica
reserves N GPUs (or its share of the cores), starts `dgemma serve --tensor-parallel N` on loopback and passes
the requests through; a rank lost takes down that replica only.

`serve_replicas` runs the replicas for `dgemma serve --replicas N`; `application` is the same application for
Ray's own tools (commands/serve.py's `ray_app`). This module needs the `ray` extra (`pip install 'dgemma[ray]'`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray import serve

from dgemma.serving.app import create_app
from dgemma.serving.server import ModelLoader, ServerSettings, StartupError, announce, build_state
from dgemma.serving.split_replica import SplitServer, proxy_app

APP_NAME = "dgemma"
REPLICA_HEADER = "x-dgemma-replica"


@dataclass(frozen=True)
class ReplicaPlan:
    replicas: int
    cpus: float  # Ray's CPU resource per replica; the replica's torch threads follow it
    gpus: float  # 1 for an engine on CUDA; 0 hides the GPUs from the replica (Ray sets CUDA_VISIBLE_DEVICES)
    max_ongoing: int  # requests Ray sends one replica at a time: its batch plus its queue, so 429s are the engine's


def plan_replicas(settings: ServerSettings, local: bool) -> ReplicaPlan:
    """What each replica reserves. `local`: on a Ray instance of this machine's own, whose cores are shared out."""
    count = settings.replicas or 1
    cpus = settings.cpus_per_replica
    if cpus is None:
        cpus = max(1, len(os.sched_getaffinity(0)) // count) if local else 1
    return ReplicaPlan(replicas=count, cpus=cpus, gpus=_gpus_per_replica(settings),
                       max_ongoing=settings.max_batch + settings.max_queue)


def _gpus_per_replica(settings: ServerSettings) -> float:
    if settings.gpus_per_replica is not None:
        return settings.gpus_per_replica
    from dgemma import devices

    ranks = settings.tensor_parallel or 1  # a split replica's ranks take a GPU each
    if settings.device.startswith("cuda"):
        return ranks
    return ranks if settings.device == "auto" and devices.cuda_available() else 0


def build_replica_state(settings: ServerSettings, loader: ModelLoader):
    """`build_state` in a replica: a model given as a Hugging Face id is fetched into this node's cache."""
    from dgemma.weights.hub import is_hub_id, resolve_model

    if not Path(settings.model).is_dir() and is_hub_id(settings.model_id):
        settings = replace(settings, model=str(resolve_model(settings.model_id, settings.revision)))
    return build_state(settings, loader)


class ReplicaHeader:
    """ASGI middleware: `x-dgemma-replica: ID` on every HTTP answer, streams included."""

    def __init__(self, app, replica: str):
        self.app = app
        self.replica = replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]}
            await send(message)

        await self.app(scope, receive, send_with_header)


@serve.deployment(name="DGemma")
@serve.ingress()  # the app is built per replica, from the state its constructor loaded
class DGemmaReplica:
    def __init__(self, settings: ServerSettings, loader: ModelLoader, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.state = build_replica_state(settings, loader)

    def __serve_build_asgi_app__(self):
        app = create_app(self.state)
        app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
        return app

    def check_health(self):
        """Ray Serve calls this every few seconds; a raise replaces the replica."""
        if not self.state.worker.alive:
            raise RuntimeError("the engine thread has stopped")


@serve.deployment(name="DGemma")
@serve.ingress()
class SplitReplica:
    """A replica that is a split server: `dgemma serve --tensor-parallel N` on loopback, requests passed through."""

    def __init__(self, argv: list[str], threads_per_rank: int):
        self.server = SplitServer(argv, threads_per_rank)

    def __serve_build_asgi_app__(self):
        replica = serve.get_replica_context().replica_id.unique_id
        return ReplicaHeader(proxy_app(self.server), replica=replica)

    def check_health(self):
        """A rank lost ends the split server (its rank 0 says 503 until then): Ray Serve replaces the replica."""
        problem = self.server.healthy()
        if problem:
            raise RuntimeError(problem)


def start_ray(address: str | None) -> dict:
    """Connect to the Ray cluster at `address`, or start a private one on this machine (None). Returns the
    cluster's resources ({"CPU": 2.0, ...})."""
    # "local": always a new instance; ray.init(None) would join a cluster left by `ray start` on this machine.
    # A private instance has no dashboard and nothing that reads Ray's own metrics, so it collects none: no
    # exporter thread in its processes, the thread where Ray's OpenTelemetry reader can crash a process at start-up
    # (a rare SIGSEGV in MetricReader::Collect)
    private = {} if address else {"_system_config": {"enable_metrics_collection": False}}
    ray.init(address=address or "local", include_dashboard=False, logging_level=logging.WARNING,
             configure_logging=True, **private)
    return ray.cluster_resources()


SPLIT_HEALTH_CHECK_S = 3.0  # a split replica's lost rank is noticed within this (Ray's default is 10 s)
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # the replicas' warnings and errors still reach stderr


def application(settings: ServerSettings, loader: ModelLoader, plan: ReplicaPlan | None = None):
    """The replicas as a Ray Serve application, for `serve.run` (`serve_replicas`) or Ray's `serve run`/`serve
    deploy` (`plan`: on a cluster by default)."""
    plan = plan or plan_replicas(settings, local=False)
    options = dict(num_replicas=plan.replicas, max_ongoing_requests=plan.max_ongoing,
                   ray_actor_options={"num_cpus": plan.cpus, "num_gpus": plan.gpus}, logging_config=QUIET)
    ranks = settings.tensor_parallel or 1
    if ranks > 1:
        return SplitReplica.options(**options, health_check_period_s=SPLIT_HEALTH_CHECK_S).bind(
            list(settings.command_line), max(1, int(plan.cpus) // ranks))
    return DGemmaReplica.options(**options).bind(settings, loader, max(1, int(plan.cpus)))


def serve_replicas(settings: ServerSettings, loader: ModelLoader) -> int:
    """`dgemma serve --replicas N`: the replicas on the Ray cluster at --ray-address, or on a private Ray instance
    of this machine, behind one endpoint at --host/--port until SIGINT or SIGTERM. A StartupError when the
    cluster cannot hold them or they fail to start."""
    count, local = settings.replicas or 1, settings.ray_address is None
    plan = plan_replicas(settings, local)
    port = _port_for_ray(settings.host, settings.port)
    resources = start_ray(settings.ray_address)
    for name, need in (("CPU", plan.cpus), ("GPU", plan.gpus)):
        if count * need > resources.get(name, 0):
            raise StartupError(f"{count} replicas of {need:g} {name}s need {count * need:g}; the Ray cluster has "
                               f"{resources.get(name, 0):g} (--cpus-per-replica, --gpus-per-replica)")
    ranks = settings.tensor_parallel or 1
    split = f", each split over {ranks} ranks" if ranks > 1 else ""
    print(f"dgemma serve: starting {count} replicas on Ray Serve ({plan.cpus:g} CPUs, {plan.gpus:g} GPUs each{split})",
          file=sys.stderr, flush=True)
    try:
        return _deploy(application(settings, loader, plan), host=settings.host, port=port, local=local,
                       announce=functools.partial(announce, settings, f"{count} replicas{split}", port))
    except RuntimeError as e:  # Ray Serve gave up on the replicas (3 failed starts): say what they raised
        raise StartupError(f"the replicas did not start: {_last_error_line(str(e))}") from None


def _port_for_ray(host: str, port: int) -> int:
    """`port` if it is free on this machine (0: a free one), for Ray Serve's proxy, which cannot report a port it
    picked itself and fails in its own process when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as e:
            raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        return sock.getsockname()[1]


def _last_error_line(message: str) -> str:
    """'TokenizerError: no tokenizer in DIR ...' from a message that holds a replica's traceback, else its last line."""
    errors = re.findall(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception): .+)$", message, flags=re.MULTILINE)
    return errors[-1] if errors else message.strip().splitlines()[-1]


def _deploy(app, *, host: str, port: int, local: bool, announce: Callable[[], None]) -> int:
    """Deploy `app` behind one proxy on host:port and serve until SIGINT or SIGTERM. `local`: Serve and Ray were
    started for this command, and stop with it."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly", logging_config=QUIET)

    def interrupt(*_):  # SIGTERM ends the command as Ctrl-C does, also while the replicas start
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        # returns once every replica has loaded its model and passed its first health check
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        announce()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:  # the replicas failed to start: their error is in the deployment's status
        raise RuntimeError(f"{e}\n{_deployment_messages()}") from None
    finally:
        if local:
            serve.shutdown()
            ray.shutdown()
        else:  # the cluster's Serve stays up for its other applications
            serve.delete(APP_NAME)
    return 0


def _deployment_messages() -> str:
    """What Ray Serve says of the deployment's replicas (a failed constructor's traceback among it)."""
    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception as e:  # noqa: BLE001  (a status that cannot be read adds nothing to the error)
        return f"(no status: {e})"
    return "" if app is None else "\n".join(d.message for d in app.deployments.values() if d.message)
