"""Shared fixtures: the default model loaded once, engine and request factories, leak checks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():  # before triton is imported: its kernels then run on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")  # in its interpreter (float32 tensors only)

from engine.config import CacheConfig, SchedulerConfig
from engine.engine import Engine, EngineConfig
from engine.models.loader import DEFAULT_MODEL, load_model, read_model_config, resolve_model
from engine.tokenizer import Tokenizer

pytest_plugins = ["tests.redis_fixtures"]

EngineFactory = Callable[..., Engine]


@pytest.fixture(scope="session")
def smollm_dir():
    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer(smollm_dir) -> Tokenizer:
    return Tokenizer(smollm_dir)


@pytest.fixture(scope="session")
def smollm_model(smollm_dir) -> torch.nn.Module:
    """SmolLM2 weights loaded once and shared by every engine a test builds."""
    config = read_model_config(smollm_dir, DEFAULT_MODEL)
    return load_model(
        smollm_dir, config, config.max_position_embeddings, torch.device("cpu"), torch.float32
    )


def build_engine(
    model: torch.nn.Module | None = None, model_path: str = DEFAULT_MODEL, **overrides
) -> Engine:
    cache = CacheConfig(
        block_size=overrides.pop("block_size", 16),
        num_blocks=overrides.pop("num_blocks", 512),
        enable_prefix_caching=overrides.pop("enable_prefix_caching", True),
        kv_cache_dtype=overrides.pop("kv_cache_dtype", "auto"),
        partial_reuse_min_tokens=overrides.pop("partial_reuse_min_tokens", 1),
        host_kv_cache_bytes=overrides.pop("host_kv_cache_bytes", 0),
        keep_on_host=overrides.pop("keep_on_host", False),
        disk_kv_cache_bytes=overrides.pop("disk_kv_cache_bytes", 0),
        disk_kv_path=overrides.pop("disk_kv_path", None),
        shared_kv_cache_bytes=overrides.pop("shared_kv_cache_bytes", 0),
        shared_kv_path=overrides.pop("shared_kv_path", None),
        shared_kv_endpoint=overrides.pop("shared_kv_endpoint", None),
        # the tier tests' tiny models compute a block faster than a file is read: "measured"
        # would compute their hits (tests/integration/test_disk_tier.py tests it on its own)
        file_tier_reads=overrides.pop("file_tier_reads", "always"),
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=overrides.pop("max_num_batched_tokens", 1024),
        max_num_seqs=overrides.pop("max_num_seqs", 32),
        max_model_len=overrides.pop("max_model_len", None),
    )
    config = EngineConfig(model=model_path, cache=cache, scheduler=scheduler, **overrides)
    return Engine(config, model=model)


@pytest.fixture
def make_engine(smollm_model) -> Iterator[EngineFactory]:
    """Engine factory; every engine it built must end the test with no leaked block."""
    engines: list[Engine] = []

    def factory(**overrides) -> Engine:
        engine = build_engine(smollm_model, **overrides)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.assert_no_leaks()


def run_to_completion(engine: Engine, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step until idle; returns req_id -> generated token ids."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests:
            return tokens
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")
