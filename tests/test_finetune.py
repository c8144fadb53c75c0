"""finetune on a tiny random-init Llama (CPU): it learns, resumes exactly, scales to 2 processes, refuses bad input."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gsm8kctl.artifacts import rundir
from gsm8kctl.config import load_config
from gsm8kctl.errors import UserError
from gsm8kctl.stages import finetune as ft
from gsm8kctl.training import trainer as training

TINY = ["finetune.learning_rate=0.01", "finetune.train_batch_size=2", "finetune.gradient_accumulation_passes=2",
        "finetune.token_budget=24", "finetune.save_checkpoint_steps=2", "finetune.logprob_chunk_tokens=16"]


def _cfg(*overrides):
    return load_config(overrides=[*TINY, *overrides])


def _samples(n=12, seed=0, old=True, ref=False, lo=100, hi=140):
    """Random prompts and completions over a small id range; weights of both signs."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(lo, hi) for _ in range(rng.randrange(3, 6))]
        c = [rng.randrange(lo, hi) for _ in range(rng.randrange(2, 8))]
        out.append({
            "id": f"s{seed}-{i}", "tape_id": f"s{seed}-{i}", "problem_id": f"train-{i % 3:05d}",
            "group_id": f"i0000/train-{i % 3:05d}", "iteration": 0, "model": "tiny",
            "input_ids": p + c, "prompt_len": len(p),
            "old_logprobs": [round(-10.0 + 0.1 * k, 3) for k in range(len(c))] if old else None,
            "ref_logprobs": [-10.5] * len(c) if ref else None, "kl": None,
            "reward": float(i % 2), "advantage": 1.0 if i % 2 else -1.0, "weight": 1.0 if i % 2 else -0.5,
        })
    return out


def _write(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _weights(ckpt):
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt) / "model.safetensors"))


def _max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _metrics(out):
    return [json.loads(line) for line in (Path(out) / "finetune" / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# Pure helpers


def test_lr_schedule():
    kw = dict(base=1.0, warmup=2, horizon=6)
    assert [training.lr_at(s, schedule="constant", **kw) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = [training.lr_at(s, schedule="cosine", **kw) for s in range(7)]
    assert cos[:3] == pytest.approx([0.5, 1.0, 1.0]) and cos[4] == pytest.approx(0.5) and cos[6] == pytest.approx(0.0)


def test_step_batches_and_micro_batches():
    a = training.step_batches(10, 4, seed=1, fp="x", epoch=0)
    assert [len(b) for b in a] == [4, 4, 2] and sorted(sum(a, [])) == list(range(10))
    assert a == training.step_batches(10, 4, seed=1, fp="x", epoch=0) != training.step_batches(10, 4, seed=1, fp="x", epoch=1)
    lengths = [10, 3, 8, 5, 7, 2]
    r0 = training.micro_batches(list(range(6)), lengths, rank=0, world=2, token_budget=16, max_batch=8)
    r1 = training.micro_batches(list(range(6)), lengths, rank=1, world=2, token_budget=16, max_batch=8)
    assert sorted(sum(r0 + r1, [])) == list(range(6))
    for mb in r0 + r1:  # padded size within budget unless a single long sample
        assert len(mb) * max(lengths[i] for i in mb) <= 16 or len(mb) == 1
    assert training.micro_batches([1, 5], lengths, rank=0, world=1, token_budget=100, max_batch=1) == [[5], [1]]
    # Packed (samples end to end): the budget bounds the total length, not rows x longest.
    packed = training.micro_batches(list(range(6)), lengths, rank=0, world=1, token_budget=16, max_batch=8, packed=True)
    assert sorted(sum(packed, [])) == list(range(6)) and len(packed) == 3
    assert all(sum(lengths[i] for i in mb) <= 16 for mb in packed)


def test_packed_logprobs_and_gradients_match_padded(tiny_model_dir):
    """Samples end to end with attention per sample = padded rows, in value and gradient (fp32)."""
    from transformers import AutoModelForCausalLM

    from gsm8kctl.training import packing
    from gsm8kctl.training.logprobs import pad_batch, token_logprobs

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = _samples(n=5, seed=3)
    prompts = [r["input_ids"][:r["prompt_len"]] for r in rows]
    comps = [r["input_ids"][r["prompt_len"]:] for r in rows]
    ids, attn, comp = pad_batch(prompts, comps, 0)
    padded, ent_padded = token_logprobs(lm, ids, attn, comp, chunk_tokens=7, with_entropy=True)
    padded.sum().backward()
    grads = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad()
    row = packing.pack(prompts, comps, "cpu")
    assert row.ids.shape == (1, sum(len(r["input_ids"]) for r in rows)) and row.max_len == ids.shape[1]
    with packing.segments(lm, row, flash=False):
        packed, ent_packed = token_logprobs(lm, row.ids, None, row.score, position_ids=row.positions,
                                            chunk_tokens=7, with_entropy=True)
    assert lm.config._attn_implementation != packing.ATTN_NAME  # restored
    packed, ent_packed = packing.unpack(packed, attn), packing.unpack(ent_packed, attn)
    assert torch.allclose(packed, padded, atol=1e-5) and torch.allclose(ent_packed, ent_padded, atol=1e-5)
    assert (packed[~comp] == 0).all() and (packed[comp] < 0).all()
    packed.sum().backward()
    for n, p in lm.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("extra", [[], ["finetune.gradient_checkpointing=true"]], ids=["plain", "grad-ckpt"])
def test_packed_training_matches_padded(tiny_model_dir, tmp_path, extra):
    path = _write(tmp_path / "s.jsonl", _samples(ref=True))
    runs = {}
    for packed in ("false", "true"):
        out = tmp_path / f"packing-{packed}"
        ft.run_finetune([path], str(out), _cfg(*RL, "finetune.train_batch_size=6", f"finetune.packing={packed}", *extra), init=tiny_model_dir, quiet=True)
        runs[packed] = out
    a, b = _metrics(runs["false"]), _metrics(runs["true"])
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-4)
    assert sum(r["micro_batches"] for r in a) > sum(r["micro_batches"] for r in b)  # fewer, fuller ones
    last = "checkpoints/step-000004"
    assert _max_diff(_weights(runs["false"] / last), _weights(runs["true"] / last)) < 1e-3


def test_compile_option():
    assert training._compile_wanted("auto", cuda=True) and not training._compile_wanted("auto", cuda=False)
    assert training._compile_wanted(True, cuda=False) and not training._compile_wanted("False", cuda=True)
    with pytest.raises(UserError, match="finetune.compile"):
        training._compile_wanted("sometimes", cuda=False)


def test_resolve_objective():
    cfg = load_config(None, ["use_rejection_sampling=true"])
    assert ft.resolve_objective(cfg) == "sft"  # use_rejection_sampling
    cfg["use_rejection_sampling"] = False
    assert ft.resolve_objective(cfg) == "reinforce"
    cfg["finetune"]["rl"]["algo"] = "grpo"
    assert ft.resolve_objective(cfg) == "grpo" and ft.resolve_objective(cfg, "sft") == "sft"
    with pytest.raises(UserError):
        ft.resolve_objective(cfg, "ppo")


# ---------------------------------------------------------------------------------------------
# A real small finetune


def _nll(model_dir, samples):
    from transformers import AutoModelForCausalLM

    from gsm8kctl.training.logprobs import pad_batch, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, attn, comp = pad_batch([s["input_ids"][:s["prompt_len"]] for s in samples],
                                [s["input_ids"][s["prompt_len"]:] for s in samples], 0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, attn, comp)
    return -(lp.sum() / comp.sum()).item()


def test_finetune_lowers_nll_of_its_own_samples(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gsm8kctl.agent import build_messages
    from gsm8kctl.artifacts.chat import render_prompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    samples = []
    for i, q in enumerate(["What is 2 + 3?", "Tom has 4 apples and eats one. How many are left?"]):
        _, prompt = render_prompt(tok, build_messages(q))
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=8, min_new_tokens=8,
                                 num_return_sequences=3, pad_token_id=tok.pad_token_id)
        for j, row in enumerate(gen.tolist()):
            samples.append({"id": f"t{i}{j}", "problem_id": f"train-{i:05d}", "group_id": f"i0000/train-{i:05d}",
                            "input_ids": row, "prompt_len": len(prompt), "old_logprobs": None,
                            "ref_logprobs": None, "reward": 1.0, "advantage": 0.0, "weight": 1.0})
    path = _write(tmp_path / "samples.jsonl", samples)
    before = _nll(tiny_model_dir, samples)
    cfg = _cfg("finetune.token_budget=256", "finetune.steps=6", "finetune.save_checkpoint_steps=3",
               "finetune.lr_scheduler=cosine", "finetune.warmup_steps=1")
    out = tmp_path / "run"
    result = ft.run_finetune([path], str(out), cfg, init=tiny_model_dir, objective="sft")
    assert result["step"] == 6 and result["steps_run"] == 6
    ckpt = rundir.latest_checkpoint(out)
    assert ckpt == out / "checkpoints" / "step-000006" and (out / "checkpoints" / "latest").read_text().strip() == ckpt.name
    after = _nll(str(ckpt), samples)
    assert after < before - 0.5, (before, after)
    # a complete HF directory: tokenizer and chat template travel with the weights
    assert AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    m = _metrics(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4, 5, 6]
    assert m[0]["lr"] == pytest.approx(0.01) and m[-1]["lr"] < 0.002  # warmup 1, cosine down
    for key in ("loss", "grad_norm", "tokens_per_s", "samples_per_s", "entropy"):
        assert m[0][key] > 0
    stats = json.loads((out / "finetune" / "dataset_stats.jsonl").read_text().splitlines()[0])
    assert stats["count"] == 6 and stats["completion_tokens"]["max"] == 8
    assert "finetune samples" in capsys.readouterr().err
    # same command again: the phase is finished, nothing is redone
    again = ft.run_finetune([path], str(out), cfg, init=tiny_model_dir, objective="sft", quiet=True)
    assert again["steps_run"] == 0 and len(_metrics(out)) == 6


# ---------------------------------------------------------------------------------------------
# Resume


RL = ["use_rejection_sampling=false", "finetune.rl.algo=grpo", "finetune.rl.kl_coef=0.1", "finetune.rl.epsilon=0.1",
      "finetune.lr_scheduler=cosine", "finetune.warmup_steps=1", "finetune.steps=4",
      "finetune.save_checkpoint_steps=1", "finetune.keep_checkpoints=2"]


def test_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    path = _write(tmp_path / "s.jsonl", _samples(ref=True))
    cfg = _cfg(*RL)
    full = tmp_path / "full"
    ft.run_finetune([path], str(full), cfg, init=tiny_model_dir, quiet=True)
    split = tmp_path / "split"
    first = ft.run_finetune([path], str(split), cfg, init=tiny_model_dir, quiet=True, stop_after=2)
    assert first["step"] == 2
    # as if killed after logging step 3 but before saving it
    with open(split / "finetune" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n")
    second = ft.run_finetune([path], str(split), cfg, init=tiny_model_dir, quiet=True)
    assert second["step"] == 4 and second["steps_run"] == 2
    assert _max_diff(_weights(full / "checkpoints" / "step-000004"), _weights(split / "checkpoints" / "step-000004")) < 1e-6
    a, b = _metrics(full), _metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-6)
    assert a[0]["kl"] > 0 and a[0]["clip_frac"] is not None and a[0]["ratio_mean"] > 0
    assert a[0]["drift_old_new"] > 0
    # keep the last 2 checkpoints (plus one marked `keep`)
    assert [p.name for _, p in rundir.list_checkpoints(split)] == ["step-000003", "step-000004"]


def test_new_samples_start_a_new_phase_and_latest_beats_init(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = _cfg("finetune.steps=2")
    ft.run_finetune([_write(tmp_path / "a.jsonl", _samples(seed=1))], str(out), cfg, init=tiny_model_dir, quiet=True)
    (out / "checkpoints" / "step-000002" / "keep").write_text("")
    capsys.readouterr()
    r = ft.run_finetune([_write(tmp_path / "b.jsonl", _samples(seed=2))], str(out), cfg, init=tiny_model_dir)
    err = capsys.readouterr().err
    assert "resuming from" in err and "--init" in err and "ignored" in err
    assert (r["phase_start"], r["step"]) == (2, 4)
    phases = [json.loads(x) for x in (out / "finetune" / "dataset_stats.jsonl").read_text().splitlines()]
    assert [p["start_step"] for p in phases] == [0, 2]
    # max_steps caps the global step
    r = ft.run_finetune([_write(tmp_path / "c.jsonl", _samples(seed=3))], str(out), cfg, quiet=True, max_steps=5)
    assert r["step"] == 5
    assert {p.name for _, p in rundir.list_checkpoints(out)} == {"step-000002", "step-000004", "step-000005"}
    # a broken `latest` pointer falls back to the highest complete checkpoint
    (out / "checkpoints" / "latest").write_text("step-000999\n")
    assert rundir.latest_checkpoint(out).name == "step-000005"


def test_killed_process_resumes(tiny_model_dir, tmp_path):
    """SIGKILL a real finetune process after its first save; the same command finishes the job."""
    path = _write(tmp_path / "s.jsonl", _samples(n=16))
    overrides = [*TINY, "finetune.steps=8", "finetune.save_checkpoint_steps=1", "finetune.keep_checkpoints=3"]
    script = (
        "import sys; from gsm8kctl.config import load_config; from gsm8kctl.stages.finetune import run_finetune\n"
        f"run_finetune([{path!r}], sys.argv[1], load_config(overrides={overrides!r}), init={tiny_model_dir!r}, quiet=True)\n"
    )
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", script, str(out)])
    deadline = time.time() + 120
    while rundir.latest_checkpoint(out) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = rundir.checkpoint_step(rundir.latest_checkpoint(out))
    assert done_before < 8
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, timeout=300)
    ref = tmp_path / "ref"
    ft.run_finetune([path], str(ref), load_config(overrides=overrides), init=tiny_model_dir, quiet=True)
    assert _max_diff(_weights(ref / "checkpoints" / "step-000008"), _weights(out / "checkpoints" / "step-000008")) < 1e-6
    assert [r["step"] for r in _metrics(out)] == list(range(1, 9))


# ---------------------------------------------------------------------------------------------
# accelerate launch, 2 CPU processes (gloo)


def test_two_processes_match_one(tiny_model_dir, tmp_path):
    path = _write(tmp_path / "s.jsonl", _samples())
    base = ["use_rejection_sampling=false", "finetune.steps=3", "finetune.gradient_accumulation_passes=1"]
    # global batch 4 both ways: 2 samples × 2 passes × 1 process, or 2 × 1 pass × 2 processes
    one = ft.run_finetune([path], str(tmp_path / "one"), _cfg(*base, "finetune.gradient_accumulation_passes=2"),
                          init=tiny_model_dir, quiet=True)
    two = ft.run_finetune([path], str(tmp_path / "two"), _cfg(*base), init=tiny_model_dir, quiet=True,
                          num_processes=2)
    assert two["step"] == 3 and Path(two["checkpoint"]).name == "step-000003"
    assert _max_diff(_weights(one["checkpoint"]), _weights(two["checkpoint"])) < 1e-5
    assert [r["loss"] for r in _metrics(tmp_path / "one")] == pytest.approx(
        [r["loss"] for r in _metrics(tmp_path / "two")], abs=1e-5)
    state = json.loads((Path(two["checkpoint"]) / "training_state" / "state.json").read_text())
    assert state["num_processes"] == 2 and (Path(two["checkpoint"]) / "training_state" / "rng-1.pt").exists()


# ---------------------------------------------------------------------------------------------
# Bad input: one clear UserError before any training


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def _rank_pids(root: int, rank: int) -> list[int]:
    """Training workers of `rank` below `root` (torchrun gives each its RANK)."""
    from gsm8kctl.procs import live_descendants

    found = []
    for pid in live_descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            found.append(pid)
    return found


def test_a_dead_rank_stops_the_others_with_one_clear_line(tiny_model_dir, tmp_path):
    """kill -9 of rank 1 mid-training: rank 0 does not hang in its all-reduce, finetune exits within
    finetune.nccl_timeout_s with one line, no process is left, and the same command resumes."""
    from gsm8kctl.procs import live_descendants

    path = _write(tmp_path / "s.jsonl", _samples(n=16))
    out = tmp_path / "out"
    timeout_s = 30
    cmd = [sys.executable, "-m", "gsm8kctl", "finetune", str(path), "--out", str(out), "--init", tiny_model_dir,
           "--num-processes", "2", "--steps", "400", "-q", *TINY, "use_rejection_sampling=false",
           "finetune.gradient_accumulation_passes=1", f"finetune.nccl_timeout_s={timeout_s}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "finetune" / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline, "training did not start"
        time.sleep(0.1)
    victims = _rank_pids(proc.pid, 1)
    assert victims, "no rank-1 worker found"
    t0 = time.time()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=timeout_s + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.time() - t0
    assert proc.returncode == 1, err[-2000:]
    assert took < timeout_s, f"the surviving rank took {took:.0f} s to stop"
    last = err.strip().splitlines()[-1]
    assert last.startswith("Error: a finetune worker failed (exit ") and "rerun the same command" in last, last
    launch = str(out / "finetune" / "launch.json")  # on every worker's command line
    left = [p for p in live_descendants(1) if launch in _cmdline(p)]
    assert not left, f"workers left running: {left}"
    # The last checkpoint is intact and the same command (fewer steps, to keep it short) resumes from it.
    done = rundir.checkpoint_step(rundir.latest_checkpoint(out))
    again = subprocess.run([*cmd[:cmd.index("--steps") + 1], str(done + 2), *cmd[cmd.index("--steps") + 2:]],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert rundir.checkpoint_step(rundir.latest_checkpoint(out)) == done + 2


def test_bad_inputs(tiny_model_dir, tmp_path):
    cfg = _cfg()
    out = str(tmp_path / "out")

    def run(records=None, raw=None, name="s.jsonl", **kw):
        p = tmp_path / name
        if raw is not None:
            p.write_bytes(raw)
        else:
            _write(p, records)
        return ft.run_finetune([str(p)], out, kw.pop("cfg", cfg), init=tiny_model_dir, quiet=True, **kw)

    tape = {"id": "t", "problem_id": "p", "prompt_token_ids": [1], "completion_token_ids": [2], "reward": 1}
    with pytest.raises(UserError, match="tape, not a training sample"):
        run([tape])
    with pytest.raises(UserError, match="not a text JSONL"):
        run(raw=b"SQLite format 3\x00\xff\xfe\x81", name="calls.sqlite")
    with pytest.raises(UserError, match="expected a JSON object"):
        run(raw=b"[1, 2, 3]\n", name="array.json")
    with pytest.raises(UserError, match="no training samples"):
        run(raw=b"\n", name="empty.jsonl")
    long = _samples(n=1)[0]
    long["input_ids"] = long["input_ids"][:long["prompt_len"]] + [5] * 2000
    long["old_logprobs"] = None
    with pytest.raises(UserError, match="s.jsonl:1: .*more than finetune.seq_length=1024"):
        run([long])
    bad_vocab = _samples(n=1, lo=10**6, hi=10**6 + 1)
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        run(bad_vocab)
    negative = _samples(n=1)[0]
    negative["input_ids"] = negative["input_ids"][:-1] + [-4]
    with pytest.raises(UserError, match=r"token id -4 is outside the model's vocabulary \(0\.\."):
        run([negative])
    with pytest.raises(UserError, match="grpo needs the sampler's old_logprobs"):
        run(_samples(n=2, old=False), objective="grpo")
    half = _samples(n=2)  # some with ref_logprobs, some without: refused (none at all trains without KL)
    half[0]["ref_logprobs"] = list(half[0]["old_logprobs"])
    with pytest.raises(UserError, match="kl_coef > 0 needs ref_logprobs; 1 of 2"):
        run(half, cfg=_cfg("finetune.rl.kl_coef=0.1"))
    with pytest.raises(UserError, match="prompt_len"):
        run([{**_samples(n=1)[0], "prompt_len": 0}])
    with pytest.raises(UserError, match="train_batch_size"):
        run(_samples(n=2), cfg=_cfg("finetune.train_batch_size=0"))
    with pytest.raises(UserError, match="no such file"):
        ft.run_finetune([str(tmp_path / "nope.jsonl")], out, cfg, init=tiny_model_dir)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((Path(tiny_model_dir) / f).read_bytes())
    with pytest.raises(UserError, match="no tokenizer"):
        ft.run_finetune([_write(tmp_path / "ok.jsonl", _samples(n=2))], out, cfg, init=str(bare))
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_resume_from_a_checkpoint_without_its_tokenizer_is_refused(tiny_model_dir, tmp_path):
    """The checkpoint a rerun resumes from gets the same model-directory check as a --model path:
    one line naming it, before any training."""
    samples = tmp_path / "s.jsonl"
    _write(samples, _samples(n=4))
    out = tmp_path / "out"
    ft.run_finetune([str(samples)], str(out), _cfg("finetune.steps=1"), init=tiny_model_dir, quiet=True)
    ckpt = rundir.latest_checkpoint(out)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=rf"{ckpt}: no tokenizer files"):
        ft.run_finetune([str(samples)], str(out), _cfg("finetune.steps=2"), init=tiny_model_dir, quiet=True)
    assert rundir.latest_checkpoint(out) == ckpt  # nothing trained or saved
