"""The model split over 2 ranks (gloo, CPU): logits against one process, the split's checks, the plan."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.multiprocessing as mp
from conftest import make_hf_model, wait_until

from dgemma.config import SamplingConfig
from dgemma.model.network import PreviousStep

# 4 query heads, 2 KV heads (sliding), 1 global KV head (full layers: replicated), 8 experts top-2; widths
# such that o_proj's and down_proj's row splits fall on int8 group bounds (64)
SPLIT_TEXT = dict(head_dim=32, global_head_dim=64, intermediate_size=128, num_experts=8)


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split-hf")
    make_hf_model("alternating", seed=3, text=SPLIT_TEXT).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, ranks: int, *args):
    """Run fn(rank, *args) in `ranks` processes joined in one gloo group on loopback."""
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}
    saved = {name: os.environ.get(name) for name in group}
    os.environ.update(group)  # the children read them; this process must not keep them (it is no rank)
    try:
        mp.spawn(_rank_main, args=(fn, args), nprocs=ranks, join=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rank_main(rank, fn, args):
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(1)
    atexit.register(_no_gloo_thread_left)  # runs after dgemma's own exit handler (`leave`, registered later)
    fn(rank, *args)


def _no_gloo_thread_left():
    """A rank's exit check: once dgemma has left the group, no gloo thread may run while the interpreter
    finalizes (one that takes the GIL then aborts the process); a rank that still has one exits 3."""
    left = [name for name in thread_names() if name.startswith(("pt_gloo", "gloo_"))]
    if left:
        print(f"gloo threads alive at exit: {left}", file=sys.stderr, flush=True)
        os._exit(3)


def thread_names() -> list[str]:
    """The OS names of this process's threads (gloo's: pt_gloo_runloop, gloo_tcp_loop)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            names.append((task / "comm").read_text().strip())
    return names


def passes(model):
    """Encoder logits over a padded batch, then decoder logits with and without self-conditioning."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :2] = False
    with torch.no_grad():
        cache = model.new_cache(2, 64)
        enc = model.encode(ids, cache, attention_mask=mask)
        canvas = torch.randint(0, model.config.vocab_size, (2, model.config.canvas_length), generator=g)
        first = model.denoise(canvas, cache)
        second = model.denoise(canvas, cache, self_conditioning=PreviousStep.from_logits(first))
    return {"encode": enc, "denoise": first, "denoise_sc": second}


def engine_tokens(model, **sampling_changes):
    """A batch of 4 prompts of different lengths through the engine (seeded, two canvases at most)."""
    from dgemma.engine import Engine

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 5, 14)]
    sampling = model.sampling_config.replace(max_new_tokens=2 * model.config.canvas_length, max_denoising_steps=6,
                                             eos_token_ids=(1,), seed=7, **sampling_changes)
    requests = Engine(model, max_batch=4, max_length=64).generate(prompts, sampling)
    return [(r.tokens, r.stats()["decoder_positions"]) for r in requests]


# the step cache with its attention-targeted refresh on a random model (which is never sure: a low bar settles)
STEP_CACHE = dict(step_cache=True, settle_steps=1, settle_probability=0.02, refresh_share=0.3)


def loop_and_scores(model):
    """The plain loop's tokens (two prompts, one batch) and the engine's prompt scores (evaluation harnesses)."""
    from dgemma.engine import Engine
    from dgemma.generation import generate

    sampling = model.sampling_config.replace(max_new_tokens=model.config.canvas_length, max_denoising_steps=4,
                                             eos_token_ids=(1,))
    tokens = generate(model, [[5, 6, 7], [9, 10, 11]], sampling, seed=2).tokens
    scored = Engine(model, max_batch=2, max_length=64).score([[4, 8, 15, 16, 23, 42], [3, 5]], top=2)
    return {"loop": [list(t) for t in tokens], "scores": [r.scores.token_logprobs for r in scored]}


def _split_passes(rank, folder, out):
    from dgemma.parallel.group import join
    from dgemma.parallel.load import load_split_model
    from dgemma.quant import int8_compute

    tp = join("cpu")
    int8_compute.MIN_TABLE_ENTRIES = 0  # the tiny table's int8 codes too, whatever the CPU
    int8_compute.TABLE_INT8_ON_AMX = True
    results = {}
    for quantize in (None, "int8"):
        model = load_split_model(folder, tp, quantize=quantize)
        assert model.embed_tokens.weight.shape[0] == model.config.vocab_size // 2
        assert model.layers[0].experts.gate_up_proj.shape[0] == 4  # 8 experts, 4 a rank
        results[quantize] = {**passes(model), "tokens": engine_tokens(model), **loop_and_scores(model)}
        if quantize is None:
            results[quantize]["step cache"] = engine_tokens(model, **STEP_CACHE)
    model = load_split_model(folder, tp, quantize="int8")
    assert int8_compute.enable(model, "on") and model.int8_table is not None  # --cpu-int8-compute on
    results["int8 compute"] = passes(model)
    if rank == 0:
        torch.save(results, out)


def _stamping_and_exiting(rank):
    from dgemma.parallel import group as parallel

    parallel.HEARTBEAT_S = 0.0  # a stamp always in flight: the heartbeat's window at exit always open
    tp = parallel.join("cpu")
    for _ in range(50):  # temporaries, whose last reference a gloo worker may drop after this thread went on
        tp.all_reduce(torch.ones(64))
        tp.all_gather_last(torch.ones(2, 8))


def test_a_rank_exits_cleanly_while_it_stamps_and_gloo_drops_tensors():
    """A rank's exit while its heartbeat stamps without pause and right after collectives on temporaries: it
    exits 0 (not SIGABRT, "terminate called without an active exception"), with no gloo thread left when the
    interpreter finalizes (`_no_gloo_thread_left`: exit code 3 otherwise)."""
    spawn_ranks(_stamping_and_exiting, 2)


def test_split_logits_match_one_process(split_checkpoint, tmp_path):
    """fp32 and int8 (each rank quantises its slices): encoder and decoder logits within 1e-5; the engine's
    tokens for a batch of 4 prompts of different lengths, the plain loop's tokens and the engine's prompt
    scores the same. int8 with int8 compute (--cpu-int8-compute on, the tied table's codes too): logits as
    far from the dequantised weights' as one process's int8 compute's, in order of magnitude."""
    from dgemma.quant import int8_compute
    from dgemma.weights.hub import load_model

    out = tmp_path / "split.pt"
    spawn_ranks(_split_passes, 2, split_checkpoint, out)
    split = torch.load(out)
    for quantize in (None, "int8"):
        model = load_model(split_checkpoint, quantize=quantize)
        tokens = engine_tokens(model)
        assert split[quantize].pop("tokens") == tokens
        assert sum(len(t) for t, _ in tokens) > 40  # past one canvas: commits went through the split encoder too
        if quantize is None:  # the step cache: the same tokens and decoder positions, fewer than without it
            cached = engine_tokens(model, **STEP_CACHE)
            assert split[quantize].pop("step cache") == cached
            assert sum(p for _, p in cached) < sum(p for _, p in tokens)
        expected = loop_and_scores(model)
        assert split[quantize].pop("loop") == expected["loop"]
        for ours, theirs in zip(split[quantize].pop("scores"), expected["scores"]):
            assert (ours - theirs).abs().max() < 1e-5
        for name, logits in passes(model).items():
            assert split[quantize][name].shape == logits.shape
            err = (split[quantize][name] - logits).abs().max().item()
            assert err < 1e-5, f"{quantize} {name}: {err}"
    # int8 compute quantises activations per row (each rank over its own slice of a row-split input): not
    # the dequantised weights' logits, and on this tiny model far from them (0.18-0.56 of the largest logit in
    # one process), so the split is held to the same order of distance, not to one process's bits
    model = load_model(split_checkpoint, quantize="int8")
    dequantised = passes(model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(int8_compute, "MIN_TABLE_ENTRIES", 0)
        patch.setattr(int8_compute, "TABLE_INT8_ON_AMX", True)
        assert int8_compute.enable(model, "on") and model.int8_table is not None
    for name, logits in passes(model).items():
        scale = dequantised[name].abs().max().item()
        ours = (split["int8 compute"][name] - dequantised[name]).abs().max().item() / scale
        one = (logits - dequantised[name]).abs().max().item() / scale
        assert 0 < ours < 3 * one, f"int8 compute {name}: {ours} split, {one} one process"


@pytest.fixture(scope="module")
def odd_vocab_checkpoint(tmp_path_factory):
    """The split model's shapes with a 973-token vocabulary (prime: no number of ranks divides it), with a
    tokenizer for the command line."""
    from conftest import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("odd-vocab-hf")
    make_hf_model("alternating", seed=5, text={**SPLIT_TEXT, "vocab_size": 973}).save_pretrained(folder)
    write_tiny_tokenizer(folder)
    return folder


def _odd_vocab_passes(rank, folder, out):
    from dgemma.parallel.group import join
    from dgemma.parallel.load import load_split_model

    model = load_split_model(folder, join("cpu"))
    assert model.embed_tokens.weight.shape[0] == 487  # 973 padded to 974, over 2 ranks
    if rank == 1:
        assert model.embed_tokens.weight[-1].abs().max() == 0  # the padding row
    results = passes(model)
    if rank == 0:
        torch.save(results, out)


def test_a_vocabulary_no_rank_count_divides_splits(odd_vocab_checkpoint, tmp_path):
    """973 tokens over 2 ranks (padded to 974, the padded logit dropped): encoder, decoder and self-conditioned
    decoder logits are (..., 973) and within 1e-4 of one process's, relative to the largest logit; and
    `dgemma generate --tensor-parallel 2` runs on it."""
    import subprocess
    import sys

    from dgemma.weights.hub import load_model

    out = tmp_path / "odd.pt"
    spawn_ranks(_odd_vocab_passes, 2, odd_vocab_checkpoint, out)
    split = torch.load(out)
    for name, logits in passes(load_model(odd_vocab_checkpoint)).items():
        assert split[name].shape == logits.shape and logits.shape[-1] == 973
        err = (split[name] - logits).abs().max().item() / logits.abs().max().item()
        assert err < 1e-4, f"{name}: {err}"
    done = subprocess.run([sys.executable, "-m", "dgemma", "generate", "--model", str(odd_vocab_checkpoint),
                           "--prompt", "hello world", "--tensor-parallel", "2", "--json", "--seed", "3",
                           "--max-new-tokens", "16", "--steps", "4"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    tokens = json.loads(done.stdout.splitlines()[-1])["tokens"]
    assert tokens and all(0 <= t < 973 for t in tokens)


def _compiled_and_eager(rank, folder, out):
    from dgemma.compilation.steps import compile_model, is_compiled
    from dgemma.engine import Engine
    from dgemma.parallel.group import join
    from dgemma.parallel.load import load_split_model

    # Not checked here: a compiled graph keeps its collectives' group (the compile group) alive past `leave`'s
    # destroy_process_group (dynamo traced it as a fake script object that still refers to it), so that
    # group's gloo threads outlive the rank's leaving, and a compiled rank's exit is not yet covered.
    atexit.unregister(_no_gloo_thread_left)
    model = load_split_model(folder, join("cpu"))
    # one canvas from prompts of one length: one graph of each kind (a compile costs minutes on two cores)
    sampling = model.sampling_config.replace(max_new_tokens=model.config.canvas_length, max_denoising_steps=4,
                                             eos_token_ids=(10**6,))
    prompts, seeds = [[5, 6, 7, 8], [9, 10, 11, 12]], [3, 4]

    def tokens():
        return [r.tokens for r in Engine(model, max_batch=1, max_length=64).generate(prompts, sampling, seeds=seeds)]

    eager = tokens()
    compile_model(model, "default", cpp_wrapper=False)  # the cheapest compile: no autotuning
    compiled = tokens()
    assert is_compiled(model)
    if rank == 0:
        torch.save({"eager": eager, "compiled": compiled}, out)


@pytest.mark.slow  # two ranks compile the tiny model's step (about a minute on two cores)
def test_compiled_split_step_equals_the_eager_one(split_checkpoint, tmp_path):
    """Every rank compiles the same graph (collectives traced in, a rank's experts one opaque op): per seed the
    compiled split engine's tokens are the eager split engine's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from dgemma.model.network import DiffusionGemma

    def graphs_here():  # earlier tests in this process may have compiled the step themselves
        return len(_debug_get_cache_entry_list(DiffusionGemma.decode_canvas.__code__))

    out = tmp_path / "compiled.pt"
    before = graphs_here()
    spawn_ranks(_compiled_and_eager, 2, split_checkpoint, out)
    got = torch.load(out)
    assert got["compiled"] == got["eager"] and got["eager"][0] != got["eager"][1]
    assert graphs_here() == before  # compiled in the ranks, not here


def images_and_search(model):
    """The engine's tokens for a prompt with an image beside one without, and a verifier search's tokens and
    rounds (rejected positions denoised again), each seeded."""
    from test_image_generation import image_prompt, picture
    from test_verifier import reject_multiples_of_3

    from dgemma.engine import Engine
    from dgemma.images import ImageProcessor

    processor = ImageProcessor.from_folder(model.source_dir)
    image = model.config.image_token_id
    prompt, inputs = image_prompt(model, processor, [2, 40, image, 41], [picture(37, 53)])
    sampling = model.sampling_config.replace(max_new_tokens=24)
    engine = Engine(model, max_batch=2, max_length=256)
    seen = [r.tokens for r in engine.generate([prompt, [2, 46, 47]], sampling, seeds=[11, 12], images=[inputs, None])]
    search = SamplingConfig(max_new_tokens=20, eos_token_ids=(model.config.vocab_size,), max_denoising_steps=6)
    verified = engine.generate([[5, 6, 7, 8, 9], [3, 4]], search, seeds=[10, 11], verifier=reject_multiples_of_3,
                               max_rounds=4)
    return {"images": seen, "search": [(r.tokens, r.stats()["search"]["rounds"]) for r in verified]}


def _images_and_search(rank, folder, out):
    from dgemma.parallel.group import join
    from dgemma.parallel.load import load_split_model

    results = images_and_search(load_split_model(folder, join("cpu")))
    if rank == 0:
        torch.save(results, out)


def test_images_and_the_verifier_search_split_equal_one_process(gemma4_vision_model_dir, tmp_path):
    """A prompt with an image (the vision tower replicated on every rank) beside one without, and a verifier
    search over rounds: 2 ranks give one process's tokens (and rounds) per seed."""
    from dgemma.weights.hub import load_model

    out = tmp_path / "images.pt"
    spawn_ranks(_images_and_search, 2, gemma4_vision_model_dir, out)
    expected = images_and_search(load_model(gemma4_vision_model_dir))
    assert torch.load(out) == expected
    assert all(expected["images"]) and max(rounds for _, rounds in expected["search"]) > 1


def staggered_turns(engine, submit, step):
    """A request starts; two steps later a 120-token prompt arrives, read in chunks beside it; then a follow-up
    of that prompt and its answer (the prefix cache gives it the first blocks). Returns the tokens and the
    follow-up's cached tokens."""
    from dgemma.engine import Request

    sampling = SamplingConfig(max_new_tokens=2 * engine.canvas_length, max_denoising_steps=6, fixed_steps=True,
                              eos_token_ids=(10**6,))
    g = torch.Generator().manual_seed(4)
    running = submit(Request(prompt=[5, 6, 7, 8], sampling=sampling, seed=1))
    for _ in range(2):
        step()
    long = submit(Request(prompt=torch.randint(3, 120, (120,), generator=g).tolist(), sampling=sampling, seed=2))
    while not (running.done and long.done):
        step()
    follow_up = submit(Request(prompt=long.prompt + long.tokens + [9, 10, 11], sampling=sampling, seed=3,
                               cache_answer=True))
    while not follow_up.done:
        step()
    return [running.tokens, long.tokens, follow_up.tokens], follow_up.cached_tokens


def _pace_at(engine, chunk_tokens: int):
    """The engine's measured chunk beside running requests, held at `chunk_tokens` (as if its clock said so)."""
    engine.pace.chunk_tokens = chunk_tokens
    engine.pace.observe = lambda tokens_read, seconds: None


def _lockstep_with_cache(rank, folder, out, deterministic):
    from dgemma.engine.lockstep import LockstepEngine
    from dgemma.parallel.group import join
    from dgemma.parallel.load import load_split_model

    model = load_split_model(folder, join("cpu", 30))
    engine = LockstepEngine(model, max_batch=2, max_length=256, prefix_cache_bytes=1 << 24,
                            deterministic=deterministic)
    _pace_at(engine, 32 if rank == 0 else 16)  # the ranks' clocks disagree: the leader's chunk is read
    if rank != 0:
        engine.follow()
        return
    results = staggered_turns(engine, engine.submit, engine.step)
    engine.close()
    engine.step()
    torch.save(results, out)


@pytest.mark.parametrize("deterministic", [False, True])
def test_lockstep_ranks_read_the_leaders_chunks_and_share_the_prefix_cache(split_checkpoint, tmp_path, deterministic):
    """A split model served in lockstep, with the prefix cache on: a long prompt read in chunks beside a
    running request, the leader's chunk size on every rank though their own measurements differ, then a
    follow-up turn that takes its prompt's blocks from the cache. The tokens are one process's; in
    deterministic mode too (aligned spans, undone and read again on every rank; a decoder forward a row)."""
    from dgemma.engine import Engine
    from dgemma.weights.hub import load_model

    out = tmp_path / "lockstep.pt"
    spawn_ranks(_lockstep_with_cache, 2, split_checkpoint, out, deterministic)
    tokens, cached = torch.load(out)
    engine = Engine(load_model(split_checkpoint), max_batch=2, max_length=256, prefix_cache_bytes=1 << 24,
                    deterministic=deterministic)
    _pace_at(engine, 32)
    chunks = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda row, ids, images=None: (chunks.append(len(ids)), prefill(row, ids, images))[1]
    expected, expected_cached = staggered_turns(engine, engine.submit, engine.step)
    assert chunks[:5] == [4, 32, 32, 32, 24]  # the long prompt in the leader's chunks, beside the running one
    assert cached == expected_cached > 120
    assert tokens == expected


def _rank_pid(launcher_pid: int, rank: int) -> int:
    """The process of a rank among the launcher's children (its RANK in its environment)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == launcher_pid and f"RANK={rank}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


def served_answers(client) -> list:
    """A chat answer, a JSON-schema answer and a tool call, each seeded; then a chat's follow-up turn, which
    takes its earlier turns from the prefix cache (on by default): its answer and the cached tokens it reports."""
    from test_server import MODEL
    from test_server_tools import WEATHER

    ask = [{"role": "user", "content": "hello world"}]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    chat = client.chat.completions.create(model=MODEL, messages=ask, seed=3, max_tokens=32)
    answer = client.chat.completions.create(model=MODEL, messages=ask, seed=4, max_tokens=48, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    call = client.chat.completions.create(model=MODEL, messages=ask, seed=5, max_tokens=48, tools=[WEATHER],
                                          tool_choice="required")
    json.loads(answer.choices[0].message.content)  # valid JSON, as the schema constrains it
    assert call.choices[0].message.tool_calls[0].function.name == "get_weather"
    turn = [{"role": "user", "content": "hello world, the cat is red and the dog is blue " * 3}]
    first = client.chat.completions.create(model=MODEL, messages=turn, seed=6, max_tokens=16)
    turn += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "yes"}]
    follow_up = client.chat.completions.create(model=MODEL, messages=turn, seed=7, max_tokens=16)
    cached = follow_up.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32, follow_up.usage  # the first turn's whole blocks at least
    return [chat.choices[0].message.content, answer.choices[0].message.content,
            [(c.function.name, c.function.arguments) for c in call.choices[0].message.tool_calls],
            follow_up.choices[0].message.content, cached]


def test_served_split_equals_one_process_and_a_killed_rank_stops_it(gemma4_chat_model_dir):
    """Through the openai client: a chat, a JSON-schema answer, a tool call and a follow-up turn served from
    the prefix cache (its default budget) from `dgemma serve --tensor-parallel 2` (dgemma starts the ranks
    itself) equal one process's, cached tokens too. Then rank 1 is killed: rank 0
    answers 503 to new work, and the launcher ends within 60 s with one line naming rank 1, every rank's process
    gone (within 90 s)."""
    from test_server import ServerProcess

    one = ServerProcess(gemma4_chat_model_dir)
    try:
        expected = served_answers(one.client())
    finally:
        one.stop_cleanly()
    split = ServerProcess(gemma4_chat_model_dir, "--tensor-parallel", "2")
    try:
        assert served_answers(split.client()) == expected
        ranks = [_rank_pid(split.pid, r) for r in (0, 1)]
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        statuses = _statuses_until_it_ends(split, killed, limit=60, timeout=10)
        code = split.proc.wait(5)
        errors = split.proc.stderr.read()
        wait_until(lambda: all(map(gone, ranks)), 90 - (time.monotonic() - killed), "every rank gone")
    finally:
        split.stop()
    assert code not in (0, None) and time.monotonic() - killed < 60
    assert 503 in statuses and 200 not in statuses, statuses
    assert "dgemma: rank 1 of 2 ended (signal SIGKILL); the other ranks were stopped" in errors, errors
    assert "Traceback" not in errors, errors


def _statuses_until_it_ends(split, since: float, limit: float, timeout: float) -> set:
    """The HTTP statuses of a completion request sent every 0.2 s until the split server's process ends, or
    `limit` seconds after `since` ("refused" when nothing listens)."""
    statuses = set()
    while split.proc.poll() is None and time.monotonic() - since < limit:
        try:
            statuses.add(split.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 16},
                                    timeout=timeout).status_code)
        except httpx.TransportError:
            statuses.add("refused")
        time.sleep(0.2)
    return statuses


def _kill_left(pids):
    """SIGKILL what a test leaves of a split server's ranks."""
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def gone(pid: int) -> bool:
    """Whether a process has ended (a zombie waiting for its parent counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_launcher_killed_outright_takes_its_ranks_with_it(tiny_model_dir):
    """SIGKILL to `dgemma serve --tensor-parallel 2` itself (the launcher, which then cannot stop its ranks): the
    ranks end by themselves (the kernel's parent-death signal) within 30 s, and nothing answers on the port."""
    from test_server import ServerProcess

    split, ranks = ServerProcess(tiny_model_dir, "--tensor-parallel", "2"), []
    try:
        ranks = [_rank_pid(split.pid, r) for r in (0, 1)]
        assert split.health()["status"] == "ok"
        split.proc.kill()
        wait_until(lambda: all(map(gone, ranks)), 30, "every rank gone")
        with pytest.raises(httpx.TransportError):
            split.health()
    finally:
        _kill_left(ranks)
        split.stop()


def test_a_hung_rank_ends_the_split_server_within_the_timeout(gemma4_chat_model_dir):
    """Rank 1 stopped (SIGSTOP: alive, silent) under `dgemma serve --tensor-parallel 2 --rank-timeout 5`: rank 0's
    next collective times out, it answers 503 (never 200) and says in one line that rank 1 went silent; every
    process is gone soon after, the stopped one too."""
    from test_server import ServerProcess

    split, ranks = ServerProcess(gemma4_chat_model_dir, "--tensor-parallel", "2", "--rank-timeout", "5"), []
    try:
        ranks = [_rank_pid(split.pid, r) for r in (0, 1)]
        time.sleep(2 * 1.0)  # a heartbeat or two from every rank
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        statuses = _statuses_until_it_ends(split, stopped, limit=90, timeout=15)
        code = split.proc.wait(5)
        ended = time.monotonic() - stopped
        errors = split.proc.stderr.read()
        wait_until(lambda: all(map(gone, ranks)), 30, "every rank gone")
    finally:
        _kill_left(ranks)
        split.stop()
    assert code not in (0, None) and ended < 60, (code, ended)
    assert 503 in statuses and 200 not in statuses, statuses
    named = [line for line in errors.splitlines() if "rank 1 of 2 silent for" in line]
    assert len(named) == 1 and "(hung or stopped)" in named[0], errors
    assert "dgemma: rank 0 of 2 ended" not in errors, errors  # the launcher adds no line blaming rank 0
    assert "Traceback" not in errors, errors


@pytest.mark.slow  # both ranks compile and warm up the tiny model's step (minutes on two cores)
def test_split_server_answers_eagerly_then_switches_to_the_compiled_step(tiny_model_dir):
    """`dgemma serve --tensor-parallel 2 --compile`: every rank compiles and warms up the same step on a thread
    of its own while the ranks answer eagerly; they switch together, the `dgemma_step_compiled` gauge reaches
    1, and each seed's answer is the one the eager step gave."""
    from test_server import MODEL, ServerProcess
    from test_server_operations import scrape

    def answers(client):
        return [client.completions.create(model=MODEL, prompt="hello world", max_tokens=32, seed=seed).choices[0].text
                for seed in (1, 2)]

    split = ServerProcess(tiny_model_dir, "--tensor-parallel", "2", "--max-batch", "1", "--compile",
                          "--compile-mode", "default")
    try:
        client = split.client()
        eager = answers(client)
        assert split.health()["step"] == "compiling"
        wait_until(lambda: split.health()["step"] != "compiling", 900, "the compiled step")
        if split.health()["step"] != "compiled":
            split.stop()
            raise AssertionError(split.proc.stderr.read())
        assert scrape(split)[("dgemma_step_compiled", ())] == 1
        assert answers(client) == eager
    finally:
        split.stop()
    errors = split.proc.stderr.read()
    assert split.proc.returncode in (0, -15) and "Traceback" not in errors, errors
    assert "compiled step ready after" in errors, errors


def test_generate_under_torchrun_equals_one_process(tiny_model_dir, capsys):
    """`torchrun --nproc-per-node 2 -m dgemma generate --chat` prints what one process prints (rank 0 alone)."""
    import subprocess
    import sys

    from dgemma.cli import main

    flags = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello world", "--chat", "--json", "--seed", "3",
             "--max-new-tokens", "40", "--steps", "6"]
    assert main(flags) == 0
    expected = json.loads(capsys.readouterr().out)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dgemma", *flags], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # rank 1 prints nothing
    split = json.loads(lines[0])
    assert split["tokens"] == expected["tokens"] and len(expected["tokens"]) > 16


@pytest.mark.parametrize("flags, message", [
    (["--tensor-parallel", "3"], "--tensor-parallel 3 does not divide the 4 attention heads"),
    (["--tensor-parallel", "2", "--quantize", "int8"],
     "int8 weights of o_proj (sliding layers) (64 inputs in groups of 64) cannot split into 2 slices on group bounds"),
])
def test_bad_splits_are_one_line_and_exit_2(tiny_model_dir, capsys, flags, message):
    from dgemma.cli import main

    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hello", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_split_constraints_and_the_plan(capsys):
    """More GPUs than there are, KV heads neither divided nor replicated whole; `info` prints the plan."""
    import dgemma
    from dgemma.cli import main
    from dgemma.parallel.plan import SplitError, check_split, plan_bytes

    config = dgemma.get_preset("tiny")
    with pytest.raises(SplitError, match="needs 2 GPUs, torch sees 0"):
        check_split(config, 2, device="cuda")
    with pytest.raises(SplitError, match="neither divides nor is a multiple of the 6 KV heads"):
        check_split(config.replace(num_heads=12, num_kv_heads=6, num_global_kv_heads=1), 4)
    assert main(["info", "--preset", "diffusiongemma-26b-a4b", "--tensor-parallel", "4"]) == 0
    info = json.loads(capsys.readouterr().out.splitlines()[-1])
    split = info["tensor_parallel"]
    assert split["ranks"] == 4 and split["weight_bytes_per_rank"] == plan_bytes(get_26b(), 4)
    whole = info["weight_bytes"]
    for fmt, n in split["weight_bytes_per_rank"].items():  # a quarter, plus the replicated norms and routers
        assert whole[fmt] / 4 < n < whole[fmt] / 4 * 1.02, fmt
    assert plan_bytes(get_26b(), 1) == pytest.approx(whole, rel=1e-5)  # one rank: what `info` says the weights are


def get_26b():
    import dgemma

    return dgemma.get_preset("diffusiongemma-26b-a4b")


def test_the_launcher_names_the_killed_rank_when_rank_0_left_in_the_same_pass(gemma4_chat_model_dir, monkeypatch,
                                                                               capsys):
    """The launcher's monitor can find rank 1 killed and rank 0 gone (it lost the others: LOST_RANKS_EXIT) in one
    pass, with one timestamp: the line names rank 1 and its signal, not rank 0's exit."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dgemma.cli import main
    from dgemma.engine.lockstep import LOST_RANKS_EXIT

    failures = {0: ProcessFailure(0, 100, LOST_RANKS_EXIT, "<N/A>"), 1: ProcessFailure(1, 101, -9, "<N/A>")}
    for failure in failures.values():
        failure.timestamp = 1_000

    def run(_):
        raise ChildFailedError("dgemma", failures)

    monkeypatch.setattr(torch.distributed.run, "run", run)
    assert main(["serve", "--model", str(gemma4_chat_model_dir), "--tensor-parallel", "2"]) == 1
    assert "dgemma: rank 1 of 2 ended (signal SIGKILL); the other ranks were stopped" in capsys.readouterr().err
