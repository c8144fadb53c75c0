"""How far apart two checkpoints' weights are: per tensor and overall.

    python tools/compare_checkpoints.py RUN_A/checkpoints/step-000240 RUN_B/checkpoints/step-000240 --out cmp.json

Reads `model.safetensors` of each (a checkpoint directory, or a run directory for its latest),
and reports the tensors that differ, the share of differing elements, and the largest absolute
difference. Used to tell nondeterministic training apart from a difference in how weights reach
the sampler (docs/benchmarks.md, "Loop iteration" and "Run-to-run determinism on CUDA").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def weights(path: str) -> dict:
    from safetensors.torch import load_file

    from gsm8kctl.artifacts import rundir

    p = Path(path)
    if not (p / "model.safetensors").exists():
        latest = rundir.latest_checkpoint(p)
        if latest is None:
            sys.exit(f"{path}: no model.safetensors and no checkpoint")
        p = latest
    return load_file(str(p / "model.safetensors"))


def compare(a: dict, b: dict) -> dict:
    if set(a) != set(b):
        return {"same_names": False, "only_a": sorted(set(a) - set(b)), "only_b": sorted(set(b) - set(a))}
    differing, elements, changed, largest = [], 0, 0, 0.0
    for name in sorted(a):
        x, y = a[name].float(), b[name].float()
        diff = (x - y).abs()
        n = int((diff > 0).sum())
        elements += x.numel()
        changed += n
        if n:
            differing.append({"name": name, "changed": n, "max_abs": float(diff.max())})
            largest = max(largest, float(diff.max()))
    return {"same_names": True, "tensors": len(a), "tensors_differing": len(differing),
            "elements": elements, "elements_differing": changed,
            "share_differing": round(changed / elements, 6) if elements else 0.0,
            "max_abs_diff": largest, "identical": changed == 0,
            "worst": sorted(differing, key=lambda d: -d["max_abs"])[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = {"a": args.a, "b": args.b, **compare(weights(args.a), weights(args.b))}
    print(f"{args.a} vs {args.b}: identical={result.get('identical')} "
          f"share differing={result.get('share_differing')} max |diff|={result.get('max_abs_diff')}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
