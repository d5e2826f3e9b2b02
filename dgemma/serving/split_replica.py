"""A replica that is a split server (`dgemma serve --replicas R --tensor-parallel N`): N ranks behind each replica.

Ray Serve places the replica (an actor reserving N GPUs, or its share of the CPU cores); the replica starts a
`dgemma serve --tensor-parallel N` of its own on loopback, with the command's flags less the replicas' (so
torch.distributed's launcher starts its N ranks, as for any split server), and forwards every HTTP request to
it, server-sent events as they are written. The split server lives and dies with its replica:
  * the replica's process ending (Ray stops it, or it is killed) sends the split server's launcher SIGTERM,
    and the launcher stops its ranks;
  * a rank that dies or hangs ends the split server (its rank 0 answers 503 until then), which fails the
    replica's health check: Ray Serve starts a new replica in its place, and the others go on answering.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dgemma.processes import end_with_parent

# the flags that place replicas; a replica's split server listens on loopback at a port of its own
REPLICA_FLAGS = ("--replicas", "--ray-address", "--cpus-per-replica", "--gpus-per-replica", "--host", "--port")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length", "host"}


def split_server_command(argv: list[str], port: int) -> list[str]:
    """The command line a replica runs: `argv` (`serve ...` as typed) without the replicas' flags, listening on
    127.0.0.1:port. argparse accepted `argv`, so an abbreviated flag names exactly one option."""
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        dropped = token.startswith("--") and len(name) > 3 and any(f.startswith(name) for f in REPLICA_FLAGS)
        if dropped:
            skip = "=" not in token  # the value is the next token
            continue
        kept.append(token)
    return [sys.executable, "-m", "dgemma", *kept, "--host", "127.0.0.1", "--port", str(port)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SplitServer:
    """`dgemma serve --tensor-parallel N` in a process group of its own, started and awaited by one thread."""

    def __init__(self, argv: list[str], threads_per_rank: int, start_timeout: float = 600.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkdtemp(prefix="dgemma-split-replica-")) / "stderr"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank)}
        command = split_server_command(argv, self.port)
        self._started, self._start_error = threading.Event(), None
        self._thread = threading.Thread(target=self._run, args=(command, env), name="split-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the split server did not start: {self._start_error}")
        self._wait_until_ready(start_timeout)

    def _run(self, command, env):
        try:
            with self.log.open("w") as stderr:
                self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=stderr, env=env, start_new_session=True,
                                                preexec_fn=end_with_parent)
        except (OSError, subprocess.SubprocessError) as e:
            self._start_error = e
            return
        finally:
            self._started.set()
        self.process.wait()  # this thread ends with the split server, never before (end_with_parent)

    def _wait_until_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            problem = self.healthy()
            if problem is None:
                return
            if self.process.poll() is not None:  # ended: it will not answer
                raise RuntimeError(problem)
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the split server did not answer within {timeout:g} s: {self.last_error()}")

    def last_error(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else "(nothing on its stderr)"

    def healthy(self) -> str | None:
        """None when the split server answers /health with 200, else why not."""
        if self.process.poll() is not None:
            return f"the split server ended (exit code {self.process.returncode}): {self.last_error()}"
        try:
            answer = httpx.get(f"{self.url}/health", timeout=10)
        except httpx.TransportError as e:
            return f"the split server does not answer: {e}"
        return None if answer.status_code == 200 else f"the split server's /health: {answer.text}"

    def stop(self, grace: float = 30.0):
        """SIGTERM to the launcher and its ranks, SIGKILL after `grace` seconds."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def proxy_app(server: SplitServer):
    """An ASGI app that sends every request on to `server` and its answer back as it comes; the split server
    stops with the app (Ray Serve ends the app's lifespan when it stops the replica)."""
    import asyncio
    import contextlib

    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(None, connect=10))

    async def forward(request):
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        outgoing = client.build_request(request.method, request.url.path, params=request.query_params,
                                        headers=headers, content=await request.body())
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.TransportError:
            body = {"error": {"message": "this replica's split server is not running; send the request again",
                              "type": "server_error", "param": None, "code": "replica_unavailable"}}
            return JSONResponse(body, status_code=503)
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=kept,
                                 background=BackgroundTask(answer.aclose))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()
        await asyncio.to_thread(server.stop)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)
