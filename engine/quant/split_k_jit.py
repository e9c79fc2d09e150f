"""The Triton helpers of split-K (engine/quant/split_k.py says what it is for); owns no state.
Imported only through split_k (which does not import triton itself); Triton's interpreter needs
triton.language among a helper's module globals, hence a module of their own."""

import triton
import triton.language as tl


@triton.jit
def part_bounds(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(k_start, k_end): this program's K range, program_id(1) of SPLIT_K parts, each a
    whole number of BLOCK_K steps, as even as they divide (none empty when there are at
    least SPLIT_K steps); unsplit, (0, K) as constants of the loop."""
    if SPLIT_K == 1:
        k_start = 0
        k_end = K
    else:
        steps = tl.cdiv(K, BLOCK_K)
        part = tl.program_id(1)
        k_start = part * steps // SPLIT_K * BLOCK_K
        k_end = tl.minimum(K, (part + 1) * steps // SPLIT_K * BLOCK_K)
    return k_start, k_end


@triton.jit
def sum_parts(acc, ws_ptr, counter_ptr, offsets, mask, tile, part_stride, SPLIT_K: tl.constexpr):
    """(last, total): stores this program's partial acc at ws_ptr + program_id(1) *
    part_stride + offsets and counts itself in at counter_ptr + tile; the program that
    arrives last gets last = True and the parts' sum in order (0 elsewhere), and puts the
    counter back to zero."""
    tl.store(ws_ptr + tl.program_id(1) * part_stride + offsets, acc, mask=mask)
    tl.debug_barrier()  # every thread's part stored before the count is released
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        for part in tl.static_range(SPLIT_K):
            at = ws_ptr + part * part_stride + offsets
            total += tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")  # past L1
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last, total
