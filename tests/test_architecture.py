"""The import direction of the package sources: a module imports only from its own layer or an earlier one.

Read from the sources with ``ast`` (nothing is imported or executed); every ``import`` counts, also those inside
functions and ``if TYPE_CHECKING:`` blocks, so a back edge cannot hide in a function body.

| # | layer        | modules (a name covers its submodules; ``=name``: that module only)                |
|---|--------------|-------------------------------------------------------------------------------------|
| 0 | kernels      | ``pallas_kernels`` (references, Pallas kernels, dispatch, MXFP4/MXFP8 codecs)        |
| 1 | leaves       | ``=k3_jax``, ``.errors``, ``.config`` (+ ``.vision.config``), ``.xla_flags``,         |
|   |              | ``.compile_cache``, ``.tokenizer``, ``.progress``, ``.vision.processor``/``.content`` |
| 2 | sharding     | ``sharding`` (mesh, logical-axis rules and presets, per-shard wrapper, memory plan)  |
| 3 | quant        | ``k3_jax.quant`` (public names of the codecs)                                        |
| 4 | parallel     | ``k3_jax.parallel`` (sequence-, expert- and vocab-parallel forms of the layers)      |
| 5 | layers       | ``k3_jax.layers``, ``k3_jax.vision`` (tower, packed attention, media plan)            |
| 6 | model        | ``k3_jax.model``, ``.cache``, ``.multimodal``, ``.kernels`` (what a config will run), |
|   |              | ``.draft`` (the speculative-decoding draft model)                                   |
| 7 | programs     | ``k3_jax.training``, ``k3_jax.serving``, ``k3_jax.convert``, ``k3_jax.vision.train``, |
|   |              | ``k3_jax.vision.shapes_data`` (the bundled image-text example)                        |
| 8 | entry points | ``k3_jax.cli``, ``k3_jax.launch``, ``sharding.plan``, ``train``, ``serve`` (scripts) |
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernels", ("pallas_kernels",)),
    ("leaves", ("=k3_jax", "k3_jax.errors", "k3_jax.vision.config", "k3_jax.config", "k3_jax.xla_flags",
                "k3_jax.compile_cache", "k3_jax.tokenizer", "k3_jax.progress", "k3_jax.vision.processor",
                "k3_jax.vision.content")),
    ("sharding", ("sharding",)),
    ("quant", ("k3_jax.quant",)),
    ("parallel", ("k3_jax.parallel",)),
    ("layers", ("k3_jax.layers", "k3_jax.vision")),
    ("model", ("k3_jax.model", "k3_jax.cache", "k3_jax.multimodal", "k3_jax.kernels", "k3_jax.draft")),
    ("programs", ("k3_jax.training", "k3_jax.serving", "k3_jax.convert", "k3_jax.vision.train",
                  "k3_jax.vision.shapes_data")),
    ("entry points", ("k3_jax.cli", "k3_jax.launch", "sharding.plan", "train", "serve")),
)
PACKAGES = ("k3_jax", "sharding", "pallas_kernels")
SCRIPTS = ("train.py", "serve.py")


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of the most specific entry covering ``module`` (None: not in the table)."""
    best, best_len = None, -1
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            exact = entry.startswith("=")
            name = entry.lstrip("=")
            if (module == name or (not exact and module.startswith(name + "."))) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name → source file, for the packages and the top-level scripts under ``root``."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    for script in SCRIPTS:
        if (root / script).exists():
            mods[script.removesuffix(".py")] = root / script
    return mods


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """``(line, imported project module)`` for every import statement in ``path`` (relative ones resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import k3_jax.model.x` -> the deepest known module
                target = target.rpartition(".")[0]
            if target and target != module and (node.lineno, target) not in out:
                out.append((node.lineno, target))
    return out


def back_imports(root: Path) -> list[str]:
    """Every import that points to a later layer, and every module the table does not place."""
    mods = project_modules(root)
    problems = []
    for module, path in mods.items():
        src = layer_of(module)
        if src is None:
            problems.append(f"{path.relative_to(root)}: module {module} is in no layer of LAYERS")
            continue
        for line, target in imports_of(module, path, set(mods)):
            dst = layer_of(target)
            if dst is not None and dst > src:
                problems.append(f"{path.relative_to(root)}:{line}: {module} (layer {LAYERS[src][0]!r}) imports "
                                f"{target} (layer {LAYERS[dst][0]!r}, later)")
    return problems


def test_imports_run_one_way():
    problems = back_imports(REPO)
    assert not problems, "imports against the layer order (tests/test_architecture.py):\n" + "\n".join(problems)


def test_checker_sees_back_edges(tmp_path):
    """The checker itself: a kernel module importing the model, and a local import in a function, are reported."""
    (tmp_path / "pallas_kernels").mkdir()
    (tmp_path / "k3_jax").mkdir()
    (tmp_path / "k3_jax" / "model.py").write_text("import pallas_kernels.ops\n")
    (tmp_path / "pallas_kernels" / "ops.py").write_text("def f():\n    from k3_jax.model import K3\n")
    (tmp_path / "k3_jax" / "unplaced.py").write_text("")
    problems = back_imports(tmp_path)
    assert problems == [
        "k3_jax/unplaced.py: module k3_jax.unplaced is in no layer of LAYERS",
        "pallas_kernels/ops.py:2: pallas_kernels.ops (layer 'kernels') imports k3_jax.model (layer 'model', later)",
    ]
