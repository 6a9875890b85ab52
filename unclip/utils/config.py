"""The strict config loader every schema of the package goes through.

The schemas live with what they describe: the networks' in :mod:`unclip.nets.config`
(:class:`~unclip.nets.config.PriorConfig`, :class:`~unclip.nets.config.DecoderConfig`, ...), the
CLIP's in :mod:`unclip.nets.clip`, the noise schedule's in :mod:`unclip.diffusion.config`, the
sampling settings in :mod:`unclip.sampling.settings`, a training run's in
:mod:`unclip.train.config`.

Loading is strict: an unknown or misspelt key is an error that names the key, the file and the
closest valid key; values are type-checked; the resolved config is printable (:func:`to_yaml`) and
saved beside every checkpoint (:func:`save_config`).

Example::

    from unclip.nets.config import DecoderConfig
    from unclip.utils.config import load_config, to_yaml
    cfg = load_config({"sample_size": 32}, ["layers_per_block=2"], schema=DecoderConfig)
    print(to_yaml(cfg))
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

__all__ = [
    "ConfigError",
    "load_config",
    "from_dict",
    "to_dict",
    "to_yaml",
    "load_yaml_file",
    "save_config",
    "apply_overrides",
]


class ConfigError(ValueError):
    """A configuration file or override is invalid (unknown key, wrong type, bad value)."""


# --------------------------------------------------------------------------------------------------
# Strict conversion dict <-> dataclass
# --------------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


_SCALARS = {
    bool: ("true or false", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("a string", (str,)),
}


def _convert(value: Any, tp: Any, where: str, source: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert it (nested dataclasses, int→float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(value, non_none[0], where, source)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where, source)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{source}: '{where}' must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if isinstance(value, bool) and any(isinstance(a, str) for a in args):
            raise ConfigError(
                f"{source}: '{where}' must be one of {list(args)}, got the boolean {value!r}: YAML "
                f"reads unquoted no/yes/on/off as booleans, so quote the word (e.g. 'no')"
            )
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{source}: '{where}' must be one of {list(args)}, got {value!r}{hint}"
            )
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a dataclass type, not instance
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(
                f"{source}: '{where}' must be a mapping of {tp.__name__} fields, got {value!r}"
            )
        return from_dict(tp, value, source=source, prefix=where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: '{where}' must be a list, got {value!r}")
        item_tp = args[0] if args else Any
        return [_convert(v, item_tp, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{where}' must be a mapping, got {value!r}")
        return dict(value)
    if tp in _SCALARS:
        what, accepted = _SCALARS[tp]
        if not isinstance(value, accepted) or (tp is not bool and isinstance(value, bool)):
            raise ConfigError(f"{source}: '{where}' must be {what}, got {value!r}")
        # checked just above: an int or a float when tp is float
        return float(typing.cast(float, value)) if tp is float else value
    raise TypeError(f"unsupported annotation {tp!r} at {where}")  # internal: schema bug


def from_dict(cls: type, data: dict, *, source: str = "<dict>", prefix: str = ""):
    """Build dataclass ``cls`` from ``data`` strictly: unknown keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix or cls.__name__}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=3, cutoff=0.5)
            # a valid key with letters appended ("lrate") means that key, even where another one
            # shares more letters ("lora")
            close = [c for c in close if str(key).startswith(c)][:1] or close[:1]
            hint = (
                f"; did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else ""
            )
            raise ConfigError(
                f"{source}: unknown key '{where}'{hint} (valid keys here: {', '.join(names)})"
            )
        kwargs[key] = _convert(value, hints[key], where, source)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:  # a required field without default
        raise ConfigError(f"{source}: {prefix or cls.__name__}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """Plain dict/list form of a config (safe for YAML and JSON)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if type(obj).__name__.endswith("Scheduler") and hasattr(obj, "config"):
        return type(obj).__name__  # a diffusers scheduler instance: recorded by its class
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _without_defaults(obj: Any, cls: type, names: tuple[str, ...]) -> Any:
    values = to_dict(obj)
    if not isinstance(values, dict):
        return values
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return {
        k: v for k, v in values.items() if not (k in names and k in defaults and v == defaults[k])
    }


def to_yaml(obj: Any) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def save_config(obj: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(obj))
    os.replace(tmp, path)


def apply_overrides(
    data: dict, overrides: list[str] | tuple[str, ...], source: str = "command line"
) -> dict:
    """Apply dotted ``key.sub=value`` overrides to a plain dict (values parsed as YAML scalars)."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"{source}: override {item!r} must look like 'section.key=value' "
                "(e.g. train.lr=3e-4)"
            )
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"{source}: override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
            # YAML 1.1 reads no/yes/on/off as booleans; on a command line they are words
            # (train.mixed_precision=no)
            value = raw.strip()
        if isinstance(value, str):  # YAML reads '3e-4' as a string; accept it as a number
            try:
                value = float(value) if any(c in value for c in ".eE") else value
            except ValueError:
                pass
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"{source}: cannot set {dotted!r}: '{k}' is not a section")
            node[k] = child = dict(child)
            node = child
        node[keys[-1]] = value
    return data


def load_yaml_file(path: str | os.PathLike, option: str) -> dict:
    """The mapping in the YAML file ``path`` (empty: ``{}``); a missing file, invalid YAML or
    another top level is a one-line :class:`ConfigError` naming ``option`` and the file."""
    if not Path(path).is_file():
        raise ConfigError(f"{option} {path}: file not found; give the path of a YAML file")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{option} {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{option} {path}: must hold a mapping, got {type(data).__name__}")
    return data


def load_config(
    path: str | os.PathLike | dict | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    schema: type,
):
    """Load a YAML file (or a dict; ``None``: the defaults) into dataclass ``schema`` with dotted
    overrides applied, strictly.

    Raises :class:`ConfigError` naming the key, the file and the closest valid key on a misspelling.
    A training run's stage config loads with :func:`unclip.train.config.load_stage_config`.
    """
    if path is None:
        data, source = {}, "<defaults>"
    elif isinstance(path, dict):
        data, source = to_dict(path), "<dict>"
    else:
        source = str(path)
        if not Path(path).is_file():
            raise ConfigError(
                f"config file not found: {source}; pass the path of a YAML file (see configs/)"
            )
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}: top level must be a mapping of sections, got {type(data).__name__}"
            )
    if overrides:
        data = apply_overrides(data, list(overrides))
        source = f"{source} (with overrides)"
    return from_dict(schema, data, source=source)
