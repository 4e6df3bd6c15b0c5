"""The package's seams, read from its import statements (ast, every import: top level, in functions, for typing)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "statelm"
ENGINE = "statelm.engine"
ENGINE_CLIENT = "statelm.engine.client"  # the one engine module the layers above may import
# who builds the engines (the in-process generation engine, an encoder model's batching thread), and with what
ENGINE_FACTORY = {
    "statelm.server.launch": {"statelm.engine.builder"},
    "statelm.server.embedding_models": {"statelm.engine.builder", "statelm.engine.encoder"},
}
ABOVE_ENGINE = (
    "statelm.api",
    "statelm.sessions",
    "statelm.server",
    "statelm.cluster",
    "statelm.cli",
    "statelm.metrics",
)
BELOW_ENGINE = (
    "statelm.models",
    "statelm.attention",
    "statelm.kernels",
    "statelm.tokenizer",
    "statelm.gguf_vocab",
    "statelm.config",
    "statelm.cpu",
    "statelm.host_allocator",
    "statelm.host_memory",
    "statelm.paths",
    "statelm.process_lock",
    "statelm.sampler_settings",
)
WIRE_PROTOCOLS = ("statelm.api.openai", "statelm.api.responses", "statelm.api.anthropic")  # over the conversation core
OUTSIDE = ("statelm", "statelm.__main__", "statelm.webui")  # the package, `python -m statelm`, the web UI's files


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every statelm module and the statelm modules it imports (a name imported from a package counts as the
    package's submodule when there is one)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported.update(known(alias.name) for alias in node.names if alias.name.startswith("statelm."))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                if base == "statelm" or base.startswith("statelm."):
                    imported.update(known(f"{base}.{alias.name}") for alias in node.names)
        graph[module] = imported - {module}
    return graph


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def test_above_the_engine_only_the_engine_client_is_imported() -> None:
    wrong = {
        module: sorted(
            imported
            for imported in imports
            if inside(imported, ENGINE) and imported != ENGINE_CLIENT and imported not in ENGINE_FACTORY.get(module, ())
        )
        for module, imports in import_graph().items()
        if any(inside(module, layer) for layer in ABOVE_ENGINE)
    }
    assert {module: imports for module, imports in wrong.items() if imports} == {}


def test_the_models_import_nothing_of_the_engine_and_attention_nothing_of_the_models() -> None:
    forbidden = {
        "statelm.models": (ENGINE, *ABOVE_ENGINE),
        "statelm.attention": (ENGINE, *ABOVE_ENGINE, "statelm.models"),
    }
    wrong = {
        module: sorted(imported for imported in imports if any(inside(imported, above) for above in banned))
        for module, imports in import_graph().items()
        for layer, banned in forbidden.items()
        if inside(module, layer)
    }
    assert {module: imports for module, imports in wrong.items() if imports} == {}


def test_the_conversation_core_imports_no_wire_protocol() -> None:
    core = {
        module: sorted(imported for imported in imports if any(inside(imported, wire) for wire in WIRE_PROTOCOLS))
        for module, imports in import_graph().items()
        if inside(module, "statelm.api") and not any(inside(module, wire) for wire in WIRE_PROTOCOLS)
    }
    assert {module: imports for module, imports in core.items() if imports} == {}


def import_loop(graph: dict[str, set[str]]) -> list[str]:
    """A loop of imports in graph (its modules, the first one again at the end), or [] if there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def test_no_import_loops() -> None:
    assert import_loop(import_graph()) == []


def test_the_graph_sees_the_imports_it_checks() -> None:
    graph = import_graph()
    assert ENGINE_CLIENT in graph["statelm.api.generation"]
    assert "statelm.engine.builder" in graph["statelm.server.launch"]
    assert "statelm.engine.engine" in graph["statelm.engine.async_engine"]
    assert "statelm.kernels.quant" in graph["statelm.models.llama"]  # imported for typing only
    assert sorted(set(import_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}))) == ["a", "b", "c"]


def test_every_module_has_a_place_in_the_layers() -> None:
    layers = (ENGINE, *ABOVE_ENGINE, *BELOW_ENGINE)
    assert [m for m in import_graph() if m not in OUTSIDE and not any(inside(m, layer) for layer in layers)] == []
