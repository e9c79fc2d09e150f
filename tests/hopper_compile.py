"""Compiling the engine's Triton kernels of a decode step for the H200 (sm_90) on a machine without
a GPU, through ptxas (Triton ships it), so that a kernel that would not build, or would build
without its pipelined loads, fails on the CPU before a GPU lease is spent on it; owns no state.

Run as `python -m tests.hopper_compile` (without TRITON_INTERPRET: functions made under Triton's
interpreter, its own standard library's included, cannot be compiled): compiles every case in
CASES with the constants the engine launches it with on the 8B shape, PDL on, and prints one
JSON object, case name -> facts (shared memory, pipelined loads, PTX instruction counts,
registers and spills) or {"error": ...}. tests/unit/test_kernels_compile_for_hopper.py checks
them."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOPPER_SHARED_LIMIT = 232448  # bytes of shared memory a block may use on sm_90
INT_ARGS_ALIGNED = ("N", "K")  # int arguments the engine's launches give as multiples of 16
HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144  # Llama-3.1-8B
PTX_FACTS = {  # fact name -> PTX instruction pattern counted
    "pdl": r"griddepcontrol\.\w+",
    "exp2": r"ex2\.approx[\w.]*",
}


def have_hopper_compiler() -> bool:
    """Whether this triton can compile for sm_90 here (its NVIDIA backend and ptxas)."""
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


def compile_for_hopper(
    kernel: Any,
    pointers: dict[str, str],
    constexprs: dict[str, Any],
    *,
    floats: tuple[str, ...] = ("eps",),
    aligned: tuple[str, ...] = INT_ARGS_ALIGNED,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Any:
    """kernel (a @triton.jit function) compiled for sm_90: pointers name -> element type
    ("bf16", "fp8e4nv", "fp32", "i32"), constexprs name -> value, floats the fp32 scalars, the
    other arguments i32. As Triton specializes a real launch: pointers 16-byte aligned, and
    the ints in aligned divisible by 16 (the 8B shape's are)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    unknown = (set(constexprs) | set(pointers)) - set(names)
    if unknown:
        raise ValueError(f"not arguments of {kernel.__name__}: {sorted(unknown)}")
    missing = {p.name for p in kernel.params if p.is_constexpr} - set(constexprs)
    if missing:
        raise ValueError(f"{kernel.__name__}'s constexprs not given: {sorted(missing)}")
    signature, attrs = {}, {}
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in floats else "i32"
            if name in aligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
    constants = {(names.index(name),): value for name, value in constexprs.items()}
    source = ASTSource(kernel, signature, constants, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def facts(compiled: Any) -> dict[str, int]:
    """What the checks read of a compiled kernel: its shared memory, its asynchronous global ->
    shared copies in Triton's GPU IR (the software pipeline's loads), PTX_FACTS' counts, and
    from the cubin (cuobjdump) its registers a thread and local memory (spills) a thread."""
    ptx = compiled.asm["ptx"]
    found = {name: len(re.findall(pattern, ptx)) for name, pattern in PTX_FACTS.items()}
    found["shared"] = compiled.metadata.shared
    found["pipelined_loads"] = compiled.asm["ttgir"].count("ttg.async_copy_global_to_local")
    found |= resource_usage(compiled.asm["cubin"])
    return found


def resource_usage(cubin: bytes) -> dict[str, int]:
    """{"registers": per thread, "local_bytes": per thread} of a cubin, read by the cuobjdump
    that Triton ships."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        dump = subprocess.run(
            [str(tool), "--dump-resource-usage", str(path)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    usage = re.search(r"REG:(\d+) .*LOCAL:(\d+)", dump)
    if usage is None:
        raise ValueError(f"no resource usage in cuobjdump's output: {dump[-500:]}")
    return {"registers": int(usage[1]), "local_bytes": int(usage[2])}


def fp8_dot_rows_case(channels: int) -> Any:
    from engine.quant import fp8_dot_rows

    block_n, block_k, warps, stages = fp8_dot_rows.tile_for(channels)
    pointers = dict(
        x_ptr="fp8e4nv", x_scale_ptr="fp32", w_ptr="fp8e4nv", w_scale_ptr="fp32",
        bias_ptr="fp32", out_ptr="bf16",
    )  # fmt: skip
    constexprs = dict(
        HAS_BIAS=False, BLOCK_M=fp8_dot_rows.BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True,
    )  # fmt: skip
    kernel = fp8_dot_rows._kernel()
    return compile_for_hopper(kernel, pointers, constexprs, num_warps=warps, num_stages=stages)


def bf16_gemv_case(projection: str) -> Any:
    """The default one-row bf16 path's fused GEMV for the 8B shape's qkv (RMSNorm in), gate/up
    (RMSNorm in, SiLU out) or down (residual add)."""
    from engine.models import fused_gemv

    norm, silu = projection in ("qkv", "gate_up"), projection == "gate_up"
    block_n, block_k, warps = fused_gemv.tile_for(norm=norm, silu=silu)
    pointers = dict(x_ptr="bf16", w_ptr="bf16", norm_ptr="bf16", out_ptr="bf16")
    constexprs = dict(
        ROWS=1, NORM=norm, SILU=silu, ADD=not norm, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True,
    )  # fmt: skip
    return compile_for_hopper(fused_gemv._kernel(), pointers, constexprs, num_warps=warps)


def rope_kv_case(cache: str) -> Any:
    """RoPE + the paged K/V write for one decode row of the 8B shape (40 heads)."""
    from engine.attention import rope_kv_kernel

    per_program = rope_kv_kernel.heads_per_program(1, 40)
    pointers = dict(
        qkv_ptr="bf16", q_out_ptr="bf16", positions_ptr="i64", cos_sin_ptr="fp32",
        slot_block_ptr="i64", slot_offset_ptr="i64", cache_ptr=cache, row_scale_ptr="bf16",
        col_scale_ptr="bf16", k_out_ptr="bf16", v_out_ptr="bf16",
    )  # fmt: skip
    constexprs = dict(
        NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PER_PROGRAM=per_program,
        DEQUANT=False, KV_OUT=False, PDL=True,
    )  # fmt: skip
    strides = ("qkv_row_stride", "q_out_row_stride", "cos_sin_row_stride", "block_stride")
    aligned = (*strides, "kv_stride", "head_stride", "slot_stride")
    return compile_for_hopper(
        rope_kv_kernel._kernel(), pointers, constexprs, floats=("k_inv_scale", "v_inv_scale"),
        aligned=aligned, num_warps=rope_kv_kernel.warps_for(per_program, 128),
    )  # fmt: skip


def add_norm_quantize_case() -> Any:
    """The FP8 path's residual add + RMSNorm + per-token e4m3 quantization of a 4,096 row."""
    from engine.quant import fp8_fused
    from engine.quant.fp8_types import AMAX_FLOOR, FP8_MAX

    pointers = dict(
        src_ptr="bf16", residual_ptr="bf16", weight_ptr="bf16", q_ptr="fp8e4nv",
        scale_ptr="fp32", static_scale_ptr="fp32", row_scale_ptr="fp32", col_scale_ptr="fp32",
    )  # fmt: skip
    constexprs = dict(
        OP=fp8_fused.ADD_NORM, BLOCK=HIDDEN, STATIC=False, DEQUANT=False, FP8_MAX=FP8_MAX,
        AMAX_FLOOR=AMAX_FLOOR, PDL=True,
    )  # fmt: skip
    aligned = ("src_row_stride", "residual_row_stride", "num_cols")
    return compile_for_hopper(
        fp8_fused._kernel(), pointers, constexprs, aligned=aligned,
        num_warps=fp8_fused.warps_for(HIDDEN),
    )  # fmt: skip


CASES: dict[str, Callable[[], Any]] = {
    "fp8_dot_rows narrow": lambda: fp8_dot_rows_case(QKV),
    "fp8_dot_rows wide": lambda: fp8_dot_rows_case(2 * INTERMEDIATE),
    "fused_gemv qkv norm": lambda: bf16_gemv_case("qkv"),
    "fused_gemv gate_up norm+silu": lambda: bf16_gemv_case("gate_up"),
    "fused_gemv down add": lambda: bf16_gemv_case("down"),
    "rope_kv decode, bf16 cache": lambda: rope_kv_case("bf16"),
    "rope_kv decode, fp8 cache": lambda: rope_kv_case("fp8e4nv"),
    "add_rms_norm_quantize": add_norm_quantize_case,
}


def main() -> None:
    results: dict[str, dict[str, Any]] = {}
    for name, case in CASES.items():
        try:
            results[name] = facts(case())
        except Exception as error:  # reported per case; the test names it
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
