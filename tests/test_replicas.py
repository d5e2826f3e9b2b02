"""`dgemma serve --replicas 2` on Ray Serve, driven by the official openai client: requests spread over both
replicas, answers equal per seed to one `dgemma serve`, and a replica killed mid-run costs no request; the same
with each replica a split server of two ranks (--tensor-parallel 2), one of whose ranks is killed.

Everything runs as real processes: the Ray instance the command starts on this machine (its GCS, raylet,
Serve controller and HTTP proxy), the two replica processes, and a one-process `dgemma serve` to compare with.
Ray is a test dependency (the [test] extra holds ray[serve]): without it the first test fails, not skips.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import openai
import pytest

from tests.test_server import MODEL, ServerProcess


def _replica_pids(root: int) -> list[int]:
    """Ray Serve replica processes below `root` (the `dgemma serve` command: its private Ray instance)."""
    found = []
    for pid in _descendants(root):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::ServeReplica"):
                found.append(pid)
        except OSError:
            continue
    return found


def _descendants(root: int) -> list[int]:
    """Every process below `root`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _ask(client: openai.OpenAI, seed: int) -> tuple[str, str | None]:
    """One seeded request (chat or completion, streamed or not, by seed): (its text, the replica that answered)."""
    kind, stream = ("chat", "completion")[seed % 2], seed % 4 >= 2
    common = {"model": MODEL, "max_tokens": 48, "seed": seed, "stream": stream}
    if kind == "chat":
        raw = client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": f"question {seed}"}], **common)
    else:
        raw = client.completions.with_raw_response.create(prompt=f"hello world {seed}", **common)
    answer = raw.parse()
    if stream:
        text = "".join((c.choices[0].delta.content or "") if kind == "chat" else c.choices[0].text
                       for c in answer if c.choices)
    else:
        text = answer.choices[0].message.content if kind == "chat" else answer.choices[0].text
    return text, raw.headers.get("x-dgemma-replica")


def _ask_again(client: openai.OpenAI, seed: int, attempts: int = 6) -> tuple[str, int]:
    """`_ask`, sent again after a broken connection, a 5xx or a stream's error event, as a client of replicas
    should. The openai client's max_retries would do it for all but a stream that broke after it began; here the
    test does it for all.
    Returns the text and how many times it was sent again."""
    for attempt in range(attempts):
        try:
            return _ask(client, seed)[0], attempt
        except openai.APIError as e:
            # a 5xx, a broken connection, or a stream ended by an error event (a split replica's lost rank)
            lost = isinstance(e, (openai.APIConnectionError, openai.InternalServerError)) or type(e) is openai.APIError
            if not lost or attempt == attempts - 1:
                raise
            time.sleep(min(4.0, 0.5 * 2**attempt))  # until Ray Serve's router has dropped the dead replica
    raise AssertionError("unreachable")


def _announced(proc: subprocess.Popen, out: Path, err: Path, timeout: float) -> str:
    """The command's "dgemma serve: ... on http://HOST:PORT" line, once written (Ray writes lines of its own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in out.read_text().splitlines():
            if line.startswith("dgemma serve: ") and " on http://" in line:
                return line
        time.sleep(0.2)
    raise AssertionError(f"no address from the command (exit {proc.poll()}): {err.read_text()[-3000:]}")


def test_two_replicas_answer_as_one_server_and_survive_a_kill(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "dgemma", "serve", "--model", str(tiny_model_dir), "--replicas", "2", "--port", "0",
           "--served-model-name", MODEL, "--automaton-cache", "none", "--max-batch", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DGEMMA_API_KEY": "", "RAY_DEDUP_LOGS": "0"}
    out, err = tmp_path / "stdout", tmp_path / "stderr"  # files: Ray's logs must never fill a pipe and block it
    with out.open("w") as stdout, err.open("w") as stderr:
        ray_serve = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
    single = ServerProcess(tiny_model_dir, "--max-batch", "4", api_key=None)  # starts while Ray starts
    try:
        expected = {seed: _ask(single.client(), seed)[0] for seed in range(20)}
        single.stop_cleanly()
        line = _announced(ray_serve, out, err, timeout=180)
        assert "(2 replicas, batch 4" in line, line
        url = line.rsplit(" on ", 1)[1].strip()
        pids = _replica_pids(ray_serve.pid)
        assert len(pids) == 2, pids

        # 10 requests, 5 at a time: Ray Serve's router sends each to the replica with fewer in flight
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(5) as pool:
            first = dict(zip(range(10), pool.map(lambda s: _ask(client, s), range(10))))
        assert {seed: text for seed, (text, _) in first.items()} == {s: expected[s] for s in range(10)}
        assert len({replica for _, replica in first.values()}) == 2, first

        # 10 more; one replica is killed (SIGKILL) once the first is answered, with four still in flight. Requests it held fail with a 5xx
        # or a broken connection (a stream mid-way), which the client sends again: the other replica answers.
        second, killed_at = {}, None
        with ThreadPoolExecutor(5) as pool:
            futures = {pool.submit(_ask_again, client, seed): seed for seed in range(10, 20)}
            for future in as_completed(futures):
                second[futures[future]] = future.result()
                if killed_at is None:
                    os.kill(pids[0], signal.SIGKILL)
                    killed_at = len(second)
        assert killed_at == 1 and len(second) == 10
        assert {seed: text for seed, (text, _) in second.items()} == {s: expected[s] for s in range(10, 20)}
        print(f"requests sent again after the kill: {sum(again for _, again in second.values())}")
        assert not Path(f"/proc/{pids[0]}").exists() or b"ServeReplica" not in Path(
            f"/proc/{pids[0]}/cmdline").read_bytes()
    finally:
        single.stop()
        if ray_serve.poll() is None:
            ray_serve.send_signal(signal.SIGTERM)  # the command stops Serve and its private Ray instance
            try:
                ray_serve.wait(60)
            except subprocess.TimeoutExpired:
                ray_serve.kill()
                ray_serve.wait()
    assert ray_serve.returncode == 0, err.read_text()[-3000:]


def test_without_the_ray_extra_one_line_and_exit_2(tiny_model_dir, monkeypatch, capsys):
    from dgemma.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets when ray is not installed
    assert main(["serve", "--model", str(tiny_model_dir), "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'dgemma[ray]'" in err, err


def _split_ranks(replica: int) -> dict[int, int]:
    """rank -> pid of the split server's ranks below a replica's process (RANK in their environment)."""
    ranks = {}
    for pid in _descendants(replica):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for rank in (0, 1):
            if f"RANK={rank}".encode() in env and b"-m\0dgemma\0serve" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks[rank] = pid
    return ranks


def _split_processes(model_dir: Path) -> list[int]:
    """Every `dgemma serve --tensor-parallel` process of this model on the machine (launchers and ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if entry.name.isdigit() and b"--tensor-parallel" in cmdline and str(model_dir).encode() in cmdline:
            found.append(int(entry.name))
    return found


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.5)


def test_replicas_of_split_servers_answer_as_one_server_and_a_killed_rank_takes_one_replica(tiny_model_dir,
                                                                                              tmp_path):
    """`dgemma serve --replicas 2 --tensor-parallel 2`: each replica a split server of 2 ranks; answers equal to one
    process per seed from both replicas. A rank of one replica SIGKILLed: that replica's processes are gone
    within 90 s, the endpoint goes on answering (a client sending 5xx again), Ray Serve starts a new replica in
    its place, and SIGTERM leaves no rank of any replica behind."""
    cmd = [sys.executable, "-m", "dgemma", "serve", "--model", str(tiny_model_dir), "--replicas", "2",
           "--tensor-parallel", "2", "--port", "0", "--served-model-name", MODEL, "--automaton-cache", "none",
           "--max-batch", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DGEMMA_API_KEY": "", "RAY_DEDUP_LOGS": "0"}
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        ray_serve = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
    single = ServerProcess(tiny_model_dir, "--max-batch", "4", api_key=None)
    try:
        expected = {seed: _ask(single.client(), seed)[0] for seed in range(12)}
        single.stop_cleanly()
        line = _announced(ray_serve, out, err, timeout=240)
        assert "(2 replicas, each split over 2 ranks, batch 4" in line, line
        client = openai.OpenAI(base_url=f"{line.rsplit(' on ', 1)[1].strip()}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        replicas = _replica_pids(ray_serve.pid)
        assert len(replicas) == 2 and all(len(_split_ranks(r)) == 2 for r in replicas), replicas

        with ThreadPoolExecutor(3) as pool:
            first = dict(zip(range(6), pool.map(lambda s: _ask(client, s), range(6))))
        assert {seed: text for seed, (text, _) in first.items()} == {s: expected[s] for s in range(6)}
        assert len({replica for _, replica in first.values()}) == 2, first

        doomed = [replicas[0], *_descendants(replicas[0])]
        os.kill(_split_ranks(replicas[0])[1], signal.SIGKILL)
        killed = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            second = dict(zip(range(6, 12), pool.map(lambda s: _ask_again(client, s, attempts=12), range(6, 12))))
        assert {seed: text for seed, (text, _) in second.items()} == {s: expected[s] for s in range(6, 12)}
        _wait(lambda: not any(Path(f"/proc/{pid}").exists() for pid in doomed), 90 - (time.monotonic() - killed),
              "the killed rank's replica and its split server gone")
        _wait(lambda: len(set(_replica_pids(ray_serve.pid)) - set(replicas)) == 1, 240, "a new replica")
    finally:
        single.stop()
        if ray_serve.poll() is None:
            ray_serve.send_signal(signal.SIGTERM)
            try:
                ray_serve.wait(90)
            except subprocess.TimeoutExpired:
                ray_serve.kill()
                ray_serve.wait()
    _wait(lambda: not _split_processes(tiny_model_dir), 30, "no split server left")
    assert ray_serve.returncode == 0, err.read_text()[-3000:]


def test_split_replica_command_drops_the_replica_flags():
    from dgemma.serving.split_replica import split_server_command

    argv = ["serve", "--model", "m", "--replicas", "2", "--tensor-parallel=2", "--port=8000", "--host", "0.0.0.0",
            "--ray-addr", "auto", "--cpus-per-replica=4", "--gpus-per-replica", "2", "--max-batch", "4"]
    command = split_server_command(argv, 1234)
    assert command[1:] == ["-m", "dgemma", "serve", "--model", "m", "--tensor-parallel=2", "--max-batch", "4",
                           "--host", "127.0.0.1", "--port", "1234"]


def test_split_replicas_that_cannot_split_one_line_and_exit_2_before_ray_starts(tiny_model_dir, monkeypatch, capsys):
    from dgemma.cli import main

    monkeypatch.setattr("ray.init", lambda *a, **k: pytest.fail("Ray started"))
    assert main(["serve", "--model", str(tiny_model_dir), "--replicas", "2", "--tensor-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tensor-parallel 3 does not divide the 4 attention heads" in err, err


def test_a_split_server_that_cannot_start_says_why_at_once(monkeypatch):
    """A replica whose split server's process cannot even start fails its constructor with the reason (Ray
    Serve reports it), not a wait for a server that will never answer."""
    from dgemma.serving.split_replica import SplitServer

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(RuntimeError, match="the split server did not start: .*No such file"):
        SplitServer(["serve", "--model", "m"], threads_per_rank=1, start_timeout=5)


def test_a_private_ray_instance_collects_no_metrics_and_a_cluster_keeps_its_own(monkeypatch):
    """The private instance (no --ray-address) starts with Ray's metrics collection off (no dashboard reads them;
    its exporter thread is where Ray's OpenTelemetry reader has crashed at start-up); a cluster's settings are
    its own: Ray refuses a _system_config when connecting to one."""
    from dgemma.serving import replicas

    calls = []
    monkeypatch.setattr("ray.init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 2.0})
    assert replicas.start_ray(None) == {"CPU": 2.0}
    assert calls[-1]["address"] == "local"
    assert calls[-1]["_system_config"] == {"enable_metrics_collection": False}
    replicas.start_ray("ray://head:10001")
    assert calls[-1]["address"] == "ray://head:10001" and "_system_config" not in calls[-1]
