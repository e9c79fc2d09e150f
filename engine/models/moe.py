"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert) and the
reading of its checkpoint tensors; owns one layer's router and expert weights.

A layer's `mlp` is a SparseMoe. Its parameters, as the loader fills them (expert_tensors):
`gate.weight` [E, H] (the router), `experts_gate_up` [E, 2I, H] (each expert's gate rows, then
its up rows), `experts_down` [E, H, I]; with a shared expert (shared_expert_size S > 0):
`shared_gate_up` [2S, H], `shared_down` [H, S], `shared_expert_gate.weight` [1, H].

Numerics are transformers 5.25's (its default "grouped_mm" experts): router logits in the
model's dtype, softmax over all experts in float32, top-k, renormalized when norm_topk_prob;
Qwen casts the top-k weights to the model's dtype, Mixtral keeps them in float32
(float32_routing_weights=True); each (token, expert) pair's down product is rounded to the
model's dtype, multiplied by its weight (in the weight's dtype), and the top-k products are
summed in float32 and rounded once. On CUDA the experts run in moe_kernels.py's fused Triton
kernels; elsewhere in `reference_experts`, plain torch over the experts that got tokens.

Tensor parallelism: the router is replicated and forward's output is linear in each expert's
down product (the routing weights and the shared expert's sigmoid gate multiply the products;
the top-k sum adds them), so with I split across ranks (each rank holding its slice of every
expert's gate rows, up rows and down columns, and of the shared expert's: parallel/sharding.py)
forward's output is the rank's partial sum, which `all_reduce` adds up; nothing here assumes I
is whole. The ranks' partial sums are rounded to the model's dtype before they are added, as a
dense MLP's row-parallel down_proj's are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import moe_kernels

if TYPE_CHECKING:
    from engine.quant.config import Fp8Config

# family -> (the per-expert format's module name, its gate, up and down projection names)
PER_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),  # with a shared expert
}
SHARED_EXPERT_FAMILIES = ("qwen2_moe",)


class Routing(NamedTuple):
    """Each token's experts and their weights: expert_ids [T, k] (int64), weights [T, k]
    (float32, or the model's dtype: see SparseMoe)."""

    expert_ids: torch.Tensor
    weights: torch.Tensor


class SparseMoe(nn.Module):
    """Top-k routed SwiGLU experts, with an optional sigmoid-gated shared expert (Qwen2-MoE).

    forward(x [T, H]) -> [T, H]: on CUDA moe_kernels.fused_experts, else reference_experts.
    From a checkpoint's config: expert_size is Qwen's moe_intermediate_size (Mixtral's
    intermediate_size), num_experts Qwen's num_experts (Mixtral's num_local_experts), top_k
    num_experts_per_tok, norm_topk_prob Qwen's field (Mixtral: True), shared_expert_size
    Qwen2-MoE's shared_expert_intermediate_size (else 0). float32_routing_weights (keyword):
    True for Mixtral, which keeps the top-k weights in float32 through the weighted sum; False
    (Qwen) casts them to x's dtype after the renormalization. quant must be None: FP8 experts
    are not supported yet (the dense projections may be FP8)."""

    def __init__(
        self,
        hidden_size: int,
        expert_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        shared_expert_size: int = 0,
        *,
        float32_routing_weights: bool = False,
        quant: Fp8Config | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """expert_size / shared_expert_size: this rank's columns of each (a tensor-parallel
        rank's share); all_reduce: adds the ranks' outputs (None: one rank)."""
        super().__init__()
        self.all_reduce = all_reduce
        if quant is not None:
            raise ValueError(
                "quant: FP8 experts are not supported; a MoE layer's experts run in the "
                "model's dtype (quantize the dense projections only)"
            )
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts {num_experts}")
        self.top_k, self.num_experts = top_k, num_experts
        self.norm_topk_prob = norm_topk_prob
        self.float32_routing_weights = float32_routing_weights
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, expert_size))
        self.shared_expert_size = shared_expert_size
        if shared_expert_size > 0:
            self.shared_gate_up = nn.Parameter(torch.empty(2 * shared_expert_size, hidden_size))
            self.shared_down = nn.Parameter(torch.empty(hidden_size, shared_expert_size))
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> Routing:
        """The router: logits in x's dtype, float32 softmax over all experts, top-k."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_routing_weights:
            weights = weights.to(x.dtype)
        return Routing(expert_ids, weights)

    def warm_up_token_counts(self, max_tokens: int) -> list[int]:
        """Token counts (at most max_tokens) that meet every specialization of the experts'
        Triton kernels a step can: each of moe_kernels.tile_for's blockings, with a pair count
        that is a multiple of 16 and one that is not (Triton specializes integer arguments so)."""
        k, e = self.top_k, self.num_experts
        starts = [1, -(-8 * e // k), -(-48 * e // k)]  # tile_for's thresholds, in tokens
        seen: dict[tuple[moe_kernels.Tile, bool], int] = {}
        for start in starts:
            for t in range(start, min(start + 16, max_tokens) + 1):
                key = (moe_kernels.tile_for(t * k, e), t * k % 16 == 0)
                seen.setdefault(key, t)
        return sorted(set(seen.values()))

    @torch.inference_mode()
    def warm_up(self, max_tokens: int) -> list[int]:
        """On CUDA, run forward once at each of warm_up_token_counts, so the kernels compile
        at start-up, not in the first prefills (the decode CUDA graphs' warm-up covers their
        batch sizes anyway); returns the counts run (none off CUDA)."""
        weight = self.experts_gate_up
        if not weight.is_cuda:
            return []
        counts = self.warm_up_token_counts(max_tokens)
        for num_tokens in counts:
            self(weight.new_zeros(num_tokens, weight.shape[2]))
        return counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.route(x)
        if x.is_cuda:
            out = moe_kernels.fused_experts(x, *routing, self.experts_gate_up, self.experts_down)
        else:
            out = reference_experts(x, routing, self.experts_gate_up, self.experts_down)
        if self.shared_expert_size > 0:
            shared = swiglu(x, self.shared_gate_up, self.shared_down)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out if self.all_reduce is None else self.all_reduce(out)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(SiLU(gate) * up) of one expert: gate_up [2I, H] (gate rows, then up rows), down
    [H, I]; in x's dtype, rounded after each op as torch rounds it."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def reference_experts(
    x: torch.Tensor, routing: Routing, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The experts' weighted sum [T, H] in plain torch (the CPU path and the reference): the
    (token, expert) pairs sorted by expert, one SwiGLU per expert that got any, each pair's
    output times its weight, the top-k summed in float32 and rounded to x's dtype."""
    num_tokens, top_k = routing.expert_ids.shape
    flat_ids = routing.expert_ids.reshape(-1)
    flat_weights = routing.weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    weighted = torch.empty(
        num_tokens * top_k, x.shape[1], dtype=flat_weights.dtype, device=x.device
    )
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        y = swiglu(x[pairs // top_k], gate_up[expert], down[expert])
        weighted[pairs] = (y * flat_weights[pairs, None]).to(weighted.dtype)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def expert_tensors(
    take: Callable[[str], torch.Tensor], prefix: str, num_experts: int, family: str
) -> dict[str, torch.Tensor]:
    """One layer's SparseMoe parameters, keyed relative to the layer ("mlp.gate.weight",
    "mlp.experts_gate_up", "mlp.experts_down", and for qwen2_moe "mlp.shared_gate_up",
    "mlp.shared_down", "mlp.shared_expert_gate.weight"), popped through take(name) (which
    raises KeyError or ValueError naming a missing tensor) from names under prefix (the
    layer's, e.g. "layers.3."). family: "mixtral", "qwen3_moe" or "qwen2_moe".

    Two on-disk formats: the hub's per-expert tensors (Mixtral
    `block_sparse_moe.experts.{e}.w1/w3/w2.weight` and `block_sparse_moe.gate.weight`; Qwen
    `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` and `mlp.gate.weight`), which
    transformers 5.25's save_pretrained also writes, and its in-memory fused layout (written with
    save_pretrained(save_original_format=False)): `mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I], `mlp.gate.weight`."""
    if family not in PER_EXPERT_NAMES:
        raise ValueError(f"MoE family {family!r} is not one of {sorted(PER_EXPERT_NAMES)}")
    prefix = prefix if not prefix or prefix.endswith(".") else prefix + "."
    module, gate_name, up_name, down_name = PER_EXPERT_NAMES[family]
    per_expert = f"{prefix}{module}.experts.{{}}.{{}}.weight"
    fused = f"{prefix}mlp.experts."
    try:
        first_gate = take(per_expert.format(0, gate_name))
    except (KeyError, ValueError):
        first_gate = None
    if first_gate is not None:
        gates = [first_gate] + [
            take(per_expert.format(e, gate_name)) for e in range(1, num_experts)
        ]
        ups = [take(per_expert.format(e, up_name)) for e in range(num_experts)]
        downs = [take(per_expert.format(e, down_name)) for e in range(num_experts)]
        gate_up = torch.stack([torch.cat(pair) for pair in zip(gates, ups, strict=True)])
        down = torch.stack(downs)
        router = take(f"{prefix}{module}.gate.weight")
    else:
        try:
            gate_up = take(fused + "gate_up_proj")
        except (KeyError, ValueError):
            raise ValueError(
                f"checkpoint has neither {per_expert.format(0, gate_name)!r} (per-expert "
                f"format) nor {fused + 'gate_up_proj'!r} (fused format)"
            ) from None
        down = take(fused + "down_proj")
        router = take(f"{prefix}mlp.gate.weight")
    _check_expert_shapes(prefix, num_experts, router, gate_up, down)
    out = {"mlp.gate.weight": router, "mlp.experts_gate_up": gate_up, "mlp.experts_down": down}
    if family in SHARED_EXPERT_FAMILIES:
        shared = f"{prefix}mlp.shared_expert."
        parts = [take(f"{shared}{name}_proj.weight") for name in ("gate", "up", "down")]
        out["mlp.shared_gate_up"] = torch.cat(parts[:2])
        out["mlp.shared_down"] = parts[2]
        out["mlp.shared_expert_gate.weight"] = take(f"{prefix}mlp.shared_expert_gate.weight")
    return out


def _check_expert_shapes(
    prefix: str,
    num_experts: int,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> None:
    """Raise naming the layer's tensor whose shape disagrees with the others or num_experts."""
    if gate_up.dim() != 3 or gate_up.shape[0] != num_experts or gate_up.shape[1] % 2:
        raise ValueError(
            f"{prefix}experts gate/up: shape {tuple(gate_up.shape)}, want "
            f"[num_experts={num_experts}, 2 * expert size, hidden size]"
        )
    _, two_i, hidden = gate_up.shape
    if tuple(down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"{prefix}experts down: shape {tuple(down.shape)}, want "
            f"{(num_experts, hidden, two_i // 2)} (from gate/up's {tuple(gate_up.shape)})"
        )
    if tuple(router.shape) != (num_experts, hidden):
        raise ValueError(
            f"{prefix}router gate.weight: shape {tuple(router.shape)}, want {(num_experts, hidden)}"
        )
