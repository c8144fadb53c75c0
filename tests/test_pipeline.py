"""sample | filter | finetune, then evaluate: the stages chained through a real shell pipeline."""

import json
import subprocess
import sys

from conftest import REPO
from gsm8kctl.artifacts.jsonl import read_jsonl


def test_shell_pipeline_sample_filter_finetune_then_evaluate(tiny_model_dir, tmp_path):
    gk = f"{sys.executable} -m gsm8kctl"
    run = tmp_path / "run"
    script = (
        f"set -o pipefail; "
        f"{gk} sample --model {tiny_model_dir} --backend transformers --n-problems 3 --attempts 2 --max-tokens 8 "
        f"-o - -q | {gk} filter - --mode all --keep-uniform-groups -o - -q | tee {tmp_path}/samples.jsonl | "
        f"{gk} finetune - --out {run} --init {tiny_model_dir} --objective reinforce --steps 2 "
        f"finetune.train_batch_size=2 -q && "
        f"{gk} evaluate --model {run} --backend transformers --limit 2 --max-tokens 4 -o {tmp_path}/ev --json -q"
    )
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = list(read_jsonl(tmp_path / "samples.jsonl"))
    assert len(samples) == 6 and all(len(s["input_ids"]) > s["prompt_len"] for s in samples)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert metrics["n"] == 2 and metrics["model"] == str(run)  # a run directory stands for its latest checkpoint


def test_stdout_keeps_only_the_data_when_libraries_and_children_print(tmp_path):
    """What the command line does first (progress.keep_stdout_for_data): print()/os.write(1) by a
    library, a started program and a forked child land on stderr; sys.stdout still reaches the pipe."""
    code = (
        "import multiprocessing, os, subprocess, sys\n"
        "from gsm8kctl.progress import keep_stdout_for_data\n"
        "keep_stdout_for_data()\n"
        "sys.stdout.write('data-1\\n'); sys.stdout.flush()\n"
        "os.write(1, b'fd1\\n')\n"
        "subprocess.run(['echo', 'program'], check=True)\n"
        "p = multiprocessing.get_context('fork').Process(target=print, args=('forked',)); p.start(); p.join()\n"
        "print('data-2')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "data-1\ndata-2\n"
    assert proc.stderr.split() == ["fd1", "program", "forked"]
