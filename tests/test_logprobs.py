"""Batching and padding for log-probs (gsm8kctl/training/logprobs.py), and the transformers backend's
score() cutting each chunk's log-probs back into rows."""

import random

import pytest

from gsm8kctl.training.logprobs import pad_batch, token_budget_batches


def _rows(n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    completions = [[rng.randrange(1, 1000) for _ in range(rng.randint(0, 9))] for _ in range(n)]
    return prompts, completions


def test_pad_batch_lays_out_each_row_then_pads():
    prompts, completions = _rows(40)
    ids, attn, comp = pad_batch(prompts, completions, pad_id=-7)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    assert ids.shape == attn.shape == comp.shape == (40, width)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        assert ids[i].tolist() == p + c + [-7] * (width - n)
        assert attn[i].tolist() == [1] * n + [0] * (width - n)
        assert comp[i].tolist() == [False] * len(p) + [True] * len(c) + [False] * (width - n)
    assert str(ids.dtype) == str(attn.dtype) == "torch.int64" and str(comp.dtype) == "torch.bool"


@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_batches_cover_every_row_once_within_the_budget(packed):
    rng = random.Random(1)
    lengths = [rng.randint(1, 50) for _ in range(200)]
    lengths[17] = 400  # longer than the budget: a group of its own
    groups = token_budget_batches(lengths, 120, max_batch=9, packed=packed)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        cost = sum(lengths[i] for i in g) if packed else len(g) * max(lengths[i] for i in g)
        assert len(g) <= 9 and (cost <= 120 or len(g) == 1)
    assert [17] in groups


def test_transformers_score_cuts_rows_as_one_row_at_a_time(tiny_model_dir):
    from gsm8kctl.config import default_config
    from gsm8kctl.sampling.backends import get_backend

    prompts, completions = _rows(24, seed=3)
    backend = get_backend("transformers", tiny_model_dir, cfg=default_config())
    try:
        together = backend.score(prompts, completions)
        backend.score_token_budget = 1  # one row per forward
        alone = backend.score(prompts, completions)
    finally:
        backend.close()
    assert [len(s) for s in together] == [len(c) for c in completions]
    assert any(not c for c in completions) and all(s == [] for s, c in zip(together, completions) if not c)
    # Batch shapes move bf16 numerics by ~1e-3 here; a token cut into the wrong row or place moves
    # it by ~0.1 (the median gap between neighbouring tokens' log-probs of this random model).
    assert max(abs(x - y) for s, t in zip(together, alone) for x, y in zip(s, t)) < 0.02
    gaps = sorted(abs(s[k] - s[k + 1]) for s in together for k in range(len(s) - 1))
    assert gaps[len(gaps) // 2] > 0.05  # so the tolerance above could tell a misplaced token


def test_transformers_score_shares_each_prompt_among_its_completions(tiny_model_dir):
    """5 prompts x 4 completions (one empty): the shared path (each prompt run once, its cache
    repeated) gives each row's log-probs as the row scored alone, in float32."""
    from gsm8kctl.config import default_config
    from gsm8kctl.sampling.backends import get_backend

    base, _ = _rows(5, seed=4)
    _, completions = _rows(20, seed=5)
    completions[3] = []
    prompts = [base[k // 4] for k in range(20)]
    backend = get_backend("transformers", tiny_model_dir, cfg=default_config(), dtype="float32")
    try:
        shared = backend.score(prompts, completions)
        backend.score_token_budget = 40  # several chunks of groups
        chunked = backend.score(prompts, completions)
        alone = [backend._score_rows([p], [c])[0] for p, c in zip(prompts, completions)]
    finally:
        backend.close()
    assert [len(s) for s in shared] == [len(c) for c in completions] and shared[3] == []
    for got in (shared, chunked):
        assert max(abs(x - y) for s, t in zip(got, alone) for x, y in zip(s, t)) < 1e-4
    gaps = sorted(abs(s[k] - s[k + 1]) for s in alone for k in range(len(s) - 1))
    assert gaps[len(gaps) // 2] > 0.05  # a misplaced token would show
