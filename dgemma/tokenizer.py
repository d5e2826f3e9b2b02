"""Text <-> token ids for a Hugging Face model folder, and its chat template.

Reads `tokenizer.json` with the `tokenizers` library (no transformers). The chat template comes from
`chat_template.jinja`, else from `tokenizer_config.json`'s `chat_template`, and is rendered in a
sandboxed jinja2 environment set up like transformers' (`trim_blocks`, `lstrip_blocks`, loop controls,
`raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`).

BOS: plain text goes through `encode`, which adds whatever the tokenizer's post-processor adds (Gemma's
adds `<bos>`). A rendered chat already carries what the template wrote (Gemma's template starts with
`{{ bos_token }}`), so `apply_chat_template` encodes it without special tokens, as transformers does;
no double BOS either way.
EOS ids come from the folder's config (`generation_config.json`, then `config.json`), else from the
tokenizer's own `eos_token`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Collection

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(ValueError):
    """The folder has no usable tokenizer, or a chat could not be rendered."""


class Tokenizer:
    def __init__(
        self,
        tokenizer,  # tokenizers.Tokenizer
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
        pad_token_id: int | None = None,
    ):
        self.backend = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self._compiled_template: jinja2.Template | None = None
        self._special_ids: frozenset[int] | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """Load `folder`/tokenizer.json plus the chat template and special tokens next to it."""
        from tokenizers import Tokenizer as BackendTokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            hint = " (only tokenizer.model found; dgemma needs the tokenizer.json format)" if (
                folder / "tokenizer.model").is_file() else ""
            raise TokenizerError(f"no tokenizer in {folder}: tokenizer.json is missing{hint}")
        backend = BackendTokenizer.from_file(str(path))
        tok_config = _read_json(folder / "tokenizer_config.json")
        bos = _token_text(tok_config.get("bos_token"))
        eos = _token_text(tok_config.get("eos_token"))

        template_file = folder / "chat_template.jinja"
        chat_template = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]: use the default one
            by_name = {t.get("name"): t.get("template") for t in chat_template}
            chat_template = by_name.get("default") or next(iter(by_name.values()), None)

        config = _read_json(folder / "config.json")
        text_config = config.get("text_config") or config
        generation = _read_json(folder / "generation_config.json")
        eos_ids = _as_ids(generation.get("eos_token_id"))
        eos_ids = eos_ids or _as_ids(text_config.get("eos_token_id")) or _as_ids(config.get("eos_token_id"))
        if not eos_ids and eos is not None and backend.token_to_id(eos) is not None:
            eos_ids = (backend.token_to_id(eos),)
        pad_id = generation.get("pad_token_id", text_config.get("pad_token_id"))
        if pad_id is None and tok_config.get("pad_token") is not None:
            pad_id = backend.token_to_id(_token_text(tok_config["pad_token"]))
        if bos is None and text_config.get("bos_token_id") is not None:
            bos = backend.id_to_token(text_config["bos_token_id"])
        if eos is None and eos_ids:
            eos = backend.id_to_token(eos_ids[0])
        return cls(backend, chat_template=chat_template, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
                   pad_token_id=pad_id)

    # -- plain text -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True, keep: Collection[int] = ()) -> str:
        """Token ids to text. `keep`: special tokens written out even while the others are skipped (the
        marks of a chat format, such as Gemma 4's `<|tool_call>`, which a parser must see)."""
        if keep and skip_special_tokens:
            if self._special_ids is None:
                added = self.backend.get_added_tokens_decoder()
                self._special_ids = frozenset(i for i, t in added.items() if t.special)
            ids = [t for t in ids if t not in self._special_ids or t in keep]
            skip_special_tokens = False
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    # -- chat -------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat as the template writes it. Extra keyword arguments (tools, enable_thinking, ...) are
        passed to the template as variables."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
        if self._compiled_template is None:
            self._compiled_template = _environment().from_string(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "tools": None, **kwargs}
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from e

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs) -> list[int]:
        """Render the chat and encode it (no special tokens added on top of what the template wrote)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _environment() -> ImmutableSandboxedEnvironment:
    """A sandbox for untrusted templates, configured like transformers' chat-template environment."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes <, >, & and ' for HTML, which would change what the model sees
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)
