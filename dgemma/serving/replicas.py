"""Replicas behind Ray Serve (`dgemma serve --replicas N`): N whole dgemma servers, one OpenAI endpoint in front.

Each replica is a Ray actor that builds what one `dgemma serve` builds (its own model, engine worker and
codec: `build_state`) and serves the same FastAPI app (`create_app`) through Ray Serve's ingress, lifespan
included, so the engine thread starts and stops with the replica. Ray Serve's HTTP proxy sends each request
to the less busy of two replicas drawn at random, passes server-sent events through as they are written,
and starts a new replica when one dies or fails its health check (the engine thread stopped). Every answer
names the replica that wrote it in an `x-dgemma-replica` header.

Only commands/serve.py imports this module; it needs the `ray` extra (`pip install 'dgemma[ray]'`).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray import serve

from dgemma.serving.app import create_app
from dgemma.serving.state import ServerState

APP_NAME = "dgemma"
REPLICA_HEADER = "x-dgemma-replica"


@dataclass(frozen=True)
class ReplicaPlan:
    replicas: int
    cpus: float  # Ray's CPU resource per replica; the replica's torch threads follow it
    gpus: float  # 1 for an engine on CUDA; 0 hides the GPUs from the replica (Ray sets CUDA_VISIBLE_DEVICES)
    max_ongoing: int  # requests Ray sends one replica at a time: its batch plus its queue, so 429s are the engine's


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
    def __init__(self, build_state: Callable[[], ServerState], threads: int):
        import torch

        torch.set_num_threads(threads)
        self.state = build_state()

    def __serve_build_asgi_app__(self):
        app = create_app(self.state)
        app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
        return app

    def check_health(self):
        """Ray Serve calls this every few seconds; a raise replaces the replica."""
        if not self.state.worker.alive:
            raise RuntimeError("the engine thread has stopped")


def start_ray(address: str | None) -> dict:
    """Connect to the Ray cluster at `address`, or start a private one on this machine (None). Returns the
    cluster's resources ({"CPU": 2.0, ...})."""
    # "local": always a new instance; ray.init(None) would join a cluster left by `ray start` on this machine
    ray.init(address=address or "local", include_dashboard=False, logging_level=logging.WARNING,
             configure_logging=True)
    return ray.cluster_resources()


QUIET = {"log_level": "WARNING", "enable_access_log": False}  # the replicas' warnings and errors still reach stderr


def application(build_state: Callable[[], ServerState], plan: ReplicaPlan):
    """The replicas as a Ray Serve application, for `serve.run` (this command) or Ray's `serve run`/`serve deploy`."""
    deployment = DGemmaReplica.options(
        num_replicas=plan.replicas, max_ongoing_requests=plan.max_ongoing,
        ray_actor_options={"num_cpus": plan.cpus, "num_gpus": plan.gpus}, logging_config=QUIET)
    return deployment.bind(build_state, max(1, int(plan.cpus)))


def serve_replicas(build_state: Callable[[], ServerState], plan: ReplicaPlan, *, host: str, port: int,
                   announce: Callable[[], None], local: bool) -> int:
    """Deploy `plan.replicas` replicas behind one proxy on host:port and serve until SIGINT or SIGTERM.
    `local`: Serve and Ray were started for this command, and stop with it."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly", logging_config=QUIET)

    def interrupt(*_):  # SIGTERM ends the command as Ctrl-C does, also while the replicas start
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        # returns once every replica has loaded its model and passed its first health check
        serve.run(application(build_state, plan), name=APP_NAME, route_prefix="/", blocking=False)
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
