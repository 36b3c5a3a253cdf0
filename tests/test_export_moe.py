"""GGUF export of mixtures of experts: each family's experts stacked as llama.cpp's converter stacks them.

Random-weight tiny models (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE) compressed by ReplaceMe, whose map folds
into every expert's down-projection. transformers reads Qwen2-MoE and Qwen3-MoE GGUF files itself, so those
exports must give the compressed folder's logits; for every family the file holds exactly the tensors
llama.cpp's loader creates for its architecture, with their shapes. llama.cpp itself runs them in
``scripts/serve-check.sh`` (bench/serving.py's MoE rows). What llama.cpp's graphs compute otherwise
(dense blocks, other routing) is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import COMMON, random_calibration
from gguf import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, GGUFReader
from transformers import (AutoConfig, AutoModelForCausalLM, MixtralConfig, OlmoeConfig, PreTrainedTokenizerFast, Qwen2MoeConfig,
                          Qwen3MoeConfig)

import blockfold
from blockfold.cli import main
from blockfold.export import export_gguf
from blockfold.export.gguf import ARCHITECTURES
from blockfold.models.checkpoint import CheckpointReader

EXPERTS = dict(num_experts_per_tok=2)
#: every block sparse and routed as llama.cpp's graph for the family routes
SERVABLE = {
    "mixtral": lambda: MixtralConfig(**COMMON, **EXPERTS, num_local_experts=4),
    "olmoe": lambda: OlmoeConfig(**{**COMMON, "num_key_value_heads": 4}, **EXPERTS, num_experts=4),  # as OLMoE: no GQA
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, **EXPERTS, num_experts=4, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, **EXPERTS, num_experts=4, moe_intermediate_size=16, head_dim=8,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}
#: the families transformers' own GGUF loader reads back
READ_BY_TRANSFORMERS = {"qwen2_moe", "qwen3_moe"}


def _tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on a few sentences (llama.cpp's ``gpt2`` vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["experts route each token to two of four maps", "the router picks"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin|>", eos_token="<|end|>")


def _compressed(family: str, tmp_path: Path, tied: bool = False, config=None) -> Path:
    """A tiny random-weight mixture with 2 of its 6 blocks removed by ReplaceMe, saved with its tokenizer."""
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    config = config or SERVABLE[family]()
    config.vocab_size, config.tie_word_embeddings = len(tokenizer), tied
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = blockfold.compress(model, tokenizer, blockfold.ReplaceMe(blocks=2),
                                calibration=random_calibration(16, 24))
    return result.save(tmp_path / family)


def _llama_cpp_tensors(arch_name: str, blocks: int) -> set[str]:
    """Every tensor name (weight or bias) llama.cpp's architecture table lists for ``blocks`` blocks."""
    arch = next(arch for arch, name in MODEL_ARCH_NAMES.items() if name == arch_name)
    templates = [TENSOR_NAMES[tensor] for tensor in MODEL_TENSORS[arch]]
    stems = {template.format(bid=index) for template in templates for index in range(blocks)}
    return {f"{stem}.{kind}" for stem in stems for kind in ("weight", "bias")}


@pytest.mark.parametrize("family", sorted(SERVABLE))
def test_compressed_mixture_exports_its_experts_stacked(family, tmp_path):
    folder = _compressed(family, tmp_path)
    out = export_gguf(folder, tmp_path / f"{family}.gguf", quant="f32")
    reader = GGUFReader(out)
    arch = str(reader.fields["general.architecture"].contents())
    assert arch == MODEL_ARCH_NAMES[ARCHITECTURES[family].arch]
    fields = {name: field.contents() for name, field in reader.fields.items()}
    config = SERVABLE[family]()
    assert fields[f"{arch}.block_count"] == 4 and fields[f"{arch}.expert_count"] == 4
    assert fields[f"{arch}.expert_used_count"] == 2
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert set(tensors) <= _llama_cpp_tensors(arch, 4), set(tensors) - _llama_cpp_tensors(arch, 4)
    assert {f"blk.{index}.ffn_{kind}_exps.weight" for index in range(4) for kind in ("gate", "up", "down")} <= \
        set(tensors)
    width = getattr(config, "moe_intermediate_size", config.intermediate_size)
    # numpy order: (experts, rows, columns) as transformers' stacked experts are
    assert tensors["blk.0.ffn_down_exps.weight"].data.shape == (4, config.hidden_size, width)
    assert tensors["blk.3.ffn_gate_exps.weight"].data.shape == (4, width, config.hidden_size)
    saved = CheckpointReader(folder)
    prefix = "block_sparse_moe.experts.{}.w2" if family == "mixtral" else "mlp.experts.{}.down_proj"
    for layer in range(4):  # the stacks hold each expert's saved weights (the fold's among them), in order
        stacked = np.stack([saved.get(f"model.layers.{layer}.{prefix.format(e)}.weight").numpy() for e in range(4)])
        assert np.array_equal(tensors[f"blk.{layer}.ffn_down_exps.weight"].data, stacked)
    if family == "qwen2_moe":
        assert tensors["blk.0.ffn_gate_inp_shexp.weight"].data.shape == (config.hidden_size,)
        assert fields[f"{arch}.expert_shared_feed_forward_length"] == 48
    if family in READ_BY_TRANSFORMERS:
        # transformers' GGUF reader takes no expert widths (it would build the family's default sizes): the
        # folder's config, and every weight from the GGUF file
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
            exported = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32,
                                                            config=AutoConfig.from_pretrained(folder))(ids).logits
        assert torch.allclose(exported, expected, atol=1e-5), (exported - expected).abs().max()


def test_a_tied_head_is_written_where_llama_cpp_requires_one(tmp_path):
    """OLMoE's and Qwen2-MoE's loaders in llama.cpp want output.weight: a tied model gets a copy of its embeddings."""
    folder = _compressed("olmoe", tmp_path, tied=True)
    assert "lm_head.weight" not in CheckpointReader(folder).names()
    tensors = {tensor.name: tensor for tensor in GGUFReader(export_gguf(folder, tmp_path / "tied.gguf",
                                                                       quant="f32")).tensors}
    assert np.array_equal(tensors["output.weight"].data, tensors["token_embd.weight"].data)


@pytest.mark.parametrize("family, config, says", [
    ("qwen2_moe", lambda: Qwen2MoeConfig(**COMMON, **EXPERTS, num_experts=4, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=48, decoder_sparse_step=2),
     "are dense in a mixture of experts"),
    ("qwen3_moe", lambda: Qwen3MoeConfig(**COMMON, **EXPERTS, num_experts=4, moe_intermediate_size=16, head_dim=8,
                                         norm_topk_prob=False),
     "norm_topk_prob=False"),
    ("olmoe", lambda: OlmoeConfig(**{**COMMON, "num_key_value_heads": 4}, **EXPERTS, num_experts=4, clip_qkv=8.0),
     "clips q, k and v"),
    ("olmoe", lambda: OlmoeConfig(**COMMON, **EXPERTS, num_experts=4), "norms keys as wide as queries"),
])
def test_what_llama_cpp_computes_otherwise_is_refused_in_one_line(capsys, family, config, says, tmp_path):
    folder = _compressed(family, tmp_path, config=config())
    out = tmp_path / "x.gguf"
    assert main(["export", "--model", str(folder), "--out", str(out), "--quant", "f16"]) == 2
    error = capsys.readouterr().err
    assert says in error and "serve it with transformers or vLLM" in error and "Traceback" not in error
    assert not out.exists() and not list(tmp_path.glob("*.partial*"))


def test_k_quants_of_an_eight_expert_model_point_to_llama_quantize(capsys, tmp_path):
    folder = _compressed("mixtral", tmp_path, config=MixtralConfig(**COMMON, **EXPERTS, num_local_experts=8))
    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "k.gguf"), "--quant", "q4_k_m"]) == 2
    assert "llama-quantize" in capsys.readouterr().err
