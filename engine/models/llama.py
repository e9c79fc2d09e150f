"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral, and the sparse-MoE
Qwen3-MoE, Qwen2-MoE and Mixtral) over packed tokens; owns weights.

GQA, RMSNorm, SwiGLU, optional qkv bias (Qwen2), optional per-head RMSNorm of q and k before
RoPE (Qwen3's q_norm / k_norm: ModelConfig.qk_norm), optional tied embeddings. q/k/v and gate/up
projections are fused into one matmul each; the loader fuses the checkpoint's tensors. With a
QuantScheme the four projections are its layers (engine/quant/fp8.py make_linear: FP8, int4 or
int8); embeddings, norms and the LM head keep the model's dtype. With use_fused_ops(True) (the
FlashInfer backend) the elementwise work runs as fused CUDA kernels (models/fused_ops.py), an
Fp8Linear that would quantize its input gets it quantized by the norm or SiLU kernel before it
(quant/fp8_fused.py), an Fp8Linear that defers its scales (decode batches) hands its output as
ScaledRows to the kernel after it, which applies them, and the residual stream is carried next
to the hidden states; otherwise plain torch ops, which are the CPU path and the reference. With
fused kernels, a step of one row (models/fused_gemv.py's limit) over unquantized bias-free
projections runs each layer as four fused GEMVs around RoPE and attention instead. RoPE and the
KV-cache write belong to the attention backend (AttentionBackend.forward_qkv), which may fuse
them; the q/k norm runs on the projection's output before it, on every path
(Attention.normed_qk).

MoE models (ModelConfig.num_experts > 0, architecture in MOE_FAMILIES): a layer in
config.moe_layers has a SparseMoe (models/moe.py) as its mlp, the others a dense MLP of
intermediate_size. The experts run in the model's dtype only, so a quantized MoE model is
refused (check_moe_quant). Every path takes a SparseMoe mlp as a whole: the fused-ops path
hands it the normed rows (its router and experts are their own kernels), and the fused-GEMV path
runs a MoE layer's attention as its two GEMVs and then norm -> SparseMoe -> residual add.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.models import fused_gemv, fused_ops
from engine.models.moe import SparseMoe
from engine.models.rope import RotaryEmbedding
from engine.parallel.layers import lm_head, vocab_embedding
from engine.parallel.tensor_parallel import SINGLE, TensorParallel, rank_model_config
from engine.quant.config import QuantScheme
from engine.quant.fp8 import defers_scales, make_linear, takes_quantized
from engine.quant.fp8_fused import add_rms_norm_quantize, silu_and_mul_quantize
from engine.quant.fp8_types import QuantizedRows, ScaledRows, materialized


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rope: RotaryEmbedding,
        quant: QuantScheme | None,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.layer = layer
        self.tp = tp  # qkv_proj: this rank's heads; o_proj: their columns, all-reduced
        heads = rank_model_config(config, tp)
        self.q_size = heads.num_heads * config.head_dim
        kv_size = heads.num_kv_heads * config.head_dim
        qkv_size = self.q_size + 2 * kv_size
        self.qkv_proj = make_linear(config.hidden_size, qkv_size, config.attention_bias, quant)
        o_bias = config.o_proj_bias and tp.rank == 0  # added once to the ranks' sum
        self.o_proj = make_linear(self.q_size, config.hidden_size, o_bias, quant)
        self.rope = rope
        self.fused = False
        self.head_dim = config.head_dim
        self.kv_size = kv_size
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor | QuantizedRows, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor | ScaledRows:
        """ScaledRows only with fused kernels (see project)."""
        if not self.fused:
            qkv = self.normed_qk(self.qkv_proj(x))
            out = attn.forward_qkv(self.layer, qkv, positions, self.rope)
            return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))
        qkv = project(self.qkv_proj, x)
        if self.q_norm is not None or not getattr(attn, "reads_scaled_rows", False):
            qkv = self.normed_qk(materialized(qkv))  # the q/k norm reads plain rows
        out = attn.forward_qkv(self.layer, qkv, positions, self.rope)
        return self.tp.all_reduce(project(self.o_proj, out.reshape(-1, self.q_size)))

    def normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] with each head of q and of k RMS-normed (qk_norm models;
        others: qkv as it is), as a new tensor: the projection's output is not changed in place.
        Every path applies it: the plain one with torch ops (HF's rounding), the fused one (and
        the fused GEMVs' attend, which runs only with fused ops) with FlashInfer's RMSNorm over
        the heads as rows [T * H, D]."""
        if self.q_norm is None or self.k_norm is None:
            return qkv
        rows, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        normed = []
        for x, norm in ((q, self.q_norm), (k, self.k_norm)):
            if self.fused:  # the strided slice is copied into contiguous rows by reshape
                x = fused_ops.rms_norm(x.reshape(-1, d), norm.weight, norm.eps)
            else:
                x = norm(x.reshape(rows, -1, d))
            normed.append(x.reshape(rows, -1))
        return torch.cat((*normed, v), dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, quant: QuantScheme | None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp  # gate_up_proj: this rank's columns; down_proj: their rows, all-reduced
        hidden, inter = config.hidden_size, config.intermediate_size // tp.world_size
        self.gate_up_proj = make_linear(hidden, 2 * inter, False, quant)
        self.down_proj = make_linear(inter, hidden, False, quant)
        self.fused = False

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor | ScaledRows:
        """ScaledRows only with fused kernels (see project)."""
        if self.fused:
            gate_up = project(self.gate_up_proj, x)
            if takes_quantized(self.down_proj, gate_up):
                quantized = silu_and_mul_quantize(gate_up, self.down_proj.input_scale)
                return self.tp.all_reduce(project(self.down_proj, quantized))
            down = self.down_proj(fused_ops.silu_and_mul(materialized(gate_up)))
            return self.tp.all_reduce(down)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


# architecture -> moe.expert_tensors' family: the architectures whose MoE layers run here
MOE_FAMILIES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}


def check_moe_quant(config: ModelConfig, quant: QuantScheme | None) -> None:
    """Refuse a quantized MoE model, naming the scheme: experts run in the model's dtype only
    (the caller says where quant came from: --quantization or the checkpoint)."""
    if quant is not None and config.moe_layers:
        raise ValueError(
            f"{config.architecture}: {quant.method} quantization ({type(quant).__name__}) of "
            "a MoE model is not supported: sparse MoE experts run in bf16 / the model's dtype "
            "only (serve the unquantized checkpoint without --quantization)"
        )


def sparse_moe(config: ModelConfig, tp: TensorParallel = SINGLE) -> SparseMoe:
    """One MoE layer's mlp, shaped and rounded as config's family (Mixtral keeps its routing
    weights in float32, Qwen casts them to the model's dtype: moe.SparseMoe); on a
    tensor-parallel rank, its share of each expert's columns, its output all-reduced."""
    n = tp.world_size
    return SparseMoe(
        config.hidden_size,
        config.moe_intermediate_size // n,
        config.num_experts,
        config.num_experts_per_tok,
        config.norm_topk_prob,
        config.shared_expert_intermediate_size // n,
        float32_routing_weights=MOE_FAMILIES.get(config.architecture) == "mixtral",
        all_reduce=tp.all_reduce if tp.is_parallel else None,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rope: RotaryEmbedding,
        quant: QuantScheme | None,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, rope, quant, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoe = (
            sparse_moe(config, tp) if layer in config.moe_layers else MLP(config, quant, tp)
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        hidden: torch.Tensor | ScaledRows,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor | ScaledRows, torch.Tensor]:
        """hidden: the previous sublayer's output (the embeddings when residual is None)."""
        attn_input = normed_input(self.self_attn.qkv_proj, hidden, residual, self.input_layernorm)
        residual = hidden if residual is None else residual
        hidden = self.self_attn(attn_input, positions, attn)
        consumer = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else self.mlp
        mlp_input = normed_input(consumer, hidden, residual, self.post_attention_layernorm)
        return self.mlp(mlp_input), residual

    def forward_gemv(
        self, residual: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> None:
        """The few-row path (models/fused_gemv.py): residual, the stream, is updated in place;
        the norms, SiLU and the residual adds run inside the projections' GEMVs."""
        att = self.self_attn

        def attend(qkv: torch.Tensor) -> torch.Tensor:
            return attn.forward_qkv(att.layer, att.normed_qk(qkv), positions, att.rope)

        self._gemv_layer(residual, attend)

    def warm_up_gemv(self, num_rows: int) -> None:
        """Run forward_gemv's four kernels once on zeros (they compile on first use);
        attention's output stands in as zeros."""
        norm = self.input_layernorm.weight  # in the activations' dtype (FP8 weights are not)
        residual = norm.new_zeros(num_rows, norm.shape[0])
        self._gemv_layer(residual, lambda qkv: qkv.new_zeros(num_rows, self.self_attn.q_size))

    def _gemv_layer(
        self, residual: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """The layer's four fused GEMVs around attend(qkv) -> attention's output; a MoE layer's
        two attention GEMVs, then its SparseMoe over the normed stream, added in place."""
        att, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
        qkv = fused_gemv.normed_gemv(residual, norm.weight, norm.eps, att.qkv_proj.weight)
        out = attend(qkv).reshape(-1, att.q_size)
        fused_gemv.gemv_add_(out, att.o_proj.weight, residual)
        norm = self.post_attention_layernorm
        if isinstance(mlp, SparseMoe):
            residual.add_(mlp(fused_ops.rms_norm(residual, norm.weight, norm.eps)))
            return
        gate_up = mlp.gate_up_proj.weight
        hidden = fused_gemv.normed_gemv_silu(residual, norm.weight, norm.eps, gate_up)
        fused_gemv.gemv_add_(hidden, mlp.down_proj.weight, residual)

    def projections(self) -> list[nn.Module]:
        """The layer's dense projections (a MoE layer's attention only: its experts are not
        Linears)."""
        att, mlp = self.self_attn, self.mlp
        dense = [mlp.gate_up_proj, mlp.down_proj] if isinstance(mlp, MLP) else []
        return [att.qkv_proj, att.o_proj, *dense]


def project(layer: nn.Module, x: torch.Tensor | QuantizedRows) -> torch.Tensor | ScaledRows:
    """layer(x) for fused kernels: ScaledRows where layer defers its scales for these rows (the
    kernel that reads them applies the scales), else the plain output."""
    if defers_scales(layer, x):
        return layer.forward_deferred(x)
    return layer(x)


def normed_input(
    consumer: nn.Module,
    hidden: torch.Tensor | ScaledRows,
    residual: torch.Tensor | None,
    norm: RMSNorm,
) -> torch.Tensor | QuantizedRows:
    """rmsnorm(residual + hidden) * weight, fused kernels only: residual += hidden in place
    (no residual: the norm of hidden, which stays as it is); quantized in the same kernel when
    the consumer is an Fp8Linear that would quantize it, else in hidden's storage. hidden may
    be ScaledRows (read through its scales)."""
    if takes_quantized(consumer, hidden):
        return add_rms_norm_quantize(hidden, residual, norm.weight, norm.eps, consumer.input_scale)
    hidden = materialized(hidden)
    if residual is None:
        return fused_ops.rms_norm(hidden, norm.weight, norm.eps)
    fused_ops.add_rms_norm_(hidden, residual, norm.weight, norm.eps)
    return hidden


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        quant: QuantScheme | None = None,
        tp: TensorParallel = SINGLE,
    ):
        """tp: this rank's share of the weights (engine/parallel/); SINGLE: all of them."""
        super().__init__()
        if config.num_experts and config.architecture not in MOE_FAMILIES:
            # e.g. a MoE config.json without "architectures": its tensors' names are unknown
            raise ValueError(
                f"{config.architecture} runs dense MLPs; this config has num_experts="
                f"{config.num_experts} (sparse MoE layers run for {', '.join(MOE_FAMILIES)})"
            )
        check_moe_quant(config, quant)
        self.config = config
        self.quant = quant
        self.tp = tp
        self.embed_tokens = vocab_embedding(config, tp)
        rope = RotaryEmbedding(config, max_positions)
        self.rope = rope
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rope, quant, tp) for i in range(config.num_layers)
        )
        self.fused_ops = False
        self._plain_projections: dict[torch.dtype, list[nn.Module]] = {}
        # An FP8 checkpoint's per-layer (k_scale, v_scale) for an fp8 KV cache (the loader's).
        self.kv_scales: list[tuple[float, float]] | None = None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = lm_head(config, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.fused_ops and self.takes_row_kernels(x):
            for layer in self.layers:  # x, a fresh tensor, is the residual stream from here
                layer.forward_gemv(x, positions, attn)
            return fused_ops.rms_norm(x, self.norm.weight, self.norm.eps)
        if self.fused_ops:
            residual = None
            for layer in self.layers:
                x, residual = layer.forward_fused(x, residual, positions, attn)
            assert residual is not None
            x = materialized(x)
            fused_ops.add_rms_norm_(x, residual, self.norm.weight, self.norm.eps)
            return x
        for layer in self.layers:
            x = layer(x, positions, attn)
        return self.norm(x)

    def plain_projections(self, dtype: torch.dtype) -> list[nn.Module]:
        """Every layer's dense projections (MoE layers': attention's) if all are unquantized
        Linears without bias in dtype (the fused GEMVs' condition, checked once per dtype), else
        []: no fused GEMVs."""
        if dtype not in self._plain_projections:
            every = [p for layer in self.layers for p in layer.projections()]
            # The GEMVs add o_proj and down_proj into the residual: no all-reduce between.
            plain = all(fused_gemv.plain_linear(p, dtype) for p in every)
            plain = plain and not self.tp.is_parallel
            self._plain_projections[dtype] = every if plain else []
        return self._plain_projections[dtype]

    def takes_row_kernels(self, x: torch.Tensor) -> bool:
        """Whether a step whose hidden states are x runs each layer as four fused GEMVs
        (models/fused_gemv.py)."""
        return fused_gemv.takes(x, self.plain_projections(x.dtype))

    def fused_gemv_rows(self) -> list[int]:
        """The step row counts that run on the fused GEMVs (none without fused ops)."""
        weight = self.embed_tokens.weight
        rows = range(1, fused_gemv.MAX_ROWS + 1)
        fits = [n for n in rows if self.takes_row_kernels(weight.new_empty(n, weight.shape[1]))]
        return fits if self.fused_ops else []

    def warm_up_fused_gemvs(self) -> list[int]:
        """Compile the fused GEMVs for every row count that takes them now, not in
        the first such step (an engine without CUDA graphs has no other warm-up); returns
        those row counts."""
        rows = self.fused_gemv_rows()
        kinds = {type(layer.mlp): layer for layer in self.layers}  # one dense, one MoE layer
        with torch.inference_mode():
            for num_rows in rows:
                for layer in kinds.values():
                    layer.warm_up_gemv(num_rows)
        return rows

    def warm_up_moe(self, max_tokens: int) -> list[int]:
        """Compile the MoE experts' kernels for every specialization a step of up to
        max_tokens tokens meets (SparseMoe.warm_up: CUDA only; one layer compiles them for all,
        which share a shape); returns the token counts run (none without MoE layers)."""
        moe = next((layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoe)), None)
        return [] if moe is None else moe.warm_up(max_tokens)

    def use_fused_ops(self, enabled: bool) -> None:
        """Switch the elementwise work to FlashInfer's fused CUDA kernels (or back)."""
        self.fused_ops = enabled
        for layer in self.layers:
            if isinstance(layer.mlp, MLP):  # a SparseMoe picks its kernels by device
                layer.mlp.fused = enabled
            layer.self_attn.fused = enabled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in the model's dtype (the sampler widens them when it needs to); with
        tensor parallelism on rank 0 only, the others get their vocabulary slice."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.tp.gather_vocab(F.linear(hidden, weight), self.config.vocab_size)
