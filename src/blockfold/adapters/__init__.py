"""Registry of architecture adapters, keyed by ``config.model_type``."""

from __future__ import annotations

import dataclasses

from blockfold.adapters.base import (DecoderAdapter, LayerScaleEncoderAdapter, MixtureOfExpertsAdapter, Projection,
                                     VisionEncoderAdapter)
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

PHI3 = DecoderAdapter(
    # fused qkv_proj and gate_up_proj change nothing here: ReplaceMe folds into down_proj, NBL replaces
    # the whole attention sublayer
    name="phi-3 (pre-norm, fused projections)",
    model_types=("phi3",),
)

# Parallel blocks: attention and MLP read the same residual input and are added to it together,
# h + attn(n(h)) + mlp(n'(h)). What the MLP adds is still exactly its output projection's output, so
# ReplaceMe's map folds into it as in a pre-norm block; the attention side of the residual is
# h + attn, the block's output less the MLP's contribution, as everywhere (see docs/adapters.md).
COHERE = DecoderAdapter(
    name="cohere (parallel attention and MLP on one LayerNorm)",
    model_types=("cohere",),
    pre_mlp_norm_attr="input_layernorm",
)

PHI = DecoderAdapter(
    name="phi (parallel attention and MLP on one LayerNorm)",
    model_types=("phi",),
    pre_mlp_norm_attr="input_layernorm",
    down_proj_attr="fc2",
    attention_output_attr="dense",
    final_norm_attr="final_layernorm",
)

GPT_NEOX = DecoderAdapter(
    name="gpt-neox (parallel residual, one LayerNorm per sublayer)",
    model_types=("gpt_neox",),
    decoder_attr="gpt_neox",
    attention_attr="attention",
    down_proj_attr="dense_4h_to_h",
    attention_output_attr="dense",
    final_norm_attr="final_layer_norm",
    head_width_from_hidden=True,
)

MIXTRAL_LIKE = MixtureOfExpertsAdapter(
    name="mixture of experts (pre-norm, every block sparse)",
    model_types=("mixtral", "olmoe"),
)

QWEN_MOE = MixtureOfExpertsAdapter(
    name="qwen mixture of experts (pre-norm, shared expert, dense layers listed)",
    model_types=("qwen2_moe", "qwen3_moe"),
    layer_count_config_fields=("max_window_layers",),
    layer_index_config_fields=("mlp_only_layers",),
)

# Vision encoders (ViT-family): patch tokens instead of text, LayerNorms, fc1/fc2 MLPs, no LM head.
VIT = VisionEncoderAdapter(
    name="vit (pre-norm image encoder)",
    model_types=("vit",),
    decoder_attr="",
    final_norm_attr="layernorm",
    attention_attr="attention",
    input_norm_attr="layernorm_before",
    pre_mlp_norm_attr="layernorm_after",
)

CLIP_VISION = VisionEncoderAdapter(
    name="clip / siglip vision tower (pre-norm image encoder)",
    model_types=("clip_vision_model",),
    decoder_attr="encoder",
    final_norm_attr="post_layernorm",
    attention_output_attr="out_proj",
    input_norm_attr="layer_norm1",
    pre_mlp_norm_attr="layer_norm2",
)

SIGLIP_VISION = dataclasses.replace(CLIP_VISION, model_types=("siglip_vision_model",), class_tokens=0)

DINOV2 = LayerScaleEncoderAdapter(
    name="dinov2 (pre-norm image encoder, layer scales)",
    model_types=("dinov2", "dinov2_with_registers"),
    decoder_attr="encoder",
    layers_attr="layer",
    final_norm_attr="layernorm",
    attention_attr="attention",
    input_norm_attr="norm1",
    pre_mlp_norm_attr="norm2",
)

#: model_type → adapter; a checkpoint with linearized sublayers ("blockfold_<base>") shares its base's adapter
ADAPTERS: dict[str, DecoderAdapter] = {
    prefix + model_type: adapter
    for adapter in (LLAMA_LIKE, QWEN, GEMMA_SANDWICH, PHI3, COHERE, PHI, GPT_NEOX, MIXTRAL_LIKE, QWEN_MOE, VIT, CLIP_VISION,
                    SIGLIP_VISION, DINOV2)
    for model_type in adapter.model_types
    for prefix in ("", "blockfold_")
}


def supported_model_types() -> list[str]:
    return sorted(t for t in ADAPTERS if not t.startswith("blockfold_"))


#: image-text dual encoders: blockfold compresses their vision tower in place (``models/multimodal.py``)
DUAL_ENCODERS = ("clip", "siglip")


def compressed_config(config):
    """The config of the network blockfold compresses: a multimodal wrapper's ``text_config`` (its
    language model), a dual encoder's ``vision_config`` (its image tower), else ``config`` itself."""
    if getattr(config, "model_type", None) in DUAL_ENCODERS and getattr(config, "vision_config", None) is not None:
        return config.vision_config
    text_config = getattr(config, "text_config", None)
    if text_config is None or getattr(config, "model_type", None) in ADAPTERS:
        return config
    return text_config


def get_adapter(model_or_config) -> DecoderAdapter:
    """The adapter for a model (or its config; a multimodal config's language model), or a clear error
    naming the supported architectures."""
    outer = getattr(model_or_config, "config", model_or_config)
    config = compressed_config(outer)
    model_type = getattr(config, "model_type", None)
    if model_type not in ADAPTERS:
        role = "vision tower of the dual encoder" if outer.model_type in DUAL_ENCODERS else "language model of the multimodal"
        inside = f" (the {role} {outer.model_type!r})" if config is not outer else ""
        raise BlockfoldError(
            f"unsupported architecture {model_type!r}{inside}: blockfold supports "
            f"{', '.join(supported_model_types())}, and multimodal checkpoints whose language model is one of them; "
            "add an adapter in blockfold/adapters/ for others (docs/adapters.md)"
        )
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "DUAL_ENCODERS", "DecoderAdapter", "MixtureOfExpertsAdapter", "Projection", "VisionEncoderAdapter", "get_adapter", "compressed_config", "supported_model_types"]
