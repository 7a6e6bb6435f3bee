"""The layering contract (.importlinter, docs/architecture.md "Seams") holds: the model imports nothing of ours above
it; the engine, activations, training and the feedback log import nothing of the server; training does not import
the engine (it reaches serving through ``alchemist.training.seams``). Checked by import-linter, as ``lint-imports``
would from the repository root; and the same contract fails a copy of the package that breaks it."""

from __future__ import annotations

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
    assert "3 kept, 0 broken" in result.stdout


def test_training_importing_the_engine_breaks_it(tmp_path):
    shutil.copytree(ROOT / "alchemist", tmp_path / "alchemist", ignore=shutil.ignore_patterns("__pycache__"))
    trainer = tmp_path / "alchemist" / "training" / "trainer.py"
    trainer.write_text(trainer.read_text() + "\nfrom alchemist.engine import LLMEngine  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 kept, 1 broken" in result.stdout
    assert "alchemist.training.trainer -> alchemist.engine" in result.stdout
