"""A minute of benchmarks/soak.py: every request kind at once in one `dgemma serve` (LoRA adapters by name, the
prefix cache at its budget, a deterministic server), every answer checked, then SIGTERM with requests running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_minute_of_mixed_load_is_clean(tmp_path):
    from soak_kinds import KINDS

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--minutes", "1", "--clients", "3",
                           "--adapters", "1", "--plot", str(tmp_path / "soak.png"),
                           "--server-log", str(tmp_path / "server.log"), "--check"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    summary = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert set(summary["served_by_kind"]) == set(KINDS), summary["served_by_kind"]  # every kind answered
    assert not summary["unexpected_errors"] and not summary["malformed"] and summary["differing"] == 0, summary
    assert summary["compared"] > 10 and summary["idle_at_end"] and summary["tracebacks"] == 0
    prefix = summary["prefix_cache"]
    assert prefix["evictions"] > 0 and prefix["bytes"] > prefix["budget_bytes"] / 2  # kept at its budget
    assert summary["sigterm"] == {"in_flight": [200, 200], "during_drain": 503, "exit_code": 0, "ok": True}
    assert (tmp_path / "soak.png").stat().st_size > 10_000
