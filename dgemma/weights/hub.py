"""Model names -> local folders: a folder on disk, or a Hugging Face id fetched into the standard cache.

An id (`org/name`, optionally at a `revision`) is resolved with `huggingface_hub`, so everything users of
Hugging Face tools expect holds: the shared cache (`HF_HOME`, `HF_HUB_CACHE`), `HF_HUB_OFFLINE=1` (the
cache alone, no network), `HF_TOKEN` for gated or private models, and a progress bar while files
download. Only what dgemma reads is fetched: the configs, tokenizer and processor files, and the
safetensors shards the index names (never pickle weights, GGUF files or other folders of the repo).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dgemma.weights.checkpoint import INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES, CheckpointError, load_folder, read_json

HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*")
SMALL_FILES = ("config.json", "generation_config.json", INDEX_FILE, "dgemma_task.json", *TOKENIZER_FILES)


def is_hub_id(name: str) -> bool:
    return HUB_ID.fullmatch(name) is not None and not name.startswith((".", "/")) and ".." not in name


def resolve_model(name: str | Path, revision: str | None = None) -> Path:
    """A local model folder for `name`: the folder itself if it exists, else the Hugging Face id's snapshot
    in the cache (downloaded when needed and allowed). Raises CheckpointError with one clear line."""
    path = Path(name)
    if path.exists():
        if revision is not None:
            raise CheckpointError(f"{name}: --revision applies to Hugging Face ids, not to a local folder")
        return path
    if not is_hub_id(str(name)):
        raise CheckpointError(f"{name}: no such model folder (nor a Hugging Face id of the form org/name)")
    return _snapshot(str(name), revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id

    def fetch(patterns) -> Path:
        try:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))
        except GatedRepoError:
            raise CheckpointError(f"{at}: gated model; accept its license on huggingface.co and set HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise CheckpointError(f"{at}: no such model on the Hugging Face Hub (or private: set HF_TOKEN)") from None
        except RevisionNotFoundError:
            raise CheckpointError(f"{at}: no such revision on the Hugging Face Hub") from None
        except LocalEntryNotFoundError:
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
            raise CheckpointError(f"{at}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}") from None
        except (HfHubHTTPError, OSError) as e:
            raise CheckpointError(f"{at}: download failed ({str(e).splitlines()[0]})") from None

    folder = fetch(SMALL_FILES)
    if (folder / INDEX_FILE).is_file():
        weight_map = read_json(folder / INDEX_FILE).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
    else:
        shards = [SINGLE_FILE]
    return fetch(shards)


def load_model(name, device="cpu", dtype: torch.dtype = torch.float32, *, quantize: str | None = None,
               revision: str | None = None, cpu_int4_kernel: bool = True):
    """`dgemma.load_model`: a model folder or a Hugging Face id -> our `DiffusionGemma` (the loading itself,
    and what `quantize` and `cpu_int4_kernel` do, is `checkpoint.load_folder`)."""
    return load_folder(resolve_model(name, revision), device=device, dtype=dtype, quantize=quantize,
                       cpu_int4_kernel=cpu_int4_kernel)
