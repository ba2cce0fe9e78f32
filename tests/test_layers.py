"""The package's layers point one way: parsed from the source (module-level and function-local
imports alike), every import goes to the same part or to a lower one, the module graph has
no loop, and a function-local import says why it is local (``# lazy: <reason>``)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Low to high. A module may import its own part or any part on a lower floor; parts on one
# floor never import each other.
FLOORS = [
    ["opd_jax", "opd_jax.shapes", "opd_jax.schema", "opd_jax.compile_cache",
     "opd_jax.distributed", "pallas_kernels"],
    ["opd_jax.sharding", "opd_jax.checkpoint", "opd_jax.envs", "opd_jax.losses",
     "opd_jax.config"],
    ["opd_jax.models", "opd_jax.plotting"],
    ["opd_jax.data", "opd_jax.rollout"],
    ["opd_jax.episodes"],
    ["opd_jax.teachers"],
    ["opd_jax.trainers"],
    ["opd_jax.recipes"],
    ["opd_jax.configs"],     # config files: run by opd_jax.config's loader, imported by none
    ["studies"],
    ["opd_jax.cli"],
    ["opd_jax.__main__"],
]
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}


def _modules():
    for top in ("opd_jax", "pallas_kernels", "studies"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            yield ".".join(parts), is_pkg, path


MODULES = {name: (is_pkg, path) for name, is_pkg, path in _modules()}


def _resolve(module: str, is_pkg: bool, node) -> list[str]:
    """The project modules an import statement names (`from pkg import mod` -> pkg.mod)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module
        names = [target] + [f"{target}.{a.name}" for a in node.names]
    out = []
    for n in names:
        if n.split(".")[0] not in ("opd_jax", "pallas_kernels", "studies"):
            continue
        while n not in MODULES and "." in n:   # a name inside a module: the module itself
            n = n.rsplit(".", 1)[0]
        if n in MODULES:
            out.append(n)
    return sorted(set(out))


def _imports():
    """(module, imported module, line, function-local) for every project import."""
    rows = []
    for module, (is_pkg, path) in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = set()
        for stmt in tree.body:
            top |= {id(n) for n in ast.walk(stmt)} if not isinstance(
                stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, is_pkg, node):
                    if target != module:
                        rows.append((module, target, node.lineno, id(node) not in top))
    return rows


def _part(module: str) -> str:
    parts = module.split(".")
    for n in (2, 1):
        if len(parts) >= n and ".".join(parts[:n]) in FLOOR:
            return ".".join(parts[:n])
    raise AssertionError(f"module {module} is on no floor of tests/test_layers.py FLOORS")


IMPORTS = _imports()


def test_every_module_is_on_a_floor():
    for module in MODULES:
        _part(module)


def _upward(imports) -> list[str]:
    return [f"{m}:{line} imports {t} ({_part(m)} floor {FLOOR[_part(m)]} -> {_part(t)} "
            f"floor {FLOOR[_part(t)]})"
            for m, t, line, _ in imports
            if _part(m) != _part(t) and FLOOR[_part(t)] >= FLOOR[_part(m)]]


def _loops(imports) -> list[list[str]]:
    graph = {}
    for m, t, _, _ in imports:
        graph.setdefault(m, set()).add(t)
    # a package's __init__ re-exports its modules: an edge from it to its own submodule is
    # the package itself, and a submodule importing its package means the package's names
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    index, low, stack, on, loops = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def test_imports_point_down():
    up = _upward(IMPORTS)
    assert not up, "imports that do not point down:\n" + "\n".join(up)


def test_the_library_does_not_import_the_studies():
    """studies/ sits beside the library: no opd_jax or pallas_kernels module (cli included)
    imports it."""
    bad = [f"{m}:{line} imports {t}" for m, t, line, _ in IMPORTS
           if t.split(".")[0] == "studies" and m.split(".")[0] != "studies"]
    assert not bad, "library modules that import studies:\n" + "\n".join(bad)


def test_no_import_loop():
    loops = _loops(IMPORTS)
    assert not loops, f"import loops: {loops}"


def test_the_checks_see_an_upward_import_and_a_loop():
    """The checks themselves: the old teachers -> trainers arrow and a two-module loop."""
    old = [("opd_jax.teachers.bank", "opd_jax.trainers.builders", 98, True),
           ("opd_jax.trainers.builders", "opd_jax.teachers.bank", 59, True)]
    assert len(_upward(old)) == 1 and "opd_jax.teachers.bank:98" in _upward(old)[0]
    assert _loops(old) == [["opd_jax.teachers.bank", "opd_jax.trainers.builders"]]


def test_function_local_imports_say_why():
    bad = []
    for module, (_, path) in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    text = lines[node.lineno - 1] + (lines[node.lineno - 2]
                                                     if node.lineno > 1 else "")
                    if "# lazy:" not in text:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, ("function-local imports without a '# lazy: <reason>' comment (optional "
                     "dependency or start-up time); otherwise import at module level:\n"
                     + "\n".join(sorted(set(bad))))
