"""The typed schema of the config: what each key of `default.yaml` may hold, as pydantic models.

One pydantic model per YAML section, fields in the YAML's order. The defaults live only in
`default.yaml` (commented, for users); these models hold no defaults, only types, ranges and
the few rules that tie keys together. `config/__init__.py` merges plain dicts and asks this
module to check the result, so every command refuses a bad value before a model loads or a file
is written. The config stays a dict: a checked value is written back into it, normalised.

To add a key: add it to `default.yaml` with a comment, and a field here to its section's model,
in the same place; a test checks that the two agree. Give the field one of the value types
below (`Int`, `Str`, `Bool`, `Count`, `Name`, ...), `float`, a `Literal[...]`, `Optional[...]`
for null, or `Annotated[..., Field(ge=, gt=, le=, lt=)]` for a range; a rule that no type can
say is an `AfterValidator` raising ValueError("must ..."). The models are strict: a value is
coerced only where a value type says so (1e3 -> 1000 for an integer, "false" -> false, a number
-> a string). Pydantic's errors become one line, "must be >= 1 or null, got 0", in `_problem`;
a new kind of constraint needs its words there, and `describe` words a type from its annotation.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterator, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

# ---------------------------------------------------------------------------------------------
# Value types: strict pydantic types, plus the coercions that YAML and the command line need


def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v  # 1e3 on the command line is a float


def _number_text(v: Any) -> Any:
    return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v  # api_key=12345, model=2024


def _bool_word(v: Any) -> Any:
    """A quoted "false" in YAML is false: bool("false") would be True."""
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return v


def _bool_choice(v: Any) -> Any:
    """As `_bool_word`; a number is none of the choices (pydantic matches 1 to true, as 1 == True)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        raise PydanticCustomError("literal_error", "Input should be one of the choices")
    return _bool_word(v)


def _comma_list(v: Any) -> Any:
    """report_to=tensorboard,wandb on the command line; null is no item."""
    if v is None:
        return []
    return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v


def _non_empty(v: str) -> str:
    if not v.strip():
        raise ValueError("must not be empty")
    return v


def _question_template(v: str) -> str:
    """A str.format template that shows the question: `{question}` once, other braces doubled."""
    if "{question}" not in v:
        raise ValueError("must contain {question} (where the problem goes)")
    try:
        v.format(question="")
    except (KeyError, IndexError, ValueError):
        raise ValueError("may use only the placeholder {question}; write literal braces as {{ and }}") from None
    return v


class ItemError(ValueError):
    """A validator's complaint about one item of the value: the message shows that item."""

    def __init__(self, problem: str, item: Any):
        super().__init__(problem)
        self.item = item


def _base_urls(v: str | list) -> str | list:
    """One URL, a comma-separated list, or a YAML list; each http(s) (backends/openai.py adds /v1)."""
    items = v.split(",") if isinstance(v, str) else [u for x in v for u in x.split(",")]
    urls = [u.strip() for u in items if u.strip()]
    if not urls:
        raise ValueError("must name at least one URL (or be null)")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ItemError("must be http:// or https:// URLs", u)
    return v


Int = Annotated[int, BeforeValidator(_integral)]
Str = Annotated[str, BeforeValidator(_number_text)]
Bool = Annotated[bool, BeforeValidator(_bool_word)]

# Shorthands for the common shapes.
Count = Annotated[Int, Field(ge=1)]           # sizes, steps, batch sizes: zero makes no sense
NonNegInt = Annotated[Int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
Name = Annotated[Str, AfterValidator(_non_empty)]
AutoBool = Annotated[Literal["auto", True, False], BeforeValidator(_bool_choice)]  # auto = decided at run time

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


class Section(BaseModel):
    # strict: no "5" -> 5, no 1 -> true, no "yes" -> true; the value types above name each coercion.
    # protected_namespaces: transformers.model_code is a key, and pydantic < 2.10 reserved model_.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())


class Loop(Section):
    engine: Literal["auto", "inprocess", "processes"]


class Agent(Section):
    system_prompt: Optional[Str]
    task_template: Annotated[Str, AfterValidator(_question_template)]
    few_shot: NonNegInt
    reward_extractor: Extractor


class Sampling(Section):
    temperature: NonNegFloat                          # 0 = greedy
    top_p: Annotated[float, Field(gt=0, le=1)]        # 0 would keep no token
    max_tokens: Count
    batch_size: Count
    num_processes: Count                              # the loop's sampler processes (shards.py)
    max_slots: Optional[Count]                        # null = sized from free GPU memory
    # Above 0.95 the weights, activations and the allocator's slack no longer fit beside it.
    kv_memory_fraction: Annotated[float, Field(gt=0, le=0.95)]
    prefill_token_budget: Count
    write_interval_s: NonNegFloat                     # 0 = every finished attempt at once


class Evaluation(Section):
    max_tokens: Count
    batch_size: Count


class Transformers(Section):
    static_cache: AutoBool
    dtype: Literal["auto", "float32", "bfloat16"]
    decode_attention: Literal["auto", "split_k", "flash", "sdpa"]
    model_code: Literal["auto", "native", "hf"]


class VLLM(Section):
    kv_cache_gb: Count                                # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)]
    enforce_eager: Bool
    # vLLM's --dtype choices (half = float16, float = float32).
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
    max_model_len: Optional[Count]
    max_num_seqs: Optional[Count]


class OpenAI(Section):
    base_url: Optional[Annotated[Union[Str, list[Str]], AfterValidator(_base_urls)]]
    api_key: Str
    concurrency: Count
    timeout_s: PosFloat
    retries: NonNegInt
    backoff_s: NonNegFloat


class Filter(Section):
    max_per_problem: Optional[Count]
    drop_uniform_groups: Bool
    drop_duplicate_correct: Bool
    ref_model: Optional[Name]
    ref_backend: Backend
    score_token_budget: Count


class RL(Section):
    algo: RLAlgo
    use_advantages: Bool
    divide_by_std: Bool                               # false: Dr. GRPO's A = r - mean
    relu_weights: Bool
    kl_coef: NonNegFloat
    implicit_kl_coef: NonNegFloat
    implicit_kl_estimator: KLEstimator
    epsilon: PosFloat                                 # GRPO clip: 0 would freeze the ratio at 1
    epsilon_high: Optional[PosFloat]                  # DAPO clip-higher; null = epsilon


class Finetune(Section):
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
    gradient_checkpointing: Bool
    compile: AutoBool
    packing: AutoBool                                 # auto = on CUDA (gsm8kctl/training/packing.py)
    logprob_chunk_tokens: Count
    num_processes: Count
    nccl_timeout_s: Count                             # timedelta(seconds=int(...)) in finetune.py
    keep_checkpoints: Count
    rl: RL


class Config(Section):
    model: Name
    backend: Backend
    machine: Literal["auto", "gpu", "cpu"]           # which column of sizes.SIZE_KEYS `auto` takes
    # numpy and torch take 32-bit seeds; per-rank and per-chunk offsets are added to this one.
    seed: Annotated[Int, Field(ge=0, le=2**31 - 1)]
    data_dir: Optional[Name]
    # auto = the whole GPU (1), or 1/R under `seeds` with R loops at once (sizes.gpu_share).
    gpu_memory_share: Union[Annotated[float, Field(gt=0, le=1)], Literal["auto"]]
    iterations: NonNegInt                             # 0 = only the initial evaluation
    attempts: Count
    max_agent_forks: Count
    use_rejection_sampling: Bool
    test_every_n_iterations: NonNegInt                # 0 = never evaluate
    eval_limit: Optional[Count]
    validation_problems: NonNegInt                    # held out of the train file; 0 = none
    warmup_sft_steps: NonNegInt
    warmup_sft_problems: NonNegInt                    # >= 1 when used (a rule below)
    warmup_sft_learning_rate: Optional[PosFloat]      # null = finetune.learning_rate
    test_before_warmup: Bool
    stop_without_signal: NonNegInt                    # 0 = never stop
    revisit_share: Annotated[float, Field(ge=0, le=1)]  # of each iteration's problems
    report_to: Annotated[list[Tracker], BeforeValidator(_comma_list)]
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


# ---------------------------------------------------------------------------------------------
# Annotations in words


def show(v: Any) -> str:
    """A value as the user typed it in YAML: true/false/null, strings quoted."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _split(tp: Any) -> tuple[Any, list]:
    """Annotated[T, m...] -> (T, [m...]), a Field(...)'s bounds spelled out (Ge(1), Le(0.95), ...)."""
    if typing.get_origin(tp) is not Annotated:
        return tp, []
    meta: list = []
    for m in tp.__metadata__:
        meta.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return tp.__origin__, meta


def _members(tp: Any) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Section)


def _range(meta: list) -> str:
    """'>= 1', 'in (0, 1]', or '' for no bounds (Field(ge=...) leaves Ge(ge=1) in the metadata);
    interval notation reads better than '> 0 and <= 1'."""
    b = {op: getattr(m, op) for m in meta for op in ("ge", "gt", "le", "lt") if getattr(m, op, None) is not None}
    lo = ("[", ">=", b["ge"]) if "ge" in b else ("(", ">", b["gt"]) if "gt" in b else None
    hi = ("]", "<=", b["le"]) if "le" in b else (")", "<", b["lt"]) if "lt" in b else None
    if lo and hi:
        return f"in {lo[0]}{_num(lo[2])}, {_num(hi[2])}{hi[0]}"
    return f"{(lo or hi)[1]} {_num((lo or hi)[2])}" if lo or hi else ""


def _word(base: Any) -> str:
    """A type without its bounds, in words: 'an integer', 'one of auto, true, false'."""
    if base is type(None):
        return "null"
    if typing.get_origin(base) is Literal:
        return "one of " + ", ".join(c if isinstance(c, str) else show(c) for c in typing.get_args(base))
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        return "a list of strings" if _split(item)[0] is str else "a list of " + describe(item).removeprefix("one of ")
    if is_section(base):
        return "a section"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[base]


def describe(tp: Any) -> str:
    """What an annotation accepts, in words, bounds included: 'an integer >= 1 or null'."""
    parts = []
    for member in _members(tp):
        base, meta = _split(member)
        if len(_members(base)) > 1:  # Annotated[Union[...], validator]
            parts.append(describe(base))
        else:
            parts.append(" ".join(filter(None, [_word(base), _range(meta)])))
    return " or ".join(parts)


# ---------------------------------------------------------------------------------------------
# Pydantic's errors in our words


class Invalid(ValueError):
    """A value that does not fit; its text is the problem: "must be >= 1, got 0"."""


_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_RULE_ERRORS = _BOUND_ERRORS | {"finite_number", "value_error"}  # a literal_error aside, the rest: a wrong type


def _bounds(tp: Any) -> list:
    """The bounds anywhere in `tp` (a union has at most one bounded member)."""
    base, meta = _split(tp)
    return meta + [m for member in _members(base) if member is not base for m in _bounds(member)]


def _list_item(tp: Any) -> Any:
    """The item type of the list in `tp` (report_to's trackers, openai.base_url's URLs)."""
    base = _split(tp)[0]
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0]
    return next((item for m in _members(base) if m is not base and (item := _list_item(m))), None)


def _is_item(err: dict) -> bool:
    return any(isinstance(p, int) for p in err["loc"])  # a list index below the field


def _explain(tp: Any, err: dict, value: Any) -> tuple[str, Any, str]:
    """One error of a value of type `tp` -> (problem, the value to show, hint): an item's error
    shows the item, and says 'items must be ...'."""
    item = _is_item(err)
    target, got, hint = (_list_item(tp), err["input"], "") if item else (tp, value, "")
    kind = err["type"]
    if kind == "literal_error":
        literal = _split(target)[0]
        text = f"must be {_word(literal)}"
        words = [c for c in typing.get_args(literal) if isinstance(c, str)]
        # 0.75: cosin -> cosine, grop -> grpo; not tensorrt -> transformers (0.6).
        close = difflib.get_close_matches(got, words, n=1, cutoff=0.75) if isinstance(got, str) else []
        hint = f"; did you mean {close[0]}?" if close else ""
    elif kind in _BOUND_ERRORS:
        text = f"must be {_range(_bounds(target))}"
    elif kind == "finite_number":
        text = "must be a finite number"
    elif kind == "value_error":  # one of our validators: its ValueError says it
        text, got = str(err["ctx"]["error"]), getattr(err["ctx"]["error"], "item", got)
    else:
        text = f"must be {_word(_split(target)[0])}"
    return (f"items {text}" if item else text), got, hint


def _problem(tp: Any, errors: list[dict], value: Any) -> str:
    """A value's pydantic errors (locs below the value) as one line: 'must be ..., got ...'.

    A union (null included) reports a member's objection to a value of its type: a bound, a
    validator, a list's item ("or null" where null would do); else every type it takes."""
    union = len(_members(tp)) > 1
    if union:
        errors = [err for err in errors if err["type"] in _RULE_ERRORS or _is_item(err)]
        if not errors:
            return f"must be {describe(tp)}, got {show(value)}"
    text, got, hint = _explain(tp, errors[0], value)
    if union and type(None) in _members(tp) and text.startswith("must be "):
        text += " or null"
    return f"{text}, got {show(got)}{hint}"


# ---------------------------------------------------------------------------------------------
# The checker


UNKNOWN, MISSING = "unknown key", "missing key"


def field_type(dotted: str) -> Any:
    """The annotation of key `a.b.c`, bounds and validators included (a section: its model);
    KeyError when there is no such key."""
    tp: Any = Config
    for part in dotted.split("."):
        if not is_section(tp):
            raise KeyError(dotted)
        info = tp.model_fields[part]
        tp = info.annotation if is_section(info.annotation) else info.rebuild_annotation()
    return tp


def dotted_keys(section: type[Section] = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, sections included (for "did you mean")."""
    out = []
    for name, info in section.model_fields.items():
        out.append(prefix + name)
        if is_section(info.annotation):
            out.extend(dotted_keys(info.annotation, f"{prefix}{name}."))
    return out


_ADAPTERS: dict[str, TypeAdapter] = {}


def check_value(dotted: str, value: Any) -> Any:
    """`value` for key `dotted`, normalised (1 -> 1.0 for a number, "a,b" -> [a, b] for a list),
    or Invalid."""
    if dotted not in _ADAPTERS:  # built on first use: the CLI checks a few keys one by one
        _ADAPTERS[dotted] = TypeAdapter(field_type(dotted), config=Section.model_config)
    try:
        return _ADAPTERS[dotted].validate_python(value)
    except ValidationError as exc:
        raise Invalid(_problem(field_type(dotted), exc.errors(include_url=False), value)) from None


def _locate(loc: tuple, section: type[Section]) -> tuple[tuple, list[str], FieldInfo | None]:
    """The key an error's `loc` blames: (its place in the report, its names, its field; None for
    an unknown key). At each level the report lists unknown keys first, then fields in YAML order."""
    place, names, info = [], [], None
    for part in loc:
        if info is not None and not is_section(info.annotation):
            break  # below a value: a union member or a list index
        section = info.annotation if info is not None else section
        names.append(str(part))
        if part not in section.model_fields:
            return (*place, (0, 0)), names, None
        place.append((1, list(section.model_fields).index(part)))
        info = section.model_fields[part]
    return tuple(place), names, info


def _problems(errors: list[dict], cfg: dict, section: type[Section], prefix: str) -> Iterator[tuple[str, str]]:
    """Pydantic's errors over `cfg`, one per key: (dotted key, problem), in the report's order."""
    found: dict[str, tuple[tuple, FieldInfo | None, list[dict]]] = {}
    for err in errors:
        place, names, info = _locate(err["loc"], section)
        below = {**err, "loc": err["loc"][len(names):]}
        found.setdefault(prefix + ".".join(names), (place, info, []))[2].append(below)
    for key, (_place, info, errs) in sorted(found.items(), key=lambda kv: kv[1][0]):
        if info is None:  # extra_forbidden, or invalid_key for a key that is not a string
            yield key, UNKNOWN
        elif errs[0]["type"] == "missing":
            yield key, MISSING
        elif is_section(info.annotation):
            yield key, "must be a section (a mapping of keys)"
        else:
            value = cfg
            for part in key.removeprefix(prefix).split("."):
                value = value[part]
            yield key, _problem(info.rebuild_annotation(), errs, value)


def _write_back(cfg: dict, checked: dict) -> None:
    for k, v in checked.items():
        if isinstance(v, dict):
            _write_back(cfg[k], v)  # sections stay the caller's dicts
        else:
            cfg[k] = v


def check_config(cfg: dict, section: type[Section] = Config, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Normalise `cfg` in place; yield (dotted key, problem) for each key that does not fit:
    UNKNOWN, MISSING, or 'must be ..., got ...'."""
    if not isinstance(cfg, dict):
        yield prefix.rstrip(".") or "config", "must be a section (a mapping of keys)"
        return
    try:
        checked = section.model_validate(cfg)
    except ValidationError as exc:
        yield from _problems(exc.errors(include_url=False), cfg, section, prefix)
        return
    _write_back(cfg, checked.model_dump())
