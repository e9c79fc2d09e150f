"""gpu_engine_bench's report: the software it ran on and the closing table of its results;
stateless.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except Exception as exc:  # reported, the bench then runs the torch backend
        info["flashinfer"] = f"unavailable: {exc}"
    return info


def print_table(result: dict[str, Any]) -> None:
    d = result["decode_b1"]
    weights = (result.get("args") or {}).get("quantization") or "bf16"
    weights = "bf16" if weights in ("none", "auto") else weights
    print(f"\n{result['env']['gpu']}, {result['shape']} (random {weights} weights)")
    print(f"device copy bandwidth        {result['copy_bandwidth_GBps']:.0f} GB/s (read+write)")
    print(
        f"decode b1 roofline           {d['roofline_ms']:.3f} ms "
        f"({d['graph_roofline_ms']:.3f} without the LM head)"
    )
    print(
        f"decode b1 engine step        {d['engine_step_ms_median']:.3f} ms "
        f"({d['engine_step_over_roofline']:.2f}x roofline)"
    )
    print(
        f"decode b1 graph replay       {d['graph_replay_ms']:.3f} ms "
        f"({d['graph_replay_over_graph_roofline']:.2f}x its roofline, no LM head)"
    )
    print(
        f"decode b1 replay + LM head   {d['replay_and_head_ms']:.3f} ms "
        f"({d['replay_and_head_over_roofline']:.2f}x roofline)"
    )
    prof = d.get("profile", {})
    if "kernel_ms_by_kind" in prof:
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in prof["kernel_ms_by_kind"].items())
        print(f"decode b1 kernels (ms/step)  {kinds}; {prof['kernels_per_iter']:.0f} kernels")
    print("batch  graph ms  eager ms  eager/graph")
    for row in result.get("graph_vs_eager", []):
        print(
            f"{row['batch']:>5}  {row['graph_step_ms']:8.3f}  {row['eager_step_ms']:8.3f}  "
            f"{row['eager_over_graph']:11.2f}"
        )
    g = result.get("hf_greedy")
    if g:
        print(f"greedy vs transformers (tiny bf16): {g['num_equal']}/{g['num_prompts']} equal")
        for row in g["prompts"]:
            if not row["equal"]:
                print(
                    f"  prompt {row['prompt_len']}: first divergence at token "
                    f"{row['first_divergence']}, transformers top-2 margin "
                    f"{row['hf_top2_margin']:.4f}"
                )
    h = result.get("hf_speed")
    if h:
        print(
            f"offline {h['num_requests']} x ({h['input_len']} in, {h['output_len']} out): kvrelay "
            f"{h['kvrelay_output_tok_s']:.0f} tok/s, transformers "
            f"{h['transformers_output_tok_s']:.0f} tok/s ({h['speedup']:.2f}x)"
        )
    t = result.get("offline")
    if t:
        print(
            f"offline {t['num_requests']} x ({t['input_len']} in, {t['output_len']} out): "
            f"{t['output_tokens_per_s']:.0f} output tok/s over {t['elapsed_s']:.1f} s"
            f"{' (truncated)' if t['truncated_at_time_budget'] else ''}; graph step "
            f"{t['graph_step_ms_mean']:.2f} ms mean"
            + (f"; {t['num_preemptions']} preemptions" if "num_preemptions" in t else "")
        )
        for h in (t.get("profile_first_wave_decode", {}), t["host_profile_mid_decode"]):
            if h.get("graph_replay_ms"):
                kinds = ", ".join(
                    f"{k} {ms:.2f}" for k, ms in h["graph_kernels"]["kernel_ms_by_kind"].items()
                )
                print(
                    f"decode batch {h['batch']}: engine step {h['engine_step_ms']:.2f} ms, "
                    f"graph replay {h['graph_replay_ms']:.2f} ms, GPU idle "
                    f"{h.get('gpu_idle_ms_per_step', float('nan')):.2f} ms a step ("
                    f"{h.get('gpu_idle_ms_between_steps', float('nan')):.2f} between steps); "
                    f"kernels ms: {kinds}"
                )
        pre = t.get("kernel_profile_prefill_steps")
        if pre and "error" not in pre:
            kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in pre["kernel_ms_by_kind"].items())
            print(
                f"steps with prefill chunks ({pre['running_before']} running): "
                f"{pre['step_wall_ms_profiled']:.1f} ms a step, GPU idle "
                f"{pre.get('gpu_idle_ms_per_step', float('nan')):.2f} ms a step; "
                f"kernels ms: {kinds}"
            )
        gc_pauses = t.get("gc_pauses")
        if gc_pauses:
            print(
                "collector pauses: "
                + "; ".join(
                    f"generation {g}: {p['count']}, {p['total_ms']:.0f} ms, longest "
                    f"{p['max_ms']:.1f} ms"
                    for g, p in gc_pauses.items()
                )
            )
