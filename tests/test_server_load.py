"""Load: 32 concurrent clients x 4 requests each against one `dgemma serve` (one engine loop).

Every response must equal the same request run alone (same seed: the engine makes each request's
tokens independent of its batch mates), none may be lost or fail, the server's memory must stay
bounded, and a burst beyond the queue limit must be answered with 429 at once rather than hang.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_server import MODEL, ServerProcess

CLIENTS, REQUESTS_PER_CLIENT = 32, 4
MAX_BATCH, MAX_QUEUE = 8, 64

# Eight different requests: chat and completion, 1-2 canvases, different step counts and fields.
VARIANTS = [
    {"chat": False, "prompt": "hello world", "max_tokens": 16, "seed": 1, "extra": {"steps": 3}},
    {"chat": True, "prompt": "how are you", "max_tokens": 32, "seed": 2, "extra": {"steps": 4}},
    {"chat": False, "prompt": "the water is hot", "max_tokens": 24, "seed": 3,
     "extra": {"steps": 2, "fixed_steps": True}},
    {"chat": True, "prompt": "write a word", "max_tokens": 16, "seed": 4, "extra": {"steps": 5, "entropy_bound": 0.5}},
    {"chat": False, "prompt": "one two", "max_tokens": 32, "seed": 5,
     "extra": {"steps": 3, "t_min": 0.2, "t_max": 1.5}},
    {"chat": True, "prompt": "diffusion sudoku", "max_tokens": 16, "seed": 6, "extra": {"steps": 2}},
    {"chat": False, "prompt": "people find water", "max_tokens": 16, "seed": 7,
     "extra": {"steps": 4, "fixed_steps": True}},
    {"chat": True, "prompt": "hello", "max_tokens": 32, "seed": 8, "extra": {"steps": 3}},
]


def ask(client: openai.OpenAI, v: dict) -> tuple[str, str]:
    if v["chat"]:
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": v["prompt"]}],
                                             max_tokens=v["max_tokens"], seed=v["seed"], extra_body=v["extra"])
        return out.choices[0].message.content, out.choices[0].finish_reason
    out = client.completions.create(model=MODEL, prompt=v["prompt"], max_tokens=v["max_tokens"], seed=v["seed"],
                                    extra_body=v["extra"])
    return out.choices[0].text, out.choices[0].finish_reason


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(tiny_model_dir, "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE))
    yield s
    s.stop()


class LoadWatcher:
    """Polls /health while the load runs: the largest batch and queue the engine held."""

    def __init__(self, server):
        self.server, self.max_active, self.max_waiting = server, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def _poll(self):
        while not self._done.is_set():
            h = self.server.health()
            self.max_active = max(self.max_active, h["active"])
            self.max_waiting = max(self.max_waiting, h["waiting"])
            time.sleep(0.01)


def run_load(server) -> tuple[list, float]:
    def client_session(c: int):
        client = server.client(timeout=120)
        variants = [(c + r * 5) % len(VARIANTS) for r in range(REQUESTS_PER_CLIENT)]  # a different mix per client
        return [(i, ask(client, VARIANTS[i])) for i in variants]

    start = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = [r for session in pool.map(client_session, range(CLIENTS)) for r in session]
    return results, time.monotonic() - start


def test_32_clients_x_4_requests(server):
    client = server.client()
    alone = [ask(client, v) for v in VARIANTS]  # one at a time: each request alone in the engine
    assert all(text for text, _ in alone)
    assert len(set(alone)) == len(VARIANTS)

    rss_before = server.rss_bytes()
    with LoadWatcher(server) as watcher:
        results, seconds = run_load(server)
    rss_after_first = server.rss_bytes()
    results_again, seconds_again = run_load(server)
    rss_after = server.rss_bytes()

    for batch in (results, results_again):
        assert len(batch) == CLIENTS * REQUESTS_PER_CLIENT  # nothing lost; any error would have raised
        for i, answer in batch:
            assert answer == alone[i], f"variant {i} differs under load"
    assert watcher.max_active == MAX_BATCH  # requests really shared forwards
    assert watcher.max_waiting > 0  # and the rest queued for a row
    server.wait_idle(timeout=5)

    mib = 1 << 20
    print(f"\n{2 * CLIENTS * REQUESTS_PER_CLIENT} requests in 2 rounds: {seconds:.1f} s and {seconds_again:.1f} s; "
          f"RSS {rss_before / mib:.0f} MiB before, {rss_after_first / mib:.0f} MiB after round 1, "
          f"{rss_after / mib:.0f} MiB after round 2")
    # the KV cache is preallocated and the queue bounded: load adds no lasting memory
    assert rss_after_first - rss_before < 64 * mib
    assert rss_after - rss_after_first < 16 * mib


def test_burst_over_the_queue_limit_gets_429_not_a_hang(server):
    burst = MAX_BATCH + MAX_QUEUE + 16
    slow = {"steps": 60, "fixed_steps": True}  # each request holds its row for 60 forwards
    client = server.client(timeout=120)
    ready = threading.Barrier(burst)

    def one(i: int):
        ready.wait()  # everyone fires together
        try:
            out = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, seed=i, extra_body=slow)
            return out.choices[0].finish_reason
        except openai.RateLimitError as e:
            return int(e.response.headers["retry-after"])

    start = time.monotonic()
    with ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(one, range(burst)))
    seconds = time.monotonic() - start
    rejected = [r for r in results if isinstance(r, int)]
    served = [r for r in results if isinstance(r, str)]
    print(f"\nburst of {burst}: {len(served)} served, {len(rejected)} got 429, {seconds:.1f} s")
    assert rejected and len(served) + len(rejected) == burst
    assert all(1 <= r <= 60 for r in rejected)
    # a 429 means all queue places were taken at that moment (rows fill only between engine steps),
    # and every request that got a place is served
    assert len(served) >= MAX_QUEUE and set(served) <= {"stop", "length"}
    server.wait_idle(timeout=5)
