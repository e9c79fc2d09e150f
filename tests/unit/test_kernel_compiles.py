"""The kernel compile watch: start-up variants counted, served ones said, Triton's hooks chained."""

from __future__ import annotations

import pytest

from engine.execution import kernel_compiles
from engine.execution.kernel_compiles import MAX_SAID, CompileWatch


def test_start_up_variants_are_counted_and_served_ones_said() -> None:
    lines: list[str] = []
    watch = CompileWatch(lines.append)
    with watch.starting():
        with watch.starting():  # a draft model's engine starts inside the target's
            watch.began("rope_kv", "k1")
            watch.ended("rope_kv", "k1", "(q: *bf16, n: i32)")
        assert watch.is_starting()
        watch.began("gemv", "k2")
        watch.ended("gemv", "k2", "(x: *bf16)")
    assert not watch.is_starting()
    assert (watch.start_count, watch.serving_count, lines) == (2, 0, [])
    assert watch.start_line().startswith("2 Triton kernel variants built at start-up")
    watch.began("rope_kv", "k3")
    watch.ended("rope_kv", "k3", "(q: *bf16, n: i32)")
    assert watch.serving_count == 1
    assert len(lines) == 1
    assert "rope_kv (q: *bf16, n: i32)" in lines[0]
    assert "likely from Triton's cache" in lines[0]  # it took well under COMPILED_S


def test_served_variants_past_the_limit_are_only_counted() -> None:
    lines: list[str] = []
    watch = CompileWatch(lines.append)
    for i in range(MAX_SAID + 5):
        watch.began("k", str(i))
        watch.ended("k", str(i), "()")
    assert watch.serving_count == MAX_SAID + 5
    assert len(lines) == MAX_SAID
    assert "later ones are only counted" in lines[-1]


def test_a_second_engine_start_counts_afresh() -> None:
    watch = CompileWatch(lambda _line: None)
    for key in ("a", "b"):
        with watch.starting():
            watch.began("k", key)
            watch.ended("k", key, "()")
        watch.began("k", key + "-served")
        watch.ended("k", key + "-served", "()")
    assert (watch.start_count, watch.serving_count) == (1, 1)


def test_install_chains_the_hooks_set_before_and_says_the_variant_triton_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime = kernel_compiles._runtime()
    if runtime is None:
        pytest.skip("this Triton has no triton.knobs.runtime hooks")
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDAOptions

    from engine.attention import rope_kv_kernel

    calls: list[str] = []

    def earlier_begin(**kw: object) -> bool:
        calls.append("begin")
        return False  # True would tell Triton to skip the compile: passed through as is

    def earlier_end(**kw: object) -> None:
        calls.append("end")

    monkeypatch.setattr(kernel_compiles, "_watch", None)  # an engine's watch of this process
    monkeypatch.setattr(kernel_compiles, "_chained", None)
    monkeypatch.setattr(runtime, "jit_cache_hook", earlier_begin)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", earlier_end)
    lines: list[str] = []
    watch = kernel_compiles.install(lines.append)
    assert watch is not None
    assert kernel_compiles.install() is watch  # one watch a process
    # the hooks called as Triton's JITFunction._do_compile calls them, for the RoPE/KV-write
    # kernel (built, not interpreted) with its positions 16-byte aligned and a constexpr set
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kernel = rope_kv_kernel._kernel.__wrapped__()
    names = [p.name for p in kernel.params]
    signature = {
        p.name: "constexpr" if p.is_constexpr else "*bf16" if p.name.endswith("_ptr") else "i32"
        for p in kernel.params
    }
    constants = {(names.index("HEAD_DIM"),): 128}
    attrs = {(names.index("positions_ptr"),): [["tt.divisibility", 16]]}
    args = ("key", signature, GPUTarget("cuda", 90, 32), 0, constants, CUDAOptions(), [attrs])
    assert not kernel._call_hook(runtime.jit_cache_hook, *args, False)
    kernel._call_hook(runtime.jit_post_compile_hook, *args, False)
    assert calls == ["begin", "end"]
    assert watch.serving_count == 1
    assert len(lines) == 1
    said = lines[0].split("): ", 1)[1]
    assert said.startswith("rope_write_kv (qkv_ptr: *bf16, ")
    assert "positions_ptr: *bf16 16-aligned" in said and "HEAD_DIM=128" in said
    assert "slot_offset_ptr: *bf16," in said  # not marked
    kernel_compiles.uninstall()
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (earlier_begin, earlier_end)


def test_a_served_variant_is_said_beside_the_closest_start_up_one() -> None:
    """What the warm-up's variants lacked: the specialization that differs from the closest
    start-up variant of the kernel, else the parts of Triton's cache key that do."""
    lines: list[str] = []
    watch = CompileWatch(lines.append)
    with watch.starting():
        for key, spec in (
            (
                "[('*bf16', 'D'), ('i32', 'D')]{'num_warps': 4}",
                "(q: *bf16 16-aligned, n: i32 16-aligned, H=16) num_warps=4",
            ),
            (
                "[('*bf16', ''), ('i32', '')]{'num_warps': 2}",
                "(q: *bf16, n: i32, H=64) num_warps=2",
            ),
        ):
            watch.began("rope", key)
            watch.ended("rope", key, spec)
    served = (
        ("k1", "(q: *bf16 16-aligned, n: i32, H=16) num_warps=4"),  # n not divisible by 16
        (
            "[('*bf16', 'D'), ('i32', 'D')]{'num_warps': 8}",
            "(q: *bf16 16-aligned, n: i32 16-aligned, H=16) num_warps=4",
        ),
    )
    for key, spec in served:
        watch.began("rope", key)
        watch.ended("rope", key, spec)
    watch.began("gemv", "k3")
    watch.ended("gemv", "k3", "(x: *bf16)")
    assert (
        "closest of start-up's 2 of this kernel it has n: i32; that one had n: i32 16-aligned"
        in lines[0]
    )
    assert "same specialization (2 of this kernel)" in lines[1]
    assert "keys differ in #2 'num_warps': 8 (start-up: 'num_warps': 4)" in lines[1]
    assert lines[2].endswith("start-up built no variant of this kernel")
