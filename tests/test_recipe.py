"""The default recipe's parts on a CPU: sizes that follow the machine, the validation split, the
stop when an iteration has no reward signal, one seed meaning one run, and the seeds and
control commands on the tiny model."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import GSM8K_DIR, REPO, run_cli
from gsm8kctl.artifacts.data import split_problems
from gsm8kctl.artifacts.jsonl import read_jsonl
from gsm8kctl.config import load_config
from gsm8kctl.config.sizes import SIZE_KEYS
from gsm8kctl.loop.driver import curve_due, no_signal

# A loop of the tiny model that runs in seconds: the recipe's shape (a warm start, a validation
# split, the KL to the warm start), sizes cut down.
SMALL = ["--backend", "transformers", "loop.engine=inprocess", "transformers.dtype=float32",
         "sampling.max_tokens=6", "evaluation.max_tokens=6", "eval_limit=3", "validation_problems=3",
         "warmup_sft_steps=2", "warmup_sft_problems=8", "max_agent_forks=8", "attempts=2",
         "finetune.train_batch_size=4", "sampling.batch_size=1"]


def test_auto_sizes_follow_the_machine_and_a_key_set_wins():
    for machine, column in (("gpu", 0), ("cpu", 1)):
        chosen: dict = {}
        cfg = load_config(None, [f"machine={machine}", "iterations=7"], command="loop", sizes_chosen=chosen)
        assert cfg["iterations"] == 7 and "iterations" not in chosen  # the user's value wins
        for key, values in SIZE_KEYS.items():
            if key == "iterations":
                continue
            section, _, name = key.rpartition(".")
            value = cfg[section][name] if section else cfg[name]
            assert value == values[column] and chosen[key] == values[column], key
    # machine=auto on this CPU-only machine is the CPU column, and the saved config holds numbers.
    cfg = load_config(None, [], command="loop")
    assert cfg["machine"] == "cpu" and cfg["warmup_sft_steps"] == SIZE_KEYS["warmup_sft_steps"][1]
    assert "auto" not in [cfg[k] for k in SIZE_KEYS if "." not in k]
    # A size set to auto again on the command line is the machine's too; a bad value is still refused.
    assert load_config(None, ["attempts=auto", "machine=gpu"])["attempts"] == SIZE_KEYS["attempts"][0]
    proc = run_cli("loop", "--run-dir", "/nonexistent/x", "attempts=many")
    assert proc.returncode == 2 and "attempts must be an integer" in proc.stderr


def test_validation_split_is_held_out_by_seed():
    cfg = load_config(None, ["validation_problems=500"])
    train, held = split_problems(cfg, "train"), split_problems(cfg, "validation")
    n = sum(1 for _ in open(GSM8K_DIR / "train.jsonl"))
    assert len(held) == 500 and len(train) == n - 500
    assert not {p["id"] for p in train} & {p["id"] for p in held}
    assert held == split_problems(load_config(None, ["validation_problems=500"]), "validation")  # fixed by seed
    assert held != split_problems(load_config(None, ["validation_problems=500", "seed=7"]), "validation")
    assert len(split_problems(load_config(None, ["validation_problems=0"]), "train")) == n
    with pytest.raises(Exception, match="would hold out all"):
        split_problems(load_config(None, [f"validation_problems={n}"]), "train")


def test_stages_see_the_splits(tmp_path, tiny_model_dir):
    """filter --gold --split train never makes a sample of a held-out problem; evaluate
    --split validation evaluates exactly the held-out ones."""
    held = {p["id"] for p in split_problems(load_config(None, ["validation_problems=40"]), "validation")}
    gold = tmp_path / "gold.jsonl"
    run_cli("filter", "--gold", "--split", "train", "--n-problems", "200", "--model", tiny_model_dir,
            "-o", str(gold), "validation_problems=40", check=True)
    ids = {s["problem_id"] for s in read_jsonl(gold)}
    assert len(ids) == 200 and not ids & held
    run_cli("evaluate", "--split", "validation", "--model", tiny_model_dir, "--backend", "transformers",
            "-o", str(tmp_path / "ev"), "validation_problems=40", "evaluation.max_tokens=2", "--quiet", check=True)
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["split"] == "validation" and metrics["n"] == 40
    assert {t["problem_id"] for t in read_jsonl(tmp_path / "ev" / "tapes.jsonl")} == held


def _row(**kw):
    row = {"attempts": 64, "problems": 16, "train_success_rate": 0.0, "format_rate": 0.0,
           "overflow_rate": 0.0, "mean_output_tokens": 80.0, "uniform_groups": 16}
    row.update(kw)
    return row


def test_no_signal_tells_the_causes_apart():
    cfg = load_config(None, [])
    assert "raise sampling.max_tokens" in no_signal(_row(overflow_rate=0.6, format_rate=0.01), cfg)
    assert "agent.few_shot" in no_signal(_row(format_rate=0.01), cfg)
    assert "formatted but wrong" in no_signal(_row(format_rate=0.5), cfg)
    uniform = no_signal(_row(train_success_rate=0.2, format_rate=0.9), cfg)
    assert "all attempts scored alike" in uniform and "attempts" in uniform
    assert no_signal(_row(train_success_rate=0.2, format_rate=0.9, uniform_groups=10), cfg) is None
    # Rejection sampling trains on all-correct groups too: uniform is not "nothing".
    rs = load_config(None, ["use_rejection_sampling=true"])
    assert no_signal(_row(train_success_rate=1.0, format_rate=1.0), rs) is None
    assert no_signal({"iteration": 3, "test_accuracy_strict": 0.1}, cfg) is None  # an evaluation-only row


def test_a_loop_without_signal_stops_with_exit_1_and_resumes(tmp_path, tiny_model_dir):
    """The tiny random model never earns a reward: the default stops it after 2 such iterations."""
    run = tmp_path / "run"
    args = ["loop", "--model", tiny_model_dir, "--run-dir", str(run), *SMALL, "--iterations", "5",
            "test_every_n_iterations=0"]
    proc = run_cli(*args)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "stopped after 2 iterations in a row without a reward signal" in last
    assert "raise sampling.max_tokens (now 6)" in last and "Traceback" not in proc.stderr
    assert "warning: iteration 0 has no reward signal: no attempt of" in proc.stderr
    rows = list(read_jsonl(run / "metrics.jsonl"))
    assert [r["iteration"] for r in rows] == [-1, 0, 1] and rows[1]["no_signal"] and rows[2]["no_signal"]
    state = json.loads((run / "state.json").read_text())
    assert (state["iteration"], state["phase"]) == (2, "evaluate")  # saved: the same command goes on
    # No evaluation since the start: the curve was drawn at the stop, after the last metrics line.
    assert (run / "learning_curve.png").stat().st_mtime_ns >= (run / "metrics.jsonl").stat().st_mtime_ns
    again = run_cli(*args, "stop_without_signal=0", "--iterations", "3")
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl")] == [-1, 0, 1, 2, 3]


def test_the_curve_is_redrawn_when_an_evaluation_lands_and_after_the_last_iteration():
    assert curve_due({"iteration": -1, "test_accuracy_strict": 0.0}, 8)
    assert curve_due({"iteration": 4, "validation_accuracy_strict": 0.1, "test_accuracy_strict": None}, 8)
    assert not curve_due({"iteration": 5, "test_accuracy_strict": None, "train_success_rate": 0.1}, 8)
    assert curve_due({"iteration": 8}, 8)  # the last, evaluated or not (test_every_n_iterations=0)


def test_one_seed_samples_the_same_tokens_in_any_run_directory(tmp_path, tiny_model_dir):
    """After a warm start the sampling model lies inside the run directory; its path must not
    change what a seed samples (CPU, float32)."""
    tapes = []
    for name in ("a", "b"):
        run = tmp_path / name
        run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *SMALL, "--iterations", "1",
                "test_every_n_iterations=0", "stop_without_signal=0", check=True)
        found = sorted(read_jsonl(run / "iterations" / "0000" / "tapes.jsonl"),
                       key=lambda t: (t["problem_id"], t["attempt"]))
        assert found and str(run) in found[0]["model"]  # sampled by the warm start's checkpoint
        tapes.append([(t["problem_id"], t["attempt"], t["completion_token_ids"]) for t in found])
    assert tapes[0] == tapes[1]


def test_seeds_runs_each_loop_and_its_control_and_reports_medians(tmp_path, tiny_model_dir):
    run = tmp_path / "seeds"
    # Two loops at once (a GPU's default): each keeps to half of the GPU's memory.
    args = ["seeds", "--run-dir", str(run), "--seeds", "3,5", "--parallel", "2", f"model={tiny_model_dir}",
            "backend=transformers", *SMALL[2:],
            "iterations=1", "stop_without_signal=0", "filter.drop_uniform_groups=false",
            "finetune.rl.use_advantages=false", "--json"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary == json.loads((run / "seeds.json").read_text())
    assert set(summary["seeds"]) == {"3", "5"} and (run / "seeds.png").read_bytes()[:4] == b"\x89PNG"
    for s in (3, 5):
        loop_cfg = load_config(run / f"seed-{s}" / "config.yaml", [])
        assert loop_cfg["seed"] == s and loop_cfg["machine"] == "cpu" and loop_cfg["gpu_memory_share"] == 0.5
        rows = {r["iteration"]: r for r in read_jsonl(run / f"seed-{s}" / "metrics.jsonl")}
        result = summary["seeds"][str(s)]
        assert result["done"] and result["warm_start"] == rows[0]["test_accuracy_strict"]
        assert result["chosen_on"] == "validation" and result["last_iteration"] == 1
        control = list(read_jsonl(run / f"seed-{s}" / "control" / "metrics.jsonl"))
        # The control trained as many tokens as RL had before the chosen checkpoint's evaluation.
        assert [r["iteration"] for r in control] == [result["chosen_iteration"]]
        assert result["control"] == control[0]["test_accuracy_strict"] and control[0]["test_n"] == 3
    warm = [r["warm_start"] for r in summary["seeds"].values()]
    assert summary["summary"]["warm_start"] == {"median": round(sorted(warm)[0] / 2 + sorted(warm)[1] / 2, 4),
                                                "min": min(warm), "max": max(warm), "n": 2}
    # A rerun resumes: nothing is trained or evaluated again.
    before = {p: p.stat().st_mtime_ns for p in run.rglob("metrics.json*")}
    assert len(before) > 10  # the loops' and the controls' metrics, their evaluations', finetune's
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout) == summary
    assert {p: p.stat().st_mtime_ns for p in run.rglob("metrics.json*")} == before
    shown = run_cli(*(a for a in args if a != "--json"), env={"COLUMNS": "80"})
    assert shown.returncode == 0, shown.stderr[-3000:]
    # Without --json the summary is a table on stderr, whole in 80 columns: no number cut, the range
    # over seeds on its own row.
    table = shown.stderr[shown.stderr.index("seeds: test strict accuracy"):].splitlines()
    end = next(i for i, line in enumerate(table) if line.split()[:1] == ["range"])
    table, span = table[:end + 1], table[end]
    assert "…" not in "\n".join(table) and all(len(line) <= 80 for line in table)
    starts = sorted(r["warm_start"] for r in summary["seeds"].values())
    assert span.split()[1] == f"{starts[0] * 100:.2f}–{starts[1] * 100:.2f}"


def test_control_matches_the_rl_runs_tokens(tmp_path, tiny_model_dir):
    """At the last evaluation of a run that trained, the control trains ceil(tokens / tokens per
    step) SFT steps from the run's warm start."""
    run = tmp_path / "run"
    run_cli("loop", "--model", tiny_model_dir, "--run-dir", str(run), *SMALL, "--iterations", "2",
            "stop_without_signal=0", "filter.drop_uniform_groups=false", "finetune.rl.use_advantages=false",
            check=True)
    from gsm8kctl.loop.control import rl_token_schedule

    _, cumulative = rl_token_schedule(run)
    assert 0 < cumulative[0] < cumulative[1]
    out = tmp_path / "control"
    proc = run_cli("control", str(run), "-o", str(out), "--at", "all", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["iteration"]: r for r in read_jsonl(out / "metrics.jsonl")}
    assert set(rows) == {0, 1, 2}
    assert [rows[i]["train_tokens_target"] for i in (0, 1, 2)] == [0, cumulative[0], cumulative[1]]
    assert rows[0]["train_steps_total"] == 0 < rows[1]["train_steps_total"] <= rows[2]["train_steps_total"]
    start = json.loads((run / "state.json").read_text())["start_model"]
    assert rows[0]["model"] == start and Path(rows[2]["model"]).name == f"step-{rows[2]['train_steps_total']:06d}"
    gold = {s["problem_id"] for s in read_jsonl(out / "gold_samples.jsonl")}
    held = {t["problem_id"] for t in read_jsonl(run / "validation" / "0000" / "tapes.jsonl")}
    assert gold and not gold & held  # the control never trains on a validation problem


def test_the_curriculum_draws_open_problems_again(tmp_path, tiny_model_dir):
    """revisit_share: the loop keeps RUN/pass_rates.jsonl from each iteration's tapes and draws that
    share of the next iteration's problems from those whose pass rate was strictly between 0 and 1.
    The tiny model never succeeds, so two problems are marked open by hand between two runs."""
    run = tmp_path / "run"
    args = ["loop", "--model", tiny_model_dir, "--run-dir", str(run), *SMALL, "test_every_n_iterations=0",
            "stop_without_signal=0", "revisit_share=0.5"]
    run_cli(*args, "--iterations", "1", check=True)
    table = [json.loads(line) for line in (run / "pass_rates.jsonl").read_text().splitlines()]
    first = sorted({t["problem_id"] for t in read_jsonl(run / "iterations" / "0000" / "tapes.jsonl")})
    assert [r["problem_id"] for r in table] == first and len(first) == 4
    assert all((r["attempts"], r["successes"], r["iterations"]) == (2, 0, [[0, 0, 2]]) for r in table)
    for r in table[:2]:
        r.update(successes=1, pass_rate=0.5, last_pass_rate=0.5, iterations=[[0, 1, 2]])
    (run / "pass_rates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table))
    proc = run_cli(*args, "--iterations", "2", check=True)
    assert "iteration 1: 2 of its 4 problems drawn again" in proc.stderr
    second = {t["problem_id"] for t in read_jsonl(run / "iterations" / "0001" / "tapes.jsonl")}
    assert len(second) == 4 and {table[0]["problem_id"], table[1]["problem_id"]} <= second
    again = {r["problem_id"]: r for r in read_jsonl(run / "pass_rates.jsonl")}
    assert again[table[0]["problem_id"]]["iterations"] == [[0, 1, 2], [1, 0, 2]]


@pytest.mark.parametrize("engine", ["inprocess", "processes"])
def test_the_loop_keeps_library_output_in_its_log(tmp_path, tiny_model_dir, engine):
    """What libraries print, in the loop's process or a stage's, goes to RUN/output.log; the
    terminal gets the loop's own talk. With -v both."""
    chatter = tmp_path / "site"
    chatter.mkdir()
    shutil.copy(REPO / "tests" / "library_chatter.py", chatter / "sitecustomize.py")
    env = {"PYTHONPATH": str(chatter), "GSM8KCTL_TEST_CHATTER": "1"}
    # One iteration's sample, filter and finetune phases, without warm start or evaluations: every
    # phase that could print is a stage process under the processes engine.
    args = ["loop", "--model", tiny_model_dir, *SMALL, f"loop.engine={engine}", "--iterations", "1",
            "warmup_sft_steps=0", "test_every_n_iterations=0", "stop_without_signal=0",
            "filter.drop_uniform_groups=false", "finetune.rl.use_advantages=false"]
    run = tmp_path / "run"
    proc = run_cli(*args, "--run-dir", str(run), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHATTER" not in proc.stderr and "CHATTER" not in proc.stdout
    log = (run / "output.log").read_text()
    for what in ("on stdout", "on stderr", "as a FutureWarning", "as a log record"):
        assert f"CHATTER {what}" in log, what
    assert f"engine: {engine}" in proc.stderr and "iteration 0" in proc.stderr  # the loop's own talk
    assert '"steps_run"' not in proc.stderr  # a finetune phase's result is not a JSON dump
    loud = run_cli(*args, "--run-dir", str(tmp_path / "loud"), "-v", env=env)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "CHATTER on stderr" in loud.stderr and not (tmp_path / "loud" / "output.log").exists()


def test_a_stage_run_by_hand_keeps_library_output_beside_its_output(tmp_path, tiny_model_dir):
    """`sample` and `evaluate`: what libraries print goes to output.log beside the output, the data
    stream stays clean; with -v on the terminal; after a failure the error says where it is."""
    chatter = tmp_path / "site"
    chatter.mkdir()
    shutil.copy(REPO / "tests" / "library_chatter.py", chatter / "sitecustomize.py")
    env = {"PYTHONPATH": str(chatter), "GSM8KCTL_TEST_CHATTER": "1"}
    common = ["--model", tiny_model_dir, "--backend", "transformers", "--max-tokens", "4"]
    out = tmp_path / "s"
    out.mkdir()
    proc = run_cli("sample", *common, "--n-problems", "2", "--attempts", "2", "-o", str(out / "t.jsonl"), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHATTER" not in proc.stderr + proc.stdout and "4 tapes written" in proc.stderr
    log = (out / "output.log").read_text()
    for what in ("on stdout", "on stderr", "as a FutureWarning", "as a log record"):
        assert f"CHATTER {what}" in log, what
    ev = run_cli("evaluate", *common, "--limit", "2", "-o", str(tmp_path / "ev"), "--json", env=env)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout)["n"] == 2 and "CHATTER" not in ev.stderr  # --json: stdout is the JSON alone
    assert "CHATTER on stderr" in (tmp_path / "ev" / "output.log").read_text()
    loud = run_cli("evaluate", *common, "--limit", "2", "-o", str(tmp_path / "loud"), "-v", env=env)
    assert loud.returncode == 0 and "CHATTER on stderr" in loud.stderr
    assert not (tmp_path / "loud" / "output.log").exists()
    failed = run_cli("sample", *common, "--n-problems", "1", "-o", str(out / "f.jsonl"),
                     env={**env, "GSM8KCTL_TEST_CHATTER": "fail"})
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and "CHATTER" not in failed.stderr, failed.stderr[-3000:]
    assert lines[-2] == f"what the libraries printed is in {out / 'output.log'}"
    assert lines[-1].startswith("Internal error: RuntimeError: the library failed")
