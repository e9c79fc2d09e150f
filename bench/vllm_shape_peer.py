"""vLLM's offline and batch-1 peer (.vstage/vllm_bench.py) on another model shape than its built-in
Llama-3.1-8B: the config.json named by PEER_MODEL_CONFIG (e.g. bench/lib/random_models.py's
qwen3-30b-a3b, written with --config-only) replaces that shape; owns no state.

On the GPU machine (vLLM staged into /tmp/vsite, ../shared/device/vllm/), from the repo root:
    python3 -m bench.lib.random_models qwen3-30b-a3b --config-only --out /tmp/qwen3-30b-a3b
    PEER_MODEL_CONFIG=/tmp/qwen3-30b-a3b/config.json PYTHONPATH=/tmp/vsite \
        python3 bench/vllm_shape_peer.py [vllm_bench.py's flags] --json out.json

The shape travels in the environment, not in a flag, because vllm_bench.py re-executes itself
(sys.argv as given) once should vLLM's start-up fail; its flags pass through unchanged. So does
PEER_TP=N: vLLM's tensor_parallel_size (vllm_bench.py has no flag for it; its LLM is built with
that keyword added). The variables are not KVRELAY_* ones: those name kvrelay's settings
(engine/settings.py). The JSON it writes gets "model" naming the shape (and the TP size) and
"model_config" holding the config.
"""

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

BENCH = Path(os.environ.get("PEER_VLLM_BENCH", ".vstage/vllm_bench.py"))


def main() -> None:
    config_path = Path(os.environ["PEER_MODEL_CONFIG"])
    shape = json.loads(config_path.read_text())
    spec = importlib.util.spec_from_file_location("vllm_bench", BENCH)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{BENCH}: vLLM's bench script (PEER_VLLM_BENCH) not found")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.LLAMA31_8B.clear()  # make_model_dir writes this dict as the dummy model's config.json
    bench.LLAMA31_8B.update({"torch_dtype": "bfloat16", **shape})
    tp = int(os.environ.get("PEER_TP", "1"))
    if tp > 1:  # vllm_bench.main imports LLM from vllm when it runs: it gets this one
        import vllm

        vllm.LLM = functools.partial(vllm.LLM, tensor_parallel_size=tp)
        print(f"vllm_shape_peer: tensor_parallel_size={tp} (PEER_TP)", flush=True)
    bench.main()
    if "--json" in sys.argv:
        out = Path(sys.argv[sys.argv.index("--json") + 1])
        result = json.loads(out.read_text())
        result["model"] = f"{config_path.parent.name} ({shape['architectures'][0]}), dummy bf16"
        result["tensor_parallel_size"] = tp
        result["model_config"] = shape
        out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
