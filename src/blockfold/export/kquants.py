"""llama.cpp's K-quant types Q4_K, Q5_K and Q6_K written from float weights, and llama.cpp's choice of
type per tensor for the K-quant file types (``q4_k_m``, ``q4_k_s``, ``q5_k_m``, ``q5_k_s``, ``q6_k``).

The ``gguf`` package reads these types but does not write them. The quantizers here follow the
algorithm of llama.cpp's reference quantizers (the ones ``llama-quantize`` runs without an importance
matrix), in float32 where llama.cpp computes in float and with its summation order, so that a tensor
comes out as ``llama-quantize`` would write it: per 32 values (Q4_K, Q5_K) a weighted least-squares
search over scale and minimum, per 16 values (Q6_K) a search over 19 trial scales, then the sub-block
scales quantized to 6 or 8 bits against one float16 scale per 256 values. They work on many blocks at
once, a bounded number of rows at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quant_shape_to_byte_shape

from blockfold.export.choices import K_FILE_TYPE_NAMES

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
QK_K = 256  # values per super-block, the unit of every K-quant type

#: the K-quant file types blockfold writes, by their ``llama-quantize`` names
K_FILE_TYPES: dict[str, LlamaFileType] = {name: LlamaFileType[f"MOSTLY_{name.upper()}"] for name in K_FILE_TYPE_NAMES}
_DEFAULT_TYPE = {"q4_k_m": Q.Q4_K, "q4_k_s": Q.Q4_K, "q5_k_m": Q.Q5_K, "q5_k_s": Q.Q5_K, "q6_k": Q.Q6_K}
#: what llama.cpp writes instead where a row is not a whole number of 256-value super-blocks
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}

#: super-blocks quantized at once: a few MB of float32 working arrays, small enough to stay in cache
_CHUNK_BLOCKS = 512
_F = np.float32
_EPS = _F(1e-15)  # llama.cpp's GROUP_MAX_EPS: a group whose largest magnitude is below it is all zero


def quantize_k(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``data`` in ``qtype`` (Q4_K, Q5_K or Q6_K) as the bytes of a GGUF tensor, shaped as
    ``gguf.quants.quant_shape_to_byte_shape(data.shape, qtype)``."""
    if qtype not in _QUANTIZERS:
        raise ValueError(f"quantize_k writes {', '.join(t.name for t in _QUANTIZERS)}, not {qtype.name}")
    data = np.asarray(data)
    if data.ndim == 0 or data.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} quantizes rows of a multiple of {QK_K} values; shape {data.shape} has "
                         "rows of another length (llama.cpp falls back to a 32-value type for such tensors)")
    blocks = data.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    quantize_blocks = _QUANTIZERS[qtype]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start:start + _CHUNK_BLOCKS].astype(np.float32)
        if not np.isfinite(chunk).all():
            raise ValueError(f"cannot quantize to {qtype.name}: the tensor holds NaN or infinite values")
        out[start:start + len(chunk)] = quantize_blocks(chunk)
    return out.reshape(quant_shape_to_byte_shape(data.shape, qtype))


def k_quant_type(file_type: str, gguf_name: str, shape: Sequence[int], layer: int | None, n_layers: int, *,
                 tied_embeddings: bool) -> GGMLQuantizationType:
    """The type ``llama-quantize`` gives the 2-D weight ``gguf_name`` in a ``file_type`` file.

    The rules of llama.cpp's ``llama_tensor_get_type`` that concern these file types in a dense
    (no experts) model other than Falcon, without an importance matrix or type overrides:

    - ``output.weight``, and ``token_embd.weight`` when the model ties its output to it
      (``tied_embeddings``: llama.cpp's test is that the file has no ``output.weight``): Q6_K, or Q8_0
      where its rows are not a multiple of 256;
    - ``attn_v`` (and a fused ``attn_qkv``, which current llama.cpp ranks with it): Q6_K in q4_k_m and
      q5_k_m on the layers that
      ``use_more_bits`` picks (the first and last eighth, and every third between); Q5_K in q4_k_s on
      layers 0-3;
    - ``ffn_down``: Q6_K in q4_k_m and q5_k_m on the ``use_more_bits`` layers; Q5_K in q4_k_s on the
      first eighth of the layers;
    - every other weight (``attn_q``, ``attn_k``, ``attn_output``, ``ffn_gate``, ``ffn_up``, an untied
      ``token_embd``): the file type's own type (Q4_K, Q5_K or Q6_K);
    - then, where a row is not a multiple of 256 values: Q4_K becomes Q5_0, Q5_K Q5_1, Q6_K Q8_0, and
      F16 where a row is not a multiple of 32 either.

    Left out as not applying to the models blockfold exports: the 70B rule (attn_v in Q5_K) and the
    rules for 8-expert and Falcon models. llama.cpp counts ``attn_v`` and ``ffn_down`` tensors in
    layer order, so the count is the ``layer`` index and ``n_layers`` the block count.
    """
    if file_type not in _DEFAULT_TYPE:
        raise ValueError(f"unknown K-quant file type {file_type!r}: choose one of {', '.join(_DEFAULT_TYPE)}")
    if len(shape) < 2:
        raise ValueError(f"{gguf_name}: llama.cpp keeps 1-D tensors in float32; only 2-D weights get a K-quant type")
    row = int(shape[-1])
    qtype = _DEFAULT_TYPE[file_type]
    if gguf_name == "output.weight" or (tied_embeddings and gguf_name == "token_embd.weight"):
        return Q.Q8_0 if row % QK_K else Q.Q6_K
    if "attn_v.weight" in gguf_name or "attn_qkv.weight" in gguf_name:
        index = _layer_of(gguf_name, layer, n_layers)
        if file_type in ("q4_k_m", "q5_k_m") and _use_more_bits(index, n_layers):
            qtype = Q.Q6_K
        elif file_type == "q4_k_s" and index < 4:
            qtype = Q.Q5_K
    elif "ffn_down" in gguf_name:
        index = _layer_of(gguf_name, layer, n_layers)
        if file_type in ("q4_k_m", "q5_k_m") and _use_more_bits(index, n_layers):
            qtype = Q.Q6_K
        elif file_type == "q4_k_s" and index < n_layers // 8:
            qtype = Q.Q5_K
    if row % QK_K:
        fallback = _FALLBACK[qtype]
        qtype = fallback if row % GGML_QUANT_SIZES[fallback][0] == 0 else Q.F16
        log.debug("%s: rows of %d values are not whole %d-value super-blocks: %s", gguf_name, row, QK_K, qtype.name)
    return qtype


def _layer_of(gguf_name: str, layer: int | None, n_layers: int) -> int:
    if layer is None or not 0 <= layer < n_layers:
        raise ValueError(f"{gguf_name}: its type depends on its layer, and layer {layer} is not in [0, {n_layers})")
    return layer


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of the layers that get more bits: the first and last eighth, and every third
    layer between."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


# ----------------------------------------------------------------------------------------------------
# Quantizers. Working arrays put the values of one sub-block along axis 0 and the sub-blocks along
# axis 1, so that every per-sub-block quantity is a vector and sums can run in llama.cpp's order.


def _sequential_sum(values: np.ndarray) -> np.ndarray:
    """The sum over axis 0 added one term after another, as llama.cpp's loops add them (numpy's own sum
    adds pairwise in some layouts, which rounds differently)."""
    total = values[0].copy()
    for term in values[1:]:
        total += term
    return total


def _sub_blocks(blocks: np.ndarray, size: int) -> np.ndarray:
    """``(n, 256)`` super-blocks as ``(size, n * 256 / size)``: value index first, sub-block second."""
    return np.ascontiguousarray(blocks.reshape(-1, size).T)


def _fit_scale_min(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                   nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's ``make_qkx2_quants`` on each column: levels ``L`` in ``0..nmax``, a scale and a
    minimum (returned negated, as the value the block stores) such that ``scale * L - min`` is close to
    ``x`` in weighted squares. Starts from the column's range, then tries ``nstep + 1`` level spacings,
    fitting scale and minimum by least squares for each and keeping the best."""
    lo, hi = x.min(axis=0), x.max(axis=0)
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    lo = np.minimum(lo, _F(0))
    flat = hi == lo
    nmax_f = _F(nmax)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = nmax_f / np.where(flat, _F(1), hi - lo)
        scale = _F(1) / iscale
        levels = np.clip(np.rint(iscale * (x - lo)), 0, nmax_f)
        diff = scale * levels + lo - x
        best = _sequential_sum(weights * (diff * diff))
        for step in range(nstep + 1):
            iscale = (_F(rmin) + _F(rdelta) * _F(step) + nmax_f) / (hi - lo)
            trial = np.clip(np.rint(iscale * (x - lo)), 0, nmax_f)
            weighted = weights * trial
            sum_l = _sequential_sum(weighted)
            sum_l2 = _sequential_sum(weighted * trial)
            sum_xl = _sequential_sum(weighted * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0  # a positive minimum is not stored: fit the scale alone
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, _F(0), this_min)
            diff = this_scale * trial + this_min - x
            error = _sequential_sum(weights * (diff * diff))
            better = (det > 0) & (error < best)
            levels = np.where(better, trial, levels)
            best = np.where(better, error, best)
            scale = np.where(better, this_scale, scale)
            lo = np.where(better, this_min, lo)
    levels[:, flat] = 0
    scale = np.where(flat, _F(0), scale)
    return levels, scale, -lo


def _q45_levels(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float,
                nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K and Q5_K (``quantize_row_q4_K_ref`` / ``q5_K_ref``): per 32 values a scale and minimum from
    ``_fit_scale_min`` weighted by ``rms + |x|``; both quantized to 6 bits against the super-block's
    largest (float16 ``d`` and ``dmin``); the values then quantized again with the stored scales.
    Returns the levels ``(n, 256)``, ``d``, ``dmin`` and the 12 packed scale bytes per super-block."""
    n = blocks.shape[0]
    x = _sub_blocks(blocks, 32)
    rms = np.sqrt(_sequential_sum(x * x) / _F(32))
    weights = rms + np.abs(x)
    levels, scales, mins = _fit_scale_min(x, weights, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), _F(0))
    max_min = np.maximum(mins.max(axis=1), _F(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))
        inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))
    # llama.cpp stores the rounded value in a uint8 before capping it at 63: a negative one wraps
    ls = np.minimum(np.rint(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    d = (max_scale / _F(63)).astype(np.float16)
    dmin = (max_min / _F(63)).astype(np.float16)
    step = (d.astype(np.float32)[:, None] * ls).reshape(-1)
    offset = (dmin.astype(np.float32)[:, None] * lm).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requantized = np.clip(np.rint((x + offset) / step), 0, _F(nmax))
    levels = np.where(step != 0, requantized, levels)  # a zero scale keeps the search's levels
    levels = levels.T.reshape(n, QK_K).astype(np.uint8)
    return levels, d, dmin, _pack_scale_min(ls, lm)


def _pack_scale_min(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit minima in 12 bytes: the first four of each whole, the last
    four split into low nibbles (bytes 8-11) and top two bits (bits 6-7 of bytes 0-7)."""
    packed = np.empty((ls.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return packed


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Block: d, dmin (float16), 12 scale bytes, 128 bytes of 4-bit levels: per 64 values, byte ``l``
    holds value ``l`` in its low nibble and value ``32 + l`` in its high one."""
    levels, d, dmin, scales = _q45_levels(blocks, 15, -1.0, 0.1, 20)
    halves = levels.reshape(-1, 4, 2, 32)
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Block: d, dmin, 12 scale bytes, 32 bytes of fifth bits (bit ``j`` of byte ``l`` for value
    ``32 j + l``), then the low four bits laid out as Q4_K's."""
    levels, d, dmin, scales = _q45_levels(blocks, 31, -0.5, 0.1, 15)
    high = (levels >> 4).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(high, axis=1)
    halves = (levels & 0xF).reshape(-1, 4, 2, 32)
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs], axis=1)


def _fit_symmetric(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``make_qx_quants`` with weights ``x**2`` on each column: levels in ``-nmax..nmax-1``
    (returned offset by ``nmax``) and a scale, the best in weighted squares of 19 trial spacings around
    ``nmax`` steps to the largest magnitude, each refitted by least squares."""
    columns = np.arange(x.shape[1])
    peak = x[np.abs(x).argmax(axis=0), columns]  # the first value of largest magnitude, with its sign
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, _F(1), peak)
    weights = x * x
    weighted_x = weights * x
    nmax_f = _F(nmax)

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        levels = np.clip(np.rint(iscale * x), -nmax_f, nmax_f - 1)
        return levels, _sequential_sum(weighted_x * levels), _sequential_sum(weights * levels * levels)

    levels, sum_lx, sum_l2 = trial(-nmax_f / peak)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(sum_l2 != 0, sum_lx / sum_l2, _F(0))
        best = scale * sum_lx
        for step in (*range(-9, 0), *range(1, 10)):
            candidate, sum_lx, sum_l2 = trial(-(nmax_f + _F(0.1) * _F(step)) / peak)
            better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
            levels = np.where(better, candidate, levels)
            scale = np.where(better, sum_lx / sum_l2, scale)
            best = np.where(better, scale * sum_lx, best)
    levels = levels + nmax_f
    levels[:, zero] = 0
    return levels, np.where(zero, _F(0), scale)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K (``quantize_row_q6_K_ref``): per 16 values a signed scale from ``_fit_symmetric``, the 16
    scales as int8 against the super-block's largest (float16 ``d``), then the values quantized again.
    Block: 128 bytes of low nibbles, 64 bytes of top two bits, 16 scales, d."""
    n = blocks.shape[0]
    x = _sub_blocks(blocks, 16)
    levels, scales = _fit_symmetric(x, 32)
    scales = scales.reshape(n, 16)
    max_scale = scales[np.arange(n), np.abs(scales).argmax(axis=1)]
    empty = np.abs(max_scale) < _EPS
    iscale = _F(-128) / np.where(empty, _F(1), max_scale)
    d = (_F(1) / iscale).astype(np.float16)
    sc = np.minimum(np.rint(iscale[:, None] * scales), _F(127)).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requantized = np.clip(np.rint(x / step), _F(-32), _F(31)) + _F(32)
    levels = np.where(step != 0, requantized, levels)
    levels = levels.T.reshape(n, 2, 4, 32).astype(np.uint8)  # two halves of 128, four rows of 32
    low = levels & 0xF
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
    high = (levels >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce(high, axis=2).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)
    out[empty] = 0  # llama.cpp writes a super-block of all-zero scales as zero bytes
    return out


_QUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q4_K: _quantize_q4_k, Q.Q5_K: _quantize_q5_k, Q.Q6_K: _quantize_q6_k,
}
