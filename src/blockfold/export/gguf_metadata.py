"""llama.cpp's metadata for a Hugging Face folder that did not come from a GGUF file.

A GGUF file carries what llama.cpp needs besides the weights: the hyperparameters under the
architecture's own keys, and the tokenizer as arrays (tokens, types, merges or scores) with the name
of the pre-tokenizer whose split rules llama.cpp applies before BPE. This module derives both from
the folder's ``config.json`` and ``tokenizer.json``, so what llama.cpp tokenizes is what the folder's
own tokenizer does, and says which tokenizers it cannot express instead of guessing.

Two vocabularies are written:
- byte-level BPE (Llama-3, Qwen, SmolLM, GPT-2 style) as llama.cpp's ``gpt2`` model: tokens, merges,
  and the pre-tokenizer named by the split rule the tokenizer's own ``pre_tokenizer`` declares;
- SentencePiece-style BPE with byte fallback (Gemma, Llama-2, Mistral) as llama.cpp's ``llama``
  model. llama.cpp merges the adjacent pair whose joined token scores highest, where Hugging Face
  applies the lowest-ranked merge, so each token scores minus the rank of the first merge that makes
  it: the same order of merges.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFValueType, Keys, RopeScalingType, TokenType
from transformers import AutoTokenizer

from blockfold.errors import BlockfoldError
from blockfold.export.choices import PRE_TOKENIZERS, SPLIT_REGEX_PRE

V = GGUFValueType
Field = tuple[str, object, GGUFValueType, "GGUFValueType | None"]

_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def config_metadata(config, arch: str, name: str, license_name: str | None) -> list[Field]:
    """The hyperparameter fields llama.cpp reads for ``arch`` (block count excepted: the exporter
    writes it with the per-layer fields compression changes)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    fields: list[Field] = [
        (Keys.General.NAME, name, V.STRING, None),
        (Keys.General.QUANTIZATION_VERSION, GGML_QUANT_VERSION, V.UINT32, None),
        (Keys.LLM.CONTEXT_LENGTH.format(arch=arch), text.max_position_embeddings, V.UINT32, None),
        (Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), text.hidden_size, V.UINT32, None),
        (Keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch), text.intermediate_size, V.UINT32, None),
        (Keys.Attention.HEAD_COUNT.format(arch=arch), text.num_attention_heads, V.UINT32, None),
        (Keys.Attention.HEAD_COUNT_KV.format(arch=arch),
         getattr(text, "num_key_value_heads", None) or text.num_attention_heads, V.UINT32, None),
        (Keys.Attention.LAYERNORM_RMS_EPS.format(arch=arch), text.rms_norm_eps, V.FLOAT32, None),
    ]
    if license_name:
        fields.append((Keys.General.LICENSE, license_name, V.STRING, None))
    if head_dim != text.hidden_size // text.num_attention_heads:  # llama.cpp's default is hidden / heads
        fields += [(Keys.Attention.KEY_LENGTH.format(arch=arch), head_dim, V.UINT32, None),
                   (Keys.Attention.VALUE_LENGTH.format(arch=arch), head_dim, V.UINT32, None)]
    if arch == "llama":
        fields += [(Keys.LLM.VOCAB_SIZE.format(arch=arch), text.vocab_size, V.UINT32, None),
                   (Keys.Rope.DIMENSION_COUNT.format(arch=arch), head_dim, V.UINT32, None)]
    if getattr(text, "sliding_window", None) and arch in ("gemma2", "gemma3"):
        fields.append((Keys.Attention.SLIDING_WINDOW.format(arch=arch), text.sliding_window, V.UINT32, None))
    fields += _expert_fields(text, arch)
    for key, attribute in ((Keys.LLM.ATTN_LOGIT_SOFTCAPPING, "attn_logit_softcapping"),
                           (Keys.LLM.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping")):
        if getattr(text, attribute, None):
            fields.append((key.format(arch=arch), float(getattr(text, attribute)), V.FLOAT32, None))
    return fields + _rope_fields(text, arch)


def _expert_fields(text, arch: str) -> list[Field]:
    """A mixture of experts' counts and widths (llama.cpp reads an expert's width as the MLP's where
    the config has no separate one, as Mixtral and OLMoE do)."""
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    if not experts:
        return []
    fields: list[Field] = [(Keys.LLM.EXPERT_COUNT.format(arch=arch), experts, V.UINT32, None),
                           (Keys.LLM.EXPERT_USED_COUNT.format(arch=arch), text.num_experts_per_tok, V.UINT32, None)]
    if getattr(text, "moe_intermediate_size", None):
        fields.append((Keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch), text.moe_intermediate_size, V.UINT32,
                       None))
    if getattr(text, "shared_expert_intermediate_size", None):
        fields.append((Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch=arch),
                       text.shared_expert_intermediate_size, V.UINT32, None))
    return fields


def _rope_parameters(text) -> tuple[dict, dict | None]:
    """The global layers' rope parameters and, where they differ per layer type, the sliding ones."""
    parameters = getattr(text, "rope_parameters", None) or {}
    if "full_attention" in parameters:
        return parameters["full_attention"], parameters.get("sliding_attention")
    return parameters, None


def _rope_fields(text, arch: str) -> list[Field]:
    rope, sliding = _rope_parameters(text)
    fields: list[Field] = [(Keys.Rope.FREQ_BASE.format(arch=arch), float(rope.get("rope_theta", 10000.0)),
                            V.FLOAT32, None)]
    if sliding and arch == "gemma3" and float(sliding.get("rope_theta", 10000.0)) != 10000.0:
        # llama.cpp assumes Gemma-3's sliding layers rotate with base 10000 unless told
        fields.append((Keys.Rope.FREQ_BASE_SWA.format(arch=arch), float(sliding["rope_theta"]), V.FLOAT32, None))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return fields
    if kind == "linear":
        return fields + [(Keys.Rope.SCALING_TYPE.format(arch=arch), RopeScalingType.LINEAR.value, V.STRING, None),
                         (Keys.Rope.SCALING_FACTOR.format(arch=arch), float(rope["factor"]), V.FLOAT32, None)]
    if kind == "yarn":
        fields += [(Keys.Rope.SCALING_TYPE.format(arch=arch), RopeScalingType.YARN.value, V.STRING, None),
                   (Keys.Rope.SCALING_FACTOR.format(arch=arch), float(rope["factor"]), V.FLOAT32, None)]
        if rope.get("original_max_position_embeddings"):
            fields.append((Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch),
                           int(rope["original_max_position_embeddings"]), V.UINT32, None))
        return fields
    if kind == "llama3":  # written as the rope_freqs tensor (llama3_rope_factors)
        return fields
    raise BlockfoldError(f"rope scaling {kind!r} has no GGUF form in blockfold's export (linear, yarn and llama3 "
                         "do): export the model with llama.cpp's own convert_hf_to_gguf.py")


def llama3_rope_factors(config) -> np.ndarray | None:
    """Llama-3.1's frequency-dependent rope scaling, which llama.cpp reads as the divisor of each
    rotary frequency from a ``rope_freqs.weight`` tensor; None for other rope types."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope, _ = _rope_parameters(text)
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    base = float(rope.get("rope_theta", 10000.0))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    frequencies = base ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelengths = 2 * math.pi / frequencies
    smooth = (original / wavelengths - low) / (high - low)
    divisors = np.where(wavelengths < original / high, 1.0,
                        np.where(wavelengths > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return divisors.astype(np.float32)


def tokenizer_metadata(folder: Path, config, pre: str | None = None) -> list[Field]:
    """The tokenizer fields for the folder's ``tokenizer.json`` (see the module's docstring)."""
    spec_path = folder / "tokenizer.json"
    if not spec_path.is_file():
        raise BlockfoldError(f"{folder} has no tokenizer.json: GGUF export builds llama.cpp's vocabulary from the "
                             "fast tokenizer's file; save the tokenizer with transformers (AutoTokenizer ... "
                             "save_pretrained) into the folder first")
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise BlockfoldError(f"{folder}: the tokenizer is a {model.get('type')!r} model; GGUF export writes BPE "
                             "tokenizers (byte-level, or SentencePiece-style with byte fallback)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = text.vocab_size  # one token per embedding row, as llama.cpp requires
    if len(tokenizer) > size:
        raise BlockfoldError(f"{folder}: the tokenizer has {len(tokenizer)} tokens but the model embeds {size}: "
                             "the tokenizer does not belong to this model; save the model's own tokenizer with it")
    added = {entry["id"]: entry for entry in spec.get("added_tokens", [])}
    id_to_token = {index: token for token, index in model["vocab"].items()}
    id_to_token.update({index: entry["content"] for index, entry in added.items()})
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    if model.get("byte_fallback"):
        fields = _sentencepiece_vocabulary(id_to_token, added, merges, size, spec)
    else:
        fields = _byte_level_vocabulary(id_to_token, added, merges, size, pre or _pre_tokenizer(spec, folder))
    return fields + _special_tokens(tokenizer, config)


def _byte_level_vocabulary(id_to_token: dict, added: dict, merges: list[str], size: int, pre: str) -> list[Field]:
    tokens, types = [], []
    for index in range(size):
        token = id_to_token.get(index)
        if token is None:  # rows of the embedding past the tokenizer's vocabulary
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(token)
            types.append(TokenType.CONTROL if added[index]["special"] else TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(TokenType.NORMAL)
    return [(Keys.Tokenizer.MODEL, "gpt2", V.STRING, None), (Keys.Tokenizer.PRE, pre, V.STRING, None),
            (Keys.Tokenizer.LIST, tokens, V.ARRAY, V.STRING),
            (Keys.Tokenizer.TOKEN_TYPE, [int(kind) for kind in types], V.ARRAY, V.INT32),
            (Keys.Tokenizer.MERGES, merges, V.ARRAY, V.STRING),
            (Keys.Tokenizer.ADD_PREFIX, False, V.BOOL, None)]


def _sentencepiece_vocabulary(id_to_token: dict, added: dict, merges: list[str], size: int, spec: dict) -> list[Field]:
    first_merge: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1)
        first_merge.setdefault(left + right, rank)
    unmerged = len(merges)  # tokens no merge makes (single characters) score below every merged one
    tokens, scores, types = [], [], []
    for index in range(size):
        token = id_to_token.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            scores.append(-1000.0)
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(token)
            scores.append(-1000.0)
            types.append(TokenType.CONTROL if added[index]["special"] else TokenType.USER_DEFINED)
        elif _BYTE_TOKEN.match(token):
            tokens.append(token)
            scores.append(0.0)
            types.append(TokenType.BYTE)
        else:
            tokens.append(token)
            rank = first_merge.get(token)
            scores.append(-float(rank if rank is not None else unmerged + index))
            types.append(TokenType.NORMAL)
    return [(Keys.Tokenizer.MODEL, "llama", V.STRING, None), (Keys.Tokenizer.PRE, "default", V.STRING, None),
            (Keys.Tokenizer.LIST, tokens, V.ARRAY, V.STRING),
            (Keys.Tokenizer.SCORES, scores, V.ARRAY, V.FLOAT32),
            (Keys.Tokenizer.TOKEN_TYPE, [int(kind) for kind in types], V.ARRAY, V.INT32),
            (Keys.Tokenizer.ADD_PREFIX, _prepends_space(spec), V.BOOL, None)]


def _prepends_space(spec: dict) -> bool:
    """Whether the normalizer puts ``▁`` before the text (Llama-2, Mistral; Gemma does not)."""
    normalizer = spec.get("normalizer") or {}
    steps = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    return any(step.get("type") == "Prepend" and step.get("prepend") == "\u2581" for step in steps)


def _pre_tokenizer(spec: dict, folder: Path) -> str:
    """llama.cpp's name for the split rule the tokenizer's ``pre_tokenizer`` declares."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
            and steps[1].get("use_regex", True)):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in SPLIT_REGEX_PRE:
            return SPLIT_REGEX_PRE[regex]
    raise BlockfoldError(f"{folder}: llama.cpp has no pre-tokenizer blockfold can match to this tokenizer's "
                         f"({json.dumps(pre)[:300]}): pass --tokenizer-pre with llama.cpp's name for it "
                         f"(blockfold knows {', '.join(PRE_TOKENIZERS)})")


def _special_tokens(tokenizer, config) -> list[Field]:
    """Special token ids (the tokenizer's, else the config's), whether the tokenizer adds BOS or EOS
    to a text, and its chat template."""
    fields: list[Field] = []
    for key, attribute in ((Keys.Tokenizer.BOS_ID, "bos_token_id"), (Keys.Tokenizer.EOS_ID, "eos_token_id"),
                           (Keys.Tokenizer.UNK_ID, "unk_token_id"), (Keys.Tokenizer.PAD_ID, "pad_token_id")):
        value = getattr(tokenizer, attribute, None)
        if value is None:
            value = getattr(config, attribute, None)
        if isinstance(value, list):  # generation configs list several end tokens; the first is the EOS
            value = value[0] if value else None
        if value is not None:
            fields.append((key, int(value), V.UINT32, None))
    probe = tokenizer("a")["input_ids"]
    fields += [(Keys.Tokenizer.ADD_BOS, bool(probe and probe[0] == tokenizer.bos_token_id), V.BOOL, None),
               (Keys.Tokenizer.ADD_EOS, bool(probe and probe[-1] == tokenizer.eos_token_id), V.BOOL, None),
               (Keys.Tokenizer.ADD_SEP, False, V.BOOL, None)]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        fields.append((Keys.Tokenizer.CHAT_TEMPLATE, template, V.STRING, None))
    return fields
