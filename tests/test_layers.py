"""The import layers (pyproject.toml's import-linter contracts, docs/architecture.md) hold, and
an import against them is caught: the check is not vacuous."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
#: The programs (the design card's top level): they import the packages, never each other.
PROGRAMS = ("server", "client", "stress_test", "prepare_model", "tune")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True,
                          text=True, timeout=240)


def copy_of_the_code(to: Path) -> Path:
    """Every package but the tests, the programs and pyproject.toml, in a folder of their own."""
    for init in ROOT.glob("*/__init__.py"):
        if init.parent.name != "tests":
            shutil.copytree(init.parent, to / init.parent.name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "results"))
    for program in ROOT.glob("*.py"):
        shutil.copy(program, to / program.name)
    shutil.copy(ROOT / "pyproject.toml", to / "pyproject.toml")
    return to


def test_every_package_imports_only_the_layers_below_it() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


def test_an_import_up_the_layers_or_of_a_program_breaks_a_contract(tmp_path: Path) -> None:
    tree = copy_of_the_code(tmp_path)
    with (tree / "protocol" / "limits.py").open("a") as limits:
        limits.write("\nimport dispatch.models  # against the grain\n")
    with (tree / "tasks" / "text.py").open("a") as text:
        text.write("\nimport server  # a package importing a program\n")
    done = lint_imports(tree)
    assert done.returncode == 1
    assert "protocol is not allowed to import dispatch" in done.stdout
    assert "tasks is not allowed to import server" in done.stdout


def programs_imported(source: str) -> set[str]:
    """The programs a module's source imports, at any depth of it (import-linter names only
    packages, so this check of the programs is ours)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(PROGRAMS)


def test_no_program_imports_another() -> None:
    for program in PROGRAMS:
        imported = programs_imported((ROOT / f"{program}.py").read_text())
        assert not imported, f"{program}.py imports {sorted(imported)}"
    assert programs_imported("def f():\n    from server import main\nimport tune.x") == \
        {"server", "tune"}  # the check catches one, even inside a function
