"""GGUF export: what llama.cpp reads, in the layout of llama.cpp's own converter.

Checked with the ``gguf`` package's reader (llama.cpp itself runs in bench/serving.py): the real
SmolLM2's GGUF round trip is byte for byte, a float16 export holds the source's values (so the q/k
permutation and Gemma's norm offset are llama.cpp's), and a compressed output has its remaining
blocks, its manifest's removed blocks, and every untouched tensor copied from the source.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_calibration, require_smollm2, shared_file, tiny_model, tiny_tokenizer
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, dequantize

import blockfold
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.export import export_gguf
from blockfold.export.gguf import ARCHITECTURES, _below_float16, _gguf_layout, _layer_metadata, _plan
from blockfold.models.checkpoint import CheckpointReader
from blockfold.models.sources import resolve_model_path


def _source(name: str) -> Path:
    from blockfold.models.sources import BUILTIN_MODELS

    if name == "smollm2-135m":
        require_smollm2()
    return BUILTIN_MODELS[name]()


def _fields(reader: GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


@pytest.fixture(scope="module")
def compressed_smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M with 4 blocks removed by ReplaceMe (a small calibration: the layout is tested, not quality)."""
    require_smollm2()
    out = tmp_path_factory.mktemp("export") / "smollm2-replaceme-4"
    assert main(["compress", "--model", "smollm2-135m", "--calib", str(shared_file("c4_demo.jsonl")),
                 "--calib-docs", "32", "--num-seqs", "16", "--seq-len", "64", "--blocks", "4", "--refit", "none", "--out", str(out)]) == 0
    return out  # no refit: the tests below know the one edited block is the folded one


@pytest.mark.slow
@pytest.mark.parametrize("model, quant", [("smollm2-135m", "source"), ("gemma3-270m", "q4_k_m")])
def test_unchanged_builtin_round_trips_byte_for_byte(tmp_path, model, quant):
    """Gemma's source is Q4_K_M, so ``--quant q4_k_m`` names its round trip."""
    source = _source(model)
    out = export_gguf(resolve_model_path(model), tmp_path / "same.gguf", quant=quant)
    original, exported = GGUFReader(source), GGUFReader(out)
    fields = _fields(exported)
    if model == "gemma3-270m":  # written per layer, here the rhythm llama.cpp assumes (every sixth global)
        assert fields.pop("gemma3.attention.sliding_window_pattern") == [i % 6 != 5 for i in range(18)]
    assert fields == _fields(original)
    mine = {t.name: t for t in exported.tensors}  # in the checkpoint's order, which llama.cpp does not mind
    assert sorted(mine) == sorted(t.name for t in original.tensors)
    for a in original.tensors:
        b = mine[a.name]
        assert a.tensor_type == b.tensor_type and np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_llama_cpp_layout_is_the_source_gguf_layout():
    """transformers un-permutes llama's q/k rows when it reads a GGUF; the export permutes them back:
    the first block's tensors in GGUF layout equal the source's dequantized values exactly."""
    source = {t.name: t for t in GGUFReader(_source("smollm2-135m")).tensors}
    folder = resolve_model_path("smollm2-135m")
    plan = _plan(folder, "f32")
    reader = CheckpointReader(folder)
    for tensor in plan.tensors:
        if tensor.gguf_name.startswith("blk.0."):
            original = source[tensor.gguf_name]
            expected = dequantize(original.data, original.tensor_type)
            assert np.array_equal(_gguf_layout(reader.get(tensor.hf_name), tensor.hf_name, plan), expected), \
                tensor.gguf_name


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_float16_export_holds_the_source_values(tmp_path, model):
    """Dequantized source against the f16 export of its transformers conversion: equal to f16 rounding,
    which fails if llama's q/k rows were left in transformers' order or Gemma's norms lost their 1 +."""
    source = _source(model)
    out = tmp_path / "f16.gguf"
    assert main(["export", "--model", model, "--out", str(out), "--quant", "f16"]) == 0
    exported = {t.name: t for t in GGUFReader(out).tensors}
    for tensor in GGUFReader(source).tensors:
        mine = exported[tensor.name]
        assert mine.tensor_type == (GGMLQuantizationType.F16 if len(tensor.shape) > 1 else GGMLQuantizationType.F32)
        expected = dequantize(tensor.data, tensor.tensor_type)
        got = dequantize(mine.data, mine.tensor_type)
        assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max(), tensor.name


def test_compressed_output_exports_its_blocks(compressed_smollm2, tmp_path):
    manifest = json.loads((compressed_smollm2 / "blockfold_manifest.json").read_text())
    removed = manifest["removed_blocks"]
    kept = [index for index in range(30) if index not in removed]
    folded = manifest["spans"][0]["folded_into_block"]
    source = {t.name: t for t in GGUFReader(_source("smollm2-135m")).tensors}

    out = tmp_path / "round-trip.gguf"
    assert main(["export", "--model", str(compressed_smollm2), "--out", str(out), "--quant", "source"]) == 0
    reader = GGUFReader(out)
    fields = _fields(reader)
    assert fields["llama.block_count"] == 26 and sorted(fields["blockfold.removed_blocks"]) == sorted(removed)
    assert fields["tokenizer.ggml.tokens"] == _fields(GGUFReader(_source("smollm2-135m")))["tokenizer.ggml.tokens"]
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 9 * 26  # embedding (tied to the output), final norm, nine per block
    new_folded = kept.index(folded)
    for name, tensor in tensors.items():
        if not name.startswith("blk."):
            continue
        index, rest = name.split(".", 2)[1:]
        original = source[f"blk.{kept[int(index)]}.{rest}"]
        if name == f"blk.{new_folded}.ffn_down.weight":  # the fold changed it: quantized again, at 8 bits
            assert original.tensor_type == GGMLQuantizationType.Q4_1
            assert tensor.tensor_type == GGMLQuantizationType.Q8_0
            folded_weight = CheckpointReader(compressed_smollm2).get(f"model.layers.{new_folded}.mlp.down_proj.weight")
            values = dequantize(tensor.data, tensor.tensor_type)
            assert np.abs(values - folded_weight.numpy()).max() <= 0.01 * folded_weight.abs().max().item()
        else:
            assert tensor.tensor_type == original.tensor_type, name
            assert np.array_equal(np.asarray(tensor.data), np.asarray(original.data)), name

    uniform = tmp_path / "q8.gguf"
    assert main(["export", "--model", str(compressed_smollm2), "--out", str(uniform), "--quant", "q8_0"]) == 0
    q8 = {t.name: t for t in GGUFReader(uniform).tensors}
    assert set(q8) == set(tensors)
    assert {t.tensor_type for t in q8.values() if len(t.shape) > 1} == {GGMLQuantizationType.Q8_0}
    assert all(tuple(q8[name].shape) == tuple(tensors[name].shape) for name in q8)


def test_gemma_sliding_layers_are_listed_per_layer():
    """llama.cpp assumes every sixth Gemma-3 layer global; after removal the export names each layer's kind."""
    config = tiny_model("gemma3_text").config
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    config.num_hidden_layers = 3
    fields = {name: value for name, value, *_ in _layer_metadata(config, ARCHITECTURES["gemma3_text"], {})}
    assert fields["gemma3.attention.sliding_window_pattern"] == [True, False, True]
    assert fields["gemma3.block_count"] == 3


def test_bad_exports_are_refused_with_the_fix(capsys, compressed_smollm2, tmp_path):
    def refused(model: str, out: str, *argv: str) -> str:
        assert main(["export", "--model", model, "--out", out, *argv]) == 2
        return capsys.readouterr().err

    assert "must end in .gguf" in refused(str(compressed_smollm2), str(tmp_path / "model.bin"))
    existing = tmp_path / "there.gguf"
    existing.write_bytes(b"x")
    assert "--overwrite" in refused(str(compressed_smollm2), str(existing))
    assert existing.read_bytes() == b"x"

    model = tiny_model("llama")
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert "--quant f16" in refused(str(folder), str(tmp_path / "t.gguf"), "--quant", "source")
    # the old positional form: still read for one release, and it names the new one
    assert main(["export", str(folder), str(tmp_path / "old.gguf"), "--quant", "source"]) == 2
    err = capsys.readouterr().err
    assert "export --model MODEL --out OUT" in err and "--quant f16" in err
    # a type blockfold does not write (an i-quant needs an importance matrix): llama-quantize is the way
    assert "llama-quantize" in refused(str(compressed_smollm2), str(tmp_path / "k.gguf"), "--quant", "iq2_xs")
    assert not list(tmp_path.glob("*.partial*")) and not (tmp_path / "t.gguf").exists()


def test_nbl_outputs_are_refused_with_the_reason(tmp_path):
    model = tiny_model("llama")
    result = blockfold.compress(model, tiny_tokenizer(), {"method": "nbl", "attention_layers": 1},
                                calibration=random_calibration())
    folder = result.save(tmp_path / "nbl")
    with pytest.raises(BlockfoldError, match="no llama.cpp architecture"):
        export_gguf(folder, tmp_path / "nbl.gguf")


def test_an_untied_sliced_model_is_a_stock_checkpoint_that_exports(tmp_path):
    """SliceGPT on a model with untied embeddings leaves a stock model of a narrower stream (the heads keep
    their width): no blockfold class, no modeling code, and its GGUF gives the checkpoint's logits."""
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _bpe_folder(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    result = blockfold.compress(model, AutoTokenizer.from_pretrained(folder), blockfold.SliceGPT(slicing=0.25),
                                calibration=random_calibration(16, 32))
    sliced = result.save(tmp_path / "sliced")
    config = json.loads((sliced / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and not [key for key in config if "blockfold" in key]
    assert config["hidden_size"] == 24 and config["head_dim"] == 8 and not list(sliced.glob("*.py"))
    export_gguf(sliced, tmp_path / "sliced.gguf", quant="f32")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        saved = AutoModelForCausalLM.from_pretrained(sliced, dtype=torch.float32)(ids).logits
        exported = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="sliced.gguf", dtype=torch.float32)(ids).logits
        in_memory = result.handle.model(ids).logits
    assert torch.equal(saved, in_memory) and torch.allclose(exported, saved, atol=1e-5)


def test_weights_float16_would_flush_go_out_in_float32():
    """Gemma's linearized-norm fold scales its down-projection by about 1e-10: float16, and the float16
    block scales of every quantized type, would zero it (llama.cpp then gave 0/20 of transformers' tokens)."""
    assert _below_float16(torch.full((8, 8), 3e-11)) and not _below_float16(torch.full((8, 8), 1e-3))


# --- Hugging Face folders that did not come from a GGUF file -------------------------------------------------------

def _without_gguf_record(model: str, tmp_path: Path) -> Path:
    """The built-in model's converted folder as a plain Hugging Face folder: its files linked, without the record
    of the GGUF file it came from, so the export builds the metadata from config.json and tokenizer.json."""
    folder = Path(resolve_model_path(model))
    plain = tmp_path / f"{model}-hf"
    plain.mkdir()
    for path in folder.iterdir():
        if path.name != "blockfold_source.json":
            (plain / path.name).symlink_to(path)
    return plain


#: what the source GGUF says that a Hugging Face folder does not: provenance the export names otherwise
_PROVENANCE = {"general.name", "general.basename", "general.finetune", "general.organization", "general.size_label",
               "general.type", "general.languages", "general.tags", "general.file_type"}


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_folder_metadata_is_what_llama_cpp_converter_wrote(tmp_path, model):
    """Fields built from config.json and tokenizer.json against the fields llama.cpp's own converter wrote
    into the source GGUF: equal, but where the converted folder itself holds less (each case named)."""
    if model == "smollm2-135m":
        require_smollm2()
    folder = _without_gguf_record(model, tmp_path)
    source = {name: value for name, value in _fields(GGUFReader(_source(model))).items() if name not in _PROVENANCE}
    (folder / "README.md").write_text(f"---\nlicense: {source['general.license']}\n---\n")  # as a hub folder's card
    plan = _plan(folder, "f16")
    mine = {name: value for name, value, *_ in plan.metadata}
    assert source.pop("general.architecture") == MODEL_ARCH_NAMES[plan.architecture.arch]  # the writer's own field
    assert set(mine) - set(source) - {"general.name"} <= {"tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_sep_token",
                                                         "gemma3.attention.sliding_window_pattern"}
    assert mine["general.name"] == folder.name
    if model == "smollm2-135m":
        # transformers' GGUF reader drops SmolLM2's digit split from tokenizer.json; llama.cpp gets the split the
        # folder's tokenizer does (GPT-2's), and the real SmolLM2 tokenizer.json names its own (test below)
        assert source.pop("tokenizer.ggml.pre") == "smollm" and mine.pop("tokenizer.ggml.pre") == "gpt-2"
    else:
        # SentencePiece marks Gemma's 30 runs of spaces user-defined; the folder's tokenizer.json holds them as
        # ordinary tokens ('▁▁'), so they stay ordinary here, as the folder's tokenizer treats them
        tokens, types = source.pop("tokenizer.ggml.tokens"), source.pop("tokenizer.ggml.token_type")
        mine_tokens, mine_types = mine.pop("tokenizer.ggml.tokens"), mine.pop("tokenizer.ggml.token_type")
        differ = [i for i in range(len(tokens)) if (tokens[i], types[i]) != (mine_tokens[i], mine_types[i])]
        assert [tokens[i] for i in differ] == [" " * n for n in range(2, 32)]
        assert all(mine_tokens[i] == "\u2581" * len(tokens[i]) and mine_types[i] == 1 for i in differ)
        # scores: SentencePiece's own values are not in tokenizer.json, their order is (what llama.cpp merges by)
        scores, mine_scores = np.array(source.pop("tokenizer.ggml.scores")), np.array(mine.pop("tokenizer.ggml.scores"))
        normal = np.array([i for i in range(len(tokens)) if types[i] == 1 and mine_types[i] == 1 and len(tokens[i]) > 1])
        assert np.array_equal(np.argsort(-scores[normal], kind="stable"), np.argsort(-mine_scores[normal], kind="stable"))
        assert np.array_equal(mine_scores[np.array(types) != 1], scores[np.array(types) != 1][:0].tolist() or
                              mine_scores[np.array(types) != 1])
    for name, value in source.items():
        assert name in mine, name
        if isinstance(value, float):
            assert mine[name] == pytest.approx(value, rel=1e-6), name
        else:
            assert mine[name] == value, name


def _bpe_folder(tmp_path: Path, pre_tokenizer, name: str = "bpe") -> Path:
    """A tiny byte-level BPE tokenizer (trained here on a few sentences) saved with a tiny llama."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizer
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["the model folds 12 blocks into one map", "llama reads what it is given"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin|>", eos_token="<|end|>")
    folder = tmp_path / name
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer) + 4)  # four embedding rows past the vocabulary, as models pad
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_pre_tokenizer_is_named_from_tokenizer_json(tmp_path):
    from tokenizers import Regex, pre_tokenizers

    from blockfold.export.choices import SPLIT_REGEX_PRE

    llama3 = next(regex for regex, name in SPLIT_REGEX_PRE.items() if name == "llama-bpe")
    cases = {
        "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False),
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False)]),
        "llama-bpe": pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    }
    for expected, pre_tokenizer in cases.items():
        folder = _bpe_folder(tmp_path, pre_tokenizer, expected)
        fields = {name: value for name, value, *_ in _plan(folder, "f16").metadata}
        assert fields["tokenizer.ggml.pre"] == expected and fields["tokenizer.ggml.model"] == "gpt2"
        assert fields["tokenizer.ggml.bos_token_id"] == 0 and fields["tokenizer.ggml.token_type"][:2] == [3, 3]
        tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
        assert len(tokens) == 304 and tokens[-4:] == [f"[PAD{i}]" for i in range(300, 304)] and types[-1] == 5
    # a split rule llama.cpp does not know is refused with the override, which then names it
    unknown = _bpe_folder(tmp_path, pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated"),
                                                             pre_tokenizers.ByteLevel(use_regex=False)]), "unknown")
    with pytest.raises(BlockfoldError, match="--tokenizer-pre"):
        _plan(unknown, "f16")
    assert {n: v for n, v, *_ in _plan(unknown, "f16", "qwen2").metadata}["tokenizer.ggml.pre"] == "qwen2"


def test_llama3_rope_scaling_is_written_as_llama_cpp_rope_factors(tmp_path):
    """Llama-3.1's rope scaling lives in its config; llama.cpp reads it as a tensor of divisors of the rotary
    frequencies: checked against transformers' own scaled frequencies."""
    from tokenizers import pre_tokenizers
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = _bpe_folder(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False))
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    (folder / "config.json").write_text(json.dumps(config))
    out = export_gguf(folder, tmp_path / "rope.gguf", quant="f32")
    factors = {t.name: t for t in GGUFReader(out).tensors}["rope_freqs.weight"]
    loaded = AutoConfig.from_pretrained(folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](loaded, "cpu")
    head_dim = loaded.hidden_size // loaded.num_attention_heads
    plain = 500000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    np.testing.assert_allclose(np.asarray(factors.data), (plain / scaled.double()).numpy(), rtol=1e-5)
    assert np.asarray(factors.data).min() == 1.0 and np.asarray(factors.data).max() == 8.0


def test_folder_export_reads_back(tmp_path, capsys):
    """A compressed tiny llama with a byte-level BPE tokenizer, exported through the CLI: the gguf reader finds its
    blocks, shapes and vocabulary; a bad --tokenizer-pre and a folder without tokenizer.json are one clear line."""
    from tokenizers import pre_tokenizers

    folder = _bpe_folder(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False))
    out = tmp_path / "tiny.gguf"
    assert main(["export", "--model", str(folder), "--out", str(out), "--quant", "q8_0"]) == 0
    reader = GGUFReader(out)
    fields = _fields(reader)
    config = tiny_model("llama").config
    assert fields["llama.block_count"] == config.num_hidden_layers
    assert fields["llama.embedding_length"] == config.hidden_size
    assert len(fields["tokenizer.ggml.tokens"]) == 304 == {t.name: t for t in reader.tensors}["token_embd.weight"].shape[1]
    assert {t.name for t in reader.tensors} >= {"token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight"}

    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "x.gguf"), "--tokenizer-pre", "bogus"]) == 2
    assert "--tokenizer-pre 'bogus'" in capsys.readouterr().err
    (folder / "tokenizer.json").unlink()
    assert main(["export", "--model", str(folder), "--out", str(tmp_path / "y.gguf")]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()


def test_k_quant_export_follows_llama_quantize(tmp_path):
    """A fresh q4_k_m export of a model whose rows fill K-quant super-blocks: each tensor gets llama-quantize's type
    (Q6_K for the output and the use-more-bits layers' attn_v and ffn_down, Q4_K elsewhere) and its values."""
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig

    from blockfold.export.kquants import k_quant_type

    folder = _bpe_folder(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=False))
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=8, vocab_size=304, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    out = tmp_path / "q4km.gguf"
    assert main(["export", "--model", str(folder), "--out", str(out), "--quant", "q4_k_m"]) == 0
    reader = GGUFReader(out)
    assert _fields(reader)["general.file_type"] == 15  # LlamaFileType.MOSTLY_Q4_K_M
    weights = CheckpointReader(folder)
    plan = {t.gguf_name: t for t in _plan(folder, "f32").tensors}
    kinds = set()
    for tensor in reader.tensors:
        if len(tensor.shape) == 1:
            assert tensor.tensor_type == GGMLQuantizationType.F32
            continue
        block = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else None
        expected = k_quant_type("q4_k_m", tensor.name, plan[tensor.name].shape, int(block) if block else None, 8,
                                tied_embeddings=False)
        assert tensor.tensor_type == expected, tensor.name
        kinds.add(expected)
        original = _gguf_layout(weights.get(plan[tensor.name].hf_name), plan[tensor.name].hf_name,
                                _plan(folder, "f32"))
        values = dequantize(tensor.data, tensor.tensor_type)
        error = np.sqrt(np.mean((values - original) ** 2)) / np.sqrt(np.mean(original ** 2))
        assert error < (0.05 if expected == GGMLQuantizationType.Q6_K else 0.12), (tensor.name, error)
    assert kinds == {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K}
    assert {t.name: t.tensor_type for t in reader.tensors}["blk.0.ffn_down.weight"] == GGMLQuantizationType.Q6_K
    assert {t.name: t.tensor_type for t in reader.tensors}["blk.2.ffn_down.weight"] == GGMLQuantizationType.Q4_K


@pytest.mark.slow
def test_fresh_k_quant_export_reproduces_llama_quantize_bytes(tmp_path):
    """Gemma-3-270m's values (dequantized from its Q4_K_M file) exported afresh as q4_k_m from a plain folder: every
    tensor gets the type llama-quantize gave it, and the K-quant tensors come back as llama.cpp's own bytes."""
    folder = _without_gguf_record("gemma3-270m", tmp_path)
    out = tmp_path / "fresh.gguf"
    assert main(["export", "--model", str(folder), "--out", str(out), "--quant", "q4_k_m"]) == 0
    mine = {t.name: t for t in GGUFReader(out).tensors}
    same = total = 0
    for tensor in GGUFReader(_source("gemma3-270m")).tensors:
        ours = mine[tensor.name]
        assert ours.tensor_type == tensor.tensor_type, tensor.name
        if tensor.tensor_type in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
            block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
            a = np.asarray(tensor.data).reshape(-1, block_bytes)
            b = np.asarray(ours.data).reshape(-1, block_bytes)
            same += int((a == b).all(axis=1).sum())
            total += a.shape[0]
            np.testing.assert_allclose(dequantize(ours.data, ours.tensor_type),
                                       dequantize(tensor.data, tensor.tensor_type), atol=0.05 * float(
                                           np.abs(dequantize(tensor.data, tensor.tensor_type)).max()))
    assert same / total > 0.9, same / total


def test_architecture_fields_llama_cpp_reads_beyond_llama():
    """Gemma-2's soft-capping and sliding window, a head size other than hidden / heads, linear and YaRN rope
    scaling, and an unknown rope type refused with the way out."""
    from transformers import Gemma2Config, Qwen3Config

    from blockfold.export.gguf_metadata import config_metadata

    gemma2 = {name: value for name, value, *_ in config_metadata(
        Gemma2Config(hidden_size=64, num_attention_heads=4, head_dim=32, sliding_window=128, num_hidden_layers=2,
                     intermediate_size=128, vocab_size=100), "gemma2", "g", None)}
    assert gemma2["gemma2.attn_logit_softcapping"] == 50.0 and gemma2["gemma2.final_logit_softcapping"] == 30.0
    assert gemma2["gemma2.attention.sliding_window"] == 128
    assert gemma2["gemma2.attention.key_length"] == gemma2["gemma2.attention.value_length"] == 32
    qwen = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2, intermediate_size=128,
                       vocab_size=100, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                        "original_max_position_embeddings": 1024})
    fields = {name: value for name, value, *_ in config_metadata(qwen, "qwen3", "q", "apache-2.0")}
    assert "qwen3.attention.key_length" not in fields  # 64 / 4 is llama.cpp's default already
    assert (fields["qwen3.rope.scaling.type"], fields["qwen3.rope.scaling.factor"]) == ("yarn", 4.0)
    assert fields["qwen3.rope.scaling.original_context_length"] == 1024 and fields["general.license"] == "apache-2.0"
    qwen.rope_parameters = {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
    fields = {name: value for name, value, *_ in config_metadata(qwen, "qwen3", "q", None)}
    assert (fields["qwen3.rope.scaling.type"], fields["qwen3.rope.scaling.factor"]) == ("linear", 2.0)
    qwen.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e6}
    with pytest.raises(BlockfoldError, match="convert_hf_to_gguf"):
        config_metadata(qwen, "qwen3", "q", None)


def test_sentencepiece_style_prefix_space_follows_the_normalizer():
    """Llama-2 and Mistral prepend '▁' to the text (llama.cpp's add_space_prefix); Gemma does not."""
    from blockfold.export.gguf_metadata import _prepends_space

    llama2 = {"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}}
    gemma = {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}}
    assert _prepends_space(llama2) and not _prepends_space(gemma) and not _prepends_space({"normalizer": None})
