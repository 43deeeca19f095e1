"""The package's imports, read with ``ast``: no cycle, and every import goes down the layers

    adapters (bindings/: sagebwd_cp.torch, sagebwd_cp.jax; the command line)
      -> api (the public functions)
        -> gpu | host (sagebwd_cp.gpu, sagebwd_cp.host; neither imports the other)
          -> core (options, problem, arrays, numerics)

A module may import its own layer (without a cycle) or any layer below; imports inside functions
are allowed only for optional frameworks (torch, cupy, jax, transformers, tqdm), never of the package.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"sagebwd_cp": REPO / "sagebwd_cp", "sagebwd_cp.torch": REPO / "bindings" / "torch",
         "sagebwd_cp.jax": REPO / "bindings" / "jax"}
CORE = {"sagebwd_cp.options", "sagebwd_cp.problem", "sagebwd_cp.arrays", "sagebwd_cp.numerics"}
RANK = {"core": 0, "gpu": 1, "host": 1, "api": 2, "adapters": 3}


def layer(module: str) -> str:
    if module in CORE:
        return "core"
    if module.startswith(("sagebwd_cp.torch", "sagebwd_cp.jax")) or module == "sagebwd_cp.__main__":
        return "adapters"
    if module.startswith("sagebwd_cp.gpu"):
        return "gpu"
    if module.startswith("sagebwd_cp.host"):
        return "host"
    return "api"


def modules() -> dict:
    """{module name: (path, is a package)} of every module of the package and its adapters."""
    found = {}
    for root, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts = parts[:-1]
            if root == "sagebwd_cp" and parts and parts[0] in ("torch", "jax"):
                continue
            found[".".join([root, *parts])] = (path, package)
    return found


def _resolve(name: str, known: dict) -> str | None:
    """The package module ``name`` is, or is in (``from package import module`` names the module)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, path: Path, package: bool, known: dict):
    """(imported module, line, at top level) for each import of the package in ``module``."""
    tree = ast.parse(path.read_text(), str(path))
    base = module if package else module.rpartition(".")[0]
    top = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.Try) for n in s.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                origin = ".".join(anchor + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names = [f"{origin}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if not name.startswith("sagebwd_cp"):
                continue
            target = _resolve(name, known)
            if target is not None and target != module:
                yield target, node.lineno, id(node) in top


def graph() -> dict:
    known = modules()
    return {m: list(imports(m, path, package, known)) for m, (path, package) in known.items()}


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, edges in graph().items():
        for target, line, at_top in edges:
            if target == "sagebwd_cp" and layer(module) == "adapters":
                continue  # the adapters may name the package itself (its __version__, public names)
            a, b = layer(module), layer(target)
            if RANK[b] > RANK[a] or {a, b} == {"gpu", "host"}:
                wrong.append(f"{module}:{line} ({a}) imports {target} ({b})")
            if not at_top:
                wrong.append(f"{module}:{line} imports {target} inside a function")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    edges = {m: sorted({t for t, _, _ in e if t != "sagebwd_cp"}) for m, e in graph().items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in edges.get(m, ()):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in edges:
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_the_layers_hold_the_modules_they_name():
    known = modules()
    assert {"sagebwd_cp.gpu.plan", "sagebwd_cp.gpu.compiler", "sagebwd_cp.gpu.specs", "sagebwd_cp.gpu.device",
            "sagebwd_cp.host.emulator", "sagebwd_cp.host.reference", "sagebwd_cp.host.packed",
            "sagebwd_cp.torch._ops", "sagebwd_cp.jax", "sagebwd_cp.options", "sagebwd_cp.api"} <= set(known)
    # Device queries live in one module.
    defining = [m for m, (path, _) in known.items()
                if any(isinstance(n, ast.FunctionDef) and n.name == "device_arch"
                       for n in ast.parse(path.read_text()).body)]
    assert defining == ["sagebwd_cp.gpu.device"]
