"""The import rule of docs/design.md: lower layers never import upper ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "shoal"

RECORDS = ("shoal.config", "shoal.request", "shoal.sampling", "shoal.structured_output")
CONTRACT = ("shoal.connectors.base", "shoal.connectors.registry", "shoal.connectors.watchdog")
# package prefix -> what its modules may import of shoal (prefixes); None = no rule
ALLOWED = {
    "shoal.kv": ("shoal.kv", "shoal.request", "shoal.sampling"),
    "shoal.model": ("shoal.model",),
    # the pool connectors: over the store layer, which imports only the contract
    "shoal.connectors.store": ("shoal.connectors.base", "shoal.connectors.store",
                               "shoal.kv.block_keys"),
    "shoal.connectors.fs": ("shoal.connectors.base", "shoal.connectors.fs",
                            "shoal.connectors.store", "shoal.kv.block_keys"),
    "shoal.connectors.redis": ("shoal.connectors.base", "shoal.connectors.redis",
                               "shoal.connectors.store", "shoal.connectors.fs.admin"),
    "shoal.connectors": CONTRACT,
    "shoal.engine": ("shoal.engine", "shoal.kv", "shoal.model", *CONTRACT, *RECORDS),
    "shoal.parallel": ("shoal.parallel", "shoal.engine", "shoal.kv", "shoal.model", *CONTRACT,
                       *RECORDS),
    "shoal.request": ("shoal.sampling",),
    "shoal.sampling": ("shoal.logits_processing", "shoal.structured_output"),
    "shoal.logits_processing": (),
    "shoal.structured_output": (),
    "shoal.config": ("shoal.connectors.base",),
}
MODE_STRINGS = {"tp", "adp", "single"}
# where a parallel mode may be named: the parallel package, and where users name it
MODE_ALLOWED = ("shoal.parallel", "shoal.config", "shoal.serving.cli", "shoal.bench")


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        yield name.removesuffix(".__init__"), ast.parse(path.read_text())


def imports(tree: ast.AST) -> set[str]:
    """Every module imported anywhere in the file (also inside functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def rule_for(name: str):
    owners = [p for p in ALLOWED if name == p or name.startswith(p + ".")]
    return ALLOWED[max(owners, key=len)] if owners else None


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("name, tree", list(modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_follow_the_layers(name, tree):
    allowed = rule_for(name)
    shoal_imports = {m for m in imports(tree) if m == "shoal" or m.startswith("shoal.")}
    if allowed is not None:
        # `from shoal.x import y` also lists shoal.x.y, which may be a name, not a module
        bad = {m for m in shoal_imports
               if not under(m, allowed) and not under(m.rpartition(".")[0], allowed)}
        assert not bad, f"{name} imports {sorted(bad)} (allowed: {allowed})"
    if not name.startswith("shoal.parallel"):
        assert not any(m.startswith("torch.distributed") for m in imports(tree)), name


@pytest.mark.parametrize("name, tree", list(modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_no_branch_on_a_mode_string_outside_parallel(name, tree):
    if under(name, MODE_ALLOWED):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
            assert not MODE_STRINGS & set(consts), f"{name}:{node.lineno} compares with a mode"


def test_the_rule_catches_a_violation():
    tree = ast.parse("from shoal.parallel.comm import Comm\nimport torch.distributed as dist\n")
    allowed = rule_for("shoal.engine.scheduler")
    assert {m for m in imports(tree) if m.startswith("shoal.") and not under(m, allowed)
            and not under(m.rpartition(".")[0], allowed)}
    mode = ast.parse("if info.mode == 'tp': pass")
    assert any(isinstance(n, ast.Compare) for n in ast.walk(mode))
