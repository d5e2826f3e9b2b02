"""What a JSON-schema constraint costs per canvas, next to an unconstrained denoising step.

Part 1, cost: for each vocabulary (the tests' Gemma-shaped tokenizer of 528 tokens; synthetic
SentencePiece-style vocabularies of 8,192 / 32,768 / 262,144 tokens: byte-fallback tokens, words with
and without a leading space, digits, punctuation runs and JSON pieces such as '":▁' and ',▁"'), one
schema's automaton is built (timed), then on random logits of one canvas:
  * step:   the unconstrained sampler step (sampler_step: temperature, entropy, acceptance, samples);
            on the two model rows also the decoder forward (tiny preset / bench-20m, random weights);
  * guide:  the per-step guidance of a constrained row (a constrained sample: forward filtering,
            backward sampling over the canvas);
  * commit: the committing DP (Viterbi over (position, state), once per canvas).
build_s is the automaton's build in CPU seconds (outlines-core's Index, then our token classes).
Part 2, what the per-step guidance does, on the tiny Gemma-shaped model (random weights): the plain loop
with guidance at every step against guidance at commit only, same seeds: validity, denoising steps per
canvas, and how often the committed token is the model's own argmax at the committing step.
Part 3, the same question on a trained model: the shipped sudoku model on hard puzzles, each puzzle's answer constrained
to keep its givens and to write in every blank only digits that no given of its row, column or box
holds (a regex of 81 character classes); solved rate without a constraint, with it at commit only,
and with it at every step, same puzzles and seeds.

    python benchmarks/structured.py            # about 5 minutes on 2 CPU cores (the 262k build dominates)
    python benchmarks/structured.py --quick    # without the 262,144-token vocabulary
    python benchmarks/structured.py --part guidance   # part 2 only (or --part cost, --part sudoku)

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": ["string", "null"]}},
                "required": ["city"]},
    "active": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
    "required": ["name", "age", "tags", "address"]}


def synthetic_vocabulary(size: int, seed: int = 0):
    """Token bytes of a SentencePiece-shaped vocabulary: 4 specials, 256 byte tokens, then text pieces."""
    from dgemma.structured import TokenVocabulary

    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pieces = ['":▁', '",▁"', '{"', '"}', '":▁"', '],▁"', '▁[', '▁{', ':▁', ',▁', '▁', '"', '▁"', '},', '▁null',
              '▁true', '▁false', "\n", "\n▁▁", "▁▁▁▁"]
    tokens = [None] * 4 + [bytes([b]) for b in range(256)]
    seen = set()
    for piece in pieces:
        seen.add(piece)
        tokens.append(piece.replace("▁", " ").encode())
    while len(tokens) < size:
        kind = rng.random()
        if kind < 0.75:  # words, two thirds with a leading space
            n = min(12, max(1, int(rng.expovariate(0.25)) + 1))
            word = "".join(rng.choices(letters, weights=range(26, 0, -1), k=n))
            word = word.capitalize() if rng.random() < 0.1 else word
            piece = ("▁" if rng.random() < 0.66 else "") + word
        elif kind < 0.85:
            piece = "".join(rng.choices("0123456789", k=rng.randint(1, 3)))
        elif kind < 0.95:
            piece = "".join(rng.choices("!\"#$%&'()*+,-./:;<=>?@[]^_`{|}~▁", k=rng.randint(1, 3)))
        else:
            piece = "".join(rng.choices("éèàüößñçøåæ日本語中文한국어абвгдеж", k=rng.randint(1, 2)))
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece.replace("▁", " ").encode())
    return TokenVocabulary(tuple(tokens), size=size)


def best_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def cost_row(name: str, vocab, canvas: int, repeats: int, model=None) -> dict:
    from dgemma.sampling import draw_samples, scan_step
    from dgemma.structured import constrained_canvas, constrained_sample, json_schema_constraint

    start = time.process_time()  # CPU time: on a shared machine, wall time says more about the neighbours
    automaton = json_schema_constraint(SCHEMA, vocab)
    build_s = time.process_time() - start
    V = vocab.size
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, canvas, V, generator=generator) * 3
    probs = torch.softmax(logits[0] / 0.6, -1)

    def step():
        draw_samples(scan_step(logits.clone(), 0.6, 0.1, generator))

    forward_ms = None
    if model is not None:
        cache = model.new_cache(1, 64 + canvas)
        model.encode(torch.zeros(1, 64, dtype=torch.long), cache, return_logits=False)
        ids = torch.randint(0, V, (1, canvas), generator=generator)
        with torch.no_grad():
            forward_ms = best_ms(lambda: model.denoise(ids, cache), repeats)
    step_ms = best_ms(step, repeats)
    kwargs = dict(budget=4096, eos_token_ids=[1], pad_token_id=0)
    guide_ms = best_ms(lambda: constrained_sample(automaton, probs, automaton.initial, generator=generator, **kwargs),
                       repeats)
    commit_ms = best_ms(lambda: constrained_canvas(automaton, probs, automaton.initial, **kwargs), repeats)
    unconstrained = step_ms + (forward_ms or 0.0)
    return {"vocab": name, "V": V, "canvas": canvas, "states": automaton.num_states, "classes": automaton.num_classes,
            "edges": automaton.num_edges, "build_s": round(build_s, 2),
            "forward_ms": None if forward_ms is None else round(forward_ms, 1), "sampler_ms": round(step_ms, 1),
            "guide_ms": round(guide_ms, 1), "commit_ms": round(commit_ms, 1),
            "guide_vs_step": round(guide_ms / unconstrained, 2), "commit_vs_step": round(commit_ms / unconstrained, 2)}


def guidance_rows(seeds: int) -> list[dict]:
    """Plain loop, tiny Gemma-shaped model: guidance every step vs at commit only, same seeds."""
    import jsonschema

    import dgemma
    from conftest import write_gemma_tokenizer
    from dgemma.generation import generate
    from dgemma.structured import TokenVocabulary, json_schema_constraint
    from dgemma.tokenizer import Tokenizer

    folder = Path(tempfile.mkdtemp())
    info = write_gemma_tokenizer(folder)
    torch.manual_seed(0)
    model = dgemma.DiffusionGemma(dgemma.get_preset("tiny").replace(vocab_size=info["vocab_size"]))
    tokenizer = Tokenizer.from_folder(folder)
    automaton = json_schema_constraint(SCHEMA, TokenVocabulary.from_tokenizer(tokenizer))
    sampling = model.sampling_config.replace(max_new_tokens=192, eos_token_ids=info["eos_token_ids"], pad_token_id=0,
                                             max_denoising_steps=16)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "A person as JSON."}])
    rows = []
    for guide in (True, False):
        valid = agree = positions = steps = canvases = 0
        start = time.perf_counter()
        for seed in range(seeds):
            drafts = []
            result = generate(model, [prompt], sampling, seed=seed, constraint=automaton, guide_steps=guide,
                              on_draft=lambda step, argmax, *_, out=drafts: out.append((step, argmax[0].clone())))
            last = [d[1] for i, d in enumerate(drafts) if i + 1 == len(drafts) or drafts[i + 1][0] == 0]
            committed = result.sequences[0]
            for c, argmax in enumerate(last):  # the committing step's argmax against the committed canvas
                part = committed[c * 16: (c + 1) * 16]
                keep = part != sampling.pad_token_id
                agree += int((argmax[: len(part)][keep] == part[keep]).sum())
                positions += int(keep.sum())
            try:
                jsonschema.validate(json.loads(tokenizer.decode(result.tokens[0])), SCHEMA)
                valid += result.finish_reasons[0] == "stop"
            except (ValueError, jsonschema.ValidationError):
                pass
            steps += sum(result.steps_per_canvas[0])
            canvases += len(result.steps_per_canvas[0])
        rows.append({"guidance": "every step" if guide else "commit only", "answers": seeds, "valid": valid,
                     "steps_per_canvas": round(steps / canvases, 2),
                     "argmax_agreement": round(agree / max(positions, 1), 3),
                     "s_per_answer": round((time.perf_counter() - start) / seeds, 2)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="leave out the 262,144-token vocabulary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=12, help="answers per guidance setting in part 2")
    parser.add_argument("--part", choices=["all", "cost", "guidance", "sudoku"], default="all")
    parser.add_argument("--puzzles", type=int, default=100, help="hard puzzles (24-29 givens) in part 3")
    args = parser.parse_args()
    rows, guidance, puzzles = [], [], []
    if args.part in ("all", "cost"):
        rows = cost_table(args)
    for part, make, out in (("guidance", lambda: guidance_rows(args.seeds), guidance),
                            ("sudoku", lambda: sudoku_rows(args.puzzles), puzzles)):
        if args.part in ("all", part):
            out += make()
            print()
            print(" | ".join(out[0]))
            for row in out:
                print(" | ".join(str(v) for v in row.values()))
    print(json.dumps({"threads": torch.get_num_threads(), "cost": rows, "guidance": guidance, "sudoku": puzzles}))


def sudoku_rows(count: int) -> list[dict]:
    """The shipped sudoku model: no constraint, constrained at commit only, constrained at every step."""
    import dgemma
    from dgemma.generation import generate
    from dgemma.structured import TokenVocabulary, regex_constraint
    from dgemma.tasks import sudoku
    from dgemma.tasks.sudoku_eval import answer_grid, sudoku_sampling
    from dgemma.tasks.sudoku_models import SHIPPED

    model = dgemma.load_model(SHIPPED)
    names = [None] * sudoku.SudokuVocab.vocab_size
    for digit, token in enumerate(sudoku.SudokuVocab.DIGIT_IDS, start=1):
        names[token] = str(digit).encode()
    vocab = TokenVocabulary(tuple(names), size=sudoku.SudokuVocab.vocab_size)
    examples = sudoku.generate_examples(count, givens=(24, 29), seed=20261202)
    rows = []
    for setting in ("none", "commit only", "every step"):
        solved, start = 0, time.perf_counter()
        for i, example in enumerate(examples):
            puzzle = example.puzzle
            automaton = None if setting == "none" else regex_constraint(_candidates_regex(puzzle), vocab)
            result = generate(model, [sudoku.encode_prompt(puzzle)], sudoku_sampling(model, seed=i), seed=i,
                              constraint=automaton, guide_steps=setting == "every step")
            solved += not sudoku.solution_errors(puzzle, answer_grid(result.tokens[0]))
        rows.append({"constraint": setting, "puzzles": count, "solved": solved,
                     "s_per_puzzle": round((time.perf_counter() - start) / count, 3)})
    return rows


def _candidates_regex(puzzle) -> str:
    """81 cells: a given stays; a blank takes a digit that no given of its row, column or box holds."""
    cells = []
    for cell, value in enumerate(puzzle):
        if value:
            cells.append(str(value))
            continue
        r, c = divmod(cell, 9)
        seen = {puzzle[9 * r + k] for k in range(9)} | {puzzle[9 * k + c] for k in range(9)}
        seen |= {puzzle[9 * (r // 3 * 3 + a) + c // 3 * 3 + b] for a in range(3) for b in range(3)}
        cells.append("[" + "".join(str(d) for d in range(1, 10) if d not in seen) + "]")
    return "".join(cells)


def cost_table(args) -> list[dict]:
    import dgemma
    from conftest import write_gemma_tokenizer
    from dgemma.structured import TokenVocabulary
    from dgemma.tokenizer import Tokenizer

    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp())
    info = write_gemma_tokenizer(folder)
    gemma_vocab = TokenVocabulary.from_tokenizer(Tokenizer.from_folder(folder))
    tiny = dgemma.DiffusionGemma(dgemma.get_preset("tiny").replace(vocab_size=info["vocab_size"])).eval()
    bench = dgemma.DiffusionGemma(dgemma.get_preset("bench-20m")).eval()
    rows = [cost_row("gemma-shaped (tests)", gemma_vocab, 16, args.repeats, tiny),
            cost_row("synthetic 8k (bench-20m)", synthetic_vocabulary(8192), 256, args.repeats, bench),
            cost_row("synthetic 32k", synthetic_vocabulary(32768), 256, args.repeats)]
    if not args.quick:
        rows.append(cost_row("synthetic 262k (Gemma's size)", synthetic_vocabulary(262144), 256, args.repeats))
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))
    return rows


if __name__ == "__main__":
    main()
