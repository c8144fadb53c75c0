"""The slot engine (continuous batching) on the CPU with the tiny model, float32.

Its scheduling — slot refill, prefill budget, finish handling, windows, compaction — must not
change a single token: every run is compared with the dynamic-cache path on the same weights
and seeds. CUDA graphs and flash attention are measured on the GPU (docs/benchmarks.md).
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from gsm8kctl.config import load_config
from gsm8kctl.errors import UserError
from gsm8kctl.sampling.backends.base import SamplingParams, completion_seeds
from gsm8kctl.sampling.backends.sampling import choose, uniforms
from gsm8kctl.sampling.backends.slots import Request, SlotEngine, buckets_for, plan_slots, slots_for_longer
from gsm8kctl.sampling.backends.transformers import TransformersBackend


def _backend(model: str, *overrides: str) -> TransformersBackend:
    return TransformersBackend(model, load_config(None, list(overrides)), dtype="float32")


@pytest.fixture(scope="module")
def dynamic(tiny_model_dir):
    return _backend(tiny_model_dir, "transformers.static_cache=false", "sampling.batch_size=3")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(1000, 20000) for _ in range(rng.randrange(3, 40))] for _ in range(7)]


def _tokens(out):
    return [[c.token_ids for c in row] for row in out]


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 1.0)])
def test_engine_equals_dynamic_path(tiny_model_dir, dynamic, prompts, temperature, top_p):
    """4 slots for 14 completions: rows are refilled as they finish."""
    engine = _backend(tiny_model_dir, "transformers.static_cache=true", "sampling.max_slots=4")
    params = SamplingParams(n=2, temperature=temperature, top_p=top_p, max_tokens=24, seed=5)
    ref, got = dynamic.generate(prompts, params), engine.generate(prompts, params)
    assert _tokens(got) == _tokens(ref)
    for r_row, g_row in zip(ref, got):
        for r, g in zip(r_row, g_row):
            assert g.finish_reason == r.finish_reason == "length" and len(g.token_ids) == 24
            assert max(abs(a - b) for a, b in zip(r.logprobs, g.logprobs)) < 1e-4
    st = engine._engine.stats
    assert st["slot_steps_busy"] == sum(len(c.token_ids) - 1 for row in got for c in row)  # first from prefill


def test_attempts_of_one_prompt_share_one_prefill(tiny_model_dir, dynamic, prompts):
    """3 prompts x 4 attempts admitted at once: 3 prompts are prefilled, not 12, in both paths,
    and every attempt is what that row gives alone (its own prefill, its own seed)."""
    engine = _backend(tiny_model_dir, "transformers.static_cache=true", "sampling.max_slots=12")
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=9)
    some = prompts[:3]
    ref, got = dynamic.generate(some, params), engine.generate(some, params)
    assert _tokens(got) == _tokens(ref)
    seeds = completion_seeds(params, 12)
    alone = [dynamic.generate([some[k // 4]], SamplingParams(n=1, temperature=1.0, max_tokens=16,
                                                             seeds=[seeds[k]]))[0][0] for k in range(12)]
    assert [c.token_ids for c in alone] == [c.token_ids for row in got for c in row]
    assert len({tuple(c.token_ids) for row in got for c in row}) == 12  # the attempts differ
    for r_row, g_row in zip(ref, got):
        for r, g in zip(r_row, g_row):
            assert max(abs(a - b) for a, b in zip(r.logprobs, g.logprobs)) < 1e-4
    assert engine._engine.stats["prefill_tokens"] == 3 * max(len(p) for p in some)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_tokens_budget_window_and_compaction(tiny_model_dir, dynamic, prompts, overlap):
    """Stop on frequent tokens so rows end at different steps; a tiny prefill budget admits one
    prompt at a time; a window of 3 decodes junk past a stop that must be dropped. With
    `overlap` (CUDA's default) each window is launched before the last one's tokens are read,
    so finished rows run a window more and refill later: the tokens must not change."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=11)
    ref = dynamic.generate(prompts, params)
    # Two tokens the model picks often become stop tokens: completions end at varied lengths.
    counts: dict[int, int] = {}
    for row in ref:
        for c in row:
            for t in c.token_ids[2:]:
                counts[t] = counts.get(t, 0) + 1
    stops = sorted(counts, key=counts.get)[-2:]
    saved = dynamic.stop_ids
    dynamic.stop_ids = stops
    try:
        ref = dynamic.generate(prompts, params)
    finally:
        dynamic.stop_ids = saved
    assert {c.finish_reason for row in ref for c in row} == {"stop", "length"}
    engine = SlotEngine(dynamic.model_obj, slots=5, max_len=64, stop_ids=stops, pad_id=dynamic.pad_id,
                        prefill_token_budget=16, window=3, overlap=overlap)
    rows = [p for p in prompts for _ in range(2)]
    seeds = completion_seeds(params, len(rows))
    done = {f.index: f for f in engine.run([Request(k, rows[k], seeds[k]) for k in range(len(rows))],
                                           temperature=1.0, top_p=1.0, max_tokens=20)}
    assert sorted(done) == list(range(len(rows)))
    for k, f in done.items():
        r = ref[k // 2][k % 2]
        assert (f.token_ids, f.finish_reason) == (r.token_ids, r.finish_reason)
        if f.finish_reason == "stop":
            assert f.token_ids[-1] in stops and not set(f.token_ids[:-1]) & set(stops)
    assert engine.stats["slot_steps_run"] > engine.stats["slot_steps_busy"]  # junk steps happened
    if overlap:  # rows refilled a window late: more windows ran for the same tokens
        serial = SlotEngine(dynamic.model_obj, slots=5, max_len=64, stop_ids=stops, pad_id=dynamic.pad_id,
                            prefill_token_budget=16, window=3, overlap=False)
        list(serial.run([Request(k, rows[k], seeds[k]) for k in range(len(rows))],
                        temperature=1.0, top_p=1.0, max_tokens=20))
        assert engine.stats["slot_steps_busy"] == serial.stats["slot_steps_busy"]
        assert engine.stats["decode_steps"] > serial.stats["decode_steps"]


@pytest.mark.parametrize("overlap", [False, True])
def test_completions_that_end_at_their_first_token(dynamic, prompts, overlap):
    """The prefill chooses a row's first token and the host reads it only with the next window:
    one-token completions (max_tokens 1) and a stop chosen first must still end right there."""
    engine = SlotEngine(dynamic.model_obj, slots=3, max_len=64, stop_ids=[0], pad_id=dynamic.pad_id,
                        window=2, overlap=overlap)
    seeds = completion_seeds(SamplingParams(n=1, seed=7), len(prompts))

    def run(max_tokens, stops=None):
        if stops is not None:
            engine.stop = torch.tensor(stops)
        reqs = [Request(k, prompts[k], seeds[k]) for k in range(len(prompts))]
        return {f.index: f for f in engine.run(reqs, temperature=1.0, top_p=1.0, max_tokens=max_tokens)}

    one = run(1)
    assert {k: (f.token_ids, f.finish_reason) for k, f in one.items()} == \
        {k: ([f.token_ids[0]], "length") for k, f in run(6).items()}
    firsts = sorted({f.token_ids[0] for f in one.values()})[:2]  # some rows choose these first
    ended = run(6, stops=firsts)
    for k, f in ended.items():
        if one[k].token_ids[0] in firsts:
            assert (f.token_ids, f.finish_reason) == (one[k].token_ids, "stop")
        else:
            assert len(f.token_ids) > 1
    assert sum(f.finish_reason == "stop" and len(f.token_ids) == 1 for f in ended.values()) >= 2


def test_same_seed_same_tokens_in_any_batch(tiny_model_dir, prompts):
    """A completion depends on its seed only, not on what shares the batch or its slot."""
    engine = _backend(tiny_model_dir, "transformers.static_cache=true", "sampling.max_slots=3")
    params = SamplingParams(n=1, temperature=1.0, max_tokens=12, seeds=[101, 202, 303, 404, 505, 606, 707])
    full = _tokens(engine.generate(prompts, params))
    alone = _tokens(engine.generate(prompts[4:5], SamplingParams(n=1, temperature=1.0, max_tokens=12,
                                                                  seeds=[505])))
    assert alone[0] == full[4]
    other = _tokens(engine.generate(prompts[4:5], SamplingParams(n=1, temperature=1.0, max_tokens=12,
                                                                  seeds=[506])))
    assert other[0] != full[4]


def test_prompt_longer_than_context_is_one_clear_error(tiny_model_dir):
    engine = _backend(tiny_model_dir, "transformers.static_cache=true", "sampling.max_slots=2")
    with pytest.raises(UserError, match="exceeds the model's context of 2048 tokens"):
        engine.generate([[5] * 2000], SamplingParams(max_tokens=100))


def test_slot_plan_sizes_and_refuses():
    class Cfg:
        num_attention_heads, num_key_value_heads, hidden_size, num_hidden_layers, vocab_size = 9, 3, 576, 30, 49152

    per_token = 30 * 2 * 3 * 64 * 2  # layers x (k, v) x kv heads x head dim x bf16 bytes
    per_slot = 1024 * per_token + 49152 * 24
    gib = 1024 ** 3
    assert plan_slots(Cfg, torch.bfloat16, 1024, max_slots=None, fraction=0.5, free_bytes=40 * gib) == \
        int(20 * gib // per_slot) // 16 * 16
    assert plan_slots(Cfg, torch.bfloat16, 1024, max_slots=512, fraction=0.5, free_bytes=40 * gib) == 512
    with pytest.raises(UserError, match=r"sampling.max_slots=100000 needs .* GiB .* only 40.0 GiB is free"):
        plan_slots(Cfg, torch.bfloat16, 1024, max_slots=100000, fraction=0.5, free_bytes=40 * gib)
    with pytest.raises(UserError, match="holds no 1024-token slot"):
        plan_slots(Cfg, torch.bfloat16, 1024, max_slots=None, fraction=0.01, free_bytes=1 << 20)
    assert buckets_for(2048)[:4] == [16, 32, 64, 128] and buckets_for(2048)[-1] == 2048
    assert buckets_for(40) == [16, 32, 40]


def test_a_pool_remade_for_longer_prompts_frees_the_old_one_first_and_keeps_its_bytes(tiny_model_dir):
    """A prompt longer than the slots hold remakes the pool. The old pool must be gone when the
    new one is planned: planned beside it, a loop's pool on an H100 fell from 432 to 208 slots for
    the rest of its run. And the new pool keeps at least the old one's bytes in longer slots."""
    alive_at_plan = []

    class Probe(TransformersBackend):
        def _plan_slots(self, cfg, dtype, max_len):
            alive_at_plan.append([ref() is not None for ref in refs])
            return super()._plan_slots(cfg, dtype, max_len)

    refs: list = []
    backend = Probe(tiny_model_dir, load_config(None, ["transformers.static_cache=true", "sampling.max_slots=8"]),
                    dtype="float32")
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=3)
    short = backend.generate([[5] * 10, [7] * 12], params)
    first = backend.slot_engine
    assert first.max_len == 128 and first.slots == 8 and alive_at_plan == [[]]
    refs = [weakref.ref(first), weakref.ref(first.kv)]
    del first
    backend.generate([[5] * 120], params)
    assert backend.slot_engine.max_len == 256 and backend.slot_engine.slots == 8
    assert alive_at_plan[1] == [False, False]  # neither the engine nor its cache outlived it
    # the remade pool samples what the first did: a completion's tokens come from its own seed
    assert _tokens(backend.generate([[5] * 10, [7] * 12], params)) == _tokens(short)

    assert slots_for_longer(432, 768, 896) == 368  # 370 slots' worth, a multiple of 16
    assert slots_for_longer(8, 128, 256) == 4 and slots_for_longer(1, 128, 1024) == 1


def test_choose_follows_the_distribution():
    """Inverse-CDF picks with uniforms from the seeded stream: frequencies match p, top-p keeps
    only the nucleus, T=0 is argmax, a zero-probability token is never picked."""
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]])).expand(4000, 5).contiguous()
    u = uniforms(7, 4000)
    picks = choose(logp, u, 1.0, 1.0)
    freq = torch.bincount(picks, minlength=5).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]), atol=0.03)
    assert set(choose(logp, u, 1.0, 0.7).tolist()) == {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert set(choose(logp, u, 0.0, 1.0).tolist()) == {0}
    assert 4 not in set(choose(logp, torch.zeros(4000, dtype=torch.float64), 1.0, 1.0).tolist())
    assert torch.equal(uniforms(7, 10), u[:10])  # a stream is a prefix-stable function of its seed


def test_sdpa_backends_leave_cudnn_out_on_cuda_only():
    """Prefill and scoring forwards run SDPA without cuDNN on CUDA (its plan per new shape cost
    seconds per process on the H200), and the flags come back afterwards."""
    from gsm8kctl.sampling.backends import slots

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    with slots.sdpa_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    with slots.sdpa_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before[0]
