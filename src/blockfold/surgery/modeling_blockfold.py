"""Modeling code for checkpoints whose attention sublayers (or whole blocks) were replaced by linear maps.

blockfold copies this file, unchanged, into every such checkpoint, so that
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` loads it on a machine without
blockfold. It therefore imports only torch and transformers and reads nothing but the config it is
given (never the working directory).

The checkpoint's config is the base architecture's config with ``model_type = "blockfold_<base>"`` (so
that a plain load without remote code fails loudly instead of silently building the original
attention with missing weights) and one extra field, ``blockfold_linearized``: a list of

    {"layer": i, "module": "self_attn", "replacement": "linear" | "zero",
     "identity": [norm attribute names], "zero": [sublayer attribute names]}

Each entry says, in the decoder layer's own attribute names, which sublayer becomes ``y = x Wᵀ + b``
(or nothing), which norms become the identity and which sublayers contribute zero. All knowledge of
where things are in a block lives in blockfold's adapters, which wrote the entries; this file only
executes them. A replaced sublayer reads no other token, so it keeps no KV cache.

A second field, ``blockfold_low_rank``, lists projections stored as two factors (SVD-LLM):

    {"layer": i, "module": "self_attn.q_proj", "rank": r}

The ``nn.Linear`` at that dotted path in the decoder layer becomes ``LowRankLinear``: ``x ↦ B (A x) + b``
with ``A`` (r × in) and ``B`` (out × r), whose weights are ``<module>.first.weight`` and
``<module>.second.weight`` (and ``.second.bias`` where the projection had a bias).

Another, ``blockfold_pruned`` (LLM-Pruner), lists projections whose weights lost rows or columns:

    {"layer": i, "module": "mlp.gate_proj", "shape": [out, in]}

The ``nn.Linear`` at that path is rebuilt at that shape (the attention keeps its heads' size and the
ratio of query to key-value heads, so only the number of heads changes).

A last one, ``blockfold_sliced`` (SliceGPT), describes a model whose residual stream was rotated and
sliced to ``hidden_size`` dimensions:

    {"head_map": bool, "rms_norms": [dotted names], "norm_eps": float, "head_bias": bool}

With ``head_map`` (tied embeddings), the final norm's output passes a square linear map without bias
(``norm.blockfold_head_map``) before the LM head, which the embeddings' tied weights then fit. The
norms named in ``rms_norms`` (a LayerNorm family's norms of the stream) become ``StreamRMSNorm`` with
epsilon ``norm_eps``: the rotated stream has no mean left to subtract. ``head_bias`` gives the LM head a bias (a LayerNorm's
bias before a head that had none).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

try:
    from transformers.cache_utils import DummyLayer
except ImportError:  # transformers < 5.20; vLLM's pinned one loads only the config classes from this file
    DummyLayer = None

LINEARIZED_FIELD = "blockfold_linearized"
LOW_RANK_FIELD = "blockfold_low_rank"
SLICED_FIELD = "blockfold_sliced"
PRUNED_FIELD = "blockfold_pruned"


def _cache_of(past_key_values, kwargs: dict):
    """The KV cache an attention sublayer is handed, under whichever name its family passes it
    (``past_key_values``; ``cache`` in transformers >= 5.22; ``layer_past`` in GPT-NeoX)."""
    for candidate in (past_key_values, kwargs.get("cache"), kwargs.get("layer_past")):
        if candidate is not None:
            return candidate
    return None


if DummyLayer is not None:
    class StatelessCacheSlot(DummyLayer):
        """The cache slot of a replaced sublayer: stores nothing, yet answers the cache's length.

        Models read the length of the whole cache from slot 0 (``cache.get_seq_length()``), and a plain
        ``DummyLayer`` has no length to give (transformers >= 5.25 raises), so this slot reports the
        length of the first slot that does store keys.
        """

        def __init__(self, cache):
            super().__init__()
            self.cache = cache  # a plain reference: a deep copy of the cache must point at the copy

        def get_seq_length(self) -> int:
            for layer in self.cache.layers:
                if not isinstance(layer, DummyLayer):
                    return layer.get_seq_length()
            return 0


def _release_cache_layer(cache, layer_idx: int) -> None:
    """Swap this layer's cache slot for one that stores nothing (a ``StatelessCacheSlot``).

    ``DynamicCache`` creates a slot per layer from the config; a slot that is never written costs no
    memory, but it would still be counted by the cache's own bookkeeping (masks, offloading, length),
    which skips ``DummyLayer`` slots. Done on the first call, before anything is cached.
    """
    if cache is None:
        return
    layers = getattr(cache, "layers", None)
    if DummyLayer is None:
        raise RuntimeError("generating with a KV cache through this checkpoint's linearized layers needs "
                           "transformers >= 5.20 (cache_utils.DummyLayer): upgrade transformers")
    if isinstance(layers, list) and layer_idx < len(layers) and not isinstance(layers[layer_idx], DummyLayer):
        layers[layer_idx] = StatelessCacheSlot(cache)


class LinearAttention(nn.Module):
    """Stands in for an attention sublayer: ``y = x Wᵀ + b`` for each token, no KV cache."""

    def __init__(self, hidden_size: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, hidden_states: torch.Tensor, *args, past_key_values=None, **kwargs):
        _release_cache_layer(_cache_of(past_key_values, kwargs), self.layer_idx)
        return self.linear(hidden_states), None


class ZeroAttention(nn.Module):
    """An attention sublayer that was dropped: contributes nothing, no parameters, no KV cache."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args, past_key_values=None, **kwargs):
        _release_cache_layer(_cache_of(past_key_values, kwargs), self.layer_idx)
        return torch.zeros_like(hidden_states), None


class ZeroMLP(nn.Module):
    """An MLP sublayer whose contribution the block's linear map already includes."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def linearize_layer(layer: nn.Module, entry: dict, hidden_size: int) -> None:
    """Apply one ``blockfold_linearized`` entry to a decoder layer, in place."""
    index = entry["layer"]
    if entry["replacement"] == "linear":
        replacement = LinearAttention(hidden_size, index)
    elif entry["replacement"] == "zero":
        replacement = ZeroAttention(index)
    else:
        raise ValueError(f"unknown replacement {entry['replacement']!r} for layer {index}")
    setattr(layer, entry["module"], replacement)
    for name in entry.get("identity", ()):
        setattr(layer, name, nn.Identity())
    for name in entry.get("zero", ()):
        setattr(layer, name, ZeroMLP())


class LowRankLinear(nn.Module):
    """A projection stored as two factors: ``second(first(x))``, ``rank`` wide in between."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.first = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.second = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(hidden_states))


def _owner_of(layer: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    """The module holding ``dotted`` (``self_attn.q_proj``) inside ``layer``, and the attribute's name there."""
    *path, name = dotted.split(".")
    for part in path:
        layer = getattr(layer, part)
    return layer, name


def factor_projection(layer: nn.Module, entry: dict, device=None) -> LowRankLinear:
    """Apply one ``blockfold_low_rank`` entry to a decoder layer, in place; returns the new module."""
    owner, name = _owner_of(layer, entry["module"])
    linear = getattr(owner, name)
    factored = LowRankLinear(linear.in_features, linear.out_features, entry["rank"], linear.bias is not None,
                             device=device or linear.weight.device, dtype=linear.weight.dtype)
    setattr(owner, name, factored)
    return factored


def resize_projection(layer: nn.Module, entry: dict, device=None) -> nn.Linear:
    """Apply one ``blockfold_pruned`` entry to a decoder layer, in place; returns the new module."""
    owner, name = _owner_of(layer, entry["module"])
    linear = getattr(owner, name)
    out_features, in_features = entry["shape"]
    resized = nn.Linear(in_features, out_features, bias=linear.bias is not None,
                        device=device or linear.weight.device, dtype=linear.weight.dtype)
    setattr(owner, name, resized)
    return resized


def _apply_head_map(norm: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The final norm's forward hook: its output mapped into the basis of the (tied) LM head."""
    return norm.blockfold_head_map(output)


class StreamRMSNorm(nn.Module):
    """A LayerNorm of the residual stream once the stream is rotated into directions orthogonal to the
    all-ones one (SliceGPT on a LayerNorm family): its mean is zero, so only the scaling is left."""

    def __init__(self, width: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = hidden_states.float() * torch.rsqrt(hidden_states.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(hidden_states.dtype) * self.weight


def attach_slicing(model: nn.Module, config, device=None) -> dict[str, list[nn.Module]]:
    """Give a model built from a ``blockfold_sliced`` config its head map, its stream norms without mean
    subtraction and its head's bias, where the config lists them; returns the new modules by kind."""
    entry = getattr(config, SLICED_FIELD, None) or {}
    added = {"head_map": [], "norms": [], "head_bias": []}
    width = config.hidden_size
    for name in entry.get("rms_norms", ()):
        parent, _, attr = name.rpartition(".")
        norm = StreamRMSNorm(width, entry["norm_eps"], device=device, dtype=model.get_submodule(name).weight.dtype)
        setattr(model.get_submodule(parent) if parent else model, attr, norm)
        added["norms"].append(norm)
    if entry.get("head_bias"):
        head = model.get_output_embeddings()
        head.bias = nn.Parameter(torch.zeros(head.out_features, device=device, dtype=head.weight.dtype))
        added["head_bias"].append(head)
    if entry.get("head_map"):
        norm = model.base_model.norm
        norm.blockfold_head_map = nn.Linear(width, width, bias=False, device=device, dtype=norm.weight.dtype)
        norm.register_forward_hook(_apply_head_map)
        added["head_map"].append(norm.blockfold_head_map)
    return added


class _Linearized:
    """Mixin for a causal-LM class: build the stock model, then apply the config's replacements."""

    def __init__(self, config):
        super().__init__(config)
        layers = self.base_model.layers
        for entry in getattr(config, LINEARIZED_FIELD, None) or ():
            linearize_layer(layers[entry["layer"]], entry, config.hidden_size)
        for entry in getattr(config, LOW_RANK_FIELD, None) or ():
            factor_projection(layers[entry["layer"]], entry)
        for entry in getattr(config, PRUNED_FIELD, None) or ():
            resize_projection(layers[entry["layer"]], entry)
        attach_slicing(self, config)


class BlockfoldLlamaConfig(LlamaConfig):
    model_type = "blockfold_llama"


class BlockfoldLlamaForCausalLM(_Linearized, LlamaForCausalLM):
    config_class = BlockfoldLlamaConfig


class BlockfoldMistralConfig(MistralConfig):
    model_type = "blockfold_mistral"


class BlockfoldMistralForCausalLM(_Linearized, MistralForCausalLM):
    config_class = BlockfoldMistralConfig


class BlockfoldQwen2Config(Qwen2Config):
    model_type = "blockfold_qwen2"


class BlockfoldQwen2ForCausalLM(_Linearized, Qwen2ForCausalLM):
    config_class = BlockfoldQwen2Config


class BlockfoldQwen3Config(Qwen3Config):
    model_type = "blockfold_qwen3"


class BlockfoldQwen3ForCausalLM(_Linearized, Qwen3ForCausalLM):
    config_class = BlockfoldQwen3Config


class BlockfoldGemma2Config(Gemma2Config):
    model_type = "blockfold_gemma2"


class BlockfoldGemma2ForCausalLM(_Linearized, Gemma2ForCausalLM):
    config_class = BlockfoldGemma2Config


class BlockfoldGemma3TextConfig(Gemma3TextConfig):
    model_type = "blockfold_gemma3_text"


class BlockfoldGemma3ForCausalLM(_Linearized, Gemma3ForCausalLM):
    config_class = BlockfoldGemma3TextConfig


class BlockfoldMixtralConfig(MixtralConfig):
    model_type = "blockfold_mixtral"


class BlockfoldMixtralForCausalLM(_Linearized, MixtralForCausalLM):
    config_class = BlockfoldMixtralConfig


class BlockfoldOlmoeConfig(OlmoeConfig):
    model_type = "blockfold_olmoe"


class BlockfoldOlmoeForCausalLM(_Linearized, OlmoeForCausalLM):
    config_class = BlockfoldOlmoeConfig


class BlockfoldQwen2MoeConfig(Qwen2MoeConfig):
    model_type = "blockfold_qwen2_moe"


class BlockfoldQwen2MoeForCausalLM(_Linearized, Qwen2MoeForCausalLM):
    config_class = BlockfoldQwen2MoeConfig


class BlockfoldQwen3MoeConfig(Qwen3MoeConfig):
    model_type = "blockfold_qwen3_moe"


class BlockfoldQwen3MoeForCausalLM(_Linearized, Qwen3MoeForCausalLM):
    config_class = BlockfoldQwen3MoeConfig


class BlockfoldPhi3Config(Phi3Config):
    model_type = "blockfold_phi3"


class BlockfoldPhi3ForCausalLM(_Linearized, Phi3ForCausalLM):
    config_class = BlockfoldPhi3Config


class BlockfoldCohereConfig(CohereConfig):
    model_type = "blockfold_cohere"


class BlockfoldCohereForCausalLM(_Linearized, CohereForCausalLM):
    config_class = BlockfoldCohereConfig


class BlockfoldPhiConfig(PhiConfig):
    model_type = "blockfold_phi"


class BlockfoldPhiForCausalLM(_Linearized, PhiForCausalLM):
    config_class = BlockfoldPhiConfig


class BlockfoldGPTNeoXConfig(GPTNeoXConfig):
    model_type = "blockfold_gpt_neox"


class BlockfoldGPTNeoXForCausalLM(_Linearized, GPTNeoXForCausalLM):
    config_class = BlockfoldGPTNeoXConfig


#: base ``model_type`` → (config class, causal-LM class) of its linearized form
LINEARIZED_CLASSES = {
    "llama": (BlockfoldLlamaConfig, BlockfoldLlamaForCausalLM),
    "mistral": (BlockfoldMistralConfig, BlockfoldMistralForCausalLM),
    "qwen2": (BlockfoldQwen2Config, BlockfoldQwen2ForCausalLM),
    "qwen3": (BlockfoldQwen3Config, BlockfoldQwen3ForCausalLM),
    "gemma2": (BlockfoldGemma2Config, BlockfoldGemma2ForCausalLM),
    "gemma3_text": (BlockfoldGemma3TextConfig, BlockfoldGemma3ForCausalLM),
    "phi3": (BlockfoldPhi3Config, BlockfoldPhi3ForCausalLM),
    "cohere": (BlockfoldCohereConfig, BlockfoldCohereForCausalLM),
    "phi": (BlockfoldPhiConfig, BlockfoldPhiForCausalLM),
    "gpt_neox": (BlockfoldGPTNeoXConfig, BlockfoldGPTNeoXForCausalLM),
    "mixtral": (BlockfoldMixtralConfig, BlockfoldMixtralForCausalLM),
    "olmoe": (BlockfoldOlmoeConfig, BlockfoldOlmoeForCausalLM),
    "qwen2_moe": (BlockfoldQwen2MoeConfig, BlockfoldQwen2MoeForCausalLM),
    "qwen3_moe": (BlockfoldQwen3MoeConfig, BlockfoldQwen3MoeForCausalLM),
}

for _config_class, _model_class in LINEARIZED_CLASSES.values():
    _config_class.register_for_auto_class("AutoConfig")
    _model_class.register_for_auto_class("AutoModelForCausalLM")
