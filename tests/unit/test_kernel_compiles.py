"""The kernel compile watch: start-up variants counted, served ones said, Triton's hooks chained."""

from __future__ import annotations

import types

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
    assert "loaded from Triton's cache" in lines[0]  # it took well under COMPILED_S


def test_served_variants_past_the_limit_are_only_counted() -> None:
    lines: list[str] = []
    watch = CompileWatch(lines.append)
    for i in range(MAX_SAID + 5):
        watch.began("k", str(i))
        watch.ended("k", str(i), "()")
    assert watch.serving_count == MAX_SAID + 5
    assert len(lines) == MAX_SAID
    assert "later ones are only counted" in lines[-1]


def test_install_chains_the_hooks_set_before_and_uninstall_puts_them_back() -> None:
    runtime = kernel_compiles._runtime()
    if runtime is None:
        pytest.skip("this Triton has no triton.knobs.runtime hooks")
    calls: list[str] = []

    def earlier_begin(**kw: object) -> bool:
        calls.append("begin")
        return False  # True would tell Triton to skip the compile: passed through as is

    def earlier_end(**kw: object) -> None:
        calls.append("end")

    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = earlier_begin, earlier_end
    lines: list[str] = []
    try:
        watch = kernel_compiles.install(lines.append)
        assert watch is not None
        assert kernel_compiles.install() is watch  # one watch a process
        # the keywords Triton's JITFunction._call_hook passes
        fn = types.SimpleNamespace(name="rope_kv_kernel")
        kw = dict(key=("k",), repr="rope_kv_kernel[num_warps=4](q: *bf16, n: i32)", fn=fn,
                  compile={}, is_manual_warmup=False, already_compiled=False)  # fmt: skip
        assert runtime.jit_cache_hook(**kw) is False
        runtime.jit_post_compile_hook(**kw)
        assert calls == ["begin", "end"]
        assert watch.serving_count == 1
        assert lines and lines[0].endswith("rope_kv_kernel (q: *bf16, n: i32)")
    finally:
        kernel_compiles.uninstall()
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (
            earlier_begin,
            earlier_end,
        )
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
