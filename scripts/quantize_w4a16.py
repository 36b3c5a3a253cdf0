"""Quantize a float Hugging Face folder to W4A16 with llm-compressor, stored as compressed-tensors.

Run by ``scripts/quantize-w4a16.sh``, in llm-compressor's own environment (it pins transformers).
GPTQ (``--method gptq``, on ``--samples`` sequences of ``--length`` tokens of a .jsonl/.txt corpus) or
round to nearest (``rtn``, no data); 4-bit integers, symmetric, one scale per ``--group-size`` inputs;
the LM head stays in float. This builds the quantized inputs blockfold's benchmarks compress.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer


def calibration(tokenizer, corpus: Path, samples: int, length: int) -> Dataset:
    """The first ``samples`` documents of the .jsonl ``corpus`` at least ``length`` tokens long, cut to ``length``."""
    texts = (json.loads(line)["text"] for line in corpus.read_text().splitlines() if line.strip())
    encoded = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts)
    ids = [tokens[:length] for tokens in encoded if len(tokens) >= length][:samples]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * length for _ in ids]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="float Hugging Face folder")
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", choices=["gptq", "rtn"], default="gptq")
    parser.add_argument("--group-size", type=int, default=64, help="inputs per scale (it must divide every layer's inputs)")
    parser.add_argument("--corpus", type=Path, default=Path("../shared/data/c4_demo.jsonl"), help=".jsonl, one \"text\" per line")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=args.group_size, dynamic=False))
    modifier = GPTQModifier if args.method == "gptq" else QuantizationModifier
    recipe = modifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    dataset = calibration(tokenizer, args.corpus, args.samples, args.length) if args.method == "gptq" else None
    oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=args.length,
            num_calibration_samples=args.samples, shuffle_calibration_samples=False)
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
