"""bench/profile_iteration.py on the CPU: one in-process loop iteration profiled phase by phase."""

import json
import subprocess
import sys

from conftest import REPO

TINY = ["machine=cpu", "backend=transformers", "attempts=2", "max_agent_forks=8", "sampling.max_tokens=8",
        "evaluation.max_tokens=8", "eval_limit=3", "validation_problems=3", "warmup_sft_steps=0",
        "filter.ref_model=null", "finetune.rl.kl_coef=0", "filter.drop_uniform_groups=false",
        "finetune.rl.use_advantages=false", "use_rejection_sampling=false", "stop_without_signal=0",
        "finetune.train_batch_size=2", "test_every_n_iterations=1"]


def _profile(tmp_path, model: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/profile_iteration.py", "--run-dir", str(tmp_path / "run"), "--iterations", "2",
           "--profile-iteration", "1", "--out", str(tmp_path / "profile.json"), f"model={model}", *TINY, *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_each_phase_of_the_profiled_iteration_is_timed(tiny_model_dir, tmp_path):
    proc = _profile(tmp_path, tiny_model_dir, "loop.engine=inprocess")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "profile.json").read_text())
    rows = result["phases"]
    assert [r["phase"] for r in rows] == ["evaluate", "sample", "filter", "finetune", "record"]
    assert result["iteration"] == 1 and result["device"] == "cpu"
    for r in rows:
        # No device on the CPU: every second of a phase is the host's.
        assert r["device_busy_s"] == 0 and r["kernels"] == 0 and r["host_only_s"] == r["wall_s"]
        assert r["unprofiled_wall_s"] is not None  # iteration 0 ran every phase unprofiled
    # The phases evaluated, sampled and trained: their time is not nothing, and sits inside the iteration.
    assert all(r["wall_s"] > 0 for r in rows if r["phase"] in ("evaluate", "sample", "finetune"))
    assert sum(r["wall_s"] for r in rows) <= result["wall_s"] + 0.01
    ops = {o["name"] for o in result["top_cpu_ops"]}
    assert "aten::mm" in ops and not any(name.startswith("phase:") for name in ops)
    # The report reaches the terminal, although the loop sends its own stdout to RUN/output.log.
    assert "| finetune |" in proc.stdout and "| CPU operator (most self time) |" in proc.stdout


def test_a_bad_override_is_refused_in_one_line(tiny_model_dir, tmp_path):
    proc = _profile(tmp_path, tiny_model_dir, "attempts=zero")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "profile_iteration.py: override 'attempts=zero': attempts must be an integer, got 'zero'"
    assert not (tmp_path / "run").exists() and not (tmp_path / "profile.json").exists()


def test_phases_in_child_processes_are_refused(tiny_model_dir, tmp_path):
    proc = _profile(tmp_path, tiny_model_dir)  # loop.engine=auto: child processes on the CPU
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no traceback
    assert "add loop.engine=inprocess" in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "profile.json").exists()
