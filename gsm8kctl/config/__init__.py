"""Plain YAML configuration: `default.yaml` (beside this package) holds every key; files and overrides merge on it.

One merge function, no object instantiation. Overrides are `key.sub=value` or `+key.sub=value`
(Hydra's "add" syntax, accepted as a plain override); values parse as YAML scalars. Typed CLI
options (--attempts, --max-tokens ...) merge last. The merged config is then checked once,
completely, against the typed schema in `config/schema.py`, pydantic models (each override also
as it is merged, so an option that wins cannot hide it): a bad value is one UserError that names
the key and where the value came from (the file, the override or the option), raised before any
model loads or file is written. The config stays a plain dict (`cfg["sampling"]["max_tokens"]`).
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from gsm8kctl.artifacts.jsonl import atomic_write_text
from gsm8kctl.config import schema, sizes
from gsm8kctl.errors import UserError

DEFAULTS_SOURCE = "gsm8kctl/config/default.yaml"


class _DuplicateKey(yaml.MarkedYAMLError):
    """A key given twice in one mapping; the mark is the second one."""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last, silently."""

    def construct_mapping(self, node, deep=False):
        first_line: dict = {}
        for key_node, _ in node.value:  # before SafeLoader flattens `<<` merges, which may repeat keys
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in first_line:
                    raise _DuplicateKey(problem=f"duplicate key {key!r} (first on line {first_line[key]})",
                                        problem_mark=key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def default_config(resolved: bool = True) -> dict:
    """default.yaml as a dict; `resolved`: its `auto` sizes filled in for this machine (sizes.py),
    as a library caller without a config of its own needs them."""
    text = resources.files("gsm8kctl.config").joinpath("default.yaml").read_text(encoding="utf-8")
    cfg = yaml.load(text, Loader=_ConfigLoader)
    if resolved:
        sizes.resolve(cfg)
    return cfg


def _read_file(p: Path) -> dict:
    """A --config file's mapping; bytes that are not UTF-8, bad YAML and a key given twice are
    refused with the file and line."""
    if not p.exists():
        raise UserError(f"{p}: no such config file")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{p}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    try:
        data = yaml.load(text, Loader=_ConfigLoader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        what = exc.problem if isinstance(exc, _DuplicateKey) else "invalid YAML"
        raise UserError(f"{p}{line}: {what}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping of config keys")
    return data


_DEFAULTS: dict | None = None


def setting(cfg: Mapping | None, dotted: str) -> Any:
    """`cfg`'s value of a dotted key, or default.yaml's where `cfg` lacks it: code that also runs
    without a full config (a backend made from Python) takes its defaults from the one place."""
    global _DEFAULTS
    cur: Any = cfg or {}
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            if _DEFAULTS is None:
                _DEFAULTS = default_config()
            return get(_DEFAULTS, dotted)
        cur = cur[part]
    return cur


def _unknown_key(key: str, where: str) -> UserError:
    close = difflib.get_close_matches(key, schema.dotted_keys(), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UserError(f"{where}: unknown config key '{key}'{hint}")


def _option_source(dotted: str) -> str:
    """`sampling.max_tokens` -> `option --max-tokens` (the CLI names options after the last part)."""
    return f"option --{dotted.rsplit('.', 1)[-1].replace('_', '-')}"


def _checked(dotted: str, value: Any, where: str) -> Any:
    if value == sizes.AUTO and dotted in sizes.SIZE_KEYS:
        return value  # filled in for the machine once every source is merged
    try:
        return schema.check_value(dotted, value)
    except schema.Invalid as exc:
        raise UserError(f"{where}: {dotted} {exc}") from None


def _merge(base: dict, update: dict, where: str, origins: dict[str, str], prefix: str = "",
           check: bool = False) -> None:
    """Copy `update` onto `base` (keys must exist there); record in `origins` who set each key.
    `check`: judge (and normalise) each value now, not only the final config, where a later
    source would hide it."""
    for k, v in update.items():
        full = f"{prefix}{k}"
        if k not in base:
            raise _unknown_key(full, where)
        if isinstance(base[k], dict):
            if v is None:  # a section whose keys are all commented out
                continue
            if not isinstance(v, dict):
                raise UserError(f"{where}: '{full}' is a section, not a value")
            _merge(base[k], v, where, origins, full + ".", check)
        else:
            base[k] = _checked(full, v, where) if check else v
            origins.pop(full, None)  # re-inserted last: a rule between keys blames the latest setter
            origins[full] = where


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=1` or `+a.b=1` -> ("a.b", 1)."""
    if "=" not in text:
        raise UserError(f"bad override '{text}': expected key=value (e.g. finetune.learning_rate=1e-6)")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise UserError(f"bad override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    # YAML reads 1e-6 as a string (it wants 1.0e-6); people type the former.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return key, value


def _nested(key: str, value: Any) -> dict:
    out: dict = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return out


def _blame(keys: Iterable[str], origins: Mapping[str, str], fallback: str) -> str:
    """The source that set the latest of `keys` (origins keep setting order)."""
    order = {k: i for i, k in enumerate(origins)}
    set_keys = [k for k in keys if k in order]
    return origins[max(set_keys, key=order.__getitem__)] if set_keys else fallback


def validate(cfg: dict, origins: Mapping[str, str] | None = None, command: str | None = None,
             fallback: str = "config") -> dict:
    """Check `cfg` against the schema, normalising it in place (1 -> 1.0 for a float key); returns it.

    `origins` maps dotted keys to the source that set them, for the error; `command` adds the
    rules only that CLI command needs (schema.RULES). Raises the first problem as UserError.
    """
    origins = origins or {}
    for key, problem in schema.check_config(cfg):
        where = origins.get(key, fallback)
        if problem == schema.UNKNOWN:
            raise _unknown_key(key, where)
        if problem == schema.MISSING:
            raise UserError(f"{where}: missing config key '{key}'")
        raise UserError(f"{where}: {key} {problem}")
    for rule, message in schema.broken_rules(cfg, command):
        raise UserError(f"{_blame(rule.keys, origins, fallback)}: {message}")
    return cfg


def load_config(config_file: str | Path | None = None, overrides: Iterable[str] = (),
                options: Mapping[str, Any] | None = None, command: str | None = None,
                sizes_chosen: dict | None = None) -> dict:
    """Defaults, then the YAML file, then `key=value` overrides, then typed `options` (dotted key ->
    value; None = not given); then the sizes left at `auto` are filled in for the machine (given
    back in `sizes_chosen`); the result is checked against the schema (and `command`'s rules)."""
    cfg = default_config(resolved=False)
    origins: dict[str, str] = {}
    if config_file:
        p = Path(config_file)
        # Not checked per value: a preset's bad key may be fixed on the command line.
        _merge(cfg, _read_file(p), str(p), origins)
    for text in overrides:
        key, value = parse_override(text)
        # Checked as typed: `sampling.max_tokens=abc --max-tokens 4` is a mistake, not a preference.
        _merge(cfg, _nested(key, value), f"override '{text}'", origins, check=True)
    for key, value in (options or {}).items():
        if value is not None:
            _merge(cfg, _nested(key, value), _option_source(key), origins)
    chosen = sizes.resolve(cfg)
    # First in setting order: a rule between keys blames what the user set, not the machine's size.
    origins = {**{key: f"{key}=auto ({cfg['machine']})" for key in chosen if key not in origins}, **origins}
    if sizes_chosen is not None:
        sizes_chosen.update(chosen)
    return validate(cfg, origins, command=command, fallback=DEFAULTS_SOURCE)


def get(cfg: dict, dotted: str) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        cur = cur[part]
    return cur


def set_value(cfg: dict, dotted: str, value: Any, where: str | None = None) -> None:
    """Set one existing key, checked against the schema (stages apply their typed options with this)."""
    where = where or _option_source(dotted)
    _merge(cfg, _nested(dotted, value), where, {}, check=True)
    try:
        for _rule, message in schema.broken_rules(cfg, involving=dotted):
            raise UserError(f"{where}: {message}")
    except KeyError:  # a partial config (a library caller's): the rules cannot be judged here
        pass


def save_config(cfg: dict, path: str | Path) -> None:
    """Write the resolved config next to what a stage produced."""
    atomic_write_text(path, yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
