"""FlashInferAttention: the GPU backend; paged prefill and decode through FlashInfer's wrappers.

Owns the FlashInfer workspace, an eager prefill wrapper (steps with any multi-token chunk, decode
rows included), an eager decode wrapper (pure-decode steps) and, after enable_cuda_graphs(), one
decode wrapper per captured batch size over shared static page-table buffers, and with an fp8
cache on Hopper the XQA decode kernel in their place (xqa_decode.py). The KV cache is bf16/fp16
(the model's dtype) or fp8 e4m3 (half the bytes per token, stored as K / k_scale and V /
v_scale per layer: the checkpoint's scales, else 1.0); new K/V reach it through one fused RoPE
+ write kernel per layer (rope_kv_kernel.py). Prefill chunks run on fa2 (fa3's faster attention
did not make the 8B offline run on an H200 faster; bench/RESULTS.md as of 31b779a).

Whole prompts (chunks with nothing cached before them) at the end of a step attend over their
own K/V instead, as the RoPE kernel leaves them in the activations' dtype, through FlashInfer's
ragged wrapper (fa3): no page table, no fp8 pages to widen, and the unquantized K/V of the
prompt itself. The paged wrapper keeps the rows before them (chunks that continue a prompt or
follow a cached prefix, decode rows XQA does not take). On Hopper over a bf16/fp16 cache only
(ragged_backend): the 8B bf16 offline run's steps with prefill chunks spent 13.3 ms a step in
attention instead of 41.2, and the run took 95.6 s instead of 96.7 (issue 12's twelfth round).
Not over an fp8 cache: with FP8 weights the FP8 GEMMs ran ~10% slower beside fa3 and the 8B
offline run was 2.6% slower (tenth round); bf16 weights over an fp8 cache were not measured
with it.

Per-layer attention windows (AttentionBackend.windows, Gemma 3's sliding layers): every wrapper
exists once per distinct window (None: full attention), each planned with FlashInfer's
window_left = W - 1 (it attends keys in [p - window_left, p]), and a layer runs the wrapper of
its window; CUDA graphs likewise hold one decode wrapper per (batch size, window), over the
same static page-table buffers (the windows' plans write the same table). Neither XQA nor the
ragged fa3 path is planned with a window here, so a model with windows runs without them: its
decode rows and whole prompts go through the paged fa2 wrappers.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, SeqSpan
from engine.attention.dense_table import DenseTableDecode
from engine.attention.rope_kv_kernel import KvOut, rope_and_write_kv
from engine.attention.xqa_decode import XqaDecode, use_xqa
from engine.execution.host_tensors import index_tensor

if TYPE_CHECKING:
    from engine.models.rope import RotaryEmbedding
    from engine.quant.fp8_types import ScaledRows

WORKSPACE_BYTES = 256 << 20
FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)
FP8_KV_DTYPE = torch.float8_e4m3fn
PREFILL_KERNEL = "fa2"  # FlashInfer's backend for the paged prefill wrapper
HOPPER = (9, 0)


# The head sizes FlashInfer's kernels are built for (fa2 and fa3; a head of 16 fails fa2's MMA
# configuration check at the first paged prefill)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def ragged_backend(capability: tuple[int, int], kv_dtype: torch.dtype, head_dim: int) -> str | None:
    """The FlashInfer backend that attends whole prompts over their own K/V: fa3 on Hopper over
    a bf16/fp16 cache of a head size fa3 is built for, else None (they go through the paged
    cache like every other chunk)."""
    fa3 = (
        capability == HOPPER and kv_dtype in FLASHINFER_DTYPES and head_dim in FLASHINFER_HEAD_DIMS
    )
    return "fa3" if fa3 else None


def whole_prompts_from(seqs: list[SeqSpan]) -> int:
    """Where the step's trailing run of whole prompts starts (len(seqs): none). A whole
    prompt is a chunk of more than one token with nothing cached before it: its attention
    reads only its own K/V, which need not go through the paged cache."""
    start = len(seqs)
    while start and seqs[start - 1].q_len > 1 and seqs[start - 1].q_len == seqs[start - 1].ctx_len:
        start -= 1
    return start


def window_left(window: int | None) -> dict[str, int]:
    """The plan() argument of an attention window W: FlashInfer's window_left counts the keys
    before the query's own, so keys in (p - W, p] are window_left = W - 1 (no window: FlashInfer's
    default, every key)."""
    return {} if window is None else {"window_left": window - 1}


def flashinfer_available() -> bool:
    """True when the optional `flashinfer` package (`pip install kvrelay[gpu]`) imports, and
    triton (which CUDA builds of torch bring) for the fused RoPE + KV write."""
    if importlib.util.find_spec("flashinfer") is None or importlib.util.find_spec("triton") is None:
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # a broken install (missing CUDA libs) counts as absent
        return False
    return True


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The attention backend to build: "auto" is flashinfer on CUDA (bf16/fp16, a head size
    in FLASHINFER_HEAD_DIMS, importable); "flashinfer" refuses what it cannot run."""
    if requested == "auto":
        usable = device.type == "cuda" and dtype in FLASHINFER_DTYPES
        usable = usable and head_dim in FLASHINFER_HEAD_DIMS
        return "flashinfer" if usable and flashinfer_available() else "torch"
    if requested not in ("torch", "flashinfer"):
        raise ValueError(f"attention_backend must be auto, torch or flashinfer, got {requested!r}")
    if requested == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    if requested == "flashinfer" and head_dim not in FLASHINFER_HEAD_DIMS:
        raise ValueError(
            f"the flashinfer attention backend runs head_dim {FLASHINFER_HEAD_DIMS}; this "
            f"model's head_dim is {head_dim} (use attention_backend torch)"
        )
    return requested


@dataclass(frozen=True)
class PageTable:
    """One step's FlashInfer CSR page table (int32): the pointers in host memory (the plan
    reads them there), the block ids already on their way to the device (FlashInfer copies a
    host tensor into a graph's buffer with a blocking copy, which waits for the GPU)."""

    qo_indptr: torch.Tensor  # [B + 1] query rows of each sequence
    kv_indptr: torch.Tensor  # [B + 1] pages of each sequence in kv_indices
    kv_indices: torch.Tensor  # [sum pages] physical block ids (on the device)
    kv_last_page_len: torch.Tensor  # [B] valid tokens in each sequence's last page


def page_table(seqs: list[SeqSpan], block_size: int, device: torch.device) -> PageTable:
    """Build the CSR page table of packed sequences (in SeqSpan order; queries from row 0)."""
    bs = block_size
    qo_indptr, kv_indptr, indices, last_len = [0], [0], [], []
    for seq in seqs:
        num_pages = -(-seq.ctx_len // bs)
        qo_indptr.append(qo_indptr[-1] + seq.q_len)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        indices.extend(seq.block_ids[:num_pages])
        last_len.append(seq.ctx_len - (num_pages - 1) * bs)

    def as_int32(values: list[int]) -> torch.Tensor:
        return index_tensor(values, torch.int32)

    device_indices = index_tensor(indices, torch.int32, device)
    return PageTable(as_int32(qo_indptr), as_int32(kv_indptr), device_indices, as_int32(last_len))


def num_leading_decodes(seqs: list[SeqSpan]) -> int:
    """How many sequences at the front of a step are single-token decode rows."""
    for i, seq in enumerate(seqs):
        if seq.q_len != 1:
            return i
    return len(seqs)


def share_plan_buffers(wrapper: Any, owner: Any) -> None:
    """Let a graph decode wrapper plan into owner's int workspace and its pinned host copy.

    FlashInfer gives every wrapper its own 8 MiB of each: one wrapper per captured batch size
    (up to ~130) held a GiB of GPU memory that the memory budget did not count. Sharing is safe
    for the graph wrappers as for their page-table buffers: one graph replays at a time, right
    after its own plan, and a plan first waits for the previous plan's uploads. A FlashInfer
    without these attributes keeps its own buffers.
    """
    names = ("_int_workspace_buffer", "_pin_memory_int_workspace_buffer")
    if wrapper is owner or not all(hasattr(w, n) for w in (wrapper, owner) for n in names):
        return
    for name in names:
        setattr(wrapper, name, getattr(owner, name))


class FlashInferAttention(AttentionBackend):
    """Paged attention with FlashInfer (fa2 kernels, HND pages read through their strides).

    The layer-packed cache gives, per layer, a non-contiguous view [num_blocks, 2, Hkv,
    block_size, D] whose page stride spans every layer; FlashInfer reads pages through tensor
    strides, so no copy is made. A step whose chunks are all single tokens runs the decode
    wrapper; any other step runs one prefill wrapper over all its sequences (decode rows are
    1-row queries), so a mixed batch costs one plan and one kernel per layer, with no
    reordering of tokens. The decode wrapper uses tensor cores: it shares the prefill
    wrapper's JIT module (FlashInfer's CUDA-core decode was no faster at batch 1 on an H200).
    With XQA (an fp8 cache on Hopper) decode rows run on it instead, in mixed steps too: the
    leading decode rows go to it, the rest to the prefill wrapper (the decode wrapper when they
    are all decode rows). With the ragged wrapper on (see
    ragged_backend) the step's trailing whole prompts go to it (see the module's docstring): up
    to three plans and three attention kernels a layer. kv_scales: per layer (k_scale,
    v_scale) of an fp8 cache (default 1.0 each).
    """

    reads_scaled_rows = True  # rope_and_write_kv applies ScaledRows' scales as it reads

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        head_dim: int,
        q_dtype: torch.dtype | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        kv_scales: list[tuple[float, float]] | None = None,
        scale: float | None = None,
        windows: Sequence[int | None] = (),
    ):
        """q_dtype: the model's activations (default: the cache's dtype; needed for fp8 KV)."""
        import flashinfer

        super().__init__(kv_cache, num_heads, head_dim, scale, windows)
        # the distinct windows, each with its own wrappers (None: full attention)
        self._groups: list[int | None] = list(dict.fromkeys(self.windows))
        windowed = any(w is not None for w in self._groups)
        self.q_dtype = q_dtype or kv_cache.dtype
        if self.q_dtype not in FLASHINFER_DTYPES:
            raise ValueError(f"FlashInfer needs bf16/fp16 activations, got {self.q_dtype}")
        if kv_cache.dtype not in (*FLASHINFER_DTYPES, FP8_KV_DTYPE):
            raise ValueError(f"FlashInfer needs a bf16/fp16/fp8 KV cache, got {kv_cache.dtype}")
        self._flashinfer = flashinfer
        self.block_size = kv_cache.shape[4]
        self.device = kv_cache.device
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        capability = torch.cuda.get_device_capability(self.device)
        self._prefill = {
            group: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "HND", backend=PREFILL_KERNEL
            )
            for group in self._groups
        }
        self._decode = {group: self._decode_wrapper() for group in self._groups}
        self.ragged_kernel = ragged_backend(capability, kv_cache.dtype, head_dim)
        if windowed:  # the ragged path is not planned with a window
            self.ragged_kernel = None
        self._ragged: Any = None
        if self.ragged_kernel is not None:
            self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace, "NHD", backend=self.ragged_kernel
            )
        self._ragged_from_row: int | None = None  # this step's first whole-prompt row
        self._graph_decode: dict[int, dict[int | None, Any]] = {}  # batch size -> per window
        num_layers = kv_cache.shape[1]
        self.kv_scales = kv_scales or [(1.0, 1.0)] * num_layers
        if len(self.kv_scales) != num_layers:
            raise ValueError(f"{len(self.kv_scales)} KV scale pairs for {num_layers} layers")
        if kv_cache.dtype != FP8_KV_DTYPE and any(p != (1.0, 1.0) for p in self.kv_scales):
            raise ValueError("KV scales apply to an fp8 KV cache only")
        # decode rows on a kernel that takes a dense page table: XQA
        self._table_decode: DenseTableDecode | None = None
        if not windowed and use_xqa(kv_cache.dtype, capability, self.block_size, head_dim):
            self._table_decode = XqaDecode(head_dim, self.block_size, self.device, self.kv_scales)
        self._num_table_rows = 0  # this step's leading decode rows that _table_decode attends
        # window -> the FlashInfer wrapper for the other rows (empty: no others)
        self._active: dict[int | None, Any] = {}
        self._uploaded: torch.cuda.Event | None = None  # after the last plan's uploads
        self._slot_block_ids: torch.Tensor | None = None
        self._slot_offsets: torch.Tensor | None = None

    def _decode_wrapper(self, **graph_buffers: Any) -> Any:
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "HND",
            use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=True,
            backend="fa2",
            **graph_buffers,
        )

    # ---- planning ------------------------------------------------------------------------
    def _wait_for_last_plan_uploads(self) -> None:
        """A plan refills pinned host buffers that the previous plan's uploads read from. With
        overlapped steps that upload may still be queued behind the running step: wait for it
        (in practice already done: it precedes that step's kernels)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def _mark_plan_uploads(self) -> None:
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()

    @property
    def decode_kernel(self) -> str:
        """What attends decode rows: "xqa" or "fa2"."""
        return "fa2" if self._table_decode is None else self._table_decode.name

    def plan(self, metadata: AttentionMetadata) -> None:
        self._wait_for_last_plan_uploads()
        seqs = metadata.seqs
        num_decodes = num_leading_decodes(seqs)
        self._num_table_rows, self._active = 0, {}
        if self._table_decode is not None and num_decodes:
            self._table_decode.plan(seqs[:num_decodes])
            self._num_table_rows, seqs = num_decodes, seqs[num_decodes:]
        self._ragged_from_row = None
        if self._ragged is not None and (split := whole_prompts_from(seqs)) < len(seqs):
            self._plan_ragged(seqs[split:])
            seqs = seqs[:split]
        if seqs and all(seq.q_len == 1 for seq in seqs):
            self._plan_decode(self._decode, page_table(seqs, self.block_size, self.device))
        elif seqs:
            table = page_table(seqs, self.block_size, self.device)
            for group, wrapper in self._prefill.items():
                # causal: bottom-right aligned, queries sit after the cached prefix
                self._plan_paged(wrapper, table, group, table.qo_indptr, causal=True)
            self._active = self._prefill
        self._mark_plan_uploads()
        self._slot_block_ids = metadata.slot_block_ids
        self._slot_offsets = metadata.slot_offsets

    def _plan_ragged(self, prompts: list[SeqSpan]) -> None:
        """Plan the step's trailing whole prompts: causal attention over their own K/V, which
        forward_qkv has the RoPE kernel leave in the activations' dtype."""
        indptr = index_tensor([0, *accumulate(seq.q_len for seq in prompts)], torch.int32)
        self._ragged.plan(
            indptr,
            indptr,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.q_dtype,
            non_blocking=True,
        )
        self._ragged_from_row = prompts[0].q_start

    def _plan_decode(self, wrappers: dict[int | None, Any], table: PageTable) -> None:
        for group, wrapper in wrappers.items():
            self._plan_paged(wrapper, table, group)
        self._active = wrappers

    def _plan_paged(
        self, wrapper: Any, table: PageTable, group: int | None, *qo_indptr: torch.Tensor, **causal
    ) -> None:
        """plan() of a paged-KV wrapper, prefill (qo_indptr and causal given) or decode: the
        table's pages, this rank's heads, the window of the layer group."""
        wrapper.plan(
            *qo_indptr,
            table.kv_indptr,
            table.kv_indices,
            table.kv_last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            **causal,
            sm_scale=self.scale,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_cache.dtype,
            non_blocking=True,  # a blocking copy would wait for the step in flight
            **window_left(group),
        )

    def enable_cuda_graphs(self, batch_sizes: list[int], max_pages_per_seq: int) -> None:
        """Create one graph-safe decode wrapper per batch size and window (static page-table
        buffers), or XQA's static buffers for the largest.

        The buffers are shared: only one graph replays at a time, right after its own plans
        (one per window, of the same page table). The plan buffers are shared per window only:
        a step's windows are planned together and each keeps its plan.
        """
        max_bs = max(batch_sizes)
        if self._table_decode is not None:
            self._table_decode.enable_graphs(max_bs, max_pages_per_seq)
            return
        indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        last_len = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        indices = torch.zeros(max_bs * max_pages_per_seq, dtype=torch.int32, device=self.device)
        first: dict[int | None, Any] = {}
        for bs in batch_sizes:
            self._graph_decode[bs] = {}
            for group in self._groups:
                wrapper = self._decode_wrapper(
                    paged_kv_indptr_buffer=indptr[: bs + 1],
                    paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last_len[:bs],
                )
                share_plan_buffers(wrapper, first.setdefault(group, wrapper))
                self._graph_decode[bs][group] = wrapper

    def plan_cuda_graph(self, metadata: AttentionMetadata) -> None:
        """Plan a (padded) pure-decode step for the graph of exactly len(metadata.seqs) rows.

        metadata's slot tensors must be the graph's static buffers: the captured writes read them.
        """
        self._wait_for_last_plan_uploads()
        self._ragged_from_row = None
        if self._table_decode is not None:
            self._table_decode.plan(metadata.seqs, graph=True)
            self._num_table_rows, self._active = len(metadata.seqs), {}
        else:
            wrappers = self._graph_decode[len(metadata.seqs)]
            table = page_table(metadata.seqs, self.block_size, self.device)
            self._plan_decode(wrappers, table)
            self._num_table_rows = 0
        self._mark_plan_uploads()
        self._slot_block_ids = metadata.slot_block_ids
        self._slot_offsets = metadata.slot_offsets

    # ---- running -------------------------------------------------------------------------
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        kv = self.kv_cache[:, layer]  # [num_blocks, 2, Hkv, block_size, D], strided pages
        k_scale, v_scale = self.kv_scales[layer]
        kv[:, 0][self._slot_block_ids, :, self._slot_offsets] = (k / k_scale).to(kv.dtype)
        kv[:, 1][self._slot_block_ids, :, self._slot_offsets] = (v / v_scale).to(kv.dtype)
        first = self._ragged_from_row
        ragged = None
        if first is not None:  # k, v [T, Hkv, D], rotated, the activations' dtype
            ragged = KvOut(k[first:].contiguous(), v[first:].contiguous(), first)
        return self._attend(layer, q, kv, ragged)

    def forward_qkv(
        self,
        layer: int,
        qkv: torch.Tensor | ScaledRows,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """out: where attention's output goes ([T, heads, head_dim]; None: a new tensor)."""
        kv = self.kv_cache[:, layer]
        assert self._slot_block_ids is not None and self._slot_offsets is not None
        # rotated q goes to its own contiguous rows: XQA needs them so, and a strided view of
        # qkv cost one copy kernel per layer
        q = torch.empty(
            (qkv.shape[0], self.num_heads, self.head_dim), dtype=self.q_dtype, device=self.device
        )
        ragged = None
        if self._ragged_from_row is not None:
            num_kv_heads, tokens = self.num_kv_heads, q.shape[0]
            ragged = KvOut.empty(tokens, self._ragged_from_row, num_kv_heads, self.head_dim, q)
        rope_and_write_kv(
            qkv,
            positions,
            rope.cos_sin,
            kv,
            self._slot_block_ids,
            self._slot_offsets,
            self.num_heads,
            self.kv_scales[layer],
            q_out=q,
            kv_out=ragged,
        )
        return self._attend(layer, q, kv, ragged, out)

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        ragged: KvOut | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] over the planned rows: the leading XQA rows, then the
        wrapper's, then the whole prompts' (over their own K/V in `ragged`); into out if given."""
        num_table = self._num_table_rows
        if num_table == 0 and ragged is None:
            return self._run_wrapper(layer, q, kv, out)
        if out is None:
            out = torch.empty(
                (q.shape[0], self.num_heads, self.head_dim), dtype=q.dtype, device=q.device
            )
        end = q.shape[0] if ragged is None else ragged.first_token
        if num_table:
            assert self._table_decode is not None
            # contiguous already when forward_qkv made q: no copy
            self._table_decode.run(layer, q[:num_table].contiguous(), kv, out[:num_table])
        if self._active:
            self._run_wrapper(layer, q[num_table:end], kv, out[num_table:end])
        if ragged is not None:
            self._ragged.run(q[end:].contiguous(), ragged.k, ragged.v, out=out[end:])
        return out

    def _run_wrapper(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        k_scale, v_scale = self.kv_scales[layer]
        wrapper = self._active[self.windows[layer]]
        if k_scale == 1.0 and v_scale == 1.0:
            return wrapper.run(q, kv, out=out)
        return wrapper.run(q, kv, out=out, k_scale=k_scale, v_scale=v_scale)
