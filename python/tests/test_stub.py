"""The type stub (kvq/__init__.pyi) describes what the module really has."""
from __future__ import annotations

import ast
from pathlib import Path

import kvq

STUB = Path(kvq.__file__).with_name("__init__.pyi")


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse(STUB.read_text())
    top: set[str] = set()
    classes: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        elif isinstance(node, ast.Assign):
            top.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            classes[node.name] = members
    return top, classes


def test_stub_covers_the_public_api() -> None:
    top, classes = _stub_names()
    assert STUB.exists() and (STUB.parent / "py.typed").exists()
    assert set(kvq.__all__) <= top, set(kvq.__all__) - top
    for name, members in classes.items():
        runtime = getattr(kvq, name)
        public = {m for m in dir(runtime) if not m.startswith("_")}
        if name == "Error":
            public = {"kind"}
        assert public <= members, f"{name}: not in the stub: {public - members}"
        assert members - {"__init__", "__eq__", "__hash__", "__copy__", "__deepcopy__"} <= public, (
            f"{name}: stub has what the module lacks: {members - public}")
