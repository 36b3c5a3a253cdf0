"""Issue #43's quality table on a real 1.5B model: Qwen2.5-Coder-1.5B-Instruct (the built-in
``qwen2.5-coder-1.5b``) at 4, 7 and 10 of its 28 blocks (NBL at as many attention layers), blockfold's
default against plain ReplaceMe (``refit=none``), UIDL, SLEB, Prune&Comp and DROP, as one resumable
``blockfold sweep`` per calibration:

- ``--calibration default``: blockfold's default calibration (the model writes its own text), every method;
- ``--calibration instruct``: instruction records through the model's chat template (Alpaca and Dolly, half
  each, from ``../shared/data``), the default and plain ReplaceMe only.

Held out: WikiText-2 windows 40-59 (no default was chosen on them), C4 documents 200 and on (no calibration
reads them) and a code text: the Python sources of the installed ``jinja2`` package (BSD-3-Clause; torch
depends on it, so it is present wherever blockfold runs), concatenated in file-name order into a text file
in the sweep's folder (``--code-package`` picks another package). Harness accuracy on four tasks with RP
(near-chance tasks are left out of RP by the sweep). Every model is measured in bfloat16 (about twice as fast
on this CPU as float32; the compress runs in float32).

    .venv/bin/python bench/qwen_quality.py                                # every method, default calibration
    .venv/bin/python bench/qwen_quality.py --calibration instruct         # ReplaceMe's two rows
    .venv/bin/python bench/qwen_quality.py --print                        # the command, not run

A sweep stopped part way resumes from ``.<out>.resume`` when started again.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from pathlib import Path

from blockfold.cli import DATA_DIR, main as blockfold

MODEL = "qwen2.5-coder-1.5b"
BUDGETS = "4,7,10"
METHODS = {"default": "replaceme,replaceme:refit=none,uidl,sleb,prune-comp,drop-block,nbl",
           "instruct": "replaceme,replaceme:refit=none"}
CALIBRATION = {"default": None, "instruct": f"{DATA_DIR / 'alpaca_en_demo.json'}:0.5,{DATA_DIR / 'dolly.jsonl'}:0.5"}
TASKS = "piqa,arc_easy,hellaswag,lambada_openai"


def code_text(package: str, target: Path) -> Path:
    """The Python sources of an installed ``package``, concatenated in file-name order into ``target``."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} is not installed (or is a single module): pass --code-package NAME")
    root = Path(next(iter(spec.submodule_search_locations)))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n\n".join(f"# {path.relative_to(root.parent)}\n{path.read_text(encoding='utf-8')}"
                                  for path in sorted(root.rglob("*.py"))), encoding="utf-8")
    return target


def command(calibration: str, out: str, code: Path, limit: int) -> list[str]:
    source = CALIBRATION[calibration]
    return ["sweep", "--model", MODEL, "--methods", METHODS[calibration], "--budgets", BUDGETS,
            *(["--calib", source] if source else []), "--num-seqs", "64", "--seq-len", "512",
            "--ppl", f"{DATA_DIR / 'wikitext2_test.txt'}[40:60]",
            "--held-out", f"{DATA_DIR / 'c4_demo.jsonl'}[200:],{code}",
            "--ppl-windows", "20", "--tasks", TASKS, "--limit", str(limit), "--eval-dtype", "bfloat16",
            "--no-analysis", "--out", out]


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", choices=sorted(METHODS), default="default")
    parser.add_argument("--out", help="the sweep's folder (default: bench/runs/qwen-CALIBRATION)")
    parser.add_argument("--code-package", default="jinja2", help="installed package whose sources are the code text")
    parser.add_argument("--limit", type=int, default=200, help="questions per task")
    parser.add_argument("--print", action="store_true", help="print the blockfold command instead of running it")
    args = parser.parse_args()
    out = args.out or f"bench/runs/qwen-{args.calibration}"
    code = Path(f"{out}-texts") / f"code_{args.code_package}.txt"
    argv = command(args.calibration, out, code, args.limit)
    if args.print:
        print(".venv/bin/blockfold " + " ".join(shlex.quote(part) for part in argv))
        return 0
    code_text(args.code_package, code)
    return blockfold(argv)


if __name__ == "__main__":
    sys.exit(run())
