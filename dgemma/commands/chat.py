"""`dgemma chat`: a terminal conversation; each answer streams canvas by canvas."""

from __future__ import annotations

import sys

from dgemma.commands._common import (
    UsageError,
    add_model_arguments,
    add_sampling_arguments,
    load_from_args,
    sampling_from_args,
)


def add_arguments(p):
    add_model_arguments(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation")
    p.add_argument("--show-drafts", action="store_true", help="draw each canvas live while it denoises")
    add_sampling_arguments(p)


def run(args):
    import rich.console

    from dgemma.commands.generate import DraftView, TextStream
    from dgemma.engine import Engine, Request
    from dgemma.tokenizer import Tokenizer

    model = load_from_args(args)
    tokenizer = Tokenizer.from_folder(args.model)
    if tokenizer.chat_template is None:
        raise UsageError(f"{args.model} has no chat template; use `dgemma generate` for plain text")
    sampling = sampling_from_args(model, args)
    context = model.config.max_position_embeddings
    engine = Engine(model, max_batch=1, max_length=context)
    console = rich.console.Console(stderr=True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    turn = 0
    while True:
        if interactive:
            console.print("[bold]you>[/] ", end="")
        line = sys.stdin.readline()
        if not line:  # end of input
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": line.strip()})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        room = (context - len(prompt)) // model.config.canvas_length * model.config.canvas_length  # whole canvases
        if room < 1:
            console.print("[red]the conversation no longer fits the model's context; start a new chat[/]")
            return 2
        budget = sampling.replace(max_new_tokens=min(sampling.max_new_tokens, room))
        stream = TextStream(tokenizer)
        view = DraftView(tokenizer, console) if args.show_drafts else None

        def on_event(event, stream=stream, view=view):
            if event.kind == "draft" and view is not None:
                view.update(event)
            elif event.kind == "canvas":
                stream.add(event.tokens)

        seed = (sampling.seed or 0) + turn
        request = Request(prompt=prompt, sampling=budget, seed=seed, want_drafts=view is not None, on_event=on_event)
        engine.submit(request)
        if interactive:
            console.print("[bold]model>[/] ", end="")
        if view is not None:
            with view:
                engine.run_until_done([request])
        else:
            engine.run_until_done([request])
        print(flush=True)
        messages.append({"role": "assistant", "content": tokenizer.decode(request.tokens)})
        turn += 1
