"""Scale-out: calibration passes shared by torch.distributed processes (gloo on CPU), checkpoints that
resume a killed run, and a statistics cache shared by commands. Each equivalence is checked against
one plain process on tiny random-weight models."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import random_calibration, tiny_model, tiny_tokenizer
from safetensors.torch import load_file

from blockfold import distributed
from blockfold.api import as_handle
from blockfold.pipelines import Runner
from blockfold.runtime import Execution
from blockfold.stats import SpanStatistics, SublayerLinearity
from blockfold.stats.sample import SpanSample
from blockfold.stats.similarity import StreamSimilarity, StreamSubsample
from blockfold.stats.reconstruction import ProjectionEquations
from blockfold.stats.state import combine, decode, encode, observer_state

PYTHON = sys.executable
CALIBRATION = ["--num-seqs", "12", "--seq-len", "32", "--batch-size", "4"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _observers(num_layers: int, total_tokens: int) -> list:
    return [SpanStatistics(num_layers, max_length=3, fit_length=2), SublayerLinearity(num_layers, "attention"),
            StreamSimilarity(num_layers, [1, 2]), StreamSubsample(num_layers, 100, total_tokens, seed=3),
            SpanSample(2, 2, 100, total_tokens, pre_norm=False, seed=5)]


def _states(observers: list) -> list:
    return [encode(observer_state(observer)) for observer in observers]



def _pass(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank of a two-process pass (or the single process, world_size 1): its states saved by rank 0."""
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        calibration = random_calibration(num_sequences=10, batch_size=4)
        handle = as_handle(tiny_model("llama"), tiny_tokenizer(), Execution())
        observers = _observers(handle.num_layers(), calibration.num_tokens)
        Runner(handle, Execution(chunk_sequences=3)).run(calibration, observers)
        observers.append(_refit_equations(rank, world_size))
        if rank == 0:
            torch.save(_states(observers), out)
    finally:
        distributed.finish()


def _refit_equations(rank: int, world_size: int) -> ProjectionEquations:
    """The refit's normal equations without the stream scale's sums (``None`` until a token adds
    them), as ``refit all`` solves for input projections: each process adds its share of the rows,
    then they are reduced as the refit reduces them."""
    generator = torch.Generator().manual_seed(7)
    inputs, targets = torch.randn(10, 4, generator=generator), torch.randn(10, 3, generator=generator)
    rows = np.linspace(0, 10, world_size + 1).astype(int)
    equations = ProjectionEquations()
    equations.add(inputs[rows[rank]:rows[rank + 1]], targets[rows[rank]:rows[rank + 1]])
    distributed.reduce_observers([equations], distributed.current())
    return equations


def test_two_gloo_processes_accumulate_the_sums_of_one(tmp_path):
    """Sums of every observer equal to 1e-10 relative; sampled rows the same tokens, row for row."""
    single, double = tmp_path / "one.pt", tmp_path / "two.pt"
    _pass(0, 1, 0, str(single))
    mp.spawn(_pass, args=(2, _free_port(), str(double)), nprocs=2, join=True)
    one, two = torch.load(single, weights_only=False), torch.load(double, weights_only=False)
    for first, second in zip(one, two):
        _assert_close(decode(*first), decode(*second), "")


def _joined(rows: list) -> tuple:
    """Rows kept per group of sequences, joined in calibration order (processes group them differently)."""
    return tuple(torch.cat(parts) for parts in zip(*rows)) if isinstance(rows[0], tuple) else (torch.cat(rows),)


def _assert_close(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_close(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list) and a and isinstance(a[0], (torch.Tensor, tuple)):  # sampled rows, per group
        _assert_close(_joined(a), _joined(b), where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{index}]")
    elif isinstance(a, torch.Tensor) and a.dtype == torch.float64 or isinstance(a, np.ndarray):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-10 * a.abs().max(), where
    elif isinstance(a, torch.Tensor):  # sampled float32 rows: the same tokens, computed in other batches
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), where
    elif a is not None:  # None: a sum no token reached, on both
        assert abs(a - b) <= 1e-10 * abs(a), where


def test_states_round_trip_and_shards_combine():
    observer = StreamSimilarity(3, [1])
    observer.tokens, observer._cross = 5, {(0, 1): torch.ones(2, 2, dtype=torch.float64)}
    structure, tensors = encode(observer_state(observer))
    back = decode(json.loads(json.dumps(structure)), tensors)
    assert back["tokens"] == 5 and torch.equal(back["_cross"][(0, 1)], observer._cross[(0, 1)])
    added = combine([{"a": 1, "b": torch.ones(2)}, {"a": 2, "b": torch.ones(2)}], rows=False)
    assert added["a"] == 3 and torch.equal(added["b"], torch.full((2,), 2.0))
    joined = combine([{"k": [torch.zeros(1)]}, {"k": [torch.ones(1), torch.ones(1)]}], rows=True)
    assert len(joined["k"]) == 3


# -- the command line under torchrun --------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path) -> Path:
    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    generator = torch.Generator().manual_seed(0)
    (tmp_path / "corpus.txt").write_text(" ".join(f"w{int(w)}" for w in torch.randint(0, 90, (6000,), generator=generator)))
    return tmp_path


def _blockfold(workdir: Path, *argv: str, processes: int = 1, wait: bool = True, extra_env: dict | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    launcher = ([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                 "--master-port", str(_free_port())] if processes > 1 else [PYTHON])
    command = [*launcher, "-m", "blockfold", *argv]
    if not wait:
        return subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    first, second = _weights(a), _weights(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _assert_same_up_to_rounding(a: Path, b: Path) -> None:
    """Every tensor equal, except fitted ones within float32 rounding of sums that differ in their last
    bits (two processes add the same terms in another order)."""
    first, second = _weights(a), _weights(b)
    assert first.keys() == second.keys()
    differing = [name for name in first if not torch.equal(first[name], second[name])]
    assert all("down_proj" in name or "linear" in name for name in differing), differing
    for name in differing:
        assert (first[name] - second[name]).abs().max() <= 1e-5 * first[name].abs().max(), name


def test_torchrun_compress_saves_what_one_process_saves(workdir):
    """The launch path (``torchrun -m blockfold``) end to end; every method in two processes is the
    composition matrix's torchrun column."""
    common = ["compress", "--model", "tiny", "--calib", "corpus.txt", *CALIBRATION, "--blocks", "2"]
    one = _blockfold(workdir, *common, "--out", "one")
    two = _blockfold(workdir, *common, "--out", "two", processes=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "shared by 2 processes" in two.stdout and two.stdout.count("blockfold compress") == 1
    _assert_same_up_to_rounding(workdir / "one", workdir / "two")
    manifests = [json.loads((workdir / name / "blockfold_manifest.json").read_text()) for name in ("one", "two")]
    assert manifests[0]["removed_blocks"] == manifests[1]["removed_blocks"]
    assert manifests[0].get("replaced") == manifests[1].get("replaced")
    assert manifests[0]["selection"]["score"] == pytest.approx(manifests[1]["selection"]["score"], rel=1e-10)
    assert manifests[1]["execution"]["processes"] == 2


def test_torchrun_analyze_writes_one_folder_of_the_same_figures(workdir):
    common = ["analyze", "--model", "tiny", "--calib", "corpus.txt", "--num-seqs", "12", "--seq-len", "32"]
    assert _blockfold(workdir, *common, "--out", "one").returncode == 0
    two = _blockfold(workdir, *common, "--out", "two", processes=2)
    assert two.returncode == 0, two.stderr
    one, two = (json.loads((workdir / name / "analysis.json").read_text()) for name in ("one", "two"))
    assert [(n, b["blocks"]) for n, b in one["best_span_per_length"].items()] == \
        [(n, b["blocks"]) for n, b in two["best_span_per_length"].items()]
    for key in ("span_distances", "similarity"):  # read straight off the sums
        assert np.allclose(_numbers(one[key]), _numbers(two[key]), rtol=1e-10, atol=0, equal_nan=True), key
    # through inverse square roots of covariance matrices, which amplify the sums' last bits
    assert np.allclose(_numbers(one["linearity"]), _numbers(two["linearity"]), rtol=1e-6, atol=0)
    assert sorted(p.name for p in (workdir / "one").iterdir()) == sorted(p.name for p in (workdir / "two").iterdir())
    assert not list(workdir.glob(".two.*"))


def _numbers(tree) -> np.ndarray:
    if isinstance(tree, dict):
        return np.concatenate([_numbers(tree[key]) for key in sorted(tree)]) if tree else np.zeros(0)
    if isinstance(tree, list):
        return np.concatenate([_numbers(item) for item in tree]) if tree else np.zeros(0)
    return np.array([np.nan if tree is None else float(tree)])


def test_torchrun_sweep_measures_what_one_process_measures(workdir):
    common = ["sweep", "--model", "tiny", "--methods", "replaceme,nbl", "--budgets", "1,2", "--calib", "corpus.txt",
              "--num-seqs", "12", "--seq-len", "32", "--ppl", "corpus.txt", "--ppl-windows", "2", "--no-analysis"]
    assert _blockfold(workdir, *common, "--out", "one").returncode == 0
    two = _blockfold(workdir, *common, "--out", "two", processes=2)
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("blockfold sweep") == 1
    one, two = (json.loads((workdir / name / "sweep.json").read_text()) for name in ("one", "two"))
    assert two["processes"] == 2
    assert [(r["method"], r["budget"], r["removed_blocks"], r["replaced"]) for r in one["runs"]] == \
        [(r["method"], r["budget"], r["removed_blocks"], r["replaced"]) for r in two["runs"]]
    assert [r["perplexity"] for r in one["runs"]] == pytest.approx([r["perplexity"] for r in two["runs"]], rel=1e-6)


def test_a_command_that_runs_in_one_process_refuses_torchrun(workdir):
    result = _blockfold(workdir, "report", "nowhere", processes=2)
    assert result.returncode != 0 and "runs in one process: start it without torchrun" in result.stderr


def test_a_rank_that_dies_stops_the_job_with_nothing_written(workdir):
    """One process killed in the middle of the pass: torchrun stops the other, the job fails, no
    output folder and no staging folder are left (the checkpoints stay, to resume from)."""
    job = _blockfold(workdir, "compress", "--model", "tiny", "--calib", "corpus.txt", "--num-seqs", "96", "--seq-len",
                     "32", "--blocks", "2", "--chunk-sequences", "1", "--checkpoint-seconds", "0", "--out", "out",
                     processes=2, wait=False)
    checkpoint = workdir / ".out.resume" / "pass-1-rank1.json"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    assert checkpoint.exists(), job.communicate()
    workers = subprocess.run(["pgrep", "-f", "-P", str(job.pid), "blockfold"], capture_output=True, text=True)
    children = [int(pid) for pid in workers.stdout.split()]
    victim = next(pid for pid in children if _environment(pid).get("RANK") == "1")
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode != 0
    assert not (workdir / "out").exists() and not list(workdir.glob(".out.partial-*"))
    assert (workdir / ".out.resume").is_dir()


def _environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


# -- resuming a killed run -------------------------------------------------------------------------
RESUMABLE = ["compress", "--model", "tiny", "--calib", "corpus.txt", "--num-seqs", "128", "--seq-len", "32",
             "--blocks", "2", "--chunk-sequences", "1", "--checkpoint-seconds", "0"]


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced."""
    index = argv.index(flag)
    return [*argv[: index + 1], value, *argv[index + 2 :]]


def _kill_after_first_checkpoint(workdir: Path, out: str) -> None:
    job = _blockfold(workdir, *RESUMABLE, "--out", out, wait=False)
    checkpoint = workdir / f".{out}.resume" / "pass-1-rank0.json"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate()
    meta = json.loads(checkpoint.read_text())
    assert 0 < meta["groups_done"] < meta["groups"], meta  # killed in the middle of the pass


def test_a_killed_run_resumes_to_the_same_output(workdir):
    fresh = _blockfold(workdir, *RESUMABLE, "--out", "fresh")
    assert fresh.returncode == 0, fresh.stderr
    _kill_after_first_checkpoint(workdir, "out")
    resumed = _blockfold(workdir, *RESUMABLE, "--out", "out")
    assert resumed.returncode == 0, resumed.stderr
    assert "1 resumed from checkpoints" in resumed.stdout
    assert _same_weights(workdir / "fresh", workdir / "out")
    assert not (workdir / ".out.resume").exists()  # saved: the checkpoints are gone


def test_a_changed_run_refuses_to_resume_and_no_resume_starts_afresh(workdir, capsys, monkeypatch):
    """Killed for real, then every later run in this process (the refusals are the resume folder's
    behaviour, not a launch path's)."""
    from blockfold.cli import main

    _kill_after_first_checkpoint(workdir, "out")
    monkeypatch.chdir(workdir)

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([*argv, "--out", "out"])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, _, err = run(*_with(RESUMABLE, "--blocks", "1"))
    assert code == 2 and "holds checkpoints of a run with another recipe" in err and "Traceback" not in err
    corpus = (workdir / "corpus.txt").read_text()
    (workdir / "corpus.txt").write_text(corpus.replace("w1", "w2"))  # the same recipe, other tokens
    code, _, err = run(*RESUMABLE)
    assert code == 2 and "a run with another calibration:" in err
    (workdir / "corpus.txt").write_text(corpus)
    tiny_model("llama", seed=1).save_pretrained(workdir / "tiny")  # the same recipe, other weights
    code, _, err = run(*RESUMABLE)
    assert code == 2 and "a run with another model:" in err
    code, out, err = run(*_with(RESUMABLE, "--blocks", "1"), "--no-resume")
    assert code == 0, err
    assert "resumed" not in out


# -- the statistics cache --------------------------------------------------------------------------
def test_the_stats_cache_serves_another_budget_and_only_the_same_weights(workdir, capsys, monkeypatch):
    """In this process (the cache's behaviour, not a launch path): NBL at another budget is served the
    first run's pass and saves what its own run saves; other weights of the same shapes are not served;
    a cache of another format, and a folder that is no cache, are refused in one line."""
    from blockfold.cli import main

    monkeypatch.chdir(workdir)

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["compress", "--calib", "corpus.txt", *CALIBRATION, "--method", "nbl", *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, err = run("--model", "tiny", "--attn", "2", "--stats-cache", "cache", "--out", "first")
    assert code == 0 and "statistics cache" not in out, err
    code, out, err = run("--model", "tiny", "--attn", "3", "--stats-cache", "cache", "--out", "cached")
    assert code == 0 and "1 loaded from the statistics cache" in out, err
    assert run("--model", "tiny", "--attn", "3", "--out", "plain")[0] == 0
    assert _same_weights(workdir / "cached", workdir / "plain")
    # other weights of the same shapes: never served
    tiny_model("llama", seed=1).save_pretrained(workdir / "other")
    tiny_tokenizer().save_pretrained(workdir / "other")
    code, out, err = run("--model", "other", "--attn", "3", "--stats-cache", "cache", "--out", "other-cached")
    assert code == 0 and "statistics cache" not in out, err
    assert run("--model", "other", "--attn", "3", "--out", "other-plain")[0] == 0
    assert _same_weights(workdir / "other-cached", workdir / "other-plain")
    # a cache of another format, and a folder that is no cache: refused in one line
    (workdir / "cache" / "blockfold-stats-cache.json").write_text(json.dumps({"format": "blockfold-stats/0"}))
    code, _, err = run("--model", "tiny", "--attn", "3", "--stats-cache", "cache", "--out", "stale")
    assert code == 2 and "written by another blockfold" in err and "Traceback" not in err
    code, _, err = run("--model", "tiny", "--attn", "3", "--stats-cache", "tiny", "--out", "foreign")
    assert code == 2 and "is not a statistics cache" in err


FAIL_ON_RANK_ONE = """
import os
if os.environ.get("RANK") == "1":
    from blockfold import methods

    def broken(job):
        raise RuntimeError("a failure of rank one's own")

    methods.METHODS["replaceme"] = broken
"""


def test_a_rank_that_fails_names_its_own_error_and_is_not_blamed_on_the_others(workdir, tmp_path):
    """Rank 1 raises in its method (loaded by a sitecustomize of the test, not by blockfold): its own
    line says so; no rank reports rank 1's error as another process's."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAIL_ON_RANK_ONE)
    job = _blockfold(workdir, "compress", "--model", "tiny", "--calib", "corpus.txt", *CALIBRATION, "--blocks", "2",
                     "--out", "out", processes=2, extra_env={"PYTHONPATH": str(hooks)})
    assert job.returncode != 0
    assert "blockfold: error (rank 1): RuntimeError: a failure of rank one's own" in job.stderr
    assert "error (rank 1): another process" not in job.stderr
    assert not (workdir / "out").exists()


@pytest.mark.slow  # two compressions of SmolLM2-135M on 16 x 512 tokens, one in each launch: minutes on 2 cores
@pytest.mark.realmodel
def test_torchrun_runs_the_default_recipe_on_smollm2_as_one_process_does(tmp_path):
    """The issue's command: today's default recipe (refit all) under torchrun with 2 processes saves
    what one process saves, the same removed blocks and every tensor within 1e-5 of its largest entry
    (two processes add the same terms in another order and run other batch shapes)."""
    from conftest import checkpoint_tensors, require_smollm2, shared_file

    require_smollm2()
    common = ["compress", "--model", "smollm2-135m", "--blocks", "8", "--calib", str(shared_file("c4_demo.jsonl")),
              "--num-seqs", "16"]
    one = _blockfold(tmp_path, *common, "--out", "one")
    two = _blockfold(tmp_path, *common, "--out", "two", processes=2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    manifests = [json.loads((tmp_path / name / "blockfold_manifest.json").read_text()) for name in ("one", "two")]
    assert manifests[0]["removed_blocks"] == manifests[1]["removed_blocks"]
    assert manifests[1]["execution"]["processes"] == 2 and manifests[1]["recipe"]["settings"]["refit"] == "all"
    first, second = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "two")
    assert first.keys() == second.keys()
    for name, value in first.items():
        difference = float((second[name].double() - value.double()).abs().max())
        assert difference <= 1e-5 * float(value.double().abs().max()), (name, difference)
