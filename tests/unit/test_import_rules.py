"""DESIGN.md's dependency rules hold on this checkout, one test case per rule, and the
checker (scripts/import_rules.py: what counts as an import, and which rule follows
imports transitively, is documented there) catches each rule's violation in a small
synthetic tree, so it can fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def _load_checker():
    spec = importlib.util.spec_from_file_location("_fleet_import_rules", REPO / "scripts" / "import_rules.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module    # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


checker = _load_checker()
RULES, Tree, scan, read_roots = checker.RULES, checker.Tree, checker.scan, checker.read_roots
DIAGNOSIS, STORE = checker.DIAGNOSIS, checker.STORE


@pytest.fixture(scope="module")
def repo_tree() -> Tree:
    return scan(REPO, read_roots(REPO / "setup.py"))


def test_the_tree_is_read(repo_tree):
    for root in ("fleet", "fleet.controlplane", "fleet.agent", "fleet.workers", "fleet.proto",
                 DIAGNOSIS, STORE):
        assert root in repo_tree.fleet, f"{root} not found: setup.py's ROOTS and the scan disagree"
    assert sum(len(m.imports) for m in repo_tree.fleet.values()) > 500
    assert any(m.name.startswith("tests.") for m in repo_tree.other)


@pytest.mark.parametrize("rule", list(RULES))
def test_dependency_rule(rule, repo_tree):
    violations = RULES[rule](repo_tree)
    assert not violations, f"rule {rule!r} (DESIGN.md, Dependency rules) is broken:\n" + "\n".join(violations)


SYNTHETIC_ROOTS = {"fleet": "fleet", "fleet.controlplane": "cp", "fleet.agent": "ag",
                   "fleet.workers": "wk", "fleet.proto": "pr/fleet/proto"}
SYNTHETIC = {
    "fleet/__init__.py": "",
    "cp/__init__.py": "",
    "cp/store/__init__.py": "import sqlalchemy\n",
    "cp/diagnosis/__init__.py": "from . import engine\n",
    "cp/diagnosis/engine.py": "from fleet.controlplane import helpers\nif TYPE_CHECKING:\n    import ray\n",
    "cp/helpers.py": "import grpc\ndef later():\n    import torch\n",
    "cp/detectors.py": "from .util import clamp\n",
    "cp/util.py": "from ray import get\n",
    "cp/policy.py": "import math\n",
    "cp/placement.py": "from fleet.proto import kinds\n",
    "cp/supervision.py": "import enum\n",
    "cp/cli.py": "def run():\n    import sqlalchemy.orm\n",
    "cp/a.py": "from fleet.controlplane import b\n",
    "cp/b.py": "import fleet.controlplane.a\n",
    "cp/c.py": "import fleet.controlplane.d\n",
    "cp/d.py": "import typing\nif typing.TYPE_CHECKING:\n    import fleet.controlplane.c\n",
    "ag/__init__.py": "",
    "ag/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fleet.controlplane.store import Store\n",
    "wk/__init__.py": "",
    "wk/w.py": "def f():\n    from ..controlplane import store\n",
    "pr/fleet/proto/__init__.py": "",
    "pr/fleet/proto/kinds.py": "import enum\n",
    "pr/fleet/proto/x_pb2_grpc.py": "import grpc\nimport proto\n",
    "tests/__init__.py": "",
    "tests/t.py": "import controlplane.config\ntry:\n    import proto\nexcept ImportError:\n    pass\n",
    "bench/b.py": "import importlib\nimportlib.import_module('workers.x')\n",
    "scripts/s.py": "import fleet.controlplane\n",
}
#: exactly what each rule must report on SYNTHETIC (one substring per violation)
CAUGHT = {
    "workers-import-no-controlplane-or-agent": ["wk/w.py:2: fleet.workers.w imports fleet.controlplane.store:"],
    "agent-imports-no-store": ["ag/a.py:3: fleet.agent.a imports fleet.controlplane.store:"],
    "agent-imports-no-controlplane": ["ag/a.py:3: fleet.agent.a imports fleet.controlplane.store:"],
    "diagnosis-imports-no-torch-ray-grpc": [
        "cp/diagnosis/engine.py:3: fleet.controlplane.diagnosis.engine imports ray (ray)",
        "cp/helpers.py:1: fleet.controlplane.helpers imports grpc (grpc), reached by "
        "fleet.controlplane.helpers <- fleet.controlplane.diagnosis.engine:"],
    "sqlalchemy-only-in-store": ["cp/cli.py:2: fleet.controlplane.cli imports sqlalchemy.orm:"],
    "decision-logic-imports-no-ray-grpc": [
        "cp/util.py:1: fleet.controlplane.util imports ray (ray), reached by "
        "fleet.controlplane.util <- fleet.controlplane.detectors:"],
    "no-old-top-level-names": ["bench/b.py:2: bench.b imports workers.x:", "tests/t.py:1: tests.t imports controlplane.config:"],
    "no-import-cycles": ["import cycle among fleet.controlplane.a, fleet.controlplane.b:\n"
                         "    cp/a.py:1 fleet.controlplane.a -> fleet.controlplane.b\n"
                         "    cp/b.py:1 fleet.controlplane.b -> fleet.controlplane.a"],
}


@pytest.fixture
def synthetic(tmp_path) -> Tree:
    for rel, text in SYNTHETIC.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "setup.py").write_text(f"ROOTS = {SYNTHETIC_ROOTS!r}\nsetup()\n")
    return scan(tmp_path, read_roots(tmp_path / "setup.py"))


def test_every_rule_has_a_planted_violation():
    assert set(CAUGHT) == set(RULES)


@pytest.mark.parametrize("rule", list(RULES))
def test_checker_catches_the_planted_violation(rule, synthetic):
    """Each rule reports exactly the planted violations: relative imports resolved,
    function-level and TYPE_CHECKING imports counted for layering, a function-level
    import outside the subject not followed, a TYPE_CHECKING back-edge no cycle, a
    guarded probe and the generated stub exempt."""
    got = sorted(RULES[rule](synthetic))
    assert len(got) == len(CAUGHT[rule]), "\n".join(got)
    for violation, expected in zip(got, sorted(CAUGHT[rule])):
        assert violation.startswith(expected), f"{violation!r}\ndoes not start with\n{expected!r}"


def test_a_missing_subject_is_an_error(synthetic):
    del synthetic.fleet["fleet.controlplane.policy"]
    with pytest.raises(AssertionError, match="fleet.controlplane.policy"):
        RULES["decision-logic-imports-no-ray-grpc"](synthetic)
