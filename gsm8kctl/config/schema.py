"""The typed schema of the config: what each key of `default.yaml` may hold.

One dataclass per YAML section, fields in the YAML's order. The defaults live only in
`default.yaml` (commented, for users); these classes hold no defaults, only types, ranges and
the few rules that tie keys together. `config.py` merges plain dicts and asks this module to
check the result, so every command refuses a bad value before a model loads or a file is written.

To add a key: add it to `default.yaml` with a comment, and a field here with its type; a test
checks that the two agree. Field types are a small vocabulary walked by `check_value`:
int, float, str, bool, None (in a union), `Literal[...]`, `list[...]`, a section dataclass, and
`Annotated[T, Range(...) | NonEmpty() | Template() | BaseUrls()]` for what a type cannot say.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Callable, Iterator, Literal, Optional, Union

# ---------------------------------------------------------------------------------------------
# Constraints on a value of the right type


_WHOLE = object()


class Invalid(Exception):
    """A value that does not fit: "must be ...", the offending `value` (default: the whole value
    checked; a list names its bad item), a `hint` for after it; `wrong_type` lets a union go on."""

    def __init__(self, message: str, wrong_type: bool = False, value: Any = _WHOLE, hint: str = ""):
        super().__init__(message)
        self.wrong_type, self.value, self.hint = wrong_type, value, hint

    def explain(self, whole: Any) -> str:
        """'must be >= 1, got 0; did you mean ...?'"""
        return f"{self}, got {show(whole if self.value is _WHOLE else self.value)}{self.hint}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """Numeric bounds. nan fails every bound: each comparison with it is False."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def text(self) -> str:
        lo = (">=", self.ge) if self.ge is not None else (">", self.gt) if self.gt is not None else None
        hi = ("<=", self.le) if self.le is not None else ("<", self.lt) if self.lt is not None else None
        if lo and hi:  # interval notation reads better than "must be > 0 and <= 1"
            return f"in {'[' if lo[0] == '>=' else '('}{_num(lo[1])}, {_num(hi[1])}{']' if hi[0] == '<=' else ')'}"
        op, bound = lo or hi or ("", None)
        return f"{op} {_num(bound)}" if op else "a number"

    def check(self, v: float) -> None:
        ok = ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
              and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))
        if not ok:
            raise Invalid(f"must be {self.text()}")


@dataclass(frozen=True)
class NonEmpty:
    def check(self, v: str) -> None:
        if not v.strip():
            raise Invalid("must not be empty")


@dataclass(frozen=True)
class Template:
    """A str.format template that shows the question: `{question}` once, other braces doubled."""

    def check(self, v: str) -> None:
        if "{question}" not in v:
            raise Invalid("must contain {question} (where the problem goes)")
        try:
            v.format(question="")
        except (KeyError, IndexError, ValueError):
            raise Invalid("may use only the placeholder {question}; write literal braces as {{ and }}") from None


@dataclass(frozen=True)
class BaseUrls:
    """One URL, a comma-separated list, or a YAML list; each http(s) (backends/openai.py adds /v1)."""

    def check(self, v: str | list) -> None:
        items = v.split(",") if isinstance(v, str) else [u for x in v for u in str(x).split(",")]
        urls = [u.strip() for u in items if u.strip()]
        if not urls:
            raise Invalid("must name at least one URL (or be null)")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise Invalid("must be http:// or https:// URLs", value=u)


# Shorthands for the common shapes.
Count = Annotated[int, Range(ge=1)]          # sizes, steps, batch sizes: zero makes no sense
NonNegInt = Annotated[int, Range(ge=0)]
NonNegFloat = Annotated[float, Range(ge=0)]
PosFloat = Annotated[float, Range(gt=0)]
Name = Annotated[str, NonEmpty()]
AutoBool = Literal["auto", True, False]       # auto = decided by the device at run time

# Allowed values that code elsewhere also names (agent.EXTRACTORS, backends.BACKENDS, ...);
# tests/test_config.py checks that those constants agree with these.
Backend = Literal["auto", "transformers", "vllm", "openai"]
Objective = Literal["sft", "reinforce", "grpo"]
RLAlgo = Literal["reinforce", "grpo"]
KLEstimator = Literal["k1", "k3"]
Extractor = Literal["strict", "lenient"]
Tracker = Literal["tensorboard", "wandb"]


# ---------------------------------------------------------------------------------------------
# Sections, mirroring default.yaml (its comments say what each key does)


@dataclass(frozen=True)
class Loop:
    engine: Literal["auto", "inprocess", "processes"]


@dataclass(frozen=True)
class Agent:
    system_prompt: Optional[str]
    task_template: Annotated[str, Template()]
    few_shot: NonNegInt
    reward_extractor: Extractor


@dataclass(frozen=True)
class Sampling:
    temperature: NonNegFloat                          # 0 = greedy
    top_p: Annotated[float, Range(gt=0, le=1)]        # 0 would keep no token
    max_tokens: Count
    batch_size: Count
    num_processes: Count                              # the loop's sampler processes (shards.py)
    max_slots: Optional[Count]                        # null = sized from free GPU memory
    # Above 0.95 the weights, activations and the allocator's slack no longer fit beside it.
    kv_memory_fraction: Annotated[float, Range(gt=0, le=0.95)]
    prefill_token_budget: Count
    write_interval_s: NonNegFloat                     # 0 = every finished attempt at once


@dataclass(frozen=True)
class Evaluation:
    max_tokens: Count
    batch_size: Count


@dataclass(frozen=True)
class Transformers:
    static_cache: AutoBool
    dtype: Literal["auto", "float32", "bfloat16"]
    decode_attention: Literal["auto", "split_k", "flash", "sdpa"]
    model_code: Literal["auto", "native", "hf"]


@dataclass(frozen=True)
class VLLM:
    kv_cache_gb: Count                                # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    gpu_memory_utilization: Annotated[float, Range(gt=0, le=1)]
    enforce_eager: bool
    # vLLM's --dtype choices (half = float16, float = float32).
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
    max_model_len: Optional[Count]
    max_num_seqs: Optional[Count]


@dataclass(frozen=True)
class OpenAI:
    base_url: Optional[Annotated[Union[str, list[str]], BaseUrls()]]
    api_key: str
    concurrency: Count
    timeout_s: PosFloat
    retries: NonNegInt
    backoff_s: NonNegFloat


@dataclass(frozen=True)
class Filter:
    max_per_problem: Optional[Count]
    drop_uniform_groups: bool
    drop_duplicate_correct: bool
    ref_model: Optional[Name]
    ref_backend: Backend
    score_token_budget: Count


@dataclass(frozen=True)
class RL:
    algo: RLAlgo
    use_advantages: bool
    divide_by_std: bool                               # false: Dr. GRPO's A = r - mean
    relu_weights: bool
    kl_coef: NonNegFloat
    implicit_kl_coef: NonNegFloat
    implicit_kl_estimator: KLEstimator
    epsilon: PosFloat                                 # GRPO clip: 0 would freeze the ratio at 1
    epsilon_high: Optional[PosFloat]                  # DAPO clip-higher; null = epsilon


@dataclass(frozen=True)
class Finetune:
    objective: Optional[Objective]
    learning_rate: PosFloat
    weight_decay: NonNegFloat
    gradient_clipping_threshold: Optional[NonNegFloat]  # 0 or null = no clipping
    lr_scheduler: Literal["constant", "cosine"]
    warmup_steps: NonNegInt
    train_batch_size: Count
    gradient_accumulation_passes: Count
    token_budget: Count
    seq_length: Count
    save_checkpoint_steps: Optional[Count]            # set: also the loop's fixed steps per iteration
    steps: Optional[Count]
    max_steps: Optional[Count]
    epochs: Count
    dtype: Literal["auto", "float32", "bfloat16"]
    gradient_checkpointing: bool
    compile: AutoBool
    packing: AutoBool                                 # auto = on CUDA (gsm8kctl/training/packing.py)
    logprob_chunk_tokens: Count
    num_processes: Count
    nccl_timeout_s: Count                             # timedelta(seconds=int(...)) in finetune.py
    keep_checkpoints: Count
    rl: RL


@dataclass(frozen=True)
class Config:
    model: Name
    backend: Backend
    machine: Literal["auto", "gpu", "cpu"]           # which column of sizes.SIZE_KEYS `auto` takes
    # numpy and torch take 32-bit seeds; per-rank and per-chunk offsets are added to this one.
    seed: Annotated[int, Range(ge=0, le=2**31 - 1)]
    data_dir: Optional[Name]
    # auto = the whole GPU (1), or 1/R under `seeds` with R loops at once (sizes.gpu_share).
    gpu_memory_share: Union[Annotated[float, Range(gt=0, le=1)], Literal["auto"]]
    iterations: NonNegInt                             # 0 = only the initial evaluation
    attempts: Count
    max_agent_forks: Count
    use_rejection_sampling: bool
    test_every_n_iterations: NonNegInt                # 0 = never evaluate
    eval_limit: Optional[Count]
    validation_problems: NonNegInt                    # held out of the train file; 0 = none
    warmup_sft_steps: NonNegInt
    warmup_sft_problems: NonNegInt                    # >= 1 when used (a rule below)
    warmup_sft_learning_rate: Optional[PosFloat]      # null = finetune.learning_rate
    test_before_warmup: bool
    stop_without_signal: NonNegInt                    # 0 = never stop
    revisit_share: Annotated[float, Range(ge=0, le=1)]  # of each iteration's problems
    report_to: list[Tracker]
    warn_passes: Optional[PosFloat]
    warn_test_drop: Optional[NonNegFloat]             # accuracy is a fraction: 0.01 = 1 point
    warn_ratio: Optional[PosFloat]
    warn_kl: Optional[NonNegFloat]
    warn_entropy: Optional[PosFloat]                  # a multiple of the first iteration's entropy
    loop: Loop
    agent: Agent
    sampling: Sampling
    evaluation: Evaluation
    transformers: Transformers
    vllm: VLLM
    openai: OpenAI
    filter: Filter
    finetune: Finetune


# ---------------------------------------------------------------------------------------------
# Rules between keys


@dataclass(frozen=True)
class Rule:
    """`ok(cfg)` must hold; `keys` are the keys it reads (the error blames the one set last).

    `commands`: only these CLI commands need the rule (None = all). `gsm8kctl sample --attempts
    1024` is fine although the loop, which spreads max_agent_forks over attempts, would refuse it.
    """

    keys: tuple[str, ...]
    ok: Callable[[dict], bool]
    message: Callable[[dict], str]
    commands: tuple[str, ...] | None = None


def _inprocess_needs_one(section: str, does: str) -> Rule:
    """loop.engine=inprocess runs SECTION in the loop's own process: `SECTION.num_processes` must be 1."""
    key = f"{section}.num_processes"
    return Rule(("loop.engine", key),
                lambda c: c["loop"]["engine"] != "inprocess" or c[section]["num_processes"] == 1,
                lambda c: f"loop.engine=inprocess {does} in one process, got {key}={c[section]['num_processes']} "
                          "(use loop.engine=processes or auto)",
                commands=("loop",))


RULES: tuple[Rule, ...] = (
    # In-process the loop itself samples and trains: with the transformers backend, in one process.
    Rule(("loop.engine", "backend"),
         lambda c: c["loop"]["engine"] != "inprocess" or c["backend"] in ("auto", "transformers"),
         lambda c: f"loop.engine=inprocess samples with the transformers backend, got backend={c['backend']} "
                   "(use loop.engine=processes or auto)",
         commands=("loop",)),
    _inprocess_needs_one("sampling", "samples"),
    Rule(("sampling.num_processes", "backend"),
         lambda c: c["sampling"]["num_processes"] == 1 or c["backend"] != "openai",
         lambda c: f"sampling.num_processes={c['sampling']['num_processes']} starts one sampler per GPU (backends "
                   "transformers and vllm); with backend openai list several servers in openai.base_url instead",
         commands=("loop",)),
    _inprocess_needs_one("finetune", "trains"),
    # Our decoder runs no attention masks and no transformers cache: the slot engine's path only.
    Rule(("transformers.model_code", "transformers.static_cache"),
         lambda c: c["transformers"]["model_code"] != "native" or c["transformers"]["static_cache"] is not False,
         lambda c: "transformers.model_code=native runs under the slot engine only, got "
                   "transformers.static_cache=false (use true, or auto on CUDA)"),
    Rule(("max_agent_forks", "attempts"),
         lambda c: c["max_agent_forks"] >= c["attempts"],
         lambda c: f"need max_agent_forks >= attempts (a loop iteration samples max_agent_forks // attempts "
                   f"problems), got max_agent_forks={c['max_agent_forks']}, attempts={c['attempts']}",
         commands=("loop",)),
    Rule(("warmup_sft_problems", "warmup_sft_steps"),
         lambda c: c["warmup_sft_steps"] == 0 or c["warmup_sft_problems"] >= 1,
         lambda c: f"warmup_sft_problems must be >= 1 when warmup_sft_steps > 0, "
                   f"got {c['warmup_sft_problems']} (warmup_sft_steps={c['warmup_sft_steps']})"),
    # In the loop only filter.ref_model can supply reference log-probs; `filter` and `finetune`
    # run alone take them from --ref-model or from the samples, and check there.
    Rule(("finetune.rl.implicit_kl_coef", "filter.ref_model"),
         lambda c: not c["finetune"]["rl"]["implicit_kl_coef"] or c["filter"]["ref_model"] is not None,
         lambda c: "finetune.rl.implicit_kl_coef > 0 needs a reference model: set filter.ref_model",
         commands=("loop",)),
    Rule(("finetune.rl.kl_coef", "filter.ref_model"),
         lambda c: not c["finetune"]["rl"]["kl_coef"] or c["filter"]["ref_model"] is not None,
         lambda c: "finetune.rl.kl_coef > 0 needs ref_logprobs in the samples: set filter.ref_model",
         commands=("loop",)),
)


# ---------------------------------------------------------------------------------------------
# The checker


def show(v: Any) -> str:
    """A value as the user typed it in YAML: true/false/null, strings quoted."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def _split(tp: Any) -> tuple[Any, tuple]:
    """Annotated[T, m...] -> (T, (m...)); anything else -> (tp, ())."""
    if typing.get_origin(tp) is Annotated:
        return tp.__origin__, tp.__metadata__
    return tp, ()


def _members(tp: Any) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)


def describe(tp: Any) -> str:
    """What a type accepts, in words: 'an integer >= 1 or null'."""
    parts = []
    for m in _members(tp):
        base, meta = _split(m)
        if base is type(None):
            parts.append("null")
            continue
        if typing.get_origin(base) in (Union, types.UnionType):
            parts.append(describe(base))
            continue
        ranges = [x.text() for x in meta if isinstance(x, Range)]
        word = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(base)
        if typing.get_origin(base) is Literal:
            word = "one of " + ", ".join(show(c) if not isinstance(c, str) else c for c in typing.get_args(base))
        elif typing.get_origin(base) is list:
            item = typing.get_args(base)[0]
            word = "a list of strings" if item is str else "a list of " + describe(item).removeprefix("one of ")
        elif dataclasses.is_dataclass(base):
            word = "a section"
        parts.append(" ".join([word or str(base), *ranges]))
    return " or ".join(parts)


def check_value(tp: Any, v: Any) -> Any:
    """The value, normalised (int -> float for a number, "a,b" -> [a, b] for a list), or Invalid."""
    members = _members(tp)
    if len(members) > 1:
        if v is None and type(None) in members:
            return None
        errors = []
        for m in members:
            if m is type(None):
                continue
            try:
                return check_value(m, v)
            except Invalid as exc:
                if typing.get_origin(_split(m)[0]) is not Literal:  # a word that is none of them: the whole union
                    errors.append(exc)
        # A value of the right type that breaks a bound says which bound (and that null would do).
        for exc in errors:
            if not exc.wrong_type:
                nullable = type(None) in members and str(exc).startswith("must be ")
                raise Invalid(f"{exc} or null" if nullable else str(exc), value=exc.value, hint=exc.hint)
        raise Invalid(f"must be {describe(tp)}", wrong_type=True)

    base, meta = _split(tp)
    if typing.get_origin(base) in (Union, types.UnionType):  # Annotated[Union[...], m]
        v = check_value(base, v)
    elif base is type(None):
        if v is not None:
            raise Invalid("must be null", wrong_type=True)
    elif typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if isinstance(v, str) and v.strip().lower() in ("true", "false") and True in choices:
            v = v.strip().lower() == "true"  # a quoted "false" in YAML: bool("false") would be True
        # Same type and value: 1 is not true, 1.0 is not "1".
        if not any(type(c) is type(v) and c == v for c in choices):
            words = [c for c in choices if isinstance(c, str)]
            # 0.75: cosin -> cosine, grop -> grpo; not tensorrt -> transformers (0.6).
            close = difflib.get_close_matches(v, words, n=1, cutoff=0.75) if isinstance(v, str) else []
            raise Invalid(f"must be {describe(base)}", hint=f"; did you mean {close[0]}?" if close else "")
    elif base is bool:
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            v = v.strip().lower() == "true"
        if not isinstance(v, bool):
            raise Invalid("must be true or false", wrong_type=True)
    elif base is int:
        if isinstance(v, float) and v.is_integer():
            v = int(v)  # 1e3 on the command line is a float
        if isinstance(v, bool) or not isinstance(v, int):
            raise Invalid("must be an integer", wrong_type=True)
    elif base is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Invalid("must be a number", wrong_type=True)
        v = float(v)
        if not math.isfinite(v):
            raise Invalid("must be a finite number")
    elif base is str:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = str(v)  # api_key=12345, model=2024 parse as numbers
        if not isinstance(v, str):
            raise Invalid("must be a string", wrong_type=True)
    elif typing.get_origin(base) is list:
        v = _check_list(base, v)
    elif dataclasses.is_dataclass(base):
        raise Invalid("is a section, not a value", wrong_type=True)
    else:  # a schema bug, not a user error
        raise TypeError(f"config_schema cannot check type {base!r}")
    for m in meta:
        if v is not None:
            m.check(v)
    return v


def _check_list(tp: Any, v: Any) -> list:
    """A list of one item type; a comma-separated string (report_to=tensorboard,wandb) splits."""
    if v is None:
        v = []
    if isinstance(v, str):
        v = [x.strip() for x in v.split(",") if x.strip()]
    if not isinstance(v, list):
        raise Invalid(f"must be {describe(tp)}", wrong_type=True)
    (item,) = typing.get_args(tp)
    checked = []
    for x in v:
        try:
            checked.append(check_value(item, x))
        except Invalid as exc:
            bad = x if exc.value is _WHOLE else exc.value
            raise Invalid(f"items {exc}", value=bad, hint=exc.hint) from None
    return checked


UNKNOWN, MISSING = "unknown key", "missing key"


@lru_cache(maxsize=None)
def fields(section: type = Config) -> dict[str, Any]:
    """Field name -> type of one section class (annotations resolved)."""
    return typing.get_type_hints(section, include_extras=True)


def field_type(dotted: str) -> Any:
    """The schema type of `a.b.c`; KeyError when there is no such key."""
    tp: Any = Config
    for part in dotted.split("."):
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            raise KeyError(dotted)
        tp = fields(tp)[part]
    return tp


def dotted_keys(section: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included (for "did you mean")."""
    out = []
    for name, tp in fields(section).items():
        out.append(prefix + name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.extend(dotted_keys(tp, f"{prefix}{name}."))
    return out


def check_config(cfg: dict, section: type = Config, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Normalise `cfg` in place; yield (dotted key, problem) for each key that does not fit:
    UNKNOWN, MISSING, or 'must be ..., got ...'."""
    if not isinstance(cfg, dict):
        yield prefix.rstrip(".") or "config", "must be a section (a mapping of keys)"
        return
    spec = fields(section)
    for k in cfg:
        if k not in spec:
            yield f"{prefix}{k}", UNKNOWN
    for name, tp in spec.items():
        key = f"{prefix}{name}"
        if name not in cfg:
            yield key, MISSING
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from check_config(cfg[name], tp, key + ".")
        else:
            try:
                cfg[name] = check_value(tp, cfg[name])
            except Invalid as exc:
                yield key, exc.explain(cfg[name])


def broken_rules(cfg: dict, command: str | None = None,
                 involving: str | None = None) -> Iterator[tuple[Rule, str]]:
    """Rules that `cfg` breaks, with their messages: rules for every command, plus `command`'s own;
    `involving`: only the rules that read that key."""
    for rule in RULES:
        if rule.commands is not None and command not in rule.commands:
            continue
        if involving is not None and involving not in rule.keys:
            continue
        if not rule.ok(cfg):
            yield rule, rule.message(cfg)
