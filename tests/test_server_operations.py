"""`dgemma serve` as operators run it: /metrics, request ids and the access log, a graceful stop on SIGTERM,
and the fast start (eager at once, the compiled step switched in when ready). Real server processes on
loopback, the official openai client."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from conftest import wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, ServerProcess


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: (sample name, sorted labels) -> value."""
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = ServerProcess(tiny_model_dir, "--eager", "--max-batch", "2", "--log-level", "info")
    yield s
    s.stop_cleanly()


def test_metrics_move_with_traffic(server):
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401  # behind the API key
    before = scrape(server)
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="hello world", max_tokens=32, seed=3,
                                    extra_body={"steps": 4, "fixed_steps": True})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=16)
    after = scrape(server)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    ok = {"route": "/v1/completions", "method": "POST", "status": "200"}
    assert moved("dgemma_http_requests_total", **ok) == 1
    assert moved("dgemma_http_requests_total", **{**ok, "status": "404"}) == 1
    assert moved("dgemma_errors_total", kind="model_not_found") == 1
    assert moved("dgemma_prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("dgemma_generation_tokens_total") == out.usage.completion_tokens
    canvases = out.model_extra["dgemma"]["canvases"]
    assert moved("dgemma_denoising_steps_per_canvas_count") == canvases
    assert moved("dgemma_denoising_steps_per_canvas_sum") == 4 * canvases
    assert moved("dgemma_denoising_steps_per_canvas_bucket", le="4.0") == canvases
    assert moved("dgemma_engine_step_seconds_count") >= 4 * canvases
    assert moved("dgemma_engine_requests_finished_total", reason=out.choices[0].finish_reason, model=MODEL) == 1
    assert after[("dgemma_queue_depth", ())] == 0 and after[("dgemma_active_rows", ())] == 0
    assert after[("dgemma_step_compiled", ())] == 0  # --eager
    assert ("dgemma_prefix_cache_hits_total", ()) in after
    cache = httpx.get(f"{server.url}/health", timeout=10).json()["prefix_cache"]  # the default budget: on
    for stat, sample in (("blocks", "dgemma_prefix_cache_blocks"), ("bytes", "dgemma_prefix_cache_bytes"),
                         ("budget_bytes", "dgemma_prefix_cache_budget_bytes"),
                         ("inserted", "dgemma_prefix_cache_inserted_blocks_total"),
                         ("evictions", "dgemma_prefix_cache_evictions_total")):
        assert after[(sample, ())] == cache[stat], sample
    assert cache["budget_bytes"] > 0 and cache["inserted"] > 0


def test_step_cache_requests_count_fewer_decoder_positions_on_metrics(server):
    before = scrape(server)
    client = server.client()
    body = dict(model=MODEL, prompt="hello world", max_tokens=32, seed=3)
    off = client.completions.create(**body, extra_body={"steps": 4, "fixed_steps": True})
    on = client.completions.create(**body, extra_body={"steps": 4, "fixed_steps": True, "step_cache": True})
    after = scrape(server)
    positions = [r.model_extra["dgemma"]["decoder_positions"] for r in (off, on)]
    assert positions[0] == 4 * off.model_extra["dgemma"]["canvases"] * 16  # the tiny model's canvas: 16
    assert 0 < positions[1] <= 4 * on.model_extra["dgemma"]["canvases"] * 16
    key = ("dgemma_decoder_positions_total", ())
    assert after[key] - before.get(key, 0) == sum(positions)


def test_request_ids_and_access_log(server):
    client = server.client()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16, seed=1,
        extra_headers={"X-Request-Id": "client-id-42"})
    assert raw.headers["x-request-id"] == "client-id-42" and raw.parse().choices
    generated = httpx.get(f"{server.url}/health", timeout=10).headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0
    bad = httpx.get(f"{server.url}/v1/nothing", headers={"X-Request-Id": "x" * 500}, timeout=10)
    assert bad.status_code in (401, 404) and bad.headers["x-request-id"] != "x" * 500  # unusable: replaced
    server.stop()  # the module's last test: the access log is complete once the process ended
    log = server.proc.stderr.read()
    assert server.proc.returncode == 0 and "Traceback" not in log, log
    line = next(line for line in log.splitlines() if "request_id=client-id-42" in line)
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in line
    assert f"request_id={generated}" in log


def test_sigterm_drains_then_exits_zero(tiny_model_dir):
    """Mid-stream SIGTERM: new requests 503, the short stream ends with its finish_reason, the one that outlives
    --shutdown-grace ends with an error event, exit code 0. The short stream's 40 steps take well under the
    grace even on a loaded machine (at 200 ms a step)."""
    s = ServerProcess(tiny_model_dir, "--eager", "--max-batch", "2", "--shutdown-grace", "8")
    try:
        client = s.client()
        short = client.completions.create(model=MODEL, prompt="hello", max_tokens=64, seed=5, stream=True,
                                          extra_body={"steps": 10, "fixed_steps": True})  # 4 canvases x 10
        endless = client.completions.create(model=MODEL, prompt="world", max_tokens=240, seed=6, stream=True,
                                            extra_body={"steps": 1000, "fixed_steps": True})
        first = next(iter(short))  # the stream is open and running
        assert first.choices
        endless_result = {}

        def read_endless():
            try:
                endless_result["chunks"] = list(endless)
            except openai.APIError as e:
                endless_result["error"] = str(e)

        reader = threading.Thread(target=read_endless)
        reader.start()
        s.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(f"{s.url}/health", timeout=5).json()["status"] == "draining", 30,
                   "/health says draining after SIGTERM")
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt="late", max_tokens=16)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "shutting_down"
        reasons = [c.choices[0].finish_reason for c in short if c.choices and c.choices[0].finish_reason]
        assert reasons and reasons[0] in ("stop", "length")
        reader.join(60)
        assert "shutting down" in endless_result.get("error", ""), endless_result
        assert s.proc.wait(30) == 0
        assert "Traceback" not in s.proc.stderr.read()
    finally:
        s.stop()


def test_request_timeout_ends_the_request_and_frees_its_row(tiny_model_dir):
    """`--request-timeout 1`: a request that would run for many seconds gets a 504 (code request_timeout) after
    about a second through the openai client, whole or streamed, its row is freed (the server goes idle), and a
    short request then answers."""
    server = ServerProcess(tiny_model_dir, "--eager", "--max-batch", "1", "--request-timeout", "1")
    try:
        client = server.client()
        long = dict(model=MODEL, prompt="hello", max_tokens=224, seed=1,
                    extra_body={"steps": 200, "fixed_steps": True})  # 14 canvases x 200 steps: many seconds
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as error:
            client.completions.create(**long)
        took = time.monotonic() - start
        assert error.value.status_code == 504 and error.value.body["code"] == "request_timeout", error.value.body
        assert "--request-timeout" in error.value.body["message"] and 1 <= took < 10, took
        server.wait_idle(timeout=10)  # the row went with it
        with pytest.raises(openai.APIError) as error:
            for _ in client.completions.create(**long, stream=True):
                pass
        assert error.value.body["code"] == "request_timeout", error.value.body
        server.wait_idle(timeout=10)
        short = client.completions.create(model=MODEL, prompt="hello", max_tokens=16, seed=1, extra_body={"steps": 2})
        assert short.choices[0].finish_reason == "length"
    finally:
        server.stop_cleanly()


@pytest.mark.slow  # one cold compile of the tiny model's step (minutes on 2 cores)
def test_fast_start_then_the_compiled_step(tiny_model_dir, tmp_path, monkeypatch):
    """The first answer within 20 s of launch with an empty compile cache and with a warm one; the switch from
    the eager step to the compiled one keeps each seed's answer (one batch row: the fewest graphs to compile)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("DGEMMA_EAGER", raising=False)  # the test suite runs eagerly otherwise (conftest.py)
    seeds = (1, 2)

    def answers(client):
        return [client.completions.create(model=MODEL, prompt="hello world", max_tokens=32, seed=seed).choices[0].text
                for seed in seeds]

    for cache in ("cold", "warm"):
        launched = time.monotonic()
        s = ServerProcess(tiny_model_dir, "--max-batch", "1")
        try:
            client = s.client()
            eager = answers(client)
            first_answer = time.monotonic() - launched
            assert first_answer < 20, (cache, first_answer)
            if cache == "warm":
                break  # stopped while it compiles: the process ends at once, exit code 0
            deadline = time.monotonic() + 900
            while (step := s.health()["step"]) != "compiled":
                if step != "compiling" or time.monotonic() > deadline:
                    s.stop()
                    raise AssertionError(f"{cache}: step {step}: {s.proc.stderr.read()}")
                time.sleep(0.5)
            assert answers(client) == eager
        finally:
            s.stop_cleanly()
