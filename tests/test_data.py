import pytest

from gsm8kctl.artifacts.data import load_problems, select_problems
from gsm8kctl.errors import UserError


def test_splits_and_stable_ids():
    train, test = load_problems("train"), load_problems("test")
    assert len(train) == 7473 and len(test) == 1319
    assert train[42]["id"] == "train-00042" and test[7]["id"] == "test-00007"
    assert train[0]["gold"] == "72"  # Natalia's clips
    assert all(p["gold"] for p in test)


def test_select_by_ids_and_count():
    test = load_problems("test")
    assert [p["id"] for p in select_problems(test, problem_ids=["test-00003", "test-00001"])] == \
        ["test-00003", "test-00001"]
    assert len(select_problems(test, n_problems=5)) == 5
    with pytest.raises(UserError, match="unknown problem id"):
        select_problems(test, problem_ids=["test-99999"])
    with pytest.raises(UserError, match="positive"):
        select_problems(test, n_problems=0)


def test_bad_data_file_names_line(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{broken\n')
    with pytest.raises(UserError, match=r"train.jsonl:2: invalid JSON"):
        load_problems("train", str(tmp_path))
    with pytest.raises(UserError, match="test.jsonl: no such file"):
        load_problems("test", str(tmp_path))
