"""Where a decode step of the slot engine spends its time, on one GPU (random-init weights).

Replays the captured step at a given slot count with slots at GSM8k-like positions and times
it with CUDA events, for each decode attention (flash varlen, masked SDPA) and with attention
replaced by nothing (what the rest of the model costs); then the token choice alone.

    python scripts/profile_slot_step.py --shape 135m --slots 1024,2048 --out profile.json
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
    from gsm8kctl.backends import slots as slot_mod
    from gsm8kctl.backends.sampling import choose
    from gsm8kctl.backends.slots import SlotEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="135m")
    ap.add_argument("--slots", default="1024,2048")
    ap.add_argument("--max-len", type=int, default=896)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="profile_slot_step.json")
    a = ap.parse_args()
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
    real_attention = slot_mod._slot_attention
    for slots in (int(s) for s in a.slots.split(",")):
        for variant in ("flash", "sdpa", "no attention"):
            engine = SlotEngine(model, slots=slots, max_len=a.max_len, stop_ids=[0], pad_id=0)
            if variant == "sdpa":
                engine.flash = False
            if variant == "no attention":
                def nothing(module, query, key, value, *args, **kwargs):
                    return query.transpose(1, 2).contiguous(), None

                AttentionInterface.register(slot_mod.ATTN_NAME, nothing)
            gen = torch.Generator(device="cuda").manual_seed(1)
            engine.pos.copy_(torch.randint(175, a.max_len - 128, (slots,), device="cuda", generator=gen))
            engine.tok.copy_(torch.randint(0, 40000, (slots,), device="cuda", generator=gen))
            engine.u.uniform_(generator=gen)
            saved_pos = engine.pos.clone()

            def step():
                engine.pos.copy_(saved_pos)  # stay at the same lengths while timing
                engine._run_step(slots, 1.0, 1.0)

            ms = timed(step, a.steps)
            rows.append({"slots": slots, "what": f"decode step, {variant}", "ms": round(ms, 3),
                         "tokens_per_s": round(slots / ms * 1000), "flash": engine.flash})
            print(rows[-1], file=sys.stderr, flush=True)
            AttentionInterface.register(slot_mod.ATTN_NAME, real_attention)
            engine._graphs.clear()  # free this variant's graphs and cache before the next
            engine.kv = None
            torch.cuda.empty_cache()
        logits = torch.randn((slots, kw["vocab_size"]), device="cuda", dtype=torch.bfloat16)
        u = torch.rand(slots, device="cuda", dtype=torch.float64)
        for T, p in ((1.0, 1.0), (0.0, 1.0), (0.7, 0.95)):
            ms = timed(lambda: choose(torch.log_softmax(logits.float(), -1), u, T, p), a.steps)
            rows.append({"slots": slots, "what": f"log_softmax + choose T={T} top_p={p}", "ms": round(ms, 3)})
            print(rows[-1], file=sys.stderr, flush=True)
    # Scoring a chunk of the default budget (16384 tokens: 24 rows of 680), with and without a
    # padding mask (right padding needs none under causal attention).
    from gsm8kctl.logprobs import token_logprobs

    ids = torch.randint(0, 40000, (24, 680), device="cuda")
    score_mask = torch.zeros_like(ids, dtype=torch.bool)
    score_mask[:, 180:] = True
    attn = torch.ones_like(ids)
    attn[::2, -100:] = 0  # some rows padded, as in a real chunk
    pos = torch.arange(680, device="cuda").expand_as(ids)
    with torch.inference_mode():
        for name, mask in (("padding mask", attn), ("no mask (causal only)", None)):
            ms = timed(lambda: token_logprobs(model, ids, mask, score_mask, position_ids=pos), 10)
            rows.append({"what": f"score 24 x 680 tokens, {name}", "ms": round(ms, 2),
                         "tokens_per_s": round(ids.numel() / ms * 1000)})
            print(rows[-1], file=sys.stderr, flush=True)
    Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "shape": a.shape, "rows": rows},
                                      indent=2))
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
