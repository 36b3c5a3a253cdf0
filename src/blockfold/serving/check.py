"""``python -m blockfold.serving.check MODEL --engine llamacpp|vllm``: exit 0 exactly when the
engine's greedy tokens equal transformers' on every prompt, printing both where they differ.

``scripts/serve-check.sh`` sets the engine's environment up and calls this.
"""

from __future__ import annotations

import argparse
import json
import os
import logging
import sys
import tempfile
from pathlib import Path

from blockfold.errors import BlockfoldError
from blockfold.models.compressed_tensors import QUANT_METHOD as COMPRESSED_TENSORS
from blockfold.serving import Agreement, read_prompts, run_engine, transformers_greedy

DEFAULT_PROMPTS = Path(os.environ.get("BLOCKFOLD_DATA", "../shared/data")) / "lambada_test.jsonl"


def agreement(model: str, engine: str, quant: str = "f16", prompts: Path = DEFAULT_PROMPTS, count: int = 20,
              prompt_tokens: int = 64, new_tokens: int = 16, threads: int = 2, gguf: Path | None = None,
              dtype: str = "auto") -> Agreement:
    """Greedy continuations of ``count`` prompts by transformers in float32 and by ``engine`` in ``dtype``
    (``auto``: float32, but bfloat16 for a compressed-tensors checkpoint in vLLM, whose CPU kernels for
    packed weights take no float32; the reference stays float32 so that its top-2 gaps say where the
    engine's rounding could choose another token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockfold.export import export_gguf
    from blockfold.models.sources import resolve_model_path

    folder = Path(resolve_model_path(model))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts, ids = read_prompts(Path(prompts), tokenizer, count, prompt_tokens)
    # NBL outputs ship their modeling code (and vLLM serves them through plugins/vllm)
    config = json.loads((folder / "config.json").read_text())
    remote = config.get("model_type", "").startswith("blockfold_")
    if dtype == "auto":
        packed = (config.get("quantization_config") or {}).get("quant_method") == COMPRESSED_TENSORS
        dtype = "bfloat16" if packed and engine == "vllm" else "float32"
    reference_model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", trust_remote_code=remote).eval()
    reference, gaps = transformers_greedy(reference_model, ids, new_tokens)
    del reference_model
    with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
        if engine == "llamacpp" and gguf is None:
            gguf = export_gguf(folder, Path(scratch) / "model.gguf", quant=quant)
        target = str(gguf) if engine == "llamacpp" else str(folder)
        result = run_engine(engine, {"model": target, "prompts": ids, "new_tokens": new_tokens, "threads": threads,
                                     "texts": texts, "trust_remote_code": remote, "dtype": dtype})
    expected_ids = [tokenizer(text)["input_ids"] for text in texts]
    tokenization = sum(a == b for a, b in zip(expected_ids, result["tokenized"]))
    speed = {key: result[key] for key in ("prefill_seconds", "decode_seconds", "prefill_tokens", "decode_tokens")}
    return Agreement(engine, reference, result["tokens"], tokenization, gaps, speed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serve-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="folder written by compress, HF folder, .gguf file or built-in name")
    parser.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    parser.add_argument("--quant", default="f16", help="GGUF type for llama.cpp (see blockfold export)")
    parser.add_argument("--gguf", type=Path, help="an exported GGUF file to check instead of exporting MODEL")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help=".jsonl ('text') or .txt prompts")
    parser.add_argument("--count", type=int, default=20, help="number of prompts")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="the engine's dtype (auto: float32; bfloat16 for compressed-tensors in vLLM)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="serve-check: %(message)s")
    try:
        found = agreement(args.model, args.engine, args.quant, args.prompts, args.count, new_tokens=args.new_tokens,
                          gguf=args.gguf, dtype=args.dtype)
    except BlockfoldError as error:
        print(f"serve-check: error: {error}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from blockfold.models.sources import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    for index, (mine, theirs) in enumerate(zip(found.reference, found.engine_tokens)):
        step = found.first_difference(index)
        if step is not None:
            print(f"prompt {index}: from token {step} (transformers' top-2 logit gap there: "
                  f"{found.gaps[index][step]:.4f})\n  transformers {mine} {tokenizer.decode(mine)!r}\n"
                  f"  {args.engine:>12} {theirs} {tokenizer.decode(theirs)!r}")
    print(f"{args.engine}: {found.matching}/{len(found.reference)} prompts give transformers' greedy tokens "
          f"({args.new_tokens} each); tokenization agrees on {found.tokenization_agrees}/{len(found.reference)}")
    return 0 if found.identical else 1


if __name__ == "__main__":
    sys.exit(main())
