"""What blockfold needs to know about one family of decoder-only architectures.

An adapter answers *where* things are (blocks, norms, attention, MLP, down-projection) and *which*
config fields are per layer. Everything else (statistics, selection, estimation, surgery) asks the
adapter instead of guessing from module names, so adding an architecture means adding one adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from blockfold.errors import BlockfoldError
from blockfold.settings import ModelSize


@dataclass(frozen=True)
class Projection:
    """A weight whose output is (part of) what a sublayer adds to the residual stream.

    ``hidden_axis`` is the axis of its weight that indexes the hidden (output) dimension: -2 for an
    ``nn.Linear`` weight (out, in) and for transformers' stacked experts (experts, out, in), -1 for
    stacked experts stored (experts, in, out). A fold multiplies along that axis (and the bias's last).
    """

    module: nn.Module
    weight: str = "weight"
    bias: str | None = "bias"
    hidden_axis: int = -2


@dataclass(frozen=True)
class DecoderAdapter:
    """Names of the parts of a Hugging Face decoder-only model, relative to the causal-LM module.

    ``post_mlp_norm`` is the norm some architectures (Gemma 2/3, "sandwich" blocks) apply between
    the down-projection and the residual add. When present, a linear map on the MLP's residual
    contribution cannot be folded into ``down_proj`` exactly; the estimators then fit the map in
    the down-projection's output space with that norm in the loop (see ``docs/gemma.md``).
    """

    name: str
    model_types: tuple[str, ...]
    decoder_attr: str = "model"
    layers_attr: str = "layers"
    final_norm_attr: str = "norm"
    attention_attr: str = "self_attn"
    mlp_attr: str = "mlp"
    down_proj_attr: str = "down_proj"
    # the attention's output projection, inside ``attention_attr``
    attention_output_attr: str = "o_proj"
    input_norm_attr: str = "input_layernorm"
    # the norm whose output the MLP reads (Llama names it post_attention_layernorm)
    pre_mlp_norm_attr: str = "post_attention_layernorm"
    post_attention_norm: str | None = None
    post_mlp_norm: str | None = None
    # Gemma's RMSNorm scales by (1 + weight); Llama's by weight.
    norm_weight_offset: float = 0.0
    # Config fields holding one entry per layer; generic per-layer lists are detected as well.
    per_layer_config_fields: tuple[str, ...] = field(default=("layer_types",))
    # Integer config fields that count layers from the bottom (e.g. Qwen's ``max_window_layers``).
    layer_count_config_fields: tuple[str, ...] = ()
    # Config lists of layer indices (e.g. Qwen-MoE's ``mlp_only_layers``), never mistaken for per-layer lists.
    layer_index_config_fields: tuple[str, ...] = ()
    # True where the attention takes its heads' width from the hidden size (no ``head_dim`` in the config),
    # so a narrower stream (SliceGPT) cannot be written as the family's own config
    head_width_from_hidden: bool = False

    #: True for encoders of images (``VisionEncoderAdapter``): calibration is images, there is no LM head
    is_vision: bool = False

    # -- locating modules -------------------------------------------------------------------
    def decoder(self, model: nn.Module) -> nn.Module:
        """The module holding the blocks (``decoder_attr`` may be a dotted path; empty: the model itself)."""
        return _get_path(model, self.decoder_attr)

    def outside_modules(self, model: nn.Module) -> list[nn.Module]:
        """What runs before the blocks (embeddings, rotary tables) and the final norm: the decoder's
        other children."""
        decoder = self.decoder(model)
        return [module for name, module in decoder.named_children() if name != self.layers_attr]

    def prepare(self, handle) -> None:
        """Rewrite the model into the form the rest of blockfold assumes, exactly, before anything runs
        (nothing to do for most families)."""

    def run_to_blocks(self, model: nn.Module, batch, device: torch.device) -> None:
        """Run ``batch`` through the model's front and its blocks (a pipeline's hooks stop it where they
        have what they need)."""
        self.decoder(model)(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                            position_ids=batch.position_ids.to(device), use_cache=False)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self.decoder(model), self.layers_attr)

    def num_layers(self, model: nn.Module) -> int:
        return len(self.layers(model))

    def attention(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attention_attr)

    def mlp(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.mlp_attr)

    def down_proj(self, layer: nn.Module) -> nn.Linear:
        return getattr(self.mlp(layer), self.down_proj_attr)

    def mlp_output_projections(self, layer: nn.Module) -> list[Projection]:
        """Every weight whose output the MLP half adds to the residual stream; a map on the MLP's
        contribution folds into all of them (one here; every expert's in a mixture of experts)."""
        return [Projection(self.down_proj(layer))]

    def is_sparse(self, layer: nn.Module) -> bool:
        """True when the block's MLP is a mixture of experts."""
        return False

    def attention_output_projection(self, layer: nn.Module) -> Projection:
        """The weight whose output the attention sublayer adds to the residual (before a post-attention norm)."""
        projection = _get_path(self.attention(layer), self.attention_output_attr, None)
        if not isinstance(projection, nn.Linear):
            raise BlockfoldError(f"{self.name}: this block's attention has no output projection "
                                 f"{self.attention_output_attr!r} (a linearized sublayer?); this operation needs one")
        return Projection(projection)

    def residual_writers(self, layer: nn.Module) -> tuple[list[nn.Module], list[Projection]]:
        """What sets the size of the block's two contributions to the residual stream: the norm that
        ends a sublayer where there is one (its gain scales the contribution), else the sublayer's
        output projections. Scaling all of them by c scales what the block adds by c, exactly."""
        norms, projections = [], []
        if self.post_attention_norm:
            norms.append(getattr(layer, self.post_attention_norm))
        else:
            projections.append(self.attention_output_projection(layer))
        mlp_norm = self.mlp_norm(layer)
        if mlp_norm is not None:
            norms.append(mlp_norm)
        else:
            projections.extend(self.mlp_output_projections(layer))
        return norms, projections

    def renumber_config(self, config, keep: list[int], sparse: list[bool]) -> None:
        """Fix the config fields that say which layer is which kind, after only ``keep`` (old
        indices, in order) remain; ``sparse`` says which old layers are mixtures of experts."""

    def mlp_norm(self, layer: nn.Module) -> nn.Module | None:
        """The norm between the down-projection and the residual add, if the block has one."""
        return getattr(layer, self.post_mlp_norm) if self.post_mlp_norm else None

    def input_norm(self, layer: nn.Module) -> nn.Module:
        """The norm whose output the attention sublayer reads."""
        return getattr(layer, self.input_norm_attr)

    def pre_mlp_norm(self, layer: nn.Module) -> nn.Module:
        """The norm whose output the MLP reads."""
        return getattr(layer, self.pre_mlp_norm_attr)

    def input_projections(self, layer: nn.Module, sublayer: str) -> list[nn.Linear]:
        """The linear layers of ``sublayer`` ("attention" or "mlp") that read its input norm's output
        (q, k, v; gate, up): every ``nn.Linear`` inside it except those that write its output. A map
        on the normed input folds into all of them; none where the sublayer has no such layout (an
        attention replaced by a map)."""
        if sublayer == "attention":
            try:
                outputs = [self.attention_output_projection(layer).module]
            except BlockfoldError:
                return []
            module = self.attention(layer)
        else:
            module, outputs = self.mlp(layer), [projection.module for projection in self.mlp_output_projections(layer)]
        return [linear for linear in module.modules()
                if isinstance(linear, nn.Linear) and not any(linear is output for output in outputs)]

    def linear_projections(self, layer: nn.Module) -> dict[str, nn.Linear]:
        """Every ``nn.Linear`` of the block's attention and MLP, by its dotted name in the layer
        (``self_attn.q_proj``, ``mlp.down_proj``): the weights a width method factors or slices."""
        found = {}
        for attr in (self.attention_attr, self.mlp_attr):
            for name, module in getattr(layer, attr).named_modules():
                if isinstance(module, nn.Linear):
                    found[f"{attr}.{name}"] = module
        return found

    def attention_contribution_module(self, layer: nn.Module) -> nn.Module:
        """The module whose output (first element) is exactly what attention adds to the residual."""
        return getattr(layer, self.post_attention_norm) if self.post_attention_norm else self.attention(layer)

    def mlp_contribution_module(self, layer: nn.Module) -> nn.Module:
        """The module whose output is exactly what the MLP half adds to the residual stream."""
        return self.mlp_norm(layer) or self.mlp(layer)

    def norm_scale(self, norm: nn.Module) -> torch.Tensor:
        """The effective per-channel scale g of an RMSNorm (``weight`` or ``1 + weight``)."""
        return norm.weight.detach().double() + self.norm_weight_offset

    def set_norm_scale(self, norm: nn.Module, scale: torch.Tensor | float) -> None:
        """Set the effective per-channel scale g of an RMSNorm (inverse of ``norm_scale``)."""
        with torch.no_grad():
            norm.weight.copy_(torch.as_tensor(scale, dtype=torch.float64) - self.norm_weight_offset)

    @staticmethod
    def norm_eps(norm: nn.Module) -> float:
        return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))

    @property
    def folds_exactly(self) -> bool:
        """True when a map on the MLP contribution folds into ``down_proj`` with no error."""
        return self.post_mlp_norm is None

    def hidden_size(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def model_size(self, model: nn.Module) -> ModelSize:
        """The sizes a ``sparsity`` budget is resolved against (parameters on the meta device count too)."""
        layers = self.layers(model)
        return ModelSize(tuple(sum(p.numel() for p in layer.parameters()) for layer in layers),
                         tuple(sum(p.numel() for p in self.attention(layer).parameters()) for layer in layers),
                         self.hidden_size(model))

    # -- linear replacements (executed by surgery/modeling_blockfold.py) -----------------------
    def attention_replacement(self, index: int, replacement: str) -> dict:
        """Replace the attention sublayer of layer ``index`` by a map of what its input norm outputs
        to what the sublayer adds to the residual (after a post-attention norm, which goes)."""
        identity = [self.post_attention_norm] if self.post_attention_norm else []
        return {"layer": index, "module": self.attention_attr, "replacement": replacement,
                "identity": identity, "zero": []}

    def block_replacement(self, index: int) -> dict:
        """Replace the whole block ``index`` by ``h + h Wᵀ + b`` on its residual input ``h``: the
        attention slot carries the map, every norm becomes the identity, the MLP adds nothing."""
        norms = [self.input_norm_attr, self.post_attention_norm, self.pre_mlp_norm_attr, self.post_mlp_norm]
        return {"layer": index, "module": self.attention_attr, "replacement": "linear",
                "identity": [name for name in norms if name], "zero": [self.mlp_attr]}


def _get_path(owner: nn.Module, path: str, *default):
    """``owner.a.b`` for ``path="a.b"`` (``owner`` for an empty path)."""
    for name in filter(None, path.split(".")):
        owner = getattr(owner, name, *default)
    return owner


@dataclass(frozen=True)
class VisionEncoderAdapter(DecoderAdapter):
    """Pre-norm transformer encoders of images (ViT, CLIP's and SigLIP's vision towers), as
    transformers 5 builds them: patch embeddings (and a class token) before the blocks, a final
    LayerNorm after them, blocks of ``h + attn(n1(h))`` then ``+ mlp(n2(.))`` with ``mlp.fc2`` the
    MLP's output projection. Every token of every image is real; calibration is images."""

    is_vision: bool = True
    mlp_attr: str = "mlp"
    down_proj_attr: str = "fc2"
    #: tokens an image gets besides its patches (the class token)
    class_tokens: int = 1

    def outside_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every module outside the blocks, wherever it hangs (the embeddings sit beside the encoder)."""
        layers = self.layers(model)
        outside, holders = [], [model]
        while holders:
            for child in holders.pop().children():
                if child is not layers:
                    (holders if any(m is layers for m in child.modules()) else outside).append(child)
        return outside

    def tokens_per_image(self, config, height: int, width: int) -> int:
        """Patches, class token and register tokens (DINOv2 with registers) of one image."""
        patch = config.patch_size
        return (height // patch) * (width // patch) + self.class_tokens + getattr(config, "num_register_tokens", 0)

    def run_to_blocks(self, model: nn.Module, batch, device: torch.device) -> None:
        model(pixel_values=batch.pixel_values.to(device, model.dtype))


@dataclass(frozen=True)
class LayerScaleEncoderAdapter(VisionEncoderAdapter):
    """DINOv2: each sublayer's output is multiplied by a learned per-channel scale (``layer_scaleN.lambda1``)
    before its residual add. ``prepare`` moves the scales into the output projections (``W ← diag(s) W``,
    ``b ← s ⊙ b``, then ``s ← 1``), an exact rewrite after which the block is a plain pre-norm block:
    the map folds into ``fc2`` (``down_proj`` with SwiGLU), the refit and criteria see the real
    contributions. The checkpoint keeps the layer-scale parameters, at one."""

    scale_attrs: tuple[str, str] = ("layer_scale1", "layer_scale2")

    def down_proj(self, layer: nn.Module) -> nn.Linear:
        mlp = self.mlp(layer)
        return getattr(mlp, "fc2", None) or mlp.down_proj

    def mlp_output_projections(self, layer: nn.Module) -> list[Projection]:
        return [Projection(self.down_proj(layer))]

    def attention_contribution_module(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.scale_attrs[0])

    def mlp_contribution_module(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.scale_attrs[1])

    def prepare(self, handle) -> None:
        for layer in self.layers(handle.model):
            for scale_attr, projection in zip(self.scale_attrs, (self.attention_output_projection(layer),
                                                                 self.mlp_output_projections(layer)[0])):
                scale = getattr(layer, scale_attr)
                with handle.materialized(scale):
                    s = scale.lambda1.detach().double().cpu()
                if bool((s == 1).all()):
                    continue
                handle.transform(projection.module, "weight", lambda weight, s=s: s.to(weight.device)[:, None] * weight)
                if projection.module.bias is not None:
                    handle.transform(projection.module, "bias", lambda bias, s=s: s.to(bias.device) * bias)
                handle.transform(scale, "lambda1", torch.ones_like)

    def renumber_config(self, config, keep: list[int], sparse: list[bool]) -> None:
        """The backbone fields name one stage per layer: keep them consistent, the output at the last stage."""
        if getattr(config, "stage_names", None) is not None:
            config.stage_names = ["stem"] + [f"stage{index}" for index in range(1, len(keep) + 1)]
            config.set_output_features_output_indices(out_features=None, out_indices=None)


@dataclass(frozen=True)
class MixtureOfExpertsAdapter(DecoderAdapter):
    """Pre-norm decoders whose MLP is a mixture of experts, as transformers 5 builds them: the
    experts' down-projections stacked in one (experts, hidden, intermediate) parameter, scaled by
    per-token routing weights and summed, plus an optional shared expert scaled by a per-token gate.

    Every term of the MoE output is linear in its expert's down-projection output and the weights are
    scalars per token, so ``T(Σ g_e E_e(x)) = Σ g_e (T E_e(x))``: a map on the MLP contribution folds
    exactly into every expert's down-projection and the shared expert's. Layers listed as dense
    (Qwen-MoE's ``mlp_only_layers``, ``decoder_sparse_step``) keep a plain MLP and fold as one.
    """

    experts_attr: str = "experts"
    shared_expert_attrs: tuple[str, ...] = ("shared_expert", "shared_experts")
    #: the stacked experts' weight and its layout (transformers 5: (experts, hidden, intermediate))
    experts_down_proj_attr: str = "down_proj"
    experts_hidden_axis: int = -2

    def is_sparse(self, layer: nn.Module) -> bool:
        return getattr(self.mlp(layer), self.experts_attr, None) is not None

    def mlp_output_projections(self, layer: nn.Module) -> list[Projection]:
        if not self.is_sparse(layer):
            return super().mlp_output_projections(layer)
        mlp = self.mlp(layer)
        experts = getattr(mlp, self.experts_attr)
        bias = f"{self.experts_down_proj_attr}_bias"
        projections = [Projection(experts, self.experts_down_proj_attr, bias if hasattr(experts, bias) else None,
                                  self.experts_hidden_axis)]
        for name in self.shared_expert_attrs:
            shared = getattr(mlp, name, None)
            if shared is not None:
                projections.append(Projection(getattr(shared, self.down_proj_attr)))
        return projections

    def down_proj(self, layer: nn.Module) -> nn.Linear:
        if self.is_sparse(layer):
            raise BlockfoldError(f"{self.name}: a mixture-of-experts block has no single down-projection; "
                                 "this operation does not support such blocks yet")
        return super().down_proj(layer)

    def dense_layers(self, config) -> list[int]:
        """The blocks the config keeps as a plain MLP, read from the config alone (Qwen-MoE's
        ``mlp_only_layers`` and every block not on its ``decoder_sparse_step``; none for the others)."""
        only = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return [index for index in range(config.num_hidden_layers) if index in only or (index + 1) % step]

    def renumber_config(self, config, keep: list[int], sparse: list[bool]) -> None:
        """Qwen-MoE picks dense layers by ``mlp_only_layers`` and every ``decoder_sparse_step``-th
        layer: the kept layers' kinds are restated as an explicit list with step 1."""
        if hasattr(config, "mlp_only_layers") and hasattr(config, "decoder_sparse_step"):
            config.mlp_only_layers = [new for new, old in enumerate(keep) if not sparse[old]]
            config.decoder_sparse_step = 1
