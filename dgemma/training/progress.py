"""What a run shows and leaves behind: a rich progress bar (or plain lines when not on a terminal), the
metrics JSONL log, and a loss-curve PNG."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


class MetricsLog:
    """OUT/metrics.jsonl: one JSON object per logged step, appended and flushed as it is written."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def read(self) -> list[dict]:
        """Every complete record (a line cut short by a kill is ignored)."""
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return records

    def truncate_after(self, step: int):
        """On resume: forget what a killed run logged after its last checkpoint (rewritten atomically)."""
        kept = [r for r in self.read() if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def append(self, record: dict):
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def plot_loss(records: list[dict], png: Path, title: str = "training loss"):
    """Loss (and its diffusion / next-token parts) against step; written atomically. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not records:
        return False
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, [r["loss"] for r in records], label="loss", linewidth=1.6)
    for key, label in (("diffusion_loss", "diffusion CE"), ("ar_loss", "next-token CE")):
        values = [r.get(key) for r in records]
        if any(v for v in values):
            ax.plot(steps, values, label=label, linewidth=1.0, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png)
    return True


class Progress:
    """Steps, loss, tokens/s and ETA. A rich bar on a terminal; otherwise one line per logged step."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool):
        self.total, self.start = total_steps, start_step
        self.bar = None
        self.t0 = time.perf_counter()
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TimeRemainingColumn(), console=Console(stderr=True),
            )
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, loss="-", tps="-")
            self.bar.start()
        self.quiet = not enabled

    def update(self, record: dict):
        """Called after every logged step with its metrics record."""
        loss, tps = f"{record['loss']:.4f}", f"{record['tokens_per_s']:,.0f}"
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], loss=loss, tps=tps)
        elif not self.quiet:
            done = record["step"] - self.start
            rate = done / max(time.perf_counter() - self.t0, 1e-9)
            eta = (self.total - record["step"]) / rate if rate > 0 else float("inf")
            print(f"step {record['step']}/{self.total}  loss {loss}  lr {record['lr']:.3g}  "
                  f"{tps} tok/s  eta {eta:,.0f}s", file=sys.stderr, flush=True)

    def advance(self, step: int):
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def close(self):
        if self.bar is not None:
            self.bar.stop()
