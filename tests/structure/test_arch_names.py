"""No architecture is spelled outside its folder (issue 32 item 2).

Everything specific to an architecture lives in ``neon_hpc/arch/<name>/`` and is asked through
the registry (``neon_hpc.arch.get``).  This scan reads every other module of ``neon_hpc/`` from its
syntax tree and refuses an architecture's name (a registered name, an alias, an HF model type
or model class) in code: a string literal that is not a docstring, an identifier (variable,
attribute, function, class, import), or a file or folder name.  Docstrings and comments may name
architectures (they are documentation), as may configs/ and docs/.

``KNOWN`` lists files that still spell one, with the issue item that removes it; a listed file
that no longer does fails the test too (remove its line).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from neon_hpc import arch
from pyscan import docstring_ids
from repo_paths import REPO

LIB = REPO / "neon_hpc"
ARCH_DIR = LIB / "arch"

# file -> why it may still spell an architecture's name
KNOWN: dict[str, str] = {}


def _names() -> list[str]:
    out = set(arch.MODEL_TYPES)
    for a in arch.ARCHITECTURES.values():
        out |= {a.hf_model_type, a.hf_architecture}
    return sorted(out)


def _patterns() -> tuple[re.Pattern, re.Pattern]:
    alt = "|".join(map(re.escape, _names()))
    # in text, a name stands between non-word characters (configs/<name>_1300xh200.yaml is a file name);
    # in an identifier, between anything but letters and digits (_<name>_errors spells it)
    return (re.compile(rf"(?<![A-Za-z0-9_])(?:{alt})(?![A-Za-z0-9_])", re.I),
            re.compile(rf"(?<![A-Za-z0-9])(?:{alt})(?![A-Za-z0-9])", re.I))


def spelled(path: Path) -> list[str]:
    """``file:line: what`` for every spelling of an architecture's name in ``path``'s code."""
    text_re, ident_re = _patterns()
    tree = ast.parse(path.read_text(), str(path))
    docs = docstring_ids(tree)
    rel = path.relative_to(REPO) if REPO in path.parents else path.name
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        found: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += text_re.findall(node.value)
        elif isinstance(node, ast.Name):
            found += ident_re.findall(node.id)
        elif isinstance(node, ast.Attribute):
            found += ident_re.findall(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found += ident_re.findall(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                found += ident_re.findall(f"{getattr(node, 'module', '') or ''}.{a.name}.{a.asname or ''}")
        out += [f"{rel}:{line}: {f!r}" for f in found]
    return out


def library_files() -> list[Path]:
    return sorted(p for p in LIB.rglob("*.py") if "__pycache__" not in p.parts and ARCH_DIR not in p.parents)


def test_the_scan_sees_each_way_of_spelling_a_name(tmp_path):
    name = arch.ARCHES[-1]
    probe = tmp_path / "probe.py"
    probe.write_text(f'"""{name} in a docstring is documentation."""\n'
                     f'# {name} in a comment too\n'
                     f'x = "{name}"\n'
                     f'def _{name}_rules(): pass\n'
                     f'if cfg.arch == "{name.upper()}": pass\n'
                     f'p = "configs/{name}_1300xh200.yaml"\n')
    hits = [h.split(": ", 1)[0] for h in spelled(probe)]
    assert sorted(h.rsplit(":", 1)[1] for h in hits) == ["3", "4", "5"], hits


def test_no_architecture_name_outside_its_folder():
    found: dict[str, list[str]] = {}
    for p in library_files():
        rel = str(p.relative_to(REPO))
        if hits := spelled(p):
            found[rel] = hits
    for p in LIB.rglob("*"):
        if ARCH_DIR not in p.parents and p != ARCH_DIR and "__pycache__" not in p.parts \
                and _patterns()[1].search(p.stem):
            found.setdefault(str(p.relative_to(REPO)), []).append(f"{p.relative_to(REPO)}: the file name")
    new = {f: h for f, h in found.items() if f not in KNOWN}
    gone = sorted(f for f in KNOWN if f not in found)
    assert not new, ("architecture names spelled outside neon_hpc/arch/<name>/ (ask neon_hpc.arch.get(...) "
                     "for the fact, or move the code into the architecture's folder):\n"
                     + "\n".join(h for hs in new.values() for h in hs))
    assert not gone, ("listed in KNOWN but clean now (remove these lines from tests/structure/test_arch_names.py): "
                      f"{gone}")


def test_an_unknown_architecture_is_refused_naming_the_registered_ones():
    import pytest
    with pytest.raises(ValueError) as e:
        arch.get("no_such_arch")
    assert "no_such_arch" in str(e.value) and all(a in str(e.value) for a in arch.ARCHES)


def test_each_registered_architecture_has_its_folder():
    for name, a in arch.ARCHITECTURES.items():
        folder = ARCH_DIR / type(a).__module__.split(".")[-1]
        assert {"__init__.py", "config.py", "hfmap.py", "megatron.py"} <= {p.name for p in folder.iterdir()}, folder
        assert a.name == name and a.mapping.NAME == name and a.megatron_module == f"{type(a).__module__}.megatron"
        for alias in a.aliases:
            assert arch.get(alias) is a
