"""Soak `dgemma serve` under mixed load: every feature at once in one server, every answer checked, and a
graceful stop at the end.

One server (`--max-batch 8`, LoRA adapters by name, a small prefix cache kept at its budget, a time limit per
request) and N clients that loop for --minutes, each drawing a request kind (every kind once first, shared
out over the clients, then by weight; benchmarks/soak_kinds.py: chat, stream, a stream the client drops, n: 2, json_schema, tool calls, images, the step cache, long distinct
prompts, follow-up turns, prompt scoring with logprobs, a completion without max_tokens), a seed from a
shared pool and a model (the base or an adapter) at random. Each kind checks its answers (JSON against its
schema, calls that name a tool with valid arguments, log-probabilities in range...), and answers that must
repeat (the same request and seed on a `--deterministic` server; a stream and its whole chat; choice i of
`n: 2` and the chat of seed + i) are compared. A sampler reads the server's RSS every second and /health and
/metrics every 2 s (the prefix cache's bytes; a failed scrape or parse is an error).

At the end the clients stop, two requests are started and the server gets SIGTERM: they must finish (200),
a request sent during the drain gets 503, and the process must exit 0.

The figures, per window of --window-seconds (default: a minute, 10 s under 20 minutes): RSS, latency
p50/p90/p99, requests and errors, plotted over time (--plot); RSS drift is the mean of the last 15 minutes
against the first 15 (a run under an hour: its last and first quarters). `--check` exits 1 on any
unexpected error, malformed answer, differing answer, a drain that failed or an exit code other than 0.

    python benchmarks/soak.py --minutes 60 --clients 6      # the hour: a table, the plot, one JSON line
    python benchmarks/soak.py --minutes 2 --clients 3 --check   # a quick look (tests/test_soak.py runs this)

The server is the tests' tiny random model with a vision tower, Gemma's tokenizer shape and Gemma 4's chat
template (built here, needs the test extra), or --model. Loopback only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dgemma.commands._common import plot_file
from dgemma.processes import resident_memory

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak_kinds import KINDS, SEEDS, Call, HTTPStatus, Malformed, Shared, parse_mix, png_urls  # noqa: E402

API_KEY = "sk-soak"
MODEL = "soak"


class Server:
    """`dgemma serve` on 127.0.0.1 with a free port; its output drained into `log`."""

    def __init__(self, model: Path, args: list[str], log: Path):
        cmd = [sys.executable, "-m", "dgemma", "serve", "--model", str(model), "--port", "0", "--served-model-name",
               MODEL, "--api-key", API_KEY, "--automaton-cache", "none", "--log-level", "info", *args]
        # stdout (the address, then the access log) and stderr share one pipe, drained for the whole run: a
        # pipe nobody reads fills and then blocks the server's event loop on its next log write
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        self._log = open(log, "w")
        lines = []
        for line in self.proc.stdout:
            self._log.write(line)
            lines.append(line)
            if " on http://" in line:
                break
        else:
            raise SystemExit(f"the server did not start: {''.join(lines[-20:])}")
        self.url = line.rsplit(" on ", 1)[1].strip()
        self._drain = threading.Thread(target=self._copy_output, daemon=True)
        self._drain.start()

    def rss_mib(self) -> float | None:
        try:
            return resident_memory(self.proc.pid)["rss"] / 2**20
        except OSError:
            return None

    def _copy_output(self):
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._drain.join(10)
        self._log.close()


class Tally:
    """What the clients and the sampler saw, shared by their threads."""

    def __init__(self, t0: float):
        self.t0, self.lock = t0, threading.Lock()
        self.ended: list[tuple[float, str, float, str]] = []  # (t, kind, seconds, "ok" | "error" | "malformed")
        self.errors = collections.Counter()  # (kind, what)
        self.malformed = collections.Counter()  # (kind, why)
        self.notes = collections.Counter()
        self.answers: dict[tuple, object] = {}
        self.compared = collections.Counter()  # answers compared with an earlier one, by kind
        self.differing = collections.Counter()
        self.largest_gap = collections.Counter()  # kinds compared within a tolerance: the largest gap seen
        self.samples: list[tuple[float, float, int | None]] = []  # (t, RSS MiB, prefix cache bytes)
        self.health: dict = {}
        self.scrapes = 0
        self.read_rss, self.memory_every = None, 0  # RSS also read at every `memory_every` requests ended
        self.memory: list[tuple[int, float]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def end(self, kind: str, seconds: float, outcome: str, what: str = ""):
        with self.lock:
            self.ended.append((self.now(), kind, seconds, outcome))
            if self.memory_every and len(self.ended) % self.memory_every == 0:
                self.memory.append((len(self.ended), self.read_rss()))
            if outcome == "error":
                self.errors[kind, what] += 1
            elif outcome == "malformed":
                self.malformed[kind, what] += 1

    def same(self, kind: str, key: tuple, answer, tolerance: float = 0.0):
        """`answer` against the first one for `key`: equal, or (numbers: `tolerance` > 0) each within it."""
        with self.lock:
            if key not in self.answers:
                self.answers[key] = answer
                return
            self.compared[kind] += 1
            first = self.answers[key]
            if tolerance:
                gaps = [abs(a - b) for a, b in zip(first, answer) if a is not None and b is not None]
                self.largest_gap[kind] = max([self.largest_gap[kind], *gaps])
                self.differing[kind] += len(first) != len(answer) or any(g > tolerance for g in gaps) \
                    or [a is None for a in first] != [b is None for b in answer]
            else:
                self.differing[kind] += first != answer


def client_loop(index: int, clients: int, url: str, deadline: float, tally: Tally, shared: Shared, mix: dict):
    rng = random.Random(index)
    names, weights = zip(*mix.items())
    # the kinds shared out over the clients first, each sent once even after the deadline, then by weight
    first = [n for n, w in mix.items() if w][index::clients]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600) as http:
        while time.monotonic() < deadline or first:
            name = first.pop() if first else rng.choices(names, weights)[0]
            call = Call(http, rng, shared, seed=rng.choice(SEEDS), model=rng.choice(shared.models),
                        same=lambda key, answer, tolerance=0.0, name=name: tally.same(name, key, answer, tolerance),
                        note=lambda what: tally.notes.update([what]))
            start = time.monotonic()
            try:
                KINDS[name][0](call)
            except Malformed as e:
                tally.end(name, time.monotonic() - start, "malformed", str(e))
            except HTTPStatus as e:
                tally.end(name, time.monotonic() - start, "error", f"HTTP {e.status}: {e.body[:120]}")
            except Exception as e:  # a transport error, a broken stream: counted, the loop goes on
                tally.end(name, time.monotonic() - start, "error", f"{type(e).__name__}: {str(e)[:120]}")
            else:
                tally.end(name, time.monotonic() - start, "ok")


def sample_loop(server: Server, stop: threading.Event, tally: Tally):
    """RSS every second; /health and /metrics (parsed by prometheus_client) every 2 s."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {API_KEY}"}
    tick = 0
    while not stop.wait(1.0):
        rss = server.rss_mib()
        if rss is None:
            return
        cache = (tally.health.get("prefix_cache") or {}).get("bytes")
        tally.samples.append((tally.now(), rss, cache))
        tick += 1
        if tick % 2:
            continue
        try:
            tally.health = httpx.get(f"{server.url}/health", timeout=30).json()
            text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30).raise_for_status().text
            list(text_string_to_metric_families(text))
            tally.scrapes += 1
        except Exception as e:
            tally.end("metrics", 0.0, "error", type(e).__name__)


def drain_on_sigterm(server: Server, shared: Shared, tally: Tally, grace: float) -> dict:
    """Two requests running, then SIGTERM: both must finish with 200, one sent during the drain must get 503,
    and the process must exit 0."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    results: list = [None, None]

    def ask(i: int):
        body = {"model": MODEL, "seed": i, "max_tokens": 160, "messages": [{"role": "user", "content": "hello world"}],
                "steps": 48, "fixed_steps": True}
        try:
            results[i] = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers,
                                    timeout=grace + 60).status_code
        except httpx.HTTPError as e:
            results[i] = type(e).__name__

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 600  # a loaded machine admits slowly
    while time.monotonic() < deadline:  # both admitted (running or queued) before the signal
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        if health["active"] + health["waiting"] >= 2:
            break
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    try:
        during = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers,
                            timeout=30).status_code
    except httpx.HTTPError as e:
        during = type(e).__name__
    for t in threads:
        t.join()
    try:
        code = server.proc.wait(grace + 30)
    except subprocess.TimeoutExpired:
        code = "still running"
    return {"in_flight": results, "during_drain": during, "exit_code": code,
            "ok": results == [200, 200] and during == 503 and code == 0}


def windows(tally: Tally, width: float) -> list[dict]:
    """Per window of `width` seconds: requests ended, unexpected errors, malformed answers, latency
    percentiles (dropped streams left out) and the RSS."""
    out = []
    last = max([t for t, *_ in tally.ended] + [s[0] for s in tally.samples] + [width])
    for w in range(int(last // width) + 1):
        lo, hi = w * width, (w + 1) * width
        ended = [e for e in tally.ended if lo <= e[0] < hi]
        lat = sorted(s for _, k, s, outcome in ended if outcome == "ok" and k not in ("drop", "metrics"))
        rss = [m for t, m, _ in tally.samples if lo <= t < hi]
        out.append({"t": hi, "requests": sum(k != "metrics" for _, k, *_ in ended),
                    "errors": sum(o == "error" for *_, o in ended), "malformed": sum(o == "malformed" for *_, o in ended),
                    "p50": percentile(lat, 0.5), "p90": percentile(lat, 0.9), "p99": percentile(lat, 0.99),
                    "rss": sum(rss) / len(rss) if rss else None})
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def rss_drift(tally: Tally, minutes: float) -> dict:
    """Mean RSS of the first and last 15 minutes (a run under an hour: first and last quarter)."""
    span = 15 * 60 if minutes >= 60 else minutes * 60 / 4
    end = tally.samples[-1][0]
    first = [m for t, m, _ in tally.samples if t < span]
    last = [m for t, m, _ in tally.samples if t >= end - span]
    a, b = sum(first) / len(first), sum(last) / len(last)
    return {"span_min": round(span / 60, 2), "first_mib": round(a, 1), "last_mib": round(b, 1),
            "change": round(b / a - 1, 4)}


def plot(tally: Tally, rows: list[dict], path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, lat, count) = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    rss.plot([t / 60 for t, *_ in tally.samples], [m for _, m, _ in tally.samples], color="tab:blue")
    rss.set_ylabel("server RSS (MiB)")
    rss.set_ylim(0, max(m for _, m, _ in tally.samples) * 1.15)
    cache = [(t / 60, c / 2**20) for t, _, c in tally.samples if c is not None]
    if cache:
        twin = rss.twinx()
        twin.plot(*zip(*cache), color="tab:gray", lw=0.8)
        twin.set_ylabel("prefix cache held (MiB)", color="tab:gray")
        twin.set_ylim(0, max(c for _, c in cache) * 1.6 + 1e-9)
    rss.set_title(title)
    width = rows[0]["t"] / 60 if rows else 1.0
    t = [r["t"] / 60 - width / 2 for r in rows]  # each window at its middle
    for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        lat.plot(t, [r[q] for r in rows], style, color="tab:orange", label=q)
    lat.set_ylabel("latency (s), answers of the window")
    lat.legend(loc="upper left")
    count.bar(t, [r["requests"] for r in rows], width=width * 0.8, color="tab:green", label="requests")
    count.plot(t, [r["errors"] + r["malformed"] for r in rows], "x-", color="tab:red",
               label="unexpected errors + malformed answers")
    count.set_ylabel("per window")
    count.set_xlabel("minutes")
    count.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a small model folder with a vision tower and "
                                                                 "a chat template (default: a tiny one built here)")
    parser.add_argument("--model-512", action="store_true", help="serve an 8-layer, 512-wide random text model "
                        "(no vision, no tool template: image and tools leave the default mix)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=2, help="random LoRA adapters served beside the model")
    parser.add_argument("--mix", type=parse_mix, default=None,
                        help=f"KIND=WEIGHT,... (default {','.join(f'{k}={w}' for k, (_, w) in KINDS.items())})")
    parser.add_argument("--prefix-cache-gib", type=float, default=0.004,
                        help="small, so that the long prompts keep it at its budget")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--window-seconds", type=float, default=None)
    parser.add_argument("--memory-every", type=int, default=0, help="also read the server's RSS every N requests "
                                                                   "ended (printed)")
    parser.add_argument("--serve-args", default="--deterministic", help="more `dgemma serve` flags")
    parser.add_argument("--plot", type=plot_file, default=ROOT / "benchmarks" / "soak-mixed.png")
    parser.add_argument("--server-log", type=Path, default=Path(tempfile.gettempdir()) / "dgemma-soak-server.log")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the run was clean")
    args = parser.parse_args()
    mix = args.mix or {k: w for k, (_, w) in KINDS.items() if not (args.model_512 and k in ("image", "tools"))}
    width = args.window_seconds or (60.0 if args.minutes >= 20 else 10.0)

    from soak_setup import build_model, build_model_512, write_adapters

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (build_model_512 if args.model_512 else build_model)(Path(tmp))
        loras = write_adapters(model, Path(tmp), args.adapters)
        server = Server(model, ["--max-batch", str(args.max_batch), "--max-queue", "64", "--eager",
                                "--prefix-cache-gib", str(args.prefix_cache_gib),
                                "--request-timeout", str(args.request_timeout),
                                *(a for flag in loras for a in ("--lora", flag)), *args.serve_args.split()],
                        args.server_log)
        shared = Shared(models=[MODEL] + [flag.partition("=")[0] for flag in loras], images=png_urls(len(SEEDS)),
                        lock=threading.Lock())
        tally = Tally(time.monotonic())
        tally.read_rss, tally.memory_every = server.rss_mib, args.memory_every
        stop = threading.Event()
        try:
            sampler = threading.Thread(target=sample_loop, args=(server, stop, tally), daemon=True)
            sampler.start()
            deadline = time.monotonic() + args.minutes * 60
            clients = [threading.Thread(target=client_loop,
                                        args=(i, args.clients, server.url, deadline, tally, shared, mix))
                       for i in range(args.clients)]
            for thread in clients:
                thread.start()
            for thread in clients:
                thread.join()
            wall = tally.now()
            health = httpx.get(f"{server.url}/health", timeout=10).json()
            stop.set()
            drain = drain_on_sigterm(server, shared, tally, grace=30)
        finally:
            stop.set()
            server.kill()
    report(args, tally, mix, width, wall, health, drain)


def report(args, tally: Tally, mix: dict, width: float, wall: float, health: dict, drain: dict):
    rows = windows(tally, width)
    print(f"{'kind':<11} {'served':>7} {'errors':>7} {'malformed':>9} {'p50 s':>7} {'p99 s':>7} {'same answer':>12}")
    for name in mix:
        ended = [e for e in tally.ended if e[1] == name]
        lat = [s for _, _, s, o in ended if o == "ok"]
        same = f"{tally.compared[name] - tally.differing[name]}/{tally.compared[name]}" if tally.compared[name] else "-"
        print(f"{name:<11} {sum(o == 'ok' for *_, o in ended):>7} {sum(o == 'error' for *_, o in ended):>7} "
              f"{sum(o == 'malformed' for *_, o in ended):>9} {percentile(lat, 0.5) or 0:>7.2f} "
              f"{percentile(lat, 0.99) or 0:>7.2f} {same:>12}")
    drift = rss_drift(tally, args.minutes)
    errors, malformed = sum(tally.errors.values()), sum(tally.malformed.values())
    differing = sum(tally.differing.values())
    print(f"{sum(o == 'ok' for *_, o in tally.ended)} answers in {wall / 60:.1f} min; unexpected errors "
          f"{dict(tally.errors) or 0}; malformed {dict(tally.malformed) or 0}; notes {dict(tally.notes)}")
    print(f"RSS: first {drift['span_min']:g} min {drift['first_mib']} MiB, last {drift['last_mib']} MiB "
          f"({drift['change']:+.1%}); prefix cache at the end {health.get('prefix_cache')}")
    print(f"SIGTERM with 2 requests running: {drain}")
    if tally.memory:
        print("server RSS MiB by requests ended: " + ", ".join(f"{n}: {m:.0f}" for n, m in tally.memory))
    lines = args.server_log.read_text(errors="replace").splitlines()
    for i in [i for i, line in enumerate(lines) if "Traceback" in line][:3]:
        print("server log:", "\n  ".join(lines[i:i + 25]))
    plot(tally, rows, args.plot, f"dgemma serve soak: {args.clients} clients, {wall / 60:.3g} min, every kind at once")
    print(f"plot: {args.plot}")
    lat = [s for _, k, s, o in tally.ended if o == "ok" and k not in ("drop", "metrics")]
    summary = {
        "minutes": round(wall / 60, 2), "clients": args.clients, "adapters": args.adapters,
        "served": sum(o == "ok" for *_, o in tally.ended),
        "served_by_kind": dict(collections.Counter(k for _, k, _, o in tally.ended if o == "ok")),
        "unexpected_errors": {f"{k}: {w}": n for (k, w), n in tally.errors.items()},
        "malformed": {f"{k}: {w}": n for (k, w), n in tally.malformed.items()},
        "compared": sum(tally.compared.values()), "differing": differing, "notes": dict(tally.notes),
        "largest_gap": dict(tally.largest_gap),
        "latency_s": {"p50": percentile(lat, 0.5), "p90": percentile(lat, 0.9), "p99": percentile(lat, 0.99)},
        "rss_drift": drift, "rss_max_mib": round(max(m for _, m, _ in tally.samples), 1),
        "prefix_cache": health.get("prefix_cache"), "idle_at_end": health["active"] == 0 and health["waiting"] == 0,
        "metrics_scrapes": tally.scrapes, "sigterm": drain, "windows": rows,
        "rss_mib_by_requests": [[n, round(m, 1)] for n, m in tally.memory],
        "tracebacks": sum("Traceback" in line for line in lines),
    }
    print(json.dumps(summary))
    clean = not errors and not malformed and not differing and drain["ok"] and summary["idle_at_end"] \
        and not summary["tracebacks"]
    if args.check and not clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
