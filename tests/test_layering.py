"""The import graph of ``titan_ext`` and ``model_plans``, imports inside functions counted: one way, no cycle.

The wings, top to bottom (``WINGS``): the commands beside training (``plan`` with ``planner/``, ``census``,
``pretrained``, ``tokenizer_json``) -> registration (``titan_ext/__init__``, ``train_specs``) -> the torchtitan edge
(``host/``: the coordinator ``host.job``, preflight, checks, the console) -> the features (``parallel/`` ->
``data/`` -> ``checkpoints/``) -> ``models/`` -> ``kernels/``; below them the leaves every wing may read (``LEAVES``: the job
plan's data, errors, ``compat``, CPU mode, the ``[titan_ext]`` section, the input checks, and the machinery every
table of changes to a host library uses, ``patching``). ``model_plans`` imports no titan_ext.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("titan_ext", "model_plans")
REGISTRATION = {"titan_ext", "titan_ext.train_specs"}
COORDINATOR = "titan_ext.host.job"
PATCH_MACHINERY = "titan_ext.patching"
LEAVES = ("titan_ext.job_plan", "titan_ext.errors", "titan_ext.compat", "titan_ext.cpu_mode", "titan_ext.config",
          "titan_ext.inputs", PATCH_MACHINERY)
WINGS = (
    ("commands", ("titan_ext.plan", "titan_ext.planner", "titan_ext.census", "titan_ext.pretrained",
                  "titan_ext.tokenizer_json")),
    ("registration", tuple(sorted(REGISTRATION))),
    ("host", ("titan_ext.host",)),
    ("parallel", ("titan_ext.parallel",)),
    ("data", ("titan_ext.data",)),
    ("checkpoints", ("titan_ext.checkpoints",)),
    ("models", ("titan_ext.models",)),
    ("kernels", ("titan_ext.kernels",)),
    ("leaves", LEAVES),
)
"""Each wing imports only its own and the wings below it."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its body (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
        resolved = set()
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                resolved.add(target)
        graph[name] = resolved
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_finder_sees_a_cycle_made_inside_functions():
    graph = import_graph()
    pipeline = "titan_ext.parallel.pipeline"
    graph["titan_ext.job_plan"] = graph["titan_ext.job_plan"] | {pipeline}  # pipeline imports job_plan
    assert any({"titan_ext.job_plan", pipeline} <= set(cycle) for cycle in cycles(graph))
    assert "titan_ext.job_plan" in import_graph()[pipeline]  # an import the finder must see


def test_only_registration_imports_the_coordinator():
    importers = {name for name, targets in import_graph().items() if COORDINATOR in targets}
    assert importers <= REGISTRATION, importers - REGISTRATION


def test_the_plan_data_is_a_leaf():
    assert import_graph()["titan_ext.job_plan"] == set()


def test_the_patch_machinery_is_a_leaf():
    """Kernels, models, features and the planner each keep their table beside their code, on one machinery."""
    assert import_graph()[PATCH_MACHINERY] == {"titan_ext.compat"}


def _under(name: str, prefixes) -> bool:
    """``name`` is one of ``prefixes`` or inside one (the package ``titan_ext`` itself holds only itself)."""
    return any(name == prefix or (prefix != "titan_ext" and name.startswith(f"{prefix}.")) for prefix in prefixes)


def wing_of(name: str) -> int | None:
    """The wing's place, top (0) to bottom."""
    if name.startswith("model_plans"):
        return len(WINGS)
    return next((index for index, (_, prefixes) in enumerate(WINGS) if _under(name, prefixes)), None)


def test_every_module_is_in_a_wing():
    assert [name for name in import_graph() if wing_of(name) is None] == []


def upward_imports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> what it imports against the wings' order; ``model_plans`` imports no titan_ext."""
    found = {}
    for name, targets in graph.items():
        above = ({t for t in targets if t.startswith("titan_ext")} if name.startswith("model_plans")
                 else {t for t in targets if wing_of(t) < wing_of(name)})
        if above:
            found[name] = above
    return found


def test_wings_import_downward_only():
    assert upward_imports(import_graph()) == {}


def test_a_model_importing_a_feature_is_upward():
    graph = import_graph()
    graph["titan_ext.models.moe.records"] = graph["titan_ext.models.moe.records"] | {"titan_ext.parallel.moe_plan"}
    graph["titan_ext.kernels.binding"] = graph["titan_ext.kernels.binding"] | {"titan_ext.host.job_patches"}
    assert upward_imports(graph) == {"titan_ext.models.moe.records": {"titan_ext.parallel.moe_plan"},
                                     "titan_ext.kernels.binding": {"titan_ext.host.job_patches"}}


# ---- a mixer is one module ------------------------------------------------------------------------


def mixer_references() -> dict[str, set[str]]:
    """Each registered mixer class -> the package modules whose code names it (a name imported from
    ``titan_ext.models.mixers``, or ``mixers.<name>``), its own module and the registry left out."""
    from titan_ext.models.mixers import MIXERS

    names = {mixer.__name__: mixer.__module__ for mixer in MIXERS}
    found = {name: set() for name in names}
    for module, path in modules().items():
        imported = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titan_ext.models.mixers"):
                imported.update(alias.asname or alias.name for alias in node.names)
        for node in ast.walk(tree):
            named = (node.id if isinstance(node, ast.Name) and node.id in imported
                     else node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id == "mixers" else None)
            if named in names and module not in (names[named], "titan_ext.models.mixers"):
                found[named].add(module)
    return found


def test_a_mixer_is_named_by_its_module_and_its_registration_line_only():
    """Adding a mixer is its module plus its line in ``MIXERS``: no feature (TP, CP, documents, AC, compile,
    kernels) names a mixer; an fla architecture names the one mixer its registered TP plan covers, and the
    generic transformers architecture and its host probe name softmax attention (the mixer of every model
    type, whose HF plan covers it)."""
    assert mixer_references() == {
        "GLA": {"titan_ext.models.gla"},
        "GatedDeltaNet": {"titan_ext.models.gated_deltanet"},
        "KDA": {"titan_ext.models.kda"},
        "FlaAttention": {"titan_ext.models.transformer"},
        "TransformersAttention": {"titan_ext.models.architecture", "titan_ext.host.checks",
                                  "titan_ext.models.mixers.mla"},
        "TransformersMLA": set(),
        "TransformersGatedDeltaNet": set(),
        "TransformersGatedDeltaNetGrouped": set(),
        "TransformersKDA": set(),
        "TransformersMamba2": set(),
        "FlaMamba2": set(),
        "TransformersShortConv": set(),
        "TransformersLightningAttention": set(),
    }


def test_the_mixer_count_sees_a_new_reference(tmp_path, monkeypatch):
    source = tmp_path / "titan_ext" / "somewhere.py"
    source.parent.mkdir()
    source.write_text("from titan_ext.models import mixers\nKIND = mixers.TransformersKDA\n")
    monkeypatch.setitem(globals(), "modules", lambda: {"titan_ext.somewhere": source})
    assert mixer_references()["TransformersKDA"] == {"titan_ext.somewhere"}
