"""Where the slot engine's admissions spend host time, on one GPU (random-init weights).

With windows in flight, `admit_s` (the host time of admitting new prompts) rose from ~3 to ~5 s
per `sample` of 8192 attempts, and `prefill_s` showed ~120 ms per admission for ~4 k prompt
tokens: about one window of decode steps, as if something in admission waited on the device.
This runs the engine on the random-init SmolLM2-135M shape (our decoder, fused) with rows that
stop at random (200 stop ids, mean ~250 tokens, so slots refill all the way), wraps each step of
an admission in a host timer, and lists what torch's sync-debug mode reports inside admissions.

    python bench/profile_admission.py --tokenizer TOKENIZER_DIR --out admission.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--problems", type=int, default=1024)
    ap.add_argument("--attempts", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2368)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--sdpa", choices=["ours", "default"], default="ours",
                    help="default: torch chooses SDPA's backend (cuDNN included), as before slots.SDPA_BACKENDS")
    ap.add_argument("--out", default="admission.json")
    a = ap.parse_args()

    import torch

    from bench_gpu_sampling import gsm8k_like_prompts, random_model
    from gsm8kctl.sampling.backends import fused, llama, slots
    from gsm8kctl.sampling.backends import sampling as sampling_mod

    if a.sdpa == "default":
        slots.SDPA_BACKENDS = None
    path = random_model("135m", a.tokenizer, Path(tempfile.mkdtemp()) / "m")
    model = llama.load(path, device="cuda", dtype=torch.bfloat16)
    host = defaultdict(float)
    calls = Counter()
    in_admit = [False]

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not in_admit[0]:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                host[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapper

    admit = slots.SlotEngine._admit

    def admit_wrapped(self, *args, **kwargs):
        in_admit[0] = True
        t0 = time.perf_counter()
        try:
            return admit(self, *args, **kwargs)
        finally:
            host["admit (all)"] += time.perf_counter() - t0
            calls["admit (all)"] += 1
            in_admit[0] = False

    slots.SlotEngine._admit = admit_wrapped
    slots.SlotEngine._up = timed("_up (pin + copy up)", slots.SlotEngine._up)
    slots.SlotEngine._prefill = timed("_prefill", slots.SlotEngine._prefill)
    slots.uniforms = timed("uniforms (CPU RNG)", sampling_mod.uniforms)
    slots.choose = timed("choose", slots.choose)
    slots._slot_attention = timed("slot attention (prefill)", slots._slot_attention)
    llama.ATTENTION[slots.ATTN_NAME] = slots._slot_attention
    fused.add_rmsnorm = timed("fused add_rmsnorm", fused.add_rmsnorm)
    fused.rope = timed("fused rope", fused.rope)
    fused.silu_mul = timed("fused silu_mul", fused.silu_mul)
    torch.Tensor.pin_memory = timed("Tensor.pin_memory", torch.Tensor.pin_memory)
    for name in ("linear", "embedding", "scaled_dot_product_attention"):
        setattr(torch.nn.functional, name, timed(f"F.{name}", getattr(torch.nn.functional, name)))

    syncs: Counter = Counter()

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if in_admit[0] and "synchroniz" in str(message):
            stack = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-9:-2]]
            syncs[" <- ".join(reversed(stack))] += 1

    warnings.showwarning = on_warning
    warnings.simplefilter("always")  # every sync, not the first per line
    prompts = gsm8k_like_prompts(a.problems)
    results = {}
    for run in ("warm-up", "measured"):
        engine = slots.SlotEngine(model, slots=a.slots, max_len=896, stop_ids=range(200), pad_id=0)
        host.clear()
        calls.clear()
        syncs.clear()
        reqs = [slots.Request(i, prompts[i // a.attempts], seed=i) for i in range(a.problems * a.attempts)]
        if run == "measured":
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        n = sum(len(f.token_ids) for f in engine.run(reqs, temperature=1.0, top_p=1.0, max_tokens=a.max_tokens))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        torch.cuda.set_sync_debug_mode(0)
        results[run] = {"wall_s": round(wall, 2), "tokens": n, "engine": {k: round(v, 3) if isinstance(v, float) else v
                                                                         for k, v in engine.stats.items()},
                        "host_s": {k: round(v, 3) for k, v in sorted(host.items(), key=lambda kv: -kv[1])},
                        "calls": dict(calls), "syncs_in_admission": dict(syncs.most_common(12))}
        print(json.dumps(results[run], indent=1), flush=True)
        del engine
        torch.cuda.empty_cache()
    results["sdpa"] = a.sdpa
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
