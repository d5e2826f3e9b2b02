"""A server's resident memory over distinct long prompts: `dgemma serve --eager` on the 8-layer, 512-wide random
model (benchmarks/soak.py --model-512's; bf16 on a CPU with native bf16), N chats one after another, each
with its own ~600-token prompt (soak.long_prompt: its own words and length) and 16 tokens out. The server's
RSS after the 1st, the 10th and every 25th; then the last prompt and the first sent again (with a prefix
cache: the last is still cached, the first evicted), and the RSS after three idle seconds (the server trims
its heap after one).

    python benchmarks/server_memory.py --requests 300 --serve-args="--prefix-cache-gib 0"
    python benchmarks/server_memory.py --requests 300 --serve-args="--prefix-cache-gib 0.05"

Prints a line per reading, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from soak_kinds import long_prompt
from soak_setup import build_model_512

from dgemma.processes import resident_memory


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: the 512-wide one)")
    parser.add_argument("--serve-args", default="--prefix-cache-gib 0", help="more `dgemma serve` flags")
    args = parser.parse_args()
    n, extra = args.requests, args.serve_args.split()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model_512(Path(tmp))
        proc = subprocess.Popen([sys.executable, "-m", "dgemma", "serve", "--model", str(model), "--port", "0",
                                 "--eager", "--automaton-cache", "none", "--served-model-name", "model", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            record = run(proc, n, extra)
        finally:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(record))


def run(proc, n: int, extra: list[str]) -> dict:
    for line in proc.stdout:
        if " on http://" in line:
            break
    url = line.rsplit(" on ", 1)[1].strip()

    def rss() -> float:
        return resident_memory(proc.pid)["rss"] / 2**20

    def ask(http, i: int) -> dict:
        body = {"model": "model", "seed": i, "max_tokens": 16, "messages": [{"role": "user", "content": long_prompt(i)}]}
        return http.post("/v1/chat/completions", json=body).json()["usage"]

    start, record, lengths = time.time(), {"serve_args": extra, "rss_mib": {}}, []
    with httpx.Client(base_url=url, timeout=600) as http:
        for i in range(n):
            lengths.append(ask(http, i)["prompt_tokens"])
            if i + 1 in (1, 10) or (i + 1) % 25 == 0:
                record["rss_mib"][i + 1] = round(rss(), 1)
                print(f"request {i + 1}: RSS {record['rss_mib'][i + 1]} MiB, {time.time() - start:.0f} s", flush=True)
        record["last_again"], record["first_again"] = ask(http, n - 1), ask(http, 0)
        time.sleep(3)
        record["rss_idle_mib"] = round(rss(), 1)
        record["health"] = http.get("/health").json()
    record["prompt_tokens"] = {"min": min(lengths), "mean": round(sum(lengths) / n, 1), "max": max(lengths)}
    record["growth_10th_to_last_mib"] = round(record["rss_mib"][n] - record["rss_mib"][10], 1)
    return record


if __name__ == "__main__":
    main()
