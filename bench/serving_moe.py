"""Mixtures of experts in the engines (issue #45 item 3): does llama.cpp, does vLLM, give transformers'
greedy tokens for a compressed Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE?

    scripts/serve-check.sh smollm2-135m --engine llamacpp   # once: sets each engine's environment up
    .venv/bin/python bench/serving_moe.py --json bench/results/serving_moe.json

No mixture-of-experts checkpoint is available offline, so each family is a **random-weight** model of
small shapes built from its config (every block sparse, OLMoE without grouped queries as OLMoE itself, 4 experts, 2 per token, head size 64 so that
vLLM's CPU attention takes it, a byte-level BPE tokenizer trained here), saved, and compressed by
ReplaceMe (2 of its 6 blocks; the map folds into every expert's down-projection). For the original and
the compressed folder: greedy tokens of each engine against transformers (float32) on 20 LAMBADA
prompts (64 tokens, 16 new); llama.cpp runs the float32 GGUF export, vLLM the folder itself (float32).
This measures whether the engines compute what transformers computes, not quality.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, MixtralConfig, OlmoeConfig, PreTrainedTokenizerFast, Qwen2MoeConfig,
                          Qwen3MoeConfig)

import blockfold
from blockfold.api import provenance
from blockfold.data import Batch, CalibrationSet
from blockfold.errors import BlockfoldError
from blockfold.jsonfile import write_json
from blockfold.serving.check import DEFAULT_PROMPTS, agreement

log = logging.getLogger("bench.serving_moe")

SHAPES = dict(hidden_size=256, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2)
FAMILIES = {
    "mixtral": lambda: MixtralConfig(**SHAPES, num_local_experts=4),
    "olmoe": lambda: OlmoeConfig(**{**SHAPES, "num_key_value_heads": 4}, num_experts=4),  # as OLMoE: no GQA
    "qwen2_moe": lambda: Qwen2MoeConfig(**SHAPES, num_experts=4, moe_intermediate_size=64,
                                        shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPES, num_experts=4, moe_intermediate_size=64, head_dim=64,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}


def _tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin|>", eos_token="<|end|>")


def _calibration(tokenizer, texts: list[str], sequences: int = 16, length: int = 64) -> CalibrationSet:
    encoded = (tokenizer(text)["input_ids"] for text in texts)
    ids = torch.tensor([one[:length] for one in encoded if len(one) >= length][:sequences])
    batches = [Batch(ids[i:i + 4], torch.ones_like(ids[i:i + 4])) for i in range(0, len(ids), 4)]
    return CalibrationSet(batches, {"source": "lambada (prompts' file, documents 100-)", "sequences": len(ids)})


def build(family: str, work: Path, texts: list[str]) -> tuple[Path, Path]:
    """The random-weight original and its ReplaceMe output, saved with the tokenizer."""
    original, compressed = work / family, work / f"{family}-replaceme-2"
    torch.manual_seed(0)
    tokenizer = _tokenizer(texts)
    config = FAMILIES[family]()
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(original)
    tokenizer.save_pretrained(original)
    result = blockfold.compress(model, tokenizer, blockfold.ReplaceMe(blocks=2),
                                calibration=_calibration(tokenizer, texts[100:]))
    result.save(compressed)
    return original, compressed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--engines", default="llamacpp,vllm")
    parser.add_argument("--work", type=Path, default=Path(".serving-moe-work"))
    parser.add_argument("--json", default="bench/results/serving_moe.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    started = provenance(["bench/serving_moe.py", *sys.argv[1:]])
    import json

    texts = [json.loads(line)["text"] for line in DEFAULT_PROMPTS.read_text().splitlines()[:400]]
    rows = []
    for family in args.families.split(","):
        original, compressed = build(family, args.work, texts)
        for variant, folder in (("original", original), ("replaceme-2", compressed)):
            for engine in args.engines.split(","):
                row = {"family": family, "variant": variant, "engine": engine}
                try:
                    found = agreement(str(folder), engine, quant="f32")
                    row.update(matching=found.matching, prompts=len(found.reference),
                               tokenization=found.tokenization_agrees,
                               # a random model could repeat one token; this says how varied the output is
                               distinct_tokens=len({token for tokens in found.reference for token in tokens}),
                               smallest_gap_where_differs=min((found.gaps[i][found.first_difference(i)]
                                                               for i in range(len(found.reference))
                                                               if found.first_difference(i) is not None),
                                                              default=None))
                except (BlockfoldError, RuntimeError) as error:
                    row["error"] = str(error).splitlines()[-1][:300]
                log.info("%s", row)
                rows.append(row)
                write_json(args.json, {"provenance": started, "rows": rows})


if __name__ == "__main__":
    main()
