"""`dgemma chat`: a terminal conversation; each answer streams canvas by canvas.

`/image PATH` attaches an image to the next message (several may be attached); `/exit` ends the chat.

The conversation is kept as token ids: turn N's prompt is turn N-1's prompt, the answer's own tokens and
what the template writes after them (`next_prompt`), and every answer is encoded into the engine's
prefix cache when it ends, so turn N encodes only what it added (from the last whole cache block on).
"""

from __future__ import annotations

import sys

from dgemma.commands import _tensor_parallel
from dgemma.commands._common import (
    UsageError,
    add_model_arguments,
    add_prefix_cache_arguments,
    add_sampling_arguments,
    agree,
    decoder_positions_text,
    image_usage_errors,
    load_from_args,
    open_images,
    prefix_cache_bytes,
    sampling_from_args,
    with_images,
)
from dgemma.commands._terminal import DraftView


def add_arguments(p):
    add_model_arguments(p, compile_by_default=True)
    _tensor_parallel.add_arguments(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation")
    p.add_argument("--show-drafts", action="store_true", help="draw each canvas live while it denoises")
    p.add_argument("--think", action="store_true",
                   help="let the model think before it answers (Gemma 4's thinking mode); thoughts show dimmed")
    add_prefix_cache_arguments(p)
    add_sampling_arguments(p)


class AnswerPrinter:
    """Prints an answer canvas by canvas: thoughts dimmed, then the reply; keeps the reply for the history
    (earlier thoughts are not sent back to the model, as Gemma 4's template drops them anyway)."""

    def __init__(self, codec, console):
        from dgemma.chat.chat_output import ChatOutput
        from dgemma.chat.codec import TextAssembler

        self.console = console
        self.assembler = TextAssembler(codec.decode_chat, [], codec.unsettled)
        self.output = ChatOutput(parse_tools=False)
        self.last = None  # the kind of the last part shown
        self.thought = False  # the answer held thoughts

    def add(self, tokens: list[int]):
        self._show(self.output.add(self.assembler.add(tokens)))

    def finish(self) -> str:
        """The answer ended: show what was held back; returns the reply without its thoughts."""
        self._show(self.output.add(self.assembler.flush()) + self.output.finish())
        return self.output.message()["content"] or ""

    def _show(self, parts):
        for kind, text in parts:
            self.thought |= kind == "reasoning"
            if kind == "content" and self.last == "reasoning":
                self.console.print()
            self.console.print(text, style="dim" if kind == "reasoning" else None, end="", markup=False,
                               highlight=False)
            self.last = kind


def next_prompt(tokenizer, messages: list[dict], template_kwargs: dict, last) -> list[int]:
    """The prompt for `messages` (ending with the new user turn). `last`: (the previous prompt, its text, the
    answer's tokens, None when it held thoughts) or None. When the template writes the previous prompt's
    text and then the reply, the ids are the previous prompt's, the answer's as the model wrote them and
    the template's rest; otherwise (thoughts, which the template drops) the whole chat rendered again."""
    text = tokenizer.render_chat(messages, add_generation_prompt=True, **template_kwargs)
    if last is not None and last[2] is not None:
        prompt, prompt_text, answer = last
        reply = messages[-2]["content"]
        head = prompt_text + reply
        if isinstance(reply, str) and text.startswith(head):
            return prompt + answer + tokenizer.encode(text[len(head):], add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)


def run(args):
    import rich.console

    from dgemma.chat.codec import TextCodec, user_content
    from dgemma.engine import Engine, Request
    from dgemma.images import image_placeholder
    from dgemma.tokenizer import Tokenizer

    model = load_from_args(args, announce=False)  # compiled by default: stderr stays the conversation's
    tokenizer = Tokenizer.from_folder(args.model)
    if tokenizer.chat_template is None:
        raise UsageError(f"{args.model} has no chat template; use `dgemma generate` for plain text")
    sampling = sampling_from_args(model, args)
    context = model.config.max_position_embeddings
    engine = Engine(model, max_batch=1, max_length=context, prefill_chunk=args.prefill_chunk,
                    prefix_cache_bytes=prefix_cache_bytes(args, model, "chat", say=sys.stdin.isatty()),
                    deterministic=args.deterministic)
    console = rich.console.Console(stderr=True)
    out = rich.console.Console(soft_wrap=True)  # the answers, on standard output
    codec = TextCodec(tokenizer, model.config.vocab_size)
    template_kwargs = {"enable_thinking": True} if args.think else {}
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = agree(args, sys.stdin.isatty)  # rank 0 reads; every rank runs each turn
    images, attached = [], []  # every image of the conversation, in order; those for the next message
    turn, last = 0, None
    while True:
        if interactive:
            console.print("[bold]you>[/] ", end="")
        line = agree(args, sys.stdin.readline)
        if not line:  # end of input
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        command, _, path = line.strip().partition(" ")
        if command == "/image":
            try:
                with image_usage_errors():
                    image_placeholder(model, tokenizer)
                if not path.strip():
                    raise UsageError("/image needs the path of an image file")
                attached += open_images([path.strip()])
            except UsageError as e:
                if not interactive:  # a script cannot correct itself
                    raise
                console.print(str(e), style="red", markup=False, highlight=False)
                continue
            console.print(f"image {len(images) + len(attached)} attached to the next message", style="dim")
            continue
        messages.append({"role": "user", "content": user_content(line.strip(), len(attached))})
        images, attached = images + attached, []
        prompt = next_prompt(tokenizer, messages, template_kwargs, None if images else last)
        prompt_text = tokenizer.render_chat(messages, add_generation_prompt=True, **template_kwargs)
        prompt, image_inputs = with_images(model, args.model, prompt, images)
        room = (context - len(prompt)) // model.config.canvas_length * model.config.canvas_length  # whole canvases
        if room < 1:
            console.print("[red]the conversation no longer fits the model's context; start a new chat[/]")
            return 2
        eos = tuple(dict.fromkeys([*sampling.eos_token_ids, *sorted(codec.answer_ends)]))
        budget = sampling.replace(max_new_tokens=min(sampling.max_new_tokens, room), eos_token_ids=eos)
        printer = AnswerPrinter(codec, out)
        view = DraftView(tokenizer, console) if args.show_drafts else None

        def on_event(event, printer=printer, view=view):
            if event.kind == "draft" and view is not None:
                view.update(event)
            elif event.kind == "canvas":
                printer.add(event.tokens)

        seed = (sampling.seed or 0) + turn
        request = Request(prompt=prompt, sampling=budget, seed=seed, want_drafts=view is not None, on_event=on_event,
                          images=image_inputs, cache_answer=True)
        engine.submit(request)
        if interactive:
            console.print("[bold]model>[/] ", end="")
        if view is not None:
            with view:
                engine.run_until_done([request])
        else:
            engine.run_until_done([request])
        reply = printer.finish()
        out.print()
        if budget.step_cache:
            console.print(f"[{decoder_positions_text(request.stats())} with the step cache]", style="dim",
                          markup=False, highlight=False)
        messages.append({"role": "assistant", "content": reply})
        last = (prompt, prompt_text, None if printer.thought else request.tokens)
        turn += 1
