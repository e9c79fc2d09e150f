"""Fixtures of the integration tests: an event loop per module for the cluster tests, and an
offline engine per module to compare the cluster's outputs with."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from engine.llm import LLM
from tests.conftest import build_engine


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for a module's cluster (its router state lives on this loop)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def sampling_llm(smollm_model) -> Iterator[LLM]:
    """SmolLM2 in-process (the shared weights): the outputs a cluster test must equal."""
    llm = LLM(engine=build_engine(smollm_model))
    yield llm
    llm.engine.assert_no_leaks()
