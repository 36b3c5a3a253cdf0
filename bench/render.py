"""Regenerate BENCHMARKS.md's tables from the benchmark JSON in bench/results, so that a number in the
document is always the number a run wrote, with that run's command, commit and machine.

    .venv/bin/python bench/render.py           # rewrite every rendered section in place
    .venv/bin/python bench/render.py --check   # exit 1 if a section is stale (CI runs this)

A rendered section sits between ``<!-- render:NAME -->`` and ``<!-- /render:NAME -->``; the prose
around it is written by hand. Sections not yet moved to JSON stay hand-written.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCUMENT = HERE.parent / "BENCHMARKS.md"


def _mib(value: float) -> str:
    return f"{value:,.0f} MiB"


def _provenance_line(provenance: dict) -> str:
    commit = provenance.get("commit") or "unknown"
    commit = commit.split("+")[0][:12] + ("+dirty" if commit.endswith("+dirty") else "")
    machine = provenance.get("machine", "")
    if "cpu" in provenance:  # blockfold.api.provenance
        machine = f"{provenance['cpu']}, {provenance.get('cpus')} CPUs, {provenance.get('memory_gib')} GiB"
    return (f"`{provenance['command']}` — commit `{commit}`, {provenance.get('date', '?')}, {machine}, "
            f"torch {provenance.get('torch')}, transformers {provenance.get('transformers')}")


#: when perplexity windows began with the tokenizer's BOS (commit b0f6e76); before, every window but the
#: first was cut from one token stream without it, which about triples Gemma's perplexity
WINDOWS_WITH_BOS_SINCE = "2026-12-03 12:00"
# how a refit entry names a block whose MLP output passes a norm (methods/refit.py), in results JSON
SANDWICH_SKIPPED = "a norm after the MLP output"


def _dates(results) -> list[str | None]:
    """Every run date a results file records (None for a provenance without one)."""
    if isinstance(results, dict):
        found = [results["provenance"].get("date")] if isinstance(results.get("provenance"), dict) else []
        return found + [date for value in results.values() for date in _dates(value)]
    if isinstance(results, list):
        return [date for value in results for date in _dates(value)]
    return []


def windows_warning(loaded) -> str | None:
    """A note for a section whose Gemma perplexities were measured on windows without BOS: they stay
    comparable with each other, not with later tables or with lm-eval's."""
    parts = loaded if isinstance(loaded, list) else [loaded]
    stale = [part for part in parts if "gemma" in json.dumps(part).lower()
             and any(date is None or date < WINDOWS_WITH_BOS_SINCE for date in _dates(part) or [None])]
    if not stale:
        return None
    return ("> **Gemma perplexities in this section were measured before " + WINDOWS_WITH_BOS_SINCE[:10]
            + ", on windows without BOS** (every window but the first was cut from one token stream). Gemma "
            "loses its attention sink without BOS: the original scores 72.2 there against 24.0 with BOS on "
            "WikiText-2 windows 40-59. Rows compare with each other (same windows), not with later tables; "
            "the section's command re-measures it. SmolLM2's windows are unchanged (its tokenizer adds no BOS).")


def _footer(parts: list[dict]) -> list[str]:
    """One provenance line per results file a section merges."""
    return [f"- {_provenance_line(part['provenance'])}" for part in parts]


def render_scale(results: dict) -> str:
    """Issue #11: memory against depth, the small model's memory and cost, weights never resident, a
    model larger than the machine."""
    lines = []
    depth = results.get("depth")
    if depth:
        lines += ["### Memory against depth (random weights, SmolLM2's width, `--blocks L/4`, layer by layer)", "",
                  "Random-weight Llama-family models built by `bench/random_model.py` (not trained models), "
                  "4 × 512 calibration tokens.", "",
                  "| blocks | weights | statistics budget | peak RSS | passes | selection + fit / pass |",
                  "|---|---|---|---|---|---|"]
        for row in depth["rows"]:
            budget = "default (25 % of free memory)" if row["setting"] == "default" else \
                " ".join(row["argv"][row["argv"].index("--stats-memory"):][:4])
            lines.append(f"| {row['layers']} | {_mib(row['weight_mib'])} | {budget} | {_mib(row['peak_rss_mib'])} | "
                         f"{row['passes']} | {row['selection_and_fit_over_pass']:.2f} |")
        summary = depth["summary"]
        lines += ["", "| setting | peak RSS 32 / 8 blocks | peak RSS 96 / 8 blocks |", "|---|---|---|"]
        lines += [f"| {name} | {s['peak_rss_32_over_8']:.2f} | **{s['peak_rss_96_over_8']:.2f}** |" for name, s in summary.items()]
        lines += ["", _provenance_line(depth["provenance"]), ""]
    small = results.get("small")
    if small:
        memory, timing = small["memory"], small["timing"]
        lines += ["### SmolLM2-135M, 64 × 512 calibration tokens, 8 blocks", "",
                  "| measure | whole model | layer by layer |", "|---|---|---|",
                  f"| peak RSS of the whole `compress` process (load, pass, fit, save) | "
                  f"{_mib(memory['whole']['peak_rss_mib'])} | {_mib(memory['sequential']['peak_rss_mib'])} |",
                  f"| removed blocks | {_span(timing['whole_removed'])} | {_span(timing['sequential_removed'])} |",
                  f"| compress time (one process: one plain forward pass took {timing['forward_seconds']:.1f} s) | "
                  f"{timing['whole_seconds']:.1f} s | {timing['sequential_seconds']:.1f} s |",
                  f"| **ratio** | compress / forward **{timing['whole_over_forward']:.2f}** | "
                  f"layer by layer / whole **{timing['sequential_over_whole']:.2f}** |",
                  "", _provenance_line(small["provenance"]), ""]
    tiny = results.get("tinyllama")
    if tiny:
        lines += _large_rows("Weights never resident: random weights, TinyLlama-1.1B's width, 32 blocks, float32", tiny)
    big = results.get("big")
    if big:
        lines += _large_rows("Larger than the machine: random weights, Llama-2-7B's width, 64 blocks, bfloat16", big,
                             machine=True)
    keying = results.get("keying")
    if keying:
        lines += ["### Keying a streamed checkpoint: the same 25 GiB random checkpoint", "",
                  "The fingerprint behind `--stats-cache` and resume folders hashes every shard's bytes once "
                  "(SHA-256, several files at once), then reads the digests from an index.", "",
                  "| files | size | reading the bytes alone | fingerprint, first time | fingerprint, index read | "
                  "first time / reading |", "|---|---|---|---|---|---|",
                  f"| {keying['files']} | {keying['gib']:.1f} GiB | {keying['read_seconds']:.1f} s | "
                  f"{keying['cold_seconds']:.1f} s ({keying['cold_gib_per_s']:.2f} GiB/s) | {keying['warm_seconds']:.3f} s | "
                  f"**{keying['cold_over_read']:.2f}** |", "", _provenance_line(keying["provenance"]), ""]
    return "\n".join(lines).rstrip("\n")


def _span(blocks: list[int]) -> str:
    """Blocks as a range where contiguous; none (a method that linearizes blocks instead) as "-"."""
    if not blocks:
        return "-"
    if len(blocks) == 1:
        return str(blocks[0])
    return f"{blocks[0]}-{blocks[-1]}" if blocks == list(range(blocks[0], blocks[-1] + 1)) else ", ".join(map(str, blocks))


def _large_rows(title: str, run: dict, machine: bool = False) -> list[str]:
    statistics = run.get("statistics") or {}
    screening = statistics.get("screening", {})
    flags = [re.sub(r"^\S*/shared/data/", "../shared/data/", flag) for flag in run["argv"][run["argv"].index("--blocks"):]]
    rows = [f"### {title}", "", f"`blockfold compress {' '.join(flags)}`", "",
            "| measure | value |", "|---|---|",
            f"| weights on disk | {_mib(run['weight_mib'])} |"]
    if machine:
        rows.append(f"| the machine's memory | {_mib(run['machine_memory_mib'])} |")
    rows += [f"| **peak RSS of the whole process** | **{_mib(run['peak_rss_mib'])}** "
             f"({run['peak_rss_mib'] / run['weight_mib']:.1%} of the weights) |",
             f"| wall time (load, passes, fit, save) | {run['seconds']:.0f} s, of which {run['pass_seconds']:.0f} s "
             f"in {run['passes']} calibration passes |",
             f"| statistics | {statistics.get('sums')}: budget {statistics.get('stats_budget_bytes', 0) / 2**30:.1f} GiB "
             f"against {statistics.get('full_sums_bytes', 0) / 2**30:.1f} GiB for every candidate's full sums"
             + (f"; {screening['kept_per_length']} spans kept by {screening['by']}" if screening else "") + " |",
             f"| removed blocks | {_span(run['removed_blocks'])} |", "",
             _provenance_line(run["provenance"]), ""]
    return rows


def render_packing(results: dict) -> str:
    """Issue #12: what the calibration packing changes."""
    lines = ["| model | packing | removed blocks | WikiText-2 ppl (original) | relative fit error |", "|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['model']}, {row['blocks']} blocks | {row['packing']} | {_span(row['removed_blocks'])} | "
                     f"**{row['perplexity']:.2f}** ({row['original_perplexity']:.2f}) | {row['relative_fit_error']:.4f} |")
    return "\n".join(lines + ["", _provenance_line(results["provenance"])])


def render_healing(parts: list[dict]) -> str:
    """Issue #12: healing a compressed checkpoint, perplexity before and after; one table per fold."""
    lines = []
    for results in parts:
        recipe = results.get("recipe") or {}
        forced = recipe.get("settings", {}).get("sandwich_fold", "auto") != "auto"
        lines += [f"{results['model']}, {results['blocks']} blocks removed with recipe version "
                  f"{recipe.get('recipe_version')}'s defaults"
                  f"{', the fold forced' if forced else ''} (fold: {results.get('regime') or 'exact'}).", "",
                  "| mode | steps × tokens | trained parameters | training loss | WikiText-2 ppl before → after |",
                  "|---|---|---|---|---|"]
        for run in results["runs"]:
            lines.append(f"| {run['mode']} | {run['settings']['steps']} × 4 × 256, lr {run['settings']['learning_rate']:g} | "
                         f"{run['trained_parameters']:,} | {run['loss_first_steps']:.3f} → {run['loss_last_steps']:.3f} | "
                         f"{run['before']:.2f} → **{run['after']:.2f}** |")
        lines += ["", *_footer([results]), ""]
    return "\n".join(lines).rstrip("\n")


def render_gemma(parts: list[dict]) -> str:
    """Issue #12: the sandwich folds on Gemma-3-270m with today's defaults, and how well the criteria's
    post-norm proxy ranks the spans the real fold replaces (the placement study: ``--placement`` in the
    same run, or a separate ``bench/span_placement.py`` run as the second file)."""
    results = parts[0]
    blocks = results["removed_blocks"]
    lines = [f"Selected span: blocks {_span(blocks)} (criterion `{results['selection']['criterion']}`, which scores "
             f"{results['selection'].get('scored_map') or 'the folded map'}); `auto` chose `{results['auto_regime']}`.", "",
             "| variant | relative fit error | WikiText-2 ppl |", "|---|---|---|"]
    errors = results["relative_fit_error"]
    for label, ppl in results["perplexity"].items():
        error = errors.get(label)
        lines.append(f"| {label} | {'-' if error is None else f'{error:.4f}'} | {ppl:.2f} |")
    placement = results.get("placement") or (parts[1] if len(parts) > 1 else None)
    if placement:
        windows = f", WikiText-2 ppl on the first {placement['ppl_windows']} windows" if "ppl_windows" in placement else ""
        lines += ["", f"Every start for {placement['blocks']} blocks, each through `compress --span-start` (its own "
                  f"sandwich fold{windows}), against each criterion's score:", "",
                  "| criterion | Spearman ρ with log ppl | picks start | its ppl |", "|---|---|---|---|"]
        for name, value in placement["criteria"].items():
            lines.append(f"| {name} | {value['spearman_with_log_ppl']:.3f} | {value['choice']} | "
                         f"{value['choice_perplexity']:.2f} |")
        best = placement["best"]
        lines.append(f"| (best start) | - | {best['start']} | {best['perplexity']:.2f} |")
        lines += ["", "Per start (removed blocks start..start+{}): ".format(placement["blocks"] - 1) + "; ".join(
            f"{row['start']}: {row['perplexity']:.1f}" + (f" ({row['regime']})" if "regime" in row else "")
            for row in placement["rows"]) + "."]
    return "\n".join(lines + [""] + _footer(parts))


def render_fold_choice(results: dict) -> str:
    """Issue #12: both sandwich folds at every start, and how often each way of comparing them picks the
    fold with the lower perplexity."""
    lines = [f"{results['model']}, {results['blocks']} blocks, every start with each fold forced; WikiText-2 ppl on "
             f"the first {results['ppl_windows']} windows; losses on the through-norm fit's token sample and on "
             "held-out calibration tokens (linearized-norm / through-norm).", "",
             "| start | ppl linearized-norm | ppl through-norm | loss on fit sample | loss held out | "
             "cosine distance held out |", "|---|---|---|---|---|---|"]
    for row in results["rows"]:
        ppl = row["perplexity"]
        cells = ["fit not finite" if f not in ppl else f"**{ppl[f]:.2f}**" if f == row["better"] else f"{ppl[f]:.2f}"
                 for f in ("linearized-norm", "through-norm")]
        pairs = [f"{row[k]['linearized-norm']:.4f} / {row[k]['through-norm']:.4f}"
                 for k in ("sample_loss", "held_out_loss", "held_out_cosine")]
        lines.append(f"| {row['start']} | " + " | ".join(cells + pairs) + " |")
    lines += ["", "| auto compares the folds by | picks the better fold | geo-mean ppl over the better fold's | worst |",
              "|---|---|---|---|"]
    for rule, summary in results["summary"].items():
        lines.append(f"| {rule} | {summary['right']} of {summary['of']} | {summary['geomean_ppl_ratio_to_better']:.3f} | "
                     f"{summary['worst_ppl_ratio_to_better']:.3f} |")
    footer = _footer([results])
    if "summary_provenance" in results:
        footer.append(f"- summary recomputed from those rows: {_provenance_line(results['summary_provenance'])}")
    return "\n".join(lines + [""] + footer)


def render_defaults(parts: list[dict]) -> str:
    """Issue #12: each default against the other candidates, on the text it was chosen on and on text it
    never saw; the default's perplexity over the best candidate's per text. Studies from several files
    (invocations) merge per model."""
    studies = {"span": ("ReplaceMe's span criterion", "span"), "estimator": ("ReplaceMe's map on the default span", "span"),
               "fold": ("ReplaceMe's sandwich fold on the default span", "span"),
               "nbl": ("NBL's linearity ranking", "attention layers")}
    merged: dict[str, dict] = {}
    for part in parts:
        for model, result in part["models"].items():
            merged.setdefault(model, {}).update(result)
    lines = []
    for model, result in merged.items():
        for key, (title, what) in studies.items():
            study = result.get(key)
            if not study:
                continue
            texts = list(result["original"])
            # candidates that built the same model (the same span or layers) share a row; maps never do
            groups: dict[tuple[str, str], list[dict]] = {}
            measured = [row for row in study["rows"] if "perplexity" in row]  # a refused candidate has none
            for row in measured:
                if "layers" in row:
                    placed = _span(row["layers"])
                elif "blocks" in study:
                    placed = _span(list(range(row["start"], row["start"] + study["blocks"])))
                else:
                    placed = f"from block {row['start']}"
                groups.setdefault((placed, row["candidate"] if key in ("estimator", "fold") else ""), []).append(row)
            first = measured[0]
            budget = study["blocks"] if "blocks" in study else len(first["layers"])
            removed = "attention layers" if key == "nbl" else "blocks"
            lines += [f"### {model.split(':')[0]}, {budget} {removed}: {title} (default `{study['default']}`)", "",
                      f"| candidates | {what} | " + " | ".join(texts) + " |", "|---|---|" + "---|" * len(texts),
                      "| original | - | " + " | ".join(f"{result['original'][t]:.2f}" for t in texts) + " |"]
            best = {t: min(row["perplexity"][t] for row in measured) for t in texts}
            for (placed, _), rows in groups.items():
                names = ", ".join((f"**{r['candidate']}** (default)" if r["candidate"] == study["default"] else r["candidate"])
                                  + (f" ({r['regime']})" if r.get("regime") and r["regime"] != r["candidate"] else "")
                                  for r in rows)
                cells = [f"**{rows[0]['perplexity'][t]:.2f}**" if rows[0]["perplexity"][t] == best[t]
                         else f"{rows[0]['perplexity'][t]:.2f}" for t in texts]
                lines.append(f"| {names} | {placed} | " + " | ".join(cells) + " |")
            lines += [f"| {row['candidate']} | - | refused: {row['refused']} |" + " |" * (len(texts) - 1)
                      for row in study["rows"] if "refused" in row]
            lines.append("| default / best | - | " + " | ".join(
                f"{study['verdict'][t]['default_over_best']:.3f}" for t in texts) + " |")
            lines.append("")
    return "\n".join(lines + _footer(parts))


def _measured(run: dict, results: dict) -> str:
    """Which run measured a row: its recipe version and commit, or that it predates both."""
    if run.get("recipe") and "provenance" in results:
        return f"recipe v{run['recipe']['recipe_version']}, `{results['provenance']['commit'][:7]}`"
    return "recipe v2, before provenance"


def render_replaceme_quality(results: dict) -> str:
    """Issue #2: plain removal and each estimator on a fixed span, and the span selection."""
    lines = [f"{results['model']}, {results['blocks']} blocks; calibration {results['calibration']['sequences']} × "
             f"{results['calibration']['sequence_length']} tokens, packing of recipe version {results.get('packing', 2)}.", "",
             "| run | removed blocks (0-based) | WikiText-2 ppl | relative fit error ‖XT−Y‖²/‖Y‖² | measured |",
             "|---|---|---|---|---|",
             f"| original | - | **{results['original']:.2f}** | - | - |"]
    for run in results["runs"]:
        estimator, where = run["run"].split("@")
        span = _span(run["removed_blocks"])
        settings = (run.get("recipe") or {}).get("settings", {})
        if estimator == "cosine" and settings:
            estimator = (f"cosine (L-BFGS from lstsq, {settings['cosine']['steps']} iterations, "
                         f"{settings['cosine']['max_tokens']:,}-token subsample)")
        if where == "fixed":
            label = f"plain removal of {span}" if estimator == "identity" else f"{estimator} on {span}"
        else:
            label = f"{estimator}, span selected by `{settings['criterion']}`" if settings else \
                f"{estimator}, span selected by the default criterion of its day (not recorded)"
        lines.append(f"| {label} | {span} | **{run['perplexity']:.2f}** | {run['relative_fit_error']:.4f} | "
                     f"{_measured(run, results)} |")
    return "\n".join(lines + ([""] + [_provenance_line(results["provenance"])] if "provenance" in results else []))


def render_cosine(results: dict) -> str:
    """Issue #2: what the cosine objective does to the residual's scale, against lstsq."""
    lines = ["| map | mean cosine distance | relative squared error | predicted / target norm, median | "
             "same, top-1 % norm tokens | WikiText-2 ppl |", "|---|---|---|---|---|---|"]
    for label, row in results.items():
        if label == "provenance":
            continue
        held = row["held_out"]
        lines.append(f"| {label} | {held['mean_cosine_distance']:.4f} | {held['relative_squared_error']:.4f} | "
                     f"{held['median_norm_ratio']:.3f} | {held['norm_ratio_top1pct_tokens']:.3f} | {row['perplexity']:.2f} |")
    footer = _provenance_line(results["provenance"]) if "provenance" in results else \
        "Recipe version 2's packing, from an invocation that recorded no provenance."
    return "\n".join(lines + ["", footer])


_METHOD_NAMES = {"nbl": "NBL", "drop-attn": "DROP-attn", "replaceme": "ReplaceMe", "nbl-block": "NBL-block",
                 "uidl": "UIDL", "drop-block": "DROP-block", "sleb": "SLEB"}
_ATTENTION_ORDER = ["nbl-cosine", "nbl-stream", "nbl-nmse", "nbl-cca", "drop-attn"]
_BLOCK_ORDER = ["replaceme", "nbl-block", "nbl-block:cosine", "nbl-block:cca", "uidl", "drop-block", "sleb"]


def _ranking(run: dict) -> tuple[str, str | None]:
    """(method, ranking criterion) of a bench/nbl_baselines.py run: from its recorded recipe, else (runs
    from before recipes were recorded) from the run's name where the name carries it."""
    recipe = run.get("recipe")
    if recipe:
        settings = recipe["settings"]
        return recipe["method"], settings.get("linearity_criterion") or settings.get("criterion")
    method = run["method"]
    if method.startswith("nbl-") and method != "nbl-block":
        return "nbl", method.removeprefix("nbl-")
    return method, None


def _default_of_its_version(run: dict, method: str, field: str) -> str:
    """The ranking a run's recipe version used by default (its migration to today's version fills it
    in), so a row stays labelled with the default it ran under after a default changes."""
    from blockfold.recipe import Recipe

    # runs from before recipes were recorded ran under version 2's defaults
    recipe = run.get("recipe") or {"recipe_version": 2, "method": method, "settings": {}}
    settings = {key: value for key, value in recipe["settings"].items() if key != field}
    return getattr(Recipe.parse({**recipe, "settings": settings}).settings, field)


def _run_label(run: dict) -> str:
    from blockfold.settings import SETTINGS

    method, criterion = _ranking(run)
    name = _METHOD_NAMES.get(method, method)
    if method in ("drop-attn", "drop-block", "sleb"):  # no ranking to name
        return name
    if criterion is None:
        return f"{name} (ranking not recorded)"
    field = "linearity_criterion" if "linearity_criterion" in SETTINGS[method].model_fields else "criterion"
    default = _default_of_its_version(run, method, field)
    estimator = (run.get("recipe") or {}).get("settings", {}).get("estimator")
    return f"{name} ({', '.join(filter(None, [estimator, criterion, 'default' if criterion == default else None]))})"


def render_nbl(parts: list[dict]) -> str:
    """Issue #3's table of NBL and the baselines, merged from the runs of several invocations: a later
    file's run replaces an earlier run of the same name; each row says which run measured it."""
    runs, sources = {}, {}
    for index, part in enumerate(parts):
        for run in part["runs"]:
            runs[run["run"]] = run
            sources[run["run"]] = index
    first = parts[0]
    length = next(int(key.rsplit("_", 1)[1]) for key in next(iter(runs.values())) if key.startswith("prefill_speedup_"))

    def order(run: dict) -> tuple:
        name = run["run"].split(" ")[0]
        if "k" in run:
            return (0, run["k"], _ATTENTION_ORDER.index(name) if name in _ATTENTION_ORDER else 99)
        return (1, run["blocks"], _BLOCK_ORDER.index(name) if name in _BLOCK_ORDER else 99)

    lines = [f"| method (ranking) | budget | layers (0-based) | WikiText-2 ppl | sparsity | prefill speed-up @ {length} | "
             "decode speed-up | KV cache / original | measured |", "|---|---|---|---|---|---|---|---|---|",
             f"| original | - | - | {first['original']['perplexity']:.2f} | 0 | 1.00 | 1.00 | 1.000 | - |"]
    for run in sorted(runs.values(), key=order):
        budget = f"{run['k']} attention" if "k" in run else f"{run['blocks']} blocks"
        tokens = run.get("calibration_tokens")
        if tokens and tokens != first["calibration"]["tokens"]:
            budget += f" ({tokens:,} calibration tokens)"
        measured = _measured(run, parts[sources[run["run"]]])
        lines.append(f"| {_run_label(run)} | {budget} | {_span(run['layers'])} | {run['perplexity']:.2f} | "
                     f"{run['sparsity']:.3f} | {run[f'prefill_speedup_{length}']:.2f} | {run['decode_speedup']:.2f} | "
                     f"{run['kv_cache_ratio']:.3f} | {measured} |")
    lines.append("")
    for part in parts:
        used = sum(1 for index in sources.values() if parts[index] is part)
        if used and "provenance" in part:
            lines.append(f"- {used} row{'s' * (used != 1)}: {_provenance_line(part['provenance'])}")
        elif used:
            lines.append(f"- {used} row{'s' * (used != 1)}: an earlier invocation that recorded no provenance "
                         "(recipe version 2 packing)")
    return "\n".join(lines)


def _weights_difference(difference: dict) -> str:
    if not difference["differing"]:
        return "identical weights"
    return (f"{difference['tensors'] - difference['differing']} of {difference['tensors']} tensors identical, the "
            f"fitted {difference['differing']} within {difference['max_relative']:.1e} of their largest entry")


def _cache_agreement(pair: dict) -> str:
    if pair["identical_to_uncached"]:
        return "identical to uncached"
    if "difference_to_uncached" in pair:  # recorded since 5a38304
        return f"differs from uncached: {_weights_difference(pair['difference_to_uncached'])}"
    return "differs from uncached (by how much was not recorded)"


def _checkpoint_interval(resume: dict) -> str:
    seconds = resume.get("checkpoint_seconds")  # recorded since the bench set it
    return f" (`--checkpoint-seconds {seconds:g}`)" if seconds is not None else ""


def render_scale_out(results: dict) -> str:
    """Issue #13: two torchrun processes against one, a killed run resumed, the statistics cache."""
    processes, resume = results["processes"], results["resume"]
    one, two = processes["one"], processes["two"]
    lines = [f"{results['model']}, `blockfold compress {results['method']}`, whole commands (interpreter, model load, "
             f"passes, fit, save), {results['threads']} threads in all.", "",
             "| measure | wall time | ratio | output |", "|---|---|---|---|",
             f"| 1 process × {results['threads']} threads | {one['seconds']:.1f} s (pass {one['pass_seconds']:.1f} s) "
             "| 1.00 | - |",
             f"| 2 torchrun processes × {max(1, results['threads'] // 2)} thread (gloo) | {two['seconds']:.1f} s "
             f"(pass {two['pass_seconds']:.1f} s) | {two['seconds'] / one['seconds']:.2f} | "
             f"{_weights_difference(processes['weights'])}, "
             f"{'same' if processes['same_selection'] else 'other'} span |",
             f"| the same command{_checkpoint_interval(resume)} after kill -9 once a checkpoint held "
             f"{resume['killed']['pass_done_at_kill']:.0%} of the pass | {resume['resumed']['seconds']:.1f} s | {resume['resumed_over_fresh']:.2f} | "
             f"{'identical weights' if resume['identical_weights'] else 'weights differ'} |"]
    for pair in results["cache"]:
        lines.append(f"| `{pair['first']}` then `{pair['second']}` through `--stats-cache` | "
                     f"{pair['first_seconds']:.1f} s then {pair['second_seconds']:.1f} s "
                     f"({pair['cached_passes']} of {pair['passes']} passes cached; uncached: "
                     f"{pair['uncached_second_seconds']:.1f} s) | {pair['second_over_first']:.2f} | "
                     f"{_cache_agreement(pair)} |")
    return "\n".join([*lines, "", *_footer([results])])


def _engine_cell(row: dict) -> str:
    if "error" in row:
        reason = row["error"].split(" ", 1)[-1]  # after the model's path
        return "not served: " + reason.split(" (")[0][:100]
    text = f"{row['matching']}/{row['prompts']}"
    if row["gaps_where_parted"]:
        text += f" (parted at gaps {', '.join(f'{gap:.3f}' for gap in sorted(row['gaps_where_parted'])[:3])}"
        text += ", ...)" if len(row["gaps_where_parted"]) > 3 else ")"
    return text


def render_serving(parts: list[dict]) -> str:
    """Issue #14: greedy tokens of vLLM and llama.cpp against transformers, throughput, the GGUF round trip."""
    results = {**parts[0], "models": [entry for part in parts for entry in part["models"]]}
    lines = [f"Greedy tokens equal to transformers' (float32) on {results['prompts']} prompts × "
             f"{results['new_tokens']} new tokens (where some differ: transformers' top-2 logit gap at the first "
             "differing token), and throughput relative to the original in the same engine "
             "(prefill / decode; vLLM: the 20 prompts batched, llama.cpp: one at a time, "
             f"{results['threads']} threads); for vLLM also the tokens its KV cache holds in the same reserved "
             "memory (more where layers keep no KV cache).", ""]
    for entry in results["models"]:
        engines = list(entry["variants"][0]["engines"])
        lines += [f"**{entry['model']}**", "", "| variant | " + " | ".join(engines) + " |",
                  "|---|" + "---|" * len(engines)]
        baseline = entry["variants"][0]["engines"]
        for variant in entry["variants"]:
            cells = []
            for engine in engines:
                row, base = variant["engines"][engine], baseline[engine]
                cell = _engine_cell(row)
                if "error" not in row and "error" not in base:
                    cell += (f"; {row['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}x / "
                             f"{row['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x")
                    if row.get("kv_cache_tokens") and base.get("kv_cache_tokens"):
                        cell += f"; KV cache {row['kv_cache_tokens'] / base['kv_cache_tokens']:.2f}x tokens"
                    if variant is entry["variants"][0]:
                        cell += (f" ({row['prefill_tokens_per_s']:.0f} / {row['decode_tokens_per_s']:.1f} tok/s"
                                 + (f", {row['kv_cache_tokens']:,} tokens" if row.get("kv_cache_tokens") else "")
                                 + ")")
                cells.append(cell)
            lines.append(f"| {variant['variant']} | " + " | ".join(cells) + " |")
        trip = entry["round_trip"]
        lines += ["", f"GGUF round trip ({trip['windows']} WikiText-2 windows of 512 tokens, llama.cpp): "
                  f"`{trip['source_gguf']}` ({trip['source_mb']:.0f} MB) perplexity {trip['source_perplexity']:.2f}; "
                  f"{entry['variants'][1]['variant']} exported with `--quant source` ({trip['exported_mb']:.0f} MB) "
                  f"{trip['round_trip_perplexity']:.2f}.", ""]
    lines += _footer(parts)
    for part in parts:
        if "llamacpp" in part:
            lines += ["", *_render_llamacpp_export(part["llamacpp"])]
    return "\n".join(lines)


def _tokens_cell(row: dict) -> str:
    return f"{_engine_cell(row)}; tokenization {row['tokenization_agrees']}/{row['prompts']}"


def _rate_cell(row: dict, base: dict, key: str) -> str:
    text = f"{row[key]:.0f}" if row[key] >= 100 else f"{row[key]:.1f}"
    return text if row is base else f"{text} (**{row[key] / base[key]:.2f}x**)"


def _render_llamacpp_export(results: dict) -> list[str]:
    """Issue #14's llama.cpp items: export from plain Hugging Face folders, fresh K-quant files, and
    throughput from llama.cpp's own counters."""
    lines = ["### llama.cpp: export from a plain Hugging Face folder, fresh K-quants, throughput inside llama.cpp", "",
             "Each model's converted folder without its record of the source GGUF (so `blockfold export` builds "
             "llama.cpp's metadata from config.json and tokenizer.json), and ReplaceMe compressed from that folder "
             "(same calibration as above), exported at each type from the folder. Greedy tokens against transformers "
             f"(float32) on the same {results['prompts']} prompts × {results['new_tokens']} new tokens, with "
             "llama.cpp's tokenization of the same texts; perplexity on the round trip's "
             f"{results['ppl_windows']} WikiText-2 windows of 512 tokens; prefill (64-token prompts) and decode "
             "tokens/s from llama.cpp's own performance counters (time inside its decode calls, "
             f"{results['threads']} threads, one prompt at a time after an untimed warm-up), the fastest of "
             f"{results['throughput_rounds']} runs taken in turn with the original's"
             + (f", each started once the machine was {results['idle_share']:.0%} idle" if "idle_share" in results
                else "") + "; ratios against the original at the same type.", ""]
    for entry in results["models"]:
        variants = entry["variants"]
        base = variants[0]["exports"]
        trip = entry["round_trip"]
        origin = "no GGUF record" if not entry["source_has_gguf_record"] else "a GGUF record (not a plain folder)"
        same = "the same weights, bit for bit, as" if entry["same_weights_as_from_gguf"] else "other weights than"
        lines += [f"**{entry['model']}** ({variants[1]['variant']} compressed from the plain folder: its manifest's "
                  f"source has {origin}; {same} compressed from the GGUF-converted folder)", "",
                  "| variant | export | GGUF | greedy tokens | WikiText-2 ppl | prefill tok/s | decode tok/s | "
                  "timed in Python: prefill / decode tok/s |", "|---|---|---|---|---|---|---|---|"]
        for quant in base:
            for variant in variants:
                row = variant["exports"][quant]
                python = [max(one[f"python_{key}"] for one in row["throughput_rounds"])
                          for key in ("prefill_tokens_per_s", "decode_tokens_per_s")]
                lines.append(f"| {variant['variant']} | `--quant {quant}` from the folder | {row['gguf_mb']:.0f} MB | "
                             f"{_tokens_cell(row)} | {row['perplexity']:.2f} | "
                             f"{_rate_cell(row, base[quant], 'prefill_tokens_per_s')} | "
                             f"{_rate_cell(row, base[quant], 'decode_tokens_per_s')} | "
                             f"{python[0]:.0f} / {python[1]:.1f} |")
        lines += [f"| original | `{trip['source_gguf']}` (the source) | {trip['source_mb']:.0f} MB | - | "
                  f"{trip['source_perplexity']:.2f} | - | - | - |",
                  f"| {variants[1]['variant']} from the GGUF | `--quant source` | {trip['exported_mb']:.0f} MB | - | "
                  f"{trip['round_trip_perplexity']:.2f} | - | - | - |", ""]
    return [*lines, *_footer([results])]


def render_quantized_input(results: dict) -> str:
    """Issue #14: a bitsandbytes 4-bit checkpoint compressed as it runs, beside the float model with the same recipe."""
    rows = results["rows"]
    recipe = results.get("recipe") or {}
    lines = [f"{results['model']}, ReplaceMe {results['blocks']} blocks with recipe version "
             f"{recipe.get('recipe_version')}'s defaults (calibration: {recipe.get('calibration', {}).get('source')}, "
             f"{recipe.get('calibration', {}).get('max_documents')} documents), from the float checkpoint and from its "
             "NF4 copy (quantized by transformers on load and saved); WikiText-2 perplexity on the first "
             f"{results['ppl_windows']} windows of 512 tokens.", "",
             "| checkpoint | model | removed blocks | weight files | WikiText-2 ppl | ratio to its original | "
             "compress time | stored unquantized |", "|---|---|---|---|---|---|---|---|"]
    originals = {row["precision"]: row for row in rows if row["model"] == "original"}
    for row in rows:
        original = originals[row["precision"]]
        compressed = row["model"] != "original"
        seconds = f"{row['compress_seconds']:.0f} s" if compressed else "-"
        lines.append(f"| {row['precision']} | {row['model']} | {_span(row['removed_blocks']) if compressed else '-'} | "
                     f"{row['weight_bytes'] / 1e6:.0f} MB | {row['perplexity']:.2f} | "
                     f"{row['perplexity'] / original['perplexity']:.2f}x | "
                     f"{seconds} | "
                     f"{', '.join(row.get('skip_modules') or []) or '-'} |")
    return "\n".join([*lines, "", *_footer([results])])


def render_compressed_tensors_input(parts: list[dict]) -> str:
    """Issue #45: a GPTQ W4A16 checkpoint (compressed-tensors) compressed as it is, beside its float model; the
    vLLM checks of a ``--serve-only`` file replace the first run's, and a ``--in-memory`` file adds the row of
    the quantized ReplaceMe before its edited layers were quantized again."""
    results, *more = parts
    checks = {row["model"]: row["vllm"] for part in more for row in part["rows"] if "vllm" in row}
    in_memory = {row["model"]: row for part in more for row in part["rows"] if "edits" in row}
    quantization = results["source_quantization"]["config_groups"]["group_0"]["weights"]
    lines = [f"{results['float_model']} quantized to {quantization['num_bits']} bits per weight, groups of "
             f"{quantization['group_size']}, {'symmetric' if quantization['symmetric'] else 'with zero points'} "
             f"(`{results['source']}`, built by `scripts/quantize-w4a16.sh`: llm-compressor GPTQ), and the float model "
             f"it was quantized from, each compressed with the same recipes; WikiText-2 perplexity on the first "
             f"{results['ppl_windows']} windows of 512 tokens.", "",
             "| checkpoint | model | removed blocks / replaced attention | weight files | WikiText-2 ppl | ratio to its "
             "original | quantized layers: as stored / quantized again | stored in float (`ignore`) | vLLM greedy tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    originals = {row["precision"]: row for row in results["rows"] if row["model"] == "original"}
    for row in results["rows"]:
        compressed = row["model"] != "original"
        cut = (_span(row.get("removed_blocks") or []) if row.get("removed_blocks")
               else f"attention {_span((row.get('replaced') or {}).get('layers') or [])}" if compressed else "-")
        layers = f"{row['as_stored']} / {len(row['quantized_again'])}" if "as_stored" in row else "-"
        floats = ", ".join(f"`{name}`" for name in _grouped_layers(row.get("ignore") or [])) or "-"
        serve = checks.get(row["model"], row.get("vllm")) if row["precision"] == "w4a16" else None
        served = (serve["summary"].split(":", 1)[1].split(";")[0].strip() if serve and ":" in serve["summary"]
                  else (serve or {}).get("summary", "-"))
        gaps = [float(re.search(r"gap there: ([0-9.]+)", line).group(1)) for line in (serve or {}).get("differences", [])]
        served += f"; where they part, transformers' top-2 gap ≤ {max(gaps):.3f}" if gaps else ""
        lines.append(f"| {row['precision']} | {row['model']} | {cut} | {row['weight_bytes'] / 1e6:.0f} MB | "
                     f"{row['perplexity']:.2f} | {row['perplexity'] / originals[row['precision']]['perplexity']:.2f}x | "
                     f"{layers} | {floats} | {served} |")
        unwritten = in_memory.get(row["model"]) if row["precision"] == "w4a16" else None
        if unwritten is not None:
            assert unwritten["removed_blocks"] == row["removed_blocks"], "the in-memory run removed other blocks"
            lines.append(f"| w4a16 | {row['model']}, edited layers in float (in memory, before writing) | {cut} | - | "
                         f"{unwritten['perplexity']:.2f} | "
                         f"{unwritten['perplexity'] / originals['w4a16']['perplexity']:.2f}x | - | - | - |")
    return "\n".join([*lines, "", *_footer(parts)])


def _grouped_layers(names: list[str]) -> list[str]:
    """Layer names with the same module in several blocks as one, ``model.layers.{5,6}.self_attn.linear``."""
    grouped: dict[str, list[str]] = {}
    for name in names:
        found = re.match(r"(.*\.layers\.)(\d+)(\..*)", name)
        key = f"{found.group(1)}{{}}{found.group(3)}" if found else name
        grouped.setdefault(key, []).append(found.group(2) if found else "")
    return [key.replace("{}", "{" + ",".join(blocks) + "}") if "{}" in key else key for key, blocks in grouped.items()]


def _perplexity(value: float) -> str:
    return f"{value:.2f}" if value < 1e5 else f"{value:.1e}"


def _method_label(row: dict) -> str:
    """The row's method spec; a ReplaceMe row that refitted nothing says so (recipe version 8 refits by
    default), one that refitted under a default other than today's ``all`` (version 10) names it, and one
    that refitted without the stream scale, which version 9 fits by default, says so too (a model whose
    blocks could not be refitted ran the same whatever the refit). A row that left sandwich blocks alone
    (before version 11 corrected their inputs by default) says so."""
    if row["method"].split(":")[0] != "replaceme":
        return row["method"]
    settings = (row.get("recipe") or {}).get("settings") or {}
    if settings.get("refit", "none") == "none":
        return row["method"] + " (no refit)"
    notes, refit = [], row.get("refit") or {}
    refitted = any("skipped" not in entry for entry in refit.get("blocks", []))
    if refitted and "refit=" not in row["method"] and settings["refit"] != "all":
        notes.append(f"refit {settings['refit']}")
    if refitted and not settings.get("refit_scale", False):
        notes.append("no scale")
    sandwich_left = any(entry.get("skipped") == SANDWICH_SKIPPED for entry in [refit, *refit.get("blocks", [])])
    if sandwich_left and not settings.get("refit_sandwich", False) and "refit_sandwich=" not in row["method"]:
        notes.append("no sandwich inputs")
    return row["method"] + (f" ({', '.join(notes)})" if notes else "")


def render_new_methods(parts: list[dict], keep: Callable[[dict], bool] | None = None) -> str:
    """Issue #16: the new methods beside the baselines, one table per model and budget (rows from every
    run of it that ``keep`` accepts, each compress time in passes of its own run), perplexity on the
    reported and held-out texts."""
    groups: dict[tuple, list[dict]] = {}
    for results in parts:
        groups.setdefault((results["model"], results["blocks"]), []).append(results)
    lines = []
    for (model, blocks), runs in groups.items():
        first = runs[0]
        texts = list(first["original"]["perplexity"])
        calibration = first["calibration"]
        lines += [f"### {model}, {blocks} blocks removed", "",
                  f"Calibration {calibration.get('source')} ({calibration.get('sequences')} x "
                  f"{calibration.get('sequence_length')} tokens). Compress cost in passes of the calibration set "
                  "through the original: block forwards counted by hooks (machine-independent), and wall time over "
                  "one pass timed in the same run (this machine).", "",
                  "| method | removed blocks | " + " | ".join(texts) + " | block forwards | wall time | parameters |",
                  "|---|---|" + "---|" * len(texts) + "---|---|---|",
                  "| original | - | " + " | ".join(_perplexity(first['original']['perplexity'][t]) for t in texts)
                  + f" | - | - | {first['original']['parameters'] / 1e6:.1f} M |"]
        for results in runs:
            for row in results["rows"]:
                if keep is not None and not keep(row):
                    continue
                forwards = f"{row['forward_passes']:.2f}" if "forward_passes" in row else "-"
                lines.append(f"| {_method_label(row)} | {_span(row['removed_blocks'])} | "
                             + " | ".join(_perplexity(row['perplexity'][t]) for t in texts)
                             + f" | {forwards} | {row['compress_passes']:.1f} | {row['parameters'] / 1e6:.1f} M |")
        lines += ["", *_footer(runs), ""]
    return "\n".join(lines).rstrip()


def render_refit(parts: list[dict]) -> str:
    """Issue #16 item 2: ReplaceMe with and without the downstream refit, every variant tried, per budget."""
    return render_new_methods(parts, keep=lambda row: row["method"].split(":")[0] == "replaceme")


def render_refit_stage(parts: list[dict]) -> str:
    """Issue #42: every block-removal method as its paper runs it and with the refit stage after it, on the
    same blocks: held-out perplexity per text (the ratio is plain over refitted) and harness relative
    performance. Runs of one model and budget (perplexity and accuracy runs, a run continued in a second
    one) make one table; a method's rows merge across them."""
    lines = []
    runs: dict[tuple, list[dict]] = {}
    for results in parts:
        runs.setdefault((results["model"], results["blocks"]), []).append(results)
    for _, same in sorted(runs.items(), key=lambda run: (run[0][0] != "smollm2-135m", run[0])):
        measured = [results for results in same if "perplexity" in results["original"]]
        if not measured:
            continue
        results = measured[0]
        texts = [text for text in results["original"]["perplexity"] if "held out" in text]
        rows = {row["method"]: row for part in measured for row in part["rows"] if "perplexity" in row}
        scored = {row["method"]: row for part in same for row in part["rows"] if "relative_performance" in row}
        pairs = [(name, plain, rows[twin]) for name, plain in rows.items() if "refit=" not in name
                 and (twin := f"{name};refit=all" if ":" in name else f"{name}:refit=all") in rows]
        if not pairs:  # a baseline run whose refit rows are not measured yet
            continue
        lines += [f"### {results['model']}, {results['blocks']} blocks removed", "",
                  "| method | removed blocks | " + " | ".join(f"{text}: plain → refit" for text in texts)
                  + " | RP ± se: plain → refit | block forwards: plain → refit |",
                  "|---|---|" + "---|" * len(texts) + "---|---|",
                  "| original | - | " + " | ".join(_perplexity(results["original"]["perplexity"][t]) for t in texts)
                  + " | 1 | - |"]
        for name, plain, refitted in pairs:
            assert plain["removed_blocks"] == refitted["removed_blocks"], name
            cells = [f"{_perplexity(plain['perplexity'][t])} → **{_perplexity(refitted['perplexity'][t])}** "
                     f"({plain['perplexity'][t] / refitted['perplexity'][t]:.1f}x)" for t in texts]
            if name in scored and refitted["method"] in scored:  # accuracy from the runs that measured it
                for row in (plain, refitted):  # the same blocks as the perplexity run's
                    assert scored[row["method"]]["removed_blocks"] == row["removed_blocks"], row["method"]
                rp = [scored[row["method"]]["relative_performance"]["average"] for row in (plain, refitted)]
                cells.append(f"{rp[0]['rp']:.3f} ± {rp[0]['stderr']:.3f} → **{rp[1]['rp']:.3f}** ± {rp[1]['stderr']:.3f}")
            else:
                cells.append("-")
            forwards = " → ".join(f"{row['forward_passes']:.2f}" if "forward_passes" in row else "-"
                                  for row in (plain, refitted))  # runs before their count have none
            lines.append(f"| {name} | {_span(plain['removed_blocks'])} | " + " | ".join(cells) + f" | {forwards} |")
        lines += ["", *_footer(same), ""]
    return "\n".join(lines).rstrip()


def render_width(parts: list[dict]) -> str:
    """Issue #44: the width baselines beside the depth methods at about the same parameter count, held-out
    perplexity per text, the share of the model's parameters removed and the block forwards compress ran.
    Rows of one model merge across runs (a method measured twice keeps its last run); sorted by the first
    held-out text."""
    lines = []
    runs: dict[str, list[dict]] = {}
    for results in parts:
        runs.setdefault(results["model"], []).append(results)
    for model, same in runs.items():
        original = same[0]["original"]
        texts = [text for text in original["perplexity"] if "held out" in text]
        rows = {row["method"]: row for part in same for row in part["rows"]}
        lines += [f"### {model}", "",
                  "| method | what goes | parameters | sparsity (model) | " + " | ".join(texts) + " | block forwards |",
                  "|---|---|---|---|" + "---|" * len(texts) + "---|",
                  f"| original | - | {original['parameters'] / 1e6:.1f} M | - | "
                  + " | ".join(_perplexity(original["perplexity"][text]) for text in texts) + " | - |"]
        for name, row in sorted(rows.items(), key=lambda item: item[1]["perplexity"][texts[0]]):
            recipe = row["recipe"]["settings"]
            if row.get("sliced") or "slicing" in recipe:
                what = f"hidden size sliced by {recipe['slicing']:.0%}"
            elif "sparsity" in recipe:
                what = f"{recipe['sparsity']:.1%} of the blocks' projection weights"
            else:
                what = f"blocks {_span(row['removed_blocks'])}"
            forwards = f"{row['forward_passes']:.2f}" if "forward_passes" in row else "-"
            lines.append(f"| {name} | {what} | {row['parameters'] / 1e6:.1f} M | "
                         f"{1 - row['parameters'] / original['parameters']:.1%} | "
                         + " | ".join(_perplexity(row["perplexity"][text]) for text in texts) + f" | {forwards} |")
        lines += ["", *_footer(same), ""]
    return "\n".join(lines).rstrip()


def render_one_pass(parts: list[dict]) -> str:
    """Issue #46: the default compress's cost in block forwards (exact) and in plain forward passes (wall
    time, each run against its own), per code version, and how far the versions' weights differ."""
    lines = ["| commit | method | removed blocks | block forwards | passes | compress time / one plain forward "
             "| the refit's original streams |", "|---|---|---|---|---|---|---|"]
    def label(row: dict) -> str:
        chunk = row.get("chunk_sequences")
        return row["method"] + (f" ({chunk} sequences per forward)" if chunk else "")

    for results in parts:
        commit = results["provenance"]["commit"].split("+")[0][:7]
        for row in results["rows"]:
            lines.append(f"| `{commit}` | {label(row)} | {_span(row['removed_blocks'])} | {row['block_forwards']:.2f} "
                         f"| {row['passes']} | {row['compress_in_plain_forwards']:.2f} "
                         f"| {row['refit_original_streams'] or '-'} |")
    first = {row["method"]: row for row in parts[0]["rows"]}
    for results in parts[1:]:
        for row in results["rows"]:
            reference = first.get(row["method"])
            if reference is None or reference["removed_blocks"] != row["removed_blocks"]:
                continue
            worst = max(abs(value - reference["weights"][name]) / max(reference["weights"][name], 1e-30)
                        for name, value in row["weights"].items())
            lines.append(f"\n{label(row)} at `{results['provenance']['commit'][:7]}` against "
                         f"`{parts[0]['provenance']['commit'][:7]}`: every tensor's Σ|w| within {worst:.1e} (relative).")
    return "\n".join([*lines, "", *_footer(parts)])


def render_block_forwards(parts: list[dict]) -> str:
    """Issue #46: every method's default (and the variants that re-run the model) in block forwards, per
    code version side by side (runs of one version merge), and what the last version's ``--dry-run``
    plans; a row whose blocks differ between versions says so."""
    versions: dict[str, dict] = {}
    for results in parts:
        versions.setdefault(results["provenance"]["commit"].split("+")[0][:7], {}).update(
            {row["method"]: row for row in results["rows"]})
    header = " → ".join(f"`{commit}`" for commit in versions)
    last = list(versions.values())[-1]
    lines = [f"| method | removed blocks | passes ({header}) | block forwards ({header}) | planned by `--dry-run` |",
             "|---|---|---|---|---|"]
    for method in dict.fromkeys(name for rows in versions.values() for name in rows):
        present = [rows[method] for rows in versions.values() if method in rows]
        blocks = {_span(row["removed_blocks"]) for row in present}
        planned = last.get(method, {}).get("planned_block_forwards")
        lines.append(f"| {method} | {' / '.join(sorted(blocks)) if len(blocks) > 1 else blocks.pop()} | "
                     + " → ".join(str(rows[method]["passes"]) if method in rows else "-" for rows in versions.values())
                     + " | " + " → ".join(f"{rows[method]['block_forwards']:.2f}" if method in rows else "-"
                                          for rows in versions.values())
                     + f" | {'-' if planned is None else f'{planned:.2f}'} |")
    return "\n".join([*lines, "", *_footer(parts)])


def render_span_count_search(parts: list[dict]) -> str:
    """ReplaceMe ``--spans auto``: the blocks each span count removes and its model's calibration loss,
    the count kept, and the kept model's perplexity on the chosen and held-out texts."""
    counts = sorted({int(count) for results in parts for row in results["rows"]
                     for count in row["span_count_search"]["candidates"]})
    texts = list(parts[0]["original"]["perplexity"])
    lines = ["Each count's model built on a copy with the row's settings; the loss is its mean next-token loss on "
             "the sequences it was scored on (held out: the last eighth of the calibration, fitted without them; "
             "fitting tokens: all of them, fitted on them), the only figure the choice reads. Perplexity of the kept "
             "model; block forwards in passes of the calibration set (every candidate, its loss and the final build).",
             "", "| model | blocks | refit | scored on | " + " | ".join(f"{count} span{'s' if count > 1 else ''}: "
                                                                      "blocks, loss" for count in counts)
             + " | kept | " + " | ".join(texts) + " | block forwards |",
             "|---|---|---|---|" + "---|" * len(counts) + "---|" + "---|" * len(texts) + "---|"]
    for results in parts:
        for row in results["rows"]:
            search = row["span_count_search"]
            cells = []
            for count in counts:
                entry = search["candidates"].get(str(count))
                cells.append(f"{', '.join(entry['spans'])}: {entry['mean_nll']:.4f}" if entry else "-")
            scored_on = "held out" if "held-out" in search["measure"] else "fitting tokens"
            refit = row["recipe"]["settings"]["refit"]
            if row.get("refit", {}).get("skipped"):  # e.g. sandwich blocks: the setting asked, nothing refitted
                refit = f"{refit} (skipped: {row['refit']['skipped']})"
            lines.append(f"| {results['model']} | {results['blocks']} | {refit} | "
                         f"{scored_on} | " + " | ".join(cells) + f" | {search['chosen']} | "
                         + " | ".join(_perplexity(row['perplexity'][t]) for t in texts)
                         + f" | {row['forward_passes']:.2f} |")
    return "\n".join([*lines, "", *_footer(parts)])


def render_accuracy(parts: list[dict]) -> str:
    """Issue #16: every method's harness accuracy and relative performance (accuracy over the
    original's, averaged over the tasks), one table per model, budget and harness setting, rows from
    every run of it (a run that took its original from another, ``--original-from``, joins that table)."""
    groups: dict[tuple, list[dict]] = {}
    for results in parts:
        key = (results["model"], results["blocks"], tuple(results["tasks"]), results["limit"],
               results.get("eval_dtype", "bfloat16"))
        groups.setdefault(key, []).append(results)
    lines = []
    for (model, blocks, tasks, limit, dtype), runs in groups.items():
        original = runs[0]["original"]["accuracy"]

        def accuracies(accuracy: dict) -> list[float]:
            return [accuracy[task]["metrics"]["acc"] for task in tasks]

        if any(accuracies(results["original"]["accuracy"]) != accuracies(original) for results in runs):
            raise ValueError(f"the runs of {model} at {blocks} blocks measured different originals; their rows "
                             "cannot share one table")
        calibration = runs[0]["calibration"]
        lines += [f"#### {model}, {blocks} blocks removed", "",
                  f"Harness accuracy (`acc`, 0-shot, the first {limit} examples of each task, a {dtype} copy of each "
                  "model). RP: relative performance, each task's accuracy over the original's, averaged over the "
                  f"tasks, ± its standard error. Calibration {calibration.get('source')} ({calibration.get('sequences')}"
                  f" x {calibration.get('sequence_length')} tokens; SLEB: its own smaller set, see the row's JSON); "
                  "block forwards in passes of each method's calibration set.", "",
                  "| method | removed blocks | " + " | ".join(tasks) + " | mean accuracy | RP | block forwards | parameters |",
                  "|---|---|" + "---|" * len(tasks) + "---|---|---|---|",
                  "| original | - | " + " | ".join(f"{value:.3f}" for value in accuracies(original))
                  + f" | {sum(accuracies(original)) / len(tasks):.3f} | 1 | - | "
                  f"{runs[0]['original']['parameters'] / 1e6:.1f} M |"]
        for results in runs:
            for row in results["rows"]:
                values, rp = accuracies(row["accuracy"]), row["relative_performance"]["average"]
                lines.append(f"| {_method_label(row)} | {_span(row['removed_blocks'])} | "
                             + " | ".join(f"{value:.3f}" for value in values)
                             + f" | {sum(values) / len(tasks):.3f} | {rp['rp']:.3f} ± {rp['stderr']:.3f}"
                             + f" | {row['forward_passes']:.2f} | {row['parameters'] / 1e6:.1f} M |")
        lines += ["", *_footer(runs), ""]
    return "\n".join(lines).rstrip()


def render_vision(results: dict) -> str:
    """Issue #15 item 3: each method on an image encoder, its embeddings' agreement with the original's
    and k-NN accuracy on held-out images."""
    images = results["images"]
    source = Path(images["source"]).name if "/" in images["source"] else images["source"]
    lines = [f"{results['model']}; calibration: {images['calibration']} images of {source}, evaluation: "
             f"{images['held_out']} others (held out).", "",
             "| method | blocks removed | removed blocks | cosine to the original (mean) | worst image | 5-NN accuracy "
             "| parameters |",
             "|---|---|---|---|---|---|---|",
             f"| original | - | - | 1 | 1 | {results['original']['knn_accuracy']:.3f} | "
             f"{results['original']['parameters'] / 1e6:.1f} M |"]
    for row in results["rows"]:
        agreement = row["agreement"]
        lines.append(f"| {_method_label(row)} | {row['blocks']} | {_span(row['removed_blocks'])} | "
                     f"{agreement['cosine_mean']:.6f} | {agreement['cosine_min']:.6f} | {row['knn_accuracy']:.3f} | "
                     f"{row['parameters'] / 1e6:.1f} M |")
    return "\n".join([*lines, "", *_footer([results])])


def render_serving_moe(parts: list[dict]) -> str:
    """Issue #45 item 3: each engine's greedy tokens against transformers' for compressed mixtures of experts
    (a later results file's rows replace an earlier one's for the same family, variant and engine)."""
    rows = {}
    for results in parts:
        for row in results["rows"]:
            rows[(row["family"], row["variant"], row["engine"])] = row
    lines = ["| family | model | engine | prompts with transformers' greedy tokens | where one parts: transformers' "
             "top-2 logit gap | tokenization agrees | distinct tokens generated |", "|---|---|---|---|---|---|---|"]
    for (family, variant, engine), row in rows.items():
        if "error" in row:
            lines.append(f"| {family} | {variant} | {engine} | error: {row['error']} | - | - | - |")
            continue
        gap = row.get("smallest_gap_where_differs")
        lines.append(f"| {family} | {variant} | {engine} | {row['matching']}/{row['prompts']} | "
                     f"{'-' if gap is None else f'{gap:.1e}'} | {row['tokenization']}/{row['prompts']} | "
                     f"{row['distinct_tokens']} |")
    return "\n".join([*lines, "", *_footer(parts)])


def render_selection(parts: list[dict]) -> str:
    """Issue #16 item 3: each estimator's span under each fit criterion, scored by its own map or by
    lstsq; then which of the two ``span_scoring: compare`` kept, with the perplexities the selection
    study measured for both."""
    lines = []
    measured = {(key, row["estimator"], row["start"]): row["perplexity"]
                for results in parts for key, model in results["models"].items() if "selection" in model
                for row in model["selection"]["rows"]}
    for results in parts:
        for key, model in results["models"].items():
            if "compare" in model:
                lines += _render_scoring_comparison(key, model, measured)
                continue
            study = model["selection"]
            texts = list(model["original"])
            lines += [f"{key.split(':')[0]}, {study['blocks']} blocks, calibration {model['calibration'].get('source')} "
                      f"({model['calibration'].get('sequences')} x {model['calibration'].get('sequence_length')} tokens)", "",
                      "| estimator | criterion | spans scored with | span | " + " | ".join(texts) + " |",
                      "|---|---|---|---|" + "---|" * len(texts),
                      "| original | - | - | - | " + " | ".join(f"{model['original'][t]:.2f}" for t in texts) + " |"]
            for row in study["rows"]:
                lines.append(f"| {row['estimator']} | {row['criterion']} | {row['scored_with']} | "
                             f"{row['start']}-{row['start'] + study['blocks'] - 1} | "
                             + " | ".join(f"{row['perplexity'][t]:.2f}" for t in texts) + " |")
            lines.append("")
        lines += [*_footer([results]), ""]
    return "\n".join(lines).rstrip()


def _render_scoring_comparison(key: str, model: dict, measured: dict) -> list[str]:
    study = model["compare"]
    lines = [f"{key.split(':')[0]}, {study['blocks']} blocks: `span_scoring: compare` (mean next-token loss on "
             "the held-out eighth of the calibration sequences, each span's map fitted without them; "
             "perplexity of each span from the table above)", "",
             "| estimator | criterion | lstsq's span: loss | own map's span: loss | kept | "
             "held-out WikiText-2 of the kept span / of the other |", "|---|---|---|---|---|---|"]
    for row in study["rows"]:
        comparison = row["comparison"]
        if comparison is None:
            span = f"{row['start']}-{row['start'] + study['blocks'] - 1}"
            lines.append(f"| {row['estimator']} | {row['criterion']} | {span} | {span} | the same span, nothing built | - |")
            continue
        (_, lstsq), (_, own) = comparison["candidates"].items()
        kept, other = (lstsq, own) if comparison["chosen"] == "the lstsq map" else (own, lstsq)
        held_out = [measured.get((key, row["estimator"], entry["removed_blocks"][0])) for entry in (kept, other)]
        ratio = ("-" if None in held_out else
                 " / ".join(f"{next(v for t, v in p.items() if 'held out' in t and 'WikiText' in t):.2f}"
                            for p in held_out))
        lines.append(f"| {row['estimator']} | {row['criterion']} | {lstsq['spans'][0]}: {lstsq['mean_nll']:.4f} | "
                     f"{own['spans'][0]}: {own['mean_nll']:.4f} | {'lstsq' if kept is lstsq else 'own'} | {ratio} |")
    return [*lines, ""]


#: section name → (results file or files, renderer); a section renders only where BENCHMARKS.md has its markers
SECTIONS: dict[str, tuple[str | tuple[str, ...], Callable]] = {
    "scale": ("scale.json", render_scale),
    "scale-out": ("scale_out.json", render_scale_out),
    "serving": (("serving.json", "serving_gemma.json"), render_serving),
    "quantized-input": ("quantized_input.json", render_quantized_input),
    "compressed-tensors-input": (("compressed_tensors_input.json", "compressed_tensors_serving.json",
                                  "compressed_tensors_in_memory.json"), render_compressed_tensors_input),
    "new-methods": (("new_methods.json", "new_methods_part2.json", "new_methods_part3.json", "new_methods_gemma_4.json",
                     "new_methods_gemma_4_part2.json", "new_methods_gemma_4_part3.json", "refit_validation_4.json",
                     "new_methods_4.json", "refit_validation_12.json", "refit_validation_12_plain.json", "new_methods_12.json",
                     "new_methods_12_part2.json", "new_methods_gemma_4_part4.json", "new_methods_8_spans.json",
                     "new_methods_4_spans.json"),
                    render_new_methods),
    "refit-stage": (("new_methods.json", "new_methods_4.json", "new_methods_12.json", "refit_stage_8.json",
                     "refit_stage_8b.json", "refit_stage_8c.json", "refit_stage_sleb_8.json", "refit_stage_4.json",
                     "refit_stage_12.json", "refit_stage_4b.json", "new_methods_accuracy.json",
                     "new_methods_accuracy_part2.json", "refit_stage_accuracy_8.json", "new_methods_gemma_4.json",
                     "new_methods_accuracy_gemma_4_part2.json", "refit_stage_gemma_4.json", "new_methods_gemma_4_part2.json",
                     "refit_stage_gemma_4b.json", "refit_stage_gemma_4c.json"),
                    render_refit_stage),
    "width": (("new_methods.json", "refit_stage_8.json", "refit_stage_8b.json", "refit_stage_8c.json", "svd_llm_8.json",
               "slicegpt_per_block_8.json", "slicegpt_shared_8.json"), render_width),
    "one-pass": (("one_pass_before.json", "one_pass_after.json", "one_pass_after2.json", "one_pass_chunks.json"),
                 render_one_pass),
    "block-forwards": (("block_forwards_before.json", "block_forwards_before_part2.json", "block_forwards_after.json"),
                       render_block_forwards),
    "span-count": (("spans_auto_in_sample_12.json", "spans_auto_12.json", "spans_auto_8.json", "spans_auto_4.json",
                    "spans_auto_gemma_4.json", "spans_auto_12_v10.json"), render_span_count_search),
    "selection": (("selection_smollm2_c4.json", "selection_gemma_c4.json", "selection_compare_c4.json"),
                  render_selection),
    "accuracy": (("new_methods_accuracy.json", "new_methods_accuracy_part2.json", "new_methods_accuracy_part3.json",
                  "new_methods_accuracy_part4.json", "new_methods_accuracy_part5.json",
                  "new_methods_accuracy_part6.json", "new_methods_accuracy_part7.json", "new_methods_accuracy_4.json",
                  "new_methods_accuracy_12.json", "new_methods_accuracy_12_spans.json",
                  "new_methods_accuracy_gemma_4.json", "new_methods_accuracy_gemma_4_part2.json",
                  "new_methods_accuracy_gemma_4_part3.json", "new_methods_accuracy_gemma_4_part4.json"),
                 render_accuracy),
    "vision": ("vision.json", render_vision),
    "vision-dinov2": ("vision_dinov2.json", render_vision),
    "serving-moe": (("serving_moe.json", "serving_moe_olmoe.json"), render_serving_moe),
    "refit": (("new_methods_part2.json", "refit_study_part1.json", "refit_study_part2.json", "refit_study_part3.json",
               "refit_study_part4.json", "refit_validation_4.json", "refit_validation_12.json", "refit_validation_12_plain.json",
               "refit_scale_8.json", "refit_scale_4.json", "refit_scale_12.json", "refit_all_8.json", "refit_all_4.json",
               "refit_all_12.json", "refit_levers_8.json", "refit_placement_8.json",
               "refit_early_4.json", "refit_early_12.json", "refit_sandwich_gemma_4.json", "refit_sandwich_gemma_6.json",
               "refit_sandwich_gemma_8.json"),
              render_refit),
    "packing": ("calibration_packing.json", render_packing),
    "healing": (("healing.json", "healing_v3_through_norm.json"), render_healing),
    "gemma": (("gemma_sandwich.json", "gemma_placement.json"), render_gemma),
    "fold-choice": ("sandwich_fold_choice.json", render_fold_choice),
    "nbl": (("nbl_baselines.json", "nbl_baselines_part2.json", "nbl_baselines_part3.json", "nbl_baselines_part4.json"),
            render_nbl),
    "nbl-gemma": (("nbl_gemma.json",), render_nbl),
    "replaceme-quality": ("replaceme_quality.json", render_replaceme_quality),
    "cosine": ("cosine_vs_lstsq.json", render_cosine),
    "defaults": (("defaults_validation.json", "defaults_validation_estimators.json", "defaults_validation_gemma_bos.json",
                  "defaults_validation_budgets.json", "defaults_validation_gemma_budget_bos.json"),
                 render_defaults),
}


def _load(filename: str | tuple[str, ...]):
    if isinstance(filename, tuple):
        return [json.loads((RESULTS / name).read_text()) for name in filename]
    return json.loads((RESULTS / filename).read_text())


def rendered_document(text: str) -> str:
    for name, (filename, render) in SECTIONS.items():
        pattern = re.compile(rf"(<!-- render:{name} -->\n)(?:.*?\n)?(<!-- /render:{name} -->)", re.S)
        if not pattern.search(text):
            continue
        loaded = _load(filename)
        body = render(loaded)
        warning = windows_warning(loaded)
        if warning:
            body += "\n\n" + warning
        text = pattern.sub(lambda match: match.group(1) + body + "\n" + match.group(2), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a rendered section differs from its JSON")
    args = parser.parse_args()
    current = DOCUMENT.read_text()
    fresh = rendered_document(current)
    if args.check:
        if fresh != current:
            print("BENCHMARKS.md is stale: run .venv/bin/python bench/render.py", file=sys.stderr)
            sys.exit(1)
        return
    DOCUMENT.write_text(fresh)


if __name__ == "__main__":
    main()
