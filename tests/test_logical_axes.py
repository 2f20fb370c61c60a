"""Every logical axis name the model uses is in ``sharding.rules.LOGICAL_AXES``, and every preset has a rule for it.

A name missing from a preset maps to no mesh axis, so the dimension is silently replicated. Parameter names come
from ``jax.eval_shape`` of the init of every bundled config (abstract shapes only, nothing compiled); the names of
constrained activations, kernel operands run per shard and cache layouts are read from the sources (``ast``):
the string constants in the ``names`` arguments of the calls in :data:`NAME_ARGUMENTS`, following a variable to
its assignments in the same module.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import flax.linen as nn
import jax
import pytest

from k3_jax.config import load_config
from sharding import rules
from sharding.plan import abstract_params

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.json"))
PRESET_FILES = sorted((REPO / "configs" / "sharding").glob("*.json"))

#: callee name -> (positions, keywords) of its logical-name arguments
NAME_ARGUMENTS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "constrain": ((1,), ("names",)),
    "with_logical_constraint": ((1,), ("names",)),
    "per_shard": ((2, 3), ("in_names", "out_names")),
    "logical_to_pspec": ((0,), ("names",)),
}


def _parameter_names(boxed) -> set[str]:
    specs = nn.get_partition_spec(boxed)
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return {name for spec in leaves for name in spec if name is not None}


@pytest.mark.parametrize("config", [*CONFIGS, "k3-tiny.json+mxfp4"])
def test_parameter_axis_names_are_in_the_table(config):
    name, _, variant = config.partition("+")
    cfg = load_config(REPO / "configs" / name, **({"expert_format": "mxfp4"} if variant else {}))
    unknown = _parameter_names(abstract_params(cfg)) - set(rules.LOGICAL_AXES)
    assert not unknown, f"{config}: parameter logical axes {sorted(unknown)} are not in sharding.rules.LOGICAL_AXES"


def _strings(node: ast.AST, assignments: dict[str, list[ast.AST]], seen: frozenset[str] = frozenset()) -> set[str]:
    """String constants in ``node`` (dict values only, not keys), following names to their assignments."""
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) else set()
    if isinstance(node, ast.Name):
        if node.id in seen:
            return set()
        return set().union(*(_strings(v, assignments, seen | {node.id}) for v in assignments.get(node.id, [])))
    if isinstance(node, ast.Dict):
        return set().union(*(_strings(v, assignments, seen) for v in node.values))
    if isinstance(node, ast.Subscript):  # CACHE_NAMES[kind]: the values of the mapping
        return _strings(node.value, assignments, seen)
    if isinstance(node, ast.Tuple | ast.List | ast.Starred):
        elts = node.elts if not isinstance(node, ast.Starred) else [node.value]
        return set().union(*(_strings(e, assignments, seen) for e in elts))
    return set()


def constrained_names(path: Path) -> dict[str, set[str]]:
    """``{"file:line": logical names}`` for the calls of :data:`NAME_ARGUMENTS` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    assignments: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assignments.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            assignments.setdefault(node.target.id, []).append(node.value)
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if callee not in NAME_ARGUMENTS:
            continue
        positions, keywords = NAME_ARGUMENTS[callee]
        args = [node.args[i] for i in positions if i < len(node.args)]
        args += [kw.value for kw in node.keywords if kw.arg in keywords]
        names = set().union(*(_strings(a, assignments) for a in args))
        if names:
            found[f"{path.relative_to(REPO)}:{node.lineno}"] = names
    return found


def test_constrained_activation_names_are_in_the_table():
    sources = [p for pkg in ("k3_jax", "sharding") for p in sorted((REPO / pkg).rglob("*.py"))]
    found = {where: names for p in sources for where, names in constrained_names(p).items()}
    assert any("model.py" in where for where in found), "the scan found no activation constraint in the model"
    unknown = {where: sorted(names - set(rules.LOGICAL_AXES)) for where, names in found.items()
               if names - set(rules.LOGICAL_AXES)}
    assert not unknown, f"logical axes not in sharding.rules.LOGICAL_AXES: {unknown}"


@pytest.mark.parametrize("preset", ["train", "serve", "long-context", *(p.stem for p in PRESET_FILES)])
def test_every_preset_has_a_rule_for_every_logical_axis(preset):
    named = [name for name, _ in rules.get_preset(preset)]
    missing = sorted(set(rules.LOGICAL_AXES) - set(named))
    assert not missing, f"preset {preset!r} has no rule for {missing} (those dimensions would be replicated)"
    unknown = sorted(set(named) - set(rules.LOGICAL_AXES))
    assert not unknown, f"preset {preset!r} has rules for names no array uses: {unknown}"


def test_preset_files_are_valid_json_presets():
    for path in PRESET_FILES:
        assert "rules" in json.loads(path.read_text()), path
