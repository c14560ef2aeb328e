"""Overrides of cluster.yaml keys without editing the file: `--set KEY=VALUE` and the
``FLEET_*`` environment variables that stand for a key.

An override names a dotted path into cluster.yaml's mapping (``job.steps``,
``detect.hang.action``, ``chaos.faults.0.kind``: a number indexes a list) and a value,
parsed as one YAML value (``1000``, ``true``, ``[--lr, "0.1"]``, ``{rank: 1}``; an empty
value is YAML's null). ``apply_overrides`` sets them, in order, on the parsed mapping
*before* validation, so an overridden value is checked exactly as the same value written
in the file would be (``config.validate_cluster_data``), and an error names the override
as the user wrote it (``Override.source``: ``--set job.steps=abc``, ``FLEET_STORE=...``).

Pure: imports YAML and the error hierarchy, reads no environment (the CLI does).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from fleet.controlplane.errors import ConfigError

#: The flag that gives overrides on the command line.
SET_FLAG = "--set"
_SET_HINT = "write it as --set KEY=VALUE, KEY a dotted cluster.yaml key: --set job.steps=1000"
_KEYS_HINT = "`fleet config show` prints the keys as fleet reads them; `fleet config schema` describes every one"


@dataclass(frozen=True)
class Override:
    """One key set to one value. ``key``: the dotted path's parts; ``source``: how the
    user gave it, the first words of any error about it."""

    key: tuple[str, ...]
    value: Any
    source: str

    @property
    def dotted(self) -> str:
        return ".".join(self.key)


def parse_override(text: str, flag: str = SET_FLAG) -> Override:
    """``KEY=VALUE`` as an ``Override``; ``ConfigError`` naming ``flag`` when the text has
    no ``=``, an empty key or key part, or a value that is not one YAML value."""
    shown = f"{flag} {text}" if text.isprintable() else f"{flag} {text!r}"
    key_text, eq, value_text = text.partition("=")
    if not eq:
        raise ConfigError(f"{shown}: expected KEY=VALUE (no '=')", hint=_SET_HINT)
    key_text = key_text.strip()
    if not key_text:
        raise ConfigError(f"{shown}: the key before '=' is empty", hint=_SET_HINT)
    parts = tuple(key_text.split("."))
    if any(not p.strip() for p in parts):
        raise ConfigError(f"{shown}: {key_text!r} has an empty part between dots", hint=_SET_HINT)
    return Override(parts, parse_value(value_text, shown), shown)


def parse_value(text: str, source: str) -> Any:
    """``text`` as one YAML value (what it would mean after ``key:`` in the file);
    ``ConfigError`` naming ``source`` when it is not one."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: not one YAML value: {' '.join(str(problem).split())}",
                          hint='quote a value that YAML would read as more: --set \'job.name="a: b"\'') from None
    except ValueError as exc:  # an impossible date, which PyYAML turns into a datetime
        raise ConfigError(f"{source}: not one YAML value: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not one YAML value: nested too deeply") from None


def parse_overrides(texts: Sequence[str] | None, flag: str = SET_FLAG) -> list[Override]:
    """Every ``KEY=VALUE`` of a repeated flag, in order."""
    return [parse_override(t, flag) for t in texts or ()]


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A copy of ``data`` (cluster.yaml's parsed mapping) with every override set, in
    order (a later one wins). A missing section on the way is created; a list is
    indexed by a number within it; a value on the way that is neither is a
    ``ConfigError`` naming the override. Unknown keys are left to validation, which
    names them."""
    out = copy.deepcopy(dict(data))
    for o in overrides:
        node: Any = out
        for depth, part in enumerate(o.key):
            last = depth == len(o.key) - 1
            where = ".".join(o.key[:depth])
            if isinstance(node, dict):
                if last:
                    node[part] = copy.deepcopy(o.value)
                elif not isinstance(node.get(part), (dict, list)):
                    if node.get(part) is not None:
                        raise ConfigError(f"{o.source}: {'.'.join(o.key[:depth + 1])} is "
                                          f"{_shown(node[part])}, not a section with keys", hint=_KEYS_HINT)
                    node[part] = {}  # absent, or `key:` left empty in the file
                if not last:
                    node = node[part]
            elif isinstance(node, list):
                if not (part.isascii() and part.isdigit() and int(part) < len(node)):
                    raise ConfigError(f"{o.source}: {where} is a list of {len(node)} item(s); "
                                      f"{part!r} is not an index in it (0 to {len(node) - 1})", hint=_KEYS_HINT)
                if last:
                    node[int(part)] = copy.deepcopy(o.value)
                else:
                    if node[int(part)] is None:
                        node[int(part)] = {}
                    node = node[int(part)]
            else:
                raise ConfigError(f"{o.source}: {where} is {_shown(node)}, not a section with keys", hint=_KEYS_HINT)
    return out


def blamed(overrides: Sequence[Override], loc: Sequence[Any], message: str,
           unknown_key: bool = False) -> tuple[Override | None, bool]:
    """The override a validation error at ``loc`` (pydantic's path) with ``message`` is
    about, and whether it alone is to blame: (the last override that set ``loc`` or a
    section holding it, True), else (the last whose key the message names, True), else
    (the last set inside the section at ``loc``, False: that section's own rule failed,
    on the file's values and the override's together; True when ``unknown_key``, the
    override's path made the key, or when the message names the key within the
    section), else (None, False)."""
    path = tuple(str(p) for p in loc)
    for o in reversed(overrides):
        if path[:len(o.key)] == o.key:
            return o, True
    for o in reversed(overrides):
        if o.dotted in message:
            return o, True
    for o in reversed(overrides):
        if o.key[:len(path)] == path:
            # the section's rule names the key the override set (``job: steps is ...``)
            rest = re.escape(".".join(o.key[len(path):]))
            return o, unknown_key or re.search(rf"(?<![\w.]){rest}(?![\w.])", message) is not None
    return None, False


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
