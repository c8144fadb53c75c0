"""`filter`: tapes → training samples (schema in `gsm8kctl.artifacts.samples`).

Order of work, per run:
1. read tapes; drop structurally useless ones (empty completion, a tape id seen twice);
2. reference log-probs through a backend's `score()` (bounded memory: chunks of
   `filter.score_token_budget` tokens) — for every attempt when the implicit KL needs them for
   the reward, else only for the samples kept;
3. reward shaping r' = r − β·KL_i and group advantages A = (r' − mean_g)/(std_g + 1e-4) (or
   r' − mean_g with `finetune.rl.divide_by_std` false) over all
   attempts of a group (one problem in one iteration), before anything is dropped: the
   advantage of a success depends on how its siblings did;
4. uniform groups (all rewards equal → A = 0) are counted, and dropped with `drop_uniform_groups`;
5. `rejection` mode keeps reward > 0 only, drops exact-duplicate completions of a problem and
   caps each problem at `max_per_problem`; `all` mode keeps every attempt (REINFORCE / GRPO),
   less the duplicate rewarded completions with `drop_duplicate_correct`;
6. weight = A when `finetune.rl.use_advantages`, else r'.

`--gold` makes SFT samples from GSM8k gold solutions instead: the agent's prompt rendered with
the model's chat template, the solution rewritten to the agent's answer format.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from gsm8kctl.artifacts.jsonl import held_located, write_jsonl
from gsm8kctl.artifacts.paths import JSONL_RECORDS, check_output_file, check_replaceable
from gsm8kctl.artifacts.samples import is_sample, iter_jsonl_lines, samples_stats  # noqa: F401 (re-export)
from gsm8kctl.artifacts.tapes import check_tape
from gsm8kctl.errors import UserError
from gsm8kctl.progress import console, warn

MODES = ("rejection", "all")

# A scorer maps (prompt ids, completion ids) lists to per-token log-prob lists: Backend.score.
Scorer = Callable[[Sequence[list[int]], Sequence[list[int]]], list[list[float]]]


@dataclass
class FilterReport:
    """What filter read, kept and dropped (and why): printed as a table, returned to callers."""

    mode: str
    tapes: int = 0
    groups: int = 0
    uniform_groups: int = 0
    uniform_all_correct: int = 0
    uniform_dropped: bool = False
    scored: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "tapes": self.tapes, "groups": self.groups,
                "uniform_groups": self.uniform_groups, "uniform_all_correct": self.uniform_all_correct,
                "uniform_dropped": self.uniform_dropped, "ref_scored": self.scored,
                "kept": self.kept, "dropped": dict(self.dropped)}

    def table(self):
        from rich.table import Table

        t = Table(title=f"filter ({self.mode})")
        t.add_column("")
        t.add_column("count", justify="right")
        t.add_row("tapes read" if self.mode != "gold" else "gold solutions", str(self.tapes))
        if self.mode != "gold":
            t.add_row("groups (iteration × problem)", str(self.groups))
            verb = "dropped" if self.uniform_dropped else "kept, zero advantage"
            t.add_row(f"uniform groups ({verb})",
                      f"{self.uniform_groups} ({self.uniform_all_correct} all rewarded)")
        if self.scored:
            t.add_row("scored by reference", str(self.scored))
        for reason, n in sorted(self.dropped.items()):
            t.add_row(f"dropped: {reason}", str(n))
        t.add_row("kept", str(self.kept), style="bold")
        return t


# ---------------------------------------------------------------------------------------------
# Reading tapes


def read_tapes(paths: Iterable[str], kept: list[dict] | None = None,
               given: list[dict] | None = None) -> Iterable[tuple[str, dict]]:
    """(`file:line`, tape) for every tape of the given files (`-` = stdin), checked; each also
    appended to `kept` when given. `given`: the tapes of the one file in `paths`, still held by
    the process that wrote them (the loop's sample phase): checked, not read again."""
    paths = list(paths)
    if given is not None and len(paths) != 1:
        raise ValueError("given stands for one tapes file")
    for path in paths:
        for where, record in iter_jsonl_lines(path) if given is None else held_located(path, given):
            tape = check_tape(record, where, tokens=True)
            if kept is not None:
                kept.append(tape)
            yield where, tape


def _slim(t: dict) -> dict:
    """The fields a sample needs; tapes also carry text we do not keep in memory."""
    return {
        "id": t["id"], "problem_id": t["problem_id"], "iteration": t.get("iteration") or 0,
        "model": t.get("model"), "prompt": t["prompt_token_ids"],
        "completion": t["completion_token_ids"], "old": t.get("logprobs"),
        "reward": float(t["reward"]), "finish_reason": t.get("finish_reason"),
        "outcome": _outcome(t),
    }


def _outcome(t: dict) -> str:
    from gsm8kctl.artifacts.tapes import outcome

    return outcome(t)


# ---------------------------------------------------------------------------------------------
# Reference scoring


def score_in_chunks(scorer: Scorer, prompts: list[list[int]], completions: list[list[int]],
                    token_budget: int) -> list[list[float]]:
    """Call `scorer` on consecutive slices of at most `token_budget` tokens (one row at least).
    Out of memory, the slice is scored again at half the budget (gsm8kctl/oom.py); the budget
    stays halved for the slices after it."""
    from gsm8kctl import oom

    out: list[list[float]] = []
    start = 0
    while start < len(prompts):
        end, used = start, 0
        while end < len(prompts):
            n = len(prompts[end]) + len(completions[end])
            if end > start and used + n > token_budget:
                break
            used += n
            end += 1
        try:
            part = scorer(prompts[start:end], completions[start:end])
        except Exception as exc:  # noqa: BLE001 - only an out-of-memory is handled
            if not oom.is_oom(exc):
                raise
            part = None
        if part is None:
            oom.release()
            if end - start == 1:
                raise oom.OutOfMemory(oom.describe(f"scoring with the reference model (one completion of "
                                                   f"{used} tokens)")) from None
            token_budget = max(1, min(token_budget, used) // 2)
            oom.retried(f"out of memory scoring {end - start} completions ({used} tokens): retrying in "
                        f"chunks of {token_budget} tokens")
            continue
        if len(part) != end - start:
            raise RuntimeError(f"scorer returned {len(part)} rows for {end - start} completions")
        for lp, c in zip(part, completions[start:end]):
            if len(lp) != len(c):
                raise RuntimeError(f"scorer returned {len(lp)} log-probs for {len(c)} tokens")
        out.extend([float(x) for x in lp] for lp in part)
        start = end
    return out


def configured_reference(fcfg: dict) -> str | None:
    """The config's `filter.ref_model` for a filter outside the loop: its `start` (the default)
    names the loop's warm start, which a filter run alone does not have, so it means none."""
    from gsm8kctl.artifacts.rundir import START_MODEL

    return None if fcfg["ref_model"] == START_MODEL else fcfg["ref_model"]


def open_scorer(ref_model: str, ref_backend: str, cfg: dict):
    """The reference model on `ref_backend`, for its `score()` (the loop keeps one open)."""
    from gsm8kctl.artifacts.models import resolve_model
    from gsm8kctl.sampling.attempts import check_backend_device
    from gsm8kctl.sampling.backends import get_backend

    check_backend_device(cfg, ref_backend)
    return get_backend(ref_backend, resolve_model(ref_model), cfg)


# ---------------------------------------------------------------------------------------------
# Tapes → samples


def filter_tapes(
    tapes: Iterable[dict | tuple[str, dict]],
    cfg: dict,
    *,
    mode: str | None = None,
    max_per_problem: int | None = None,
    drop_uniform_groups: bool | None = None,
    ref_model: str | None = None,
    ref_backend: str | None = None,
    scorer: Scorer | None = None,
) -> tuple[list[dict], FilterReport]:
    """Samples from tapes (module docstring for the order of work) and a report of what happened.

    Arguments left None come from `cfg` (`use_rejection_sampling`, `filter.*`, `finetune.rl.*`).
    `scorer` (a `Backend.score`) replaces opening `ref_model` — tests and callers holding a
    backend pass it.
    """
    fcfg, rl = cfg["filter"], cfg["finetune"]["rl"]
    mode = mode or ("rejection" if cfg["use_rejection_sampling"] else "all")
    if mode not in MODES:
        raise UserError(f"unknown filter mode '{mode}'; choose rejection or all")
    if max_per_problem is None:
        max_per_problem = fcfg["max_per_problem"]
    if max_per_problem is not None and max_per_problem < 1:
        raise UserError("--max-per-problem must be at least 1")
    if drop_uniform_groups is None:
        drop_uniform_groups = fcfg["drop_uniform_groups"]
    ref_model = ref_model or configured_reference(fcfg)
    ref_backend = ref_backend or fcfg["ref_backend"]
    kl_coef = float(rl["implicit_kl_coef"])
    estimator = rl["implicit_kl_estimator"]
    if kl_coef and scorer is None and not ref_model:
        raise UserError("finetune.rl.implicit_kl_coef > 0 needs a reference model: pass --ref-model")
    report = FilterReport(mode=mode, uniform_dropped=bool(drop_uniform_groups))

    rows = _read_rows(tapes, report, need_logprobs=bool(kl_coef))

    from gsm8kctl.training import losses  # imports torch (~3 s): not before the tapes are checked

    if estimator not in losses.KL_ESTIMATORS:
        raise UserError(f"finetune.rl.implicit_kl_estimator must be k1 or k3, got '{estimator}'")

    # --- reference log-probs, when the reward needs them (implicit KL) ----------------------
    own_scorer = None
    if (scorer is None) and ref_model:
        own_scorer = open_scorer(ref_model, ref_backend, cfg)
        scorer = own_scorer.score
    try:
        if scorer is not None and kl_coef:
            _score(rows, scorer, fcfg["score_token_budget"], report)

        # --- shaped rewards, advantages, uniform groups (over every attempt of a group) -----
        group_ids = [r["group"] for r in rows]
        for r in rows:
            r["kl"] = (losses.implicit_kl(r["old"], r["ref"], estimator)
                       if r.get("ref") is not None and r["old"] is not None else None)
            r["shaped"] = r["reward"] - kl_coef * r["kl"] if kl_coef else r["reward"]
        advantages = losses.group_advantages([r["shaped"] for r in rows], group_ids,
                                             divide_by_std=bool(rl["divide_by_std"]))
        # Uniform by task reward: the KL shaping alone does not make a group informative.
        uniform = losses.uniform_groups([r["reward"] for r in rows], group_ids)
        report.groups = len(set(group_ids))
        report.uniform_groups = len(uniform)
        report.uniform_all_correct = len({r["group"] for r in rows if r["group"] in uniform and r["reward"] > 0})

        kept = _keep(rows, advantages, uniform, report, mode=mode, drop_uniform_groups=drop_uniform_groups,
                     drop_duplicate_correct=fcfg["drop_duplicate_correct"], max_per_problem=max_per_problem)

        # Explicit KL in finetune needs reference log-probs of the kept samples only.
        if scorer is not None and not kl_coef:
            _score(kept, scorer, fcfg["score_token_budget"], report)
    finally:
        if own_scorer is not None:
            own_scorer.close()

    use_adv = bool(rl["use_advantages"])
    samples = [_to_sample(r, r["advantage"] if use_adv else r["shaped"]) for r in kept]
    report.kept = len(samples)
    return samples, report


def _read_rows(tapes: Iterable[dict | tuple[str, dict]], report: FilterReport, *, need_logprobs: bool) -> list[dict]:
    """The tapes as slim rows with their group (iteration and problem); a repeated tape id or an
    empty completion is dropped (and counted)."""
    rows: list[dict] = []
    seen_ids: set[str] = set()
    for item in tapes:
        where, t = item if isinstance(item, tuple) else ("<tapes>", check_tape(item, "<tapes>", tokens=True))
        report.tapes += 1
        if t["id"] in seen_ids:
            report.dropped["duplicate tape id"] += 1
            continue
        seen_ids.add(t["id"])
        if not t["completion_token_ids"]:
            report.dropped["empty completion"] += 1
            continue
        if need_logprobs and t.get("logprobs") is None:
            raise UserError(f"{where}: tape {t['id']} has no sampler logprobs; the implicit KL "
                            "needs them (sample with a backend that returns logprobs)")
        row = _slim(t)
        row["group"] = f"i{row['iteration']:04d}/{row['problem_id']}"
        rows.append(row)
    return rows


def _keep(rows: list[dict], advantages: list[float], uniform: set, report: FilterReport, *, mode: str,
          drop_uniform_groups: bool, drop_duplicate_correct: bool, max_per_problem: int | None) -> list[dict]:
    """The rows that become samples, each with its advantage; what is dropped is counted by why."""
    kept: list[dict] = []
    seen_completions: set[tuple] = set()
    per_problem: Counter = Counter()
    for r, adv in zip(rows, advantages):
        r["advantage"] = adv
        if drop_uniform_groups and r["group"] in uniform:
            report.dropped["uniform group"] += 1
            continue
        if mode == "rejection" and r["reward"] <= 0:
            report.dropped[f"not rewarded ({r['outcome']})"] += 1
            continue
        if r["reward"] > 0 and (mode == "rejection" or drop_duplicate_correct):
            # The advantage was computed over the whole group first: a dropped copy still
            # counted towards its siblings' baseline.
            key = (r["problem_id"], tuple(r["completion"]))
            if key in seen_completions:
                report.dropped["duplicate completion"] += 1
                continue
            seen_completions.add(key)
        if max_per_problem is not None and per_problem[r["problem_id"]] >= max_per_problem:
            report.dropped[f"over max_per_problem={max_per_problem}"] += 1
            continue
        per_problem[r["problem_id"]] += 1
        kept.append(r)
    return kept


def _score(rows: list[dict], scorer: Scorer, token_budget: int, report: FilterReport) -> None:
    # A problem's attempts side by side (tapes come in finishing order): a backend that runs each
    # distinct prompt once (transformers) then finds them in the same slice.
    todo = sorted((r for r in rows if r.get("ref") is None), key=lambda r: r["group"])
    if not todo:
        return
    refs = score_in_chunks(scorer, [r["prompt"] for r in todo], [r["completion"] for r in todo], token_budget)
    for r, ref in zip(todo, refs):
        r["ref"] = [round(x, 6) for x in ref]
    report.scored += len(todo)


def _to_sample(r: dict, weight: float) -> dict:
    return {
        "id": r["id"],
        "tape_id": r["id"],
        "problem_id": r["problem_id"],
        "group_id": r["group"],
        "iteration": r["iteration"],
        "model": r["model"],
        "input_ids": list(r["prompt"]) + list(r["completion"]),
        "prompt_len": len(r["prompt"]),
        "old_logprobs": r["old"],
        "ref_logprobs": r.get("ref"),
        "kl": None if r.get("kl") is None else round(r["kl"], 6),
        "reward": r["reward"],
        "advantage": round(r["advantage"], 6),
        "weight": round(weight, 6),
    }


# ---------------------------------------------------------------------------------------------
# Gold solutions → SFT samples


def gold_samples(cfg: dict, *, split: str = "train", model: str | None = None,
                 n_problems: int | None = None, data_dir: str | None = None,
                 tokenizer=None) -> tuple[list[dict], FilterReport]:
    """SFT samples from gold solutions: reward 1, weight 1, advantage 0, no sampler log-probs.

    The prompt is the sampler's own (`attempts.prompt_for`: system prompt, template, the same
    seeded few-shot examples), so warm-start data and sampled data share one format.
    """
    from gsm8kctl.agent import format_gold_solution
    from gsm8kctl.artifacts.chat import render_completion
    from gsm8kctl.artifacts.data import split_problems
    from gsm8kctl.sampling.attempts import prompt_for

    model = model or cfg["model"]
    if n_problems is not None and n_problems < 1:
        raise UserError("--n-problems must be positive")
    # The data first: a bad data file is refused before a tokenizer (or model) is loaded.
    cfg = {**cfg, "data_dir": data_dir or cfg["data_dir"]}
    problems = split_problems(cfg, split)  # `train` holds no validation problem
    if n_problems is not None:
        problems = problems[:n_problems]
    train = split_problems(cfg, "train") if cfg["agent"]["few_shot"] > 0 else []
    if tokenizer is None:
        from gsm8kctl.artifacts.models import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(model))
    report = FilterReport(mode="gold")
    samples = []
    for p in problems:
        report.tapes += 1
        _, _, prompt_ids = prompt_for(cfg, tokenizer, p, train)
        completion_ids = render_completion(tokenizer, format_gold_solution(p["solution"]))
        samples.append({
            "id": f"gold-{p['id']}", "tape_id": None, "problem_id": p["id"],
            "group_id": f"gold/{p['id']}", "iteration": None, "model": model,
            "input_ids": prompt_ids + completion_ids, "prompt_len": len(prompt_ids),
            "old_logprobs": None, "ref_logprobs": None, "kl": None,
            "reward": 1.0, "advantage": 0.0, "weight": 1.0,
        })
    report.kept = len(samples)
    return samples, report


# ---------------------------------------------------------------------------------------------
# The stage: files in, file out, a table on stderr


def run_filter(
    inputs: Sequence[str],
    out: str,
    cfg: dict,
    *,
    mode: str | None = None,
    max_per_problem: int | None = None,
    drop_uniform_groups: bool | None = None,
    ref_model: str | None = None,
    ref_backend: str | None = None,
    gold: bool = False,
    split: str = "train",
    model: str | None = None,
    n_problems: int | None = None,
    data_dir: str | None = None,
    quiet: bool = False,
    scorer: Scorer | None = None,
    tapes_read: list[dict] | None = None,
    tapes_given: list[dict] | None = None,
    samples_written: list[dict] | None = None,
) -> FilterReport:
    """`gsm8kctl filter`: write samples to `out` (atomic file or `-`), report on stderr.

    Rerunning with the same arguments rewrites the same file: nothing is ever appended twice.
    `scorer` (a `Backend.score`) stands for the reference model when tapes are filtered: the
    loop's in-process engine keeps one loaded for the whole run. `tapes_read`, a list, receives
    every tape (checked), and `samples_written` every sample written, so that a caller in the
    same process need not parse them again. `tapes_given` are the tapes of the one file in
    `inputs`, still held by the caller that wrote them: checked, not read again.
    """
    # Before anything is read: `filter tapes.jsonl -o tapes.jsonl` would replace the tapes.
    check_output_file(out, option="-o", inputs=inputs, data_dir=data_dir or cfg["data_dir"])
    check_replaceable(out, option="-o", kind=JSONL_RECORDS)
    from gsm8kctl.artifacts.rundir import START_MODEL

    if ref_model == START_MODEL:
        raise UserError(f"filter.ref_model '{START_MODEL}' stands for the model a `gsm8kctl loop` started from; "
                        f"here pass the model itself (--ref-model PATH, or ./{START_MODEL} for a directory of that name)")
    # The config's `start` (the default) means the loop's warm start; run alone, no reference.
    cfg = {**cfg, "filter": {**cfg["filter"], "ref_model": configured_reference(cfg["filter"])}}
    if ref_model or cfg["filter"]["ref_model"]:
        from gsm8kctl.artifacts.models import resolve_model

        resolve_model(ref_model or cfg["filter"]["ref_model"])  # an unknown model: refused before any reading
    if gold:
        if inputs:
            raise UserError("--gold makes samples from GSM8k solutions; it takes no tapes")
        samples, report = gold_samples(cfg, split=split, model=model, n_problems=n_problems,
                                       data_dir=data_dir)
        if ref_model or cfg["filter"]["ref_model"]:
            ref = ref_model or cfg["filter"]["ref_model"]
            backend = open_scorer(ref, ref_backend or cfg["filter"]["ref_backend"], cfg)
            try:
                refs = score_in_chunks(backend.score, [s["input_ids"][:s["prompt_len"]] for s in samples],
                                       [s["input_ids"][s["prompt_len"]:] for s in samples],
                                       cfg["filter"]["score_token_budget"])
            finally:
                backend.close()
            for s, r in zip(samples, refs):
                s["ref_logprobs"] = [round(x, 6) for x in r]
            report.scored = len(samples)
    else:
        if not inputs:
            raise UserError("no tapes given: pass tapes files or - for stdin (or --gold)")
        samples, report = filter_tapes(read_tapes(inputs, tapes_read, tapes_given), cfg, mode=mode,
                                       max_per_problem=max_per_problem, drop_uniform_groups=drop_uniform_groups,
                                       ref_model=ref_model, ref_backend=ref_backend, scorer=scorer)
    write_jsonl(out, samples)
    if samples_written is not None:
        samples_written.extend(samples)
    if not quiet:
        console.print(report.table())
    if not samples:
        warn("no samples kept; finetune would have nothing to train on")
    return report
