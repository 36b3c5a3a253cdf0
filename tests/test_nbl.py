"""NBL, DROP-attn and SLEB on tiny random models: exact replacement, known-linear attention recovered,
KV cache sized to the kept attention layers, remote-code checkpoints reloaded without blockfold."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import handle_of, random_calibration, stream, tiny_model, tiny_tokenizer
from transformers import Qwen2Config

import blockfold
from blockfold.adapters import get_adapter
from blockfold.errors import BlockfoldError
from blockfold.estimate import fit_lmmse
from blockfold.eval.speed import kv_cache_bytes, kv_cache_bytes_per_layer, parameter_counts
from blockfold.methods.sleb import candidate_losses
from blockfold.models import load_model
from blockfold.select import cca_bound, nmse, score_layers
from blockfold.stats import SublayerLinearity
from blockfold.surgery import LINEARIZED_FIELD, remove_blocks

IDS = torch.randint(4, 96, (2, 20), generator=torch.Generator().manual_seed(7))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _with_linear_maps(model, maps: dict[int, tuple[torch.Tensor, torch.Tensor]], target: str):
    """Reference: the unmodified model with each chosen sublayer's output overwritten by ``x Wᵀ + b``
    through hooks, computed here independently of blockfold's replacement modules."""
    adapter = get_adapter(model)
    handles, inputs = [], {}
    for index, (weight, bias) in maps.items():
        layer = adapter.layers(model)[index]
        if target == "attention":
            def keep(module, args, output, index=index):
                inputs[index] = output
            def replace(module, args, output, index=index, weight=weight, bias=bias):
                value = inputs[index] @ weight.T.float() + bias.float()
                return (value, *output[1:]) if isinstance(output, tuple) else value
            handles.append(adapter.input_norm(layer).register_forward_hook(keep))
            handles.append(adapter.attention_contribution_module(layer).register_forward_hook(replace))
        else:
            def replace_block(module, args, kwargs, output, weight=weight, bias=bias):
                hidden = args[0] if args else kwargs["hidden_states"]
                return hidden + hidden @ weight.T.float() + bias.float()
            handles.append(layer.register_forward_hook(replace_block, with_kwargs=True))
    try:
        return _logits(model)
    finally:
        for handle in handles:
            handle.remove()


def _statistics(model, calibration, target: str):
    observer = SublayerLinearity(model.config.num_hidden_layers, target)
    stream(model, calibration, [observer])
    return observer.finalize()


@pytest.mark.parametrize("target", ["attention", "block"])
def test_replaced_sublayer_computes_exactly_its_lmmse_map(arch, target, tokenizer):
    model = tiny_model(arch)
    calibration = random_calibration(num_sequences=16, length=32)
    statistics = _statistics(model, calibration, target)
    method, budget = ("nbl", "attention_layers") if target == "attention" else ("nbl-block", "blocks")
    result = blockfold.compress(model, tokenizer, {"method": method, budget: 2}, calibration=calibration)
    layers = result.manifest["replaced"]["layers"]
    reference = _with_linear_maps(tiny_model(arch), {i: fit_lmmse(statistics[i])[:2] for i in layers}, target)
    assert len(layers) == 2 and type(model).__name__.startswith("Blockfold")
    assert (_logits(model) - reference).abs().max() < 1e-4
    assert result.manifest["parameters"] < result.manifest["original_parameters"]


def _qwen_with_linear_attention() -> torch.nn.Module:
    """Layers 3-5 attend only to the current token (sliding window 1), so their attention is exactly
    ``o_proj(v_proj(x))``: linear. Layers 0-2 attend to the whole prefix."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         use_sliding_window=True, sliding_window=1, max_window_layers=3, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_truly_linear_attention_is_found_and_recovered(tokenizer):
    model = _qwen_with_linear_attention()
    assert model.config.layer_types == ["full_attention"] * 3 + ["sliding_attention"] * 3
    calibration = random_calibration(num_sequences=16, length=32)
    statistics = _statistics(model, calibration, "attention")
    for index in (3, 4, 5):
        assert cca_bound(statistics[index]) < 1e-5 and nmse(statistics[index]) < 1e-8
    for index in (0, 1, 2):
        assert cca_bound(statistics[index]) > 1.0
    expected = _logits(model)
    attention = model.model.layers[4].self_attn
    heads = model.config.num_attention_heads // model.config.num_key_value_heads
    v = attention.v_proj.weight.view(model.config.num_key_value_heads, -1, 32).repeat_interleave(heads, 0).reshape(-1, 32)
    true_weight, true_bias = attention.o_proj.weight @ v, attention.o_proj.weight @ attention.v_proj.bias.view(
        model.config.num_key_value_heads, -1).repeat_interleave(heads, 0).reshape(-1)
    for criterion in ("cca", "nmse", "stream"):  # all criteria of linearity see it; cosine measures size
        assert score_layers(statistics, criterion)[3:] == pytest.approx([0, 0, 0], abs=1e-5)
    result = blockfold.compress(model, tokenizer, {"method": "nbl", "attention_layers": 3, "linearity_criterion": "cca"},
                                calibration=calibration)
    assert result.manifest["replaced"]["layers"] == [3, 4, 5]
    linear = model.model.layers[4].self_attn.linear
    assert torch.allclose(linear.weight, true_weight, atol=1e-4) and torch.allclose(linear.bias, true_bias, atol=1e-4)
    assert (_logits(model) - expected).abs().max() < 1e-4


def test_kv_cache_shrinks_exactly_to_the_kept_attention_layers(arch, tokenizer):
    model = tiny_model(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the cache passed under the keyword transformers expects
        before = kv_cache_bytes_per_layer(model, 40)
    result = blockfold.compress(model, tokenizer, {"method": "nbl", "attention_layers": 2}, calibration=random_calibration())
    replaced = result.manifest["replaced"]["layers"]
    assert kv_cache_bytes_per_layer(model, 40) == [0 if i in replaced else b for i, b in enumerate(before)]
    if len(set(before)) == 1:
        assert kv_cache_bytes(model, 40) * 6 == sum(before) * 4  # full attention everywhere: exactly 4/6


@pytest.mark.parametrize("replacement", ["linear", "zero"])
def test_generation_with_a_kv_cache_through_a_replaced_first_layer_equals_generation_without(arch, replacement):
    """Layer 0 is where the cache reads the sequence length from: a replaced layer 0 that left its
    slot empty would restart the positions at every step (the cache reaches attention as
    ``past_key_values``, ``cache`` or ``layer_past`` depending on the family and version)."""
    from blockfold.surgery import replace_sublayers

    model = tiny_model(arch)
    handle = handle_of(model, tiny_tokenizer())
    adapter = handle.adapter
    entries = [adapter.attention_replacement(index, replacement) for index in (0, 3)]
    generator = torch.Generator().manual_seed(5)
    maps = {index: (torch.eye(32) + 0.1 * torch.randn(32, 32, generator=generator), torch.zeros(32)) for index in (0, 3)}
    replace_sublayers(handle, entries, maps if replacement == "linear" else None)
    ids = torch.tensor([[5, 17, 33, 8, 61, 20]])
    cached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    uncached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("replacement", ["linear", "zero"])
def test_a_hand_written_decode_loop_through_a_replaced_first_layer_equals_a_forward_without_cache(arch, replacement):
    """``generate`` hands the model its positions; a caller's own loop over ``model(token,
    past_key_values=cache)`` lets the model read them from the cache's slot 0, which a replaced layer 0
    emptied (transformers 5.25 raised there)."""
    from transformers import DynamicCache

    from blockfold.surgery import replace_sublayers

    model = tiny_model(arch)
    handle = handle_of(model, tiny_tokenizer())
    entries = [handle.adapter.attention_replacement(index, replacement) for index in (0, 3)]
    generator = torch.Generator().manual_seed(6)
    maps = {index: (torch.eye(32) + 0.1 * torch.randn(32, 32, generator=generator), torch.zeros(32)) for index in (0, 3)}
    replace_sublayers(handle, entries, maps if replacement == "linear" else None)
    ids = IDS[:1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        stepwise = [model(ids[:, :12], past_key_values=cache, use_cache=True).logits]
        for position in range(12, ids.shape[1]):
            stepwise.append(model(ids[:, position:position + 1], past_key_values=cache, use_cache=True).logits)
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(torch.cat(stepwise, dim=1), _logits(model, ids), rtol=1e-4, atol=1e-4)


def test_drop_attention_drops_the_attention_layers_that_do_nothing(tokenizer):
    model = tiny_model("llama")
    with torch.no_grad():
        for index in (2, 4):
            model.model.layers[index].self_attn.o_proj.weight.zero_()
    expected = _logits(model)
    dropped_params = sum(p.numel() for p in model.model.layers[2].self_attn.parameters())
    before = parameter_counts(model)["parameters"]
    result = blockfold.compress(model, tokenizer, {"method": "drop-attn", "attention_layers": 2},
                                calibration=random_calibration())
    assert result.manifest["replaced"] == {"target": "attention", "layers": [2, 4], "replacement": "zero"}
    assert (_logits(model) - expected).abs().max() < 1e-5
    assert parameter_counts(model)["parameters"] == before - 2 * dropped_params


def test_greedy_recomputes_statistics_after_each_replacement(tokenizer):
    model = tiny_model("llama")
    result = blockfold.compress(model, tokenizer, {"method": "nbl", "attention_layers": 3, "greedy": True},
                                calibration=random_calibration())
    steps = result.manifest["selection"]["greedy_steps"]
    assert [len(step["chosen"]) for step in steps] == [1, 1, 1]
    assert sorted(sum((step["chosen"] for step in steps), [])) == result.manifest["replaced"]["layers"]
    replaced_first = steps[0]["chosen"][0]
    # the second pass sees the replaced layer as its linear map: its NMSE is then zero up to rounding
    assert steps[1]["scores"]["nmse"][replaced_first] < 1e-6


def test_removing_blocks_renumbers_linearized_layers(tokenizer):
    model = tiny_model("llama")
    blockfold.compress(model, tokenizer, {"method": "nbl", "attention_layers": 2}, calibration=random_calibration())
    layers = [entry["layer"] for entry in getattr(model.config, LINEARIZED_FIELD)]
    removed = min(set(range(6)) - set(layers))
    remove_blocks(model, get_adapter(model), [removed])
    expected = [i - (i > removed) for i in layers]
    assert [entry["layer"] for entry in getattr(model.config, LINEARIZED_FIELD)] == expected
    assert all(model.model.layers[i].self_attn.layer_idx == i for i in expected)
    model.generate(IDS[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)


# -- SLEB --------------------------------------------------------------------------------------

def test_sleb_candidate_scores_equal_the_perplexity_of_each_pruned_model():
    model = tiny_model("gemma3_text")
    calibration = random_calibration(num_sequences=4, length=16)
    adapter = get_adapter(model)
    scores = candidate_losses(handle_of(model), list(calibration), [1, 3, 5])
    for block, score in scores.items():
        pruned = tiny_model("gemma3_text")
        remove_blocks(pruned, adapter, [block])
        nll, count = 0.0, 0
        for batch in calibration:
            logits = _logits(pruned, batch.input_ids)
            nll += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                           batch.input_ids[:, 1:].reshape(-1), reduction="sum"))
            count += batch.input_ids[:, 1:].numel()
        assert score == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_sleb_removes_the_blocks_that_do_nothing(tokenizer):
    """Calibration text sampled from the model itself: in expectation no change to the model predicts
    it better (KL ≥ 0), so removing any block that does something raises its perplexity."""
    from blockfold.data import Batch, CalibrationSet

    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked next-token distributions: the samples depend on every block
        for index in (1, 4):
            model.model.layers[index].self_attn.o_proj.weight.zero_()
            model.model.layers[index].mlp.down_proj.weight.zero_()
    torch.manual_seed(0)
    samples = model.generate(torch.full((32, 1), 1), max_new_tokens=31, do_sample=True, top_k=0, pad_token_id=0)
    calibration = CalibrationSet([Batch(samples[i:i + 8], torch.ones_like(samples[i:i + 8])) for i in range(0, 32, 8)],
                                 {"source": "self-sampled", "sequences": 32, "tokens": samples.numel()})
    result = blockfold.compress(model, tokenizer, {"method": "sleb", "blocks": 2}, calibration=calibration)
    assert result.manifest["removed_blocks"] == [1, 4] and model.config.num_hidden_layers == 4


def test_sleb_scores_on_its_first_sequences_and_the_refit_fits_on_all(tokenizer):
    """``score_sequences``: SLEB's choice is the one it makes on those sequences alone, while the refit
    after it fits on every calibration token (SLEB's stream per candidate is what few sequences save)."""
    from blockfold.data import CalibrationSet

    calibration = random_calibration(num_sequences=8, length=24, batch_size=4)
    first = CalibrationSet(calibration.first_sequences(3), {"source": "random", "sequences": 3})
    assert [len(batch) for batch in first] == [3]
    alone = blockfold.compress(tiny_model("llama"), tokenizer, {"method": "sleb", "blocks": 2}, calibration=first)
    scored = blockfold.compress(tiny_model("llama"), tokenizer,
                                {"method": "sleb", "blocks": 2, "score_sequences": 3, "refit": "down"},
                                calibration=calibration)
    assert scored.manifest["removed_blocks"] == alone.manifest["removed_blocks"]
    assert scored.manifest["selection"]["scored_sequences"] == 3
    assert scored.manifest["selection"]["steps"] == alone.manifest["selection"]["steps"]
    assert {fit["tokens"] for fit in _refit_fits(scored.manifest)} == {calibration.num_tokens}


def _refit_fits(manifest: dict) -> list[dict]:
    """Every fit the refit stage's manifest reports (each with the tokens it was fitted on)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if "tokens" in node and "relative_error_before" in node:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(manifest["refit"])
    assert found, manifest["refit"]
    return found


def test_attention_budget_is_checked(tokenizer):
    with pytest.raises(BlockfoldError, match="attention_layers"):
        blockfold.Recipe.parse({"method": "replaceme", "attention_layers": 4})
    with pytest.raises(BlockfoldError, match="blocks"):
        blockfold.Recipe.parse({"method": "nbl", "blocks": 4})
    with pytest.raises(BlockfoldError, match="--attn between 1 and 6"):
        blockfold.compress(tiny_model("llama"), tokenizer, {"method": "nbl", "attention_layers": 7},
                           calibration=random_calibration())
    assert blockfold.Recipe.parse({"method": "drop-attn", "ratio": 0.5}).settings.num_attention_layers(6) == 3


# -- checkpoints ---------------------------------------------------------------------------------

REMOTE_RELOAD = r"""
import sys, json, torch
sys.modules["blockfold"] = None  # blockfold must not be importable here
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=False)
    print("loaded without trust_remote_code")
except ValueError as err:
    assert "trust_remote_code" in str(err), err
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
out = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
print(json.dumps(out.tolist()))
"""


@pytest.mark.parametrize("arch, method", [("llama", "nbl"), ("gemma3_text", "nbl"), ("qwen2", "nbl-block"),
                                          ("mistral", "drop-attn")])
def test_linearized_checkpoint_reloads_without_blockfold_and_generates_same_tokens(arch, method, tmp_path):
    model = tiny_model(arch)
    budget = {"blocks": 2} if method == "nbl-block" else {"attention_layers": 2}
    result = blockfold.compress(model, tiny_tokenizer(), {"method": method, **budget}, calibration=random_calibration())
    out = result.save(tmp_path / "out")
    assert (out / "modeling_blockfold.py").is_file()
    ids = [[5, 17, 33, 8, 61, 20]]
    expected = model.generate(torch.tensor(ids), max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    workdir = tmp_path / "elsewhere"  # the shipped code must not read the working directory
    workdir.mkdir()
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    completed = subprocess.run([sys.executable, "-c", REMOTE_RELOAD, str(out), json.dumps(ids)], cwd=workdir,
                               env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True)
    lines = completed.stdout.strip().splitlines()
    assert "loaded without trust_remote_code" not in lines, "a plain load must refuse, not build the wrong model"
    assert json.loads(lines[-1]) == expected.tolist()
    # ...and through blockfold, with its own copy of the modeling code
    reloaded = load_model(str(out)).model
    assert type(reloaded).__name__ == type(model).__name__
    assert torch.equal(reloaded.generate(torch.tensor(ids), max_new_tokens=12, do_sample=False, pad_token_id=0), expected)


def test_rankings_compared_on_one_model_share_one_statistics_pass():
    """A comparison of linearity rankings (bench/defaults_validation.py) passes a PassCache: the second
    ranking reuses the first's statistics and builds the same model as its own pass would; other
    weights are not served them."""
    import copy

    from blockfold.methods import PassCache

    base, calibration, cache = tiny_model("llama"), random_calibration(num_sequences=8), PassCache()
    for criterion, passes in (("cosine", 1), ("cca", 0)):
        recipe = {"method": "nbl", "attention_layers": 2, "linearity_criterion": criterion}
        alone = copy.deepcopy(base)
        expected = blockfold.compress(alone, tiny_tokenizer(), recipe, calibration=calibration).manifest
        shared = copy.deepcopy(base)
        got = blockfold.compress(shared, tiny_tokenizer(), recipe, calibration=calibration, cache=cache).manifest
        assert got["execution"]["passes"] == passes
        assert got["replaced"] == expected["replaced"]
        assert all(torch.allclose(alone.state_dict()[k], v, atol=1e-6) for k, v in shared.state_dict().items())
    other = blockfold.compress(tiny_model("llama", seed=3), tiny_tokenizer(), {"method": "nbl", "attention_layers": 2},
                               calibration=calibration, cache=cache).manifest
    assert other["execution"]["passes"] == 1


TOKENIZER_RELOAD = r"""
import sys, time
sys.modules["blockfold"] = None
from transformers import AutoTokenizer
started = time.perf_counter()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print(time.perf_counter() - started)
print(" ".join(map(str, tokenizer("w1 w2 w3")["input_ids"])))
print(any(name.startswith("transformers_modules") for name in sys.modules))
"""


def test_linearized_checkpoint_tokenizer_loads_in_a_job_without_a_terminal_and_runs_no_shipped_code(tmp_path):
    """The model refuses to load without trust_remote_code (it would be the wrong model); its
    tokenizer is a stock one: a job with no terminal gets it at once, without executing the shipped
    modeling code (AutoTokenizer reads config.json, whose custom model_type asks before code runs)."""
    tokenizer = tiny_tokenizer()
    result = blockfold.compress(tiny_model("llama"), tokenizer, {"method": "nbl", "attention_layers": 2},
                                calibration=random_calibration())
    out = result.save(tmp_path / "out")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    completed = subprocess.run([sys.executable, "-c", TOKENIZER_RELOAD, str(out)], env=env, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, check=True, timeout=120)
    seconds, ids, ran_shipped_code = completed.stdout.strip().splitlines()[-3:]
    seconds = seconds.split()[-1]  # after the unanswered prompt's text, which input() leaves on the line
    assert ids == " ".join(map(str, tokenizer("w1 w2 w3")["input_ids"]))
    assert ran_shipped_code == "False"
    assert float(seconds) < 10, "the remote-code prompt waited for an answer no job can give"
