"""The validated, versioned recipe shared by the Python API, the CLI and YAML files.

A recipe says *what* to do to a model (method, budget, estimator, calibration); it is saved next
to every output so a run can be repeated and a report rebuilt from the output folder alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from blockfold.errors import BlockfoldError

RECIPE_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @classmethod
    def parse(cls, data: dict, origin: str = "recipe"):
        """Validate a plain dict, turning pydantic's report into one readable line."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'recipe'}: {e['msg']}" for e in err.errors()
            )
            raise BlockfoldError(f"invalid {origin}: {problems}") from None


class CalibrationConfig(_Strict):
    """Where calibration text comes from and how it becomes token batches.

    ``source=None`` lets the model write its own calibration text (self-generated calibration).
    ``packing=None`` packs plain-text corpora into consecutive full-length sequences and keeps
    instruction data one example per (padded) sequence.
    """

    source: str | None = None
    num_sequences: int = Field(64, ge=1)
    sequence_length: int = Field(512, ge=8)
    max_documents: int | None = Field(None, ge=1)
    text_field: str | None = None
    # render each record with str.format, e.g. "{support}\n{question}\n{correct_answer}" (benchmark splits)
    text_template: str | None = None
    packing: bool | None = None
    use_chat_template: bool = True
    padding_side: Literal["right", "left"] = "right"
    batch_size: int = Field(8, ge=1)
    generation_temperature: float = Field(1.0, gt=0)
    generation_top_p: float = Field(0.95, gt=0, le=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check_sources(self) -> "CalibrationConfig":
        parts = calibration_sources(self.source)
        if len(parts) > self.num_sequences:
            raise ValueError(f"a mix of {len(parts)} sources needs at least {len(parts)} sequences (num_sequences)")
        return self


SELF_GENERATED = "self"


def calibration_sources(source: str | None) -> list[tuple[str, float]]:
    """``"a.jsonl:0.5,b.json:0.5"`` → ``[("a.jsonl", 0.5), ("b.json", 0.5)]`` (weights normalised to 1).

    One source needs no weight; in a mix, either every part has a weight or none (equal shares).
    ``self`` (or no source at all) is text the model writes itself.
    """
    if source is None:
        return [(SELF_GENERATED, 1.0)]
    parts = [part.strip() for part in source.split(",") if part.strip()]
    if not parts:
        raise ValueError("calibration source is empty: give a file, a dataset, a mix 'a:0.5,b:0.5' or 'self'")
    named = []
    for part in parts:
        name, _, weight = part.rpartition(":")
        try:
            named.append((name, float(weight)))
        except ValueError:
            named.append((part, None))
    if len(named) == 1:
        return [(named[0][0], 1.0)]
    if any(w is None for _, w in named) and not all(w is None for _, w in named):
        raise ValueError(f"calibration mix {source!r}: give every part a weight ('a:0.5,b:0.5') or none")
    if all(w is None for _, w in named):
        return [(name, 1.0 / len(named)) for name, _ in named]
    if any(w <= 0 for _, w in named):
        raise ValueError(f"calibration mix {source!r}: weights must be positive")
    total = sum(w for _, w in named)
    return [(name, w / total) for name, w in named]


class CosineConfig(_Strict):
    """Numerical fit of the transform under a cosine (or, for sandwich norms, MSE) objective."""

    max_tokens: int = Field(16384, ge=64)
    steps: int = Field(60, ge=1)
    learning_rate: float = Field(1.0, gt=0)
    # L1 penalty on the transform, λ·Σ|T_ij| / d, added to the objective (0: none)
    l1_penalty: float = Field(0.0, ge=0)


class Recipe(_Strict):
    recipe_version: Literal[1] = RECIPE_VERSION
    method: str = "replaceme"
    # budget: blocks for block methods, attention_layers for attention methods (nbl, drop-attn);
    # ratio is the share of blocks or of attention layers instead
    blocks: int | None = Field(None, ge=1)
    attention_layers: int | None = Field(None, ge=1)
    ratio: float | None = Field(None, gt=0, lt=1)
    # the span-replacing map (estimate/): closed form from the streamed normal equations, or cosine
    # (numerical, from the lstsq start); identity = plain removal
    estimator: Literal["lstsq", "diagonal", "orthogonal", "lowrank", "cosine", "identity"] = "lstsq"
    rank: int | None = Field(None, ge=1)  # lowrank: rank of the correction to the identity (default 32)
    # Fix the span's first block instead of selecting it (for studies and reproductions).
    span_start: int | None = Field(None, ge=1)
    ridge_alpha: float = Field(0.0, ge=0)
    # span selection (select/spans.py); None = the method's default (replaceme: fit_error_stream,
    # uidl: angular_last)
    criterion: Literal[
        "angular_last", "angular_all", "block_influence", "cka", "cca", "fit_error", "fit_error_stream"
    ] | None = None
    # replaceme/uidl: remove this many non-overlapping spans (one transform each) sharing the budget
    spans: int = Field(1, ge=1)
    # NBL: which sublayers to replace (select/linearity.py). "cosine" (DROP's ranking, then the LMMSE
    # map instead of nothing) measured best on SmolLM2-135M at 4, 8 and 12 layers (BENCHMARKS.md);
    # "cca" is the NBL paper's. greedy recomputes statistics after each replacement; for replaceme it
    # removes one block per round, the one whose removal after its best linear fix loses least.
    linearity_criterion: Literal["cca", "nmse", "cosine", "stream"] = "cosine"
    greedy: bool = False
    # Blocks with a norm after the MLP (Gemma): which foldable form of the map to use (docs/gemma.md).
    sandwich_fold: Literal["auto", "linearized-norm", "through-norm"] = "auto"
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    cosine: CosineConfig = Field(default_factory=CosineConfig)

    @model_validator(mode="after")
    def _check(self) -> "Recipe":
        from blockfold.methods import ATTENTION_METHODS, METHODS, SPAN_METHODS  # late import: methods import the recipe

        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(sorted(METHODS))}")
        budget = "attention_layers" if self.method in ATTENTION_METHODS else "blocks"
        other = "blocks" if budget == "attention_layers" else "attention_layers"
        if getattr(self, other) is not None:
            flag = "--attn" if other == "attention_layers" else "--blocks"
            raise ValueError(f"{other} ({flag}) does not apply to method {self.method!r}; give {budget} or ratio")
        if getattr(self, budget) is None and self.ratio is None:
            setattr(self, budget, 8)
        if getattr(self, budget) is not None and self.ratio is not None:
            raise ValueError(f"give either {budget} or ratio, not both")
        if self.estimator == "lowrank" and self.rank is None:
            self.rank = 32
        if self.rank is not None and self.estimator != "lowrank":
            raise ValueError(f"rank (--rank) applies to the lowrank estimator only, not {self.estimator!r}")
        if self.spans > 1:
            if self.method not in SPAN_METHODS:
                raise ValueError(f"spans (--spans) applies to {', '.join(sorted(SPAN_METHODS))}, not {self.method!r}")
            if self.greedy or self.span_start is not None:
                raise ValueError("spans (--spans) cannot be combined with greedy or span_start: choose one selection")
        return self

    def num_attention_layers_to_replace(self, num_layers: int) -> int:
        """How many attention sublayers an attention method replaces, validated against the model."""
        k = self.attention_layers if self.attention_layers is not None else round(self.ratio * num_layers)
        if k < 1 or k > num_layers:
            raise BlockfoldError(f"cannot replace {k} of {num_layers} attention layers: use --attn between 1 and {num_layers}")
        return k

    def num_blocks_to_remove(self, num_layers: int) -> int:
        """The span length for a model with ``num_layers`` blocks, validated against it."""
        n = self.blocks if self.blocks is not None else round(self.ratio * num_layers)
        if n < 1 or n > num_layers - 2:
            raise BlockfoldError(
                f"cannot remove {n} of {num_layers} blocks: use --blocks between 1 and {num_layers - 2} "
                "(the first block and at least one after the span are always kept)"
            )
        if self.spans > n:
            raise BlockfoldError(f"cannot split {n} blocks into {self.spans} spans: use --spans at most {n}")
        return n

    # -- YAML -----------------------------------------------------------------------------
    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Recipe":
        path = Path(path)
        if not path.is_file():
            raise BlockfoldError(f"recipe file {path} not found: pass an existing YAML file to --recipe")
        data = yaml.safe_load(path.read_text()) or {}
        return cls.parse(data, origin=str(path))



def _healing_data() -> CalibrationConfig:
    return CalibrationConfig(num_sequences=400, sequence_length=256, batch_size=4)


class HealConfig(_Strict):
    """``blockfold heal``: a few next-token training steps on ``data``, merged back into the weights."""

    heal_version: Literal[1] = 1
    mode: Literal["lt", "lora"] = "lt"  # lt: only the down-projections holding folded maps
    steps: int = Field(100, ge=1)
    learning_rate: float | None = Field(None, gt=0)  # None: 1e-4 for lt, 5e-4 for lora
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = Field(16.0, gt=0)
    seed: int = 0
    data: CalibrationConfig = Field(default_factory=_healing_data)

    @model_validator(mode="after")
    def _default_learning_rate(self) -> "HealConfig":
        if self.learning_rate is None:
            self.learning_rate = 1e-4 if self.mode == "lt" else 5e-4
        return self
