"""The loop end to end on a tiny model: layout, metrics, kill-and-resume in every phase, the lock."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from gsm8kctl.artifacts.jsonl import read_jsonl
from gsm8kctl.artifacts.llm_calls import open_readonly
from gsm8kctl.loop.curriculum import next_problems, problem_order
from gsm8kctl.loop.driver import iteration_steps, iteration_warnings
from gsm8kctl.procs import STAGE_TOKEN_ENV, live_descendants, live_members, token_processes

TINY_RUN = ["--iterations", "1", "--attempts", "2", "max_agent_forks=8", "eval_limit=3",
            "sampling.max_tokens=6", "evaluation.max_tokens=6", "sampling.batch_size=2",
            "finetune.save_checkpoint_steps=2", "finetune.train_batch_size=2", "use_rejection_sampling=false",
            "finetune.rl.use_advantages=false", "--backend", "transformers",
            # The loop's mechanics, without the default recipe's warm start and KL term (tests of
            # their own below): a random model earns no reward, so nothing would train either.
            "warmup_sft_steps=0", "filter.ref_model=null", "finetune.rl.kl_coef=0", "filter.drop_uniform_groups=false",
            "stop_without_signal=0", "validation_problems=3"]


def _cmd(model: str, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "gsm8kctl", "loop", "--model", model, "--run-dir", str(run_dir), *TINY_RUN]


def _summary(run_dir: Path) -> dict:
    """Everything that must match between an interrupted and an uninterrupted run."""
    tapes = {p.parent.name: sorted((t["problem_id"], t["attempt"]) for t in read_jsonl(p))
             for p in (run_dir / "iterations").glob("*/tapes.jsonl")}
    evals = {p.parent.name: sorted(t["problem_id"] for t in read_jsonl(p)) for p in (run_dir / "eval").glob("*/tapes.jsonl")}
    samples = {p.parent.name: sum(1 for _ in read_jsonl(p)) for p in (run_dir / "iterations").glob("*/samples.jsonl")}
    conn = open_readonly(run_dir / "llm_calls.sqlite")
    calls = conn.execute("SELECT count(*), count(DISTINCT tape_id) FROM llm_calls").fetchone()
    steps = [json.loads(l)["step"] for l in open(run_dir / "finetune" / "metrics.jsonl")]
    return {
        "tapes": tapes, "evals": evals, "samples": samples, "calls": tuple(calls), "steps": steps,
        "metrics_iterations": [r["iteration"] for r in read_jsonl(run_dir / "metrics.jsonl")],
        "latest": (run_dir / "checkpoints" / "latest").read_text().strip(),
        "state": {k: v for k, v in json.loads((run_dir / "state.json").read_text()).items()
                  if k in ("iteration", "phase", "cursor")},
    }


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    proc = subprocess.run(_cmd(tiny_model_dir, run_dir), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)
    return run_dir


def test_loop_layout_and_metrics(reference_run):
    run = reference_run
    for name in ("config.yaml", "state.json", "llm_calls.sqlite", "metrics.jsonl", "learning_curve.png",
                 "iterations/0000/tapes.jsonl", "iterations/0000/samples.jsonl", "eval/0000/metrics.json",
                 "eval/0001/metrics.json", "finetune/metrics.jsonl"):
        assert (run / name).exists(), name
    rows = list(read_jsonl(run / "metrics.jsonl"))
    assert [r["iteration"] for r in rows] == [0, 1]
    first = rows[0]
    for key in ("train_success_rate", "pass_at_k", "format_rate", "overflow_rate", "mean_output_tokens",
                "samples_kept", "uniform_groups", "test_accuracy_strict", "test_accuracy_lenient", "seconds"):
        assert key in first, key
    assert first["attempts"] == 8 and first["problems"] == 4 and first["samples_kept"] == 8
    rewarded = [(t["problem_id"], tuple(t["completion_token_ids"]))
                for t in read_jsonl(run / "iterations" / "0000" / "tapes.jsonl") if t["reward"] > 0]
    assert first["duplicate_correct"] == len(rewarded) - len(set(rewarded))
    assert rows[1]["model"].endswith("step-000002")  # the final evaluation ran on the trained model
    assert (run / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    summary = _summary(run)
    assert summary["steps"] == [1, 2] and summary["state"]["phase"] == "done"
    # train attempts + two evaluations, each of 3 test and 3 validation problems
    assert summary["calls"] == (8 + 2 * (3 + 3), 8 + 2 * (3 + 3))
    # The validation problems are held out of the train file: evaluated, never trained on.
    held = {t["problem_id"] for t in read_jsonl(run / "validation" / "0000" / "tapes.jsonl")}
    trained = {t["problem_id"] for t in read_jsonl(run / "iterations" / "0000" / "tapes.jsonl")}
    assert len(held) == 3 and all(p.startswith("train-") for p in held) and not held & trained
    assert rows[0]["validation_n"] == 3 and rows[1]["validation_accuracy_strict"] is not None
    assert json.loads((run / "state.json").read_text())["best"]["split"] == "validation"
    # save_checkpoint_steps=2 set: the old fixed count per iteration, 2 steps of 2 on 8 samples.
    assert (first["train_steps"], first["train_passes"], first["train_steps_mode"]) == (2, 0.5, "fixed")
    assert first["train_ratio_max"] is not None and first["train_kl_max"] is None  # no reference model
    # The means over this iteration's finetune steps, from finetune/metrics.jsonl.
    steps = list(read_jsonl(run / "finetune" / "metrics.jsonl"))
    assert first["train_loss_mean"] == round(sum(r["loss"] for r in steps) / 2, 4)
    assert first["train_entropy_mean"] == round(sum(r["entropy"] for r in steps) / 2, 4) > 0
    assert first["train_kl_mean"] is None
    assert [r["warnings"] for r in rows] == [[], []]
    stderr = (run.parent / "stderr.txt").read_text()
    assert "iteration 0: 2 optimizer steps of 2 samples on 8 samples = 0.5 passes " \
           "(finetune.save_checkpoint_steps=2)" in stderr
    # The summary (the last lines) names the best evaluated model.
    best = json.loads((run / "state.json").read_text())["best"]
    tail = stderr[stderr.rindex("done. metrics:"):]
    assert "warning" not in tail
    assert f"best:    {best['checkpoint'] or 'the starting model'}" in tail


def _loop_without(tiny_model_dir: str, run_dir: Path, *extra: str, drop=()) -> subprocess.CompletedProcess:
    """TINY_RUN without the `drop` overrides, plus `extra`; no evaluation (not needed, and slow);
    in-process (seconds instead of a process per phase; the engines agree, tested below)."""
    args = [a for a in TINY_RUN if not a.startswith(tuple(drop))]
    proc = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run_dir), *args,
                   "test_every_n_iterations=0", "loop.engine=inprocess", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_steps_per_iteration_follow_the_data_and_too_many_passes_warn(tiny_model_dir, tmp_path):
    """save_checkpoint_steps unset: `epochs` passes over the iteration's samples, each pass 10 samples at
    2 x 2 per step = 3 steps. Five passes is more than warn_passes=4: a warning on stderr and in metrics."""
    run = tmp_path / "run"
    proc = _loop_without(tiny_model_dir, run, "max_agent_forks=10", "finetune.train_batch_size=2",
                         "finetune.gradient_accumulation_passes=2", "finetune.epochs=5",
                         drop=("finetune.save_checkpoint_steps", "max_agent_forks"))
    row = list(read_jsonl(run / "metrics.jsonl"))[0]
    assert row["samples_kept"] == 10
    assert (row["train_steps"], row["train_passes"], row["train_steps_mode"]) == (15, 5.0, "data")
    assert [r["step"] for r in read_jsonl(run / "finetune" / "metrics.jsonl")] == list(range(1, 16))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000015"
    from gsm8kctl.artifacts.rundir import list_checkpoints

    assert [s for s, _ in list_checkpoints(run)] == [15]  # save_checkpoint_steps null: saved at the end only
    assert "iteration 0: 15 optimizer steps of 4 samples on 10 samples = 5 passes (finetune.epochs=5)" in proc.stderr
    assert len(row["warnings"]) == 1
    assert row["warnings"][0].startswith("trained 5 passes over its 10 samples (15 steps, > warn_passes=4)")
    assert "lower finetune.epochs" in row["warnings"][0]
    assert f"warning: iteration 0: {row['warnings'][0]}" in proc.stderr
    assert "warnings: at iteration(s) 0;" in proc.stderr[proc.stderr.rindex("done. metrics:"):]


def _ft(*overrides: str) -> dict:
    from gsm8kctl.config import load_config

    return load_config(None, list(overrides))["finetune"]


def test_iteration_steps_follow_the_data_unless_a_count_is_set():
    ft = _ft("finetune.train_batch_size=2", "finetune.gradient_accumulation_passes=2")
    assert ft["save_checkpoint_steps"] is None and ft["steps"] is None  # the defaults: sized by the data
    assert [iteration_steps(n, ft)["steps"] for n in (0, 1, 4, 5, 10)] == [0, 1, 1, 2, 3]
    assert iteration_steps(10, ft)["passes"] == 1.0 and iteration_steps(10, ft)["mode"] == "data"
    assert iteration_steps(10, {**ft, "epochs": 2})["steps"] == 6
    assert iteration_steps(10, {**ft, "num_processes": 2})["steps"] == 2  # 8 samples per step
    # The issue: save_checkpoint_steps=8 at 64 per step on 16 successes = 8 passes.
    fixed = _ft("finetune.save_checkpoint_steps=8", "finetune.train_batch_size=64")
    assert iteration_steps(16, fixed) == {"steps": 8, "passes": 8.0, "mode": "fixed", "global_batch": 64,
                                          "why": "finetune.save_checkpoint_steps=8"}
    assert iteration_steps(0, fixed)["steps"] == 0  # nothing to train on: no step
    assert iteration_steps(16, {**fixed, "steps": 3})["steps"] == 3  # finetune.steps wins
    # configs/original.yaml (the TapeAgents command line) keeps its fixed 8 steps per iteration.
    from gsm8kctl.config import load_config

    original = load_config(str(REPO / "configs" / "original.yaml"), [])["finetune"]
    assert iteration_steps(1000, original)["steps"] == 8 and iteration_steps(3, original)["steps"] == 8


GUARDS = {"warn_passes": 4.0, "warn_test_drop": 0.01, "warn_ratio": 5.0, "warn_kl": 1.0, "warn_entropy": 2.0}


@pytest.mark.parametrize("before, now, fires", [(0.0349, 0.0200, True), (0.0349, 0.0258, False),
                                                (0.05, 0.04, False), (0.05, 0.0399, True), (0.02, 0.05, False)])
def test_guard_on_a_test_accuracy_drop(before, now, fires):
    earlier = [{"iteration": 0, "test_accuracy_strict": 0.9}, {"iteration": 2, "test_accuracy_strict": before},
               {"iteration": 3}]  # not evaluated: the drop is measured from iteration 2
    out = iteration_warnings({"iteration": 4, "test_accuracy_strict": now}, earlier, GUARDS)
    assert len(out) == fires
    if fires:
        assert out[0].startswith(f"test strict accuracy fell {(before - now) * 100:.2f} points, {before:.2%} at "
                                 "iteration 2")


def test_guard_on_passes_ratio_and_kl():
    row = {"iteration": 1, "samples_kept": 16, "train_steps": 8, "train_passes": 8.0, "train_steps_mode": "fixed",
           "train_ratio_max": 47.0, "train_kl_max": 1.5}
    out = iteration_warnings(row, [], GUARDS)
    assert len(out) == 3
    assert out[0].startswith("trained 8 passes over its 16 samples (8 steps, > warn_passes=4)")
    assert "finetune.save_checkpoint_steps" in out[0]
    assert "ratio reached 47 (> warn_ratio=5)" in out[1] and "KL to the reference reached 1.5 (> warn_kl=1)" in out[2]
    assert "from the model that sampled" in out[1] and "from the reference model" in out[2]  # each its own cause
    assert "finetune.rl.kl_coef" in out[2] and "kl_coef" not in out[1]
    calm = {**row, "train_passes": 4.0, "train_ratio_max": 1.2, "train_kl_max": None}
    assert iteration_warnings(calm, [], GUARDS) == []
    assert iteration_warnings(row, [], dict.fromkeys(GUARDS)) == []  # null: off


@pytest.mark.parametrize("first, now, fires", [(0.73, 1.76, True), (0.73, 1.46, False), (1.25, 0.55, False),
                                               (None, 3.0, False)])
def test_guard_on_an_entropy_rise(first, now, fires):
    # A run at sampling temperature 0.7 (H200, 2026-12-02): 0.73 at iteration 0, 1.76 at 74, 2.73 at 75; the default fell 1.25 -> 0.55.
    earlier = [{"iteration": 1, "train_entropy_mean": 9.0}, {"iteration": 0, "train_entropy_mean": first},
               {"iteration": 2}]  # the first iteration's is the yardstick, whatever order the rows come in
    if first is None:
        earlier = [{"iteration": 2}]
    out = iteration_warnings({"iteration": 3, "train_entropy_mean": now}, earlier, GUARDS)
    assert len(out) == fires
    if fires:
        assert out[0].startswith(f"the mean entropy reached {now:.3g}, 2.4x the first iteration's 0.73 "
                                 "(> warn_entropy=2)")
        assert "sampling.temperature" in out[0]
    assert iteration_warnings({"iteration": 3, "train_entropy_mean": now}, earlier, dict.fromkeys(GUARDS)) == []


def test_best_checkpoint_survives_pruning_and_the_summary_names_it(tmp_path, capsys):
    from gsm8kctl.artifacts.rundir import KEEP_MARKER, list_checkpoints, load_state
    from gsm8kctl.artifacts.rundir import prune_checkpoints as _prune
    from gsm8kctl.config import load_config
    from gsm8kctl.loop.driver import _Context

    run = tmp_path / "run"
    for step in (1, 2, 3):
        d = run / "checkpoints" / f"step-{step:06d}"
        (d / "training_state").mkdir(parents=True)
        (d / "training_state" / "state.json").write_text(json.dumps({"step": step}))
        (d / "config.json").write_text("{}")
    ckpt = lambda step: run / "checkpoints" / f"step-{step:06d}"  # noqa: E731
    ctx = _Context(load_config(None, []), run, load_state(run), "base", 10, quiet=False)
    ctx._mark_best(0, 0.02, ckpt(1))
    ctx._mark_best(1, 0.01, ckpt(2))  # worse: the best stays
    _prune(run, keep=1, current=ckpt(3))
    assert [d.name for _, d in list_checkpoints(run)] == ["step-000001", "step-000003"]
    ctx._summary()
    assert f"best:    {ckpt(1)} (validation strict 2.00% at iteration 0; kept from pruning" in capsys.readouterr().err
    ctx._mark_best(2, 0.03, ckpt(3))  # a new best takes the marker over
    assert not (ckpt(1) / KEEP_MARKER).exists() and (ckpt(3) / KEEP_MARKER).exists()


def test_problem_order_is_seeded_and_continues():
    first, after = next_problems(0, 4, 7473, seed=42)
    assert after == 4 and next_problems(0, 8, 7473, seed=42)[0][:4] == first
    assert next_problems(4, 4, 7473, seed=42)[0] == next_problems(0, 8, 7473, seed=42)[0][4:]
    assert next_problems(0, 4, 7473, seed=43)[0] != first
    assert len(set(next_problems(0, 7473, 7473, seed=1)[0])) == 7473  # a full pass has no repeats
    # Across a pass boundary the two passes' orders overlap; a draw still holds k distinct ids: the
    # first k distinct ones of positions 30, 31, ..., the last of them new.
    n, k = 50, 40
    ids, after = next_problems(30, k, n, seed=7)
    naive = [f"train-{problem_order(n, 7, pos // n)[pos % n]:05d}" for pos in range(30, after)]
    assert len(ids) == len(set(ids)) == k and after > 30 + k  # some were skipped
    assert list(dict.fromkeys(naive)) == ids and naive[-1] == ids[-1] and naive.count(ids[-1]) == 1
    assert next_problems(0, 80, n, seed=7)[0] == next_problems(0, n, n, seed=7)[0]  # at most one pass


def _wait_for(cond, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"loop ended before the kill point (exit {proc.returncode})")
        time.sleep(0.05)
    raise AssertionError("kill point not reached")


def _state(run_dir):
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.exists() else 0


def test_sigkill_in_every_phase_then_resume_matches_uninterrupted(tiny_model_dir, reference_run, tmp_path):
    run_dir = tmp_path / "run"
    # (A kill in filter, whose output is one atomic rewrite, is covered by the in-process test below.)
    kill_points = [
        ("sample", lambda: _lines(run_dir / "iterations/0000/tapes.jsonl") >= 2),
        ("finetune", lambda: _state(run_dir).get("phase") == "finetune" and _state(run_dir).get("child_pgid")),
        ("evaluate", lambda: _lines(run_dir / "eval/0001/tapes.jsonl") >= 1),
    ]
    for phase, cond in kill_points:
        proc = subprocess.Popen(_cmd(tiny_model_dir, run_dir), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        _wait_for(cond, proc)
        if phase == "finetune":
            time.sleep(1.5)  # let the stage get into its work
        child = _state(run_dir).get("child_pgid")
        proc.send_signal(signal.SIGKILL)  # the loop dies without any cleanup...
        proc.wait()
        if child:  # ...and so does the stage it ran (a crash of the whole machine, say)
            try:
                os.killpg(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert _state(run_dir).get("phase") != "done", f"loop finished before the {phase} kill"
    proc = subprocess.run(_cmd(tiny_model_dir, run_dir), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _summary(run_dir) == _summary(reference_run)


# ---------------------------------------------------------------------------------------------
# The in-process engine: the same artifacts as child processes, and the same resume


def _inprocess_cmd(model: str, run_dir: Path) -> list[str]:
    return [*_cmd(model, run_dir), "loop.engine=inprocess"]


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def test_inprocess_engine_writes_what_processes_write(tiny_model_dir, reference_run, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(_inprocess_cmd(tiny_model_dir, run_dir), cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine: inprocess (loop.engine=inprocess)" in proc.stderr
    assert _summary(run_dir) == _summary(reference_run)
    # Token for token and bit for bit: the same seeds, batches and float arithmetic, whichever
    # process ran the phase (the sampler took the trainer's weights by copy, not from disk).
    for sub in ("iterations/0000", "eval/0000", "eval/0001"):
        # (Tape ids hash the model's path, a checkpoint of each run directory after training.)
        key = lambda t: (t["problem_id"], t["attempt"], t["completion_token_ids"], t["reward"])  # noqa: E731
        ours = [key(t) for t in read_jsonl(run_dir / sub / "tapes.jsonl")]
        theirs = [key(t) for t in read_jsonl(reference_run / sub / "tapes.jsonl")]
        assert sorted(ours) == sorted(theirs), sub
    losses = lambda run: [r["loss"] for r in read_jsonl(run / "finetune" / "metrics.jsonl")]  # noqa: E731
    assert losses(run_dir) == losses(reference_run)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    ours, theirs = _weights(run_dir / "checkpoints" / latest), _weights(reference_run / "checkpoints" / latest)
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
    row = list(read_jsonl(run_dir / "metrics.jsonl"))[0]
    assert row["seconds"]["weights_refresh"] >= 0  # measured, and in metrics.jsonl
    # In this process the filter takes the tapes the sample phase wrote, and the finetune and record
    # phases the samples the filter wrote, not the files again: every row and every samples file
    # says what the other engine's say (times and paths aside).
    volatile = ("seconds", "model", "sample_tokens_per_s")
    rows = lambda run: [{k: v for k, v in r.items() if k not in volatile}  # noqa: E731
                        for r in read_jsonl(run / "metrics.jsonl")]
    assert rows(run_dir) == rows(reference_run)
    assert any("train_success_rate" in r and "pass_at_k" in r for r in rows(run_dir))
    trained = lambda run: [(s["input_ids"], s["prompt_len"], s["old_logprobs"], s["reward"], s["weight"])  # noqa: E731
                           for s in read_jsonl(run / "iterations" / "0000" / "samples.jsonl")]
    assert trained(run_dir) == trained(reference_run) and trained(run_dir)
    # Every stage still reruns by itself on what the engine wrote, and finds its work done.
    conn = open_readonly(run_dir / "llm_calls.sqlite")
    calls = conn.execute("SELECT count(*) FROM llm_calls").fetchone()[0]
    conn.close()
    config = ["--config", str(run_dir / "config.yaml")]
    again = run_cli("evaluate", "--model", str(run_dir), "-o", str(run_dir / "eval" / "0001"), "--iteration", "1",
                    "--llm-calls", str(run_dir / "llm_calls.sqlite"), "--limit", "3", *config)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "3 attempts already there" in again.stderr
    again = run_cli("finetune", str(run_dir / "iterations" / "0000" / "samples.jsonl"), "--out", str(run_dir),
                    "--steps", "2", *config)
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr[-2000:]
    conn = open_readonly(run_dir / "llm_calls.sqlite")
    assert conn.execute("SELECT count(*) FROM llm_calls").fetchone()[0] == calls


def test_inprocess_engine_on_our_decoder_samples_what_processes_sample(tiny_model_dir, tmp_path):
    """Under the slot engine the sampler is our decoder (backends/llama.py). In process it takes
    the trainer's weights by `state_dict()` name; the evaluation after training must be token for
    token what a fresh process loading the checkpoint samples."""
    tapes = {}
    for engine in ("processes", "inprocess"):
        run = tmp_path / engine
        proc = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *TINY_RUN,
                       "transformers.static_cache=true", "transformers.model_code=native", f"loop.engine={engine}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        key = lambda t: (t["problem_id"], t["attempt"], t["completion_token_ids"], t["logprobs"])  # noqa: E731
        tapes[engine] = {sub: sorted(key(t) for t in read_jsonl(run / sub / "tapes.jsonl"))
                         for sub in ("iterations/0000", "eval/0000", "eval/0001")}
    assert tapes["inprocess"] == tapes["processes"]
    assert all(len(v) for v in tapes["inprocess"].values())
    # The in-process sampler's slot-engine counters per iteration: every decoded token after each
    # attempt's first (the prefill's) was a busy row of a decode step. Child processes report none.
    first = next(read_jsonl(tmp_path / "inprocess" / "metrics.jsonl"))
    counters = first["sampler"]
    attempts = list(read_jsonl(tmp_path / "inprocess" / "iterations/0000/tapes.jsonl"))
    decoded = sum(len(t["completion_token_ids"]) - 1 for t in attempts)
    assert counters["decode_steps"] > 0 and counters["slots"] >= 1 and counters["admissions"] >= 1
    assert abs(counters["mean_busy_rows"] * counters["decode_steps"] - decoded) <= 0.05 * counters["decode_steps"]
    assert 0 < counters["busy_share"] <= 1 and counters["mean_busy_rows"] <= counters["slots"]
    assert "sampler" not in next(read_jsonl(tmp_path / "processes" / "metrics.jsonl"))
    report = subprocess.run([sys.executable, "tools/results_report.py", f"{tmp_path / 'inprocess'}=in",
                             f"{tmp_path / 'processes'}=out", "--phases", "0:0"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in report.stdout.split("\n\n")[1].strip().splitlines()[2:]}
    assert cells["in"][10:12] == [str(counters["decode_steps"]),
                                  f"{counters['mean_busy_rows']:.0f} / {counters['slots']}"]
    assert cells["out"][10:12] == ["–", "–"]


def test_inprocess_sigkill_in_every_phase_then_resume_matches_uninterrupted(tiny_model_dir, reference_run,
                                                                            tmp_path):
    """No child to wait for: the kill points watch state.json closely (in-process phases are short).

    The finetune phase's checkpoint is written by a thread while the loop goes on (`pending_save`
    in state.json until it is on disk). The tiny model's write is over in milliseconds, so the
    "background save" point kills in that window and then removes the checkpoint and its
    `latest` pointer: what a kill before the thread published leaves. The next start must train
    the phase again and still end as the uninterrupted run."""
    run_dir = tmp_path / "run"
    phase = lambda: _state(run_dir).get("phase")  # noqa: E731
    kill_points = [
        ("sample", lambda: _lines(run_dir / "iterations/0000/tapes.jsonl") >= 2, 0.0),
        ("filter", lambda: phase() in ("filter", "finetune"), 0.0),
        ("finetune", lambda: phase() == "finetune", 1.0),  # into the trainer's start and steps
        ("background save", lambda: bool(_state(run_dir).get("pending_save")), 0.0),
        ("evaluate", lambda: _lines(run_dir / "eval/0001/tapes.jsonl") >= 1, 0.0),
    ]
    for name, cond, delay in kill_points:
        err = tmp_path / f"{name}.stderr"
        with open(err, "w") as err_file:
            proc = subprocess.Popen(_inprocess_cmd(tiny_model_dir, run_dir), cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=err_file)
        deadline = time.time() + 300
        while not cond():
            assert proc.poll() is None, f"loop ended before the {name} kill point (exit {proc.returncode})"
            assert time.time() < deadline, f"{name} kill point not reached"
            time.sleep(0.002)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert phase() != "done", f"loop finished before the {name} kill"
        if name == "background save":
            pending = Path(_state(run_dir)["pending_save"]["checkpoint"])
            shutil.rmtree(pending, ignore_errors=True)  # (gone already if the kill beat the thread)
            older = sorted(pending.parent.glob("step-*"))
            latest = pending.parent / "latest"
            if older:
                latest.write_text(older[-1].name + "\n")
            else:
                latest.unlink(missing_ok=True)
    assert "was still being written when the loop stopped" in (tmp_path / "evaluate.stderr").read_text()
    proc = subprocess.run(_inprocess_cmd(tiny_model_dir, run_dir), cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _summary(run_dir) == _summary(reference_run)


def test_inprocess_warm_start_then_evaluate_at_its_own_learning_rate(tiny_model_dir, tmp_path):
    """The warm start trains at warmup_sft_learning_rate, the iterations at finetune.learning_rate.
    Its checkpoint is still being written when iteration 0 evaluates, and no sampler exists yet:
    it opens on the start weights and takes the trainer's (as on an H200, where the 1.6 GB write
    outlasts the evaluation's start)."""
    run = tmp_path / "run"
    proc = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *TINY_RUN, "loop.engine=inprocess",
                   "warmup_sft_steps=2", "warmup_sft_problems=4", "warmup_sft_learning_rate=3e-4",
                   "finetune.learning_rate=2e-6", "test_before_warmup=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lrs = [r["lr"] for r in read_jsonl(run / "finetune" / "metrics.jsonl")]
    assert lrs[:2] == [3e-4, 3e-4] and len(lrs) > 2 and lrs[2:] == [2e-6] * (len(lrs) - 2)
    start, *rows = list(read_jsonl(run / "metrics.jsonl"))
    # test_before_warmup: the starting model first, as iteration -1, from eval/start/.
    assert start["iteration"] == -1 and start["model"] == tiny_model_dir and start["test_n"] == 3
    assert json.loads((run / "eval" / "start" / "metrics.json").read_text())["iteration"] == -1
    assert {t["model"] for t in read_jsonl(run / "eval" / "start" / "tapes.jsonl")} == {tiny_model_dir}
    assert [r["iteration"] for r in rows] == [0, 1]
    assert rows[0]["model"].endswith("step-000002") and rows[0]["test_n"] == 3
    # The evaluation ran on the warm start's weights: its tokens match a fresh evaluation.
    again = run_cli("evaluate", "--model", rows[0]["model"], "-o", str(tmp_path / "again"), "--iteration", "0",
                    "--limit", "3", "--config", str(run / "config.yaml"), "--backend", "transformers")
    assert again.returncode == 0, again.stderr[-2000:]
    first = {t["problem_id"]: t["completion_token_ids"] for t in read_jsonl(run / "eval" / "0000" / "tapes.jsonl")}
    second = {t["problem_id"]: t["completion_token_ids"] for t in read_jsonl(tmp_path / "again" / "tapes.jsonl")}
    assert first == second


def test_processes_warm_start_own_learning_rate_and_kl_to_it(tiny_model_dir, tmp_path):
    """The processes engine: the warm start at its own rate, and filter.ref_model=start scores every
    sample with the warm start's checkpoint (the filter child gets its path), kept from pruning."""
    run = tmp_path / "run"
    proc = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *TINY_RUN,
                   "loop.engine=processes", "warmup_sft_steps=2", "warmup_sft_problems=4",
                   "warmup_sft_learning_rate=3e-4", "finetune.learning_rate=2e-6", "test_every_n_iterations=0",
                   "filter.ref_model=start", "finetune.rl.kl_coef=0.1", "finetune.keep_checkpoints=1",
                   "test_before_warmup=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The starting model's evaluation ran in its own child before the warm start, with no other.
    rows = list(read_jsonl(run / "metrics.jsonl"))
    assert [(r["iteration"], r.get("test_n")) for r in rows][:1] == [(-1, 3)] and rows[0]["model"] == tiny_model_dir
    assert all(r.get("test_n") is None for r in rows[1:])  # test_every_n_iterations=0
    assert [r["lr"] for r in read_jsonl(run / "finetune" / "metrics.jsonl")] == [3e-4, 3e-4, 2e-6, 2e-6]
    warm = run / "checkpoints" / "step-000002"
    assert Path(_state(run)["start_model"]) == warm
    assert (warm / "keep").read_text().startswith("the KL reference")  # keep_checkpoints=1 left it
    loop_refs = _check_ref_logprobs(run, warm, tmp_path)
    # ... and not the base model's: scored by it, the same samples are further off than the noise.
    base_refs = _fresh_ref_logprobs(run, Path(tiny_model_dir), tmp_path / "base.jsonl")
    assert _max_diff(loop_refs, base_refs) > 10 * REF_NOISE


# How far two processes' bf16 CPU scores of the same rows may differ: the same code gave 4e-6
# once (the matmuls' reduction order is not fixed across processes).
REF_NOISE = 1e-4


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y))


def _fresh_ref_logprobs(run: Path, ref: Path, out: Path) -> list[list[float]]:
    again = run_cli("filter", str(run / "iterations" / "0000" / "tapes.jsonl"), "-o", str(out), "--ref-model",
                    str(ref), "--config", str(run / "config.yaml"))
    assert again.returncode == 0, again.stderr[-2000:]
    return [s["ref_logprobs"] for s in read_jsonl(out)]


def _check_ref_logprobs(run: Path, ref: Path, tmp_path: Path) -> list[list[float]]:
    """Iteration 0's samples carry ref log-probs of the checkpoint `ref`: those a fresh `filter
    --ref-model` gives the same tapes, up to the noise between processes."""
    loop_refs = [s["ref_logprobs"] for s in read_jsonl(run / "iterations" / "0000" / "samples.jsonl")]
    assert loop_refs and all(loop_refs)
    assert _max_diff(loop_refs, _fresh_ref_logprobs(run, ref, tmp_path / "again.jsonl")) <= REF_NOISE
    return loop_refs


def test_inprocess_reference_model_scores_every_sample(tiny_model_dir, tmp_path):
    """filter.ref_model in-process: one resident scorer gives every sample its ref_logprobs, and the
    KL term then shows in the iteration's metrics. `start` is the model iteration 0 sampled with."""
    run = tmp_path / "run"
    _loop_without(tiny_model_dir, run, "filter.ref_model=start", "finetune.rl.kl_coef=0.1")
    assert Path(_state(run)["start_model"]).resolve() == Path(tiny_model_dir).resolve()  # no warm start
    samples = list(read_jsonl(run / "iterations" / "0000" / "samples.jsonl"))
    assert len(samples) == 8
    for s in samples:
        n = len(s["input_ids"]) - s["prompt_len"]
        assert len(s["ref_logprobs"]) == len(s["old_logprobs"]) == n
        # Iteration 0 samples with the reference's own weights: the two agree up to bf16 noise.
        assert max(abs(a - b) for a, b in zip(s["ref_logprobs"], s["old_logprobs"])) < 0.5
    row = list(read_jsonl(run / "metrics.jsonl"))[0]
    assert row["train_kl_mean"] is not None and row["train_kl_max"] >= row["train_kl_mean"] >= 0
    _check_ref_logprobs(run, Path(tiny_model_dir), tmp_path)


def test_sft_control_and_results_report_on_a_run(tiny_model_dir, reference_run, tmp_path):
    """`gsm8kctl control --at all` trains on gold solutions as many completion tokens as the RL run
    had before each of its evaluations and evaluates at the same points; tools/results_report.py
    tabulates both."""
    control = tmp_path / "control"
    proc = run_cli("control", str(reference_run), "-o", str(control), "--at", "all", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rl = list(read_jsonl(reference_run / "metrics.jsonl"))
    rows = list(read_jsonl(control / "metrics.jsonl"))
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in rl] == [0, 1]
    assert all(r["test_n"] == 3 for r in rows)  # the RL run's eval_limit
    rl_tokens = sum(r["completion_tokens"] for r in read_jsonl(reference_run / "finetune" / "metrics.jsonl"))
    assert rows[0]["train_steps_total"] == 0 and rows[1]["train_tokens_target"] == rl_tokens
    trained = sum(r["completion_tokens"] for r in read_jsonl(control / "finetune" / "metrics.jsonl"))
    assert [r["step"] for r in read_jsonl(control / "finetune" / "metrics.jsonl")] == \
        list(range(1, rows[1]["train_steps_total"] + 1))
    assert trained >= rl_tokens  # gold steps until the RL run's tokens are reached
    assert rows[1]["model"].endswith(f"step-{rows[1]['train_steps_total']:06d}")
    report = subprocess.run([sys.executable, "tools/results_report.py", f"{reference_run}=RL", f"{control}=SFT",
                             "--plot", str(tmp_path / "r.png"), "--json", str(tmp_path / "r.json"), "--phases", "0:1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    results, phases = report.stdout.split("\n\n")
    table = {line.split("|")[1].strip(): line for line in results.splitlines()[2:]}
    assert f"| {rl[-1]['test_accuracy_strict'] * 100:.2f} % |" in table["RL"]
    # The checkpoint chosen on validation: the first evaluation with the best validation strict.
    chosen = max((r for r in rl if r.get("validation_accuracy_strict") is not None),
                 key=lambda r: r["validation_accuracy_strict"])
    assert table["RL"].split("|")[2].strip() == f"{chosen['test_accuracy_strict'] * 100:.2f} % ({chosen['iteration']})"
    assert f"| {sum(r.get('attempts', 0) for r in rl)} | {sum(r.get('samples_kept', 0) for r in rl)} |" \
        in table["RL"]
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "r.json").read_text())
    assert [r["label"] for r in saved["runs"]] == ["RL", "SFT"]
    evals = [r["test_accuracy_strict"] for r in rl if r.get("test_accuracy_strict") is not None]
    assert len(evals) > 1 and saved["runs"][0]["mean_strict"] == pytest.approx(sum(evals[1:]) / len(evals[1:]))
    # Iteration 0's test strict (after any warm start, before RL) and the chosen checkpoint's ratio to it.
    start = next(r for r in rl if r["iteration"] >= 0 and r.get("test_accuracy_strict") is not None)
    cells = [c.strip() for c in table["RL"].split("|")]
    assert cells[8] == f"{start['test_accuracy_strict'] * 100:.2f} %"
    assert cells[9] == (f"{chosen['test_accuracy_strict'] / start['test_accuracy_strict']:.2f}×"
                        if start["test_accuracy_strict"] else "–")
    # --phases: each run's median phase seconds over the iterations asked for, from its metrics and state.
    rows_by_label = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
                     for line in phases.strip().splitlines()[2:]}
    timed = [r for r in rl if all(p in r.get("seconds", {}) for p in ("sample", "filter", "finetune"))]
    its = [r["iteration"] for r in timed]
    assert its == [0]  # iteration 1 of this run only evaluates (the one after the last)
    assert rows_by_label["RL"][1] == "0–0 (1)"
    assert rows_by_label["RL"][2] == f"{timed[0]['seconds']['sample']:.2f}"
    assert rows_by_label["RL"][5] == f"{sum(timed[0]['seconds'][p] for p in ('sample', 'filter', 'finetune')):.2f}"
    timings = json.loads((reference_run / "state.json").read_text())["timings"]
    assert rows_by_label["RL"][6] == f"{timings['0']['record']:.2f}"
    tokens_per_s = timed[0]["attempts"] * timed[0]["mean_output_tokens"] / timed[0]["seconds"]["sample"]
    assert rows_by_label["RL"][9] == f"{tokens_per_s / 1000:.1f} k"
    assert rows_by_label["SFT"][1] == "none"  # the control has no sample or filter phase
    assert [p["label"] for p in saved["phases"]] == ["RL", "SFT"] and saved["phases"][0]["iterations"] == its
    bad = subprocess.run([sys.executable, "tools/results_report.py", str(reference_run), "--phases", "3:1"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--phases: FROM:TO" in bad.stderr


def test_two_sampler_processes_kill_and_resume_match_one(tiny_model_dir, reference_run, tmp_path):
    """sampling.num_processes=2 (one sampler per GPU; here two CPU processes): killed while both
    sample, then rerun, the run ends with the artifacts of the one-process run: one tapes file per
    phase in problem order, one call log without duplicates."""
    run_dir = tmp_path / "run"
    cmd = [*_cmd(tiny_model_dir, run_dir), "sampling.num_processes=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shard_dir = run_dir / "iterations" / "0000" / "shards"
    _wait_for(lambda: all(_lines(shard_dir / f"tapes-{k}.jsonl") >= 1 for k in (0, 1)), proc)
    child = _state(run_dir).get("child_pgid")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if child:  # the supervisor takes both samplers down with the loop; a machine crash would too
        try:
            os.killpg(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not (run_dir / "iterations" / "0000" / "tapes.jsonl").exists()  # merged only once both finish
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _summary(run_dir) == _summary(reference_run)
    from gsm8kctl.artifacts.data import split_problems
    from gsm8kctl.config import load_config

    # Iteration 0's problems (max_agent_forks 8 / 2 attempts), drawn from what validation leaves.
    pool = [int(p["id"].split("-")[1]) for p in split_problems(load_config(None, ["validation_problems=3"]), "train")]
    order, _ = next_problems(0, 4, pool, seed=42)
    tapes = list(read_jsonl(run_dir / "iterations" / "0000" / "tapes.jsonl"))
    assert [(t["problem_id"], t["attempt"]) for t in tapes] == [(p, a) for p in order for a in (0, 1)]
    for sub in ("iterations/0000", "eval/0000", "eval/0001"):
        assert (run_dir / sub / "shards").is_dir(), sub  # every sampling phase ran sharded
    ev = json.loads((run_dir / "eval" / "0001" / "metrics.json").read_text())
    ref = json.loads((reference_run / "eval" / "0001" / "metrics.json").read_text())
    assert ev["n"] == ref["n"] == 3


def test_second_loop_on_same_run_dir_is_refused(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(tiny_model_dir, run_dir), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _state(run_dir).get("child_pgid"), proc)
        second = run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run_dir), *TINY_RUN)
        assert second.returncode == 2
        assert "another loop" in second.stderr and str(proc.pid) in second.stderr
    finally:
        proc.kill()
        proc.wait()


def test_bad_loop_config_is_refused_before_any_work(tmp_path):
    proc = run_cli("loop", "--run-dir", str(tmp_path / "run"), "attempts=8", "max_agent_forks=4")
    assert proc.returncode == 2 and "max_agent_forks >= attempts" in proc.stderr
    assert not (tmp_path / "run").exists()
    for bad, says in ((["loop.engine=inprocess", "backend=vllm"], "loop.engine=inprocess samples with the "
                       "transformers backend, got backend=vllm"),
                      (["loop.engine=inprocess", "finetune.num_processes=2"], "loop.engine=inprocess trains in "
                       "one process, got finetune.num_processes=2"),
                      (["sampling.num_processes=2", "backend=openai"], "sampling.num_processes=2 starts one "
                       "sampler per GPU")):
        proc = run_cli("loop", "--run-dir", str(tmp_path / "run"), *bad)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# Process lifecycle across a crash: the restart signals only its own stage; a dead loop leaves nothing


def _restart_finished_run(model: str, run_dir: Path, child_pgid: int, child_token: str | None):
    """A run whose state.json names a stage group, restarted: it only checks for a left stage."""
    run_dir.mkdir(parents=True)
    state = {"iteration": 2, "phase": "done", "cursor": 4, "problems": None, "child_pgid": child_pgid,
             "child_token": child_token, "timings": {}, "best": None}
    (run_dir / "state.json").write_text(json.dumps(state))
    return subprocess.run(_cmd(model, run_dir), cwd=REPO, capture_output=True, text=True, timeout=300)


def _proc_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process, None once it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])


def _running(pid: int) -> bool:
    st = _proc_start(pid)
    return st is not None and st[0] not in ("Z", "X")


@pytest.mark.parametrize("token", [None, "f" * 32], ids=["no-token", "other-token"])
def test_restart_never_signals_a_group_that_is_not_its_stage(tiny_model_dir, tmp_path, token):
    """After a reboot or a pid wrap the saved group number can belong to anything."""
    pid = int(subprocess.run(["bash", "-c", "setsid sleep 1000 >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout)
    try:
        deadline = time.time() + 10
        while os.getpgid(pid) != pid and time.time() < deadline:  # setsid runs after `echo $!`
            time.sleep(0.05)
        assert os.getpgid(pid) == pid
        proc = _restart_finished_run(tiny_model_dir, tmp_path / "run", pid, token)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "stopping a stage" not in proc.stderr
        assert _running(pid), "the restart killed an unrelated process group"
    finally:
        os.kill(pid, signal.SIGKILL)


def test_restart_stops_the_stage_the_dead_loop_left(tiny_model_dir, tmp_path):
    token = secrets.token_hex(16)
    left = subprocess.Popen(["sleep", "1000"], start_new_session=True, env={**os.environ, STAGE_TOKEN_ENV: token})
    try:
        proc = _restart_finished_run(tiny_model_dir, tmp_path / "run", left.pid, token)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"stopping a stage left running by the previous loop (process group {left.pid})" in proc.stderr
        assert left.wait(timeout=10) == -signal.SIGTERM
    finally:
        left.kill()
        left.wait()


@pytest.mark.vllm
def test_sigkill_during_a_vllm_phase_leaves_no_process(smollm2_dir, tmp_path):
    """kill -9 of the loop while its evaluate stage runs a vLLM engine: within 10 s nothing of the
    stage is left (its supervisor, the stage, vLLM's engine core and workers)."""
    import vllm  # noqa: F401 - make install puts it there; missing must fail, not skip

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gsm8kctl", "loop", "--model", smollm2_dir, "--run-dir", str(run_dir),
           "--iterations", "1", "--backend", "vllm", "eval_limit=2", "evaluation.max_tokens=8",
           "warmup_sft_steps=0"]
    with open(tmp_path / "loop.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # it ended between the listing and the read
            return b""

    def engine_started() -> bool:
        pgid = _state(run_dir).get("child_pgid")
        return bool(pgid) and any(b"VLLM::" in cmdline(p) for p in live_descendants(pgid) if _running(p))

    try:
        _wait_for(engine_started, proc, timeout=600)
    except AssertionError:
        proc.kill()
        raise AssertionError((tmp_path / "loop.log").read_text()[-3000:]) from None
    time.sleep(2)  # let the engine start its workers
    st = _state(run_dir)
    pgid, token = st["child_pgid"], st["child_token"]
    tree = {p: _proc_start(p) for p in [pgid, *live_descendants(pgid)]}
    assert len(tree) >= 3, tree  # supervisor, stage, engine core (and workers)
    assert pgid in token_processes(token)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def left() -> list[int]:
        same = [p for p, start in tree.items() if _running(p) and _proc_start(p)[1] == start[1]]
        return sorted(set(same) | set(token_processes(token)) | set(live_members(pgid)))

    deadline = time.time() + 10
    while left() and time.time() < deadline:
        time.sleep(0.1)
    survivors = left()
    for p in survivors:  # do not leave 4 GB behind for the next test
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not survivors, f"processes of the stage outlived the loop by 10 s: {survivors}"


def test_duplicate_correct_counts_rewarded_copies_within_a_problem():
    from gsm8kctl.loop.driver import _duplicate_correct

    def tape(pid, ids, reward):
        return {"problem_id": pid, "completion_token_ids": ids, "reward": reward}
    tapes = [tape("a", [1, 2], 1.0), tape("a", [1, 2], 1.0), tape("a", [1, 2], 1.0),  # two copies
             tape("a", [1, 3], 1.0), tape("a", [1, 3], 0.0),   # an unrewarded twin is not a copy
             tape("b", [1, 2], 1.0)]                           # the same tokens, another problem
    assert _duplicate_correct(tapes) == 2
