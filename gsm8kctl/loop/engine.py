"""How the loop runs a phase: a stage command in a child process, or a call in this process.

Both engines write the same artifacts at the same points, because both run the same stage
functions on the same files; the loop (`loop/driver.py`) decides which phase runs and records
it in `state.json`, and does not care which engine ran it.

- `ProcessEngine` (`loop.engine: processes`): each phase is `gsm8kctl <stage> ... --config
  RUN/config.yaml` under the process supervisor (`procs.py`). Its memory (a sampler's KV cache,
  a trainer's optimizer) goes back to the system when it ends; every phase pays for process
  start, imports, model load and compile again. vLLM, openai and `finetune.num_processes > 1`
  run this way.
- `InProcessEngine` (`loop.engine: inprocess`): the loop process keeps one `training.Trainer`
  (fp32 master weights, AdamW state, compiled layers) and one transformers sampler (its slot
  engine's KV cache and CUDA graphs) for the whole run. After a finetune phase the sampler's
  weights are copied in place from the trainer's (a cast to the sampler's dtype; the CUDA
  graphs stay valid because the tensors keep their addresses), so sampling never reloads from
  disk. The checkpoint is still saved at the end of every finetune phase, exactly as the stage
  saves it, so a kill -9 at any moment resumes from disk as with processes.

`auto` takes inprocess on one CUDA device with the transformers backend and processes
elsewhere; the loop says which at start.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path

from gsm8kctl.artifacts.jsonl import read_jsonl
from gsm8kctl.artifacts.rundir import LLM_CALLS_FILE, OUTPUT_LOG_FILE, SHARDS_DIR
from gsm8kctl.errors import EXIT_BAD_INPUT, StageFailed, UserError
from gsm8kctl.procs import TALK_FD_ENV, StageRecord, run_stage
from gsm8kctl.progress import say

ENGINES = ("auto", "inprocess", "processes")


def choose_engine(cfg: dict) -> tuple[str, str]:
    """(engine, why): what runs the phases of this loop, decided before anything is loaded."""
    from gsm8kctl.sampling.backends import resolve_backend_name

    want = cfg["loop"]["engine"]
    backend = resolve_backend_name(cfg["backend"])
    nproc, samplers = int(cfg["finetune"]["num_processes"]), int(cfg["sampling"]["num_processes"])
    blocker = None
    if backend != "transformers":
        blocker = f"backend {backend} samples in its own engine or server"
    elif nproc > 1:
        blocker = f"finetune.num_processes={nproc} trains under accelerate launch"
    elif samplers > 1:
        blocker = f"sampling.num_processes={samplers} samples in that many processes"
    if want == "processes":
        return "processes", "loop.engine=processes"
    if want == "inprocess":
        if blocker:  # the schema refuses the explicit cases; `backend: auto` resolves only now
            raise UserError(f"loop.engine=inprocess cannot run here: {blocker} (use loop.engine=processes)")
        return "inprocess", "loop.engine=inprocess"
    if blocker:
        return "processes", f"loop.engine=auto: {blocker}"
    import torch

    if not torch.cuda.is_available():
        return "processes", "loop.engine=auto: no CUDA device (set loop.engine=inprocess to keep the model " \
                            "in this process on the CPU)"
    return "inprocess", "loop.engine=auto: one CUDA device, transformers backend"


def open_engine(cfg: dict, run_dir: Path, state: dict, *, quiet: bool):
    engine, why = choose_engine(cfg)
    say(f"engine: {engine} ({why})", quiet)
    if engine == "inprocess":
        return InProcessEngine(cfg, run_dir, quiet=quiet)
    return ProcessEngine(cfg, run_dir, state, quiet=quiet)


# ---------------------------------------------------------------------------------------------
# Child processes


class ProcessEngine:
    name = "processes"

    def __init__(self, cfg: dict, run_dir: Path, state: dict, *, quiet: bool):
        from gsm8kctl.artifacts.rundir import CONFIG_FILE
        from gsm8kctl.artifacts.rundir import save_state

        self.cfg, self.run_dir, self.state, self.quiet = cfg, run_dir, state, quiet
        self.config_path = str(run_dir / CONFIG_FILE)
        self._save_state = save_state

    def gold_samples(self, out: Path, n_problems: int) -> None:
        # SFT needs no reference log-probs (and filter.ref_model=start does not exist yet).
        self._stage("filter", "--gold", "filter.ref_model=null", "--split", "train", "--n-problems", str(n_problems),
                    "-o", str(out), "--quiet")

    def finetune(self, samples: Path, steps: int, objective: str | None = None,
                 overrides: dict | None = None, samples_given: list[dict] | None = None) -> dict:
        """The stage reads `samples` in its own process (`samples_given` is not used)."""
        self._stage("finetune", str(samples), *(f"{k}={v}" for k, v in (overrides or {}).items()),
                    "--out", str(self.run_dir), "--steps", str(steps),
                    *(["--objective", objective] if objective else []))
        return {}

    def evaluate(self, model: str, out_dir: Path, iteration: int, limit: int | None, split: str = "test") -> None:
        args = ["evaluate", "--model", model, "--quiet", "--iteration", str(iteration), "--split", split]
        n = self._sampler_processes()
        if n == 1:
            extra = ["--limit", str(limit)] if limit is not None else []
            self._sampling_stage(model, *args, *extra, "-o", str(out_dir),
                                 "--llm-calls", str(self.run_dir / LLM_CALLS_FILE))
            return
        from gsm8kctl.artifacts.data import split_problems
        from gsm8kctl.artifacts.rundir import EVAL_METRICS_FILE, TAPES_FILE
        from gsm8kctl.stages.evaluate import eval_metrics

        ids = [p["id"] for p in split_problems(self.cfg, split)][:limit]
        t0 = time.perf_counter()
        # Each shard evaluates into its own directory (tapes, metrics, config) under shards/.
        self._sharded(out_dir, out_dir / TAPES_FILE, ids, n, lambda k, part, d: (
            [*args, "--problem-ids", ",".join(part), "-o", str(d / f"eval-{k}"),
             "--llm-calls", str(d / f"llm_calls-{k}.sqlite")], d / f"eval-{k}" / TAPES_FILE))
        seconds = round(time.perf_counter() - t0, 2)
        tapes = list(read_jsonl(out_dir / TAPES_FILE))
        tokens = sum(len(t["completion_token_ids"]) for t in tapes if t.get("iteration", 0) == iteration)
        from gsm8kctl.artifacts.jsonl import atomic_write_json
        from gsm8kctl.sampling.backends import resolve_backend_name

        atomic_write_json(out_dir / EVAL_METRICS_FILE, eval_metrics(
            out_dir / TAPES_FILE, ids, iteration=iteration, model_label=model,
            backend=resolve_backend_name(self.cfg["backend"]), split=split, seconds=seconds,
            tokens_per_s=round(tokens / max(seconds, 1e-9), 1)))

    def sample(self, model: str, problem_ids: list[str], iteration: int, out: Path) -> None:
        """None: the tapes were written in the stage's own process."""
        args = ["sample", "--model", model, "--iteration", str(iteration), "--quiet"]
        n = self._sampler_processes()
        if n == 1:
            self._sampling_stage(model, *args, "--problem-ids", ",".join(problem_ids), "-o", str(out),
                                 "--llm-calls", str(self.run_dir / LLM_CALLS_FILE))
            return None
        self._sharded(out.parent, out, problem_ids, n, lambda k, part, d: (
            [*args, "--problem-ids", ",".join(part), "-o", str(d / f"tapes-{k}.jsonl"),
             "--llm-calls", str(d / f"llm_calls-{k}.sqlite")], d / f"tapes-{k}.jsonl"))

    def _sampler_processes(self) -> int:
        return int(self.cfg["sampling"]["num_processes"])

    def _sharded(self, phase_dir: Path, tapes_file: Path, ids: list[str], n: int, command) -> None:
        """The phase as N stage processes over shards of `ids`, run side by side, then merged (shards.py)."""
        from gsm8kctl.artifacts.jsonl import atomic_write_json
        from gsm8kctl.loop import shards

        parts = shards.split(ids, n)
        d = phase_dir / SHARDS_DIR
        d.mkdir(parents=True, exist_ok=True)
        commands, envs, tapes_files, calls_files = [], [], [], []
        for k, part in enumerate(parts):
            args, tapes = command(k, part, d)  # the stage's arguments, and where its tapes land
            commands.append([*args, "--config", self.config_path])
            envs.append({**shards.shard_env(k), "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")})
            tapes_files.append(tapes)
            calls_files.append(d / f"llm_calls-{k}.sqlite")
        spec = phase_dir / SHARDS_DIR / "spec.json"
        atomic_write_json(spec, {"commands": commands, "envs": envs})

        def remember(stage: StageRecord) -> None:
            self.state.update(stage.to_state())
            self._save_state(self.run_dir, self.state)

        rc = run_stage([str(spec)], on_start=remember, module="gsm8kctl.loop.shards")
        if rc != 0:
            raise UserError(f"{commands[0][0]} failed in one of {len(parts)} sampler processes (exit {rc}) in "
                            f"{self.run_dir}; fix the cause and rerun the same command to resume")
        shards.merge(tapes_file, tapes_files, self.run_dir / LLM_CALLS_FILE, calls_files, ids)

    def filter(self, tapes: Path, out: Path, ref_model: str | None,
               tapes_given: list[dict] | None = None) -> tuple[None, None]:
        """(None, None): the tapes were read and the samples written in the stage's own process."""
        ref = ("--ref-model", ref_model) if ref_model else ()
        self._stage("filter", str(tapes), "-o", str(out), *ref, "--quiet")
        return None, None

    def wait_saved(self) -> float:
        return 0.0  # the finetune stage saved before it exited

    def close(self) -> None:
        pass

    def _server_for(self, model: str):
        """backend openai without a URL: serve the current model with `vllm serve` for this phase only,
        so the GPU is free again when finetune starts (the original system left it allocated)."""
        import contextlib

        if self.cfg["backend"] != "openai" or self.cfg["openai"]["base_url"]:
            return contextlib.nullcontext(None)
        from gsm8kctl.artifacts.models import resolve_model
        from gsm8kctl.loop.serve import VLLMServer

        return VLLMServer(resolve_model(model), log_path=self.run_dir / "vllm-server.log", cfg=self.cfg)

    def _sampling_stage(self, model: str, *args: str) -> None:
        with self._server_for(model) as server:
            extra = [f"openai.base_url={server.base_url}"] if server is not None else []
            self._stage(*args, *extra)

    def _stage(self, *args: str) -> None:
        """Run one stage command on the run's resolved config; a failure stops the loop."""

        def remember(stage: StageRecord) -> None:
            self.state.update(stage.to_state())  # the supervisor's group, and the token that proves it
            self._save_state(self.run_dir, self.state)

        # vLLM's start-up warnings (no Triton, eager mode...) would bury the loop's own lines.
        env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
        rc = run_stage([*args, "--config", self.config_path], on_start=remember, env=env)
        if rc != 0:
            log = self.run_dir / OUTPUT_LOG_FILE
            where = f" (what it printed besides: {log})" if os.environ.get(TALK_FD_ENV) else ""
            # The loop exits as its stage did: 2 for input the stage refused, 1 for anything else.
            error = UserError if rc == EXIT_BAD_INPUT else StageFailed
            raise error(f"{args[0]} failed (exit {rc}) in {self.run_dir}{where}; fix the cause and rerun the "
                        "same command to resume")


# ---------------------------------------------------------------------------------------------
# This process


class InProcessEngine:
    name = "inprocess"

    def __init__(self, cfg: dict, run_dir: Path, *, quiet: bool):
        self.cfg, self.run_dir, self.quiet = cfg, run_dir, quiet
        self.trainer = None          # training.Trainer, opened at the first finetune
        self.trainer_start = None    # the directory the trainer loaded
        self.sampler = None          # backends.transformers.TransformersBackend, at the first sampling
        self.sampler_weights = None  # the model directory whose weights the sampler holds now
        self.ref = None              # the reference model's scorer (filter.ref_model), at the first filter
        self.sampler_counters = None # the slot engine's counters over the last sample phase (slot_counters)
        self._planned = False

    # ------------------------------------------------------------------ phases
    def gold_samples(self, out: Path, n_problems: int) -> None:
        from gsm8kctl.stages.filter import run_filter

        cfg = {**self.cfg, "filter": {**self.cfg["filter"], "ref_model": None}}  # as ProcessEngine's
        run_filter([], str(out), cfg, gold=True, split="train", n_problems=n_problems, quiet=True)

    def finetune(self, samples_path: Path, steps: int, objective: str | None = None,
                 overrides: dict | None = None, samples_given: list[dict] | None = None) -> dict:
        """One phase on the resident trainer, checked like the stage; then the sampler takes its
        weights. `samples_given`: the samples file's records, held by the filter phase: not read again."""
        from gsm8kctl.config import set_value
        from gsm8kctl.stages.finetune import check_finetune_config, load_and_check, resolve_start, \
            resolve_objective

        waited = self.wait_saved()  # the previous phase's checkpoint is where this one starts
        cfg = json.loads(json.dumps(self.cfg))  # the phase's copy, as the stage gets it from its options
        set_value(cfg, "finetune.steps", steps)
        for key, value in (overrides or {}).items():
            set_value(cfg, key, value)
        objective = resolve_objective(cfg, objective)
        set_value(cfg, "finetune.objective", objective)
        check_finetune_config(cfg["finetune"])
        start, resume, note = resolve_start(self.run_dir, None, cfg)
        samples = load_and_check([str(samples_path)], start, cfg, objective, given=samples_given)
        if self.trainer is None:
            from gsm8kctl.training.trainer import Trainer

            say(note, self.quiet)
            t0 = time.perf_counter()
            self.trainer = Trainer(cfg, self.run_dir, start=start, resume=resume, quiet=self.quiet)
            self.trainer_start = start  # the weights it loaded (a sampler can open on them)
            self.trainer.background_saves = True
            say(f"trainer ready in {time.perf_counter() - t0:.1f} s (kept for the whole run)", self.quiet)
        t0 = time.perf_counter()
        result = self.trainer.run(samples, cfg, source=[str(samples_path)])
        info = {"train_s": round(time.perf_counter() - t0, 3), "save_wait_s": round(waited, 3)}
        if result["steps_run"]:
            info["refresh_s"] = self._refresh_sampler(Path(result["checkpoint"]))
        if self.trainer.pending is not None:  # written by a thread while the loop goes on
            info["pending"] = str(self.trainer.pending)
        self._say_memory()
        return info

    def evaluate(self, model: str, out_dir: Path, iteration: int, limit: int | None, split: str = "test") -> None:
        from gsm8kctl.stages.evaluate import evaluate

        evaluate(self._cfg_for(model), out_dir=str(out_dir), limit=limit, split=split,
                 calls_db=str(self.run_dir / LLM_CALLS_FILE), iteration=iteration,
                 backend=self._sampler(model), model_label=model, quiet=True)

    def sample(self, model: str, problem_ids: list[str], iteration: int, out: Path) -> list[dict] | None:
        """The tapes it wrote, when they are the whole file: the filter and record phases use them
        rather than parse the file again (0.3-0.4 s for an iteration's 4096 tapes on a 2-core CPU).
        None when the file was there before: a resumed phase appends to what a killed run wrote."""
        from gsm8kctl.stages.sample import sample

        whole = not out.exists()
        written: list[dict] = []
        backend = self._sampler(model)
        engine = getattr(backend, "slot_engine", None)
        before = dict(engine.stats) if engine is not None else {}
        # Only a weak reference over the phase: an engine the phase replaces must be freed before
        # its successor is planned, or the new pool is sized beside the old one's memory.
        was = weakref.ref(engine) if engine is not None else None
        del engine
        sample(self._cfg_for(model), out=str(out), split="train", problem_ids=problem_ids,
               calls_db=str(self.run_dir / LLM_CALLS_FILE), iteration=iteration,
               backend=backend, quiet=True, written=written)
        after = getattr(backend, "slot_engine", None)
        # An engine rebuilt in the phase (a longer prompt, an out-of-memory retry) counts from zero.
        self.sampler_counters = slot_counters(after, before if was is not None and after is was() else {})
        return written if whole else None

    def filter(self, tapes: Path, out: Path, ref_model: str | None,
               tapes_given: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
        """(the tapes, checked; the samples written): the finetune and record phases use them rather
        than parse the files again. `tapes_given`, the sample phase's tapes, are not read again."""
        from gsm8kctl.stages.filter import run_filter

        read: list[dict] = []
        written: list[dict] = []
        run_filter([str(tapes)], str(out), self.cfg, quiet=True, ref_model=ref_model,
                   scorer=self._ref_scorer(ref_model), tapes_read=read, tapes_given=tapes_given,
                   samples_written=written)
        return read, written

    def _ref_scorer(self, ref: str | None):
        """The reference model on the transformers backend, loaded once; None: the stage opens its own."""
        from gsm8kctl.sampling.backends import resolve_backend_name

        if ref is None or resolve_backend_name(self.cfg["filter"]["ref_backend"]) != "transformers":
            return None  # (a vLLM scorer would hold its GPU share between phases)
        if self.ref is None:
            from gsm8kctl.stages.filter import open_scorer

            self.ref = open_scorer(ref, "transformers", self.cfg)
        return self.ref.score

    def wait_saved(self) -> float:
        """Block until the last phase's checkpoint is on disk; the seconds waited."""
        return self.trainer.wait_saved() if self.trainer is not None else 0.0

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
        for name in ("sampler", "ref"):
            if getattr(self, name) is not None:
                getattr(self, name).close()
                setattr(self, name, None)

    # ------------------------------------------------------------------ the sampler
    def _cfg_for(self, model: str) -> dict:
        """The run's config with `model` set, as the stage command gets it from `--model`."""
        return {**self.cfg, "model": model}

    def _sampler(self, model: str):
        """The resident sampler, holding `model`'s weights: loaded once, then refreshed in place."""
        from gsm8kctl.artifacts.models import resolve_model

        if self.sampler is not None and Path(model).resolve() == self.sampler_weights:
            return self.sampler  # the trainer's weights (their checkpoint may still be being written)
        pending = self.trainer.pending if self.trainer is not None else None
        if pending is not None and Path(model).resolve() == pending.resolve():
            # The first sampling after the warm start: its checkpoint is still being written, so
            # open the sampler on the weights the trainer started from and give it the trainer's.
            if self.sampler is None:
                self._open_sampler(Path(resolve_model(self.trainer_start)).resolve())
            self._refresh_sampler(pending)
            return self.sampler
        path = Path(resolve_model(model)).resolve()
        if self.sampler is None:
            self._open_sampler(path)
        elif self.sampler_weights != path:
            # Not the weights the trainer last gave it (a checkpoint put there by hand, say): load them.
            self._load_sampler_weights(path)
        return self.sampler

    def _open_sampler(self, path: Path) -> None:
        from gsm8kctl.sampling.backends.transformers import TransformersBackend

        t0 = time.perf_counter()
        self.sampler = TransformersBackend(str(path), self.cfg)
        self.sampler_weights = path
        say(f"sampler ready in {time.perf_counter() - t0:.1f} s (kept for the whole run)", self.quiet)

    def _refresh_sampler(self, ckpt: Path) -> float | None:
        """Copy the trainer's weights into the sampler in place; the seconds it took."""
        if self.sampler is None:
            return None
        import torch

        t0 = time.perf_counter()
        source = self.trainer.lm.state_dict()
        with torch.no_grad():
            for name, tensor in self.sampler.model_obj.state_dict().items():
                tensor.copy_(source[name])
        if self.sampler.device == "cuda":
            torch.cuda.synchronize()
        self.sampler_weights = ckpt.resolve()
        return round(time.perf_counter() - t0, 4)

    def _load_sampler_weights(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        fresh = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
        with torch.no_grad():
            for name, tensor in self.sampler.model_obj.state_dict().items():
                tensor.copy_(fresh[name])
        self.sampler_weights = path

    def _say_memory(self) -> None:
        """Once, when trainer and sampler both exist: what each holds, beside what is free."""
        if self._planned or self.quiet or self.trainer is None or self.sampler is None:
            return
        self._planned = True
        say(memory_plan(self.trainer, self.sampler))


def slot_counters(engine, before: dict) -> dict | None:
    """What the slot engine did in one phase, from its cumulative stats before and after: its
    decode steps, the rows busy in an average step against its slots (a low fill means a tail of
    few long attempts), the share of the rows run that were busy (the rest pad a graph bucket or
    finished mid-window), and the host's seconds blocked on the GPU and admitting. A phase resumed
    after a kill counts what it sampled itself. None where sampling did not run on the slot
    engine (the CPU's default, or another backend)."""
    if engine is None:
        return None
    d = {k: engine.stats[k] - before.get(k, 0) for k in engine.stats}
    steps = d["decode_steps"]
    return {"slots": engine.slots, "decode_steps": steps,
            "mean_busy_rows": round(d["slot_steps_busy"] / steps, 1) if steps else 0.0,
            "busy_share": round(d["slot_steps_busy"] / d["slot_steps_run"], 3) if d["slot_steps_run"] else None,
            "admissions": d["admissions"], "sync_s": round(d["sync_s"], 3), "admit_s": round(d["admit_s"], 3)}


def memory_plan(trainer, sampler) -> str:
    """One line: the trainer's resident bytes, the sampler's weights and KV cache, what is free."""
    import torch

    params = sum(p.numel() for p in trainer.lm.parameters())
    # fp32 weights + fp32 gradients + AdamW's two moments: 16 bytes per parameter.
    train_gb = params * 16 / 2**30
    s_bytes = next(sampler.model_obj.parameters()).element_size()
    sample_gb = params * s_bytes / 2**30
    engine = getattr(sampler, "slot_engine", None)
    kv = ""
    if engine is not None:
        kv_gb = engine.kv.numel() * engine.kv.element_size() / 2**30
        kv = f", KV cache {kv_gb:.2f} GB ({engine.slots} slots x {engine.max_len} tokens)"
    if torch.cuda.is_available():
        free, total = (b / 2**30 for b in torch.cuda.mem_get_info())
        peak = torch.cuda.max_memory_allocated() / 2**30
        where = f"; GPU free now {free:.1f} GB, peak allocated {peak:.1f} GB"
        if sampler.gpu_share < 1:
            where += f", this loop's share {sampler.gpu_share:g} of {total:.1f} GB = {sampler.gpu_share * total:.1f} GB"
    else:
        import psutil

        where = f"; RAM available {psutil.virtual_memory().available / 2**30:.1f} GB"
    return (f"memory: trainer {train_gb:.2f} GB resident ({params / 1e6:.0f}M parameters: fp32 weights, "
            f"gradients, AdamW moments), sampler weights {sample_gb:.2f} GB{kv}{where}")
