"""The names ``blockfold export`` accepts, without the libraries that write them (so ``--help`` stays fast)."""

from __future__ import annotations

#: tensor types written for every tensor alike (gguf's GGMLQuantizationType names, lower case)
QUANT_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
#: llama-quantize's K-quant file types (gguf's LlamaFileType names without MOSTLY_, lower case)
K_FILE_TYPE_NAMES = ("q4_k_m", "q4_k_s", "q5_k_m", "q5_k_s", "q6_k")
#: keep the source GGUF's type per tensor (only for models that came from a GGUF file)
SOURCE = "source"

#: the pre-tokenizer split rules llama.cpp implements, by the name a GGUF file gives them, as the
#: ``Split`` regex a tokenizer.json declares for them (followed by a byte-level step without regex)
SPLIT_REGEX_PRE = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}
#: names ``--tokenizer-pre`` accepts: the split rules above, GPT-2's own regex, and GPT-2's regex
#: after every digit is split off (SmolLM, StarCoder)
PRE_TOKENIZERS = ("gpt-2", "smollm", *SPLIT_REGEX_PRE.values())
