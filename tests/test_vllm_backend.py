"""The in-process vLLM backend on the real embedded SmolLM2-135M (one engine start for the module).

The scoring-parity check (vLLM's sampler, vLLM `score()`, transformers `score()`) lives here too:
it was a module of its own that started a second engine for the same model and config (~35 s).
"""

from __future__ import annotations

import json
import time

import pytest

from gsm8kctl import agent
from gsm8kctl.artifacts.chat import render_prompt
from gsm8kctl.artifacts.data import load_problems
from gsm8kctl.config import default_config
from gsm8kctl.sampling.backends import SamplingParams, get_backend
from tests.conftest import run_cli

pytestmark = pytest.mark.vllm
import vllm  # noqa: E402,F401 - make install puts it there; missing must fail, not skip

QUESTIONS = [
    "Janet has 3 apples and buys 4 more. How many apples does she have?",
    "A train travels 60 miles per hour for 2 hours. How far does it go?",
]


def _engine_pids() -> set[int]:
    import psutil

    # multiprocessing's resource tracker is a per-process helper that lives as long as we do.
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    cfg = default_config()
    b = get_backend("vllm", smollm2_dir, cfg=cfg)
    b.engine_pids = _engine_pids()
    yield b
    b.close()


@pytest.fixture(scope="module")
def prompts(backend):
    return [render_prompt(backend.tokenizer, agent.build_messages(q))[1] for q in QUESTIONS]


def test_sigkill_of_a_stage_run_by_hand_leaves_no_engine(smollm2_dir, tmp_path):
    """`gsm8kctl evaluate --backend vllm` run directly (no loop, no supervisor) and killed with -9
    while its engine runs: within 10 s vLLM's engine core and workers are gone too (procs.Guard)."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO
    from gsm8kctl.procs import _stat, live_descendants, start_time

    cmd = [sys.executable, "-m", "gsm8kctl", "evaluate", "--model", smollm2_dir, "--backend", "vllm",
           "--limit", "8", "-o", str(tmp_path / "eval"), "evaluation.max_tokens=512"]
    with open(tmp_path / "stage.log", "w") as log:
        stage = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def engine() -> list[int]:
        found = []
        for p in live_descendants(stage.pid):
            try:
                if b"VLLM::" in open(f"/proc/{p}/cmdline", "rb").read():
                    found.append(p)
            except OSError:
                pass
        return found

    deadline = time.time() + 600
    while not engine():
        assert stage.poll() is None, (tmp_path / "stage.log").read_text()[-3000:]
        assert time.time() < deadline, "the engine did not start"
        time.sleep(0.2)
    time.sleep(3)  # into the engine's start (weights, workers) or its first steps
    tree = {p: start_time(p) for p in live_descendants(stage.pid)}
    assert len(engine()) >= 1 and len(tree) >= 2, tree  # the engine core (+ workers) and the guard
    stage.send_signal(signal.SIGKILL)
    stage.wait()

    def left() -> list[int]:
        return [p for p, t in tree.items() if start_time(p) == t and (_stat(p) or ("Z",))[0] not in ("Z", "X")]

    deadline = time.time() + 10
    while left() and time.time() < deadline:
        time.sleep(0.1)
    survivors = left()
    for p in survivors:  # do not leave gigabytes behind for the next test
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not survivors, f"processes of the stage outlived it by 10 s: {survivors}"


def test_sample_to_stdout_is_tapes_only(smollm2_dir, tmp_path):
    """`sample -o -` on vLLM: its log lines (vLLM logs to stdout by default, from this process and
    from its engine core) go to stderr, and every stdout line is a tape (before: 12 log lines first)."""
    import subprocess
    import sys

    from conftest import REPO

    cmd = [sys.executable, "-m", "gsm8kctl", "sample", "--model", smollm2_dir, "--backend", "vllm",
           "--n-problems", "2", "--attempts", "2", "--max-tokens", "8", "-o", "-", "-q",
           "--llm-calls", str(tmp_path / "calls.sqlite")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tapes = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted(t["attempt"] for t in tapes) == [0, 0, 1, 1] and all(t["id"] for t in tapes)


def _check_completion(c, backend, max_tokens):
    assert c.finish_reason in ("stop", "length")
    assert len(c.token_ids) == len(c.logprobs) > 0
    assert all(lp <= 0.0 for lp in c.logprobs)
    stops = [i for i, t in enumerate(c.token_ids) if t in backend.stop_ids]
    if c.finish_reason == "stop":
        # The stop token is kept (with its log-prob) as the last id; the text skips it.
        assert stops == [len(c.token_ids) - 1]
    else:
        assert len(c.token_ids) == max_tokens and not stops
    assert "<|im_end|>" not in c.text
    assert c.text == backend.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_sample_n_per_prompt(backend, prompts):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=48, seed=7)
    out = backend.generate(prompts, params)
    assert len(out) == len(prompts) and all(len(comps) == 3 for comps in out)
    for comps in out:
        for c in comps:
            _check_completion(c, backend, 48)
        # n samples of one prompt are different samples, not one sample three times.
        assert len({tuple(c.token_ids) for c in comps}) == 3


def test_finish_reasons_and_stop_token(backend, prompts):
    greedy = backend.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=300))[0][0]
    _check_completion(greedy, backend, 300)
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == backend.tokenizer.convert_tokens_to_ids("<|im_end|>")
    short = backend.generate(prompts[:1], SamplingParams(n=1, temperature=0.0, max_tokens=5))[0][0]
    assert short.finish_reason == "length" and short.token_ids == greedy.token_ids[:5]


def test_seeds(backend, prompts):
    """What a seed guarantees (docs/architecture.md, "Reproducibility"): the same seeded request
    alone in the engine gives the same tokens; within one call, repeated prompts and other seeds
    give other samples. A batch is NOT bit-identical across calls: vLLM's engine core starts
    stepping as requests reach it, so the batch is split into steps differently from call to call
    (more so on a busy machine), and bf16 logits depend on the batch they were computed in."""
    alone = SamplingParams(n=1, temperature=1.0, max_tokens=24, seed=123)
    backend.generate(prompts[:1], alone)  # from here on the prompt's KV blocks are cached for both calls
    first = backend.generate(prompts[:1], alone)[0][0]
    again = backend.generate(prompts[:1], alone)[0][0]
    assert again.token_ids == first.token_ids, "same seed, request alone in the engine: same sample"
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=123)
    batch = [prompts[0], prompts[1], prompts[0]]
    a = backend.generate(batch, params)
    ids = lambda out: [[c.token_ids for c in comps] for comps in out]  # noqa: E731
    # The same prompt twice in one call must not get the same samples (per-prompt seeds).
    assert ids(a)[0] != ids(a)[2]
    other = backend.generate(batch, SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=124))
    assert ids(other) != ids(a)


def test_many_seeded_prompts(backend):
    """32 seeded requests whose prompts together exceed vLLM's default 2048-token step budget: on
    CPU, chunked prefill of a seeded request used to kill the engine (see CPU_ENGINE_ARGS). Not
    more: without chunking one step prefills them all, and on a busy 2-core machine a 128-request
    step (~14k tokens) outlasted vLLM's 300 s execute_model timeout, which kills the engine."""
    from gsm8kctl.artifacts.data import load_problems

    problems = load_problems("test")[:8]
    ps = [render_prompt(backend.tokenizer, agent.build_messages(p["question"]))[1] for p in problems]
    assert sum(len(p) for p in ps) * 4 > 1.5 * 2048
    out = backend.generate(ps, SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=3))
    assert [len(c) for c in out] == [4] * 8 and all(len(c.token_ids) == 4 for cs in out for c in cs)


def test_score_matches_sampler_and_is_chunked(backend, prompts):
    out = backend.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1))
    ps = [p for p, comps in zip(prompts, out) for _ in comps]
    cs = [c.token_ids for comps in out for c in comps]
    sampler = [c.logprobs for comps in out for c in comps]
    big = backend.score(ps, cs)
    budget = backend.score_token_budget
    backend.score_token_budget = 1  # one sequence per engine call
    try:
        small = backend.score(ps, cs)
    finally:
        backend.score_token_budget = budget
    assert [len(s) for s in big] == [len(c) for c in cs]
    diffs = [abs(x - y) for s, t in zip(big, small) for x, y in zip(s, t)]
    # bf16 numerics depend on the batch composition, and vLLM's CPU scheduler decides it by timing:
    # the same code passed under 0.2 and gave 0.2008 from run to run. The yardstick below (bf16 vs fp32 on the
    # same tokens) is max 0.26 nats; a real bug is off by nats.
    assert max(diffs) < 0.3
    diffs = [abs(x - y) for s, t in zip(big, sampler) for x, y in zip(s, t)]
    assert max(diffs) < 0.5 and sum(diffs) / len(diffs) < 0.05
    assert backend.score([prompts[0]], [[]]) == [[]]


# ---------------------------------------------------------------------------------------------
# Scoring parity: same completion ids, three log-prob sources: vLLM's sampler, vLLM `score()`,
# transformers `score()`.
#
# All three are raw log-probs of the chosen token (no temperature), from bf16 weights, so they
# differ only by bf16 arithmetic (different kernels, batch shapes). The numbers are printed.
# Yardstick for the tolerances: the transformers backend in bf16 vs in fp32 on the same 761 tokens
# (8 GSM8k gold solutions) differs by mean 0.029, max 0.26 nats; measured here (768 tokens):
# vLLM sampler = vLLM score() exactly, vLLM vs transformers mean 0.034, max 0.24. A real bug (a
# position off by one, temperature-scaled log-probs, a wrong stop token) is off by nats.

PARITY_MAX_ABS = 1.0   # worst single token
PARITY_MEAN_ABS = 0.08  # mean over all completion tokens


def _diff(a: list[list[float]], b: list[list[float]]) -> dict:
    assert [len(x) for x in a] == [len(x) for x in b]
    d = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return {"tokens": len(d), "max_abs": round(max(d), 4), "mean_abs": round(sum(d) / len(d), 5)}


def test_scoring_parity(backend, smollm2_dir, capsys):
    """vLLM samples of 4 GSM8k test prompts x n=2 (ids + sampler log-probs), scored by vLLM's own
    score() and by the transformers backend (the module's engine: the same model and config)."""
    problems = load_problems("test")[:4]
    ps = [render_prompt(backend.tokenizer, agent.build_messages(p["question"]))[1] for p in problems]
    out = backend.generate(ps, SamplingParams(n=2, temperature=1.0, max_tokens=96, seed=11))
    ps = [p for p, comps in zip(ps, out) for _ in comps]
    cs = [c.token_ids for comps in out for c in comps]
    sampler = [c.logprobs for comps in out for c in comps]
    vllm_score = backend.score(ps, cs)
    tb = get_backend("transformers", smollm2_dir, cfg=default_config())
    try:
        tf_score = tb.score(ps, cs)
    finally:
        tb.close()
    report = {
        "sampler_vs_vllm_score": _diff(sampler, vllm_score),
        "vllm_score_vs_transformers_score": _diff(vllm_score, tf_score),
        "sampler_vs_transformers_score": _diff(sampler, tf_score),
    }
    with capsys.disabled():
        print("\nscoring parity (bf16, SmolLM2-135M):", json.dumps(report))
    for name, r in report.items():
        assert r["max_abs"] <= PARITY_MAX_ABS and r["mean_abs"] <= PARITY_MEAN_ABS, (name, r)

def test_engine_shared_within_process(backend, smollm2_dir):
    t0 = time.perf_counter()
    second = get_backend("vllm", smollm2_dir, cfg=default_config())
    assert time.perf_counter() - t0 < 10 and second.llm is backend.llm
    second.close()  # the first backend still holds the engine
    assert backend.generate([[1, 2, 3]], SamplingParams(n=1, max_tokens=2, temperature=0.0))[0][0].token_ids


def test_sample_and_evaluate_stages(backend, smollm2_dir, tmp_path):
    from gsm8kctl.stages.evaluate import evaluate
    from gsm8kctl.stages.sample import sample

    cfg = default_config()
    cfg.update(model=smollm2_dir, backend="vllm", attempts=3)
    cfg["sampling"]["max_tokens"] = 32
    cfg["evaluation"]["max_tokens"] = 32
    out = tmp_path / "tapes.jsonl"
    stats = sample(cfg, out=str(out), split="test", n_problems=2, backend=backend, quiet=True)
    tapes = [json.loads(line) for line in out.read_text().splitlines()]
    assert stats["tapes"] == len(tapes) == 6
    metrics = evaluate(cfg, out_dir=str(tmp_path / "eval"), limit=3, backend=backend, quiet=True)
    assert metrics["n"] == 3 and metrics["backend"] == "vllm"


def test_close_stops_the_engine(backend):
    import psutil

    assert backend.engine_pids, "the engine runs in child processes"
    backend.close()
    backend.close()  # idempotent
    deadline = time.time() + 30
    while time.time() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                         for p in backend.engine_pids):
        time.sleep(0.2)
    alive = [p for p in backend.engine_pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive


def test_a_head_size_vllm_cannot_run_on_the_cpu_is_refused_in_one_line(tiny_model_dir, tmp_path):
    """vLLM's CPU attention has kernels for some head sizes only (the tiny model's is 8): without
    this check its engine dies at the first step, and the cause shows only in vLLM's own log."""
    out = tmp_path / "out" / "tapes.jsonl"
    proc = run_cli("sample", "--backend", "vllm", "--model", tiny_model_dir, "--n-problems", "1",
                   "--attempts", "1", "--max-tokens", "4", "-o", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {tiny_model_dir}/config.json: head size 8"), proc.stderr
    assert "use backend=transformers" in lines[0]
    assert not out.exists()
