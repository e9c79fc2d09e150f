"""Triton kernel variants met for the first time in this process, watched through Triton's
compile hooks: counted while an engine starts (graph capture, warm-up), and once serving each one
said on stderr with its kernel, specialization and time, as a shape the warm-up missed. Owns the
process's watch: the hooks it chained, the compiles in progress, the counts, and the latest
start's variants (a served one is said beside the closest of them: what the warm-up's lacked).

Why: on the H100 a fresh machine's first server stalled ~0.6 s on its first prompts while the
second server on the same machine did not (bench/RESULTS.md, leases L6 and L7): a variant
compiled once per machine and then loaded from Triton's cache on disk. Triton calls the hooks
for every variant a process builds, from its disk cache or compiled, so a served run's log
names what the warm-up should cover. The time between the hooks only hints which it was (a
process's first variant also hashes Triton's library; the module loads after the second hook).
CUDA only, rank 0 only (a tensor-parallel follower is not watched); a Triton without
`triton.knobs.runtime` (before 3.4) is not watched.

The eighth lease (H100, d5af943) still met two RoPE/KV-write variants first while serving (274
and 332 ms, compiled) whose specialization as said looked like warm-up's; so each served
variant is now said with how it differs from the closest start-up variant of its kernel: in
its specialization, or, where that is the same, in Triton's cache key.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from engine.say import say

MAX_SAID = 20  # served variants said one by one; past this only counted
COMPILED_S = 0.05  # a variant taking longer than this was likely compiled, not loaded
MAX_DIFF_ITEMS = 6  # of a difference from the closest start-up variant, this many a side


class CompileWatch:
    def __init__(self, say_line: Callable[[str], None] = say) -> None:
        self._say = say_line
        self._lock = threading.Lock()  # the hooks run on whichever thread launches a kernel
        self._in_progress: dict[tuple[str, str], float] = {}
        self._starting = 0  # engines starting now (a draft model's engine starts inside one)
        self.start_count = 0  # variants met since the latest start began, while it started
        self.start_s = 0.0
        self.serving_count = 0  # and since it ended: shapes the warm-up missed
        self.serving_s = 0.0
        self._start_variants: list[tuple[str, str, str]] = []  # (kernel, key, spec) of start's

    def began(self, kernel: str, key: str) -> None:
        with self._lock:
            self._in_progress[(kernel, key)] = time.perf_counter()

    def ended(self, kernel: str, key: str, spec: str) -> None:
        with self._lock:
            began = self._in_progress.pop((kernel, key), None)
            seconds = 0.0 if began is None else time.perf_counter() - began
            if self._starting:
                self.start_count += 1
                self.start_s += seconds
                self._start_variants.append((kernel, key, spec))
                return
            self.serving_count += 1
            self.serving_s += seconds
            count = self.serving_count
            starts = [(k, s) for name, k, s in self._start_variants if name == kernel]
        if count <= MAX_SAID:
            how = "likely compiled" if seconds > COMPILED_S else "likely from Triton's cache"
            more = " (later ones are only counted)" if count == MAX_SAID else ""
            self._say(
                f"kernel variant met first while serving, built in {seconds * 1000:.0f} ms, {how} "
                f"(a shape the warm-up missed; {count} so far{more}): {kernel} {spec}; "
                f"{beside_start_up(key, spec, starts)}"
            )

    @contextmanager
    def starting(self) -> Iterator[None]:
        """An engine starts: the variants met meanwhile are start-up's, counted, not said; the
        counts start afresh with each outermost start (a process may build several engines)."""
        with self._lock:
            if not self._starting:
                self.start_count, self.start_s = 0, 0.0
                self.serving_count, self.serving_s = 0, 0.0
                self._start_variants = []
            self._starting += 1
        try:
            yield
        finally:
            with self._lock:
                self._starting -= 1

    def is_starting(self) -> bool:
        with self._lock:
            return self._starting > 0

    def start_line(self) -> str:
        return (
            f"{self.start_count} Triton kernel variants built at start-up in "
            f"{self.start_s:.1f} s (compiled on a machine's first start, then loaded from "
            "Triton's cache)"
        )


def _spec_items(spec: str) -> Counter[str]:
    """A spec's arguments (with their marks), and its warps and stages as one item, as a
    multiset."""
    return Counter(t.strip() for t in re.split(r"[(),]", spec) if t.strip())


def _key_items(key: str) -> list[str]:
    """A cache key's parts in order: each parenthesised group whole (an argument's type and
    specialization), the other tokens between commas and brackets."""
    return [t.strip() for t in re.findall(r"\([^()]*\)|[^,()\[\]{}]+", key) if t.strip()]


def _short(items: list[str]) -> str:
    shown = [item[:80] for item in items[:MAX_DIFF_ITEMS]]
    more = len(items) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "") if shown else "nothing"


def beside_start_up(key: str, spec: str, starts: list[tuple[str, str]]) -> str:
    """How a served variant differs from the closest start-up variant of its kernel (starts:
    their (key, spec)): in the specialization said, else part by part in Triton's cache key."""
    if not starts:
        return "start-up built no variant of this kernel"
    ours = _spec_items(spec)

    def distance(start: tuple[str, str]) -> int:
        theirs = _spec_items(start[1])
        return sum(((ours - theirs) + (theirs - ours)).values())

    closest_key, closest_spec = min(starts, key=distance)
    theirs = _spec_items(closest_spec)
    if ours != theirs:
        return (
            f"beside the closest of start-up's {len(starts)} of this kernel it has "
            f"{_short(sorted((ours - theirs).elements()))}; that one had "
            f"{_short(sorted((theirs - ours).elements()))}"
        )
    a, b = _key_items(key), _key_items(closest_key)
    if a == b:
        return (
            f"start-up built one with the same specialization and cache key ({len(starts)} of "
            "this kernel): a new JITFunction, or another device's cache"
        )
    if len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        parts = [f"#{i} {x} (start-up: {y})" for i, (x, y) in pairs if x != y]
    else:
        parts = [f"{len(a)} parts (start-up: {len(b)})"]
    return (
        f"start-up built one of the same specialization ({len(starts)} of this kernel); "
        f"Triton's cache keys differ in {_short(parts)}"
    )


_watch: CompileWatch | None = None
_chained: tuple[Any, Any] | None = None  # the hooks that were set before ours
_installing = threading.Lock()


def describe(compile: dict[str, Any]) -> str:
    """A variant as Triton's hooks pass it (their `compile` keyword): each argument's type,
    marked `16-aligned` where the variant takes it so (pointers) or divisible by 16 (integers),
    the constexpr values, warps and stages."""
    signature = compile.get("signature") or {}
    names = list(signature)
    attrs = (compile.get("configs") or [{}])[0] or {}
    aligned = {
        names[key[0]]
        for key, marks in attrs.items()
        if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int)
        and key[0] < len(names) and any("divisibility" in str(mark) for mark in marks)
    }  # fmt: skip
    constants = {
        names[key[0]]: value
        for key, value in (compile.get("constants") or {}).items()
        if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int)
        and key[0] < len(names)
    }  # fmt: skip
    args = [
        f"{name}={constants[name]}" if name in constants
        else f"{name}: {kind}{' 16-aligned' if name in aligned else ''}"
        for name, kind in signature.items()
    ]  # fmt: skip
    return (
        f"({', '.join(args)}) num_warps={compile.get('num_warps')} "
        f"num_stages={compile.get('num_stages')}"
    )


def _runtime() -> Any | None:
    try:
        from triton import knobs
    except ImportError:  # no Triton (CPU builds), or one older than 3.4
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if hasattr(runtime, "jit_post_compile_hook") else None


def install(say_line: Callable[[str], None] = say) -> CompileWatch | None:
    """The process's watch, its hooks chained in front of any set before (their answers pass
    through); None where Triton cannot be watched."""
    global _watch, _chained
    with _installing:
        if _watch is not None:
            return _watch
        runtime = _runtime()
        if runtime is None:
            return None
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        watch = CompileWatch(say_line)

        def name(kw: dict[str, Any]) -> str:
            qualname = str(getattr(kw.get("fn"), "name", "?"))  # _kernel.<locals>.rope_write_kv
            return qualname.rsplit(".", 1)[-1]

        def on_begin(**kw: Any) -> Any:
            answer = before(**kw) if before is not None else None  # truthy: no compile
            if not answer:
                watch.began(name(kw), str(kw.get("key")))
            return answer

        def on_end(**kw: Any) -> Any:
            try:
                spec = describe(kw.get("compile") or {})
            except Exception:  # a Triton passing other shapes: its own text
                spec = str(kw.get("repr", ""))
            watch.ended(name(kw), str(kw.get("key")), spec)
            return after(**kw) if after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_begin, on_end
        _watch, _chained = watch, (before, after)
        return watch


def uninstall() -> None:
    """Put back the hooks that were set before install (tests)."""
    global _watch, _chained
    runtime = _runtime()
    if _watch is None or _chained is None or runtime is None:
        return
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = _chained
    _watch, _chained = None, None
