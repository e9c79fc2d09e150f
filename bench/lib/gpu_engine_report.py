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
    weights = (result.get("args") or {}).get("quantization") or "bf16"
    weights = "bf16" if weights in ("none", "auto") else weights
    print(f"\n{result['env']['gpu']}, {result['shape']} (random {weights} weights)")
    print(f"device copy bandwidth        {result['copy_bandwidth_GBps']:.0f} GB/s (read+write)")
    d = result.get("decode_b1")
    if d:
        print_decode_b1(d)
    for row in result.get("moe_layer") or ():
        print(
            f"MoE layer, {row['tokens']:>4} tokens   {row['layer_us']:.1f} us, "
            f"{row['experts_touched']} experts, {row['bytes_read'] / 1e6:.1f} MB: "
            f"{row['over_roofline']:.2f}x roofline ({row['achieved_GBps']:.0f} GB/s)"
        )
    mixed = result.get("mixed")
    if mixed:
        print_mixed(mixed)
    t = result.get("offline")
    if t:
        print_offline(t)


def print_decode_b1(d: dict[str, Any]) -> None:
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


def print_offline(t: dict[str, Any]) -> None:
    print(
        f"offline {t['num_requests']} x ({t['input_len']} in, {t['output_len']} out): "
        f"{t['output_tokens_per_s']:.0f} output tok/s over {t['elapsed_s']:.1f} s"
        f"{' (truncated)' if t['truncated_at_time_budget'] else ''}; graph step "
        f"{t['graph_step_ms_mean']:.2f} ms mean; {t['num_preemptions']} preemptions"
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


def _ms(group: dict[str, Any] | None, key: str = "wall_ms") -> str:
    value = None if group is None else group.get(key)
    return "-" if value is None else f"{value:.2f}"


def _top_stages(group: dict[str, Any], num: int = 5) -> str:
    host = sorted(group.get("host_ms", {}).items(), key=lambda kv: -kv[1])[:num]
    return ", ".join(f"{stage} {ms:.2f}" for stage, ms in host)


def print_mixed(mixed: dict[str, Any]) -> None:
    """The mixed-step section (bench/lib/mixed_steps.py): per (B, P), medians in ms."""
    print("mixed steps: B decoding + one fresh P-token prompt; medians, ms a step() call")
    for cell in mixed["cells"]:
        head = f"  B={cell['batch']:<3} P={cell['prompt_len']:<5}"
        over = (cell.get("overlapped") or {}).get("groups")
        if over:
            first = cell["overlapped"].get("first", {})
            decode, launch, finish = (
                over.get(k) for k in ("decode", "launch_mixed", "finish_mixed")
            )
            print(
                f"{head} overlapped: decode {_ms(decode)} (its step's GPU span "
                f"{_ms(decode, 'finished_gpu_span_ms')}), launch_mixed {_ms(launch)}, "
                f"finish_mixed {_ms(finish)} (the mixed step's GPU span "
                f"{_ms(finish, 'finished_gpu_span_ms')}); first time "
                f"{_ms(first.get('launch_mixed'))} + {_ms(first.get('finish_mixed'))}"
            )
            head = " " * len(head)
        serial, first = cell["serial"]["groups"], cell["serial"].get("first", {})
        for label in ("mixed", "decode"):
            group = serial.get(label)
            if group is None:
                continue
            line = f"{head} serial {label:<6} {_ms(group)}: host {_top_stages(group)}"
            if label == "mixed" and label in first:
                line += f"; first time {_ms(first[label])}"
            print(line)
            head = " " * len(head)
        kernels = (cell.get("serial_kernels") or {}).get("groups", {})
        for label in ("mixed", "decode"):
            k = kernels.get(label)
            if k is None or not k.get("num_kernels"):
                continue
            kinds = ", ".join(f"{kind} {ms:.2f}" for kind, ms in k["kernel_ms_by_kind"].items())
            print(
                f"{head} GPU {label:<6} busy {_ms(k, 'kernel_busy_ms')} of {_ms(k)} (idle "
                f"{_ms(k, 'gpu_idle_in_call_ms')}), {k['num_kernels']:.0f} kernels: {kinds}"
            )
    for skipped in mixed.get("skipped", ()):
        print(f"  B={skipped['batch']} P={skipped['prompt_len']}: skipped ({skipped['why']})")
