"""The package's import graph reads top to bottom: each module imports only modules of its own
layer or of layers below it (statically: ``import`` and ``from ... import`` anywhere in the
file, function-level imports included, and the ``"module:attr"`` targets of the dispatch
tables). The layers:

1. base: version, errors, threads, configuration, dispatch, ids and their hash, KV layouts,
   KV codec formats;
2. implementations: ``ucm.reference.*`` and ``ucm.fast.*`` (the native extension included);
3. public ops: ``ucm.ops``, ``ucm.transfer``, ``ucm.compress``, ``ucm.sparse.ops``,
   ``ucm.blend.ops``, which validate and dispatch;
4. services: ``ucm.store.*``, the sparse methods ``ucm.sparse.*``, Blend ``ucm.blend.*``, the
   package's root;
5. applications: ``ucm.integration.*``, ``ucm.cli``, ``ucm.demo.*``, ``ucm.models``,
   ``ucm.replay``, ``ucm.autotune``, ``ucm.calibrate``.
"""
import ast
import fnmatch
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ucm"

LAYERS = [
    ("base", ["ucm._version", "ucm.errors", "ucm.files", "ucm.threads", "ucm.config_values", "ucm.config",
              "ucm.dispatch", "ucm.ids", "ucm.murmur", "ucm.layout", "ucm.codecs", "ucm.metrics",
              "ucm.progress", "ucm.buffers"]),
    ("implementations", ["ucm.reference", "ucm.reference.*", "ucm.fast", "ucm.fast.*",
                         "ucm._native"]),
    ("ops", ["ucm.ops", "ucm.transfer", "ucm.compress", "ucm.sparse.ops", "ucm.blend.ops"]),
    ("services", ["ucm.store", "ucm.store.*", "ucm.sparse", "ucm.sparse.*", "ucm.blend",
                  "ucm.blend.*", "ucm"]),
    ("applications", ["ucm.integration", "ucm.integration.*", "ucm.cli", "ucm.__main__",
                      "ucm.demo", "ucm.demo.*", "ucm.models", "ucm.replay", "ucm.autotune",
                      "ucm.calibrate"]),
]


def _modules() -> dict:
    mods = {"ucm._native": None}  # the compiled engine
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = p
    return mods


def _layer(mod: str) -> int:
    for k, (_, patterns) in enumerate(LAYERS):  # (the first match wins: ucm.sparse.ops is an op)
        if any(fnmatch.fnmatchcase(mod, pat) for pat in patterns):
            return k
    raise AssertionError(f"{mod} belongs to no layer: add it to LAYERS")


def _imports(mod: str, path: pathlib.Path, mods: dict) -> set:
    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "ucm"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = pkg + ("." + base if base else "")
            if base.split(".")[0] == "ucm":
                out |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base)
                        for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("ucm.") and ":" in node.value:
            out.add(resolve(node.value.partition(":")[0]))
    out.discard(mod)
    out.discard("")
    return out


def test_every_module_has_a_layer():
    for mod in _modules():
        _layer(mod)


def test_imports_point_down():
    mods = _modules()
    up = []
    for mod, path in sorted((m, p) for m, p in mods.items() if p is not None):
        for dep in sorted(_imports(mod, path, mods)):
            if _layer(dep) > _layer(mod):
                up.append(f"{mod} ({LAYERS[_layer(mod)][0]}) imports {dep} "
                          f"({LAYERS[_layer(dep)][0]})")
    assert not up, "imports pointing up a layer:\n" + "\n".join(up)


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: a base module importing a store module is reported."""
    path = tmp_path / "ids.py"
    path.write_text("def f():\n    from ucm.store import base\n    return base\n")
    mods = _modules()
    deps = _imports("ucm.ids", path, mods)
    assert deps == {"ucm.store.base"} and _layer("ucm.store.base") > _layer("ucm.ids")


@pytest.mark.parametrize("family, module", [("foundation", "ucm.ops"), ("transfer", "ucm.transfer"),
                                            ("sparse", "ucm.sparse.ops")])
def test_each_family_has_one_table_of_implementations(family, module):
    """Each op family registers its implementations in its own public module, from one table;
    every op of the family has a reference."""
    import importlib

    from ucm import dispatch

    m = importlib.import_module(module)
    table = m.IMPLEMENTATIONS
    rows = [s for t in table.values() for s in t] if isinstance(table, dict) else list(table)
    assert rows and all(isinstance(s, dispatch.ImplSpec) for s in rows)
    ops = list(table) if isinstance(table, dict) else list(getattr(m, "OPS", ())) + \
        list(getattr(m, "TRITON_OPS", ()))
    assert ops
    for op in ops:
        names = [i.name for i in dispatch.implementations(op)]
        assert "reference" in names and len(names) >= 2, (op, names)


def test_no_module_is_over_800_lines():
    """A module a reader can hold: split by family or role before it grows past this."""
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 800}
    assert not long, long
