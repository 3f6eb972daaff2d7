"""The package's layering: no import circle between draftlab's modules (counting imports inside functions too,
which hide a circle from Python but not from a reader), and every module described in ARCHITECTURE.md."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "draftlab"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the draftlab modules it imports anywhere in its body (`from draftlab import x` names module x
    when x is a module)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "") in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                plain = [a for a in node.names if f"{node.module}.{a.name}" not in modules]
                edges.update(subs)
                if plain or not subs:
                    edges.add(node.module)
        graph[name] = edges - {name, "draftlab"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    assert "draftlab.checkpoint" in graph["draftlab.drafters.acceptance"]   # imported inside a method
    assert "draftlab.errors" in graph["draftlab.cli"] and "draftlab.train" in graph["draftlab.cli"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_architecture_lists_every_module():
    text = (PACKAGE / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(PACKAGE)}`" not in text]
    assert not missing, f"modules not described in draftlab/ARCHITECTURE.md: {missing}"
