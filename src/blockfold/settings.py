"""Each method's own typed settings, registered by method name.

A setting lives on the methods that use it and nowhere else, so a value a method would ignore is a
validation error instead of a silent no-op (``estimator`` on NBL, ``linearity_criterion`` on
ReplaceMe). Defaults are resolved here, at construction, so a saved recipe holds the values that
ran and replays the same run after a default changes. Why each default is what it is, with the
figures, is docs/defaults.md. This module imports nothing of the methods' code: the recipe validates
against it without pulling in the engine.

In the Python API the classes are also the one verb's configuration (torchao-style):
``blockfold.compress(model, blockfold.ReplaceMe(blocks=8))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from blockfold.errors import BlockfoldError
from blockfold.schema import Strict

SPAN_CRITERIA = ("angular_last", "angular_all", "block_influence", "cka", "cca", "fit_error", "fit_error_stream")
SpanCriterion = Literal["angular_last", "angular_all", "block_influence", "cka", "cca", "fit_error", "fit_error_stream"]
LinearityCriterion = Literal["cca", "nmse", "cosine", "stream"]
#: the span counts ReplaceMe's ``spans="auto"`` compresses and compares
AUTO_SPAN_COUNTS = (1, 2, 3)
SPARSITY_DESCRIPTION = "share of the blocks' parameters removed (width methods: 0.2)"


@dataclass(frozen=True)
class ModelSize:
    """What a ``sparsity`` budget is resolved against: the parameters of each block and of each block's
    attention sublayer, and the hidden size (the width of a map put in place of what is removed)."""

    block_parameters: tuple[int, ...]
    attention_parameters: tuple[int, ...]
    hidden_size: int


def count_for_sparsity(settings: "MethodSettings", units: tuple[int, ...], size: ModelSize, high: int, unit: str) -> int:
    """How many of ``units`` (the parameters of each block, or of each attention sublayer) ``settings`` removes
    so that the share of the blocks' parameters removed, less what the method puts in their place, is nearest
    its ``sparsity``; refused in one line where no count from 1 to ``high`` comes within half a unit."""
    total, per_unit = sum(size.block_parameters), sum(units) / len(units)
    shares = {n: (n * per_unit - settings.parameters_added(n, size.hidden_size)) / total for n in range(1, high + 1)}
    count = min(shares, key=lambda n: abs(shares[n] - settings.sparsity))
    if abs(shares[count] - settings.sparsity) > per_unit / total / 2:
        raise BlockfoldError(f"--sparsity {settings.sparsity:g} cannot be reached by removing {unit} of this model: use "
                             f"a sparsity from {shares[1]:.3f} (1 of its {len(units)} {unit}) to {shares[high]:.3f} "
                             f"({high}), or a width method (svd-llm, slicegpt, llm-pruner)")
    return count


def check_one_budget(settings: "MethodSettings", count_field: str, count_flag: str) -> None:
    """One of a count (``count_field``, default 8), ``ratio`` and ``sparsity`` given, or a one-line error."""
    given = [f"{name} (--{flag})" for name, flag in ((count_field, count_flag), ("ratio", "ratio"),
                                                     ("sparsity", "sparsity")) if getattr(settings, name) is not None]
    if len(given) > 1:
        raise ValueError(f"give one budget, not {' and '.join(given)}")
    if not given:
        settings._resolve(count_field, 8)


class CosineConfig(Strict):
    """Numerical fit of the transform under a cosine (or, for sandwich norms, MSE) objective."""

    max_tokens: int = Field(16384, ge=64, description="calibration tokens subsampled for the fit")
    steps: int = Field(60, ge=1, description="L-BFGS iterations")
    learning_rate: float = Field(1.0, gt=0, description="L-BFGS step size")
    l1_penalty: float = Field(0.0, ge=0, description="L1 penalty λ·Σ|T_ij|/d on the map (0: none)")


class MethodSettings(Strict):
    """What one method needs besides the model and the calibration data, and the method's entry in
    the registry (``SETTINGS``): its name, the function that runs it and what it can run on. The CLI,
    the API, sweep and the composition matrix read methods from here; nothing else lists them."""

    method: ClassVar[str]
    #: ``module:function`` of the method's code (imported when the method runs, not with the settings)
    runner: ClassVar[str]
    #: False where the output replaces sublayers by linear modules and ships their modeling code
    writes_standard_checkpoint: ClassVar[bool] = True
    #: True where the method needs only hidden states, so it runs on image encoders too
    runs_on_images: ClassVar[bool] = False
    #: the sublayers the method ranks by their linearity statistics ("attention" or "block"), or None
    ranks_sublayers: ClassVar[str | None] = None
    #: ``module:function`` of the method's plan for ``--dry-run`` (plan.MethodPlan); None: no pass
    planner: ClassVar[str | None] = None
    #: the setting that sizes the compression: a count of blocks or layers, or a share (sparsity, slicing)
    budget_field: ClassVar[str | None] = None
    @classmethod
    def summary(cls) -> str:
        """One line on what the method does: the first line of its settings class's docstring."""
        return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", "")

    def describe(self, selection: dict) -> str:
        """What to add after the method's name in compress's summary (its map, its ranking), or ``""``."""
        return ""

    def folds_maps(self) -> bool:
        """True where the method folds fitted maps into down-projections (what healing's ``lt`` mode trains)."""
        return False

    def parameters_added(self, count: int, hidden_size: int) -> int:
        """Parameters the method puts in place of ``count`` removed blocks or sublayers (its linear maps)."""
        return 0

    def for_model(self, size: ModelSize) -> "MethodSettings":
        """These settings with a ``sparsity`` budget resolved into the method's own unit for a model of
        ``size`` (blocks, attention layers), so the run and its saved recipe hold the count that ran."""
        return self


class BlockBudget(MethodSettings):
    """A budget in decoder blocks: ``blocks``, or ``ratio`` of the model's blocks (default 8 blocks)."""

    budget_field: ClassVar[str | None] = "blocks"

    blocks: int | None = Field(None, ge=1, description="blocks to remove or replace (default 8)")
    ratio: float | None = Field(None, gt=0, lt=1, description="share of the blocks (or layers) instead")
    sparsity: float | None = Field(None, gt=0, lt=1, description=SPARSITY_DESCRIPTION)

    @model_validator(mode="after")
    def _one_budget(self):
        check_one_budget(self, "blocks", "blocks")
        return self

    def for_model(self, size: ModelSize) -> "BlockBudget":
        if self.sparsity is None:
            return self
        count = count_for_sparsity(self, size.block_parameters, size, len(size.block_parameters) - 2, "blocks")
        return self.model_copy(update={"blocks": count, "sparsity": None})

    def num_blocks(self, num_layers: int) -> int:
        """How many blocks, validated against a model of ``num_layers`` blocks."""
        if self.sparsity is not None:
            raise BlockfoldError("a sparsity budget is resolved against the model first (settings.for_model)")
        n = self.blocks if self.blocks is not None else round(self.ratio * num_layers)
        if n < 1 or n > num_layers - 2:
            raise BlockfoldError(
                f"cannot remove {n} of {num_layers} blocks: use --blocks between 1 and {num_layers - 2} "
                "(the first block and at least one after the span are always kept)"
            )
        return n


class AttentionBudget(MethodSettings):
    """A budget in attention sublayers: ``attention_layers``, or ``ratio`` of the layers (default 8)."""

    budget_field: ClassVar[str | None] = "attention_layers"

    attention_layers: int | None = Field(None, ge=1, description="attention layers to replace or drop (default 8)",
                                         json_schema_extra={"flag": "attn"})
    ratio: float | None = Field(None, gt=0, lt=1, description="share of the blocks (or layers) instead")
    sparsity: float | None = Field(None, gt=0, lt=1, description=SPARSITY_DESCRIPTION)

    @model_validator(mode="after")
    def _one_budget(self):
        check_one_budget(self, "attention_layers", "attn")
        return self

    def for_model(self, size: ModelSize) -> "AttentionBudget":
        if self.sparsity is None:
            return self
        count = count_for_sparsity(self, size.attention_parameters, size, len(size.attention_parameters),
                                   "attention layers")
        return self.model_copy(update={"attention_layers": count, "sparsity": None})

    def num_attention_layers(self, num_layers: int) -> int:
        if self.sparsity is not None:
            raise BlockfoldError("a sparsity budget is resolved against the model first (settings.for_model)")
        k = self.attention_layers if self.attention_layers is not None else round(self.ratio * num_layers)
        if k < 1 or k > num_layers:
            raise BlockfoldError(f"cannot replace {k} of {num_layers} attention layers: use --attn between 1 and {num_layers}")
        return k


class ParameterBudget(MethodSettings):
    """A budget in parameters: ``sparsity``, the share of the decoder blocks' projection weights removed."""

    budget_field: ClassVar[str | None] = "sparsity"

    sparsity: float = Field(0.2, gt=0, lt=1, description=SPARSITY_DESCRIPTION)


class SpanSelection(BlockBudget):
    """Contiguous spans: several spans sharing the budget, or one at a fixed start."""

    spans: int = Field(1, ge=1, description="spans sharing the budget")
    span_start: int | None = Field(None, ge=1, description="start the span here instead of selecting one")

    @model_validator(mode="after")
    def _one_selection(self):
        if self.spans != 1 and self.span_start is not None:
            raise ValueError("spans (--spans) cannot be combined with span_start (--span-start): choose one selection")
        return self

    def num_blocks(self, num_layers: int) -> int:
        n = super().num_blocks(num_layers)
        if isinstance(self.spans, int) and self.spans > n:
            raise BlockfoldError(f"cannot split {n} blocks into {self.spans} spans: use --spans at most {n}")
        return n

    def span_counts(self, blocks: int) -> tuple[int, ...]:
        """How many spans the selection considers for ``blocks`` blocks: its own count, or every count
        ``auto`` compares."""
        return (self.spans,) if isinstance(self.spans, int) else tuple(k for k in AUTO_SPAN_COUNTS if k <= blocks)


class RefitStage(MethodSettings):
    """The refit stage's settings, on every method that removes blocks: after the removal, the projections
    of the blocks from the one before each removed span are refitted in closed form so that the compressed
    model's stream follows the original's (methods/refit.py). ``refit=None`` resolves to the method's
    ``default_refit()``: ``none`` for the baselines, so each runs as its paper describes unless asked."""

    #: True where the method's own surgery runs the refit (it records the streams before removing),
    #: False where the stage records them on an unedited twin of the model before the method runs
    refits_within: ClassVar[bool] = False
    #: True where the method's first pass runs the unedited model over the whole calibration set and carries
    #: ``job.streams``, so the stage records the original streams there instead of on a twin
    first_pass_records: ClassVar[bool] = False

    refit: Literal["none", "down", "attn+down", "all"] | None = Field(
        None, description="projections refitted after removal")
    refit_blocks: int | None = Field(None, ge=1, description="blocks refitted per span, from the one before it")
    refit_ridge: float = Field(1e-2, ge=0, description="ridge toward the current weights (relative)")
    refit_weighting: Literal["none", "stream"] = Field(
        "none", description="token errors as they are or relative")
    refit_scale: bool | None = Field(None, description="also fit the stream's scale after each span")
    refit_sandwich: bool | None = Field(None, description="with all: also the inputs of sandwich-norm blocks")

    def default_refit(self) -> str:
        return "none"

    @model_validator(mode="after")
    def _consistent_refit(self):
        if self.refit is None:
            self._resolve("refit", self.default_refit())
        if self.refit == "none":
            defaults = type(self).model_fields
            if (self.refit_blocks is not None or self.refit_ridge != defaults["refit_ridge"].default
                    or self.refit_weighting != defaults["refit_weighting"].default or self.refit_scale):
                raise ValueError("refit_blocks, refit_ridge, refit_weighting and refit_scale apply to a refit: add "
                                 "--refit all or --refit down, or drop them")
            self._resolve("refit_scale", False)
        if self.refit != "all" and self.refit_sandwich:
            raise ValueError("refit_sandwich (--refit-sandwich) corrects input projections, which only --refit all "
                             "refits: use --refit all or drop it")
        if self.refit_sandwich is None:
            self._resolve("refit_sandwich", self.refit == "all")
        if self.refit != "none":
            if self.refit_blocks is None:
                self._resolve("refit_blocks", 3 if self.refit == "all" else 2)
            if self.refit_scale is None:
                self._resolve("refit_scale", True)
        return self


class ReplaceMe(RefitStage, SpanSelection):
    """Remove the span a linear map replaces best and fold the map into the block before it."""

    method: ClassVar[str] = "replaceme"
    runner: ClassVar[str] = "blockfold.methods.replaceme:compress_replaceme"
    planner: ClassVar[str | None] = "blockfold.methods.replaceme:plan_span_removal"
    refits_within: ClassVar[bool] = True
    runs_on_images: ClassVar[bool] = True
    spans: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="spans sharing the budget (auto: the best of 1 to 3)")

    criterion: SpanCriterion = Field("fit_error", description="how spans are scored")
    greedy: bool = Field(False, description="one block at a time, re-measuring after each")
    estimator: Literal["lstsq", "diagonal", "orthogonal", "lowrank", "cosine", "identity"] = Field(
        "lstsq", description="the span's map (identity: none)")
    span_scoring: Literal["lstsq", "estimator", "compare"] | None = Field(
        None, description="scorer (compare: both)")
    shortlist: int = Field(1, ge=1, description="the N best spans apart, kept by held-out loss")
    rank: int | None = Field(None, ge=1, description="lowrank: rank of the correction")
    ridge_alpha: float = Field(0.0, ge=0, description="L2 penalty of the fit, per token")
    sandwich_fold: Literal["auto", "compare", "linearized-norm", "through-norm"] = Field(
        "auto", description="how it folds")
    cosine: CosineConfig = Field(default_factory=CosineConfig, description="the cosine estimator's numerical fit")

    def describe(self, selection: dict) -> str:
        return f" / {self.estimator}" + (f" (rank {self.rank})" if self.rank else "")

    def folds_maps(self) -> bool:
        return self.estimator != "identity"

    def default_refit(self) -> str:
        # a refit needs the spans before the surgery, and plain removal stays plain
        return "all" if self.estimator == "lstsq" and not self.greedy else "none"

    @model_validator(mode="after")
    def _consistent(self):
        if self.refit != "none" and self.greedy:
            raise ValueError("refit (--refit) cannot follow greedy removal yet: the original streams are recorded "
                             "before the surgery, and greedy decides the blocks one removal at a time; drop one of them")
        if self.estimator == "lowrank" and self.rank is None:
            self._resolve("rank", 32)
        if self.rank is not None and self.estimator != "lowrank":
            raise ValueError(f"rank (--rank) applies to the lowrank estimator only, not {self.estimator!r}")
        if self.greedy and (self.spans != 1 or self.span_start is not None):
            raise ValueError("greedy (--greedy) cannot be combined with spans or span_start: choose one selection")
        if self.shortlist > 1 and (self.greedy or self.spans != 1 or self.span_start is not None):
            raise ValueError("shortlist (--shortlist) compares single spans chosen by the criterion, so it cannot "
                             "be combined with spans, greedy or span_start: drop one of them")
        if self.shortlist > 1 and self.span_scoring == "compare":
            raise ValueError("shortlist (--shortlist) and span_scoring compare (--span-scoring compare) both keep a "
                             "span by held-out loss: use --span-scoring lstsq or estimator with --shortlist")
        if self.span_scoring is None:
            self._resolve("span_scoring", "compare" if self.spans == 1 and not self.greedy and self.shortlist == 1
                          else "lstsq")
        if self.span_scoring == "compare" and (self.greedy or self.spans != 1):
            raise ValueError("span_scoring compare (--span-scoring compare) builds the single span each scoring "
                             "picks, so it cannot pick several spans or greedy rounds: use --span-scoring lstsq "
                             "or estimator with --spans / --greedy, or drop them")
        if self.sandwich_fold != "auto" and self.estimator == "identity":
            raise ValueError("sandwich_fold chooses how a map is folded, and the identity estimator folds none: "
                             "drop --sandwich-fold or choose another estimator")
        if self.sandwich_fold in ("through-norm", "compare") and self.estimator in ("diagonal", "orthogonal", "lowrank"):
            raise ValueError(f"sandwich_fold {self.sandwich_fold} needs the through-norm fit, an unconstrained map, so "
                             f"the {self.estimator} constraint would not hold: use --sandwich-fold linearized-norm or auto")
        return self


class UIDL(RefitStage, SpanSelection):
    """The span of least angular distance (or ``criterion``), removed with no map (UIDL / ShortGPT)."""

    method: ClassVar[str] = "uidl"
    runner: ClassVar[str] = "blockfold.methods.baselines:compress_uidl"
    planner: ClassVar[str | None] = "blockfold.methods.replaceme:plan_span_removal"
    refits_within: ClassVar[bool] = True  # it runs ReplaceMe's surgery with the identity map
    runs_on_images: ClassVar[bool] = True
    criterion: SpanCriterion = Field("angular_last", description="how spans are scored")
    span_scoring: Literal["lstsq", "estimator"] = Field(
        "lstsq", description="with a fit criterion: whose error scores")


class NBL(AttentionBudget):
    """Replace the most linear attention sublayers by their LMMSE maps (no KV cache for them)."""

    method: ClassVar[str] = "nbl"
    runner: ClassVar[str] = "blockfold.methods.nbl:compress_nbl"
    planner: ClassVar[str | None] = "blockfold.methods.nbl:plan_linearity"
    ranks_sublayers: ClassVar[str | None] = "attention"
    writes_standard_checkpoint: ClassVar[bool] = False
    linearity_criterion: LinearityCriterion | Literal["auto"] = Field(
        "auto", description="ranking (auto: nmse on Gemma)")
    greedy: bool = Field(False, description="one at a time, re-measuring after each")
    ridge_alpha: float = Field(0.0, ge=0, description="L2 penalty of the fit, per token")

    def describe(self, selection: dict) -> str:
        return f" / {selection['criterion']}"

    def parameters_added(self, count: int, hidden_size: int) -> int:
        return count * (hidden_size * hidden_size + hidden_size)  # one map W x + b per replaced sublayer

    def resolved_criterion(self, adapter) -> LinearityCriterion:
        """The ranking that runs on an architecture (``adapter``): ``auto``'s rule, or the one named."""
        if self.linearity_criterion != "auto":
            return self.linearity_criterion
        return "nmse" if adapter.post_attention_norm else "cosine"


class NBLBlock(BlockBudget):
    """Replace the most linear whole blocks by their LMMSE maps."""

    method: ClassVar[str] = "nbl-block"
    runner: ClassVar[str] = "blockfold.methods.nbl:compress_nbl_block"
    planner: ClassVar[str | None] = "blockfold.methods.nbl:plan_linearity"
    ranks_sublayers: ClassVar[str | None] = "block"
    writes_standard_checkpoint: ClassVar[bool] = False
    linearity_criterion: LinearityCriterion = Field("cosine", description="how blocks are ranked")
    greedy: bool = Field(False, description="one at a time, re-measuring after each")
    ridge_alpha: float = Field(0.0, ge=0, description="L2 penalty of the fit, per token")

    def describe(self, selection: dict) -> str:
        return f" / {selection['criterion']}"

    def parameters_added(self, count: int, hidden_size: int) -> int:
        return count * (hidden_size * hidden_size + hidden_size)  # one map W x + b per replaced block

    def resolved_criterion(self, adapter) -> LinearityCriterion:
        return self.linearity_criterion


class DropAttention(AttentionBudget):
    """DROP: the attention sublayers whose residual input and output are most alike, dropped."""

    method: ClassVar[str] = "drop-attn"
    runner: ClassVar[str] = "blockfold.methods.nbl:compress_drop_attention"
    planner: ClassVar[str | None] = "blockfold.methods.nbl:plan_linearity"
    ranks_sublayers: ClassVar[str | None] = "attention"
    writes_standard_checkpoint: ClassVar[bool] = False
    greedy: bool = Field(False, description="one at a time, re-measuring after each")


class DropBlock(RefitStage, BlockBudget):
    """DROP: the blocks whose output is most like their input, wherever they are, dropped."""

    method: ClassVar[str] = "drop-block"
    runner: ClassVar[str] = "blockfold.methods.baselines:compress_drop_blocks"
    planner: ClassVar[str | None] = "blockfold.methods.baselines:plan_drop_blocks"
    runs_on_images: ClassVar[bool] = True
    first_pass_records: ClassVar[bool] = True


class SLEB(RefitStage, BlockBudget):
    """SLEB: remove blocks one at a time, each time the one whose removal raises calibration perplexity least."""

    method: ClassVar[str] = "sleb"
    runner: ClassVar[str] = "blockfold.methods.sleb:compress_sleb"
    planner: ClassVar[str | None] = "blockfold.methods.sleb:plan_sleb"
    score_sequences: int | None = Field(None, ge=1, description="score on the first N sequences "
                                                                "(default: all; the refit fits on all)")


class PruneComp(RefitStage, BlockBudget):
    """Prune&Comp: remove blocks one per round by an importance measured on the model as pruned so far,
    and compensate the magnitude each leaves missing with a scalar folded into existing weights."""

    method: ClassVar[str] = "prune-comp"
    runner: ClassVar[str] = "blockfold.methods.prune_comp:compress_prune_comp"
    planner: ClassVar[str | None] = "blockfold.methods.prune_comp:plan_prune_comp"
    importance: Literal["block_influence", "perplexity"] = Field(
        "block_influence", description="ranking")
    compensate: bool = Field(True, description="fold the magnitude compensation")


class LaCo(RefitStage, BlockBudget):
    """LaCo: consecutive blocks collapsed into the first of them (its weights plus the others' differences
    from them), where the collapse keeps the last block's output most like the original model's."""

    method: ClassVar[str] = "laco"
    runner: ClassVar[str] = "blockfold.methods.laco:compress_laco"
    planner: ClassVar[str | None] = "blockfold.methods.laco:plan_laco"
    merge_layers: int = Field(4, ge=2, description="blocks collapsed into one per merge")
    similarity_sequences: int = Field(8, ge=1, description="sequences a merge is judged on")


class LinearPatch(BlockBudget):
    """LinearPatch: the span whose input and output are most alike removed, one linear patch on the residual
    stream in its place (a linear block: not a standard checkpoint, the modeling code ships with it)."""

    method: ClassVar[str] = "linear-patch"
    runner: ClassVar[str] = "blockfold.methods.linear_patch:compress_linear_patch"
    planner: ClassVar[str | None] = "blockfold.methods.linear_patch:plan_linear_patch"
    writes_standard_checkpoint: ClassVar[bool] = False
    criterion: Literal["block_influence", "angular_all", "angular_last"] = Field(
        "block_influence", description="how spans are scored")
    span_start: int | None = Field(None, ge=1, description="start the span here instead of selecting one")
    patch: Literal["hadamard", "full"] = Field("hadamard", description="H D Hᵀ or least squares")
    ridge_alpha: float = Field(0.0, ge=0, description="full: L2 penalty per token")

    def parameters_added(self, count: int, hidden_size: int) -> int:
        return hidden_size * hidden_size + hidden_size  # one patch, stored as a linear block, for the span

    @model_validator(mode="after")
    def _ridge_for_full(self):
        if self.ridge_alpha and self.patch != "full":
            raise ValueError("ridge_alpha (--ridge-alpha) applies to the least-squares patch only: add --patch full")
        return self


class Streamline(BlockBudget):
    """LLM-Streamline: the span of blocks + 1 whose input and output are most alike becomes one block,
    trained by MSE on calibration activations to output what the span did (a standard checkpoint)."""

    method: ClassVar[str] = "streamline"
    runner: ClassVar[str] = "blockfold.methods.streamline:compress_streamline"
    planner: ClassVar[str | None] = "blockfold.methods.streamline:plan_streamline"
    criterion: Literal["block_influence", "angular_all", "angular_last"] = Field(
        "block_influence", description="how spans are scored")
    train_steps: int = Field(200, ge=0, description="Adam steps training the new block")
    learning_rate: float = Field(1e-4, gt=0, description="that training's learning rate",
                                 json_schema_extra={"flag": "lr"})


class SvdLlm(ParameterBudget):
    """SVD-LLM: every projection of the blocks as two low-rank factors, truncated where its output on the
    calibration data loses least (a width baseline: not a standard checkpoint, the modeling code ships with it)."""

    method: ClassVar[str] = "svd-llm"
    runner: ClassVar[str] = "blockfold.methods.svd_llm:compress_svd_llm"
    planner: ClassVar[str | None] = "blockfold.methods.svd_llm:plan_svd_llm"
    writes_standard_checkpoint: ClassVar[bool] = False
    whitening: bool = Field(True, description="whiten by the inputs' moments (off: plain SVD)")


class SliceGPT(MethodSettings):
    """SliceGPT: the residual stream rotated into its principal directions and the least used sliced
    away (a width baseline: not a standard checkpoint, the modeling code ships with it)."""

    method: ClassVar[str] = "slicegpt"
    runner: ClassVar[str] = "blockfold.methods.slicegpt:compress_slicegpt"
    planner: ClassVar[str | None] = "blockfold.methods.slicegpt:plan_slicegpt"
    writes_standard_checkpoint: ClassVar[bool] = False
    budget_field: ClassVar[str | None] = "slicing"
    slicing: float = Field(0.25, ge=0, lt=1, description="share of the hidden dimension sliced away (default 0.25)")
    sparsity: float | None = Field(None, gt=0, lt=1, description=SPARSITY_DESCRIPTION)

    @model_validator(mode="after")
    def _slicing_from_sparsity(self):
        # slicing the stream to k of d dimensions keeps k/d of every block's parameters: the two budgets are one
        if self.sparsity is not None:
            if "slicing" in self.model_fields_set and self.slicing != self.sparsity:
                raise ValueError("give one budget, not slicing (--slicing) and sparsity (--sparsity)")
            self._resolve("slicing", self.sparsity)
        return self


class LLMPruner(ParameterBudget):
    """LLM-Pruner: attention head groups and MLP channels of the middle blocks pruned by their weights'
    first-order Taylor importance on calibration gradients (a width baseline: ships its modeling code)."""

    method: ClassVar[str] = "llm-pruner"
    runner: ClassVar[str] = "blockfold.methods.llm_pruner:compress_llm_pruner"
    planner: ClassVar[str | None] = "blockfold.methods.llm_pruner:plan_llm_pruner"
    writes_standard_checkpoint: ClassVar[bool] = False


#: the registry: method name → its settings class (the first is the default method)
SETTINGS: dict[str, type[MethodSettings]] = {
    cls.method: cls for cls in (ReplaceMe, UIDL, NBL, NBLBlock, DropAttention, DropBlock, SLEB, PruneComp, LaCo,
                                LinearPatch, Streamline, SvdLlm, SliceGPT, LLMPruner)
}
DEFAULT_METHOD = next(iter(SETTINGS))


def register_method(settings_class: type[MethodSettings]) -> type[MethodSettings]:
    """Add a method to the registry (usable as a class decorator): from then on the CLI, the API, recipes,
    sweep and ``blockfold methods`` know it. A package can register its methods when blockfold starts by
    naming the module in the ``blockfold.methods`` entry-point group (docs/methods.md)."""
    name = getattr(settings_class, "method", None)
    if not isinstance(name, str) or not isinstance(getattr(settings_class, "runner", None), str):
        raise BlockfoldError(f"{settings_class.__name__} needs the class variables method (its name) and runner "
                             "('module:function') to be registered")
    if name in SETTINGS and SETTINGS[name] is not settings_class:
        raise BlockfoldError(f"a method named {name!r} is registered already ({SETTINGS[name].__name__})")
    SETTINGS[name] = settings_class
    return settings_class


def _load_plugins() -> None:
    """Import the modules of the ``blockfold.methods`` entry-point group: each registers its methods."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="blockfold.methods"):
        entry.load()


_load_plugins()


def methods_where(predicate) -> list[str]:
    """Names of the registered methods whose settings class satisfies ``predicate`` (in registry order)."""
    return [name for name, cls in SETTINGS.items() if predicate(cls)]
