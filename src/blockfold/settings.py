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

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from blockfold.errors import BlockfoldError
from blockfold.schema import Strict

SPAN_CRITERIA = ("angular_last", "angular_all", "block_influence", "cka", "cca", "fit_error", "fit_error_stream")
SpanCriterion = Literal["angular_last", "angular_all", "block_influence", "cka", "cca", "fit_error", "fit_error_stream"]
LinearityCriterion = Literal["cca", "nmse", "cosine", "stream"]
#: the span counts ReplaceMe's ``spans="auto"`` compresses and compares
AUTO_SPAN_COUNTS = (1, 2, 3)


class CosineConfig(Strict):
    """Numerical fit of the transform under a cosine (or, for sandwich norms, MSE) objective."""

    max_tokens: int = Field(16384, ge=64)
    steps: int = Field(60, ge=1)
    learning_rate: float = Field(1.0, gt=0)
    # L1 penalty on the transform, λ·Σ|T_ij| / d, added to the objective (0: none)
    l1_penalty: float = Field(0.0, ge=0)


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
    @classmethod
    def summary(cls) -> str:
        """One line on what the method does: the first line of its settings class's docstring."""
        return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()).replace("``", "")

    def describe(self, selection: dict) -> str:
        """What to add after the method's name in compress's summary (its map, its ranking), or ``""``."""
        return ""


class BlockBudget(MethodSettings):
    """A budget in decoder blocks: ``blocks``, or ``ratio`` of the model's blocks (default 8 blocks)."""

    blocks: int | None = Field(None, ge=1)
    ratio: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_budget(self):
        if self.blocks is not None and self.ratio is not None:
            raise ValueError("give either blocks (--blocks) or ratio (--ratio), not both")
        if self.blocks is None and self.ratio is None:
            self._resolve("blocks", 8)
        return self

    def num_blocks(self, num_layers: int) -> int:
        """How many blocks, validated against a model of ``num_layers`` blocks."""
        n = self.blocks if self.blocks is not None else round(self.ratio * num_layers)
        if n < 1 or n > num_layers - 2:
            raise BlockfoldError(
                f"cannot remove {n} of {num_layers} blocks: use --blocks between 1 and {num_layers - 2} "
                "(the first block and at least one after the span are always kept)"
            )
        return n


class AttentionBudget(MethodSettings):
    """A budget in attention sublayers: ``attention_layers``, or ``ratio`` of the layers (default 8)."""

    attention_layers: int | None = Field(None, ge=1)
    ratio: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_budget(self):
        if self.attention_layers is not None and self.ratio is not None:
            raise ValueError("give either attention_layers (--attn) or ratio (--ratio), not both")
        if self.attention_layers is None and self.ratio is None:
            self._resolve("attention_layers", 8)
        return self

    def num_attention_layers(self, num_layers: int) -> int:
        k = self.attention_layers if self.attention_layers is not None else round(self.ratio * num_layers)
        if k < 1 or k > num_layers:
            raise BlockfoldError(f"cannot replace {k} of {num_layers} attention layers: use --attn between 1 and {num_layers}")
        return k


class SpanSelection(BlockBudget):
    """Contiguous spans: several spans sharing the budget, or one at a fixed start."""

    spans: int = Field(1, ge=1)
    span_start: int | None = Field(None, ge=1)

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

    # which projections: down, attention output + down, all (also those reading the normed inputs), none
    refit: Literal["none", "down", "attn+down", "all"] | None = None
    # blocks refitted per span, from the one before it (a number past the last block: every later one)
    refit_blocks: int | None = Field(None, ge=1)
    # ridge toward the current weight, relative to the mean of diag(aᵀa) of the projection's inputs
    refit_ridge: float = Field(1e-2, ge=0)
    # each token's squared error as it is (none) or relative to the original stream's energy (stream)
    refit_weighting: Literal["none", "stream"] = "none"
    # also fit one scalar for the span's magnitude gap, folded into every later block's writes
    refit_scale: bool | None = None
    # with refit all, correct the input projections of sandwich blocks whose outputs cannot be refitted
    refit_sandwich: bool | None = None

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
    refits_within: ClassVar[bool] = True
    runs_on_images: ClassVar[bool] = True
    # auto: build each of AUTO_SPAN_COUNTS and keep the lowest held-out calibration loss
    spans: Annotated[int, Field(ge=1)] | Literal["auto"] = 1

    # how candidate spans are scored (select/spans.py)
    criterion: SpanCriterion = "fit_error"
    # greedy: one block per round, wherever it is, the one whose removal after its own map loses least
    greedy: bool = False
    # the map (estimate/): closed form, cosine (numerical), or identity (plain removal)
    estimator: Literal["lstsq", "diagonal", "orthogonal", "lowrank", "cosine", "identity"] = "lstsq"
    # which map scores the spans: lstsq, the estimator's own, or compare (build both, keep the better)
    span_scoring: Literal["lstsq", "estimator", "compare"] | None = None
    rank: int | None = Field(None, ge=1)  # lowrank: rank of the correction to the identity (default 32)
    ridge_alpha: float = Field(0.0, ge=0)  # L2 penalty per calibration token
    # blocks with a norm after the MLP (Gemma): which foldable form of the map (docs/gemma.md)
    sandwich_fold: Literal["auto", "compare", "linearized-norm", "through-norm"] = "auto"
    cosine: CosineConfig = Field(default_factory=CosineConfig)

    def describe(self, selection: dict) -> str:
        return f" / {self.estimator}" + (f" (rank {self.rank})" if self.rank else "")

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
        if self.span_scoring is None:
            self._resolve("span_scoring", "compare" if self.spans == 1 and not self.greedy else "lstsq")
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
    refits_within: ClassVar[bool] = True  # it runs ReplaceMe's surgery with the identity map
    runs_on_images: ClassVar[bool] = True
    criterion: SpanCriterion = "angular_last"
    # with a fit criterion, what scores each span: lstsq or the identity's own error
    span_scoring: Literal["lstsq", "estimator"] = "lstsq"


class NBL(AttentionBudget):
    """Replace the most linear attention sublayers by their LMMSE maps (no KV cache for them)."""

    method: ClassVar[str] = "nbl"
    runner: ClassVar[str] = "blockfold.methods.nbl:compress_nbl"
    ranks_sublayers: ClassVar[str | None] = "attention"
    writes_standard_checkpoint: ClassVar[bool] = False
    # auto: nmse where attention's output passes a norm (sandwich blocks), cosine elsewhere
    linearity_criterion: LinearityCriterion | Literal["auto"] = "auto"
    greedy: bool = False  # recompute the statistics after each replacement (k passes)
    ridge_alpha: float = Field(0.0, ge=0)

    def describe(self, selection: dict) -> str:
        return f" / {selection['criterion']}"

    def resolved_criterion(self, adapter) -> LinearityCriterion:
        """The ranking that runs on an architecture (``adapter``): ``auto``'s rule, or the one named."""
        if self.linearity_criterion != "auto":
            return self.linearity_criterion
        return "nmse" if adapter.post_attention_norm else "cosine"


class NBLBlock(BlockBudget):
    """Replace the most linear whole blocks by their LMMSE maps."""

    method: ClassVar[str] = "nbl-block"
    runner: ClassVar[str] = "blockfold.methods.nbl:compress_nbl_block"
    ranks_sublayers: ClassVar[str | None] = "block"
    writes_standard_checkpoint: ClassVar[bool] = False
    linearity_criterion: LinearityCriterion = "cosine"
    greedy: bool = False
    ridge_alpha: float = Field(0.0, ge=0)

    def describe(self, selection: dict) -> str:
        return f" / {selection['criterion']}"

    def resolved_criterion(self, adapter) -> LinearityCriterion:
        return self.linearity_criterion


class DropAttention(AttentionBudget):
    """DROP: the attention sublayers whose residual input and output are most alike, dropped."""

    method: ClassVar[str] = "drop-attn"
    runner: ClassVar[str] = "blockfold.methods.nbl:compress_drop_attention"
    ranks_sublayers: ClassVar[str | None] = "attention"
    writes_standard_checkpoint: ClassVar[bool] = False
    greedy: bool = False


class DropBlock(RefitStage, BlockBudget):
    """DROP: the blocks whose output is most like their input, wherever they are, dropped."""

    method: ClassVar[str] = "drop-block"
    runner: ClassVar[str] = "blockfold.methods.baselines:compress_drop_blocks"
    runs_on_images: ClassVar[bool] = True


class SLEB(RefitStage, BlockBudget):
    """SLEB: remove blocks one at a time, each time the one whose removal raises calibration perplexity least."""

    method: ClassVar[str] = "sleb"
    runner: ClassVar[str] = "blockfold.methods.sleb:compress_sleb"


class PruneComp(RefitStage, BlockBudget):
    """Prune&Comp: remove blocks one per round by an importance measured on the model as pruned so far,
    and compensate the magnitude each leaves missing with a scalar folded into existing weights."""

    method: ClassVar[str] = "prune-comp"
    runner: ClassVar[str] = "blockfold.methods.prune_comp:compress_prune_comp"
    # block_influence: 1 − mean cos(h_in, h_out) per block (the paper's CosSim(BI) example);
    # perplexity: calibration perplexity with the block skipped (its PPL metric, SLEB's)
    importance: Literal["block_influence", "perplexity"] = "block_influence"
    compensate: bool = True  # False: iterative removal alone (the paper's ablation)


class LaCo(RefitStage, BlockBudget):
    """LaCo: consecutive blocks collapsed into the first of them (its weights plus the others' differences
    from them), where the collapse keeps the last block's output most like the original model's."""

    method: ClassVar[str] = "laco"
    runner: ClassVar[str] = "blockfold.methods.laco:compress_laco"
    merge_layers: int = Field(4, ge=2)  # blocks collapsed into one per merge (the paper's C = 4)
    # calibration sequences the similarity is measured on (the paper's few sentences)
    similarity_sequences: int = Field(8, ge=1)


class LinearPatch(BlockBudget):
    """LinearPatch: the span whose input and output are most alike removed, one linear patch on the residual
    stream in its place (a linear block: not a standard checkpoint, the modeling code ships with it)."""

    method: ClassVar[str] = "linear-patch"
    runner: ClassVar[str] = "blockfold.methods.linear_patch:compress_linear_patch"
    writes_standard_checkpoint: ClassVar[bool] = False
    # the paper's selection: the span of highest mean cosine between its input and output
    criterion: Literal["block_influence", "angular_all", "angular_last"] = "block_influence"
    span_start: int | None = Field(None, ge=1)
    # hadamard: the paper's H D Hᵀ (D from rotated magnitudes); full: least squares on the stream
    patch: Literal["hadamard", "full"] = "hadamard"
    ridge_alpha: float = Field(0.0, ge=0)  # full only: L2 penalty per calibration token

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
    # the paper's selection: the span of highest mean cosine between its input and output
    criterion: Literal["block_influence", "angular_all", "angular_last"] = "block_influence"
    train_steps: int = Field(200, ge=0)  # Adam steps, one calibration batch each; 0: the span's first block as is
    learning_rate: float = Field(1e-4, gt=0)


#: the registry: method name → its settings class (the first is the default method)
SETTINGS: dict[str, type[MethodSettings]] = {
    cls.method: cls for cls in (ReplaceMe, UIDL, NBL, NBLBlock, DropAttention, DropBlock, SLEB, PruneComp, LaCo,
                                LinearPatch, Streamline)
}
DEFAULT_METHOD = next(iter(SETTINGS))


def methods_where(predicate) -> list[str]:
    """Names of the registered methods whose settings class satisfies ``predicate`` (in registry order)."""
    return [name for name, cls in SETTINGS.items() if predicate(cls)]
