"""vLLM's own model classes with the sublayers an NBL checkpoint replaced swapped out after building.

The checkpoint's config lists the replacements (``blockfold_linearized``: layer, sublayer attribute,
``linear`` or ``zero``, norms that become the identity, sublayers that contribute zero), in the
attribute names transformers and vLLM share for these families. A replaced attention's vLLM
``Attention`` is unregistered from the forward context, which is where vLLM collects the layers it
allocates KV cache for: a linearized layer holds none, as in transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

LINEARIZED_FIELD = "blockfold_linearized"


class LinearAttention(nn.Module):
    """``y = x Wᵀ + b`` for each token (the same parameter names as blockfold's modeling code)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.linear(hidden_states)


class ZeroAttention(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


class ZeroMLP(nn.Module):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


class IdentityNorm(nn.Module):
    """A norm that became the identity, in both of vLLM's call forms: ``norm(x)`` and the fused
    residual add ``norm(x, residual) -> (x + residual, x + residual)``."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return hidden_states
        total = hidden_states + residual
        return total, total


def _linearize(model: nn.Module, vllm_config: VllmConfig) -> None:
    config = vllm_config.model_config.hf_config
    if any(getattr(config, field, None) for field in ("blockfold_low_rank", "blockfold_sliced", "blockfold_pruned")):
        raise ValueError("this checkpoint stores projections as low-rank factors (SVD-LLM), slices its stream "
                         "(SliceGPT) or gives its blocks different widths (LLM-Pruner), which this "
                         "plugin does not build: serve it with transformers")
    context = vllm_config.compilation_config.static_forward_context
    for entry in getattr(config, LINEARIZED_FIELD, None) or ():
        layer = model.model.layers[entry["layer"]]
        replaced = getattr(layer, entry["module"])
        for module in replaced.modules():  # no KV cache: vLLM allocates it for what the context holds
            if isinstance(module, AttentionLayerBase):
                context.pop(module.layer_name, None)
        if entry["replacement"] == "linear":
            replacement = LinearAttention(config.hidden_size)
        elif entry["replacement"] == "zero":
            replacement = ZeroAttention()
        else:
            raise ValueError(f"unknown replacement {entry['replacement']!r} for layer {entry['layer']}")
        setattr(layer, entry["module"], replacement)
        for name in entry.get("identity", ()):
            setattr(layer, name, IdentityNorm())
        for name in entry.get("zero", ()):
            setattr(layer, name, ZeroMLP())


def _linearized(base: type) -> type:
    class Linearized(base):
        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs):
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
            with torch.device(next(self.parameters()).device):
                _linearize(self, vllm_config)

    Linearized.__name__ = Linearized.__qualname__ = f"Blockfold{base.__name__}"
    return Linearized


BlockfoldLlamaForCausalLM = _linearized(LlamaForCausalLM)
BlockfoldMistralForCausalLM = _linearized(MistralForCausalLM)
BlockfoldQwen2ForCausalLM = _linearized(Qwen2ForCausalLM)
BlockfoldQwen3ForCausalLM = _linearized(Qwen3ForCausalLM)
BlockfoldGemma2ForCausalLM = _linearized(Gemma2ForCausalLM)
BlockfoldGemma3ForCausalLM = _linearized(Gemma3ForCausalLM)
