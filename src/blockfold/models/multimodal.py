"""The network blockfold compresses inside a checkpoint of two: the language model of a multimodal
checkpoint (Gemma-3, LLaVA, Mistral-3, SmolVLM / Idefics3, ...), the vision tower of an image-text dual
encoder (CLIP, SigLIP).

transformers builds the first as a wrapper (``XForConditionalGeneration``) whose ``model`` holds a vision
encoder, a projector and the text decoder (``language_model`` or ``text_model``), with the LM head
beside it and the decoder's config as ``config.text_config``; the second as a ``CLIPModel`` /
``SiglipModel`` holding a ``vision_model`` of ``config.vision_config`` beside its text tower.
``compressed_view`` gives a plain model of the inner config (a causal LM, a ``CLIPVisionModel``) whose
modules and config *are* the wrapper's own objects, so adapters, pipelines and surgery see a model they
know, every edit lands in the wrapper, and the checkpoint is written from the wrapper (the other
network as it was), which the wrapper's class loads as before.
"""

from __future__ import annotations

from accelerate import init_empty_weights
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from blockfold.adapters import ADAPTERS, DUAL_ENCODERS, compressed_config
from blockfold.errors import BlockfoldError

#: where a wrapper's ``model`` keeps its text decoder, by transformers' naming
DECODER_ATTRS = ("language_model", "text_model")

#: files a checkpoint of two networks needs beside the weights for images and text to reach the model (a dual
#: encoder's handle carries its image processor, so its text tokenizer's files are copied too)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "spiece.model")


def is_multimodal(config) -> bool:
    return compressed_config(config) is not config


def is_dual_encoder(config) -> bool:
    return getattr(config, "model_type", None) in DUAL_ENCODERS


def auto_class(config):
    """The transformers auto class that builds a checkpoint of ``config``: with its LM head, or the
    bare model of an image encoder or a dual encoder."""
    if is_dual_encoder(config):
        return AutoModel
    if is_multimodal(config):
        return AutoModelForImageTextToText
    return AutoModel if is_vision(config) else AutoModelForCausalLM


def is_vision(config) -> bool:
    """Whether blockfold compresses an image encoder in ``config`` (on its own, or a dual encoder's tower)."""
    adapter = ADAPTERS.get(getattr(compressed_config(config), "model_type", None))
    return adapter is not None and adapter.is_vision


def compressed_view(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` itself for a model of one network; for a multimodal wrapper, a causal LM of its text
    config built around the wrapper's own decoder, LM head and text config; for a dual encoder, its own
    vision tower (no weight is copied)."""
    if not is_multimodal(model.config):
        return model
    if is_dual_encoder(model.config):
        return _vision_tower_view(model)
    text_config = model.config.text_config
    inner = model.base_model
    decoder = next((getattr(inner, attr) for attr in DECODER_ATTRS if hasattr(inner, attr)), None)
    if getattr(decoder, "config", None) is not text_config:
        raise BlockfoldError(f"cannot find the text decoder of {type(model).__name__} (looked for "
                             f"{' or '.join(DECODER_ATTRS)} under its base model): this multimodal layout is "
                             "not supported; compress its language model saved on its own")
    with init_empty_weights(include_buffers=False):
        view = AutoModelForCausalLM.from_config(text_config, dtype=model.dtype)
    setattr(view, view.base_model_prefix, decoder)
    view.set_output_embeddings(model.get_output_embeddings())
    view.config = text_config  # from_config may have copied it: edits must reach the wrapper's own
    view.generation_config = model.generation_config
    view.eval()
    view.requires_grad_(False)
    return view


def _vision_tower_view(model: PreTrainedModel) -> PreTrainedModel:
    """The dual encoder's own vision tower (transformers builds it as a ``CLIPVisionModel`` /
    ``SiglipVisionModel``), holding the wrapper's vision config itself so that edits reach the saved config."""
    tower = getattr(model, "vision_model", None)
    if not isinstance(tower, PreTrainedModel):
        raise BlockfoldError(f"cannot find the vision tower of {type(model).__name__} (looked for a vision_model): "
                             "this layout is not supported; compress its vision model saved on its own")
    tower.config = model.config.vision_config
    return tower
