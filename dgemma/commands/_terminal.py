"""What the generating commands draw on a terminal (generate and chat): the canvas live while it denoises."""

from __future__ import annotations


class DraftView:
    """The canvas as coloured tokens: green accepted this step, yellow→red by entropy (rich Live)."""

    def __init__(self, tokenizer, console):
        from rich.live import Live

        self.tokenizer, self.console = tokenizer, console
        self.live = Live(console=console, refresh_per_second=12, transient=True)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        self.live.__exit__(*exc)

    def update(self, event):
        from rich.text import Text

        text = Text()
        text.append(f"canvas {event.canvas_index} step {event.step + 1}\n", style="bold")
        for token, entropy, accepted in zip(event.tokens, event.entropy, event.accepted):
            piece = self.tokenizer.decode([token], skip_special_tokens=False) or "·"
            style = "green" if accepted else ("yellow" if entropy < 1.0 else "red")
            text.append(piece.replace("\n", "⏎"), style=style)
        self.live.update(text)
