"""The downstream refit (``--refit down``): what it changes and what it must leave alone.

A span that does nothing leaves the compressed stream equal to the original, so the refit has nothing
to correct and every weight must stay as it was; a span that does something leaves an error the refit
lowers at every block and at the model's output; blocks it cannot refit exactly are named, not
silently approximated; the output is a plain checkpoint of the same size."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (generate_without_blockfold, random_calibration, shared_file, silence_blocks, tiny_folder_and_corpus,
                      tiny_model, tiny_tokenizer)

import blockfold
from blockfold.adapters import get_adapter
from blockfold.cli import main
from blockfold.errors import BlockfoldError
from blockfold.data import build_calibration
from blockfold.recipe import RECIPE_VERSION, CalibrationConfig, Recipe


@pytest.mark.parametrize("refit", ["down", "attn+down", "all"])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_a_span_that_does_nothing_leaves_every_weight_as_it_was(arch, refit):
    """The targets are the original stream: if they were taken one block off, or from the compressed
    stream's own blocks, the refit would move weights here."""
    model = tiny_model(arch)
    if arch == "gpt_neox":
        adapter = get_adapter(model)
        with torch.no_grad():
            for index in (2, 3):
                layer = adapter.layers(model)[index]
                layer.attention.dense.weight.zero_()
                adapter.down_proj(layer).weight.zero_()
    else:
        silence_blocks(model, (2, 3))
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit=refit,
                                                                             refit_blocks=10, refit_ridge=0.0),
                                calibration=random_calibration())
    assert result.manifest["removed_blocks"] == [2, 3]
    blocks = result.manifest["refit"]["blocks"]
    assert [entry["block"] for entry in blocks] == [1, 2, 3]  # from the block before the span to the last
    assert all(entry["relative_error_before"] < 1e-9 for entry in blocks)
    if refit != "down":
        assert "attention" not in blocks[0]  # it reads the original stream
        assert all(entry["attention"]["relative_error_before"] < 1e-9 for entry in blocks[1:])
    if refit == "all":
        assert "attention_inputs" not in blocks[0] and "mlp_inputs" not in blocks[0]
        assert all(entry[part]["relative_error_before"] < 1e-9 for entry in blocks[1:]
                   for part in ("attention_inputs", "mlp_inputs"))
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4


def _block_outputs(model, calibration, part: str | None = None) -> dict[int, torch.Tensor]:
    """Each decoder block's output over the calibration tokens (with ``part`` "down": its down-projection's
    output instead), from a plain forward pass."""
    adapter, outputs = get_adapter(model), {}
    modules = {index: adapter.down_proj(layer) if part == "down" else layer for index, layer in enumerate(adapter.layers(model))}
    hooks = [module.register_forward_hook(lambda m, a, out, index=index: outputs.setdefault(index, []).append(
        (out[0] if isinstance(out, tuple) else out).reshape(-1, (out[0] if isinstance(out, tuple) else out).shape[-1])))
             for index, module in modules.items()]
    with torch.no_grad():
        for batch in calibration:
            model(batch.input_ids)
    for hook in hooks:
        hook.remove()
    return {index: torch.cat(values).double() for index, values in outputs.items()}


@pytest.mark.parametrize("refit", ["down", "all"])
def test_each_reported_fit_error_is_what_the_saved_model_computes(refit):
    """The refit runs a block only as far as each fit needs and takes the block's output with its new
    down-projection from what it has already computed: the error it reports for every refitted block
    must be the one a fresh forward pass of the compressed model makes against the original's stream
    (a stream advanced with a stale weight, or a fit stopped too early, would report another)."""
    calibration, original = random_calibration(), tiny_model("llama")
    model = copy.deepcopy(original)
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit=refit,
                                                                             refit_blocks=3, refit_scale=False),
                                calibration=calibration)
    wanted_from = {1: 3, 2: 4, 3: 5}  # compressed block -> the original block whose output it is fitted to
    streams, outputs, down = (_block_outputs(original, calibration), _block_outputs(model, calibration),
                              _block_outputs(model, calibration, "down"))
    entries = result.manifest["refit"]["blocks"]
    assert [entry["block"] for entry in entries] == [1, 2, 3]
    for entry in entries:
        block = entry["block"]
        wanted = streams[wanted_from[block]] - (outputs[block] - down[block])
        error = float((wanted - down[block]).pow(2).sum() / wanted.pow(2).sum())
        assert error == pytest.approx(entry["relative_error_after"], rel=1e-3, abs=1e-7), block


def test_the_refit_reads_the_first_pass_recording_and_builds_what_its_own_pass_builds(monkeypatch, tmp_path):
    """The default refit reads the original streams the selection pass recorded (one pass fewer) and builds
    the same weights as with a pass of its own to record them, padded sequences included; the recording,
    spilled to disk here, leaves nothing behind."""
    from blockfold.data import Batch, CalibrationSet
    from blockfold.pipelines import StreamRecorder
    from blockfold.runtime import Execution

    batches = []
    for batch in random_calibration():
        mask = torch.ones_like(batch.attention_mask)
        mask[1, 17:], mask[2, 20:] = 0, 0  # right padding
        batches.append(Batch(batch.input_ids, mask))
    calibration = CalibrationSet(batches, {"source": "random, padded"})
    spill = tmp_path / "spill"
    spill.mkdir()
    recorded = tiny_model("llama")
    first = blockfold.compress(recorded, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2), calibration=calibration,
                               execution=Execution(offload="disk", offload_dir=str(spill)))
    assert first.manifest["refit"]["original_streams"] == "recorded in the first pass"
    assert list(spill.iterdir()) == []
    monkeypatch.setattr(StreamRecorder, "covers", lambda *args: False)
    own = tiny_model("llama")
    second = blockfold.compress(own, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2), calibration=calibration)
    assert second.manifest["refit"]["original_streams"] == "a pass of their own"
    assert second.manifest["execution"]["passes"] == first.manifest["execution"]["passes"] + 1
    assert second.manifest["removed_blocks"] == first.manifest["removed_blocks"]
    for (name, got), wanted in zip(recorded.state_dict().items(), own.state_dict().values()):
        assert (got - wanted).abs().max() <= 1e-5 * wanted.abs().max(), name


def test_a_recording_the_statistics_budget_cannot_hold_is_not_made_and_the_plan_says_so(tmp_path):
    """The recording shares the statistics budget: one byte short of it, the refit runs its own pass,
    with the same weights, and ``--dry-run`` counts that pass too."""
    from blockfold.plan import plan_for
    from blockfold.runtime import Execution

    folder, _ = tiny_folder_and_corpus(tmp_path)
    calibration = random_calibration()
    roomy = blockfold.compress(str(folder), recipe=blockfold.ReplaceMe(blocks=2), calibration=calibration)
    statistics = roomy.manifest["selection"]["statistics"]
    assert roomy.manifest["refit"]["original_streams"] == "recorded in the first pass"
    short = Execution(stats_memory=statistics["full_sums_bytes"] + statistics["original_streams"]["bytes"] - 1)
    tight = blockfold.compress(str(folder), recipe=blockfold.ReplaceMe(blocks=2), calibration=calibration,
                               execution=short)
    assert tight.manifest["refit"]["original_streams"] == "a pass of their own"
    assert "statistics budget" in tight.manifest["selection"]["statistics"]["original_streams"]["not_recorded"]
    assert tight.manifest["execution"]["passes"] == roomy.manifest["execution"]["passes"] + 1
    # a first pass the statistics cache serves records nothing: the refit reads the original in a pass of
    # its own, which the plan counts wherever a cache is given
    cache = Execution(stats_cache=str(tmp_path / "cache"))
    blockfold.compress(str(folder), recipe=blockfold.ReplaceMe(blocks=2), calibration=calibration, execution=cache)
    cached = blockfold.compress(str(folder), recipe=blockfold.ReplaceMe(blocks=2), calibration=calibration,
                                execution=cache)
    assert cached.manifest["execution"]["cached_passes"] >= 1
    assert cached.manifest["refit"]["original_streams"] == "a pass of their own"
    for execution, result in ((Execution(), roomy), (short, tight), (cache, cached)):
        plan = plan_for(str(folder), Recipe.of(blockfold.ReplaceMe(blocks=2)).model_copy(update={
            "calibration": CalibrationConfig(num_sequences=8, sequence_length=24)}), execution)
        assert plan.numbers["passes"] == result.manifest["execution"]["passes"], plan.render()
    for name, value in roomy.model.state_dict().items():
        assert torch.allclose(tight.model.state_dict()[name], value, atol=1e-6), name


def test_drop_block_records_the_refit_stages_streams_in_its_own_pass(tmp_path):
    """DROP's one pass runs the unedited model over every calibration token, so the refit stage records
    the original streams there: no twin and no pass of their own, the same weights as with the twin (a
    budget one byte short of the recording), and ``--dry-run`` counts each run's passes."""
    from blockfold.plan import plan_for
    from blockfold.runtime import Execution

    folder, _ = tiny_folder_and_corpus(tmp_path)
    calibration = random_calibration()
    recipe = blockfold.DropBlock(blocks=2, refit="all")
    roomy = blockfold.compress(str(folder), recipe=recipe, calibration=calibration)
    assert roomy.manifest["refit"]["original_streams"] == "recorded in the first pass"
    recording = roomy.manifest["selection"]["statistics"]["original_streams"]
    assert recording["depths"] == 7  # every depth of the tiny Llama's 6 blocks
    short = Execution(stats_memory=recording["bytes"] - 1)
    tight = blockfold.compress(str(folder), recipe=recipe, calibration=calibration, execution=short)
    assert tight.manifest["refit"]["original_streams"] == "a pass of their own"
    assert "statistics budget" in tight.manifest["selection"]["statistics"]["original_streams"]["not_recorded"]
    assert tight.manifest["execution"]["passes"] == roomy.manifest["execution"]["passes"] + 1
    assert tight.manifest["removed_blocks"] == roomy.manifest["removed_blocks"]
    # with a statistics cache the pass may be loaded, leaving a recording short: the twin, as in the plan
    cache = Execution(stats_cache=str(tmp_path / "cache"))
    cached = blockfold.compress(str(folder), recipe=recipe, calibration=calibration, execution=cache)
    assert cached.manifest["refit"]["original_streams"] == "a pass of their own"
    for execution, result in ((Execution(), roomy), (short, tight), (cache, cached)):
        plan = plan_for(str(folder), Recipe.of(recipe).model_copy(update={"calibration": CalibrationConfig(
            num_sequences=8, sequence_length=24)}), execution)
        assert plan.numbers["passes"] == result.manifest["execution"]["passes"], plan.render()
    for name, value in roomy.model.state_dict().items():
        assert torch.allclose(tight.model.state_dict()[name], value, atol=1e-6), name


def test_a_refit_on_fewer_tokens_than_its_projections_have_inputs_says_it_will_overfit(caplog):
    """A down-projection of 64 inputs fitted on 48 tokens fits the tokens, not the model (SLEB's own 1,024
    tokens did that to SmolLM2's 1,536-input projections): the run says so, naming the fix."""
    few = random_calibration(num_sequences=2, length=24, batch_size=2)
    blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.ReplaceMe(blocks=2), calibration=few)
    assert any("fewer than it has inputs" in record.getMessage() and "--num-seqs" in record.getMessage()
               for record in caplog.records)
    caplog.clear()
    blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.ReplaceMe(blocks=2), calibration=random_calibration())
    assert not any("fewer than it has inputs" in record.getMessage() for record in caplog.records)


def _output_error(model, original, calibration) -> float:
    with torch.no_grad():
        errors = [(model(batch.input_ids).logits - original(batch.input_ids).logits).pow(2).mean() for batch in calibration]
    return float(sum(errors) / len(errors))


@pytest.mark.parametrize("refit", ["down", "attn+down", "all"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi"])
def test_the_refit_lowers_the_error_of_every_block_and_of_the_output(arch, refit):
    calibration = random_calibration(num_sequences=16, length=32)
    original = tiny_model(arch)
    plain, refitted = tiny_model(arch), tiny_model(arch)
    blockfold.compress(plain, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit="none"),
                       calibration=calibration)
    result = blockfold.compress(refitted, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit=refit,
                                                                                refit_blocks=10),
                                calibration=calibration)
    assert len(result.manifest["refit"]["blocks"]) == 3
    for entry in result.manifest["refit"]["blocks"]:
        assert entry["relative_error_after"] < entry["relative_error_before"], entry
        assert entry["tokens"] == 16 * 32
        if refit != "down" and entry["block"] > 1:
            assert entry["attention"]["relative_error_after"] < entry["attention"]["relative_error_before"], entry
        if refit == "all" and entry["block"] > 1:
            # phi's attention and MLP read one LayerNorm: one map for all four projections, solved once
            parts = {"shared_inputs": 4} if arch == "phi" else {"attention_inputs": 3, "mlp_inputs": 2}
            assert {part: entry[part]["projections"] for part in entry if part.endswith("_inputs")} == parts, entry
            for part in parts:
                assert entry[part]["relative_error_after"] < entry[part]["relative_error_before"], entry
    assert _output_error(refitted, original, calibration) < 0.8 * _output_error(plain, original, calibration)
    assert sum(p.numel() for p in refitted.parameters()) == sum(p.numel() for p in plain.parameters())


@pytest.mark.parametrize("refit, blocks, expected", [
    ("down", 1, {"model.layers.1.mlp.down_proj.weight"}),
    ("attn+down", 2, {"model.layers.1.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight",
                      "model.layers.2.self_attn.o_proj.weight"}),
    ("all", 2, {"model.layers.1.mlp.down_proj.weight"} | {f"model.layers.2.{name}.weight" for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")}),
])
def test_refit_blocks_limits_the_refit_and_the_rest_stays_plain_replaceme(refit, blocks, expected):
    """The block before the span reads the original stream, so its attention is left alone. (Without the
    stream scale, which rescales every later writer by design: the scale's own test checks those.)"""
    calibration = random_calibration()
    plain, limited = tiny_model("llama"), tiny_model("llama")
    blockfold.compress(plain, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit="none"),
                       calibration=calibration)
    result = blockfold.compress(limited, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit=refit,
                                                                               refit_blocks=blocks, refit_scale=False),
                                calibration=calibration)
    assert [entry["block"] for entry in result.manifest["refit"]["blocks"]] == list(range(1, 1 + blocks))
    changed = {name for (name, a), (_, b) in zip(plain.state_dict().items(), limited.state_dict().items())
               if not torch.equal(a, b)}
    assert changed == expected


def test_several_spans_take_each_span_end_as_the_target():
    """With two spans, the block before the second gap is fitted on the stream after the second span:
    silent spans again leave everything as it was."""
    model = tiny_model("llama", seed=3)
    silence_blocks(model, (1, 4))
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, spans=2, criterion="fit_error",
                                                                             refit="down", refit_ridge=0.0),
                                calibration=random_calibration())
    assert result.manifest["removed_blocks"] == [1, 4]
    with torch.no_grad():
        assert (model(ids).logits - expected).abs().max() < 1e-4


@pytest.mark.parametrize("refit", ["down", "attn+down", "all"])
@pytest.mark.parametrize("arch, reason", [("gemma3_text", "a norm after the MLP output"), ("mixtral", "mixture of experts")])
def test_blocks_it_cannot_refit_exactly_are_named_and_left_as_they_are(arch, reason, refit):
    """(Sandwich blocks' input projections, which ``all`` corrects by default, have their own test below.)"""
    plain, refitted = tiny_model(arch), tiny_model(arch)
    calibration = random_calibration()
    blockfold.compress(plain, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit="none"),
                       calibration=calibration)
    result = blockfold.compress(refitted, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit=refit,
                                                                                refit_sandwich=False),
                                calibration=calibration)
    assert result.manifest["refit"]["skipped"] == reason and result.manifest["refit"]["blocks"] == []
    for (name, a), (_, b) in zip(plain.state_dict().items(), refitted.state_dict().items()):
        assert torch.equal(a, b), name


def test_sandwich_blocks_after_the_span_have_only_their_input_projections_refitted(tmp_path):
    """Gemma's blocks end each sublayer with a norm, so what they write cannot be refitted by least
    squares; what they read can. The block before the span reads the original stream and stays as it
    was; in the next ones q, k, v, gate and up change, lowering their fit error, and nothing else does."""
    calibration = random_calibration(num_sequences=16, length=32)
    plain, refitted = tiny_model("gemma3_text"), tiny_model("gemma3_text")
    blockfold.compress(plain, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit="none"),
                       calibration=calibration)
    result = blockfold.compress(refitted, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2),
                                calibration=calibration)
    report = result.manifest["refit"]["blocks"]
    assert report[0] == {"block": 1, "skipped": "a norm after the MLP output"}
    assert [entry["block"] for entry in report[1:]] == [2, 3]
    for entry in report[1:]:
        assert entry["outputs"] == {"skipped": "a norm after the MLP output"}
        for part in ("attention_inputs", "mlp_inputs"):
            assert entry[part]["relative_error_after"] < entry[part]["relative_error_before"], entry
    changed = {name for (name, a), (_, b) in zip(plain.state_dict().items(), refitted.state_dict().items())
               if not torch.equal(a, b)}
    assert changed == {f"model.layers.{index}.{name}.weight" for index in (2, 3) for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert sum(p.numel() for p in refitted.parameters()) == sum(p.numel() for p in plain.parameters())
    card = (result.save(tmp_path / "out") / "README.md").read_text()
    assert "In blocks 2, 3 of the result, whose sublayer outputs pass a norm, only the projections" in card
    assert "down-projections of blocks" not in card


def test_the_default_refits_every_projection_of_three_blocks_per_span_except_where_it_cannot_apply():
    default = blockfold.ReplaceMe()
    assert (default.refit, default.refit_blocks, default.refit_scale, default.refit_sandwich) == ("all", 3, True, True)
    assert blockfold.ReplaceMe(refit="down").refit_sandwich is False
    assert blockfold.ReplaceMe(refit="down").refit_blocks == 2 == blockfold.ReplaceMe(refit="attn+down").refit_blocks
    assert (blockfold.ReplaceMe(greedy=True).refit, blockfold.ReplaceMe(greedy=True).refit_scale) == ("none", False)
    assert blockfold.ReplaceMe(estimator="identity").refit == "none"  # plain removal stays plain
    saved = Recipe.parse({"method": "replaceme", "blocks": 2, "refit": "none"}).model_dump(mode="json")
    assert Recipe.parse(saved).settings.refit == "none"  # a saved recipe replays (its defaults included)
    saved = Recipe.parse({"method": "replaceme", "blocks": 2, "refit_scale": False}).model_dump(mode="json")
    assert Recipe.parse(saved).settings.refit_scale is False


def test_a_version_8_recipe_refits_the_weights_alone():
    migrated = Recipe.parse({"recipe_version": 8, "method": "replaceme", "settings": {"blocks": 2}})
    assert (migrated.settings.refit, migrated.settings.refit_blocks, migrated.settings.refit_scale) == ("down", 2, False)
    assert migrated.recipe_version == RECIPE_VERSION
    explicit = Recipe.parse({"recipe_version": 8, "method": "replaceme", "settings": {"blocks": 2, "refit_scale": True}})
    assert explicit.settings.refit_scale is True


@pytest.mark.parametrize("settings, refit", [({}, "down"), ({"estimator": "diagonal"}, "none"), ({"greedy": True}, "none"),
                                             ({"refit": "attn+down"}, "attn+down")])
def test_a_version_9_recipe_keeps_the_refit_it_resolved_to(settings, refit):
    migrated = Recipe.parse({"recipe_version": 9, "method": "replaceme", "settings": {"blocks": 2, **settings}})
    assert migrated.recipe_version == RECIPE_VERSION and migrated.settings.refit == refit
    assert migrated.settings.refit_blocks == (2 if refit != "none" else None)


@pytest.mark.parametrize("settings, sandwich", [({}, False), ({"refit": "down"}, False), ({"refit_sandwich": True}, True)])
def test_a_version_10_recipe_leaves_sandwich_blocks_unless_it_asked(settings, sandwich):
    migrated = Recipe.parse({"recipe_version": 10, "method": "replaceme", "settings": {"blocks": 2, **settings}})
    assert migrated.recipe_version == RECIPE_VERSION and migrated.settings.refit_sandwich is sandwich
    assert migrated.settings.refit == settings.get("refit", "all")


def test_a_version_7_recipe_keeps_folding_the_map_alone():
    migrated = Recipe.parse({"recipe_version": 7, "method": "replaceme", "settings": {"blocks": 2}})
    assert migrated.settings.refit == "none" and migrated.settings.refit_blocks is None
    assert migrated.settings.refit_scale is False
    explicit = Recipe.parse({"recipe_version": 7, "method": "replaceme", "settings": {"blocks": 2, "refit": "down",
                                                                                     "refit_blocks": 3}})
    assert explicit.settings.refit == "down" and explicit.settings.refit_blocks == 3


def test_refit_settings_are_refused_where_they_would_do_nothing():
    with pytest.raises(BlockfoldError, match="--refit down"):
        Recipe.parse({"method": "replaceme", "blocks": 2, "refit": "none", "refit_blocks": 3})
    with pytest.raises(BlockfoldError, match="refit_scale"):
        Recipe.parse({"method": "replaceme", "blocks": 2, "refit": "none", "refit_scale": True})
    with pytest.raises(BlockfoldError, match="greedy"):
        Recipe.parse({"method": "replaceme", "blocks": 2, "greedy": True, "refit": "down"})
    with pytest.raises(BlockfoldError, match="--refit all"):
        Recipe.parse({"method": "replaceme", "blocks": 2, "refit": "down", "refit_sandwich": True})
    # the refit follows methods that remove blocks; one that replaces or patches them has no such stage
    for method, budget in (("nbl", "attention_layers"), ("linear-patch", "blocks"), ("streamline", "blocks")):
        with pytest.raises(BlockfoldError, match=f"refit does not apply to method '{method}'"):
            Recipe.parse({"method": method, budget: 2, "refit": "down"})
    assert Recipe.parse({"method": "uidl", "blocks": 2, "refit": "down"}).settings.refit_blocks == 2


def test_cli_refit_output_reloads_without_blockfold(tmp_path):
    folder, corpus = tiny_folder_and_corpus(tmp_path)
    out = tmp_path / "out"
    assert main(["compress", "--model", str(folder), "--calib", str(corpus), "--out", str(out), "--num-seqs", "8",
                 "--seq-len", "32", "--blocks", "2", "--refit", "down", "--refit-blocks", "2"]) == 0
    assert "refit" in (out / "README.md").read_text()
    assert len(generate_without_blockfold(out, [[5, 6, 7, 8]], tmp_path)[0]) > 4


def test_refit_blocks_counts_from_the_block_before_each_span(tmp_path):
    model = tiny_model("llama", seed=3)
    silence_blocks(model, (1, 4))
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, spans=2, criterion="fit_error",
                                                                             refit="down", refit_blocks=1),
                                calibration=random_calibration())
    assert result.manifest["removed_blocks"] == [1, 4]
    assert [entry["block"] for entry in result.manifest["refit"]["blocks"]] == [0, 2]  # 0-based, compressed model
    card = (result.save(tmp_path / "out") / "README.md").read_text()
    assert "down-projections of blocks 0, 2 of the result were refitted" in card
    assert "The refit of block 0, block 2 also fitted the stream's scale after it" in card


def test_projections_that_do_not_read_the_norms_output_leave_their_sublayer_alone(monkeypatch):
    """A map on the normed input folds only into projections that read exactly it: an adapter that
    named one more (here the attention output projection) gets that sublayer skipped, not mis-folded."""
    from blockfold.adapters.base import DecoderAdapter

    found = DecoderAdapter.input_projections

    def with_a_stranger(self, layer, sublayer):
        extra = [self.attention_output_projection(layer).module] if sublayer == "attention" else []
        return found(self, layer, sublayer) + extra

    monkeypatch.setattr(DecoderAdapter, "input_projections", with_a_stranger)
    model, original = tiny_model("llama"), tiny_model("llama")
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2, refit_blocks=2),
                                calibration=random_calibration())
    entry = result.manifest["refit"]["blocks"][1]
    assert entry["attention_inputs"] == {"skipped": "its projections do not read the norm's output as it is"}
    assert entry["mlp_inputs"]["relative_error_after"] < entry["mlp_inputs"]["relative_error_before"]
    for name in ("q_proj", "k_proj", "v_proj"):  # compressed block 2 is the original's block 4
        assert torch.equal(getattr(model.model.layers[2].self_attn, name).weight,
                           getattr(original.model.layers[4].self_attn, name).weight), name


def test_the_card_names_the_blocks_whose_input_projections_were_refitted(tmp_path):
    result = blockfold.compress(tiny_model("llama"), tiny_tokenizer(), blockfold.ReplaceMe(blocks=2, span_start=2),
                                calibration=random_calibration())
    assert [entry["block"] for entry in result.manifest["refit"]["blocks"]] == [1, 2, 3]  # the default: all, 3 blocks
    card = (result.save(tmp_path / "out") / "README.md").read_text()
    assert "In blocks 2, 3 the projections that read each sublayer's normed input were refitted" in card


def test_the_stream_scale_solve_recovers_a_planted_weight_and_scale():
    """Sums split across two batches (as across processes) give the joint least squares exactly."""
    from blockfold.stats.reconstruction import ProjectionEquations

    generator = torch.Generator().manual_seed(0)
    inputs, kept = torch.randn(300, 12, generator=generator, dtype=torch.float64), torch.randn(300, 5, generator=generator,
                                                                                                 dtype=torch.float64)
    weight = torch.randn(12, 5, generator=generator, dtype=torch.float64)
    targets = inputs @ weight + 0.37 * kept  # the kept part should be 1.37 times as large
    equations, other = ProjectionEquations(), ProjectionEquations()
    equations.add(inputs[:100], targets[:100], kept=kept[:100])
    other.add(inputs[100:], targets[100:], kept=kept[100:])
    fitted, scale, residual = equations.merge(other).stream_scale(0.0, torch.zeros(12, 5, dtype=torch.float64))
    assert scale == pytest.approx(1.37, abs=1e-9)
    assert torch.allclose(fitted, weight, atol=1e-9) and residual < 1e-12
    noisy = targets + 0.3 * torch.randn(300, 5, generator=generator, dtype=torch.float64)
    equations = ProjectionEquations()
    equations.add(inputs, noisy, kept=kept)
    fitted, scale, residual = equations.stream_scale(0.0, torch.zeros(12, 5, dtype=torch.float64))
    for nudge in (-0.01, 0.01):  # no other scale, with its own best weight, fits better
        shifted = noisy - (scale - 1 + nudge) * kept
        best = torch.linalg.lstsq(inputs, shifted).solution
        assert (shifted - inputs @ best).pow(2).sum() > residual * noisy.pow(2).sum()


def test_a_stream_scale_that_would_flip_the_stream_falls_back_to_the_plain_refit():
    """A scale of zero or below cannot pass the later norms: the weight alone is fitted, with s = 1."""
    from blockfold.stats.reconstruction import ProjectionEquations

    generator = torch.Generator().manual_seed(0)
    inputs, kept = torch.randn(300, 12, generator=generator, dtype=torch.float64), torch.randn(300, 5, generator=generator,
                                                                                                 dtype=torch.float64)
    targets = inputs @ torch.randn(12, 5, generator=generator, dtype=torch.float64) - 1.5 * kept  # asks for s = -0.5
    equations = ProjectionEquations()
    equations.add(inputs, targets, kept=kept)
    fitted, scale, residual = equations.stream_scale(0.0, torch.zeros(12, 5, dtype=torch.float64))
    plain = torch.linalg.lstsq(inputs, targets).solution
    assert scale == 1.0 and torch.allclose(fitted, plain, atol=1e-9)
    assert residual == pytest.approx(float((targets - inputs @ plain).pow(2).sum() / targets.pow(2).sum()), rel=1e-9)


def test_the_stream_scale_is_folded_into_every_later_block_and_reaches_the_fitted_error(smollm2):
    """On SmolLM2-135M (a random model's span leaves no magnitude gap to fit) the refit asks for the
    stream after block 11 ``s`` times as large and writes ``1/s`` on every later block's output
    projections (the same function: every later block and the final norm read the stream through a
    scale-invariant norm). Checked through forward passes: ``s`` times the compressed stream there is
    as far from the original stream after the span as the fit says, and every later writer is the
    unscaled compression's divided by ``s``."""
    config = CalibrationConfig(source=str(shared_file("c4_demo.jsonl")), num_sequences=8, sequence_length=128)
    calibration = build_calibration(config, smollm2.tokenizer)
    original, plain, scaled = (copy.deepcopy(smollm2.model) for _ in range(3))
    recipe = dict(blocks=8, span_start=12, refit="down", refit_blocks=1)
    blockfold.compress(plain, smollm2.tokenizer, blockfold.ReplaceMe(**recipe, refit_scale=False), calibration=calibration)
    result = blockfold.compress(scaled, smollm2.tokenizer, blockfold.ReplaceMe(**recipe, refit_scale=True),
                                calibration=calibration)
    entry = result.manifest["refit"]["blocks"][0]
    scale = entry["stream_scale"]
    assert abs(scale - 1) > 0.005 and entry["relative_error_after"] < entry["relative_error_before"]
    adapter = get_adapter(scaled)
    for index in range(12, len(adapter.layers(scaled))):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            got = adapter.layers(scaled)[index].get_parameter(name)
            assert torch.allclose(got, adapter.layers(plain)[index].get_parameter(name) / scale, rtol=1e-5, atol=1e-8)
    captured = {}

    def keep(name):
        return lambda module, args, output: captured.__setitem__(name, output[0] if isinstance(output, tuple) else output)

    hooks = [adapter.layers(original)[19].register_forward_hook(keep("after_span")),
             adapter.layers(scaled)[11].register_forward_hook(keep("compressed")),
             adapter.down_proj(adapter.layers(scaled)[11]).register_forward_hook(keep("down"))]
    error = wanted = 0.0
    with torch.no_grad():
        for batch in calibration:
            original(batch.input_ids), scaled(batch.input_ids)
            kept = captured["compressed"] - captured["down"]
            error += float((scale * captured["compressed"] - captured["after_span"]).double().pow(2).sum())
            wanted += float((captured["after_span"] - kept).double().pow(2).sum())
    for hook in hooks:
        hook.remove()
    assert error / wanted == pytest.approx(entry["relative_error_after"], rel=1e-3)


def test_with_the_stream_scale_the_gap_block_fits_at_least_as_well_as_without():
    """One more free scalar: on the same sums the joint fit cannot be worse than the plain refit's."""
    calibration = random_calibration(num_sequences=16, length=32)
    errors = {}
    for scaled in (False, True):
        result = blockfold.compress(tiny_model("qwen2"), tiny_tokenizer(),
                                    blockfold.ReplaceMe(blocks=2, span_start=2, refit="down", refit_scale=scaled),
                                    calibration=calibration)
        errors[scaled] = result.manifest["refit"]["blocks"][0]["relative_error_after"]
    assert errors[True] <= errors[False] + 1e-12


@pytest.mark.slow  # two compressions and 2 x 32 perplexity windows of SmolLM2: over a minute on 2 cores
def test_refitting_the_input_projections_too_lowers_held_out_perplexity_on_a_real_model(smollm2):
    """On SmolLM2-135M, 8 blocks from 12: the blocks after the span read a stream the removal changed;
    correcting what their q, k, v, gate and up projections compute from it (``all``) must beat refitting
    the output projections alone (``attn+down``) on WikiText-2, text of another domain than the C4
    calibration (BENCHMARKS.md "Downstream refit" has the full-size figures). 32 windows: on the first 6
    alone the order flips (208 against 198), the spread of so few passages."""
    from blockfold.eval import perplexity, tokenize_windows

    config = CalibrationConfig(source=str(shared_file("c4_demo.jsonl")), num_sequences=16, sequence_length=256)
    calibration = build_calibration(config, smollm2.tokenizer)
    windows = tokenize_windows(shared_file("wikitext2_test.txt").read_text(encoding="utf-8"), smollm2.tokenizer, 256, 32)
    figures = {}
    for refit in ("attn+down", "all"):
        model = copy.deepcopy(smollm2.model)
        result = blockfold.compress(model, smollm2.tokenizer,
                                    blockfold.ReplaceMe(blocks=8, span_start=12, refit=refit, refit_blocks=3),
                                    calibration=calibration)
        figures[refit] = perplexity(model, windows)["perplexity"]
    later = result.manifest["refit"]["blocks"][1:]
    assert [entry["block"] for entry in later] == [12, 13]
    assert all(entry[part]["relative_error_after"] < entry[part]["relative_error_before"]
               for entry in later for part in ("attention_inputs", "mlp_inputs"))
    assert figures["all"] < 0.95 * figures["attn+down"], figures  # measured: 259.0 against 314.5


def _drop_silenced(silenced: tuple[int, ...], refit: str) -> tuple[dict, float]:
    """A tiny Llama whose blocks ``silenced`` do nothing, compressed by drop-block with the refit stage
    (unregularised, over every later block): the manifest, and how far its logits moved."""
    model = tiny_model("llama")
    silence_blocks(model, silenced)
    ids = torch.randint(4, 96, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    result = blockfold.compress(model, tiny_tokenizer(), blockfold.DropBlock(blocks=len(silenced), refit=refit,
                                                                             refit_ridge=0.0, refit_blocks=10),
                                calibration=random_calibration())
    with torch.no_grad():
        return result.manifest, float((model(ids).logits - expected).abs().max())


@pytest.mark.parametrize("silenced", [(2, 3), (0, 1)], ids=["mid-model", "from-block-0"])
def test_the_refit_stage_after_drop_block_leaves_a_span_that_does_nothing_alone(silenced):
    """The stage records the original streams on a twin taken before the method runs; on blocks that do
    nothing (which drop-block removes) it must find nothing to correct, also where the span is at the
    very start and there is no block before it (the refit then starts at the first kept block)."""
    manifest, moved = _drop_silenced(silenced, "all")
    assert manifest["removed_blocks"] == list(silenced)
    blocks = manifest["refit"]["blocks"]
    assert [entry["block"] for entry in blocks] == list(range(silenced[0] - 1 if silenced[0] else 0, 4))
    assert all(entry["relative_error_before"] < 1e-9 for entry in blocks)
    assert moved < 1e-4


@pytest.mark.parametrize("method", [blockfold.DropBlock, blockfold.SLEB, blockfold.PruneComp, blockfold.LaCo])
def test_the_refit_stage_brings_each_removal_closer_to_the_original(method):
    """After any method that removes blocks, the refit stage lowers the error of every block it refits
    and brings the output on tokens it never saw closer to the original's; the removal itself (the
    blocks, Prune&Comp's compensation) is what the method alone does."""
    held_out = torch.randint(4, 96, (4, 24), generator=torch.Generator().manual_seed(7))
    original = tiny_model("llama")
    with torch.no_grad():
        expected = original(held_out).logits
    outputs = {}
    for refit in ("none", "all"):
        model = copy.deepcopy(original)
        result = blockfold.compress(model, tiny_tokenizer(), method(blocks=2, refit=refit),
                                    calibration=random_calibration(num_sequences=16))
        outputs[refit] = result.manifest
        with torch.no_grad():
            outputs[refit]["error"] = float((model(held_out).logits - expected).pow(2).mean())
    plain, refitted = outputs["none"], outputs["all"]
    assert plain["removed_blocks"] == refitted["removed_blocks"]
    assert plain.get("compensation") == refitted.get("compensation") and "refit" not in plain
    entries = [entry for entry in refitted["refit"]["blocks"] if "relative_error_before" in entry]
    assert entries and all(entry["relative_error_after"] < entry["relative_error_before"] for entry in entries)
    assert refitted["error"] < plain["error"]


def test_the_refit_stage_fits_to_the_stream_a_compensated_removal_left(monkeypatch):
    """Prune&Comp divides what every block after a removal writes by its scale ``s``: the compressed
    stream there is the original's divided by ``s``. The refit must aim at that stream, so after a span
    that does nothing, compensated by ``s = 2``, the block before it only halves the stream (its fitted
    stream scale) and the later blocks find nothing to correct. Aimed at the undivided stream, the
    stream scale would stay 1 and every later block would have half its contribution to make up."""
    from blockfold import methods
    from blockfold.surgery import remove_blocks, scale_block_output

    def silenced_span_compensated(job):
        remove_blocks(job.model, job.adapter, [2, 3])
        for later in job.handle.layers()[2:]:
            scale_block_output(job.handle, later, 1 / 2)
        return {"removed_blocks": [2, 3], "compensation": {"by_block": {2: 1.0, 3: 2.0}},
                "selection": {"criterion": "given", "score": 0.0}}

    monkeypatch.setitem(methods.METHODS, "drop-block", silenced_span_compensated)
    monkeypatch.setattr(blockfold.DropBlock, "first_pass_records", False)  # the stand-in runs no pass to record in
    manifest, moved = _drop_silenced((2, 3), "down")
    gap, *later = manifest["refit"]["blocks"]
    assert gap["block"] == 1 and gap["stream_scale"] == pytest.approx(0.5, rel=1e-6)
    assert [entry["block"] for entry in later] == [2, 3] and all(entry["relative_error_before"] < 1e-9 for entry in later)
    assert moved < 1e-3
