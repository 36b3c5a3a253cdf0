"""bench/render.py: BENCHMARKS.md's tables come from the JSON, a stale number is caught, and a merged
table says which run measured each row."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def render():
    spec = importlib.util.spec_from_file_location("bench_render", ROOT / "bench" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROVENANCE = {"command": "bench/x.py", "date": "2026-12-01 10:00 UTC", "commit": "abcdef1234567890", "cpu": "CPU",
              "cpus": 2, "memory_gib": 23.5, "torch": "2.13.0", "transformers": "5.24.0"}


def _run(name: str, perplexity: float, **extra) -> dict:
    return {"run": name, "perplexity": perplexity, "sparsity": 0.2, "prefill_speedup_2048": 1.3, "decode_speedup": 1.2,
            "kv_cache_ratio": 0.733, "layers": [12, 13, 14], **extra}


def test_committed_benchmarks_match_their_json(render):
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert render.rendered_document(text) == text, "BENCHMARKS.md is stale: run .venv/bin/python bench/render.py"


def test_a_hand_edited_number_inside_a_rendered_section_is_caught(render):
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.index("<!-- render:packing -->")
    edited = text[:section] + text[section:].replace("189.13", "150.00", 1)
    assert edited != text
    assert render.rendered_document(edited) == text


def test_merged_nbl_table_takes_the_later_run_and_labels_it_from_its_recipe(render):
    old = {"original": {"perplexity": 29.19}, "calibration": {"tokens": 32768},
           "runs": [_run("replaceme 8 blocks", 300.72, method="replaceme", blocks=8),
                    _run("drop-block 8 blocks", 115.11, method="drop-block", blocks=8)]}
    recipe = {"recipe_version": 3, "method": "nbl-block", "settings": {"blocks": 8, "linearity_criterion": "cca"}}
    new = {"original": {"perplexity": 29.19}, "calibration": {"tokens": 32768}, "provenance": PROVENANCE,
           "runs": [_run("replaceme 8 blocks", 102.55, method="replaceme", blocks=8,
                         recipe={"recipe_version": 3, "method": "replaceme",
                                 "settings": {"blocks": 8, "criterion": "fit_error_stream", "estimator": "lstsq"}}),
                    _run("nbl-block:cca 8 blocks", 425.0, method="nbl-block:cca", blocks=8, recipe=recipe)]}
    table = render.render_nbl([old, new])
    assert "300.72" not in table and "102.55" in table
    assert "ReplaceMe (lstsq, fit_error_stream, default) | 8 blocks" in table
    assert "NBL-block (cca) | 8 blocks" in table  # not the default ranking, so not labelled default
    # labelled with the default of the run's recipe version (v3: fit_error_stream), not today's
    v5 = {**new, "runs": [_run("replaceme 8 blocks", 99.0, method="replaceme", blocks=8, recipe={
        "recipe_version": 5, "method": "replaceme", "settings": {"blocks": 8, "criterion": "fit_error_stream"}})]}
    assert "ReplaceMe (fit_error_stream) | 8 blocks" in render.render_nbl([v5])
    assert "| 115.11 |" in table and "recipe v2, before provenance" in table  # the old row stays, marked
    assert "recipe v3, `abcdef1`" in table
    assert "- 1 row: an earlier invocation that recorded no provenance" in table
    assert "- 2 rows: `bench/x.py` — commit `abcdef123456`" in table


def test_defaults_table_groups_candidates_that_built_the_same_model_and_marks_the_default(render):
    texts = ["chosen on", "held out"]
    results = {"provenance": PROVENANCE, "models": {"smollm2-135m": {
        "original": {"chosen on": 29.0, "held out": 20.0},
        "span": {"default": "fit_error_stream", "blocks": 8,
                 "rows": [{"candidate": "angular_last", "start": 11, "perplexity": {"chosen on": 327.0, "held out": 90.0}},
                          {"candidate": "fit_error_stream", "start": 12, "perplexity": {"chosen on": 102.0, "held out": 95.0}},
                          {"candidate": "cka", "start": 12, "perplexity": {"chosen on": 102.0, "held out": 95.0}}],
                 "verdict": {"chosen on": {"default_over_best": 1.0}, "held out": {"default_over_best": 95 / 90}}}}}}
    table = render.render_defaults([results])
    assert table.count("| 12-19 |") == 1
    assert "| **fit_error_stream** (default), cka | 12-19 | **102.00** | 95.00 |" in table
    assert "| angular_last | 11-18 | 327.00 | **90.00** |" in table
    assert "| default / best | - | 1.000 | 1.056 |" in table
    assert texts[1] in table


def test_defaults_table_keeps_one_row_per_map_and_merges_studies_from_two_files(render):
    texts = {"chosen on": 1.0, "held out": 1.0}
    span = {"provenance": PROVENANCE, "models": {"m": {"original": texts, "span": {
        "default": "a", "blocks": 2, "rows": [{"candidate": "a", "start": 3, "perplexity": texts}],
        "verdict": {t: {"default_over_best": 1.0} for t in texts}}}}}
    maps = {"provenance": {**PROVENANCE, "command": "bench/y.py"}, "models": {"m": {"original": texts, "estimator": {
        "default": "lstsq", "rows": [{"candidate": name, "layers": [3, 4], "perplexity": texts} for name in ("lstsq", "orthogonal")],
        "verdict": {t: {"default_over_best": 1.0} for t in texts}}}}}
    table = render.render_defaults([span, maps])
    assert "### m, 2 blocks: ReplaceMe's span criterion" in table and "### m, 2 blocks: ReplaceMe's map on the default span" in table
    assert "| **lstsq** (default) | 3-4 |" in table and "| orthogonal | 3-4 |" in table
    assert "- `bench/x.py`" in table and "- `bench/y.py`" in table


def test_defaults_table_keeps_two_budgets_of_one_model_apart(render):
    """defaults_validation keys a run by model:blocks:layers, so a check at another budget is its own table."""
    texts = {"held out": 1.0}
    def run(blocks, ppl):
        return {"original": texts, "span": {"default": "a", "blocks": blocks,
                "rows": [{"candidate": "a", "start": 1, "perplexity": {"held out": ppl}}],
                "verdict": {"held out": {"default_over_best": 1.0}}}}
    table = render.render_defaults([{"provenance": PROVENANCE, "models": {"m:2:2": run(2, 11.0), "m:4:4": run(4, 44.0)}}])
    assert "### m, 2 blocks: ReplaceMe's span criterion" in table and "### m, 4 blocks: ReplaceMe's span criterion" in table
    assert "| **a** (default) | 1-2 | **11.00** |" in table and "| **a** (default) | 1-4 | **44.00** |" in table


def test_defaults_table_lists_a_refused_candidate_with_its_reason_outside_the_best(render):
    texts = {"chosen on": 50.0, "held out": 40.0}
    study = {"default": "auto", "rows": [{"candidate": "auto", "layers": [5, 6], "perplexity": texts},
                                         {"candidate": "through-norm", "refused": "the fit is not finite"}],
             "verdict": {t: {"default_over_best": 1.0} for t in texts}}
    table = render.render_defaults([{"provenance": PROVENANCE, "models": {"m": {"original": texts, "fold": study}}}])
    assert "| **auto** (default) | 5-6 | **50.00** | **40.00** |" in table
    assert "| through-norm | - | refused: the fit is not finite | |" in table


def test_gemma_section_takes_the_placement_study_from_a_separate_run(render):
    main = {"removed_blocks": [7, 8, 9, 10], "selection": {"criterion": "fit_error_stream", "scored_map": "post-norm lstsq"},
            "auto_regime": "through-norm", "perplexity": {"original": 62.06, "folded: through-norm": 188.92},
            "relative_fit_error": {"folded: through-norm": 0.1357}, "provenance": PROVENANCE}
    placement = {"blocks": 4, "ppl_windows": 12, "provenance": {**PROVENANCE, "command": "bench/span_placement.py"},
                 "rows": [{"start": 1, "perplexity": 900.0, "regime": "linearized-norm"},
                          {"start": 7, "perplexity": 190.0, "regime": "through-norm"}],
                 "criteria": {"fit_error_stream": {"spearman_with_log_ppl": 1.0, "choice": 7, "choice_perplexity": 190.0}},
                 "best": {"start": 7, "perplexity": 190.0}}
    table = render.render_gemma([main, placement])
    assert "| fit_error_stream | 1.000 | 7 | 190.00 |" in table
    assert "1: 900.0 (linearized-norm); 7: 190.0 (through-norm)." in table
    assert "first 12 windows" in table and "- `bench/span_placement.py`" in table
    assert "placement" not in render.render_gemma([main]).lower()


def test_fold_choice_table_marks_the_better_fold_and_a_failed_fit(render):
    def losses(a, b):
        return {"linearized-norm": a, "through-norm": b}

    rows = [{"start": 1, "perplexity": losses(100.0, 150.0), "better": "linearized-norm", "sample_loss": losses(0.3, 0.2),
             "held_out_loss": losses(0.31, 0.22), "held_out_cosine": losses(0.01, 0.02)},
            {"start": 2, "perplexity": {"linearized-norm": 90.0}, "better": "linearized-norm",
             "failed": {"through-norm": "fit not finite"}, "sample_loss": losses(0.3, float("nan")),
             "held_out_loss": losses(0.3, float("nan")), "held_out_cosine": losses(0.01, float("nan"))}]
    spec = importlib.util.spec_from_file_location("fold_choice", ROOT / "bench" / "sandwich_fold_choice.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    summary = bench.summarize(rows)
    assert summary["objective on the fit sample (version 3's auto)"]["right"] == 1  # it picks through-norm at 1
    assert summary["linearized-norm unless its fit is not finite (version 4's auto)"]["right"] == 2
    assert summary["objective on the fit sample (version 3's auto)"]["worst_ppl_ratio_to_better"] == 1.5
    table = render.render_fold_choice({"model": "m", "blocks": 4, "ppl_windows": 12, "rows": rows, "summary": summary,
                                       "provenance": PROVENANCE})
    assert "| 1 | **100.00** | 150.00 |" in table and "| 2 | **90.00** | fit not finite |" in table
    assert "| objective on the fit sample (version 3's auto) | 1 of 2 | 1.225 | 1.500 |" in table


def test_serving_section_adds_the_llamacpp_export_rows_with_their_own_provenance(render):
    """bench/serving.py --part llamacpp merges into the serving JSON; its rows render after the engine
    tables, ratios against the original at the same type, with the run that measured them."""
    def export(mb, ppl, prefill, decode, matching=20):
        rounds = [{"prefill_tokens_per_s": prefill / 2, "decode_tokens_per_s": decode / 2,
                   "python_prefill_tokens_per_s": prefill / 2, "python_decode_tokens_per_s": decode / 2},
                  {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode,
                   "python_prefill_tokens_per_s": prefill * 0.9, "python_decode_tokens_per_s": decode * 0.9}]
        return {"matching": matching, "prompts": 20, "gaps_where_parted": [0.0017] * (20 - matching),
                "tokenization_agrees": 20, "gguf_mb": mb, "perplexity": ppl, "prefill_tokens_per_s": prefill,
                "decode_tokens_per_s": decode, "throughput_rounds": rounds}
    row = {"matching": 20, "prompts": 20, "gaps_where_parted": [], "tokenization_agrees": 20,
           "prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 10.0}
    trip = {"source_gguf": "m.Q4_1.gguf", "source_mb": 98.4, "exported_mb": 81.0, "windows": 20,
            "source_perplexity": 36.02, "round_trip_perplexity": 126.92}
    engines = {"provenance": PROVENANCE, "prompts": 20, "new_tokens": 16, "threads": 2, "models": [
        {"model": "m", "round_trip": trip, "variants": [{"variant": "original", "engines": {"llamacpp-f16": row}},
                                                       {"variant": "replaceme-8", "engines": {"llamacpp-f16": row}}]}]}
    llamacpp = {"provenance": {**PROVENANCE, "command": "bench/serving.py --part llamacpp"}, "prompts": 20,
                "new_tokens": 16, "threads": 2, "ppl_windows": 20, "throughput_rounds": 2, "idle_share": 0.9, "models": [{
                    "model": "m", "source_has_gguf_record": False, "same_weights_as_from_gguf": True, "round_trip": trip,
                    "variants": [{"variant": "original", "exports": {"f16": export(271.0, 36.5, 400.0, 50.0, 19),
                                                                     "q4_k_m": export(105.0, 37.9, 500.0, 80.0)}},
                                 {"variant": "replaceme-8", "exports": {"f16": export(214.0, 126.8, 520.0, 65.0),
                                                                        "q4_k_m": export(86.0, 131.0, 650.0, 100.0)}}]}]}
    plain = render.render_serving([engines])
    table = render.render_serving([{**engines, "llamacpp": llamacpp}])
    assert table.startswith(plain) and "fresh K-quants" not in plain
    assert "its manifest's source has no GGUF record; the same weights, bit for bit" in table
    assert "the fastest of 2 runs taken in turn with the original's, each started once the machine was 90% idle" in table
    assert "| original | `--quant f16` from the folder | 271 MB | 19/20 (parted at gaps 0.002); tokenization 20/20 | " \
           "36.50 | 400 | 50.0 | 360 / 45.0 |" in table
    assert "| replaceme-8 | `--quant f16` from the folder | 214 MB | 20/20; tokenization 20/20 | 126.80 | " \
           "520 (**1.30x**) | 65.0 (**1.30x**) |" in table
    assert "| replaceme-8 | `--quant q4_k_m` from the folder | 86 MB | 20/20; tokenization 20/20 | 131.00 | " \
           "650 (**1.30x**) | 100 (**1.25x**) |" in table  # against the original's q4_k_m, not its f16
    assert "| original | `m.Q4_1.gguf` (the source) | 98 MB | - | 36.02 |" in table
    assert "| replaceme-8 from the GGUF | `--quant source` | 81 MB | - | 126.92 |" in table
    assert table.index("- `bench/x.py`") < table.index("### llama.cpp") < table.index("- `bench/serving.py --part llamacpp`")


def test_accuracy_section_gives_each_methods_accuracy_relative_performance_and_cost(render):
    def accuracy(piqa: float, arc: float) -> dict:
        return {"piqa": {"metrics": {"acc": piqa}}, "arc_easy": {"metrics": {"acc": arc}}}

    row = {"method": "replaceme:refit=none", "recipe": {"settings": {"refit": "none"}}, "removed_blocks": [12, 13, 14],
           "forward_passes": 1.0, "compress_passes": 1.2, "parameters": 90e6,
           "accuracy": accuracy(0.6, 0.4), "relative_performance": {"average": {"rp": 0.8333, "stderr": 0.0251}}}
    results = {"provenance": PROVENANCE, "model": "m", "blocks": 3, "calibration": {"source": "c4", "sequences": 2,
               "sequence_length": 8}, "tasks": ["piqa", "arc_easy"], "limit": 500,
               "original": {"parameters": 100e6, "accuracy": accuracy(0.7, 0.5)}, "rows": [row]}
    text = render.render_accuracy([results])
    assert "| original | - | 0.700 | 0.500 | 0.600 | 1 | - | 100.0 M |" in text
    assert "| replaceme:refit=none (no refit) | 12-14 | 0.600 | 0.400 | 0.500 | 0.833 ± 0.025 | 1.00 | 90.0 M |" in text
    assert "first 500 examples" in text and "#### m, 3 blocks removed" in text and "abcdef123456" in text


def test_accuracy_runs_of_one_setting_share_a_table_and_must_share_their_original(render):
    def results(method: str, original_piqa: float) -> dict:
        accuracy = {"piqa": {"metrics": {"acc": 0.5}}}
        row = {"method": method, "recipe": {}, "removed_blocks": [3], "forward_passes": 1.0, "parameters": 90e6,
               "accuracy": accuracy, "relative_performance": {"average": {"rp": 0.5 / original_piqa, "stderr": 0.0}}}
        return {"provenance": PROVENANCE, "model": "m", "blocks": 1, "calibration": {}, "tasks": ["piqa"],
                "limit": 500, "eval_dtype": "float32",
                "original": {"parameters": 100e6, "accuracy": {"piqa": {"metrics": {"acc": original_piqa}}}},
                "rows": [row]}

    text = render.render_accuracy([results("uidl", 0.6), results("sleb", 0.6)])
    assert text.count("| original |") == 1 and text.count("####") == 1
    assert text.index("| uidl |") < text.index("| sleb |")
    assert text.count("abcdef123456") == 2  # one provenance line per run
    with pytest.raises(ValueError, match="different originals"):
        render.render_accuracy([results("uidl", 0.6), results("sleb", 0.7)])
    other_limit = results("sleb", 0.7) | {"limit": 100}
    assert render.render_accuracy([results("uidl", 0.6), other_limit]).count("| original |") == 2


def test_refit_stage_pairs_each_setting_with_its_refit_twin_across_runs(render):
    held_out = "C4 (held out)"

    def row(method: str, ppl: float, blocks: list[int]) -> dict:
        return {"method": method, "removed_blocks": blocks, "forward_passes": 1.0,
                "perplexity": {"WikiText-2 (chosen on)": ppl, held_out: ppl}}

    def results(model: str, blocks: int, rows: list[dict]) -> dict:
        return {"provenance": PROVENANCE, "model": model, "blocks": blocks, "rows": rows,
                "original": {"perplexity": {"WikiText-2 (chosen on)": 10.0, held_out: 20.0}}}

    both = {"relative_performance": {"average": {"rp": 0.9, "stderr": 0.01}}}  # a run measuring both
    text = render.render_refit_stage([
        results("gemma3-270m", 4, [row("uidl", 90.0, [5]) | both, row("uidl:refit=all", 45.0, [5]) | both]),
        results("smollm2-135m", 8, [row("sleb", 60.0, [3]), row("sleb:score_sequences=2", 80.0, [4]),
                                    row("laco", 70.0, [6])]),
        results("smollm2-135m", 8, [row("sleb:score_sequences=2;refit=all", 40.0, [4]),
                                    row("sleb:refit=all", 120.0, [3])]),
        accuracy_run([scored("sleb", 0.6, [3]), scored("sleb:refit=all", 0.5, [3]), scored("laco", 0.7, [6])]),
    ])
    assert text.index("### smollm2-135m, 8 blocks") < text.index("### gemma3-270m, 4 blocks")
    assert "| sleb | 3 | 60.00 → **120.00** (0.5x) | 0.600 ± 0.020 → **0.500** ± 0.020 | 1.00 → 1.00 |" in text
    assert "| sleb:score_sequences=2 | 4 | 80.00 → **40.00** (2.0x) | - | 1.00 → 1.00 |" in text
    assert "| uidl | 5 | 90.00 → **45.00** (2.0x) | 0.900 ± 0.010 → **0.900** ± 0.010 |" in text
    assert "laco" not in text and "WikiText-2 (chosen on)" not in text  # no twin; held-out texts only
    with pytest.raises(AssertionError):  # accuracy measured on other blocks than the perplexity is refused
        render.render_refit_stage([results("smollm2-135m", 8, [row("uidl", 90.0, [5]), row("uidl:refit=all", 45.0, [5])]),
                                   accuracy_run([scored("uidl", 0.6, [6]), scored("uidl:refit=all", 0.7, [6])])])


def accuracy_run(rows: list[dict]) -> dict:
    return {"provenance": PROVENANCE, "model": "smollm2-135m", "blocks": 8, "rows": rows, "tasks": ["piqa"],
            "original": {"accuracy": {"piqa": 0.7}}}


def scored(method: str, rp: float, blocks: list[int]) -> dict:
    return {"method": method, "removed_blocks": blocks, "relative_performance": {"average": {"rp": rp, "stderr": 0.02}}}


def test_block_forwards_sets_each_versions_count_side_by_side(render):
    def results(commit: str, rows: list[dict]) -> dict:
        return {"provenance": PROVENANCE | {"commit": commit}, "rows": rows}

    def row(method: str, forwards: float, passes: int, blocks: list[int], planned: float | None = None) -> dict:
        return {"method": method, "block_forwards": forwards, "passes": passes, "removed_blocks": blocks,
                **({} if planned is None else {"planned_block_forwards": planned})}

    text = render.render_block_forwards([
        results("aaaaaaa1", [row("replaceme", 2.13, 3, [4, 5]), row("sleb", 5.0, 2, [1])]),
        results("aaaaaaa1", [row("uidl", 1.0, 1, [3])]),  # a second run of the same version adds its rows
        results("bbbbbbb2", [row("replaceme", 1.25, 2, [4, 5], planned=2.0), row("sleb", 5.0, 2, [2]),
                             row("laco", 1.5, 2, [], planned=1.5)]),
    ])
    assert ("| method | removed blocks | passes (`aaaaaaa` → `bbbbbbb`) | block forwards (`aaaaaaa` → `bbbbbbb`) "
            "| planned by `--dry-run` |") in text
    assert "| replaceme | 4-5 | 3 → 2 | 2.13 → 1.25 | 2.00 |" in text
    assert "| sleb | 1 / 2 | 2 → 2 | 5.00 → 5.00 | - |" in text
    assert "| uidl | 3 | 1 → - | 1.00 → - | - |" in text
    assert "| laco | - | - → 2 | - → 1.50 | 1.50 |" in text


def test_vision_section_gives_each_methods_agreement_and_knn_accuracy(render):
    row = {"method": "uidl", "blocks": 2, "removed_blocks": [6, 7], "parameters": 73.5e6, "recipe": {"settings": {}},
           "agreement": {"cosine_mean": 0.9699176, "cosine_min": 0.9669537, "images": 300}, "knn_accuracy": 0.4933}
    results = {"provenance": PROVENANCE, "model": "a tower", "rows": [row],
               "images": {"source": "digits", "calibration": 128, "held_out": 300},
               "original": {"parameters": 87.8e6, "knn_accuracy": 0.5}}
    text = render.render_vision(results)
    assert "| original | - | - | 1 | 1 | 0.500 | 87.8 M |" in text
    assert "| uidl | 2 | 6-7 | 0.969918 | 0.966954 | 0.493 | 73.5 M |" in text
    assert "calibration: 128 images of digits, evaluation: 300 others (held out)" in text and "abcdef123456" in text
    folder = render.render_vision({**results, "images": {"source": "/tmp/x/cifar10_folder", "calibration": 130,
                                                         "held_out": 400}})
    assert "130 images of cifar10_folder" in folder and "/tmp/x" not in folder  # a folder by its name, not the path


def test_gemma_perplexities_measured_on_windows_without_bos_carry_a_note(render):
    """A results file naming Gemma, from a run before windows began with BOS (or with no date at all),
    gets the note; the same file re-measured since, or a SmolLM2 file of any date, does not."""
    old = {"model": "gemma3-270m", "provenance": PROVENANCE, "rows": [{"perplexity": 79.9}]}
    fresh = {**old, "provenance": {**PROVENANCE, "date": "2026-12-03 12:05 UTC"}}
    undated = {"model": "gemma3-270m", "runs": [{"perplexity": 94.6}]}
    smollm2 = {**old, "model": "smollm2-135m"}
    assert "without BOS" in render.windows_warning([smollm2, old])
    assert "without BOS" in render.windows_warning(undated)
    assert render.windows_warning([fresh, smollm2]) is None
    assert render.windows_warning({**fresh, "rows": [{"provenance": PROVENANCE}]}) is not None, "an older row inside"


def test_defaults_verdict_compares_only_the_candidates_that_were_built():
    """bench/defaults_validation.py records a candidate compress refused (a fold that is not finite on
    the span) as a row with its reason; the default-over-best verdict is taken over the others."""
    spec = importlib.util.spec_from_file_location("bench_defaults", ROOT / "bench" / "defaults_validation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    study = {"default": "auto", "rows": [{"candidate": "auto", "perplexity": {"t": 60.0}},
                                         {"candidate": "through-norm", "refused": "not finite"},
                                         {"candidate": "other", "perplexity": {"t": 50.0}}]}
    assert module.verdict(study) == {"t": {"best": "other", "default_over_best": 1.2}}


@pytest.mark.parametrize("method, settings, blocks, label", [
    ("replaceme", {"refit": "all", "refit_scale": True}, [{"block": 11}], "replaceme"),
    ("replaceme", {"refit": "down", "refit_scale": True}, [{"block": 11}], "replaceme (refit down)"),
    ("replaceme", {"refit": "down", "refit_scale": False}, [{"block": 11}], "replaceme (refit down, no scale)"),
    ("replaceme:refit=down", {"refit": "down", "refit_scale": True}, [{"block": 11}], "replaceme:refit=down"),
    ("replaceme", {"refit": "down", "refit_scale": False}, [{"block": 3, "skipped": "x"}], "replaceme"),
    ("replaceme", {"refit": "down", "refit_scale": True}, [{"block": 3, "skipped": "a norm after the MLP output"}],
     "replaceme (no sandwich inputs)"),
    ("replaceme:refit=none", {"refit": "none"}, [], "replaceme:refit=none (no refit)"),
    ("replaceme", {"refit": "all", "refit_scale": True}, [{"block": 4, "skipped": "a norm after the MLP output"}],
     "replaceme (no sandwich inputs)"),
    ("replaceme", {"refit": "all", "refit_scale": True, "refit_sandwich": True},
     [{"block": 4, "skipped": "a norm after the MLP output"}, {"block": 5, "outputs": {"skipped": "x"}}], "replaceme"),
    ("replaceme:refit_sandwich=true", {"refit": "all", "refit_scale": True, "refit_sandwich": True},
     [{"block": 4, "skipped": "a norm after the MLP output"}], "replaceme:refit_sandwich=true"),
])
def test_a_replaceme_row_names_what_it_ran_where_todays_default_differs(render, method, settings, blocks, label):
    """Rows measured under older recipe versions keep the bare name they ran under: the label says which
    refit they resolved to, so a reader does not take them for today's default (version 10: all; version 11 with sandwich inputs)."""
    assert render._method_label({"method": method, "recipe": {"settings": settings}, "refit": {"blocks": blocks}}) == label
