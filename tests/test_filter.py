"""filter on hand-made tapes: counts, dedupe, caps, uniform groups, KL shaping, gold formatting, errors."""

import io
import json
import math
import os

import pytest

from gsm8kctl.artifacts.samples import read_samples, samples_stats
from gsm8kctl.config import load_config
from gsm8kctl.errors import UserError
from gsm8kctl.stages import filter as flt

PROMPT = [1, 2, 3]


def tape(pid, attempt, reward, completion, iteration=3, logprobs="auto", finish="stop", correct=None):
    if logprobs == "auto":
        logprobs = [-0.5] * len(completion)
    return {
        "id": f"{pid}-i{iteration:04d}-a{attempt:02d}-abc123", "iteration": iteration, "split": "train",
        "problem_id": pid, "attempt": attempt, "model": "m", "question": "q", "gold": "1",
        "answer": {"strict": "1" if reward > 0 else ("2" if reward == 0 else None), "lenient": None},
        "correct": reward > 0 if correct is None else correct, "reward": reward, "finish_reason": finish,
        "prompt_token_ids": PROMPT, "completion_token_ids": completion, "logprobs": logprobs,
    }


def tapes_fixture():
    return [
        # train-00001: two successes with the same completion, a wrong one, an overflow
        tape("train-00001", 0, 1.0, [10, 11]),
        tape("train-00001", 1, 1.0, [10, 11]),
        tape("train-00001", 2, 0.0, [12]),
        tape("train-00001", 3, -1.0, [13, 14, 15], finish="length"),
        # train-00002: all correct (uniform), distinct completions
        tape("train-00002", 0, 1.0, [20]),
        tape("train-00002", 1, 1.0, [21]),
        tape("train-00002", 2, 1.0, [22]),
        # train-00003: all wrong (uniform)
        tape("train-00003", 0, 0.0, [30]),
        tape("train-00003", 1, 0.0, [31]),
    ]


@pytest.fixture
def cfg():
    # These rows count what filter keeps group by group, rejection sampling unless a test says --mode,
    # uniform groups kept unless a test drops them (the loop's recipe does the opposite by default).
    return load_config(None, ["filter.drop_uniform_groups=false", "use_rejection_sampling=true"])


def test_rejection_counts_dedupe_and_report(cfg):
    samples, rep = flt.filter_tapes(tapes_fixture(), cfg, mode="rejection")
    assert [s["id"][:13] for s in samples] == ["train-00001-i", "train-00002-i", "train-00002-i", "train-00002-i"]
    assert rep.tapes == 9 and rep.kept == 4 and rep.groups == 3
    assert rep.uniform_groups == 2 and rep.uniform_all_correct == 1
    assert rep.dropped == {"duplicate completion": 1, "not rewarded (wrong)": 3, "not rewarded (overflow)": 1}
    s = samples[0]
    assert s["input_ids"] == [1, 2, 3, 10, 11] and s["prompt_len"] == 3
    assert s["group_id"] == "i0003/train-00001" and s["tape_id"] == s["id"] and s["iteration"] == 3
    assert s["old_logprobs"] == [-0.5, -0.5] and s["ref_logprobs"] is None and s["kl"] is None
    # advantage over the whole group (1, 1, 0, −1): mean 0.25, sample std sqrt(2.75 / 3)
    assert s["advantage"] == pytest.approx(0.75 / (math.sqrt(2.75 / 3) + 1e-4), abs=1e-5)
    assert s["weight"] == s["advantage"]  # use_advantages is on by default
    assert samples[1]["advantage"] == 0.0  # uniform group
    assert set(s) >= {"id", "tape_id", "problem_id", "group_id", "iteration", "model", "input_ids",
                      "prompt_len", "old_logprobs", "ref_logprobs", "reward", "advantage", "weight"}


def test_max_per_problem_and_drop_uniform(cfg):
    samples, rep = flt.filter_tapes(tapes_fixture(), cfg, mode="rejection", max_per_problem=2)
    assert len(samples) == 3 and rep.dropped["over max_per_problem=2"] == 1
    samples, rep = flt.filter_tapes(tapes_fixture(), cfg, mode="rejection", drop_uniform_groups=True)
    assert [s["problem_id"] for s in samples] == ["train-00001"]
    assert rep.dropped["uniform group"] == 5 and rep.uniform_dropped


def test_mode_all_keeps_every_attempt_with_reward_weights(cfg):
    cfg["finetune"]["rl"]["use_advantages"] = False
    samples, rep = flt.filter_tapes(tapes_fixture(), cfg, mode="all")
    assert len(samples) == 9 and not rep.dropped  # duplicates are independent draws here
    assert [s["weight"] for s in samples] == [1, 1, 0, -1, 1, 1, 1, 0, 0]
    # mode follows use_rejection_sampling when not given
    cfg["use_rejection_sampling"] = False
    assert flt.filter_tapes(tapes_fixture(), cfg)[1].mode == "all"


def test_dedupe_is_per_problem_across_iterations_and_duplicate_tape_ids(cfg):
    ts = [tape("train-00001", 0, 1.0, [10]), tape("train-00001", 0, 1.0, [10], iteration=4),
          tape("train-00002", 0, 1.0, [10]), tape("train-00002", 0, 1.0, [10])]
    samples, rep = flt.filter_tapes(ts, cfg, mode="rejection")
    assert [s["group_id"] for s in samples] == ["i0003/train-00001", "i0003/train-00002"]
    assert rep.dropped == {"duplicate completion": 1, "duplicate tape id": 1}
    samples, rep = flt.filter_tapes([tape("train-00001", 0, 1.0, [])], cfg, mode="all")
    assert samples == [] and rep.dropped == {"empty completion": 1}


def test_drop_duplicate_correct_in_all_mode(cfg):
    cfg["filter"]["drop_duplicate_correct"] = True
    samples, rep = flt.filter_tapes(tapes_fixture(), cfg, mode="all")
    # the second identical success of train-00001 goes; wrong and overflowing attempts stay
    assert len(samples) == 8 and rep.dropped == {"duplicate completion": 1}
    # its advantage was computed with the copy in the group: (1, 1, 0, -1)
    assert samples[0]["advantage"] == pytest.approx(0.75 / (math.sqrt(2.75 / 3) + 1e-4), abs=1e-5)
    cfg["finetune"]["rl"]["divide_by_std"] = False  # Dr. GRPO: r - mean
    samples, _ = flt.filter_tapes(tapes_fixture(), cfg, mode="all")
    assert [s["advantage"] for s in samples[:3]] == pytest.approx([0.75, -0.25, -1.25])


class FakeScorer:
    """Reference log-prob −1 for every token; records the calls (to check chunking)."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions):
        self.calls.append(len(prompts))
        return [[-1.0] * len(c) for c in completions]


def test_implicit_kl_folds_into_reward_before_advantages(cfg):
    rl = cfg["finetune"]["rl"]
    rl["implicit_kl_coef"], rl["use_advantages"] = 0.5, False
    cfg["filter"]["score_token_budget"] = 10  # 3-5 tokens per row: 2-3 rows per call
    ts = [tape("train-00001", 0, 1.0, [10, 11], logprobs=[-0.5, -0.5]),   # k1 KL = Σ(old − ref) = 1
          tape("train-00001", 1, 0.0, [12], logprobs=[-2.0])]            # k1 KL = −1
    scorer = FakeScorer()
    samples, rep = flt.filter_tapes(ts, cfg, mode="all", scorer=scorer)
    assert [s["kl"] for s in samples] == [1.0, -1.0]
    assert [s["weight"] for s in samples] == [0.5, 0.5]  # 1 − 0.5·1, 0 − 0.5·(−1)
    assert samples[0]["ref_logprobs"] == [-1.0, -1.0] and rep.scored == 2
    assert samples[0]["reward"] == 1.0  # the task reward stays; the shaped one is the weight
    # k3: Σ exp(ref−old) − (ref−old) − 1
    rl["implicit_kl_estimator"] = "k3"
    samples, _ = flt.filter_tapes(ts, cfg, mode="all", scorer=FakeScorer())
    k3_a = 2 * (math.exp(-0.5) + 0.5 - 1)
    assert samples[0]["kl"] == pytest.approx(k3_a, abs=1e-6)
    assert samples[0]["weight"] == pytest.approx(1 - 0.5 * k3_a, abs=1e-6)
    # same rewards after shaping → zero advantages with use_advantages
    rl["implicit_kl_estimator"], rl["use_advantages"] = "k1", True
    samples, _ = flt.filter_tapes(ts, cfg, mode="all", scorer=FakeScorer())
    assert [s["advantage"] for s in samples] == [0.0, 0.0]


def test_reference_scores_only_kept_samples_in_chunks(cfg):
    cfg["filter"]["score_token_budget"] = 5  # one row (≥ 4 tokens) per call
    scorer = FakeScorer()
    samples, rep = flt.filter_tapes(tapes_fixture(), cfg, mode="rejection", scorer=scorer)
    assert rep.scored == 4 and scorer.calls == [1, 1, 1, 1]
    assert all(s["ref_logprobs"] == [-1.0] * (len(s["input_ids"]) - 3) for s in samples)


def test_reference_scoring_sees_each_problems_attempts_together(cfg):
    """Tapes come in finishing order, problems interleaved; the scorer gets each problem's
    attempts in one slice (a backend runs each distinct prompt once)."""
    cfg["finetune"]["rl"]["implicit_kl_coef"] = 0.1
    cfg["filter"]["score_token_budget"] = 3 * 5  # three rows of 3 + 2 tokens per call
    seen = []

    def scorer(prompts, completions):
        seen.append({tuple(p) for p in prompts})
        return [[-1.0] * len(c) for c in completions]

    ts = []
    for a in range(3):
        for k, pid in enumerate(("train-00001", "train-00002", "train-00003")):
            t = tape(pid, a, float(a == k), [40 + a, 41])
            t["prompt_token_ids"] = [k + 1, 7, 7]
            ts.append(t)
    flt.filter_tapes(ts, cfg, mode="all", scorer=scorer)
    assert seen == [{(1, 7, 7)}, {(2, 7, 7)}, {(3, 7, 7)}]


def test_score_in_chunks_checks_the_scorer():
    with pytest.raises(RuntimeError):
        flt.score_in_chunks(lambda p, c: [[0.0]], [[1], [1]], [[2], [3]], 100)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_bad_inputs_are_user_errors(tmp_path, cfg):
    good = tape("train-00001", 0, 1.0, [10])
    cases = {
        "sample.jsonl": ([{"id": "x", "input_ids": [1, 2], "prompt_len": 1}], "training sample"),
        "missing.jsonl": ([{"id": "x", "problem_id": "p"}], "missing"),
        "lp.jsonl": ([{**good, "logprobs": [0.1, 0.2]}], "logprobs"),
        "reward.jsonl": ([{**good, "reward": None}], "reward"),
    }
    for name, (records, msg) in cases.items():
        with pytest.raises(UserError, match=msg):
            flt.run_filter([_write(tmp_path / name, records)], str(tmp_path / "o.jsonl"), cfg, quiet=True)
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2: invalid JSON"):
        flt.run_filter([str(tmp_path / "bad.jsonl")], "-", cfg, quiet=True)
    (tmp_path / "bin.sqlite").write_bytes(b"SQLite format 3\x00\xff\xfe\x00\x81")
    with pytest.raises(UserError, match="not a text JSONL"):
        flt.run_filter([str(tmp_path / "bin.sqlite")], "-", cfg, quiet=True)
    with pytest.raises(UserError, match="no such file"):
        flt.run_filter([str(tmp_path / "nope.jsonl")], "-", cfg, quiet=True)
    with pytest.raises(UserError, match="no tapes"):
        flt.run_filter([], "-", cfg, quiet=True)
    with pytest.raises(UserError, match="mode"):
        flt.filter_tapes([good], cfg, mode="best")
    cfg["finetune"]["rl"]["implicit_kl_coef"] = 0.1
    with pytest.raises(UserError, match="ref-model"):
        flt.filter_tapes([good], cfg)
    with pytest.raises(UserError, match="no sampler logprobs"):
        flt.filter_tapes([tape("train-00001", 0, 1.0, [10], logprobs=None)], cfg, scorer=FakeScorer())


def test_run_filter_file_and_stdout(tmp_path, cfg, capsys, monkeypatch):
    src = _write(tmp_path / "tapes.jsonl", tapes_fixture())
    out = tmp_path / "samples.jsonl"
    rep = flt.run_filter([src], str(out), cfg)
    err = capsys.readouterr().err
    assert "kept" in err and "duplicate completion" in err
    assert rep.kept == 4 and len(read_samples([str(out)])) == 4
    # rerun: same file, same content, nothing appended
    flt.run_filter([src], str(out), cfg, quiet=True)
    assert len(out.read_text().splitlines()) == 4
    # stdin to stdout: stdout is data only
    monkeypatch.setattr("sys.stdin", io.StringIO(open(src).read()))
    flt.run_filter(["-"], "-", cfg, mode="all")
    captured = capsys.readouterr()
    assert [json.loads(line)["problem_id"] for line in captured.out.splitlines()].count("train-00002") == 3
    assert "filter (all)" in captured.err


def test_samples_stats():
    cfg = load_config(None, ["filter.drop_uniform_groups=false"])
    samples, _ = flt.filter_tapes(tapes_fixture(), cfg, mode="all")
    st = samples_stats(samples)
    assert st["count"] == 9 and st["problems"] == 3 and st["groups"] == 3
    assert st["prompt_tokens"]["max"] == 3 and st["completion_tokens"]["max"] == 3
    assert st["completion_tokens_sum"] == 2 + 2 + 1 + 3 + 1 + 1 + 1 + 1 + 1
    assert st["reward"]["histogram"] == {"-1": 1, "0": 3, "1": 5}
    assert st["with_old_logprobs"] == 9 and st["with_ref_logprobs"] == 0
    assert st["weight"]["zero"] == 5  # two uniform groups, and the rest are non-zero


# ---------------------------------------------------------------------------------------------
# Gold solutions


@pytest.fixture(scope="module")
def tokenizer():
    from gsm8kctl.artifacts.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


@pytest.fixture
def gsm8k_dir():
    d = os.environ.get("GSM8K_DIR", "/work/shared/data/gsm8k")
    assert os.path.exists(os.path.join(d, "train.jsonl")), f"GSM8K_DIR={d} has no train.jsonl"
    return d


def test_gold_samples_format_and_tokens(cfg, tokenizer, gsm8k_dir):
    from gsm8kctl.agent import build_messages
    from gsm8kctl.artifacts.chat import render_prompt
    from gsm8kctl.artifacts.data import load_problems

    samples, rep = flt.gold_samples(cfg, split="train", n_problems=3, data_dir=gsm8k_dir, tokenizer=tokenizer)
    assert rep.kept == 3 and [s["id"] for s in samples] == ["gold-train-00000", "gold-train-00001", "gold-train-00002"]
    p = load_problems("train", gsm8k_dir)[0]
    s = samples[0]
    _, prompt_ids = render_prompt(tokenizer, build_messages(p["question"], task_template=cfg["agent"]["task_template"]))
    assert s["input_ids"][:s["prompt_len"]] == prompt_ids
    completion = s["input_ids"][s["prompt_len"]:]
    assert completion[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(completion, skip_special_tokens=True)
    assert "<<" not in text and "####" not in text
    assert text.rstrip().endswith(f"The final answer is \\boxed{{{p['gold']}}}.")
    assert (s["reward"], s["advantage"], s["weight"], s["old_logprobs"], s["group_id"]) == (
        1.0, 0.0, 1.0, None, "gold/train-00000")


def test_gold_prompt_is_the_samplers_prompt_with_few_shot(cfg, tokenizer, gsm8k_dir):
    from gsm8kctl.artifacts.data import split_problems
    from gsm8kctl.sampling.attempts import prompt_for

    cfg["agent"]["few_shot"] = 2
    # The training split, as the sampler sees it: the validation problems are never few-shot examples.
    train = split_problems({**cfg, "data_dir": str(gsm8k_dir)}, "train")
    samples, _ = flt.gold_samples(cfg, n_problems=2, data_dir=gsm8k_dir, tokenizer=tokenizer)
    messages, _, ids = prompt_for(cfg, tokenizer, train[1], train)
    assert samples[1]["input_ids"][:samples[1]["prompt_len"]] == ids
    assert [m["role"] for m in messages][-3:] == ["user", "assistant", "user"]


def test_run_filter_gold(tmp_path, cfg, tokenizer, gsm8k_dir, monkeypatch):
    monkeypatch.setattr("gsm8kctl.artifacts.models.load_tokenizer", lambda path: tokenizer)
    out = tmp_path / "gold.jsonl"
    rep = flt.run_filter([], str(out), cfg, gold=True, n_problems=2, data_dir=gsm8k_dir, quiet=True)
    assert rep.kept == 2 and len(read_samples([str(out)])) == 2
    with pytest.raises(UserError, match="takes no tapes"):
        flt.run_filter(["x.jsonl"], str(out), cfg, gold=True)


def test_ref_model_through_the_transformers_backend(cfg, tiny_model_dir):
    """--ref-model opens a real backend and fills ref_logprobs through its score()."""
    import torch
    from transformers import AutoModelForCausalLM

    from gsm8kctl.training.logprobs import pad_batch, token_logprobs

    cfg["finetune"]["rl"]["implicit_kl_coef"] = 0.1
    samples, rep = flt.filter_tapes(tapes_fixture()[:4], cfg, mode="all", ref_model=tiny_model_dir,
                                    ref_backend="transformers")
    assert rep.scored == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    s = samples[3]
    ids, attn, comp = pad_batch([s["input_ids"][:3]], [s["input_ids"][3:]], 0)
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, attn, comp)
    assert s["ref_logprobs"] == pytest.approx(lp[comp].tolist(), abs=5e-3)  # the backend's own dtype/batching
    assert s["kl"] == pytest.approx(sum(o - r for o, r in zip(s["old_logprobs"], s["ref_logprobs"])), abs=1e-4)


def test_the_list_checks_agree_with_the_rule_element_by_element():
    """`is_int_list` and `is_number_list` take a fast path (one pass over the element types, a
    sum for finiteness); on every edge case they must say what checking each element says."""
    from gsm8kctl.artifacts.tapes import is_int_list, is_number, is_number_list

    class Int(int):
        pass

    cases = [[], [1, 2, 3], [1, True], [False], [1, 2.0], [1.5, -0.25], [-0.5, 2], [Int(3), 4],
             [0.1, math.nan], [math.inf], [-math.inf, math.inf], [1e308, 1e308], [-1e308, -1e308, 1.0],
             [10 ** 400], [1, 10 ** 400], [0.5, "0.5"], [None], [[1]], "12", None, (1, 2)]
    for x in cases:
        is_list = isinstance(x, list)
        assert is_int_list(x) == (is_list and all(isinstance(v, int) and not isinstance(v, bool) for v in x)), x
        assert is_number_list(x) == (is_list and all(is_number(v) for v in x)), x
    # finite elements whose sum overflows are finite all the same
    assert is_number_list([1e308, 1e308]) and not is_number_list([1e308, math.inf])


def test_tapes_and_samples_held_in_memory_are_what_the_files_hold(tmp_path, tiny_model_dir, gsm8k_dir):
    """The loop's in-process engine hands the tapes the sample phase wrote to the filter, and the
    filter's samples to the finetune and record phases, instead of parsing the files again. What
    it holds must be what the files hold, types included (a tuple is not a list), and the filter
    must write the same samples from them as from the file."""
    from gsm8kctl.artifacts.jsonl import read_jsonl
    from gsm8kctl.stages.sample import sample

    cfg = load_config(None, [f"model={tiny_model_dir}", "backend=transformers", f"data_dir={gsm8k_dir}",
                             "attempts=3", "sampling.max_tokens=8", "filter.ref_model=null"])
    tapes_path = tmp_path / "tapes.jsonl"
    written: list[dict] = []
    sample(cfg, out=str(tapes_path), n_problems=4, iteration=2, quiet=True, written=written)
    on_disk = list(read_jsonl(tapes_path))
    assert len(on_disk) == 12 and written == on_disk
    assert all(type(a) is type(b) for t, d in zip(written, on_disk) for a, b in zip(t.values(), d.values()))

    # A random-init model earns nothing: give two groups a reward, so that their samples are kept.
    for k, t in enumerate(written):
        t["reward"] = 1.0 if k in (0, 1, 6) else 0.0
    rewarded = tmp_path / "rewarded.jsonl"
    rewarded.write_text("".join(json.dumps(t) + "\n" for t in written))
    from_file, from_memory, kept = tmp_path / "a.jsonl", tmp_path / "b.jsonl", []
    rep_file = flt.run_filter([str(rewarded)], str(from_file), cfg, quiet=True)
    rep_memory = flt.run_filter([str(rewarded)], str(from_memory), cfg, quiet=True, tapes_given=written,
                                samples_written=kept)
    assert rep_memory.kept == rep_file.kept == len(kept) == 6  # two groups of three attempts
    assert from_memory.read_bytes() == from_file.read_bytes()
    assert kept == list(read_jsonl(from_file))
    # A tape held in memory is checked as a read one is, and named by its file and line.
    written[4]["completion_token_ids"] = (1, 2)
    with pytest.raises(UserError, match=rf"{rewarded}:5: completion_token_ids must be a list of token ids"):
        flt.run_filter([str(rewarded)], str(tmp_path / "c.jsonl"), cfg, quiet=True, tapes_given=written)


def test_samples_held_in_memory_are_checked_as_read_ones(tmp_path):
    """finetune's check of the samples the loop's filter phase held: the same records as from the
    file, and a bad one named by the file and line it stands for."""
    from gsm8kctl.artifacts.samples import read_samples

    samples = [{"id": f"s{i}", "input_ids": [1, 2, 3, 4 + i], "prompt_len": 2, "reward": 1.0, "advantage": 0.5,
                "weight": 0.5, "old_logprobs": [-0.1, -0.2], "ref_logprobs": None} for i in range(3)]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    assert read_samples([path], vocab_size=100, given=samples) == read_samples([path], vocab_size=100)
    samples[1]["input_ids"] = [1, 2, 3, 400]
    with pytest.raises(UserError, match=rf"{path}:2: .*vocab"):
        read_samples([path], vocab_size=100, given=samples)
