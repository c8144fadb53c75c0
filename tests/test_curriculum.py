"""The curriculum: which problems an iteration samples, and the pass-rate table behind it."""

import json

from gsm8kctl.loop.curriculum import choose_problems, next_problems, read_pass_rates, record_pass_rates


def _tapes(outcomes: dict[str, list[bool]]) -> list[dict]:
    return [{"problem_id": pid, "correct": ok} for pid, oks in outcomes.items() for ok in oks]


def test_pass_rate_table_is_rewritten_and_a_redone_iteration_counts_once(tmp_path):
    path = tmp_path / "pass_rates.jsonl"
    record_pass_rates(path, 0, _tapes({"train-00001": [True, False], "train-00002": [False, False]}))
    record_pass_rates(path, 3, _tapes({"train-00001": [True, True]}))
    record_pass_rates(path, 3, _tapes({"train-00001": [True, True]}))  # the record phase redone
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["problem_id"] for r in rows] == ["train-00001", "train-00002"]
    one = rows[0]
    assert (one["attempts"], one["successes"], one["pass_rate"]) == (4, 3, 0.75)
    assert (one["last_iteration"], one["last_pass_rate"], one["iterations"]) == (3, 1.0, [[0, 1, 2], [3, 2, 2]])
    assert read_pass_rates(path)["train-00002"]["pass_rate"] == 0.0
    assert read_pass_rates(tmp_path / "none.jsonl") == {}


def test_revisits_come_from_open_problems_and_the_rest_from_the_order(tmp_path):
    path = tmp_path / "pass_rates.jsonl"
    open_ids = [f"train-{i:05d}" for i in range(10)]
    record_pass_rates(path, 0, _tapes({**{p: [True, False] for p in open_ids},
                                       "train-00050": [True, True], "train-00051": [False, False]}))
    table = read_pass_rates(path)
    ids, cursor, n = choose_problems(0, 8, 100, seed=7, iteration=1, table=table, revisit_share=0.5)
    assert n == 4 and set(ids[:4]) <= set(open_ids) and len(set(ids)) == 8
    fresh, after = next_problems(0, 4, 100, seed=7, exclude=frozenset(ids[:4]))
    assert ids[4:] == fresh and cursor == after
    # the same inputs draw the same problems (a resumed run); another iteration another draw
    assert choose_problems(0, 8, 100, seed=7, iteration=1, table=table, revisit_share=0.5)[0] == ids
    assert choose_problems(0, 8, 100, seed=7, iteration=2, table=table, revisit_share=0.5)[0][:4] != ids[:4]
    # never more revisits than open problems; share 0 is the plain order
    assert choose_problems(0, 40, 100, seed=7, iteration=1, table=table, revisit_share=1.0)[2] == 10
    assert choose_problems(0, 8, 100, seed=7, iteration=1, table=table, revisit_share=0.0)[:2] == \
        next_problems(0, 8, 100, seed=7)
    # only iterations before this one count
    assert choose_problems(0, 8, 100, seed=7, iteration=0, table=table, revisit_share=0.5)[2] == 0


def test_a_held_table_writes_what_a_read_one_does(tmp_path):
    """The loop keeps the table between iterations instead of reading the file again: the file it
    writes is the same byte for byte, a redone iteration included."""
    read_each_time, held = tmp_path / "read.jsonl", tmp_path / "held.jsonl"
    table = None
    for it, outcomes in ((0, {"train-00001": [True, False], "train-00002": [False, False]}),
                         (1, {"train-00002": [True, True], "train-00003": [False, True]}),
                         (1, {"train-00002": [True, True], "train-00003": [False, True]})):
        record_pass_rates(read_each_time, it, _tapes(outcomes))
        table = record_pass_rates(held, it, _tapes(outcomes), table)
        assert held.read_bytes() == read_each_time.read_bytes()
    assert table == read_pass_rates(held)
