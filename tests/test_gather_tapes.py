"""gather-tapes on hand-written files of every layout it reads (no network, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gsm8kctl.artifacts.jsonl import read_jsonl
from gsm8kctl.artifacts.tapes import TAPE_KEYS, outcome
from gsm8kctl.errors import UserError
from gsm8kctl.stages.gather_tapes import gather_tapes
from gsm8kctl.stages.stats import tape_stats

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def our_tape(tid: str, *, correct: bool = True, iteration: int = 1, split: str = "train",
             attempt: int = 0, finish_reason: str = "stop") -> dict:
    """A tape as `gsm8kctl.artifacts.tapes.make_tape` writes it (hand-written, no grader involved)."""
    answer = "72" if correct else "70"
    completion = f"In May she sold 48/2 = 24 clips.\nAltogether 48 + 24 = {answer}.\n\\boxed{{{answer}}}"
    return {
        "id": tid, "iteration": iteration, "split": split, "problem_id": "train-00000",
        "attempt": attempt, "model": "smollm2-135m", "question": QUESTION, "gold": "72",
        "steps": [{"kind": "question", "text": QUESTION},
                  {"kind": "reasoning", "text": completion, "llm_call_id": f"call-{tid}"},
                  {"kind": "answer", "text": answer}],
        "answer": {"strict": answer, "lenient": answer, "format": True, "correct_strict": correct,
                   "correct_lenient": correct, "reason": f"\\boxed{{{answer}}} vs gold 72"},
        "correct": correct, "reward": 1.0 if correct else 0.0, "finish_reason": finish_reason,
        "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5, 6, 7],
        "logprobs": [-0.1, -0.2, -0.3, -0.4], "n_messages": 2, "created": 1700000000.5,
    }


def ta_step(kind: str, prompt_id: str = "", other: dict | None = None, **fields) -> dict:
    return {"metadata": {"id": f"step-{kind}-{prompt_id}", "prompt_id": prompt_id, "node": "cot",
                         "agent": "COTMathAgent", "other": other or {}},
            "kind": kind, **fields}


def ta_task(question: str = QUESTION, value: float = 72) -> dict:
    # rl_gsm8k: Task(task=question, metadata=StepMetadata(other=extract_result_value(problem)))
    return ta_step("task", other={"question": question, "answer": f"...\n#### {int(value)}",
                                  "value": value}, task=question, template="{task}")


def ta_tape(tid: str, steps: list[dict], *, parent: str = "parent-1", result=None) -> dict:
    return {"metadata": {"id": tid, "parent_id": parent, "author": "COTMathAgent",
                         "author_tape_id": None, "n_added_steps": 1, "error": None,
                         "result": {} if result is None else result},
            "context": None, "steps": steps}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def by_id(path: Path) -> dict[str, dict]:
    return {t["id"]: t for t in read_jsonl(path)}


# ---------------------------------------------------------------------------------------------


def test_our_jsonl_files_deduplicated_across_sources(tmp_path, capsys):
    run = tmp_path / "runs" / "r1"
    write(run / "iterations" / "0001" / "tapes.jsonl", jsonl([our_tape("a"), our_tape("b", correct=False)]))
    write(run / "iterations" / "0002" / "tapes.jsonl", jsonl([our_tape("c", iteration=2)]))
    older = write(tmp_path / "gathered.jsonl", jsonl([our_tape("a"), our_tape("d")]))
    out = tmp_path / "all.jsonl"

    result = gather_tapes([str(run), str(older)], str(out))

    tapes = by_id(out)
    assert list(tapes) == ["a", "b", "c", "d"]
    assert result["written"] == 4 and result["duplicates"] == 1
    run_src, older_src = result["sources"]
    assert (run_src["files"], run_src["tapes"], run_src["written"], run_src["duplicates"]) == (2, 3, 3, 0)
    assert (older_src["tapes"], older_src["written"], older_src["duplicates"]) == (2, 1, 1)
    assert older_src["layouts"] == {"gsm8kctl": 2}
    # Our tapes go through unchanged (same keys, same values).
    assert tapes["b"] == our_tape("b", correct=False)
    err = capsys.readouterr().err
    assert "wrote 4 tapes" in err and "1 duplicates dropped" in err


def test_json_list_of_an_older_layout_gets_every_key(tmp_path):
    old = our_tape("old-1")
    for key in ("split", "logprobs", "created", "question", "reward"):
        old.pop(key)
    old["iteration"] = None
    src = write(tmp_path / "eval" / "0004" / "tapes.json", json.dumps([old], indent=2))
    out = tmp_path / "out.jsonl"

    gather_tapes([str(src)], str(out), quiet=True)

    (tape,) = read_jsonl(out)
    assert set(TAPE_KEYS) <= set(tape)
    assert tape["question"] == QUESTION  # recovered from the question step
    assert (tape["iteration"], tape["split"]) == (4, "test")  # from eval/0004/
    assert tape["reward"] == 1.0 and tape["correct"] is True
    assert tape["logprobs"] is None and tape["n_messages"] == 2  # extra keys kept


def test_tapeagents_rl_gsm8k_layout(tmp_path):
    right = "48/2 = 24 in May. 48 + 24 = 72.\nThe answer is: 72"
    tapes = [
        ta_tape("ta-right", [ta_task(), ta_step("reasoning_thought_with_value", "p1", reasoning=right, value=72.0)]),
        ta_tape("ta-wrong", [ta_task(), ta_step("reasoning_thought_with_value", "p2", reasoning="The answer is: 70", value=70.0)]),
        ta_tape("ta-fail", [ta_task(), ta_step("llm_output_parsing_failure_action", "p3",
                                               error="Failed to parse agent output", llm_output="no idea")]),
    ]
    src = write(tmp_path / "exp" / "tapes" / "train" / "3" / "tapes.json", json.dumps(tapes, indent=4))
    out = tmp_path / "out.jsonl"

    result = gather_tapes([str(tmp_path / "exp")], str(out), quiet=True)

    assert result["sources"][0]["layouts"] == {"tapeagents": 3}
    got = by_id(out)
    r, w, f = got["ta-right"], got["ta-wrong"], got["ta-fail"]
    for t in (r, w, f):
        assert set(TAPE_KEYS) <= set(t)
        assert (t["iteration"], t["split"], t["question"], t["gold"]) == (3, "train", QUESTION, "72")
        assert t["source"]["format"] == "tapeagents"
    assert [t["attempt"] for t in (r, w, f)] == [0, 1, 2]
    assert r["problem_id"] == w["problem_id"] == f["problem_id"]
    assert (r["reward"], r["correct"], outcome(r)) == (1.0, True, "correct")
    assert r["steps"] == [{"kind": "question", "text": QUESTION},
                          {"kind": "reasoning", "text": right, "llm_call_id": "p1"}]
    assert r["answer"]["lenient"] == "72" and "72" in r["answer"]["reason"]
    assert (w["reward"], w["correct"], outcome(w)) == (0.0, False, "wrong")
    assert (f["reward"], outcome(f)) == (-1.0, "unparsable")
    # The parse failure is not a step kind we map: kept verbatim.
    assert f["steps"][1]["kind"] == "llm_output_parsing_failure_action"
    assert f["steps"][1]["llm_output"] == "no idea"
    assert src.exists()


def test_tapeagents_result_metadata_and_unknown_steps(tmp_path):
    # examples/gsm8k_tuning: calculator steps, an answer action, metadata.result.solved.
    steps = [
        ta_task(value=72),
        ta_step("reasoning_thought", "p1", reasoning="April 48, May half of that."),
        ta_step("use_calculator_action", "p1", expression="48 + 48/2"),
        ta_step("calculation_result_observation", result="72.0"),
        ta_step("answer_action", "p2", text="Natalia sold 72 clips.", value=72),
    ]
    solved = ta_tape("ta-solved", steps, result={"question": QUESTION, "value": 72, "solved": True})
    # A recorded reward wins over our own comparison (here: answer right, reward says 0.5).
    scored = ta_tape("ta-scored", [ta_task(value=72), ta_step("final_answer_action", "p9", text="72", value=72)],
                     result={"reward": 0.5})
    src = write(tmp_path / "tapes.json", json.dumps([solved, scored]))
    out = tmp_path / "out.jsonl"

    gather_tapes([str(src)], str(out), quiet=True)

    got = by_id(out)
    t = got["ta-solved"]
    assert [s["kind"] for s in t["steps"]] == ["question", "reasoning", "use_calculator_action",
                                              "calculation_result_observation", "answer"]
    assert t["steps"][2] == steps[2]  # verbatim
    assert t["steps"][4] == {"kind": "answer", "text": "72"}
    assert t["correct"] is True and t["reward"] == 1.0
    assert (t["iteration"], t["split"]) == (0, "unknown")  # nothing in the path says
    assert t["model"] == "COTMathAgent"
    assert got["ta-scored"]["reward"] == 0.5 and got["ta-scored"]["correct"] is True


def test_tapeagents_jsonl_and_yaml(tmp_path):
    import yaml

    a = ta_tape("y1", [ta_task(), ta_step("reasoning_thought_with_value", "p", reasoning="The answer is: 72", value=72)])
    b = ta_tape("y2", [ta_task(), ta_step("reasoning_thought_with_value", "p", reasoning="The answer is: 1", value=1)])
    write(tmp_path / "src" / "a.jsonl", jsonl([a]))
    write(tmp_path / "src" / "b.yaml", yaml.safe_dump_all([b]))
    out = tmp_path / "out.jsonl"

    result = gather_tapes([str(tmp_path / "src")], str(out), quiet=True)

    assert result["written"] == 2
    assert {t["id"]: t["reward"] for t in read_jsonl(out)} == {"y1": 1.0, "y2": 0.0}


def test_unreadable_files_are_skipped_with_a_warning_naming_them(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "good.jsonl", jsonl([our_tape("g1")]))
    write(src / "broken.json", "{ this is not json")
    (src / "latin1.jsonl").write_bytes('{"id": "caf\xe9"}\n'.encode("latin-1"))
    out = tmp_path / "out.jsonl"

    result = gather_tapes([str(src)], str(out))

    assert [t["id"] for t in read_jsonl(out)] == ["g1"]
    skipped = {Path(s["path"]).name: s["reason"] for s in result["skipped"]}
    assert set(skipped) == {"broken.json", "latin1.jsonl"}
    assert "not JSON" in skipped["broken.json"] and "UTF-8" in skipped["latin1.jsonl"]
    assert result["sources"][0]["skipped"] == 2
    err = capsys.readouterr().err
    assert "broken.json" in err and "latin1.jsonl" in err and "warning" in err


def test_a_truncated_last_line_loses_only_that_line(tmp_path, capsys):
    text = jsonl([our_tape("t1"), our_tape("t2")]) + json.dumps(our_tape("t3"))[:50]
    src = write(tmp_path / "tapes.jsonl", text)
    out = tmp_path / "out.jsonl"

    gather_tapes([str(src)], str(out))

    assert [t["id"] for t in read_jsonl(out)] == ["t1", "t2"]
    assert "skipped 1 invalid line(s), first at line 3" in capsys.readouterr().err


def test_run_directory_files_without_tapes_are_ignored_quietly(tmp_path, capsys):
    run = tmp_path / "run"
    write(run / "iterations" / "0000" / "tapes.jsonl", jsonl([our_tape("x")]))
    write(run / "iterations" / "0000" / "samples.jsonl",
          jsonl([{"tape_id": "x", "input_ids": [1, 2], "labels": [1, 2], "reward": 1.0}]))
    write(run / "iterations" / "0000" / "stats.json", json.dumps({"count": 1}))
    write(run / "metrics.jsonl", jsonl([{"iteration": 0, "test_accuracy": 0.1}]))
    write(run / "config.yaml", "model: smollm2-135m\nattempts: 8\n")
    write(run / "iterations" / "0000" / ".tapes.jsonl.abc.tmp", "half a li")  # atomic writer's temp
    out = tmp_path / "out.jsonl"

    result = gather_tapes([str(run)], str(out))

    assert result["written"] == 1 and result["skipped"] == []
    assert result["sources"][0]["files"] == 5 and result["sources"][0]["ignored"] == 4
    assert "warning" not in capsys.readouterr().err


def test_output_inside_a_source_or_on_a_source_is_refused(tmp_path):
    # An output inside a source directory could replace a tapes file found there.
    src = tmp_path / "src"
    write(src / "tapes.jsonl", jsonl([our_tape("a"), our_tape("b")]))
    before = (src / "tapes.jsonl").read_bytes()

    with pytest.raises(UserError, match="inside the source directory"):
        gather_tapes([str(src)], str(src / "all.jsonl"), quiet=True)
    with pytest.raises(UserError, match="is the input file"):
        gather_tapes([str(src / "tapes.jsonl")], str(src / "tapes.jsonl"), quiet=True)

    assert sorted(p.name for p in src.iterdir()) == ["tapes.jsonl"]
    assert (src / "tapes.jsonl").read_bytes() == before
    out = tmp_path / "all.jsonl"
    assert gather_tapes([str(src)], str(out), quiet=True)["written"] == 2
    assert [t["id"] for t in read_jsonl(out)] == ["a", "b"]


def test_nothing_readable_is_a_user_error_and_writes_nothing(tmp_path):
    write(tmp_path / "src" / "bad.json", "[1, 2")
    write(tmp_path / "src" / "stats.json", "{}")
    out = tmp_path / "out.jsonl"
    with pytest.raises(UserError, match=r"no tapes found .*1 unreadable file\(s\) skipped, 1 file\(s\) without tapes"):
        gather_tapes([str(tmp_path / "src")], str(out), quiet=True)
    assert not out.exists()
    with pytest.raises(UserError, match="no tapes found"):
        gather_tapes([str(tmp_path / "src" / "stats.json")], str(out), quiet=True)


def test_missing_source_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="nope.jsonl: no such file or directory"):
        gather_tapes([str(tmp_path / "nope.jsonl")], str(tmp_path / "out.jsonl"))
    with pytest.raises(UserError, match="at least one"):
        gather_tapes([], str(tmp_path / "out.jsonl"))


def test_stdout_is_data_and_stderr_is_talk(tmp_path, capsys):
    src = write(tmp_path / "tapes.jsonl", jsonl([our_tape("a"), our_tape("b", correct=False)]))

    gather_tapes([str(src)], "-")

    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["a", "b"]
    assert "gather-tapes" in captured.err and "wrote 2 tapes" in captured.err


def test_stdin_source(tmp_path, monkeypatch, capsys):
    import io
    import sys

    data = json.dumps([ta_tape("s1", [ta_task(), ta_step("reasoning_thought_with_value", "p", reasoning="72", value=72)])])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data.encode())))
    out = tmp_path / "out.jsonl"

    gather_tapes(["-"], str(out), quiet=True)

    assert [t["id"] for t in read_jsonl(out)] == ["s1"]


def test_gathered_file_feeds_stats(tmp_path):
    write(tmp_path / "a" / "tapes.jsonl", jsonl([our_tape("a0"), our_tape("a1", correct=False, attempt=1),
                                                 our_tape("a2", finish_reason="length", correct=False, attempt=2)]))
    ta = [ta_tape("t0", [ta_task(), ta_step("reasoning_thought_with_value", "p", reasoning="x", value=72)])]
    write(tmp_path / "b" / "tapes.json", json.dumps(ta))
    out = tmp_path / "out.jsonl"

    gather_tapes([str(tmp_path / "a"), str(tmp_path / "b")], str(out), quiet=True)

    stats = tape_stats(read_jsonl(out))
    assert stats["count"] == 4
    assert stats["outcomes"] == {"correct": 2, "overflow": 1, "wrong": 1}


def test_tapeagents_text_is_graded_by_our_extractors(tmp_path):
    # strict/format/lenient come from agent.grade on the completion text.
    def task(value) -> dict:
        return ta_step("task", other={"question": QUESTION, "value": value}, task=QUESTION)

    def thought(text: str, value=None) -> dict:
        return ta_step("reasoning_thought_with_value", "p", reasoning=text, value=value)

    tapes = [
        ta_tape("boxed", [task(7), thought("3 + 4 = 7, so \\boxed{7}.", 7)]),
        ta_tape("gold-list", [task([7]), thought("3 + 4 = 7, so \\boxed{7}.", 7)]),
        ta_tape("wrong-box", [task(7), thought("3 + 5 = 8, so \\boxed{8}.", 8)]),
        ta_tape("no-number", [task(72), thought("I added them.", 72)]),
        ta_tape("gold-pair", [task([7, 8]), thought("\\boxed{7}", 7)]),
        ta_tape("answer-text", [ta_task(value=72),
                                ta_step("reasoning_thought", "p1", reasoning="Half of 48."),
                                ta_step("answer_action", "p2", text="Natalia sold 72 clips.", value=72)]),
    ]
    src = write(tmp_path / "tapes.json", json.dumps(tapes))
    out = tmp_path / "out.jsonl"

    gather_tapes([str(src)], str(out), quiet=True)

    got = {tid: (t["gold"], t["answer"]["strict"], t["answer"]["format"], t["answer"]["correct_strict"],
                 t["answer"]["lenient"], t["answer"]["correct_lenient"], t["correct"])
           for tid, t in by_id(out).items()}
    assert got == {
        "boxed": ("7", "7", True, True, "7", True, True),
        "gold-list": ("7", "7", True, True, "7", True, True),  # [7] is the gold 7, not dropped
        "wrong-box": ("7", "8", True, False, "8", False, False),
        # No number in the text: the agent's own value is the lenient answer.
        "no-number": ("72", None, False, False, "72", True, True),
        "gold-pair": (None, "7", True, False, "7", False, False),  # two golds: none
        "answer-text": ("72", None, False, False, "72", True, True),
    }


def test_stats_count_a_cut_completion_as_not_correct(tmp_path):
    # A right box cut at max tokens has reward -1, so accuracy must not count it;
    # answer.correct_strict still says the box was right. "old-cut" was written before the fix.
    cut = our_tape("cut", attempt=1)
    cut.update(finish_reason="length", reward=-1.0, correct=False)
    old_cut = our_tape("old-cut", attempt=2)
    old_cut.update(finish_reason="length", reward=-1.0)
    wrong = our_tape("wrong", correct=False, attempt=3)
    write(tmp_path / "tapes.jsonl", jsonl([our_tape("right"), cut, old_cut, wrong]))
    out = tmp_path / "out.jsonl"

    gather_tapes([str(tmp_path / "tapes.jsonl")], str(out), quiet=True)

    stats = tape_stats(read_jsonl(out))
    assert (stats["accuracy_strict"], stats["accuracy_lenient"]) == (0.25, 0.25)
    assert stats["pass_at_k"]["1"] == 0.25
    assert stats["mean_reward"] == round((1.0 - 1.0 - 1.0 + 0.0) / 4, 4)
    assert stats["outcomes"] == {"correct": 1, "overflow": 2, "wrong": 1}
    assert by_id(out)["cut"]["answer"]["correct_strict"] is True


def test_stats_count_each_tape_id_once(tmp_path):
    """A tapes file concatenated twice (cat a b > c): stats counts what filter and gather-tapes keep."""
    from gsm8kctl.stages.stats import file_stats

    lines = jsonl([our_tape("a0"), our_tape("a1", correct=False, attempt=1)])
    write(tmp_path / "twice.jsonl", lines + lines + jsonl([our_tape("a0", correct=False)]))
    stats = file_stats(read_jsonl(tmp_path / "twice.jsonl"))
    assert (stats["count"], stats["duplicate_ids"], stats["accuracy_strict"]) == (2, 3, 0.5)
