"""One sparse MoE layer's GPU time against the weight bytes it reads, per token count; owns no
state.

For each token count T a CUDA graph of one SparseMoe's forward (router, align, the two grouped
GEMMs, the top-k sum) over random hidden states is captured and replayed; its time is held to
the bytes it must read: the router and every expert the T tokens were routed to (each once:
T=1 reads top_k experts, a large T all of them), plus the hidden states in and out. Random
weights route near-uniformly, as a trained router's load balancing aims to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bench.lib.gpu_timing import event_ms
from engine.models.moe import SparseMoe

TOKEN_COUNTS = (1, 8, 64, 256, 1024, 2048)


def moe_layer_bytes(moe: SparseMoe, x: torch.Tensor) -> tuple[int, int]:
    """(experts the rows of x are routed to, bytes a forward over x must read and write)."""
    touched = int(torch.unique(moe.route(x).expert_ids).numel())
    gate_up, down = moe.experts_gate_up, moe.experts_down
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    router = moe.gate.weight.numel() * moe.gate.weight.element_size()
    activations = 2 * x.numel() * x.element_size()
    return touched, touched * per_expert + router + activations


@torch.inference_mode()
def moe_layer_times(
    model: nn.Module, bandwidth: float, token_counts: tuple[int, ...] = TOKEN_COUNTS
) -> list[dict[str, Any]]:
    """A row per token count: the graph replay's time of the model's first SparseMoe layer,
    the experts touched, the bytes read and the time that takes at bandwidth (the roofline)."""
    moe = next(m for m in model.modules() if isinstance(m, SparseMoe))
    weight = moe.experts_gate_up
    hidden = weight.shape[2]
    gen = torch.Generator(weight.device).manual_seed(0)
    rows = []
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, hidden, generator=gen, device=weight.device, dtype=weight.dtype)
        moe(x)  # compiles the kernels for this shape outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe(x)
        ms = event_ms(graph.replay, 200)
        touched, nbytes = moe_layer_bytes(moe, x)
        roofline_ms = nbytes / bandwidth * 1e3
        rows.append(
            {
                "tokens": num_tokens,
                "experts_touched": touched,
                "bytes_read": nbytes,
                "layer_us": ms * 1e3,
                "roofline_us": roofline_ms * 1e3,
                "over_roofline": ms / roofline_ms,
                "achieved_GBps": nbytes / (ms / 1e3) / 1e9,
            }
        )
        del graph
    torch.cuda.empty_cache()  # the graphs' pools: the engine sizes its KV pool after this
    return rows
