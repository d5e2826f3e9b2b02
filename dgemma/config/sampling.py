"""`SamplingConfig`: the denoising sampler's settings, mirroring the checkpoint's `generation_config.json`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dgemma.config.model import ConfigError

# The orders in which a denoising step accepts positions (dgemma.sampling.acceptance_uncertainty);
# "entropy" is the reference's and the released model's.
ACCEPT_ORDERS = ("entropy", "margin", "confidence")
# The denoising samplers (dgemma.sampling.samplers): the model's own, and diffusers' other two DiffusionGemma
# schedulers (BlockRefinementScheduler, DiscreteDDIMScheduler).
SAMPLERS = ("entropy-bound", "block-refinement", "ddim")
# How a DDIM corrector sweep picks the positions it draws again, least confident first (dgemma.sampling.ddim).
CORRECTOR_SELECTIONS = ("lowest_log_margin", "lowest_maxprob", "lowest_current_prob", "random")

# Which settled positions the step cache recomputes each step, as many as hold `refresh_share` of the attention
# the computed positions put on settled ones (dgemma.generation.step_cache): the most attended ("attention"),
# or, as controls at the same count, random ones or the longest kept.
REFRESH_ORDERS = ("attention", "random", "oldest")

# What a position's top probability is read at when it settles: the step's temperature (the sampler's) or the
# model's own (temperature 1), which settles confident positions in the hot first steps of a schedule.
SETTLE_ON = ("tempered", "model")


# dgemma's own settings, kept in generation_config.json's "dgemma" section, one group at a time
STEP_CACHE_KEYS = ("step_cache", "settle_steps", "settle_probability", "settle_on", "cache_refresh", "refresh_share",
                   "refresh_order")
SAMPLER_KEYS = ("sampler", "temperature", "commit_threshold", "editing_threshold", "corrector_steps", "corrector_k",
                "corrector_selection", "corrector_selection_tau")
# the settings each sampler reads besides max_denoising_steps (every sampler's decoder forwards per canvas)
SAMPLER_SETTINGS = {
    "entropy-bound": ("entropy_bound", "t_min", "t_max", "accept_order"),
    "block-refinement": ("temperature", "commit_threshold", "editing_threshold"),
    "ddim": ("temperature", "corrector_steps", "corrector_k", "corrector_selection", "corrector_selection_tau"),
}


def settings_not_read(samplers: str | tuple[str, ...], given: dict[str, Any], *, as_flags: bool = False) -> str | None:
    """The first sampler setting set in `given` (name -> value; None: not set) that none of `samplers` reads, as
    "NAME: a setting of the READERS sampler, not of SAMPLERS" (NAME as a command-line flag with `as_flags`), or
    None: what the command line and the server refuse."""
    samplers = (samplers,) if isinstance(samplers, str) else tuple(samplers)
    for name, value in given.items():
        readers = [s for s, names in SAMPLER_SETTINGS.items() if name in names]
        if value is not None and readers and not set(readers) & set(samplers):
            shown = "--" + name.replace("_", "-") if as_flags else name
            which = " and ".join(readers) + (" samplers" if len(readers) > 1 else " sampler")
            return f"{shown}: a setting of the {which}, not of {' or '.join(samplers)}"
    return None


@dataclass
class SamplingConfig:
    """The denoising sampler's knobs; defaults are the released `generation_config.json` values,
    except `max_new_tokens`, which the official file caps at one canvas (256)."""

    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_max: float = 0.8
    t_min: float = 0.4
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    max_new_tokens: int = 2048
    fixed_steps: bool = False  # run exactly max_denoising_steps per canvas (benchmarks)
    eos_token_ids: tuple[int, ...] = (1, 106, 50)
    pad_token_id: int = 0
    seed: int | None = None
    # which positions a step accepts first: lowest entropy (the reference), widest top-2 margin, or
    # highest top-1 probability; the entropy bound applies to each order's uncertainty (dgemma.sampling)
    accept_order: str = "entropy"
    # the step cache (dgemma.generation.step_cache): settled positions are not recomputed; a position settles
    # after `settle_steps` steps with the same argmax at top probability >= `settle_probability` (at the step's
    # temperature, or the model's own: `settle_on`); every `cache_refresh`-th step recomputes all (0: never),
    # and every step also the settled positions holding `refresh_share` of the attention (0: none), chosen by
    # `refresh_order`. Off by default: it trades quality for compute, except on models trained to read it.
    step_cache: bool = False
    settle_steps: int = 2
    settle_probability: float = 0.99
    settle_on: str = "tempered"
    cache_refresh: int = 0
    refresh_share: float = 0.0
    refresh_order: str = "attention"
    # which sampler turns a step's logits into the next canvas (dgemma.sampling.samplers): "entropy-bound" (the
    # model's own: entropy_bound, t_min/t_max, accept_order), "block-refinement" or "ddim" (diffusers'
    # BlockRefinementScheduler and DiscreteDDIMScheduler); max_denoising_steps is each one's forwards per canvas
    sampler: str = "entropy-bound"
    temperature: float = 0.0  # block refinement and DDIM: what their predictions are drawn at (0: the argmax)
    commit_threshold: float = 0.95  # block refinement: also commit every position more confident than this
    editing_threshold: float = 0.0  # block refinement: replace a committed token predicted otherwise above this
    corrector_steps: int = 0  # DDIM: Gibbs sweeps after each of the first predictor steps (0: none)
    corrector_k: int = 1  # DDIM: positions one sweep draws again
    corrector_selection: str = "lowest_log_margin"  # DDIM: how a sweep picks them (CORRECTOR_SELECTIONS)
    corrector_selection_tau: float = 1.0  # DDIM: temperature of that Gumbel-top-k choice

    def __post_init__(self):
        self.eos_token_ids = tuple(self.eos_token_ids)
        checks = [
            (self.max_denoising_steps >= 1, "max_denoising_steps must be >= 1"),
            (self.entropy_bound >= 0 and math.isfinite(self.entropy_bound), "entropy_bound must be >= 0"),
            (0 < self.t_min <= self.t_max and math.isfinite(self.t_max), "need 0 < t_min <= t_max"),
            (self.stability_threshold >= 1, "stability_threshold must be >= 1"),
            (self.confidence_threshold >= 0, "confidence_threshold must be >= 0"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (isinstance(self.step_cache, bool), "step_cache must be true or false"),
            (self.settle_steps >= 1, "settle_steps must be >= 1"),
            (0 <= self.settle_probability <= 1, "settle_probability must be in [0, 1]"),
            (self.cache_refresh >= 0, "cache_refresh must be >= 0 (0: never)"),
            (0 <= self.refresh_share <= 1, "refresh_share must be in [0, 1]"),
            (self.refresh_order in REFRESH_ORDERS,
             f"refresh_order must be one of {', '.join(REFRESH_ORDERS)}, not {self.refresh_order!r}"),
            (self.settle_on in SETTLE_ON, f"settle_on must be one of {', '.join(SETTLE_ON)}, not {self.settle_on!r}"),
            (self.accept_order in ACCEPT_ORDERS,
             f"accept_order must be one of {', '.join(ACCEPT_ORDERS)}, not {self.accept_order!r}"),
            (self.sampler in SAMPLERS, f"sampler must be one of {', '.join(SAMPLERS)}, not {self.sampler!r}"),
            (self.temperature >= 0 and math.isfinite(self.temperature), "temperature must be >= 0"),
            (self.commit_threshold >= 0 and math.isfinite(self.commit_threshold), "commit_threshold must be >= 0"),
            (self.editing_threshold >= 0 and math.isfinite(self.editing_threshold),
             "editing_threshold must be >= 0 (0: no editing)"),
            (self.corrector_steps >= 0, "corrector_steps must be >= 0"),
            (self.corrector_k >= 1, "corrector_k must be >= 1"),
            (self.corrector_selection in CORRECTOR_SELECTIONS, "corrector_selection must be one of "
             f"{', '.join(CORRECTOR_SELECTIONS)}, not {self.corrector_selection!r}"),
            (self.corrector_selection_tau > 0 and math.isfinite(self.corrector_selection_tau),
             "corrector_selection_tau must be > 0"),
            (not (self.step_cache and self.sampler == "ddim" and self.corrector_steps > 0),
             "DDIM's corrector sweeps (corrector_steps > 0) cannot run with the step cache"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @classmethod
    def from_hf_dict(cls, gen: dict[str, Any], **overrides) -> "SamplingConfig":
        """Read `generation_config.json`; `max_new_tokens` there is ignored (it caps output at one canvas).
        `accept_order` is dgemma's own key (absent: "entropy", the reference's order)."""
        kw: dict[str, Any] = {}
        for key in ("max_denoising_steps", "t_max", "t_min", "stability_threshold", "confidence_threshold",
                    "accept_order"):
            if gen.get(key) is not None:
                kw[key] = gen[key]
        sampler = gen.get("sampler_config") or {}
        if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
            kw["entropy_bound"] = sampler["entropy_bound"]
        eos = gen.get("eos_token_id")
        if eos is not None:
            kw["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
        if gen.get("pad_token_id") is not None:
            kw["pad_token_id"] = gen["pad_token_id"]
        section = gen.get("dgemma") or {}
        if isinstance(section, dict):
            kw.update({k: section[k] for k in STEP_CACHE_KEYS + SAMPLER_KEYS if section.get(k) is not None})
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """`generation_config.json`'s fields; `accept_order` only when it is not the reference's, and the step
        cache's settings and the sampler's in a "dgemma" section, each group only when one of its settings
        differs from its default (transformers keeps a key it does not know as an attribute and ignores it, so
        such a file still loads there; `sampler_config` stays the entropy bound's, the class transformers
        rebuilds)."""
        order = {} if self.accept_order == "entropy" else {"accept_order": self.accept_order}
        defaults = SamplingConfig()
        section = {}
        for keys in (STEP_CACHE_KEYS, SAMPLER_KEYS):
            if any(getattr(self, k) != getattr(defaults, k) for k in keys):
                section.update({k: getattr(self, k) for k in keys})
        if section:
            order["dgemma"] = section
        return {
            "max_denoising_steps": self.max_denoising_steps,
            # transformers rebuilds the sampler dataclass from its class name
            "sampler_config": {"entropy_bound": float(self.entropy_bound), "_cls_name": "EntropyBoundSamplerConfig"},
            "t_max": self.t_max,
            "t_min": self.t_min,
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": self.confidence_threshold,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            **order,
        }

    def replace(self, **changes) -> "SamplingConfig":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})
