"""`dgemma generate`: one prompt in, text streamed out canvas by canvas (or left to right with --ar)."""

from __future__ import annotations

import json
import sys
import time

from dgemma.commands import _tensor_parallel
from dgemma.commands._common import (
    UsageError,
    add_model_arguments,
    add_prefix_cache_arguments,
    add_sampling_arguments,
    agree,
    check_compile_flags,
    image_usage_errors,
    load_from_args,
    maybe_compile,
    open_images,
    prefix_cache_bytes,
    read_prompt,
    decoder_positions_text,
    refuse_sampler_flags_with_ar,
    sampling_from_args,
    with_images,
)
from dgemma.commands._terminal import DraftView


def add_arguments(p):
    add_model_arguments(p, compile_by_default="warm")
    p.add_argument("--prompt", default=None, help="the prompt text; - reads standard input")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for the model to read (repeatable, in order). With --chat the images open the "
                        "user turn; without, each goes where the prompt writes the image placeholder (Gemma 4: "
                        "<|image|>), or all before the prompt when it writes none")
    p.add_argument("--ar", action="store_true", help="decode left to right with the KV cache (AR baseline)")
    p.add_argument("--show-drafts", action="store_true", help="draw the canvas live while it denoises")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    structured = p.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", default=None,
                            help="answer with JSON valid under this JSON schema (supported subset: docs/serving.md)")
    structured.add_argument("--json-object", action="store_true", help="answer with a JSON object")
    add_prefix_cache_arguments(p)
    add_sampling_arguments(p)
    _tensor_parallel.add_arguments(p)


class TextStream:
    """Decodes the growing token list and prints only the new text (multi-byte safe)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.tokens, self.printed = tokenizer, out, [], ""

    def add(self, tokens: list[int]):
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next canvas
            return
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


def run(args):
    from dgemma.chat.codec import encode_prompt
    from dgemma.compilation.policy import engine_shape
    from dgemma.engine import Engine, Request
    from dgemma.generation.canvas import positions_needed
    from dgemma.images import image_placeholder
    from dgemma.sampling import seed_or_random
    from dgemma.tokenizer import Tokenizer

    refuse_sampler_flags_with_ar(args)
    text = agree(args, lambda: read_prompt(args.prompt))
    tokenizer = Tokenizer.from_folder(args.model)
    constraint = constraint_from_args(args, tokenizer)  # before loading: a bad schema or image fails at once
    images = open_images(args.image)
    if images and args.ar:
        raise UsageError("--image works with the diffusion sampler, not with --ar")
    check_compile_flags(args)
    model = load_from_args(args, compile=False)  # compiled below, once its shape is known
    sampling = sampling_from_args(model, args)
    with image_usage_errors():
        placeholder = image_placeholder(model, tokenizer) if images else None
    prompt = encode_prompt(tokenizer, text, args.chat, len(images), placeholder)
    if not prompt:
        raise UsageError("the prompt encodes to no tokens")
    prompt, image_inputs = with_images(model, args.model, prompt, images)
    context = model.config.max_position_embeddings
    if len(prompt) >= context:
        raise UsageError(f"the prompt is {len(prompt)} tokens; the model's context is {context}")

    if args.ar:
        if constraint is not None:
            raise UsageError("--json-schema / --json-object work with the diffusion sampler, not with --ar")
        return _run_ar(args, maybe_compile(args, model, shape="left to right"), tokenizer, prompt, sampling)

    import rich.console

    need = positions_needed(len(prompt), sampling.max_new_tokens, model.config.canvas_length)
    if need > context:
        raise UsageError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceed the "
                         f"model's context of {context}")
    maybe_compile(args, model, shape=engine_shape(1, need))
    engine = Engine(model, max_batch=1, max_length=need, prefix_cache_bytes=prefix_cache_bytes(args, model, "generate"),
                    prefill_chunk=args.prefill_chunk, deterministic=args.deterministic)
    stream = TextStream(tokenizer) if not args.json else None
    console = rich.console.Console(stderr=True)
    view = DraftView(tokenizer, console) if args.show_drafts and not args.json else None

    def on_event(event):
        if event.kind == "draft" and view is not None:
            view.update(event)
        elif event.kind == "canvas" and stream is not None:
            if view is not None:
                view.live.update("")
            stream.add(event.tokens)

    seed = agree(args, lambda: seed_or_random(sampling.seed))  # rank 0's draw, on every rank
    request = Request(prompt=prompt, sampling=sampling, seed=seed, want_drafts=view is not None, on_event=on_event,
                      constraint=constraint, images=image_inputs)
    try:
        engine.submit(request)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if view is not None:
        with view:
            engine.run_until_done([request])
    else:
        engine.run_until_done([request])
    stats = request.stats()
    if args.json:
        print(json.dumps({"text": tokenizer.decode(request.tokens), "tokens": request.tokens,
                          "finish_reason": request.finish_reason, "seed": seed, "prompt_tokens": len(prompt),
                          **stats}))
    else:
        print()
        saved = f"{decoder_positions_text(stats)} with the step cache, " if request.sampling.step_cache else ""
        print(f"[{len(request.tokens)} tokens, {stats['canvases']} canvases, steps {stats['steps_per_canvas']}, "
              f"{stats['tokens_per_forward']:.1f} tokens/forward, {saved}{stats['tokens_per_second']:.1f} tokens/s, "
              f"finish: {request.finish_reason}]", file=sys.stderr)
    return 0


def constraint_from_args(args, tokenizer):
    """The TokenAutomaton --json-schema FILE / --json-object ask for, or None."""
    if args.json_schema is None and not args.json_object:
        return None
    from dgemma.structured import (
        ConstraintError,
        SchemaError,
        TokenVocabulary,
        json_object_constraint,
        json_schema_constraint,
    )

    vocabulary = TokenVocabulary.from_tokenizer(tokenizer)  # ids past the tokenizer's are never allowed
    try:
        if args.json_object:
            return json_object_constraint(vocabulary)
        with open(args.json_schema) as f:
            text = f.read()
        return json_schema_constraint(text, vocabulary)
    except (SchemaError, ConstraintError) as e:
        raise UsageError(f"--json-schema {args.json_schema}: {e}") from None


def _run_ar(args, model, tokenizer, prompt, sampling):
    from dgemma.generation import generate_ar

    start = time.perf_counter()
    tokens = generate_ar(model, [prompt], sampling.max_new_tokens, eos_token_ids=sampling.eos_token_ids,
                         seed=sampling.seed)[0]
    elapsed = time.perf_counter() - start
    text = tokenizer.decode(tokens)
    stats = {"tokens_per_second": len(tokens) / elapsed if elapsed else 0.0, "elapsed_s": elapsed,
             "tokens_per_forward": 1.0}
    if args.json:
        print(json.dumps({"text": text, "tokens": tokens, "prompt_tokens": len(prompt), "mode": "ar", **stats}))
    else:
        print(text)
        print(f"[{len(tokens)} tokens left to right, {stats['tokens_per_second']:.1f} tokens/s]", file=sys.stderr)
    return 0
