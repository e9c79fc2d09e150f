"""Int4Linear (owns 4-bit weights packed for torch's int4 weight-only GEMM, their bf16 scales
and zero points, an optional input permutation and bias) and the pure helpers around it:
reading AWQ (GEMM), GPTQ and compressed-tensors (pack-quantized) tensors into one form
(Int4Weight), dequantizing it (the CPU reference path), fusing parts and repacking for the
kernel.

The kernel is torch's own tinygemm (torch.ops.aten._weight_int4pack_mm on CUDA, what torchao's
int4 weight-only layout runs): no new dependency, kept with torch. It computes each weight as
(q - 8) * scale + zero per group of input channels, so a checkpoint's asymmetric groups
(q - z) * s map onto it exactly with zero = (8 - z) * s (then rounded to bf16, the kernel's
only scale dtype: AWQ's and GPTQ's fp16 scales lose 3 mantissa bits there). GPTQ act-order
(g_idx not in input order) is mapped by permuting the input channels so that every group is a
contiguous run: the layer reorders its input the same way (input_perm). On CPU the same layer
runs torch's CPU twin of the kernel (_weight_int4pack_mm_for_cpu; tests), but a model on CPU
dequantizes at load instead (engine/models/loader.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from engine.quant.int_config import Int4Config

KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what tinygemm takes
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's nibble i of a word holds column AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)

TakeFn = Callable[[str], torch.Tensor]  # removes and returns a checkpoint tensor by name


class Int4Weight(NamedTuple):
    """A 4-bit weight in one form whatever the checkpoint: codes uint8 [N, K] (0..15), scales
    and zeros float32 [N, G] (zeros: the code that stands for 0.0), groups int64 [K] (each input
    channel's group). weight[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g], g = groups[k]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    groups: torch.Tensor


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C, 8]: nibble i (bits 4i..4i+3) of each word at index i."""
    return ((packed.to(torch.int32)[..., None] >> _SHIFTS) & 15).to(torch.uint8)


def contiguous_groups(num_inputs: int, group_size: int) -> torch.Tensor:
    """The groups of input channels in order: group_size at a time (-1: one group)."""
    size = num_inputs if group_size == -1 else group_size
    return torch.arange(num_inputs) // size


def read_awq(take: TakeFn, module: str, group_size: int) -> Int4Weight:
    """AutoAWQ's GEMM layout: qweight int32 [K, N/8] and qzeros int32 [K/group, N/8] packed
    along the output channels in AWQ_ORDER, scales fp16 [K/group, N]."""
    qweight, qzeros = take(module + ".qweight"), take(module + ".qzeros")
    scales = take(module + ".scales").float()
    num_inputs, num_outputs = qweight.shape[0], qweight.shape[1] * 8
    _check_int32(qweight, module + ".qweight")
    _check_int32(qzeros, module + ".qzeros")
    groups = contiguous_groups(num_inputs, group_size)
    num_groups = int(groups[-1]) + 1
    _check_shape(scales, (num_groups, num_outputs), module + ".scales")
    _check_shape(qzeros, (num_groups, num_outputs // 8), module + ".qzeros")
    order = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column j's nibble

    def columns(packed: torch.Tensor) -> torch.Tensor:
        return unpack_int32(packed)[..., order].reshape(packed.shape[0], -1)

    return Int4Weight(
        columns(qweight).t().contiguous(), scales.t().contiguous(),
        columns(qzeros).float().t().contiguous(), groups,
    )  # fmt: skip


def read_gptq(take: TakeFn, module: str, quant: Int4Config) -> Int4Weight:
    """GPTQ's layout: qweight int32 [K/8, N] packed along the input channels, qzeros int32
    [G, N/8] along the output channels (nibble i: column 8c + i; v1 stores each zero minus
    one), scales fp16 [G, N], g_idx int32 [K]."""
    qweight, qzeros = take(module + ".qweight"), take(module + ".qzeros")
    scales, g_idx = take(module + ".scales").float(), take(module + ".g_idx")
    _check_int32(qweight, module + ".qweight")
    _check_int32(qzeros, module + ".qzeros")
    num_inputs, num_outputs = qweight.shape[0] * 8, qweight.shape[1]
    num_groups = 1 if quant.group_size == -1 else -(-num_inputs // quant.group_size)
    _check_shape(scales, (num_groups, num_outputs), module + ".scales")
    _check_shape(qzeros, (num_groups, num_outputs // 8), module + ".qzeros")
    _check_shape(g_idx, (num_inputs,), module + ".g_idx")
    groups = g_idx.long()
    if num_inputs and (groups.min() < 0 or groups.max() >= num_groups):
        raise ValueError(f"{module}.g_idx has a group outside 0..{num_groups - 1}")
    codes = unpack_int32(qweight).permute(0, 2, 1).reshape(num_inputs, num_outputs)
    zeros = unpack_int32(qzeros).reshape(num_groups, num_outputs).float()
    if quant.v1_zeros:
        zeros = zeros + 1
    return Int4Weight(codes.t().contiguous(), scales.t().contiguous(), zeros.t(), groups)


def read_compressed(take: TakeFn, module: str, quant: Int4Config) -> Int4Weight:
    """compressed-tensors' pack-quantized layout (symmetric): weight_packed int32 [N, K/8]
    packed along the input channels (nibble i: column 8c + i) of codes q + 8, weight_shape
    [N, K], weight_scale [N, G], and with actorder "group" weight_g_idx [K]."""
    packed = take(module + ".weight_packed")
    _check_int32(packed, module + ".weight_packed")
    shape = take(module + ".weight_shape")
    num_outputs, num_inputs = (int(v) for v in shape.reshape(-1).tolist())
    if packed.shape[0] != num_outputs or packed.shape[1] * 8 < num_inputs:
        raise ValueError(
            f"{module}.weight_packed has shape {tuple(packed.shape)}, which does not hold "
            f"weight_shape {(num_outputs, num_inputs)}"
        )
    scales = take(module + ".weight_scale").float()
    if scales.dim() == 1:
        scales = scales[:, None]
    if quant.desc_act:
        groups = take(module + ".weight_g_idx").long()
        _check_shape(groups, (num_inputs,), module + ".weight_g_idx")
    else:
        groups = contiguous_groups(num_inputs, quant.group_size)
    num_groups = int(groups.max()) + 1 if num_inputs else 0
    _check_shape(scales, (num_outputs, num_groups), module + ".weight_scale")
    codes = unpack_int32(packed).reshape(num_outputs, -1)[:, :num_inputs].contiguous()
    return Int4Weight(codes, scales.contiguous(), torch.full_like(scales, 8.0), groups)


def read_int4(take: TakeFn, module: str, quant: Int4Config) -> Int4Weight:
    """The checkpoint's 4-bit weight of module, in the method's layout."""
    if quant.method == "awq":
        return read_awq(take, module, quant.group_size)
    if quant.method == "compressed-tensors":
        return read_compressed(take, module, quant)
    return read_gptq(take, module, quant)


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    """The float32 weight [N, K] an Int4Weight stands for (the CPU reference path)."""
    scales, zeros = weight.scales[:, weight.groups], weight.zeros[:, weight.groups]
    return (weight.codes.float() - zeros) * scales


def fuse_int4(parts: Sequence[Int4Weight], module: str) -> Int4Weight:
    """Stack parts (q/k/v, gate/up) along the output channels; they must group their input
    channels alike (act-order parts share the input, so GPTQ gives them one g_idx)."""
    for part in parts[1:]:
        if not torch.equal(part.groups, parts[0].groups):
            raise ValueError(f"{module}: the fused parts' g_idx differ; they cannot share a kernel")
    return Int4Weight(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]), parts[0].groups,
    )  # fmt: skip


def kernel_group_size(group_size: int, num_inputs: int) -> int:
    """The kernel's group size for a checkpoint's: itself, or (larger groups, -1) the largest
    of KERNEL_GROUP_SIZES that divides it, the scales repeated (exact)."""
    size = num_inputs if group_size == -1 else group_size
    for candidate in (size, *reversed(KERNEL_GROUP_SIZES)):
        if candidate in KERNEL_GROUP_SIZES and size % candidate == 0:
            return candidate
    raise ValueError(
        f"group_size {group_size} over {num_inputs} input channels does not map onto the int4 "
        f"kernel's group sizes {KERNEL_GROUP_SIZES}"
    )


def inner_k_tiles(num_inputs: int) -> int:
    """tinygemm's innerKTiles: the largest of 8, 4, 2 with num_inputs % (16 * it) == 0."""
    for tiles in (8, 4, 2):
        if num_inputs % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"the int4 kernel needs input channels divisible by 32, got {num_inputs}")


def input_permutation(weight: Int4Weight, group_size: int) -> torch.Tensor:
    """The input-channel order in which the groups are contiguous runs of group_size (GPTQ
    act-order); refused when a group does not have exactly group_size channels."""
    num_inputs = weight.groups.numel()
    perm = torch.argsort(weight.groups, stable=True)
    size = num_inputs if group_size == -1 else group_size
    in_order = torch.arange(num_inputs, device=weight.groups.device) // size
    if not torch.equal(weight.groups[perm], in_order):
        raise ValueError(
            f"g_idx does not split the input channels into groups of {size}; this act-order "
            "layout cannot be mapped onto the int4 kernel"
        )
    return perm


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W 4-bit: weight int32 in tinygemm's packed layout (kernel "cuda":
    [N/8, K/(16 tiles), 32, tiles/2]; kernel "cpu", the CPU twin's: uint8 [N, K/2]),
    scales_and_zeros bf16 [K/group, N, 2], input_perm int64 [K] when the checkpoint uses
    act-order (the input is reordered first). Runs in bf16."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quant: Int4Config,
        kernel: str = "cuda",
    ):
        super().__init__()
        if kernel not in ("cuda", "cpu"):
            raise ValueError(f"Int4Linear kernel must be 'cuda' or 'cpu', got {kernel!r}")
        if out_features % 8:
            raise ValueError(
                f"the int4 kernel needs output channels divisible by 8, got {out_features}"
            )
        self.in_features, self.out_features, self.kernel = in_features, out_features, kernel
        self.group_size = kernel_group_size(quant.group_size, in_features)
        self.tiles = inner_k_tiles(in_features)

        def fixed(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

        if kernel == "cuda":
            shape = (out_features // 8, in_features // (16 * self.tiles), 32, self.tiles // 2)
            self.weight = fixed(*shape, dtype=torch.int32)
        else:
            self.weight = fixed(out_features, in_features // 2, dtype=torch.uint8)
        groups = in_features // self.group_size
        self.scales_and_zeros = fixed(groups, out_features, 2, dtype=torch.bfloat16)
        perm = fixed(in_features, dtype=torch.int64) if quant.desc_act else None
        self.register_parameter("input_perm", perm)
        self.register_parameter("bias", fixed(out_features, dtype=torch.bfloat16) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] bf16 -> [..., N] bf16."""
        rows = x.reshape(-1, self.in_features)
        if self.input_perm is not None:
            rows = rows.index_select(1, self.input_perm)
        rows = rows.to(torch.bfloat16).contiguous()
        if self.kernel == "cuda":
            op = torch.ops.aten._weight_int4pack_mm
        else:
            op = torch.ops.aten._weight_int4pack_mm_for_cpu
        out = op(rows, self.weight, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        order = ", act-order" if self.input_perm is not None else ""
        return f"{self.in_features} -> {self.out_features}, int4 groups of {self.group_size}{order}"


def int4_linear_state(
    prefix: str, weight: Int4Weight, quant: Int4Config, kernel: str = "cuda"
) -> dict[str, torch.Tensor]:
    """The state-dict entries of the Int4Linear at prefix (kernel "cuda" packs on the CUDA
    device the weight is on)."""
    num_outputs, num_inputs = weight.codes.shape
    group = kernel_group_size(quant.group_size, num_inputs)
    codes, groups = weight.codes, weight.groups
    state: dict[str, torch.Tensor] = {}
    if quant.desc_act:
        perm = input_permutation(weight, quant.group_size)
        codes, groups = codes[:, perm], groups[perm]
        state[prefix + ".input_perm"] = perm
    elif not torch.equal(groups, contiguous_groups(num_inputs, quant.group_size).to(groups.device)):
        raise ValueError(f"{prefix}: g_idx is not in input order but desc_act is false")
    # one kernel group per `group` input channels: the checkpoint group of its first channel
    first = groups.reshape(-1, group)[:, 0].to(weight.scales.device)
    scales, zeros = weight.scales[:, first], weight.zeros[:, first]
    state[prefix + ".scales_and_zeros"] = (
        torch.stack([scales.t(), ((8 - zeros) * scales).t()], dim=-1)
        .to(torch.bfloat16)
        .contiguous()
    )
    tiles = inner_k_tiles(num_inputs)
    if kernel == "cuda":
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
        state[prefix + ".weight"] = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    else:
        cpu_codes = codes.to(torch.int32).contiguous()
        state[prefix + ".weight"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            cpu_codes, tiles
        )
    if num_outputs % 8:
        raise ValueError(f"{prefix}: the int4 kernel needs output channels divisible by 8")
    return state


def _check_int32(tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype != torch.int32 or tensor.dim() != 2:
        raise ValueError(f"{name} is {tensor.dtype} {tuple(tensor.shape)}, expected 2-D int32")


def _check_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
