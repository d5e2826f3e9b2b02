"""A tiny `dgemma bench` run completes and prints its JSON line (speed itself is not a test)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_tiny_bench_prints_json(tmp_path):
    plot = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "dgemma", "bench", "--config", "tiny", "--batch", "1,2", "--steps", "2",
         "--repeats", "1", "--prompt-len", "8", "--eager", "--plot", str(plot)],
        capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    systems = {(r["system"], r["batch"]) for r in result["results"]}
    assert systems == {(s, b) for s in ("engine-fixed", "engine-adaptive", "transformers", "ar") for b in (1, 2)}
    assert result["speedup_vs_transformers"] > 0 and result["speedup_vs_ar"] > 0
    assert all(r["tokens_per_s"] > 0 for r in result["results"])
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    ran = result["what_ran"]  # what the figures ran: kernels per part, int8 compute, threads, load
    assert ran["int8_compute"] is False and ran["cpu"]["threads"] == 1
    assert ran["cpu"]["openmp_spin"] == "default"  # no int4 weights for OpenVINO: libgomp's own spin
    assert ran["canvas step (16 rows)"]["experts"] == f"{result['dtype']} matmuls (grid or per expert)"
    assert "before" in ran["load_average"] and "after" in ran["load_average"]
    # which dtype ran and why: --dtype auto asks devices.default_dtype, as the generating commands do
    assert result["dtype"] == "float32" and ran["dtype_why"] == "a model 64 wide: on a CPU, bf16 pays from 256 wide"
    assert "what ran: int8 compute off, float32 (a model 64 wide: on a CPU, bf16 pays from 256 wide)" in proc.stdout
    # start-up: fresh processes to the first canvas, eager and compiled from an empty then a filled cache
    startup = result["startup"]
    assert list(startup) == ["eager", "compiled, cold cache", "compiled, warm cache"]
    assert [run["compiled"] for run in startup.values()] == [False, True, True]
    cold, warm = startup["compiled, cold cache"], startup["compiled, warm cache"]
    assert warm["first_canvas_s"] < cold["first_canvas_s"]  # the cold run compiled; the warm one read its kernels
    assert all(0 < run["build_s"] < run["seconds"] for run in startup.values())


def test_bench_rejects_bad_batch():
    proc = subprocess.run([sys.executable, "-m", "dgemma", "bench", "--batch", "one"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--batch" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_rejects_more_layers_than_the_preset_has():
    proc = subprocess.run([sys.executable, "-m", "dgemma", "bench", "--config", "tiny", "--layers", "5"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--layers takes 1 to 4" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_compiles_by_default_and_reports_both_engines(tmp_path):
    """No flag: the compiled engine (here beside the eager one, --with-eager), whose tokens equal the plain
    loop's; the compiled step marks the compile cache warm for this model."""
    cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "dgemma", "bench", "--config", "tiny", "--batch", "1", "--steps", "2", "--repeats", "1",
         "--prompt-len", "8", "--with-eager", "--no-transformers", "--no-adaptive", "--no-startup", "--check-tokens"],
        capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "TORCHINDUCTOR_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # AR decoding is timed twice: turn about with the eager engine, then with the compiled one
    assert {(r["system"], r["group"]) for r in result["results"]} == {
        ("engine-fixed", "eager"), ("ar", "eager"), ("engine-compiled", "compiled"), ("ar", "compiled")}
    assert result["compile"] and result["compile_mode"] == "max-autotune-no-cudagraphs"
    assert result["speedup_vs_ar"] > 0 and result["speedup_vs_ar_eager"] > 0
    assert result["memory"]["1"]["compiled_within_budget"] and result["memory"]["1"]["checked"] == "host rss"
    assert result["tokens_check"] == {"1": {"rows_equal": 1, "rows": 1, "token_agreement": 1.0}}
    assert len(list((cache / "dgemma-warm").iterdir())) == 1  # `dgemma generate` on this model now compiles


def test_systems_are_timed_turn_about():
    """Every round runs each system once, in an order that flips every round, and each system reports
    its fastest run and a memory peak taken per run."""
    from dgemma.benchmarking import timing as bench

    order = []

    class Fake(bench.Timed):
        def __init__(self, name):
            super().__init__(1, "cpu")
            self.system = name

        def generate(self, r):
            order.append((r, self.system))
            return {}

    systems = [Fake("a"), Fake("b"), Fake("c")]
    bench.interleave(systems, 3)
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")]
    for timed in systems:
        assert len(timed.runs) == 3 and timed.fastest()["seconds"] == min(run["seconds"] for run in timed.runs)
        assert all(run["peak_rss"] > 0 and run["rss_before"] > 0 for run in timed.runs)
        assert timed.within_budget(0)


def test_memory_peaks_see_each_run_even_when_freed_memory_is_kept():
    """With freed memory kept for reuse (as `dgemma bench` runs), a run that allocates 64 MB must still
    show 64 MB over its starting point in every repeat, not only the first."""
    script = (
        "import torch\n"
        "from dgemma.benchmarking import timing as bench\n"
        "from dgemma.engine.allocator import keep_freed_memory\n"
        "assert keep_freed_memory()\n"
        "class Allocating(bench.Timed):\n"
        "    system = 'allocating'\n"
        "    def generate(self, r):\n"
        "        torch.ones(16 << 20)\n"  # 64 MB, touched, freed at once
        "        return {}\n"
        "timed = Allocating(1, 'cpu')\n"
        "bench.interleave([timed], 3)\n"
        "print(*[(run['peak_rss'] - run['rss_before']) >> 20 for run in timed.runs])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(int(mb) >= 60 for mb in out.stdout.split()), out.stdout


def test_missing_extras_are_one_line_naming_the_pip_command(monkeypatch, capsys, tmp_path):
    """A core install (no matplotlib, no transformers): --plot is refused before any work, and the transformers
    comparison before it loads anything of transformers, each in one line naming the extra to install."""
    import importlib.util

    import pytest

    from dgemma.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("matplotlib", "transformers") else real(name, *a))
    with pytest.raises(SystemExit) as exit_code:
        main(["bench", "--config", "tiny", "--plot", str(tmp_path / "bench.png")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_code.value.code == 2 and "--plot" in err and "pip install 'dgemma[plot]'" in err
    args = ["bench", "--config", "tiny", "--batch", "1", "--steps", "1", "--repeats", "1", "--prompt-len", "8",
            "--eager", "--no-ar", "--no-adaptive", "--no-startup"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'dgemma[bench]'" in err[0] and "--no-transformers" in err[0], err


def test_an_int4_bench_shortens_torchs_openmp_spin_where_openvino_may_take_the_weights():
    """`dgemma bench --quantize int4` on a CPU with OpenVINO sets GOMP_SPINCOUNT before torch loads (its idle
    threads would hold the cores the library's graphs need) and says so in its record and its "what ran" line;
    DGEMMA_CPU_KERNELS=torch keeps libgomp's default."""
    import importlib.util

    def bench(**env) -> tuple[dict, str]:
        proc = subprocess.run(
            [sys.executable, "-m", "dgemma", "bench", "--config", "tiny", "--quantize", "int4", "--batch", "1",
             "--steps", "1", "--repeats", "1", "--prompt-len", "8", "--eager", "--no-startup", "--no-transformers",
             "--no-ar", "--no-adaptive"],
            capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **env})
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])["what_ran"]["cpu"], proc.stdout

    installed = importlib.util.find_spec("openvino") is not None
    cpu, out = bench()
    assert cpu["openmp_spin"] == ("10000" if installed else "default")
    assert ("(OpenMP spin 10000)" in out) == installed
    assert bench(DGEMMA_CPU_KERNELS="torch")[0]["openmp_spin"] == "default"
