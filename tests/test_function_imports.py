"""docs/design.md section 10: a function-level import is kept only for an optional dependency
or start-up cost, with its reason in a comment on the import (or on the line above its block).
Everything else imports at module level, where import-linter's layer contract sees it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flexmarl"


def _unexplained(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if any("#" in line for line in lines[node.lineno - 1:node.end_lineno]):
                continue
            above = node.lineno - 2  # walk up this block of imports to a comment above it
            while above >= 0 and lines[above].strip().startswith(("import ", "from ", ")")) \
                    and "#" not in lines[above]:
                above -= 1
            if above >= 0 and (lines[above].strip().startswith("#")
                               or lines[above].strip().startswith(("import ", "from "))):
                continue
            out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: "
                       f"{lines[node.lineno - 1].strip()}")
    return out


def test_every_function_level_import_says_why() -> None:
    unexplained = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _unexplained(path)]
    assert not unexplained, ("function-level imports without a reason (move them to the module's "
                             "imports, or say on the line which optional dependency or start-up "
                             "cost keeps them there):\n" + "\n".join(unexplained))
