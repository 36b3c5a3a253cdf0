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
    return "\n".join(lines).rstrip("\n")


def _span(blocks: list[int]) -> str:
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


def render_healing(results: dict) -> str:
    """Issue #12: healing a compressed checkpoint, perplexity before and after."""
    lines = [f"{results['model']}, {results['blocks']} blocks removed with today's defaults (fold: "
             f"{results.get('regime') or 'exact'}).", "",
             "| mode | steps × tokens | trained parameters | training loss | WikiText-2 ppl before → after |",
             "|---|---|---|---|---|"]
    for run in results["runs"]:
        lines.append(f"| {run['mode']} | {run['settings']['steps']} × 4 × 256, lr {run['settings']['learning_rate']:g} | "
                     f"{run['trained_parameters']:,} | {run['loss_first_steps']:.3f} → {run['loss_last_steps']:.3f} | "
                     f"{run['before']:.2f} → **{run['after']:.2f}** |")
    return "\n".join(lines + ["", _provenance_line(results["provenance"])])


def render_gemma(results: dict) -> str:
    """Issue #12: the sandwich folds on Gemma-3-270m with today's defaults, and how well the criteria's
    post-norm proxy ranks the spans the real fold replaces."""
    blocks = results["removed_blocks"]
    lines = [f"Selected span: blocks {_span(blocks)} (criterion `{results['selection']['criterion']}`, which scores "
             f"{results['selection'].get('scored_map') or 'the folded map'}); `auto` chose `{results['auto_regime']}`.", "",
             "| variant | relative fit error | WikiText-2 ppl |", "|---|---|---|"]
    errors = results["relative_fit_error"]
    for label, ppl in results["perplexity"].items():
        error = errors.get(label)
        lines.append(f"| {label} | {'-' if error is None else f'{error:.4f}'} | {ppl:.2f} |")
    placement = results.get("placement")
    if placement:
        lines += ["", f"Every start for {placement['blocks']} blocks, each through `compress --span-start` (its own "
                  "sandwich fold), against each criterion's score:", "",
                  "| criterion | Spearman ρ with log ppl | picks start | its ppl |", "|---|---|---|---|"]
        for name, value in placement["criteria"].items():
            lines.append(f"| {name} | {value['spearman_with_log_ppl']:.3f} | {value['choice']} | "
                         f"{value['choice_perplexity']:.2f} |")
        best = placement["best"]
        lines.append(f"| (best start) | - | {best['start']} | {best['perplexity']:.2f} |")
    return "\n".join(lines + ["", _provenance_line(results["provenance"])])


#: section name → (results file, renderer); a section renders only where BENCHMARKS.md has its markers
SECTIONS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "scale": ("scale.json", render_scale),
    "packing": ("calibration_packing.json", render_packing),
    "healing": ("healing.json", render_healing),
    "gemma": ("gemma_sandwich.json", render_gemma),
}


def rendered_document(text: str) -> str:
    for name, (filename, render) in SECTIONS.items():
        pattern = re.compile(rf"(<!-- render:{name} -->\n)(?:.*?\n)?(<!-- /render:{name} -->)", re.S)
        if not pattern.search(text):
            continue
        body = render(json.loads((RESULTS / filename).read_text()))
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
