"""Soak `dgemma serve`: N clients send a mix of requests for a fixed time, and the server must hold up.

The mix, each client drawing by weight with its own seeded generator:
  chat        a chat answer (one of SEEDS, so every answer is asked for many times)
  stream      the same chats streamed: the joined text must equal the non-streamed answer of that seed
  drop        a stream the client abandons after its first chunk (the server must free the row)
  structured  response_format json_schema: the answer must parse and validate (finish_reason stop)
  image       a chat with a PNG as a data URL (the model's vision tower)
  tools       tool_choice "required": the answer must be calls whose arguments are JSON objects
  long        a chat whose ~600-token prompt no other request has (its own words and length), so that every
              one brings new prompt lengths, routings and prefix-cache blocks: what grows a server's memory
              if anything per prompt is kept (not compared: every answer is asked for once)
--mix sets the weights (e.g. `--mix long=6,chat=2,stream=1`); a kind left out is not sent.
With --adapters N, N random LoRA adapters (PEFT folders) are served beside the model (`--lora`) and each
request names the base model or one of them at random. A scraper reads /metrics every 2 s and parses it
with prometheus_client (a failed scrape or parse is an error of kind "metrics").
Every answer is keyed by (what was asked, seed, model); two different answers to one key are a determinism
failure. Errors are counted by kind (HTTP status, exception class, an invalid answer). The server's RSS
is sampled every second from /proc, and read at every --memory-every requests ended (printed as a table);
the plot shows it over time with the requests served, and against the requests ended.

The server is the small model given with --model, or by default a tiny random one built here like the
tests' (tests/conftest.py: a vision tower, Gemma's tokenizer shape and Gemma 4's chat template; needs the
test extra for transformers), or with --model-512 an 8-layer, 512-wide random text model (the prefix cache
benchmark's; bf16 on a CPU with native bf16 matmuls) with Gemma's tokenizer shape and no vision tower.

    python benchmarks/soak.py --minutes 10 --clients 8      # prints a table, then one JSON line
    python benchmarks/soak.py --minutes 1 --clients 4       # a quick look
    python benchmarks/soak.py --minutes 3 --clients 4 --adapters 2   # LoRA adapters by name, mixed in batches
    python benchmarks/soak.py --minutes 30 --clients 2 --model-512 --mix long=6,chat=2,stream=1,structured=1 \
        --serve-args="--eager --prefix-cache-gib 0.05"                # memory over distinct long prompts

Loopback only: the server binds 127.0.0.1 and the loops stop by themselves after --minutes.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import random
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

API_KEY = "sk-soak"
MODEL = "soak"
SEEDS = list(range(8))
KINDS = {"chat": 3, "stream": 3, "drop": 1, "structured": 2, "image": 2, "tools": 2}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}
PROMPTS = ["hello world", "Tell me about the sea.", "Name a colour.", "What is in this picture?"]
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from Paris Ada "
         "red blue small large yes no hello world cat name age city").split()


def long_prompt(index: int) -> str:
    """Prompt `index`'s text: 105-144 numbered words (~530-720 of the Gemma-shaped tokenizer's tokens)."""
    rng = random.Random(index)
    return " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(105 + index % 40))


def build_model_512(root: Path) -> Path:
    """benchmarks/prefix_cache.py's 8-layer, 512-wide model (random weights) with the Gemma-shaped tokenizer
    and its chat template, 2 denoising steps at most, written under `root`."""
    from conftest import write_gemma_tokenizer
    from prefix_cache import model_512

    import dgemma

    model = model_512()
    folder = root / "model-512"
    info = write_gemma_tokenizer(root)
    model.sampling_config = model.sampling_config.replace(
        eos_token_ids=info["eos_token_ids"], pad_token_id=info["pad_token_id"], max_denoising_steps=2)
    dgemma.save_pretrained(model, folder)
    write_gemma_tokenizer(folder)
    return folder


def build_model(root: Path) -> Path:
    """The tests' tiny vision model (random weights), written under `root`."""
    import json as _json
    import shutil

    from conftest import IMAGE_SPECIALS, SMALL_PROCESSOR, SMALL_VISION, make_hf_model, write_gemma_tokenizer

    import dgemma

    words = root / "tokenizer"
    words.mkdir()
    info = write_gemma_tokenizer(words, IMAGE_SPECIALS)
    image, boi, eoi = (info["ids"][t] for t in IMAGE_SPECIALS)
    hf = make_hf_model(seed=5, vision=SMALL_VISION, image_token_id=image, boi_token_id=boi, eoi_token_id=eoi,
                       text=dict(vocab_size=info["vocab_size"], max_position_embeddings=1024,
                                 use_bidirectional_attention="vision"))
    hf.save_pretrained(root / "hf")
    model = dgemma.load_model(root / "hf")
    model.sampling_config = model.sampling_config.replace(
        eos_token_ids=info["eos_token_ids"], pad_token_id=info["pad_token_id"], max_denoising_steps=8)
    folder = root / "model"
    dgemma.save_pretrained(model, folder)
    write_gemma_tokenizer(folder, IMAGE_SPECIALS)
    shutil.copy(ROOT / "tests" / "data" / "gemma4_chat_template.jinja", folder / "chat_template.jinja")
    (folder / "processor_config.json").write_text(_json.dumps({"image_processor": SMALL_PROCESSOR}))
    return folder


def png_url(seed: int) -> str:
    from conftest import png_bytes

    return "data:image/png;base64," + base64.b64encode(png_bytes(24 + seed, 30 + seed, seed=seed)).decode()


class Server:
    """`dgemma serve` on 127.0.0.1 with a free port; its RSS sampled every second."""

    def __init__(self, model: Path, args: list[str], log: Path):
        cmd = [sys.executable, "-m", "dgemma", "serve", "--model", str(model), "--port", "0", "--served-model-name",
               MODEL, "--api-key", API_KEY, "--automaton-cache", "none", *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = log
        # stdout (the address line, then uvicorn's access log) and stderr (tracebacks) share one pipe, drained
        # into the log file for the whole run: a pipe nobody reads fills after a few hundred access lines and
        # then blocks the server's event loop on its next log write
        self.proc = subprocess.Popen(cmd + ["--log-level", "info"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self._log_file = open(log, "w")
        lines = []
        for line in self.proc.stdout:
            self._log_file.write(line)
            lines.append(line)
            if " on http://" in line:
                break
        else:
            self.proc.kill()
            raise SystemExit(f"the server did not start: {''.join(lines[-20:])}")
        self.url = line.rsplit(" on ", 1)[1].strip()
        self._drain = threading.Thread(target=self._copy_output, daemon=True)
        self._drain.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        self.rss: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        threading.Thread(target=self._sample, daemon=True).start()

    def read_rss(self) -> float | None:
        """The server's resident memory now, MiB (None once it is gone)."""
        try:
            return resident_memory(self.proc.pid)["rss"] / 2**20
        except OSError:
            return None

    def _sample(self):
        while not self._stop.wait(1.0):
            mib = self.read_rss()
            if mib is None:
                return
            self.rss.append((time.monotonic() - self.t0, mib))

    def _copy_output(self):
        for line in self.proc.stdout:
            self._log_file.write(line)
            self._log_file.flush()

    def stop(self):
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._drain.join(10)
        self._log_file.close()


class Tally:
    """What the clients saw, shared by their threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.served = collections.Counter()
        self.errors = collections.Counter()  # (kind, what)
        self.latency = collections.defaultdict(list)
        self.answers: dict[tuple, str] = {}
        self.checked = collections.Counter()  # determinism: answers compared with an earlier one
        self.mismatched = collections.Counter()
        self.done: list[float] = []  # when each request ended
        self.scrapes = 0  # /metrics read and parsed
        self.metrics: dict[tuple, float] = {}  # the last scrape: (sample, labels) -> value
        self.read_rss = None  # () -> the server's RSS in MiB, read at every `memory_every` requests ended
        self.memory_every = 0
        self.memory: list[tuple[int, float]] = []  # (requests ended, RSS MiB)
        self.long_count = 0  # long prompts handed out: each client's next one is new

    def next_long(self) -> int:
        with self.lock:
            self.long_count += 1
            return self.long_count - 1

    def _ended(self, t: float):
        self.done.append(t)
        if self.memory_every and len(self.done) % self.memory_every == 0 and self.read_rss is not None:
            self.memory.append((len(self.done), self.read_rss()))

    def ok(self, kind: str, seconds: float, t: float):
        with self.lock:
            self.served[kind] += 1
            self.latency[kind].append(seconds)
            self._ended(t)

    def error(self, kind: str, what: str, t: float):
        with self.lock:
            self.errors[kind, what] += 1
            self._ended(t)

    def answer(self, kind: str, key: tuple, text: str):
        """The answer to `key` (what was asked, seed), compared with the first one seen for it."""
        with self.lock:
            if key in self.answers:
                self.checked[kind] += 1
                self.mismatched[kind] += self.answers[key] != text
            else:
                self.answers[key] = text


def write_adapters(model_dir: Path, root: Path, count: int) -> list[str]:
    """`count` random LoRA adapters of the text layers' q_proj and o_proj, as PEFT folders: ["NAME=PATH", ...]."""
    import torch

    import dgemma
    from dgemma.weights.peft import write_peft_adapter

    model = dgemma.load_model(model_dir)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and n.startswith("layers.") and n.endswith(("q_proj", "o_proj"))}
    flags = []
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        weights = {}
        for name, m in linears.items():
            weights[f"{name}.lora_A"] = torch.randn(4, m.in_features, generator=g) * 0.3
            weights[f"{name}.lora_B"] = torch.randn(m.out_features, 4, generator=g) * 0.3
        folder = write_peft_adapter(root / f"adapter-{i}", weights, rank=4, alpha=8, dropout=0.0,
                                    base_model=str(model_dir), config=model.config)
        flags.append(f"lora-{i}={folder}")
    return flags


def scrape_loop(url: str, deadline: float, tally: Tally, t0: float):
    """/metrics every 2 s, parsed; the last scrape's samples are kept for the summary."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {API_KEY}"}
    while time.monotonic() < deadline:
        try:
            text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).raise_for_status().text
            tally.metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                             for family in text_string_to_metric_families(text) for s in family.samples}
            tally.scrapes += 1
        except Exception as e:
            tally.error("metrics", type(e).__name__, time.monotonic() - t0)
        time.sleep(2)


def chat_body(kind: str, seed: int, model: str = MODEL, long_index: int = 0) -> dict:
    prompt = long_prompt(long_index) if kind == "long" else PROMPTS[seed % 3]
    body = {"model": model, "seed": seed, "max_tokens": 48, "messages": [{"role": "user", "content": prompt}]}
    if kind == "structured":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        body["max_tokens"] = 64
    elif kind == "image":
        body["messages"] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(seed)}},
                                                         {"type": "text", "text": PROMPTS[3]}]}]
        body["max_tokens"] = 32
    elif kind == "tools":
        body["tools"], body["tool_choice"] = [WEATHER], "required"
        body["messages"][0]["content"] = "Weather in Paris?"
    return body


def stream_text(response) -> tuple[str, str | None]:
    """The joined content of a chat stream and its finish reason; raises on an error event."""
    text, reason = [], None
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']['message']}")
        for choice in chunk["choices"]:
            text.append(choice["delta"].get("content") or "")
            reason = choice["finish_reason"] or reason
    return "".join(text), reason


def answer_text(message: dict) -> str:
    """What must be the same for one seed: content, thoughts, calls (names and arguments; ids are random)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return json.dumps([message.get("content"), message.get("reasoning_content"), calls])


def check(kind: str, message: dict, reason: str) -> str | None:
    """Why an answer is wrong for its kind, or None."""
    import jsonschema

    if kind == "structured" and reason == "stop":
        try:
            jsonschema.validate(json.loads(message["content"]), SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"invalid JSON answer: {type(e).__name__}"
    if kind == "tools":
        calls = message.get("tool_calls") or []
        if reason == "tool_calls" and not all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls):
            return "tool arguments are not a JSON object"
        if reason == "stop" and not calls:
            return "a required tool choice gave no call"
    return None


def client_loop(index: int, url: str, deadline: float, tally: Tally, t0: float, models: list[str], mix: dict):
    rng = random.Random(index)
    kinds, weights = zip(*mix.items())
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            seed = rng.choice(SEEDS)
            model = rng.choice(models)
            body = chat_body("chat" if kind in ("stream", "drop") else kind, seed, model,
                             tally.next_long() if kind == "long" else 0)
            start = time.monotonic()
            try:
                if kind in ("stream", "drop"):
                    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                        if r.status_code != 200:
                            r.read()
                            tally.error(kind, f"HTTP {r.status_code}", time.monotonic() - t0)
                            continue
                        if kind == "drop":
                            next(r.iter_lines())  # the first chunk; then the client goes away
                            tally.ok(kind, time.monotonic() - start, time.monotonic() - t0)
                            continue
                        text, reason = stream_text(r)
                    tally.answer(kind, ("chat", seed, model), answer_text({"content": text}))
                else:
                    r = http.post("/v1/chat/completions", json=body)
                    if r.status_code != 200:
                        tally.error(kind, f"HTTP {r.status_code}", time.monotonic() - t0)
                        continue
                    choice = r.json()["choices"][0]
                    problem = check(kind, choice["message"], choice["finish_reason"])
                    if problem:
                        tally.error(kind, problem, time.monotonic() - t0)
                        continue
                    if kind != "long":  # every long prompt is asked once: nothing to compare
                        tally.answer(kind, (kind, seed, model), answer_text(choice["message"]))
            except Exception as e:  # a transport error, a broken stream: counted, the loop goes on
                tally.error(kind, type(e).__name__, time.monotonic() - t0)
                continue
            tally.ok(kind, time.monotonic() - start, time.monotonic() - t0)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def plot(server: Server, tally: Tally, path: Path, minutes: float, clients: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, by_count) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    t = [s / 60 for s, _ in server.rss]
    ax.plot(t, [m for _, m in server.rss], color="tab:blue", label="server RSS (MiB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)", color="tab:blue")
    top = max(m for _, m in server.rss)
    ax.set_ylim(0, top * 1.15)
    twin = ax.twinx()
    done = sorted(tally.done)
    twin.plot([d / 60 for d in done], range(1, len(done) + 1), color="tab:orange", label="requests ended")
    twin.set_ylabel("requests ended (cumulative)", color="tab:orange")
    ax.set_title(f"dgemma serve soak: {clients} clients, {minutes:g} min, mixed requests")
    if tally.memory:
        by_count.plot([n for n, _ in tally.memory], [m for _, m in tally.memory], marker=".", color="tab:blue")
        by_count.set_ylim(0, max(m for _, m in tally.memory) * 1.15)
    by_count.set_xlabel("requests ended")
    by_count.set_ylabel("server RSS (MiB)")
    by_count.set_title(f"RSS every {tally.memory_every} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_mix(text: str) -> dict[str, int]:
    mix = {}
    for part in text.split(","):
        kind, _, weight = part.partition("=")
        if kind not in (*KINDS, "long") or not weight.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r}: want KIND=WEIGHT with KIND one of {', '.join(KINDS)}, long")
        mix[kind] = int(weight)
    return mix


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a small model folder (default: a tiny one built here)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=0, help="random LoRA adapters served beside the model")
    parser.add_argument("--model-512", action="store_true",
                        help="serve an 8-layer, 512-wide random text model (no vision, no tool template: image and tools leave the default mix)")
    parser.add_argument("--mix", type=parse_mix, default=None,
                        help=f"KIND=WEIGHT,... from {', '.join(KINDS)}, long (default: {KINDS}, no long)")
    parser.add_argument("--memory-every", type=int, default=100, help="read the server's RSS every N requests ended")
    parser.add_argument("--serve-args", default="", help="more `dgemma serve` flags, e.g. '--eager'")
    parser.add_argument("--plot", type=plot_file, default=ROOT / "benchmarks" / "soak.png",
                        help="PNG of RSS and requests over time (needs dgemma[plot])")
    parser.add_argument("--server-log", type=Path, default=Path(tempfile.gettempdir()) / "dgemma-soak-server.log",
                        help="the server's stderr (its tracebacks are printed at the end)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (build_model_512 if args.model_512 else build_model)(Path(tmp))
        mix = args.mix or {k: w for k, w in KINDS.items() if not (args.model_512 and k in ("image", "tools"))}
        loras = write_adapters(model, Path(tmp), args.adapters) if args.adapters else []
        models = [MODEL] + [flag.partition("=")[0] for flag in loras]
        server = Server(model, ["--max-batch", str(args.max_batch), "--max-queue", "64",
                                *(a for flag in loras for a in ("--lora", flag)), *args.serve_args.split()],
                        args.server_log)
        try:
            tally = Tally()
            tally.read_rss, tally.memory_every = server.read_rss, args.memory_every
            start = time.monotonic()
            deadline = start + args.minutes * 60
            threads = [threading.Thread(target=client_loop, args=(i, server.url, deadline, tally, server.t0, models, mix))
                       for i in range(args.clients)]
            threads.append(threading.Thread(target=scrape_loop, args=(server.url, deadline, tally, server.t0)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.monotonic() - start
            time.sleep(2)  # a last RSS sample with every request gone
            health = httpx.get(f"{server.url}/health", timeout=10).json()
        finally:
            server.stop()

    rss = [m for _, m in server.rss]
    warm = [m for s, m in server.rss if s >= server.rss[0][0] + 60] or rss  # after the first minute
    print(f"{'kind':<11} {'served':>7} {'errors':>7} {'p50 s':>7} {'p99 s':>7} {'same answer':>12}")
    for kind in mix:
        errors = sum(n for (k, _), n in tally.errors.items() if k == kind)
        lat = tally.latency[kind]
        same = (f"{tally.checked[kind] - tally.mismatched[kind]}/{tally.checked[kind]}"
                if kind in tally.checked else "-")
        p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
        print(f"{kind:<11} {tally.served[kind]:>7} {errors:>7} {p50 or 0:>7.2f} {p99 or 0:>7.2f} {same:>12}")
    all_lat = [x for k in mix for x in tally.latency[k] if k != "drop"]
    print(f"requests served {sum(tally.served.values())} in {wall / 60:.1f} min; errors {dict(tally.errors) or 'none'}")
    print(f"server RSS MiB: start {rss[0]:.0f}, after 1 min {warm[0]:.0f}, end {rss[-1]:.0f}, max {max(rss):.0f}; "
          f"idle at the end: active {health['active']}, waiting {health['waiting']}")
    if tally.memory:
        print("server RSS MiB by requests ended: " + ", ".join(f"{n}: {m:.0f}" for n, m in tally.memory))
    lines = args.server_log.read_text(errors="replace").splitlines()
    problems = [i for i, line in enumerate(lines) if "Traceback" in line or " 500 " in line or "ERROR" in line]
    for i in problems[:5]:
        print("server log:", "\n  ".join(lines[i:i + 25]))
    finished = collections.Counter()
    for (name, labels), value in tally.metrics.items():
        if name == "dgemma_engine_requests_finished_total":
            finished[dict(labels)["model"]] += value
    scraped_errors = {dict(labels)["kind"]: v for (name, labels), v in tally.metrics.items()
                      if name == "dgemma_errors_total" and v}
    print(f"/metrics scraped {tally.scrapes} times; engine requests finished by model (last scrape): "
          f"{dict(finished)}; errors by kind: {scraped_errors or 'none'}")
    plot(server, tally, args.plot, args.minutes, args.clients)
    print(f"plot: {args.plot}")
    summary = {
        "minutes": round(wall / 60, 2), "clients": args.clients, "served": sum(tally.served.values()),
        "served_by_kind": dict(tally.served),
        "errors": {f"{k}: {w}": n for (k, w), n in tally.errors.items()},
        "determinism": {"compared": sum(tally.checked.values()), "mismatched": sum(tally.mismatched.values())},
        "latency_s": {"p50": percentile(all_lat, 0.5), "p99": percentile(all_lat, 0.99),
                      **{k: {"p50": percentile(tally.latency[k], 0.5), "p99": percentile(tally.latency[k], 0.99)}
                         for k in mix}},
        "rss_mib": {"start": round(rss[0], 1), "after_1_min": round(warm[0], 1), "end": round(rss[-1], 1),
                    "max": round(max(rss), 1), "growth_after_1_min": round(rss[-1] - warm[0], 1)},
        "rss_mib_by_requests": [[n, round(m, 1)] for n, m in tally.memory],
        "idle_at_end": health["active"] == 0 and health["waiting"] == 0,
        "adapters": args.adapters, "metrics_scrapes": tally.scrapes, "finished_by_model": dict(finished),
        "metrics_errors_by_kind": scraped_errors,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
