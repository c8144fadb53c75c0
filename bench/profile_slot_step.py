"""Where a decode step of the slot engine spends its time, on one GPU (random-init weights).

Replays the captured step at a given slot count with slots at GSM8k-like positions and times
it with CUDA events, for each decode attention (the split-K kernel at several tilings, flash
varlen, masked SDPA) and with attention replaced by nothing (what the rest of the model costs);
then the token choice alone, and scoring chunks of several token budgets (whole log-prob pass,
and the decoder alone). First it checks the split-K kernel against flash on random bf16 data,
and times it with each slot's prompt keys read from its own row and from the first row of its
group of --group (the slot engine's shared prompt reads; `split_k shared` does the same in the step).

    python bench/profile_slot_step.py --shape 135m --slots 1024,2048 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import torch
    import transformers
    from transformers import AttentionInterface

    from bench_gpu_sampling import SHAPES
    from gsm8kctl.sampling.backends import slots as slot_mod
    from gsm8kctl.sampling.backends.decode_attention import DecodeAttention
    from gsm8kctl.sampling.backends.sampling import choose
    from gsm8kctl.sampling.backends.slots import SlotEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="135m")
    ap.add_argument("--slots", default="1024,2048")
    ap.add_argument("--max-len", type=int, default=896)
    ap.add_argument("--steps", type=int, default=40)
    # split-K tilings: keys per split x keys per tile, warps, pipeline stages
    ap.add_argument("--tilings", default="256x64w4s2,128x64w4s2,512x64w4s3,256x128w4s2,256x32w2s2,128x32w2s3")
    ap.add_argument("--variants", default="split_k,flash,sdpa,no attention")
    ap.add_argument("--score-budgets", default="16384,65536,262144")
    ap.add_argument("--models", default="hf",
                    help="whose forward the steps run, in turn: hf (transformers' module), native (backends/llama.py, "
                         "eager), fused (backends/llama.py with fused.py's kernels); same random weights")
    ap.add_argument("--group", type=int, default=16,
                    help="attempts per prompt for the shared-prompt rows: the kernel and the `split_k shared` step "
                         "read each group's first --prompt-len keys from its first row (decode_attention.py)")
    ap.add_argument("--prompt-len", type=int, default=108,
                    help="shared prompt keys per row; 108 = the mean GSM8k train prompt under SmolLM2's chat template")
    ap.add_argument("--out", default="profile_slot_step.json")
    a = ap.parse_args()
    if a.group < 1 or not 0 <= a.prompt_len < a.max_len - 128:
        ap.error(f"--group must be >= 1 and --prompt-len in [0, --max-len - 128 = {a.max_len - 128})")
    cls, kw = SHAPES[a.shape]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw), dtype=torch.bfloat16)
    model.eval()

    def timed(fn, n) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    rows = []
    cfg = model.config
    kv_heads, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    dim = cfg.hidden_size // heads
    rep = heads // kv_heads
    tilings = []
    for t in a.tilings.split(","):
        chunk, rest = t.split("x")
        block, rest = rest.split("w")
        warps, stages = rest.split("s")
        tilings.append((t, dict(chunk=int(chunk), block_n=int(block), warps=int(warps), stages=int(stages))))

    # The kernel against flash varlen on one layer's worth of random bf16 cache.
    slots0 = 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn((slots0, a.max_len, kv_heads, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn((slots0, a.max_len, kv_heads, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn((slots0, kv_heads, rep, dim), device="cuda", dtype=torch.bfloat16, generator=gen)
    n = torch.randint(1, a.max_len + 1, (slots0,), device="cuda", generator=gen).to(torch.int32)
    cu = torch.arange(slots0 + 1, dtype=torch.int32, device="cuda")
    qf = q.transpose(1, 2).reshape(slots0 * rep, kv_heads, dim)
    ref = torch.ops.aten._flash_attention_forward(
        qf, k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim), cu * rep, cu * a.max_len, rep, a.max_len,
        0.0, False, False, scale=dim ** -0.5, seqused_k=n)[0].view(slots0, rep, kv_heads, dim).transpose(1, 2)
    for name, tiling in tilings:
        att = DecodeAttention(slots0, a.max_len, kv_heads, rep, dim, torch.bfloat16, "cuda", **tiling)
        out = att(q, k, v, n, dim ** -0.5)
        ms = timed(lambda: att(q, k, v, n, dim ** -0.5), 50)
        read = float(n.sum()) * kv_heads * dim * 2 * 2  # keys and values, bf16
        rows.append({"slots": slots0, "what": f"one layer's decode attention, split_k {name}", "ms": round(ms, 4),
                     "max_abs_diff_vs_flash": round((out.float() - ref.float()).abs().max().item(), 5),
                     "cache_read_tb_per_s": round(read / ms / 1e9, 2)})
        print(rows[-1], file=sys.stderr, flush=True)
    # The same kernel with and without shared prompt reads, at GSM8k-like lengths: a prompt of
    # --prompt-len keys and up to 128 generated, groups of --group rows.
    att = DecodeAttention(slots0, a.max_len, kv_heads, rep, dim, torch.bfloat16, "cuda")
    own = torch.arange(slots0, dtype=torch.int32, device="cuda")
    leader = own - own % a.group
    plen = torch.full((slots0,), a.prompt_len, dtype=torch.int32, device="cuda")
    n_gsm = torch.randint(a.prompt_len + 1, a.prompt_len + 129, (slots0,), device="cuda", generator=gen).to(torch.int32)
    for name, prow in (("own rows", own), (f"prompt read from one row of {a.group}", leader)):
        ms = timed(lambda: att(q, k, v, n_gsm, dim ** -0.5, prow, plen), 50)
        rows.append({"slots": slots0, "what": f"one layer's decode attention, split_k, {name}", "ms": round(ms, 4),
                     "keys_per_row_mean": round(float(n_gsm.float().mean()), 1)})
        print(rows[-1], file=sys.stderr, flush=True)
    ms = timed(lambda: torch.ops.aten._flash_attention_forward(
        qf, k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim), cu * rep, cu * a.max_len, rep, a.max_len,
        0.0, False, False, scale=dim ** -0.5, seqused_k=n), 50)
    rows.append({"slots": slots0, "what": "one layer's decode attention, flash varlen", "ms": round(ms, 4),
                 "cache_read_tb_per_s": round(float(n.sum()) * kv_heads * dim * 4 / ms / 1e9, 2)})
    print(rows[-1], file=sys.stderr, flush=True)
    del k, v, q, ref
    torch.cuda.empty_cache()

    real_attention = slot_mod._slot_attention
    variants = []
    for v in a.variants.split(","):
        variants += [f"split_k {t}" for t, _ in tilings] if v == "split_k" else [v]
        if v == "split_k":
            variants.append("split_k shared")
    hf_model = model
    models = {"hf": hf_model}
    if set(a.models.split(",")) - {"hf"}:
        import tempfile

        from gsm8kctl.sampling.backends import llama

        saved = Path(tempfile.mkdtemp()) / "random"
        hf_model.save_pretrained(saved)
        for name in ("native", "fused"):
            if name in a.models.split(","):
                models[name] = llama.load(saved, device="cuda", dtype=torch.bfloat16, fuse_kernels=name == "fused")
    runs = [(slots, m, variant) for slots in (int(s) for s in a.slots.split(",")) for m in a.models.split(",")
            for variant in variants]
    for i, (slots, model_name, variant) in enumerate(runs):
        model = models[model_name]
        attention = variant.split()[0] if variant != "no attention" else "sdpa"
        engine = SlotEngine(model, slots=slots, max_len=a.max_len, stop_ids=[0], pad_id=0, attention=attention)
        if variant.startswith("split_k") and variant != "split_k shared":
            tiling = dict(tilings)[variant.split()[1]]
            engine.split_k = DecodeAttention(slots, a.max_len, kv_heads, rep, dim, torch.bfloat16, "cuda",
                                             **tiling)
        if variant == "no attention":
            def nothing(module, query, key, value, *args, **kwargs):
                return query.transpose(1, 2).contiguous(), None

            AttentionInterface.register(slot_mod.ATTN_NAME, nothing)
            if model_name != "hf":
                llama.ATTENTION[slot_mod.ATTN_NAME] = nothing
        gen = torch.Generator(device="cuda").manual_seed(1)
        engine.pos.copy_(torch.randint(175, a.max_len - 128, (slots,), device="cuda", generator=gen))
        if variant == "split_k shared":  # each group's prompt read from its first row; the default tiling
            own_rows = torch.arange(slots, dtype=torch.int32, device="cuda")
            engine.prefix_row.copy_(own_rows - own_rows % a.group)
            engine.prefix_len.fill_(a.prompt_len)
        else:
            engine.share_prefix = False
        engine.tok.copy_(torch.randint(0, 40000, (slots,), device="cuda", generator=gen))
        engine.u.uniform_(generator=gen)
        saved_pos = engine.pos.clone()

        def step():
            engine.pos.copy_(saved_pos)  # stay at the same lengths while timing
            engine._run_step(slots, 1.0, 1.0)

        try:
            ms = timed(step, a.steps)
            rows.append({"slots": slots, "model": model_name, "what": f"decode step, {variant}", "ms": round(ms, 3),
                         "tokens_per_s": round(slots / ms * 1000)})
        except (RuntimeError, ValueError) as e:  # a tiling that does not fit: recorded, and on to the next
            rows.append({"slots": slots, "model": model_name, "what": f"decode step, {variant}", "error": str(e)[:300]})
        print(rows[-1], file=sys.stderr, flush=True)
        AttentionInterface.register(slot_mod.ATTN_NAME, real_attention)
        if model_name != "hf":
            llama.ATTENTION[slot_mod.ATTN_NAME] = real_attention
        engine._graphs.clear()  # free this variant's graphs and cache before the next
        engine.kv = engine.split_k = slot_mod._FWD.kv = None
        del engine, step
        torch.cuda.empty_cache()
        if i + 1 < len(runs) and runs[i + 1][0] == slots:
            continue
        logits = torch.randn((slots, kw["vocab_size"]), device="cuda", dtype=torch.bfloat16)
        u = torch.rand(slots, device="cuda", dtype=torch.float64)
        for T, p in ((1.0, 1.0), (0.0, 1.0), (0.7, 0.95)):
            ms = timed(lambda: choose(torch.log_softmax(logits.float(), -1), u, T, p), a.steps)
            rows.append({"slots": slots, "what": f"log_softmax + choose T={T} top_p={p}", "ms": round(ms, 3)})
            print(rows[-1], file=sys.stderr, flush=True)
    # Scoring chunks of each token budget (rows of 680 tokens, the last 500 scored), right-padded
    # rows under causal attention (no mask): the whole log-prob pass, and the decoder alone.
    from gsm8kctl.training.trainer.logprobs import token_logprobs

    model = hf_model
    decoder = model.get_decoder()
    for budget in (int(b) for b in a.score_budgets.split(",")):
        rows_n = max(1, budget // 680)
        ids = torch.randint(0, 40000, (rows_n, 680), device="cuda")
        score_mask = torch.zeros_like(ids, dtype=torch.bool)
        score_mask[:, 180:] = True
        pos = torch.arange(680, device="cuda").expand_as(ids)
        with torch.inference_mode():
            for name, fn in (("token_logprobs", lambda: token_logprobs(model, ids, None, score_mask, position_ids=pos)),
                             ("decoder only", lambda: decoder(input_ids=ids, position_ids=pos))):
                ms = timed(fn, 5)
                rows.append({"what": f"score {rows_n} x 680 tokens, {name}", "ms": round(ms, 2),
                             "tokens_per_s": round(ids.numel() / ms * 1000),
                             "scored_tokens_per_s": round(int(score_mask.sum()) / ms * 1000)})
                print(rows[-1], file=sys.stderr, flush=True)
        del ids, score_mask, pos
        torch.cuda.empty_cache()
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "shape": a.shape, "rows": rows},
                                      indent=2))
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
