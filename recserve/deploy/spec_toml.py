"""A :class:`~recserve.config.spec.ClusterConfig` written back as TOML.

``recserve deploy render`` ships the spec the pods read in a ConfigMap: the user's spec
with ``shard_addresses`` set to the shards' stable DNS names. It is written from the
validated object, not patched into the user's text, so whatever the user wrote (comments,
defaults left out) the pods read exactly the config the render checked; the round trip
``loads(dumps(c)) == c`` is a unit test. Generic over the dataclasses, so a section added
to the spec later is written without a change here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from recserve.config.spec import ClusterConfig
from recserve.errors import ConfigError

__all__ = ["dumps"]


def _value(field: str, v: Any) -> str:
    """One TOML value: bool, int, float (inf / nan as TOML spells them), str, list."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string (same escapes)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_value(field, x) for x in v) + "]"
    raise ConfigError(f"{field} = {v!r} cannot be written as TOML: a spec field of type {type(v).__name__} is not supported by recserve.deploy.spec_toml")


def _table(header: str, obj: Any, out: list[str]) -> None:
    """``[header]`` (or ``[[header]]`` lines already in ``header``) with ``obj``'s fields;
    None fields (an unset override) are left out; nested dataclasses become sub-tables."""
    out.append(header)
    nested: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if v is None:
            continue
        if dataclasses.is_dataclass(v):
            nested.append((f.name, v))
            continue
        out.append(f"{f.name} = {_value(f.name, v)}")
    name = header.strip("[]")
    for key, sub in nested:
        out.append("")
        _table(f"[{name}.{key}]", sub, out)


def dumps(cluster: ClusterConfig) -> str:
    """The TOML text of ``cluster`` (every field, defaults included).

    >>> from recserve.config import default_config, loads
    >>> loads(dumps(default_config())) == default_config()
    True
    """
    top: list[str] = ["# Rendered by `recserve deploy render` from the validated spec: edit the source spec and re-render."]
    sections: list[str] = []
    for f in dataclasses.fields(cluster):
        v = getattr(cluster, f.name)
        if dataclasses.is_dataclass(v):
            sections.append("")
            _table(f"[{f.name}]", v, sections)
        elif isinstance(v, tuple) and v and dataclasses.is_dataclass(v[0]):
            for entry in v:
                sections.append("")
                _table(f"[[{f.name}]]", entry, sections)
        else:  # top-level keys (shard_addresses) must precede every table header
            top.append(f"{f.name} = {_value(f.name, v)}")
    return "\n".join(top + sections) + "\n"
