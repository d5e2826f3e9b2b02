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
                           "--adapters", "1", "--prefix-cache-gib", "0.0005", "--plot", str(tmp_path / "soak.png"),
                           "--server-log", str(tmp_path / "server.log"), "--check"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    summary = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 0, json.dumps({k: v for k, v in summary.items() if k != "windows"})
    assert set(summary["served_by_kind"]) == set(KINDS), summary["served_by_kind"]  # every kind answered
    assert not summary["unexpected_errors"] and not summary["malformed"] and summary["differing"] == 0, summary
    assert summary["idle_at_end"] and summary["tracebacks"] == 0
    assert summary["prefix_cache"]["evictions"] > 0  # half a MiB: the long prompts alone overflow it
    assert summary["sigterm"] == {"in_flight": [200, 200], "during_drain": 503, "exit_code": 0, "ok": True}
    assert (tmp_path / "soak.png").stat().st_size > 10_000
