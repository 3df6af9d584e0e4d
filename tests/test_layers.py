"""The house rules of DESIGN.md, checked on the source: imports point down the layers, no module imports
itself back through others (lazy imports inside functions included), no file in src/ over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "posttrain"

# top to bottom; a module may import its own layer and the layers below it
LAYERS = [
    ("cli",),
    ("algorithms",),
    ("rollout",),
    ("tasks", "envs"),
    ("generation",),
    ("policy",),
    ("parallel",),
    ("models",),
    ("data",),
    (
        "config",
        "config_keys",
        "checkpoint",
        "checkpoint_verify",
        "tokenizer_files",
        "rng_state",
        "dtypes",
        "host_memory",
        "logging",
        "__init__",
    ),
]
RANK = {name: len(LAYERS) - i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(("posttrain", *parts)).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posttrain"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from package import module`
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("posttrain")}
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in SRC.rglob("*.py")}


def test_every_module_belongs_to_a_layer():
    unknown = sorted({layer(m) for m in graph()} - set(RANK))
    assert not unknown, f"add {unknown} to LAYERS here and to the layers of DESIGN.md"


def test_imports_point_downward():
    upward = [
        f"{m} -> {d}"
        for m, deps in graph().items()
        for d in deps
        if layer(d) in RANK and RANK[layer(d)] > RANK[layer(m)]
    ]
    assert upward == []


def test_no_import_cycles():
    g = graph()
    g = {m: {d for d in deps if d in g and d != m and not m.startswith(d + ".")} for m, deps in g.items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(g[m]):
            if seen.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d) :] + [m, d]) if d in path else f"{m} -> {d}")
            elif d not in seen:
                visit(d, path + [m])
        seen[m] = 2

    for m in sorted(g):
        if m not in seen:
            visit(m, [])
    assert cycles == []


def test_no_file_over_600_lines():
    long = {
        str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


def test_the_two_grpo_loops_share_the_rollout_layer_and_never_import_each_other():
    g = graph()
    sync = g["posttrain.algorithms.grpo"]
    asynchronous = set().union(
        *(deps for m, deps in g.items() if m.startswith("posttrain.algorithms.async_grpo"))
    )
    assert not any(d.startswith("posttrain.algorithms.async_grpo") for d in sync)
    assert "posttrain.algorithms.grpo" not in asynchronous
    for deps in (sync, asynchronous):  # both sample, score and lay out rows through the rollout layer
        assert {"posttrain.rollout.groups", "posttrain.rollout.validation"} <= deps
