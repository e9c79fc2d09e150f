"""Small frozen configs: the model's shape, the KV cache's geometry, the scheduler's limits, and
EngineConfig, which carries them with the user's settings (engine/settings.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.execution.memory_budget import check_fraction
from engine.quant.config import check_quantization, fp8_device_error
from engine.settings import Settings

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class StartRefused(ValueError):
    """A setting the engine cannot start with, found only once the worker knows its model (a
    KV tier too small for one block of it): every start fails the same way (the controller
    stops trying at once; a crash or a full GPU is retried)."""


class CheckpointRefused(StartRefused):
    """A checkpoint (its config.json or its tensors) the engine does not run."""


# config.json's `architectures` the engine runs (engine/models/registry.py maps each to its
# class); here, torch-free, so the CLI refuses another before any process starts
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma3ForCausalLM",
)


def names_default(model: str) -> bool:
    """Whether `model` names the default model (SmolLM2, fetched as a GGUF package)."""
    return model.lower() in (
        "default",
        DEFAULT_MODEL.lower(),
        f"huggingfacetb/{DEFAULT_MODEL}".lower(),
    )


def served_model_id(model: str) -> str:
    """The id a model is served under: the default model's name, a GGUF file's stem, or the
    checkpoint folder's name."""
    if names_default(model):
        return DEFAULT_MODEL
    # "." and "../x/" name their folders too; a link keeps its own name (not its target's)
    path = Path(os.path.abspath(Path(model).expanduser()))
    return path.stem if model.endswith(".gguf") else path.name


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling parameters (llama3 style or linear); `kind` "default" means none."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# rope_type values the engine computes (models/rope.py); others (yarn, dynamic, longrope, ...)
# are refused at config read.
ROPE_KINDS = ("default", "linear", "llama3")
# model_type -> whether q and k get a per-head RMSNorm after the projection (Qwen3's q_norm,
# k_norm; Gemma 3's, of its own (1 + weight) kind)
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
# Gemma 3's text decoder (models/gemma3.py): config.json's model_type and the defaults
# transformers' Gemma3TextConfig gives the fields a config.json may leave out.
GEMMA3_TEXT = "gemma3_text"
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "num_key_value_heads": 1,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
_GEMMA3_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral) or of Gemma 3's
    text decoder, and of the sparse MoE MLPs of Qwen3-MoE, Qwen2-MoE (a gated shared expert
    beside the routed ones) and Mixtral (models/llama.py MOE_FAMILIES)."""

    model_id: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and of k, before RoPE
    sliding_window: int | None = None  # Mistral: the engine caps max_model_len to it
    # Per layer: its attention window (a query attends to the keys of the last W positions, its
    # own included: transformers' sliding_window) or None (every position). Empty: all None.
    # Gemma 3's sliding_attention layers; the paged cache still keeps every position.
    layer_windows: tuple[int | None, ...] = ()
    # The windowed layers' RoPE base (Gemma 3's rope_local_base_freq, unscaled); None: those
    # layers use rope_theta and rope_scaling like the others.
    local_rope_theta: float | None = None
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh (Gemma 3)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"
    # Sparse MoE MLPs (0 experts: every MLP is dense, of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts a token is routed to
    moe_intermediate_size: int = 0  # one expert's MLP width
    norm_topk_prob: bool = False  # the top-k routing weights are renormalized to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is sparse; the others are dense
    shared_expert_intermediate_size: int = 0  # an always-on shared expert's width (0: none)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], model_id: str) -> ModelConfig:
        """Read a transformers config.json dict (both rope_scaling and rope_parameters forms).
        A field that changes the model's math in a way the engine does not implement is refused
        by name and value (check_hf_fields)."""
        check_hf_fields(hf)
        model_type = hf.get("model_type", "llama")
        gemma3 = model_type == GEMMA3_TEXT
        if gemma3:
            hf = {**_GEMMA3_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if gemma3:
            rope = _gemma3_rope(hf)["full_attention"]
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        scaling = RopeScaling(
            kind=kind,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)
            ),
        )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        num_layers = int(hf["num_hidden_layers"])
        return cls(
            model_id=model_id,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_qkv_bias(hf, model_type),
            o_proj_bias=model_type not in QKV_BIAS_TYPES and bool(hf.get("attention_bias", False)),
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            sliding_window=_whole_model_window(hf, gemma3),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            architecture=archs[0],
            **_moe_fields(hf, model_type, num_layers),
            **(_gemma3_fields(hf, num_layers) if gemma3 else {}),
        )

    @classmethod
    def from_dir(cls, path: str | Path, model_id: str | None = None) -> ModelConfig:
        path = Path(path)
        try:
            hf = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf, model_id or Path(os.path.abspath(path)).name)

    @property
    def context_len(self) -> int:
        """The longest sequence the model runs: its positions, capped by a whole-model sliding
        window (Mistral's, whose attention the engine does not implement)."""
        positions = self.max_position_embeddings
        return min(positions, self.sliding_window or positions)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def _whole_model_window(hf: dict[str, Any], gemma3: bool) -> int | None:
    """Mistral's sliding_window, which caps max_model_len; Gemma 3's is per layer instead."""
    if gemma3 or not hf.get("use_sliding_window", True):
        return None
    return hf.get("sliding_window")


def _gemma3_layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """config.json's layer_types, or (older configs) every sliding_window_pattern-th layer
    full and the others sliding, as transformers derives them."""
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern") or 6)
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers:
        raise ValueError(
            f"config.json's layer_types has {len(types)} entries for num_hidden_layers={num_layers}"
        )
    return list(types)


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Gemma 3's RoPE per layer type, from either form of config.json: rope_parameters keyed by
    layer type (transformers 5), or rope_theta, rope_scaling (the full layers') and
    rope_local_base_freq (the sliding layers')."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and set(params) <= set(_LAYER_TYPES) and params:
        out = {kind: dict(params.get(kind) or {}) for kind in _LAYER_TYPES}
    else:
        out = {"full_attention": dict(hf.get("rope_scaling") or {}), "sliding_attention": {}}
        if hf.get("rope_theta") is not None:
            out["full_attention"]["rope_theta"] = hf["rope_theta"]
        if hf.get("rope_local_base_freq") is not None:
            out["sliding_attention"]["rope_theta"] = hf["rope_local_base_freq"]
    for kind, theta in _GEMMA3_ROPE_THETA.items():
        out[kind].setdefault("rope_theta", theta)
    return out


def _gemma3_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelConfig's Gemma 3 fields: a window per sliding_attention layer, their RoPE base,
    the query_pre_attn_scalar ** -0.5 softmax scale and the activation."""
    window = int(hf["sliding_window"])
    if window < 1:
        raise ValueError(f"config.json's sliding_window={window} must be >= 1")
    types = _gemma3_layer_types(hf, num_layers)
    return dict(
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        local_rope_theta=float(_gemma3_rope(hf)["sliding_attention"]["rope_theta"]),
        attention_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
        hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act")),
    )


# model types whose q/k/v projections have a bias and o_proj none: Qwen2's (attention_bias,
# default true) and Qwen2-MoE's (its config names it qkv_bias, default true)
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")


def _qkv_bias(hf: dict[str, Any], model_type: str) -> bool:
    if model_type == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias", model_type == "qwen2"))


def _moe_fields(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's MoE fields from config.json: Qwen3-MoE (and Qwen2-MoE) name the expert
    count num_experts (transformers 5 writes num_local_experts), size experts by
    moe_intermediate_size, renormalize the top-k weights only with norm_topk_prob, and make a
    layer sparse unless it is in mlp_only_layers or off the decoder_sparse_step grid; Mixtral's
    num_local_experts experts are intermediate_size wide, renormalized, in every layer."""
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if num_experts == 0:
        return {}
    top_k = int(hf.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"config.json's num_experts_per_tok={hf.get('num_experts_per_tok')!r} must be in "
            f"[1, {num_experts}] (the number of experts)"
        )
    if model_type == "mixtral":
        width, norm_topk, sparse = int(hf["intermediate_size"]), True, tuple(range(num_layers))
    else:
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in hf.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        width = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        norm_topk = bool(hf.get("norm_topk_prob", False))
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=norm_topk,
        moe_layers=sparse,
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
    )


def check_hf_fields(hf: dict[str, Any]) -> None:
    """Refuse config.json fields that change the math in ways the engine does not implement,
    naming the field and its value. Fields the supported families' default configs set to a
    harmless value pass (Qwen2/3's layer_types of "full_attention" only, use_sliding_window
    false, null softcaps); Mistral's sliding_window is kept (the engine caps max_model_len).
    Gemma 3's text decoder (model_type gemma3_text) may have sliding_attention layers, a RoPE
    per layer type and the gelu_pytorch_tanh activation; multimodal Gemma 3 is refused."""
    arch = (hf.get("architectures") or [hf.get("model_type", "this model")])[0]
    gemma3 = hf.get("model_type") == GEMMA3_TEXT

    def refuse(name: str, why: str) -> ValueError:
        return ValueError(
            f"{arch}: config.json's {name}={hf_value(name)!r} is not supported ({why})"
        )

    def hf_value(name: str) -> Any:
        value: Any = hf
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    if hf.get("model_type") == "gemma3" or "text_config" in hf:
        raise refuse(
            "model_type",
            "a multimodal checkpoint (Gemma3ForConditionalGeneration); kvrelay runs text-only "
            "decoders: Gemma3ForCausalLM checkpoints (model_type gemma3_text)",
        )
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(name) is not None:
            raise refuse(name, "logit soft-capping is not implemented")
    if hf.get("use_sliding_window"):
        raise refuse("use_sliding_window", "sliding-window attention is not implemented")
    if hf.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", "attention is causal here")
    layer_types = hf.get("layer_types") or []
    allowed = _LAYER_TYPES if gemma3 else ("full_attention",)
    if any(kind not in allowed for kind in layer_types):
        kinds = " and ".join(f'"{kind}"' for kind in allowed)
        raise refuse("layer_types", f"only {kinds} layers are implemented")
    activations = ("silu", "swish", *(("gelu_pytorch_tanh",) if gemma3 else ()))
    for name in ("hidden_act", "hidden_activation"):
        if hf.get(name) not in (None, *activations):  # transformers: silu and swish are SiLU
            raise refuse(name, f"the MLP's activation must be {' or '.join(activations)}")
    if hf.get("mlp_bias"):
        raise refuse("mlp_bias", "MLP projections have no bias here")
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key)
        if not isinstance(rope, dict):
            continue
        if gemma3 and key == "rope_parameters" and set(rope) <= set(_LAYER_TYPES) and rope:
            _check_gemma3_rope(rope, refuse)
            continue
        if any(isinstance(v, dict) for v in rope.values()):
            raise refuse(key, "one RoPE for every layer is implemented, not one per layer type")
        _check_rope(rope, key, refuse)
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse("partial_rotary_factor", "RoPE rotates the whole head here")


def _check_rope(rope: dict[str, Any], key: str, refuse: Callable[[str, str], ValueError]) -> None:
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_KINDS:
        name = f"{key}.rope_type" if "rope_type" in rope else f"{key}.type"
        raise refuse(name, f"RoPE types implemented: {', '.join(ROPE_KINDS)}")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse(f"{key}.partial_rotary_factor", "RoPE rotates the whole head here")


def _check_gemma3_rope(rope: dict[str, Any], refuse: Callable[[str, str], ValueError]) -> None:
    """Gemma 3's rope_parameters per layer type: the full layers' of any implemented type, the
    sliding layers' unscaled (models/gemma3.py builds their table from rope_theta alone)."""
    for kind, params in rope.items():
        key = f"rope_parameters.{kind}"
        if not isinstance(params, dict):
            continue
        _check_rope(params, key, refuse)
        scaled = (params.get("rope_type") or "default") != "default"
        if kind == "sliding_attention" and scaled:
            raise refuse(f"{key}.rope_type", "the sliding layers' RoPE is unscaled here")


KV_CACHE_DTYPES = ("auto", "fp8")


FILE_TIER_READS = ("measured", "always")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. num_blocks=None sizes the pool from kv_cache_memory_bytes; when
    that is None too, from the GPU memory the engine may use (EngineConfig.gpu_memory_utilization,
    engine/execution/memory_budget.py), or a fixed 1 GiB on CPU."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    # "auto": the model's dtype | "fp8": e4m3 (FlashInfer), the checkpoint's KV scales or 1.0
    kv_cache_dtype: str = "auto"
    # A prompt that diverges inside a cached block reuses its first matching tokens (the block
    # is copied into a fresh one) when at least this many match; 0: full blocks only; None:
    # half a block, so a few shared chat-template tokens do not cost a block copy.
    partial_reuse_min_tokens: int | None = None
    # A host-memory tier of the prefix cache (pinned on CUDA): cached blocks evicted from the
    # device pool are copied there and copied back on a prefix hit. 0: none.
    host_kv_cache_bytes: int = 0
    # Blocks a finished request keeps (add_request keep_blocks) are held as the host tier's
    # copies of its leading full blocks (a peer reads them from host memory) instead of their
    # device blocks, which stay cached but unpinned; only the rest holds device blocks. Needs a
    # host tier. The prefill worker's --host-leases.
    keep_on_host: bool = False
    # A disk tier of the prefix cache: blocks evicted from the host tier (or from the device
    # pool without one) are written to files under disk_kv_path (one per block, through NIXL's
    # POSIX backend), loaded back on a prefix hit (while reading beats computing:
    # file_tier_reads), and found again by a restarted engine with the same model and KV
    # layout. 0: none.
    disk_kv_cache_bytes: int = 0
    disk_kv_path: str | None = None
    # The cluster-shared KV store below the disk tier: a directory every worker reads (a shared
    # filesystem); each block written to a disk tier is published there once (the first
    # complete copy wins), and a prefix any worker published is loaded, not computed. Bounded
    # by shared_kv_cache_bytes for all workers together (kept by each worker's scans: exact for
    # up to 8 workers publishing at once, shared_store.WRITERS). 0: none; needs a disk tier.
    shared_kv_cache_bytes: int = 0
    # a directory, or s3://BUCKET/PREFIX: an S3-compatible object store through NIXL's object
    # backend, served at shared_kv_endpoint (None: AWS_ENDPOINT_URL, else AWS's own)
    shared_kv_path: str | None = None
    shared_kv_endpoint: str | None = None
    # A disk tier's or the shared store's prefix hits: "measured" reads them back while a
    # block's recent read time is no longer than computing its tokens at the engine's recent
    # rate, else the prompt computes them (engine/kv_cache/load_gate.py); "always" reads every
    # hit back (less compute, a longer TTFT where reads are the slower).
    file_tier_reads: str = "measured"

    @property
    def partial_reuse_threshold(self) -> int:
        """Matching tokens a partly cached block needs to be reused (0: never)."""
        if self.partial_reuse_min_tokens is None:
            return max(1, self.block_size // 2)
        return self.partial_reuse_min_tokens

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 <= self.partial_reuse_threshold <= self.block_size:
            raise ValueError(
                f"partial_reuse_min_tokens must be in [0, block_size={self.block_size}], got "
                f"{self.partial_reuse_min_tokens}"
            )
        if self.host_kv_cache_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes must be >= 0, got {self.host_kv_cache_bytes}")
        if self.keep_on_host and not self.host_kv_cache_bytes:
            raise ValueError("keep_on_host needs a host tier (host_kv_cache_bytes > 0)")
        if self.file_tier_reads not in FILE_TIER_READS:
            raise ValueError(
                f"file_tier_reads must be one of {FILE_TIER_READS}, got {self.file_tier_reads!r}"
            )
        if self.disk_kv_cache_bytes < 0:
            raise ValueError(f"disk_kv_cache_bytes must be >= 0, got {self.disk_kv_cache_bytes}")
        if self.disk_kv_cache_bytes and not self.disk_kv_path:
            raise ValueError("disk_kv_cache_bytes needs disk_kv_path (the tier's directory)")
        if self.disk_kv_path and not self.disk_kv_cache_bytes:
            raise ValueError("disk_kv_path needs disk_kv_cache_bytes (the tier's size)")
        if self.shared_kv_path and not self.shared_kv_cache_bytes:
            raise ValueError("shared_kv_path needs shared_kv_cache_bytes (the store's size)")
        if self.disk_kv_cache_bytes and not self.enable_prefix_caching:
            raise ValueError("disk_kv_cache_bytes needs enable_prefix_caching")
        if self.shared_kv_cache_bytes < 0:
            raise ValueError(
                f"shared_kv_cache_bytes must be >= 0, got {self.shared_kv_cache_bytes}"
            )
        if self.shared_kv_cache_bytes and not self.shared_kv_path:
            raise ValueError("shared_kv_cache_bytes needs shared_kv_path (the store's directory)")
        if self.shared_kv_cache_bytes and _nested(self.shared_kv_path, self.disk_kv_path):
            raise ValueError(
                "shared_kv_path must differ from disk_kv_path and lie neither inside nor around "
                "it (a worker's disk tier is its own; its start scan would adopt shared files)"
            )
        if self.shared_kv_endpoint and not is_object_store(self.shared_kv_path):
            raise ValueError(
                "shared_kv_endpoint needs an object store as shared_kv_path (s3://BUCKET/PREFIX), "
                f"got {self.shared_kv_path!r}"
            )
        if self.shared_kv_cache_bytes and not self.disk_kv_cache_bytes:
            raise ValueError(
                "shared_kv_cache_bytes needs a disk tier (disk_kv_cache_bytes > 0): blocks are "
                "published to the shared store as they reach the disk tier"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits: tokens computed in one step, sequences running at once, context length."""

    max_num_batched_tokens: int = 2048
    # None: the engine picks it for its KV pool (memory_budget.default_max_num_seqs: 64 for a
    # fixed-size pool, up to 1024 for one sized by GPU memory); Engine.config holds the choice.
    max_num_seqs: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        seqs = self.max_num_seqs
        if self.max_num_batched_tokens < 1 or (seqs is not None and seqs < 1):
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculation/). method None: off; "ngram": prompt lookup
    (the tokens that followed the last n tokens' latest earlier match, prompt and output);
    "draft": draft_model (a model of the same tokenizer, a path or "default" for SmolLM2)
    continues each request greedily, run with a KV pool of draft_kv_cache_bytes.

    num_speculative_tokens: drafted tokens verified per step (K); ngram_min / ngram_max: the
    match lengths tried, longest first; max_batch: speculation steps aside while more
    requests than this are running (a large batch is bound by compute, not by weight reads);
    adaptive: also step aside while it measures dearer per token than plain decode steps on
    this engine (engine/speculation/speculation_cost.py; tests that count drafts turn it off).
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 8
    adaptive: bool = True
    draft_model: str | None = None
    draft_kv_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError(
                "speculative method 'draft' needs a draft_model, and only it takes one"
            )
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS} or None")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max")
        if self.max_batch < 1:
            raise ValueError("speculative max_batch must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto" (cuda when a GPU is visible)
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 elsewhere
    attention_backend: str = "auto"  # "auto" (flashinfer on CUDA when importable) | "torch"
    cuda_graph: bool = True  # decode CUDA graphs (FlashInfer backend only; ignored on CPU)
    async_scheduling: bool | None = None  # overlap step N+1's host work with step N on the GPU
    # (None: on when decode runs through CUDA graphs)
    load_format: str = "auto"  # "auto": the checkpoint's weights | "dummy": random (speed runs)
    # "fp8": quantize bf16 weights at load (an FP8 checkpoint is detected by itself); CUDA only
    quantization: str | None = None
    seed: int | None = None
    record_kv_events: bool = False
    detokenize: bool = False  # text deltas in RequestOutput (stop strings always detokenize)
    # A KV pool sized by GPU memory: kvrelay's engines on a card use this part of it together,
    # and this engine gpu_share of that (Ray's fractional num_gpus: 0.5 when two share a GPU).
    gpu_memory_utilization: float = 0.9
    gpu_share: float = 1.0
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Ranks the model is split over (engine/parallel/: heads, MLP columns, vocabulary); rank 0
    # runs the engine, the others follow its steps. A collective that waits longer than the
    # timeout (a rank gone or stuck) fails the engine with an error instead of hanging.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0
    # Run synthetic prompts of every step size through the engine before it serves, so kernels
    # load then, not in the first requests (engine/warm_up.py); None: on CUDA only.
    warm_up: bool | None = None
    # The KVRELAY_* choices (engine/settings.py), read from the environment where the config is
    # built (the driver) and carried as they are to the workers the config is sent to.
    settings: Settings = field(default_factory=Settings.from_env)
    # The id clients name the model by (a request's `model`, /v1/models, the index namespace,
    # metrics labels); None: served_model_id(model), the folder's name or a .gguf file's stem.
    served_model_name: str | None = None

    @property
    def model_id(self) -> str:
        """The id this engine's model is served under (served_model_name, else the model's)."""
        return self.served_model_name or served_model_id(self.model)

    def __post_init__(self) -> None:
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must be non-empty when given")
        check_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        check_fraction("gpu_share", self.gpu_share)
        check_quantization(self.quantization)
        if self.quantization is not None and self.device == "cpu":
            raise ValueError(fp8_device_error("cpu"))
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.cache.shared_kv_cache_bytes:
            raise ValueError(  # its files would hold rank 0's heads only
                "cache.shared_kv_cache_bytes: the shared KV store is not split across "
                "tensor-parallel ranks yet (tensor_parallel_size must be 1)"
            )
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(
                f"tensor_parallel_timeout_s must be > 0, got {self.tensor_parallel_timeout_s}"
            )


def is_object_store(path: str | None) -> bool:
    """Whether a shared store location is an object store (s3://BUCKET/PREFIX), not a
    directory (kvtransfer/s3_control.py parses it)."""
    return bool(path) and str(path).startswith("s3://")


def _nested(a: str | None, b: str | None) -> bool:
    """Whether directories a and b are one, or one lies inside the other (resolved: a trailing
    slash, a relative path or a link to the same directory is the same directory)."""
    if not a or not b or is_object_store(a) or is_object_store(b):
        return False
    ra, rb = Path(a).resolve(), Path(b).resolve()
    return ra == rb or ra.is_relative_to(rb) or rb.is_relative_to(ra)
