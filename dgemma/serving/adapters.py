"""LoRA adapters served by name beside the base model (`dgemma serve --lora NAME=PATH`, repeatable).

Each adapter is a PEFT folder (`dgemma train --lora` writes one as RUN/adapter). A request's `model` field
picks the base model or an adapter (app.py `_check_model`); the engine runs every request in one batch,
each row with its own adapter (dgemma.model.adapters.RowLoRALinear). /v1/models lists the adapters after the
base model, each with `parent` (the base) as vLLM lists them.
"""

from __future__ import annotations

from pathlib import Path

from dgemma.model.adapters import AdapterError, install_adapters, read_peft_adapter
from dgemma.serving.errors import bad_request


def parse_lora_flags(values: list[str], model_name: str) -> list[tuple[str, Path]]:
    """["NAME=PATH", ...] -> [(name, path)]; ValueError (the one line the CLI prints) for a malformed flag, a
    repeated name, or the base model's name."""
    out: list[tuple[str, Path]] = []
    for value in values:
        name, sep, path = value.partition("=")
        name = name.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora {value!r}: expected NAME=PATH")
        if name == model_name or name in {n for n, _ in out}:
            raise ValueError(f"--lora {name!r}: the name is already served")
        out.append((name, Path(path)))
    return out


def load_adapters(model, flags: list[tuple[str, Path]]) -> tuple[str, ...]:
    """Read each adapter and install them all on `model`; ValueError (one line) when one does not fit it."""
    try:
        adapters = [read_peft_adapter(name, path) for name, path in flags]
        install_adapters(model, adapters)
    except (AdapterError, OSError, KeyError, ValueError) as e:
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return tuple(name for name, _ in flags)


def adapter_card(state, name: str) -> dict:
    i = state.adapters.index(name)
    return {"id": name, "object": "model", "created": state.created, "owned_by": "dgemma",
            "parent": state.model_name, "root": state.adapter_paths[i] if state.adapter_paths else None,
            "dgemma": {"kind": "lora"}}


def no_adapter_scoring(adapter: int):
    if adapter != 0:
        raise bad_request("scoring (logprobs with max_tokens 0 or 1) runs the base model only; send the base model's "
                          "name", param="model")
