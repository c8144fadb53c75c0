"""Sizes that follow the machine: what `auto` means for the keys of `SIZE_KEYS`.

The default config is one recipe (a warm start on gold solutions, then REINFORCE with group
advantages and a KL term to the warm start); only its budgets differ between machines. On a GPU
they are the budgets measured on one H200 (docs/results.md); on a CPU, what the demo runs in
about a quarter of an hour on two cores. `machine: auto` picks the column by whether torch sees a
CUDA device; `machine: gpu` or `cpu` picks it by hand. A key the user sets keeps the user's
value; the loop prints what `auto` became, and the run's saved config.yaml holds the numbers.
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"
MACHINES = ("gpu", "cpu")

# key: (gpu, cpu). Warm-start steps: three passes over the 6973 problems left once 500 are held out
# (64 per step) on a GPU, which beat two passes over seeds (docs/results.md, "Recipes compared");
# one pass over 96 on a CPU.
SIZE_KEYS: dict[str, tuple[Any, Any]] = {
    "iterations": (48, 1),
    "attempts": (16, 4),
    "max_agent_forks": (4096, 64),
    "test_every_n_iterations": (4, 1),
    "eval_limit": (None, 30),
    "validation_problems": (500, 30),
    "warmup_sft_steps": (327, 12),
    "warmup_sft_problems": (7473, 96),
    "warmup_sft_learning_rate": (5.0e-5, 1.0e-4),
    "sampling.max_tokens": (512, 256),
    "evaluation.max_tokens": (512, 256),
    "finetune.learning_rate": (5.0e-6, 5.0e-5),
    "finetune.train_batch_size": (64, 8),
    "finetune.token_budget": (32768, 8192),
    "filter.score_token_budget": (65536, 16384),
}


def detect_machine() -> str:
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _get(cfg: dict, dotted: str) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        cur = cur[part]
    return cur


def _put(cfg: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    cur = cfg
    for part in parents:
        cur = cur[part]
    cur[last] = value


def resolve(cfg: dict) -> dict[str, Any]:
    """Replace every `auto` of SIZE_KEYS in `cfg` (in place); returns what each became. `machine`
    becomes gpu or cpu too, so a saved config reads the same on any machine."""
    machine = cfg.get("machine", AUTO)
    pending = [k for k in SIZE_KEYS if _get(cfg, k) == AUTO]
    if machine == AUTO and not pending:
        return {}
    if machine == AUTO:
        machine = detect_machine()
        cfg["machine"] = machine
    column = MACHINES.index(machine)
    chosen = {}
    for key in pending:
        chosen[key] = SIZE_KEYS[key][column]
        _put(cfg, key, chosen[key])
    return chosen


def describe(machine: str, chosen: dict[str, Any]) -> str:
    """One line for the loop's start: which column and what it filled in."""
    if not chosen:
        return ""
    values = ", ".join(f"{k}={'null' if v is None else v}" for k, v in chosen.items())
    return f"sizes for a {machine} (keys left at auto; set one to override it): {values}"


def gpu_share(cfg) -> float:
    """`gpu_memory_share` as a number: auto is the whole GPU (the seeds command sets 1/R itself)."""
    share = (cfg or {}).get("gpu_memory_share", AUTO)
    return 1.0 if share == AUTO else float(share)


def kv_room(free: int, total: int, held: int, share: float) -> int:
    """Bytes the sampler's KV cache is sized from (times sampling.kv_memory_fraction): what is
    free now, and never more than this process's share of the whole GPU less what it holds
    already. So loops started together each keep to their share, whichever starts first."""
    return max(0, min(free, int(share * total) - held))
