"""`loop`: the RL loop — evaluate, sample, filter, finetune, record — with crash-safe resume.

Each phase runs the stage of the same name on files in the run directory (layout in
`rundir.py`), either as a child process or in this process with the model resident
(`engine.py`, `loop.engine`); every phase can also be rerun by hand. `state.json` says which
phase of which iteration is next; it is rewritten atomically after a phase has finished.
Killed at any moment and started again with the same command, the loop reruns the unfinished
phase, whose stage resumes by itself: `sample` appends only missing attempts, `filter`
rewrites its output atomically, `finetune` continues from its last saved state, `evaluate`
appends only missing problems. Nothing is done twice, nothing is lost.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gsm8kctl.artifacts.jsonl import read_jsonl, write_jsonl
from gsm8kctl.artifacts.llm_calls import check_log
from gsm8kctl.artifacts.paths import SAVED_CONFIG, OwnFile, check_output_dir, check_replaceable
from gsm8kctl.artifacts.rundir import (CONFIG_FILE, CURVE_FILE, EVAL_METRICS_FILE, FINETUNE_DIR, KEEP_MARKER,
                                       LLM_CALLS_FILE, OUTPUT_LOG_FILE, PASS_RATES_FILE, PHASES, RUN_METRICS_FILE,
                                       RunLock, SAMPLES_FILE, START_ITERATION, START_MODEL, STATE_FILE, TAPES_FILE,
                                       WARMUP_DIR, WARNINGS_FILE, eval_dir, is_own_checkpoint, iteration_dir,
                                       latest_checkpoint, load_state, mark_keep, save_state, unmark_keep)
from gsm8kctl.config import save_config
from gsm8kctl.errors import Stopped, UserError
from gsm8kctl.loop.curriculum import choose_problems, read_pass_rates, record_pass_rates
from gsm8kctl.procs import StageRecord
from gsm8kctl.progress import LIBRARY_OUTPUT_ENV, WARNINGS_ENV, console, library_output_to, say, warn
from gsm8kctl.stages.stats import tape_stats

# ---------------------------------------------------------------------------------------------
# What an iteration trains, and the warnings about it


def iteration_steps(n_samples: int, ft: dict) -> dict:
    """Optimizer steps of one iteration's finetune, and how many passes over its samples they make.

    `finetune.steps` if set, else `save_checkpoint_steps` if set (the TapeAgents command line: a
    fixed count whatever the data), else `epochs` passes. A fixed count on a few samples repeats
    them: with the TapeAgents command line's settings, 8 steps per iteration on 16-35 successes
    drove the new/old ratio to 47 and test accuracy down.
    """
    from gsm8kctl.training.trainer import global_batch_size, steps_per_epoch

    batch = global_batch_size(ft, int(ft["num_processes"]))
    if ft["steps"] is not None:
        steps, mode, why = int(ft["steps"]), "fixed", f"finetune.steps={ft['steps']}"
    elif ft["save_checkpoint_steps"] is not None:
        steps, mode = int(ft["save_checkpoint_steps"]), "fixed"
        why = f"finetune.save_checkpoint_steps={steps}"
    else:
        steps, mode, why = None, "data", f"finetune.epochs={ft['epochs']}"
    if n_samples == 0:
        return {"steps": 0, "passes": 0.0, "mode": mode, "why": why, "global_batch": batch}
    per_pass = steps_per_epoch(n_samples, batch)
    if steps is None:
        steps = int(ft["epochs"]) * per_pass
    # finetune's passes: a pass is ceil(n / batch) steps, its last step the remainder.
    return {"steps": steps, "passes": round(steps / per_pass, 3), "mode": mode, "why": why, "global_batch": batch}


def iteration_warnings(row: dict, earlier: list[dict], cfg: dict) -> list[str]:
    """The guard: what in this metrics.jsonl line (and the evaluation before it) a user should see."""
    out = []
    limit = cfg["warn_passes"]
    if limit is not None and row.get("train_passes", 0) > limit:
        remedy = ("set finetune.save_checkpoint_steps and finetune.steps to null (one pass per iteration)"
                  if row.get("train_steps_mode") == "fixed" else "lower finetune.epochs")
        out.append(f"trained {row['train_passes']:g} passes over its {row['samples_kept']} samples "
                   f"({row['train_steps']} steps, > warn_passes={limit:g}): so many repeats overfit them; "
                   f"{remedy}, or sample more problems (max_agent_forks)")
    drop, now = cfg["warn_test_drop"], row.get("test_accuracy_strict")
    before = [r for r in earlier if r["iteration"] < row["iteration"] and r.get("test_accuracy_strict") is not None]
    if drop is not None and now is not None and before:
        prev = max(before, key=lambda r: r["iteration"])
        # Rounded: accuracies carry 4 decimals, and 0.05 - 0.04 is 0.010000000000000002.
        fall = round(prev["test_accuracy_strict"] - now, 6)
        if fall > drop:
            out.append(f"test strict accuracy fell {fall * 100:.2f} points, {prev['test_accuracy_strict']:.2%} "
                       f"at iteration {prev['iteration']} -> {now:.2%} (> warn_test_drop={drop:g})")
    for key, label, limit_key, cause in (
            ("train_ratio_max", "new/old probability ratio", "warn_ratio",
             "the policy moved far from the model that sampled; lower finetune.learning_rate or the steps per iteration"),
            ("train_kl_max", "KL to the reference", "warn_kl",
             "the policy moved far from the reference model; lower finetune.learning_rate or raise finetune.rl.kl_coef")):
        value, limit = row.get(key), cfg[limit_key]
        if value is not None and limit is not None and value > limit:
            out.append(f"a finetune step's mean {label} reached {value:.3g} (> {limit_key}={limit:g}): {cause}")
    # Entropy falls as RL sharpens the policy; a rise to a multiple of where it started means the
    # distribution is spreading out, e.g. sampling below T 1 leaves the tail untrained (docs/results.md).
    limit, now = cfg["warn_entropy"], row.get("train_entropy_mean")
    first = next((r["train_entropy_mean"] for r in sorted(earlier, key=lambda r: r["iteration"])
                  if r["iteration"] < row["iteration"] and r.get("train_entropy_mean")), None)
    if limit is not None and now is not None and first and now > limit * first:
        out.append(f"the mean entropy reached {now:.3g}, {now / first:.2g}x the first iteration's {first:.3g} "
                   f"(> warn_entropy={limit:g}): the policy is spreading out; sample at "
                   f"sampling.temperature 1, lower finetune.learning_rate or raise finetune.rl.kl_coef")
    return out


def no_signal(row: dict, cfg: dict) -> str | None:
    """Why an iteration (its metrics.jsonl line) gave training no reward signal (no correct attempt, or
    every group scored alike; a format-only difference does not teach answers), and the keys
    that change it; None when it did. Told apart by what the attempts did: ran out of tokens,
    never wrote the answer format, wrote it and were wrong, or scored alike within every group."""
    if not row.get("attempts"):
        return None  # an evaluation-only row
    if not row["train_success_rate"]:
        fmt, over, mean = row["format_rate"], row["overflow_rate"], row["mean_output_tokens"]
        facts = (f"no attempt of {row['attempts']} earned a reward (answer format {fmt:.1%}, {over:.0%} ran to "
                 f"the token limit, {mean:.0f} tokens on average)")
        if over >= 0.3:
            cause = (f"most attempts run out of tokens before they answer: raise sampling.max_tokens "
                     f"(now {cfg['sampling']['max_tokens']}), or teach a shorter solution with a warm start "
                     f"(warmup_sft_steps, now {cfg['warmup_sft_steps']})")
        elif fmt < 0.05:
            cause = (f"the model rarely puts its answer in \\boxed{{}}: teach the format with a warm start "
                     f"(warmup_sft_steps, now {cfg['warmup_sft_steps']}) or show solved examples "
                     f"(agent.few_shot, now {cfg['agent']['few_shot']})")
        else:
            cause = (f"the answers are formatted but wrong: start from a stronger model (warmup_sft_steps, now "
                     f"{cfg['warmup_sft_steps']}) or sample more attempts per problem (attempts, now {cfg['attempts']})")
        return f"{facts}; {cause}"
    grouped = not cfg["use_rejection_sampling"] and cfg["finetune"]["rl"]["use_advantages"]
    if grouped and row["uniform_groups"] >= row["problems"]:
        return (f"in every one of its {row['problems']} problems all attempts scored alike, so every group "
                f"advantage is 0: sample more attempts per problem (attempts, now {cfg['attempts']}) or train "
                f"on successes alone (use_rejection_sampling=true)")
    return None


def _finetune_summary(run_dir: Path, samples: list[dict]) -> dict:
    """Over the finetune steps that trained on these samples (an iteration's samples file): the
    largest mean ratio and KL (the guard reads these), and the mean loss, entropy and KL (the
    learning curves plot these)."""
    from gsm8kctl.artifacts.rundir import FINETUNE_METRICS_FILE
    from gsm8kctl.training.trainer import fingerprint

    path = run_dir / FINETUNE_DIR / FINETUNE_METRICS_FILE
    out = dict.fromkeys(("train_ratio_max", "train_kl_max", "train_loss_mean", "train_entropy_mean",
                         "train_kl_mean"))
    if not samples or not path.exists():
        return out
    fp = fingerprint(samples)  # finetune tags each step's line with its samples' fingerprint
    lines = [r for r in read_jsonl(path, repair_tail=True) if r.get("phase") == fp]
    for key, src, reduce in (("train_ratio_max", "ratio_mean", max), ("train_kl_max", "kl", max),
                             ("train_loss_mean", "loss", _mean), ("train_entropy_mean", "entropy", _mean),
                             ("train_kl_mean", "kl", _mean)):
        values = [r[src] for r in lines if r.get(src) is not None]
        out[key] = round(reduce(values), 4) if values else None
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------
# The loop


def _is_run_metrics(p: Path) -> bool:
    # Read whole now: the record phase rewrites it only after the iteration's work.
    try:
        return all(isinstance(r.get("iteration"), int) for r in read_jsonl(p))
    except UserError:
        return False


# RUN/metrics.jsonl as the record phase writes it: every line an object with its iteration.
RUN_METRICS = OwnFile(_is_run_metrics, "a loop's metrics (one line per iteration)")


def loop(cfg: dict, run_dir: str, *, quiet: bool = False, sizes: dict | None = None,
         library_log: bool = False) -> dict:
    """`sizes`: what the config's `auto` keys became on this machine (printed at start).
    `library_log`: what libraries print (here and in the stage processes) goes to RUN/output.log,
    not the terminal (the command line's default; `-v` keeps it on the terminal)."""
    run = Path(run_dir)
    # Every check before the run directory is created or anything in it is written.
    check_output_dir(run, option="--run-dir", files=(CONFIG_FILE, STATE_FILE, RUN_METRICS_FILE),
                     data_dir=cfg["data_dir"])
    check_log(run / LLM_CALLS_FILE)
    check_replaceable(run / CONFIG_FILE, option="--run-dir", kind=SAVED_CONFIG)
    check_replaceable(run / RUN_METRICS_FILE, option="--run-dir", kind=RUN_METRICS)
    if cfg["attempts"] < 1 or cfg["max_agent_forks"] < cfg["attempts"]:
        raise UserError("need attempts >= 1 and max_agent_forks >= attempts "
                        f"(got attempts={cfg['attempts']}, max_agent_forks={cfg['max_agent_forks']})")
    if cfg["iterations"] < 0 or cfg["test_every_n_iterations"] < 0:
        raise UserError("iterations and test_every_n_iterations must be >= 0")
    from gsm8kctl.artifacts.data import split_problems
    from gsm8kctl.artifacts.models import resolve_model

    # Checks the data (and the held-out size) before any work; the loop trains on this pool only.
    pool = [int(p["id"].split("-")[1]) for p in split_problems(cfg, "train")]
    base_model = resolve_model(cfg["model"])
    old = load_state(run)  # checked now; read again under the lock
    if cfg["filter"]["ref_model"] == START_MODEL and old["phase"] != "warmup" and old.get("start_model") is None:
        raise UserError(f"{run / STATE_FILE}: filter.ref_model={START_MODEL} needs the model this run started "
                        "from, and this state file (written before the option existed) does not say; set "
                        "filter.ref_model to that model's path")
    run.mkdir(parents=True, exist_ok=True)
    if library_log:
        library_output_to(run / OUTPUT_LOG_FILE)
    else:
        os.environ[LIBRARY_OUTPUT_ENV] = "terminal"  # and its stage processes keep it there too
    from gsm8kctl.config.sizes import describe

    if sizes:
        say(describe(cfg["machine"], sizes), quiet)
    with RunLock(run):
        save_config(cfg, run / CONFIG_FILE)
        state = load_state(run)
        # Only a group that still carries the saved token is our stage: after a reboot or a pid wrap
        # the saved number can belong to anything (gsm8kctl/procs.py).
        left = StageRecord.from_state(state)
        if left is not None and left.processes():
            say(f"stopping a stage left running by the previous loop (process group {left.pgid})", quiet)
            left.stop()
        from gsm8kctl.loop.engine import open_engine

        engine = open_engine(cfg, run, state, quiet=quiet)
        try:
            _Context(cfg, run, state, base_model, pool, quiet, engine=engine).run()
        finally:
            os.environ.pop(WARNINGS_ENV, None)
            engine.close()
        return state


class _Context:
    """What every phase needs; one method per phase, read top to bottom in `run`."""

    def __init__(self, cfg: dict, run: Path, state: dict, base_model: str, pool: int | list[int], quiet: bool,
                 engine=None):
        self.cfg, self.run_dir, self.state, self.base_model = cfg, run, state, base_model
        self.pool, self.quiet = pool, quiet  # the training problems' lines of the train file
        # The split that chooses the best checkpoint: never the test split while a validation one exists.
        self.select_on = "validation" if cfg["validation_problems"] else "test"
        self.engine = engine  # engine.ProcessEngine or InProcessEngine: runs each phase's stage
        # An iteration's tapes and samples as this process wrote or read them, so that a later phase
        # need not parse the file again; a phase resumed after the one that made them reads it.
        self.held: dict = {"iteration": None, "tapes": None, "samples": None}
        self.pass_rates: dict[str, dict] | None = None

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        st = self.state
        if st["phase"] == "done":
            if st["iteration"] - 1 >= self.cfg["iterations"]:
                say(f"{self.run_dir}: all {self.cfg['iterations']} iterations done (raise --iterations to go on)",
                    self.quiet)
                return
            # Asked for more iterations: the last one ran only its final evaluation; train it now.
            st.update(iteration=st["iteration"] - 1, phase="sample", problems=None)
        pending = st.pop("pending_save", None)
        latest = latest_checkpoint(self.run_dir)
        if pending and (latest is None or latest.resolve() != Path(pending["checkpoint"]).resolve()):
            # Killed before a background save was published: that phase's weights are lost, so it is
            # trained again from the checkpoint before it. Attempts already sampled or evaluated
            # with those weights are kept: the redone phase gives the same weights (the same
            # data, seeds and saved state), and the checkpoint gets the same name.
            say(f"the checkpoint {Path(pending['checkpoint']).name} was still being written when the loop "
                f"stopped: training its phase again", self.quiet)
            st.update({k: pending[k] for k in ("iteration", "phase", "cursor", "problems")})
        if st["phase"] == "warmup":
            self._warmup()
            start = self.current_model()  # the warm start's checkpoint, or the model itself resolved
            st.update(phase="evaluate", start_model=self.base_model if start == self.cfg["model"] else start)
            save_state(self.run_dir, st)
        iterations = self.cfg["iterations"]
        while st["iteration"] <= iterations:
            it = st["iteration"]
            last = it == iterations  # after the last iteration only the final evaluation runs
            for phase in PHASES[PHASES.index(st["phase"]):]:
                if last and phase != "evaluate" and phase != "record":
                    continue
                self._banner(it, phase)
                t0 = time.time()
                # A phase's out-of-memory retries (this process's or a stage's) land in the iteration's file.
                os.environ[WARNINGS_ENV] = str(self.it_dir(it) / WARNINGS_FILE)
                getattr(self, f"_{phase}")(it)
                st["timings"].setdefault(str(it), {})[phase] = round(time.time() - t0, 1)
                nxt = PHASES.index(phase) + 1
                if nxt < len(PHASES):
                    st["phase"] = PHASES[nxt]
                else:
                    st.update(iteration=it + 1, phase="evaluate", problems=None)
                st.update(StageRecord.cleared())
                save_state(self.run_dir, st)
                if phase == "record":
                    self._stop_without_signal(it)
        self._settle(st["iteration"] - 1)
        st["phase"] = "done"
        save_state(self.run_dir, st)
        self._summary()

    def _stop_without_signal(self, it: int) -> None:
        """Stop (exit 1) after `stop_without_signal` iterations in a row without a reward signal,
        rather than spend the rest of the run the same way. The state is saved: a rerun goes on."""
        limit = self.cfg["stop_without_signal"]
        if not limit:
            return
        self._settle(it)
        rows = sorted(read_jsonl(self.run_dir / RUN_METRICS_FILE), key=lambda r: r["iteration"])
        trained = [r for r in rows if r.get("attempts")]
        streak = trained[-limit:]
        if len(streak) == limit and all(r.get("no_signal") for r in streak) and streak[-1]["iteration"] == it:
            plot_learning_curve(rows, self.run_dir / CURVE_FILE)  # the curve up to where it stops
            raise Stopped(f"{self.run_dir}: stopped after {limit} iterations in a row without a reward signal "
                          f"(stop_without_signal={limit}); the last: {streak[-1]['no_signal']}. Change the config "
                          "and rerun the same command to go on from here")

    # ------------------------------------------------------------------ paths
    def it_dir(self, it: int) -> Path:
        return iteration_dir(self.run_dir, it)

    def eval_dir(self, it: int, split: str = "test") -> Path:
        return eval_dir(self.run_dir, it, split)

    def splits(self) -> tuple[str, ...]:
        """What an evaluation covers: the test split, and the validation split where there is one."""
        return ("test", "validation") if self.cfg["validation_problems"] else ("test",)

    def _evaluate_model(self, model: str, it: int) -> dict[str, dict]:
        """Greedy evaluations of `model` on each split; their metrics by split."""
        out = {}
        for split in self.splits():
            limit = self.cfg["eval_limit"] if split == "test" else None  # validation: every held-out problem
            self.engine.evaluate(model, self.eval_dir(it, split), it, limit, split)
            out[split] = json.loads((self.eval_dir(it, split) / EVAL_METRICS_FILE).read_text(encoding="utf-8"))
        return out

    def current_model(self) -> str:
        pending = self.state.get("pending_save")
        if pending:  # in-process: the trainer's weights, their checkpoint still being written
            return pending["checkpoint"]
        ckpt = latest_checkpoint(self.run_dir)
        return str(ckpt) if ckpt else self.cfg["model"]

    def _pending(self, info: dict, phase: str) -> None:
        """Remember a checkpoint the engine writes in the background, and where to go back to if
        the loop is killed before it is on disk (`run` reads it at the start)."""
        if info.get("pending"):
            st = self.state
            st["pending_save"] = {"checkpoint": info["pending"], "iteration": st["iteration"], "phase": phase,
                                  "cursor": st["cursor"], "problems": st["problems"]}

    def _settle(self, it: int) -> None:
        """Wait for a background checkpoint write: before the next iteration's problems are drawn
        (a redone phase must see the same cursor), before a checkpoint is marked, and at the end."""
        if self.state.get("pending_save") is None:
            return
        waited = self.engine.wait_saved()
        self.state.pop("pending_save")
        self.state["timings"].setdefault(str(it), {})["checkpoint_wait"] = round(waited, 3)

    # ------------------------------------------------------------------ phases
    def _warmup(self) -> None:
        steps = self.cfg["warmup_sft_steps"]
        if not steps:
            return
        if self.cfg["test_before_warmup"]:
            self._evaluate_start()
        self._banner(-1, "warm-start SFT on gold solutions")
        d = self.run_dir / WARMUP_DIR
        samples = d / SAMPLES_FILE
        if not samples.exists():
            self.engine.gold_samples(samples, self.cfg["warmup_sft_problems"])
        lr = self.cfg["warmup_sft_learning_rate"]
        # No KL term: the warm start is what the KL of the iterations (ref_model=start) measures against.
        overrides = {"finetune.rl.kl_coef": 0.0, **({"finetune.learning_rate": lr} if lr is not None else {})}
        self._pending(self.engine.finetune(samples, steps, objective="sft", overrides=overrides), "warmup")

    def _evaluate_start(self) -> None:
        """The starting model on the test split, before the warm start changes it: what the warm
        start and the iterations gained is measured from here (metrics.jsonl iteration -1)."""
        it = START_ITERATION
        if not all((self.eval_dir(it, s) / EVAL_METRICS_FILE).exists() for s in self.splits()):  # a rerun skips it
            self._banner(it, "evaluate the starting model")
            t0 = time.time()
            self._evaluate_model(self.cfg["model"], it)
            self.state["timings"].setdefault(str(it), {})["evaluate"] = round(time.time() - t0, 1)
            save_state(self.run_dir, self.state)
        m = json.loads((self.eval_dir(it, self.select_on) / EVAL_METRICS_FILE).read_text(encoding="utf-8"))
        self._mark_best(it, m["accuracy_strict"], Path(m["model"]))
        self._record(it)

    def _evaluate(self, it: int) -> None:
        every = self.cfg["test_every_n_iterations"]
        final = it == self.cfg["iterations"]
        if not every or (it % every and not final):
            return
        model = self.current_model()
        m = self._evaluate_model(model, it)[self.select_on]
        # Marked now, not at record: this iteration's finetune prunes, and with keep_checkpoints=1
        # it would delete the checkpoint just evaluated before record could keep it.
        self._settle(it)
        self._mark_best(it, m["accuracy_strict"], Path(m["model"]))

    def _sample(self, it: int) -> None:
        st = self.state
        k = max(1, self.cfg["max_agent_forks"] // self.cfg["attempts"])
        if not st.get("problems"):
            # Chosen once per iteration and saved before sampling: a restart samples the same ones.
            table = self._pass_rates()
            st["problems"], st["cursor"], revisits = choose_problems(
                st["cursor"], k, self.pool, self.cfg["seed"], it, table, self.cfg["revisit_share"])
            save_state(self.run_dir, st)
            if self.cfg["revisit_share"]:
                say(f"iteration {it}: {revisits} of its {k} problems drawn again (pass rate strictly between 0 "
                    f"and 1 when last sampled), {k - revisits} new", self.quiet)
        self.it_dir(it).mkdir(parents=True, exist_ok=True)
        model = self.current_model()
        tapes = self.engine.sample(model, st["problems"], it, self.it_dir(it) / TAPES_FILE)
        self.held = {"iteration": it, "tapes": tapes, "samples": None}
        counters = getattr(self.engine, "sampler_counters", None)
        if counters is not None:  # saved with the phase: record reads it, also after a restart
            st.setdefault("sampler", {})[str(it)] = counters
        self._settle(it)  # the write ran while this phase sampled

    def _filter(self, it: int) -> None:
        tapes, samples = self.engine.filter(self.it_dir(it) / TAPES_FILE, self.it_dir(it) / SAMPLES_FILE,
                                            self._reference(), tapes_given=self._held(it, "tapes"))
        # The tapes file does not change after the sample phase, nor the samples after this one.
        self.held = {"iteration": it, "tapes": tapes, "samples": samples}

    def _held(self, it: int, what: str) -> list[dict] | None:
        """This iteration's tapes or samples in memory, or None: read the file."""
        return self.held[what] if self.held["iteration"] == it else None

    def _pass_rates(self) -> dict[str, dict]:
        """The pass-rate table: read once per process, then kept as record rewrites it (only this
        loop writes the file)."""
        if self.pass_rates is None:
            self.pass_rates = read_pass_rates(self.run_dir / PASS_RATES_FILE)
        return self.pass_rates

    def _reference(self) -> str | None:
        """filter.ref_model, with `start` read as the model iteration 0 sampled with; a checkpoint of
        this run that serves as the reference is kept from pruning (the KL needs it every iteration)."""
        ref = self.cfg["filter"]["ref_model"]
        if ref != START_MODEL:
            return ref
        start = self.state["start_model"]  # set when the warm start ended; `loop` checked an older state
        ckpt = Path(start)
        if is_own_checkpoint(self.run_dir, ckpt) and not (ckpt / KEEP_MARKER).exists():
            mark_keep(ckpt, "the KL reference (filter.ref_model=start)")
        return start

    def _finetune(self, it: int) -> None:
        samples = self.it_dir(it) / SAMPLES_FILE
        held = self._held(it, "samples")
        n = len(held) if held is not None else sum(1 for _ in read_jsonl(samples))
        if not n:
            say(f"iteration {it}: no training samples (no attempt earned a reward); trains nothing, the model "
                "is unchanged", self.quiet)
            return
        plan = iteration_steps(n, self.cfg["finetune"])
        say(f"iteration {it}: {plan['steps']} optimizer steps of {plan['global_batch']} samples on {n} samples = "
            f"{plan['passes']:g} pass{'' if plan['passes'] == 1 else 'es'} ({plan['why']})", self.quiet)
        info = self.engine.finetune(samples, plan["steps"], samples_given=held)
        self._pending(info, "finetune")
        if info.get("refresh_s") is not None:  # in-process: the sampler took the trainer's weights
            self.state["timings"].setdefault(str(it), {})["weights_refresh"] = info["refresh_s"]

    def _record(self, it: int) -> None:
        row: dict = {"iteration": it, "model": self.current_model()}
        tapes_path = self.it_dir(it) / TAPES_FILE
        held_tapes, held_samples = self._held(it, "tapes"), self._held(it, "samples")
        self.held = {"iteration": None, "tapes": None, "samples": None}
        if tapes_path.exists():
            tapes = held_tapes if held_tapes is not None else list(read_jsonl(tapes_path))
            self.pass_rates = record_pass_rates(self.run_dir / PASS_RATES_FILE, it, tapes, self._pass_rates())
            st = tape_stats(tapes)
            if tapes:
                row["model"] = tapes[0]["model"]  # the model that sampled, not the one it trained
            samples_path = self.it_dir(it) / SAMPLES_FILE
            samples = (held_samples if held_samples is not None
                       else list(read_jsonl(samples_path)) if samples_path.exists() else [])
            row.update({
                "train_success_rate": round(sum(bool(t["correct"]) for t in tapes) / max(1, len(tapes)), 4),
                "train_accuracy_strict": st["accuracy_strict"], "train_accuracy_lenient": st["accuracy_lenient"],
                "pass_at_k": st["pass_at_k"], "format_rate": st["format_rate"],
                "overflow_rate": st["overflow_rate"], "mean_output_tokens": st["tokens"]["completion"]["mean"],
                "attempts": len(tapes), "problems": st["problems"],
                "samples_kept": len(samples),
                "uniform_groups": _uniform_groups(tapes),
                "duplicate_correct": _duplicate_correct(tapes),
            })
            plan = iteration_steps(row["samples_kept"], self.cfg["finetune"])
            row.update(train_steps=plan["steps"], train_passes=plan["passes"], train_steps_mode=plan["mode"],
                       **_finetune_summary(self.run_dir, samples))
            secs = self.state["timings"].get(str(it), {}).get("sample")
            if secs:
                row["sample_tokens_per_s"] = round(sum(len(t["completion_token_ids"]) for t in tapes) / secs, 1)
        for split in ("test", "validation"):
            ev = self.eval_dir(it, split) / EVAL_METRICS_FILE
            if ev.exists():
                m = json.loads(ev.read_text(encoding="utf-8"))
                row.update({f"{split}_accuracy_strict": m["accuracy_strict"],
                            f"{split}_accuracy_lenient": m["accuracy_lenient"],
                            f"{split}_format_rate": m["format_rate"], f"{split}_n": m["n"]})
        row["seconds"] = self.state["timings"].get(str(it), {})
        if str(it) in self.state.get("sampler", {}):
            row["sampler"] = self.state["sampler"][str(it)]
        path = self.run_dir / RUN_METRICS_FILE
        rows = [r for r in read_jsonl(path) if r["iteration"] != it] if path.exists() else []
        guard = iteration_warnings(row, rows, self.cfg)
        retried = self.it_dir(it) / WARNINGS_FILE
        # The out-of-memory retries were said when they happened; the guard's are said now.
        row["warnings"] = [r["warning"] for r in read_jsonl(retried, repair_tail=True)] if retried.exists() else []
        row["warnings"] += guard
        row["no_signal"] = no_signal(row, self.cfg)
        for w in guard:
            warn(f"iteration {it}: {w}", self.quiet)
        if row["no_signal"]:
            warn(f"iteration {it} has no reward signal: {row['no_signal']}", self.quiet)
        write_jsonl(path, rows + [row])  # atomic rewrite: a rerun of this phase never duplicates a line
        if curve_due(row, self.cfg["iterations"]):
            plot_learning_curve(rows + [row], self.run_dir / CURVE_FILE)
        _report_to(self.cfg["report_to"], row, self.run_dir, self.quiet)

    def _mark_best(self, it: int, accuracy: float, evaluated: Path) -> None:
        """Keep the checkpoint with the best strict accuracy on the selection split (validation
        where there is one) from pruning (finetune's `keep` marker)."""
        best = self.state.get("best")
        if best and best["accuracy_strict"] >= accuracy:
            return
        ckpt = evaluated if is_own_checkpoint(self.run_dir, evaluated) else None
        if ckpt is None:  # the base model was best: nothing of ours to keep
            self.state["best"] = {"iteration": it, "accuracy_strict": accuracy, "checkpoint": None,
                                  "split": self.select_on}
            return
        if best and best["checkpoint"] and Path(best["checkpoint"]).exists() and not self._is_reference(best["checkpoint"]):
            unmark_keep(Path(best["checkpoint"]))
        mark_keep(ckpt, f"best strict {self.select_on} accuracy {accuracy} at iteration {it}")
        self.state["best"] = {"iteration": it, "accuracy_strict": accuracy, "checkpoint": str(ckpt),
                              "split": self.select_on}

    def _is_reference(self, ckpt: str) -> bool:
        return (self.cfg["filter"]["ref_model"] == START_MODEL and self.state.get("start_model") is not None
                and Path(self.state["start_model"]).resolve() == Path(ckpt).resolve())

    # ------------------------------------------------------------------ talk
    def _banner(self, it: int, phase: str) -> None:
        if self.quiet:
            return
        best = self.state.get("best")
        acc = f", best {best.get('split', 'test')} accuracy {best['accuracy_strict']:.3f}" if best else ""
        label = "warm start" if it < 0 else f"iteration {it}/{self.cfg['iterations']}"
        console.rule(f"[bold]{label}[/] · {phase}{acc}")

    def _summary(self) -> None:
        if self.quiet:
            return
        r = self.run_dir
        lines = [f"done. metrics: {r / RUN_METRICS_FILE}", f"      curve:   {r / CURVE_FILE}",
                 f"      tapes:   {r / 'iterations'}/*/{TAPES_FILE}, {r / 'eval'}/*/{TAPES_FILE}",
                 f"      browse:  gsm8kctl browse {r}"]
        best = self.state.get("best")
        path = r / RUN_METRICS_FILE
        rows = {row["iteration"]: row for row in read_jsonl(path)} if path.exists() else {}
        if best:
            split = best.get("split", "test")
            acc = f"{split} strict {best['accuracy_strict']:.2%} at iteration {best['iteration']}"
            test = rows.get(best["iteration"], {}).get("test_accuracy_strict")
            if split != "test" and test is not None:
                acc += f", test strict {test:.2%}"
            if best["checkpoint"]:
                lines.append(f"      best:    {best['checkpoint']} ({acc}; kept from pruning by its `keep` file)")
            else:
                lines.append(f"      best:    the starting model {self.cfg['model']} ({acc}; no checkpoint of "
                             "this run beat it)")
        evaluated = [row for row in rows.values() if row.get("test_accuracy_strict") is not None]
        if evaluated:
            last = max(evaluated, key=lambda row: row["iteration"])
            lines.append(f"      last:    test strict {last['test_accuracy_strict']:.2%} at iteration {last['iteration']}")
        warned = [row["iteration"] for row in rows.values() if row.get("warnings")]
        if warned:
            lines.append(f"      warnings: at iteration(s) {', '.join(map(str, warned))}; the `warnings` "
                         f"of {path} say what")
        say("\n".join(lines))


def _uniform_groups(tapes: list[dict]) -> int:
    groups: dict[str, set] = {}
    for t in tapes:
        groups.setdefault(t["problem_id"], set()).add(t["reward"])
    return sum(1 for rewards in groups.values() if len(rewards) == 1)


def _duplicate_correct(tapes: list[dict]) -> int:
    """Rewarded attempts whose completion repeats an earlier rewarded one of the same problem, token
    for token: what `filter.drop_duplicate_correct` would drop, counted whether it is on or not."""
    seen: set = set()
    copies = 0
    for t in tapes:
        if t["reward"] > 0:
            key = (t["problem_id"], tuple(t["completion_token_ids"]))
            copies += key in seen
            seen.add(key)
    return copies


def curve_due(row: dict, iterations: int) -> bool:
    """Whether the record phase redraws the learning curve: when an evaluation lands and after the
    last iteration (and, in `_stop_without_signal`, before a stop). Drawing takes about 0.3 s on one
    core, most of the record phase, and an iteration without an evaluation adds one train-success
    point only, so the curve is at most `test_every_n_iterations - 1` such points behind."""
    evaluated = any(row.get(f"{split}_accuracy_strict") is not None for split in ("test", "validation"))
    return evaluated or row["iteration"] >= iterations


def plot_learning_curve(rows: list[dict], path: Path) -> None:
    """Test accuracy (strict and lenient), validation accuracy (strict, the split that chooses the
    best checkpoint) and train success vs iteration, and on a right-hand axis
    the test format rate (what a warm start moves first); written atomically. Iteration -1, the
    starting model before the warm start, is labelled `start`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    lines = []
    for key, label, style in (("test_accuracy_strict", "test accuracy (strict)", "o-"),
                              ("test_accuracy_lenient", "test accuracy (lenient)", "s--"),
                              ("validation_accuracy_strict", "validation accuracy (strict)", "v-"),
                              ("train_success_rate", "train success rate", "^:")):
        pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            lines += ax.plot(*zip(*pts), style, label=label)
    fmt = [(r["iteration"], r["test_format_rate"]) for r in rows if r.get("test_format_rate") is not None]
    if fmt:
        right = ax.twinx()
        lines += right.plot(*zip(*fmt), "d-.", color="tab:purple", label="test format rate (right axis)")
        right.set_ylabel("format rate")
        right.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: "start" if x == START_ITERATION else f"{x:g}"))
    ax.set_xlabel("iteration")
    ax.set_ylabel("rate")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(lines, [ln.get_label() for ln in lines], loc="best")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def _report_to(trackers: list[str], row: dict, run_dir: Path, quiet: bool) -> None:
    """Optional trackers: never required, a missing package is a warning."""
    scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for name in trackers:
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                with SummaryWriter(str(run_dir / "tensorboard")) as w:
                    for k, v in scalars.items():
                        w.add_scalar(k, v, row["iteration"])
            elif name == "wandb":
                import wandb

                if wandb.run is None:
                    wandb.init(project="gsm8kctl", name=run_dir.name, dir=str(run_dir), resume="allow")
                wandb.log(scalars, step=row["iteration"])
            else:
                warn(f"unknown tracker '{name}' in report_to (tensorboard, wandb)", quiet)
        except ImportError:
            warn(f"report_to {name}: package not installed; metrics.jsonl still has everything", quiet)
