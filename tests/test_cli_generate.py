"""`dgemma generate` end to end on a tiny checkpoint, and its bad-input cases."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest


def dgemma(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "dgemma", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)


def test_generate_streams_text(tiny_model_dir):
    proc = dgemma("generate", "--model", str(tiny_model_dir), "--prompt", "hello world", "--max-new-tokens", "40",
                  "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()  # some words
    assert "tokens/forward" in proc.stderr and "canvases" in proc.stderr


def test_generate_json_is_reproducible(tiny_model_dir):
    args = ("generate", "--model", str(tiny_model_dir), "--prompt", "the world", "--max-new-tokens", "20",
            "--seed", "3", "--json", "--steps", "4")
    first, second = dgemma(*args), dgemma(*args)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out == {**json.loads(second.stdout), "elapsed_s": out["elapsed_s"],
                   "tokens_per_second": out["tokens_per_second"],
                   "time_to_first_canvas_s": out["time_to_first_canvas_s"]}
    assert out["steps_per_canvas"] == [4, 4] and out["canvases"] == 2
    assert out["finish_reason"] in ("stop", "length") and len(out["tokens"]) <= 20


def test_generate_chat_stdin_fixed_steps_and_drafts(tiny_model_dir):
    proc = dgemma("generate", "--model", str(tiny_model_dir), "--chat", "--prompt", "-", "--fixed-steps",
                  "--steps", "3", "--show-drafts", "--max-new-tokens", "16", stdin="how are you")
    assert proc.returncode == 0, proc.stderr


def test_generate_ar(tiny_model_dir):
    proc = dgemma("generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--ar", "--json",
                  "--max-new-tokens", "12", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mode"] == "ar" and len(out["tokens"]) <= 12


def test_draft_view_renders_tokens_by_state(tiny_model_dir):
    from rich.console import Console

    from dgemma.commands._terminal import DraftView
    from dgemma.engine import Event
    from dgemma.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_model_dir)
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system="truecolor")
    ids = tok.encode("hello world", add_special_tokens=False)
    with DraftView(tok, console) as view:
        view.update(Event("draft", "r", 0, step=2, tokens=ids, entropy=[0.01, 3.0], accepted=[True, False]))
        view.live.refresh()
    out = buf.getvalue()
    assert "step 3" in out and "hello" in out and "world" in out
    assert "\x1b[32mhello" in out and "\x1b[31mworld" in out  # accepted green, high entropy red


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model", "--prompt", "hi"], "no such model folder"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt", "hi", "--steps", "0"], "must be >= 1"),
    (["--prompt", "hi", "--steps", "many"], "expected a whole number"),
    (["--prompt", "hi", "--entropy-bound", "-1"], "must be a finite number >= 0"),
    (["--prompt", "hi", "--accept-order", "random"], "invalid choice: 'random'"),
    (["--prompt", "hi", "--t-min", "0.9", "--t-max", "0.5"], "t_min <= t_max"),
    (["--prompt", " ".join(["hello"] * 300)], "context is 256"),
    (["--prompt", "hi", "--deterministic", "--compile"], "--deterministic runs eagerly: drop --compile"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_model_dir, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    proc = dgemma("generate", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_chat_answers_each_line_and_keeps_history(tiny_model_dir):
    proc = dgemma("chat", "--model", str(tiny_model_dir), "--max-new-tokens", "16", "--steps", "2", "--seed", "0",
                  stdin="hello world\nhow are you\n")
    assert proc.returncode == 0, proc.stderr
    assert len([line for line in proc.stdout.splitlines() if line.strip()]) >= 1
    assert proc.stdout.count("\n") == 2  # one answer line per user line


def test_chat_refuses_a_conversation_over_the_context(tiny_model_dir):
    proc = dgemma("chat", "--model", str(tiny_model_dir), "--steps", "2", stdin=" ".join(["hello"] * 300) + "\n")
    assert proc.returncode == 2 and "no longer fits" in proc.stderr


def test_generating_commands_keep_freed_memory_for_reuse():
    """glibc's defaults give a large buffer its own mmap and trim freed memory off the heap, so a step's
    buffers are page-faulted in afresh at every step. After `keep_freed_memory` (what the generating
    commands call first) they live in the heap and stay there when freed. Read from glibc's own
    accounting (mallinfo2), which page reclaim on the host cannot disturb."""
    script = (
        "import ctypes, sys, torch\n"
        "from dgemma.engine.allocator import keep_freed_memory\n"
        "class Info(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in 'arena ordblks smblks hblks hblkhd usmblks fsmblks"
        " uordblks fordblks keepcost'.split()]\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.mallinfo2.restype = Info\n"
        "assert keep_freed_memory()\n"
        "trimmed, mapped = 0, 0\n"
        "for _ in range(4):\n"  # a step's temporaries: three 8 MB buffers (bench-20m's logits are 8 MB)
        "    buffers = [torch.empty(2 << 20).fill_(1.0) for _ in range(3)]\n"
        "    during = libc.mallinfo2()\n"
        "    mapped = max(mapped, during.hblkhd)\n"
        "    del buffers\n"
        "    trimmed += libc.mallinfo2().arena < during.arena\n"
        "print(trimmed, mapped)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    if "mallinfo2" in out.stderr:
        pytest.skip("needs glibc >= 2.33")
    assert out.returncode == 0, out.stderr
    trimmed, mapped = map(int, out.stdout.split()[-2:])
    assert trimmed == 0  # freed buffers stay in the heap for the next step
    assert mapped < 8 << 20  # none of them got its own mmap (glibc starts at 128 KB)


def test_only_generating_commands_change_the_allocator(monkeypatch, tmp_path):
    import dgemma.cli

    calls, bounded = [], []
    monkeypatch.setattr(dgemma.cli, "keep_freed_memory", lambda: calls.append(True))
    monkeypatch.setattr(dgemma.cli, "bound_kernel_caches", lambda: bounded.append(True))
    assert dgemma.cli.main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert dgemma.cli.main(["info", "--preset", "tiny"]) == 0
    assert dgemma.cli.main(["bench", "--glibc-malloc-defaults", "--batch", "0"]) == 2  # asked to leave it
    assert dgemma.cli.main(["bench", "--batch", "0"]) == 2
    assert calls == [True, True]
    assert bounded == [True]  # generate; bench times with the kernel libraries' defaults


def test_bounding_the_kernel_caches_leaves_a_value_set_in_the_environment(monkeypatch):
    from dgemma.engine import allocator

    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    allocator.bound_kernel_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(allocator.KERNEL_CACHE_ENTRIES)


def test_chat_shows_thoughts_dimmed_and_keeps_only_the_reply(gemma_tokenizer_model_dir):
    import rich.console

    from dgemma.chat.codec import TextCodec
    from dgemma.commands.chat import AnswerPrinter
    from dgemma.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(gemma_tokenizer_model_dir)
    tokens = tokenizer.encode("<|channel>thought\nThe user is nice.<channel|>Hello Ada", add_special_tokens=False)
    screen = io.StringIO()
    printer = AnswerPrinter(TextCodec(tokenizer, tokenizer.vocab_size),
                            rich.console.Console(file=screen, force_terminal=True, color_system="standard"))
    for start in range(0, len(tokens), 3):  # canvases of three tokens
        printer.add(tokens[start:start + 3])
    assert printer.finish() == "Hello Ada"
    shown = screen.getvalue()
    dimmed = re.compile("\x1b\\[2m(.*?)\x1b\\[0m", re.S)  # SGR 2: faint
    assert "".join(dimmed.findall(shown)) == "The user is nice."
    assert dimmed.sub("", shown) == "\nHello Ada"  # the reply, plain, on a line of its own


def test_cpu_dtype_default_follows_the_model_width(tiny_model_dir, tmp_path):
    """No --dtype on a CPU: bf16 for models 256 or more wide where the CPU multiplies bf16 natively, fp32
    for narrower ones (the tiny model, 64 wide) and for folders that cannot be read here."""
    import argparse

    import torch

    import dgemma as lib
    from dgemma import devices
    from dgemma.commands._common import resolve_device_dtype

    wide = tmp_path / "wide"
    lib.save_pretrained(lib.DiffusionGemma(lib.get_preset("tiny").replace(hidden_size=256)), wide)
    native = devices.native_bf16("cpu")

    def dtype(model, given=None):
        return resolve_device_dtype(argparse.Namespace(device="cpu", dtype=given, model=str(model)))[1]

    assert dtype(wide) == (torch.bfloat16 if native else torch.float32)
    assert dtype(tiny_model_dir) == torch.float32
    assert dtype(tmp_path / "missing") == torch.float32
    assert dtype(wide, "fp32") == torch.float32 and dtype(tiny_model_dir, "bf16") == torch.bfloat16


def test_deterministic_runs_eagerly(monkeypatch):
    """--deterministic never compiles, even where the command would by default: compiled kernels round
    otherwise than eager ones, and autotuning picks them by timings."""
    from argparse import Namespace

    import dgemma
    from dgemma.commands._common import wants_compile

    monkeypatch.delenv("DGEMMA_EAGER", raising=False)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny"))
    flags = dict(compile=False, eager=False, compile_by_default=True, compile_mode="auto")
    assert wants_compile(Namespace(**flags, deterministic=False), model)
    assert not wants_compile(Namespace(**flags, deterministic=True), model)
