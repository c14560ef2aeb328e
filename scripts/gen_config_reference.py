"""Print the cluster.yaml reference (a Markdown table per section) from the pydantic schema.

Usage: python scripts/gen_config_reference.py [--check README.md | --write README.md]

The README holds this output between the markers below; ``--write`` replaces it there,
``--check`` exits 1 when the README's copy is stale (a unit test runs the check).
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleet.controlplane.config import ClusterConfig  # noqa: E402

BEGIN = "<!-- BEGIN cluster.yaml reference (scripts/gen_config_reference.py) -->"
END = "<!-- END cluster.yaml reference -->"


def _default(field) -> str:  # noqa: ANN001 (pydantic FieldInfo)
    if field.default_factory is not None:
        return "(section)"
    value = field.default
    return "null" if value is None else f"`{value}`"


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        for ann in _models_in(field.annotation):
            out += _sections(ann, f"{prefix}{name}.")
    return out


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The section models a field's type names: itself, or the members of a union
    (``job.entrypoint`` is ``builtin`` or a program's section)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType, typing.Annotated):
        return []
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def reference() -> str:
    lines = [BEGIN]
    for prefix, model in _sections(ClusterConfig):
        title = prefix.rstrip(".") or "top level"
        lines += ["", f"**{title}** — {model.__doc__.strip().splitlines()[0]}", "",
                  "| key | default | meaning |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                continue
            lines.append(f"| `{prefix}{name}` | {_default(field)} | {field.description or ''} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", type=Path, help="exit 1 if this file's reference is stale")
    group.add_argument("--write", type=Path, help="replace the reference in this file")
    ns = parser.parse_args(argv)
    ref = reference()
    target = ns.check or ns.write
    if target is None:
        print(ref)
        return 0
    text = target.read_text()
    if BEGIN not in text or END not in text:
        print(f"{target}: reference markers not found", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + ref + tail
    if ns.check:
        if new != text:
            print(f"{target}: cluster.yaml reference is stale; run "
                  f"python scripts/gen_config_reference.py --write {target}", file=sys.stderr)
            return 1
        return 0
    target.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
