"""A vLLM plugin that serves blockfold's NBL checkpoints (``model_type = "blockfold_<base>"``).

vLLM finds it through the ``vllm.general_plugins`` entry point and calls ``register`` in every
process it starts; the model classes are registered by name and imported only when a checkpoint
asks for one. This package is separate from blockfold because it is installed into vLLM's own
environment, whose pins (torch, transformers) blockfold's dependencies would break.
"""

from __future__ import annotations

#: the architectures blockfold writes into an NBL checkpoint's config, and the vLLM class each extends
ARCHITECTURES = ("BlockfoldLlamaForCausalLM", "BlockfoldMistralForCausalLM", "BlockfoldQwen2ForCausalLM",
                 "BlockfoldQwen3ForCausalLM", "BlockfoldGemma2ForCausalLM", "BlockfoldGemma3ForCausalLM")


def register() -> None:
    from vllm import ModelRegistry

    for name in ARCHITECTURES:
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"blockfold_vllm.models:{name}")
