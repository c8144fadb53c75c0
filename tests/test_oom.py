"""Out of memory, injected on the CPU (tests/oom_fault.py): retried smaller where the work splits
without changing what is computed, else one clear line and exit 1; nothing lost, and the same
command resumes to what an uninterrupted run gives."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_cli
from gsm8kctl.artifacts.jsonl import read_jsonl

FAULT = REPO / "tests" / "oom_fault.py"
FT = ["--steps", "3", "finetune.train_batch_size=8", "finetune.token_budget=8192", "finetune.dtype=float32",
      "finetune.learning_rate=1e-3", "--quiet"]

# A loop of 8 attempts a phase that trains on all of them in one step of 8, with no warm start,
# evaluation or reference model: only the phases an out-of-memory is injected into.
LOOP = ["--backend", "transformers", "--attempts", "2", "max_agent_forks=8", "sampling.max_tokens=6",
        "warmup_sft_steps=0", "validation_problems=0", "test_every_n_iterations=0", "filter.ref_model=null",
        "finetune.rl.kl_coef=0", "filter.drop_uniform_groups=false", "finetune.rl.use_advantages=false",
        "finetune.train_batch_size=8", "stop_without_signal=0"]


def _fault_env(tmp: Path, spec: str) -> dict:
    d = tmp / "fault"
    d.mkdir(exist_ok=True)
    shutil.copy(FAULT, d / "sitecustomize.py")
    return {"PYTHONPATH": str(d), "GSM8KCTL_TEST_OOM": spec}


def _weights(run: Path) -> dict:
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    return load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def gold(tiny_model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gold") / "gold.jsonl"
    run_cli("filter", "--gold", "--n-problems", "24", "--model", tiny_model_dir, "-o", str(path), check=True)
    return path


@pytest.fixture(scope="module")
def clean_run(tiny_model_dir, gold, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("clean") / "run"
    run_cli("finetune", str(gold), "--out", str(run), "--init", tiny_model_dir, *FT, check=True)
    return run


@pytest.mark.parametrize("fault", ["train:2:3", "train:2:3:cublas"])
def test_finetune_retries_smaller_and_learns_the_same(tiny_model_dir, gold, clean_run, tmp_path, fault):
    """Micro-batches of more than 2 samples fail 3 times: the budget halves until they fit, and
    the same samples feed the same steps. A cuBLAS allocation failure (a RuntimeError, not torch's
    OutOfMemoryError) is an out-of-memory too."""
    run = tmp_path / "run"
    proc = run_cli("finetune", str(gold), "--out", str(run), "--init", tiny_model_dir, *FT,
                   env=_fault_env(tmp_path, fault))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: out of memory in finetune step")]
    assert len(warned) == 3 and warned[-1].endswith("retried in micro-batches of 1024 tokens")
    steps = list(read_jsonl(run / "finetune" / "metrics.jsonl"))
    assert [len(s.get("oom_retries", [])) for s in steps] == [3, 0, 0]
    assert all(s["micro_batches"] > 1 for s in steps)  # later steps keep the size that fit
    clean = list(read_jsonl(clean_run / "finetune" / "metrics.jsonl"))
    assert [s["micro_batches"] for s in clean] == [1, 1, 1]
    ours, theirs = _weights(run), _weights(clean_run)
    assert ours.keys() == theirs.keys()
    # Summed in other micro-batches, the gradients round differently; AdamW divides each by its own
    # running scale, so where one nearly cancels the rounding moves a weight by a visible share of
    # a step (up to 8.7e-7 seen). Different samples or order would move weights by about a whole
    # step (lr = 1e-3) each: the tolerance is 1 % of one step.
    start = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    moved = max((theirs[name] - start[name]).abs().max().item() for name in theirs if name in start)
    assert moved > 1e-3, moved  # three steps trained: the tolerance is small against what they moved
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-5, msg=name)


def test_finetune_gives_up_with_one_line_then_resumes(tiny_model_dir, gold, clean_run, tmp_path):
    run = tmp_path / "run"
    proc = run_cli("finetune", str(gold), "--out", str(run), "--init", tiny_model_dir, *FT,
                   env=_fault_env(tmp_path, "train:0:-1"))  # even one sample fails
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("warning:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr and "Internal error" not in proc.stderr
    assert lines[0].startswith("Error: out of memory in finetune step 1")
    assert "run the same command again: it resumes where it stopped" in lines[0]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step-*"))  # nothing half-written
    again = run_cli("finetune", str(gold), "--out", str(run), "--init", tiny_model_dir, *FT)
    assert again.returncode == 0, again.stderr[-3000:]
    ours, theirs = _weights(run), _weights(clean_run)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


def test_reference_scoring_halves_its_chunk(tiny_model_dir, tmp_path):
    """filter's reference log-probs: a chunk of more than 3 completions fails twice, and the
    samples come out as without the fault."""
    tapes = tmp_path / "tapes.jsonl"
    run_cli("sample", "--model", tiny_model_dir, "--backend", "transformers", "--n-problems", "4", "--attempts", "2",
            "--max-tokens", "8", "-o", str(tapes), "transformers.dtype=float32", "--quiet", check=True)
    args = ["filter", str(tapes), "--mode", "all", "--keep-uniform-groups", "--ref-model", tiny_model_dir,
            "--ref-backend", "transformers", "transformers.dtype=float32", "--quiet"]
    clean = run_cli(*args, "-o", str(tmp_path / "clean.jsonl"))
    assert clean.returncode == 0, clean.stderr[-2000:]
    proc = run_cli(*args, "-o", str(tmp_path / "retried.jsonl"), env=_fault_env(tmp_path, "score:3:2"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("warning: out of memory scoring") == 2
    ours, theirs = list(read_jsonl(tmp_path / "retried.jsonl")), list(read_jsonl(tmp_path / "clean.jsonl"))
    assert len(ours) == len(theirs) == 8
    for a, b in zip(ours, theirs):
        assert a["input_ids"] == b["input_ids"]
        assert a["ref_logprobs"] == pytest.approx(b["ref_logprobs"], abs=1e-5)
    stuck = run_cli(*args, "-o", str(tmp_path / "stuck.jsonl"), env=_fault_env(tmp_path, "score:0:-1"))
    assert stuck.returncode == 1 and "Error: out of memory in scoring with the reference model" in stuck.stderr
    assert "Traceback" not in stuck.stderr and not (tmp_path / "stuck.jsonl").exists()


SAMPLE = ["sample", "--backend", "transformers", "--n-problems", "3", "--attempts", "4", "--max-tokens", "8",
          "transformers.dtype=float32", "--quiet"]


def _by_id(path: Path) -> dict:
    return {(t["problem_id"], t["attempt"]): t for t in read_jsonl(path)}


@pytest.mark.parametrize("cache, spec, said", [
    # The CPU's batched decode: 12 rows fail, then 6; batches of 3 fit.
    ("transformers.static_cache=false", "sample:3:2", ["with 12 rows per batch", "with 6 rows per batch"]),
    # The slot engine: a pool of 16 slots fails, then 8; 4 fit (the pool is made again each time).
    ("transformers.static_cache=true", "slots:4:-1", ["with 16 slots", "with 8 slots"]),
])
def test_sampling_retries_smaller_and_samples_the_same(tiny_model_dir, tmp_path, cache, spec, said):
    args = [*SAMPLE, "--model", tiny_model_dir, cache, "sampling.max_slots=16"]
    clean = run_cli(*args, "-o", str(tmp_path / "clean.jsonl"))
    assert clean.returncode == 0, clean.stderr[-2000:]
    proc = run_cli(*args, "-o", str(tmp_path / "retried.jsonl"), env=_fault_env(tmp_path, spec))
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: out of memory sampling")]
    assert [w.split(": the ")[0].split("sampling ")[1] for w in warned] == said, proc.stderr
    ours, theirs = _by_id(tmp_path / "retried.jsonl"), _by_id(tmp_path / "clean.jsonl")
    assert ours.keys() == theirs.keys() and len(ours) == 12
    for key, tape in ours.items():
        assert tape["completion_token_ids"] == theirs[key]["completion_token_ids"], key
        assert tape["logprobs"] == pytest.approx(theirs[key]["logprobs"], abs=1e-5)


def test_sampling_gives_up_with_one_line_then_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "tapes.jsonl"
    args = [*SAMPLE, "--model", tiny_model_dir, "-o", str(out)]
    proc = run_cli(*args, env=_fault_env(tmp_path, "sample:0:-1"))  # even one row fails
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("warning: out of memory sampling")]
    assert len(lines) == 1 and lines[0].startswith("Error: out of memory in sampling with 1 rows per batch")
    assert "Internal error" not in proc.stderr and "resumes where it stopped" in lines[0]
    assert "Traceback" not in proc.stderr
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    clean = run_cli(*args[:-1], str(tmp_path / "clean.jsonl"))
    assert clean.returncode == 0, clean.stderr[-2000:]
    ours, theirs = _by_id(out), _by_id(tmp_path / "clean.jsonl")
    assert len(list(read_jsonl(out))) == len(ours) == 12  # no attempt twice
    assert {k: t["completion_token_ids"] for k, t in ours.items()} == \
        {k: t["completion_token_ids"] for k, t in theirs.items()}


@pytest.mark.parametrize("engine", ["inprocess", "processes"])  # the retries of this process, or of a stage's
def test_loop_records_the_retries_in_the_iterations_warnings(tiny_model_dir, tmp_path, engine):
    run = tmp_path / "run"
    proc = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *LOOP, "--iterations", "1",
                   f"loop.engine={engine}", env=_fault_env(tmp_path, "sample:4:1,train:2:2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(r for r in read_jsonl(run / "metrics.jsonl") if r["iteration"] == 0)
    # In the order they happened: the sampler's batch halved once, then the trainer's budget twice.
    assert row["warnings"][0].startswith("out of memory sampling with 8 rows per batch")
    assert [w for w in row["warnings"][1:3] if w.startswith("out of memory in finetune step 1")] == row["warnings"][1:3]
    assert json.loads((run / "state.json").read_text())["phase"] == "done"


@pytest.mark.parametrize("engine", ["inprocess", "processes"])
def test_a_loop_out_of_memory_exits_1_with_one_clear_line_then_resumes(tiny_model_dir, tmp_path, engine):
    """Even one row fails: the loop stops with exit 1 (not 2, not an internal error) under either
    engine, and the same command resumes to the end."""
    run = tmp_path / "run"
    args = ["loop", "--model", tiny_model_dir, "--run-dir", str(run), *LOOP, "--iterations", "1",
            f"loop.engine={engine}"]
    proc = run_cli(*args, env=_fault_env(tmp_path, "sample:0:-1"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert errors and "out of memory" in errors[0] and "resume" in errors[-1], proc.stderr[-3000:]
    assert "Internal error" not in proc.stderr and "Traceback" not in proc.stderr
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run / "state.json").read_text())["phase"] == "done"


def test_a_halved_budget_grows_back_phase_by_phase(tiny_model_dir, tmp_path):
    """In one process (the inprocess engine) the trainer keeps a budget that an out-of-memory
    halved for the rest of its phase, then tries twice that size in each next phase, up to
    finetune.token_budget: a passing peak does not slow every later iteration."""
    run = tmp_path / "run"
    proc = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *LOOP, "--iterations", "4",
                   "finetune.token_budget=2048", "loop.engine=inprocess", env=_fault_env(tmp_path, "train:1:3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    retried = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: out of memory in finetune")]
    assert retried[-1].endswith("retried in micro-batches of 256 tokens")  # 2048 -> 1024 -> 512 -> 256
    steps = list(read_jsonl(run / "finetune" / "metrics.jsonl"))
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [len(s.get("oom_retries", [])) for s in steps] == [3, 0, 0, 0]  # the fault fired 3 times, in step 1
    mbs = [s["micro_batches"] for s in steps]
    # 256, 512, 1024, then 2048 tokens again: the 8 samples (under 2048 tokens) in one micro-batch
    assert mbs[0] > mbs[1] > mbs[3] == 1 and mbs[1] >= mbs[2] >= mbs[3], mbs


@pytest.mark.parametrize("cache, spec, said", [
    # Batches of 8 rows: 8, 4 and 2 fail in iteration 0; iteration 1 tries 2 again (and fails).
    ("transformers.static_cache=false", "sample:1:4", [["8 rows per batch", "4 rows per batch", "2 rows per batch"],
                                                       ["2 rows per batch"], [], [], []]),
    # The slot engine: pools of 16, 8 and 4 fail in iteration 0; iteration 1 tries 4 again (and fails).
    ("transformers.static_cache=true", "slots:2:4", [["16 slots", "8 slots", "4 slots"], ["4 slots"], [], [],
                                                                           []]),
])
def test_a_halved_sampler_grows_back_phase_by_phase(tiny_model_dir, tmp_path, cache, spec, said):
    """In one process the sampler keeps the size an out-of-memory left for the rest of its call,
    then tries twice that size in each next call: a passing peak does not slow every later
    iteration. Had the size stayed halved, iteration 1 would have failed nothing."""
    run = tmp_path / "run"
    proc = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *LOOP, "--iterations", "4", cache,
                   "sampling.batch_size=8", "sampling.max_slots=16", "loop.engine=inprocess",
                   env=_fault_env(tmp_path, spec))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(read_jsonl(run / "metrics.jsonl"), key=lambda r: r["iteration"])  # 0-3, and 4's evaluation
    sizes = [[w.split(": the ")[0].split("sampling with ")[1] for w in r.get("warnings") or []
              if w.startswith("out of memory sampling")] for r in rows]
    assert sizes == said, proc.stderr[-3000:]


def test_loops_started_together_each_keep_to_their_share():
    """The KV cache is sized from what is free, never beyond this process's share of the GPU less
    what it holds already: the first of two loops at share 0.5 no longer takes the most."""
    from gsm8kctl.config.sizes import gpu_share, kv_room

    gib = 2**30
    assert kv_room(free=140 * gib, total=140 * gib, held=0, share=1.0) == 140 * gib  # alone: as before
    first = kv_room(free=139 * gib, total=140 * gib, held=1 * gib, share=0.5)
    assert first == 69 * gib
    second = kv_room(free=139 * gib - first - 1 * gib, total=140 * gib, held=1 * gib, share=0.5)
    assert second == first  # the second loop finds as much room as the first took
    assert kv_room(free=4 * gib, total=140 * gib, held=1 * gib, share=0.5) == 4 * gib  # others hold the rest
    assert kv_room(free=4 * gib, total=8 * gib, held=5 * gib, share=0.5) == 0
    assert gpu_share({"gpu_memory_share": "auto"}) == 1.0 and gpu_share({"gpu_memory_share": 0.25}) == 0.25


def test_a_loop_with_a_share_caps_its_allocator_within_it():
    """Under gpu_memory_share < 1 torch's allocator is capped at the share less 1 GiB (the CUDA
    context and library workspaces lie outside it), so six loops at 1/6 each fit the GPU together;
    the whole GPU is not capped, and on a CPU nothing is set."""
    from gsm8kctl.oom import OUTSIDE_ALLOCATOR, allocator_fraction, keep_to_share

    gib = 2**30
    total = 80 * gib
    assert allocator_fraction(1.0, total) is None
    sixth = allocator_fraction(1 / 6, total)
    assert 6 * (sixth * total + OUTSIDE_ALLOCATOR) == pytest.approx(total)
    assert allocator_fraction(0.001, total) == 0.01  # a tiny share still gets a usable cap
    keep_to_share(0.5)  # no CUDA here: a no-op, not an error
