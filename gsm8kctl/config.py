"""Plain YAML configuration: `configs/default.yaml` holds every key; files and overrides merge on it.

One merge function, no object instantiation. Overrides are `key.sub=value` or `+key.sub=value`
(Hydra's "add" syntax, accepted as a plain override); values parse as YAML scalars.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import yaml

from gsm8kctl.errors import UserError
from gsm8kctl.jsonl import atomic_write_text

CONFIG_FILE = "config.yaml"


def default_config() -> dict:
    text = resources.files("gsm8kctl").joinpath("configs/default.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _flat_keys(cfg: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in cfg.items():
        full = f"{prefix}{k}"
        keys.append(full)
        if isinstance(v, dict):
            keys.extend(_flat_keys(v, full + "."))
    return keys


def _unknown_key(key: str, where: str, valid: list[str]) -> UserError:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UserError(f"{where}: unknown config key '{key}'{hint}")


def _check_type(key: str, value: Any, default: Any, where: str) -> Any:
    """Keep YAML's typing but refuse a value whose type cannot stand for the default's."""
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UserError(f"{where}: '{key}' expects true or false, got {value!r}")
    elif isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}: '{key}' expects a number, got {value!r}")
        if isinstance(default, float):
            return float(value)
    elif isinstance(default, list):
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise UserError(f"{where}: '{key}' expects a list, got {value!r}")
    elif isinstance(default, dict):
        if not isinstance(value, dict):
            raise UserError(f"{where}: '{key}' is a section, not a value")
    elif isinstance(default, str) and not isinstance(value, str):
        return str(value)
    return value


def _merge(base: dict, update: dict, where: str, prefix: str = "") -> None:
    valid = _flat_keys(default_config())
    for k, v in update.items():
        full = f"{prefix}{k}"
        if k not in base:
            raise _unknown_key(full, where, valid)
        if isinstance(base[k], dict):
            if not isinstance(v, dict):
                raise UserError(f"{where}: '{full}' is a section, not a value")
            _merge(base[k], v, where, full + ".")
        else:
            base[k] = _check_type(full, v, base[k], where)


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


def load_config(config_file: str | Path | None = None, overrides: Iterable[str] = ()) -> dict:
    """Defaults, then the YAML file, then `key=value` overrides, each checked against the defaults."""
    cfg = default_config()
    if config_file:
        p = Path(config_file)
        if not p.exists():
            raise UserError(f"{p}: no such config file")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark else ""
            raise UserError(f"{p}{line}: invalid YAML") from None
        if not isinstance(data, dict):
            raise UserError(f"{p}: expected a mapping of config keys")
        _merge(cfg, data, str(p))
    for text in overrides:
        key, value = parse_override(text)
        _merge(cfg, _nested(key, value), f"override '{text}'")
    return cfg


def get(cfg: dict, dotted: str) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        cur = cur[part]
    return cur


def set_value(cfg: dict, dotted: str, value: Any) -> None:
    """Set a key that exists in the defaults (typed options of the CLI use this)."""
    _merge(cfg, _nested(dotted, value), f"option for '{dotted}'")


def save_config(cfg: dict, path: str | Path) -> None:
    """Write the resolved config next to what a stage produced."""
    atomic_write_text(path, yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
