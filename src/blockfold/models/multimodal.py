"""The language model inside a multimodal checkpoint (Gemma-3, LLaVA, Mistral-3, SmolVLM / Idefics3, ...).

transformers builds these as a wrapper (``XForConditionalGeneration``) whose ``model`` holds a vision
encoder, a projector and the text decoder (``language_model`` or ``text_model``), with the LM head
beside it and the decoder's config as ``config.text_config``. blockfold compresses the text decoder
in place: ``language_model_view`` gives a plain causal LM of the text config whose decoder, LM head
and config *are* the wrapper's own objects, so adapters, pipelines and surgery see a text model they
know, every edit lands in the wrapper, and the checkpoint is written from the wrapper (vision tower
and projector as they were), which the multimodal class loads as before.
"""

from __future__ import annotations

from accelerate import init_empty_weights
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from blockfold.adapters import ADAPTERS, language_config
from blockfold.errors import BlockfoldError

#: where a wrapper's ``model`` keeps its text decoder, by transformers' naming
DECODER_ATTRS = ("language_model", "text_model")

#: files a multimodal folder needs beside the weights and tokenizer for images to reach the model
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def is_multimodal(config) -> bool:
    return language_config(config) is not config


def auto_class(config):
    """The transformers auto class that builds a checkpoint of ``config``: with its LM head, or the
    bare encoder of an image model."""
    if is_multimodal(config):
        return AutoModelForImageTextToText
    return AutoModel if is_vision(config) else AutoModelForCausalLM


def is_vision(config) -> bool:
    adapter = ADAPTERS.get(getattr(config, "model_type", None))
    return adapter is not None and adapter.is_vision


def language_model_view(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` itself for a text model; for a multimodal wrapper, a causal LM of its text config
    built around the wrapper's own decoder, LM head and text config (no weight is copied)."""
    if not is_multimodal(model.config):
        return model
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
