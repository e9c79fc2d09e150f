"""Process-wide NIXL setup: UCX transport choice (UCX_TLS) and creating an agent.

Owns one piece of process state: whether UCX_TLS in os.environ was set by kvrelay (which may
set it again) or by the user (never touched).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from kvtransfer.base import KVTransferError

BACKEND = "UCX"
UCX_TLS_CPU = "sm,self,tcp"
UCX_TLS_GPU = "cuda_ipc,cuda_copy,sm,self,tcp"
MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}
DEFAULT_PROGRESS_DELAY_US = 100  # idle progress thread: ~3% of a core instead of 100%
_ucx_tls_set_by_us: str | None = None


def configure_ucx(device_kind: str) -> str:
    """Pick UCX transports unless the user set UCX_TLS; returns the value in force.

    Must run before the NIXL agent (and so its UCX context) is created: UCX reads UCX_TLS then.
    With UCX's default transports a second process on the host may fail to create its backend;
    tcp must be listed (NIXL's UCX backend wires itself up through it); and where CUDA sees a
    GPU, NIXL refuses a UCX_TLS without cuda_copy, even for a CPU tensor: so the GPU list is
    used for a CUDA tensor or whenever a GPU is visible. With a GPU, cuda_ipc's GET (our READ)
    is also switched on: UCX leaves it off where it sees no NVLink, and a READ then crawls
    through tcp software emulation (0.5 GB/s instead of ~90 GB/s measured on one H200).
    """
    global _ucx_tls_set_by_us
    gpu = device_kind == "cuda" or torch.cuda.is_available()
    if gpu:
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    current = os.environ.get("UCX_TLS")
    if current is not None and current != _ucx_tls_set_by_us:
        return current  # the user's choice wins
    wanted = UCX_TLS_GPU if gpu else UCX_TLS_CPU
    os.environ["UCX_TLS"] = _ucx_tls_set_by_us = wanted
    return wanted


def check_kv_tensor(kv_tensor: torch.Tensor) -> tuple[str, int]:
    """Validate the layer-packed KV tensor; return (device kind, device id)."""
    if kv_tensor.dim() != 6:
        raise ValueError(
            "KV tensor must be [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], "
            f"got shape {tuple(kv_tensor.shape)}"
        )
    if not kv_tensor.is_contiguous() or kv_tensor.numel() == 0:
        raise ValueError("KV tensor must be contiguous and non-empty")
    kind = kv_tensor.device.type
    if kind not in MEM_TYPES:
        raise ValueError(f"KV tensor on {kv_tensor.device} is not supported (cpu or cuda only)")
    device_id = kv_tensor.get_device() if kind == "cuda" else 0  # NIXL wants 0 for DRAM
    return kind, device_id


def import_nixl_api() -> Any:
    """NIXL's Python API: through the `nixl` meta package, or straight from a CUDA-specific
    wheel (nixl-cu13 / nixl-cu12) installed without it."""
    errors = []
    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise KVTransferError("NIXL is not installed (pip install nixl): " + "; ".join(errors))


def make_agent(
    agent_name: str,
    progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    progress_thread: bool = True,
) -> Any:
    """Create the NIXL agent with the UCX backend and (by default) a progress thread.

    The side being read from needs the thread: on tcp/sm it must progress UCX for a READ to
    complete. NIXL's Python wrapper hard-codes its delay to 0 (a spinning thread, one whole core
    per idle agent); `progress_delay_us` > 0 lets it pause between rounds. A side that only
    reads can do without it (polling a READ progresses UCX); on an H200 pair a busier thread
    made GPU READs slower, as it competes with the polling for the UCX worker.
    """
    nixl_api = import_nixl_api()
    config = nixl_api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[BACKEND])
    try:
        with _progress_delay(nixl_api, progress_delay_us):
            agent = nixl_api.nixl_agent(agent_name, config)
    except Exception as e:
        raise KVTransferError(
            f"NIXL agent {agent_name!r} failed to start its {BACKEND} backend "
            f"(UCX_TLS={os.environ.get('UCX_TLS')!r}; it must list tcp, and cuda_copy where a "
            f"GPU is present): {e!r}"
        ) from e
    if BACKEND not in agent.backends:
        raise KVTransferError(
            f"NIXL has no {BACKEND} plugin (plugins found: {agent.get_plugin_list()})"
        )
    return agent


@contextlib.contextmanager
def _progress_delay(nixl_api: Any, delay_us: int) -> Iterator[None]:
    """While creating an agent, hand the C++ agent a config whose pthrDelay is `delay_us`.

    nixl_agent.__init__ builds nixlBind.nixlAgentConfig itself and sets pthrDelay = 0; we wrap
    the nixlBind.nixlAgent constructor it then calls. If a NIXL release stops calling it so,
    this is a no-op (the agent still works, with a spinning progress thread).
    """
    bind = nixl_api.nixlBind
    real_agent = bind.nixlAgent
    if delay_us <= 0:
        yield
        return

    def agent_with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real_agent(name, config)

    bind.nixlAgent = agent_with_delay
    try:
        yield
    finally:
        bind.nixlAgent = real_agent
