"""Shared fixtures: tiny random Llama-family checkpoints saved as real HF directories, and the default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import TINY_VARIANTS, make_tiny_hf_dir


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules marked slow first, in the order collected, then the others: `make test`'s two workers take a file
    at a time in this order (``--no-loadscope-reorder``: pytest-xdist would put the files of most tests first), and
    a long module started last would run on alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_hf_dir(root, v) for v in TINY_VARIANTS}


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, SmolLM2-135M-Instruct, in fp32 (the exactness reference), loaded once."""
    from alchemist.model.loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server for the whole test run (alchemist/bench/postgres.py); started by the first
    test that asks."""
    from alchemist.bench.postgres import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh empty database on the session's server, as a postgresql:// URL."""
    return postgres_server.fresh_database()
