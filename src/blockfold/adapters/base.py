"""What blockfold needs to know about one family of decoder-only architectures.

An adapter answers *where* things are (blocks, norms, attention, MLP, down-projection) and *which*
config fields are per layer. Everything else (statistics, selection, estimation, surgery) asks the
adapter instead of guessing from module names, so adding an architecture means adding one adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


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

    # -- locating modules -------------------------------------------------------------------
    def decoder(self, model: nn.Module) -> nn.Module:
        return getattr(model, self.decoder_attr)

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

    def mlp_norm(self, layer: nn.Module) -> nn.Module | None:
        """The norm between the down-projection and the residual add, if the block has one."""
        return getattr(layer, self.post_mlp_norm) if self.post_mlp_norm else None

    def input_norm(self, layer: nn.Module) -> nn.Module:
        """The norm whose output the attention sublayer reads."""
        return getattr(layer, self.input_norm_attr)

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
