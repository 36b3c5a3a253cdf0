"""Registry of architecture adapters, keyed by ``config.model_type``."""

from __future__ import annotations

from blockfold.adapters.base import DecoderAdapter
from blockfold.errors import BlockfoldError

LLAMA_LIKE = DecoderAdapter(name="llama-like (pre-norm)", model_types=("llama", "mistral"))

QWEN = DecoderAdapter(
    name="qwen (pre-norm, sliding-window layer count)",
    model_types=("qwen2", "qwen3"),
    layer_count_config_fields=("max_window_layers",),
)

GEMMA_SANDWICH = DecoderAdapter(
    name="gemma (sandwich norms)",
    model_types=("gemma2", "gemma3_text"),
    post_attention_norm="post_attention_layernorm",
    pre_mlp_norm_attr="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
    norm_weight_offset=1.0,
)

#: model_type → adapter; a checkpoint with linearized sublayers ("blockfold_<base>") shares its base's adapter
ADAPTERS: dict[str, DecoderAdapter] = {
    prefix + model_type: adapter
    for adapter in (LLAMA_LIKE, QWEN, GEMMA_SANDWICH) for model_type in adapter.model_types
    for prefix in ("", "blockfold_")
}


def supported_model_types() -> list[str]:
    return sorted(t for t in ADAPTERS if not t.startswith("blockfold_"))


def get_adapter(model_or_config) -> DecoderAdapter:
    """The adapter for a model (or its config), or a clear error naming the supported architectures."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        raise BlockfoldError(
            f"unsupported architecture {model_type!r}: blockfold supports "
            f"{', '.join(supported_model_types())}; add an adapter in blockfold/adapters/ for others"
        )
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "DecoderAdapter", "get_adapter", "supported_model_types"]
