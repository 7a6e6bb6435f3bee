"""The layering contract (.importlinter, docs/architecture.md "Seams") holds: the model imports nothing of ours above
it; the engine, activations, training, the feedback log and the runtime that assembles them import nothing of the
server; none of the parts imports the runtime; training does not import the engine (it reaches serving through
``alchemist.training.seams``), nor the activations training. Checked by import-linter, as ``lint-imports`` would from
the repository root; and the same contract fails a copy of the package that breaks it. Beside it: the runtime loads
no web framework, and the HTTP server assembles nothing (the runtime builds the system it serves)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter on the ``alchemist`` package under ``root`` (its working directory comes first on sys.path)."""
    args = [sys.executable, "-c", LINT, "--no-cache", "--no-logo", str(ROOT / ".importlinter")]
    return subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_the_layering_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


def test_training_importing_the_engine_breaks_it(tmp_path):
    shutil.copytree(ROOT / "alchemist", tmp_path / "alchemist", ignore=shutil.ignore_patterns("__pycache__"))
    trainer = tmp_path / "alchemist" / "training" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\nfrom alchemist.engine import LLMEngine  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "5 kept, 1 broken" in result.stdout
    assert "alchemist.training.trainer -> alchemist.engine" in result.stdout


def test_the_runtime_imports_no_web_framework():
    code = "import sys, alchemist.runtime; print(sorted({m.split('.')[0] for m in sys.modules}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not {"fastapi", "starlette", "uvicorn"} & set(ast.literal_eval(result.stdout)), result.stdout


# What the runtime builds (alchemist/runtime/build.py); the HTTP server gets them built, in a System.
BUILT_BY_THE_RUNTIME = {"LLMEngine", "ActivationStore", "OnlineTrainer", "load_model"}


def test_the_server_constructs_no_part_of_the_system():
    """No file of alchemist/server calls the constructors of the engine, the activation store, the online trainer
    (nor loads the model): ``ActivationStore(...)`` and ``ActivationStore.from_config(...)`` alike."""
    calls = []
    for path in sorted((ROOT / "alchemist" / "server").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                names = {n.id for n in ast.walk(node.func) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node.func) if isinstance(n, ast.Attribute)}
                calls += [f"{path.name}:{node.lineno} {name}" for name in sorted(names & BUILT_BY_THE_RUNTIME)]
    assert not calls, calls
