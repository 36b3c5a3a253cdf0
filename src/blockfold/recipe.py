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
    packing: bool | None = None
    use_chat_template: bool = True
    padding_side: Literal["right", "left"] = "right"
    batch_size: int = Field(8, ge=1)
    generation_temperature: float = Field(1.0, gt=0)
    generation_top_p: float = Field(0.95, gt=0, le=1)
    seed: int = 0


class CosineConfig(_Strict):
    """Numerical fit of the transform under a cosine (or, for sandwich norms, MSE) objective."""

    max_tokens: int = Field(16384, ge=64)
    steps: int = Field(60, ge=1)
    learning_rate: float = Field(1.0, gt=0)


class Recipe(_Strict):
    recipe_version: Literal[1] = RECIPE_VERSION
    method: str = "replaceme"
    # budget: blocks for block methods, attention_layers for attention methods (nbl, drop-attn);
    # ratio is the share of blocks or of attention layers instead
    blocks: int | None = Field(None, ge=1)
    attention_layers: int | None = Field(None, ge=1)
    ratio: float | None = Field(None, gt=0, lt=1)
    estimator: Literal["lstsq", "cosine", "identity"] = "lstsq"
    # Fix the span's first block instead of selecting it (for studies and reproductions).
    span_start: int | None = Field(None, ge=1)
    ridge_alpha: float = Field(0.0, ge=0)
    criterion: Literal["angular_last", "angular_all"] = "angular_last"
    # NBL: which sublayers to replace (select/linearity.py). "cosine" (DROP's ranking, then the LMMSE
    # map instead of nothing) measured best on SmolLM2-135M at 4, 8 and 12 layers (BENCHMARKS.md);
    # "cca" is the NBL paper's. greedy recomputes statistics after each replacement.
    linearity_criterion: Literal["cca", "nmse", "cosine", "stream"] = "cosine"
    greedy: bool = False
    # Blocks with a norm after the MLP (Gemma): which foldable form of the map to use (docs/gemma.md).
    sandwich_fold: Literal["auto", "linearized-norm", "through-norm"] = "auto"
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    cosine: CosineConfig = Field(default_factory=CosineConfig)

    @model_validator(mode="after")
    def _check(self) -> "Recipe":
        from blockfold.methods import ATTENTION_METHODS, METHODS  # late import: methods import the recipe

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

    @classmethod
    def parse(cls, data: dict, origin: str = "recipe") -> "Recipe":
        """Validate a plain dict, turning pydantic's report into one readable line."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'recipe'}: {e['msg']}" for e in err.errors()
            )
            raise BlockfoldError(f"invalid {origin}: {problems}") from None
