"""Helpers for the tests that scan the library's source (test_protocol, test_arch_names, test_imports)."""

from __future__ import annotations

import ast


def docstring_ids(tree: ast.AST) -> set[int]:
    """``id()`` of every docstring constant in ``tree`` (module, class and function docstrings)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def in_function_imports(tree: ast.AST) -> list[ast.stmt]:
    """``import`` / ``from ... import`` statements inside a function body, at any depth."""
    out: list[ast.stmt] = []

    def visit(node: ast.AST, in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_fn:
                out.append(child)
            visit(child, in_fn or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out
