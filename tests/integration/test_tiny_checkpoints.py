"""Tiny random HF checkpoints (Llama with llama3 rope, Qwen2 with qkv bias, Mistral) load and
run through the same path, and match transformers greedy token for token."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint

VOCAB_SIZE = 512
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CHECKPOINTS = {
    "llama3": dict(architecture="llama", rope_scaling=LLAMA3_ROPE),
    "qwen2": dict(architecture="qwen2", tie_embeddings=True),
    "mistral": dict(architecture="mistral"),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_tiny_random_checkpoint_matches_transformers(tmp_path, kind):
    import transformers

    make_tiny_checkpoint(tmp_path, **CHECKPOINTS[kind])
    assert (tmp_path / "config.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompts = [[5, 17, 300, 42], list(range(1, 200, 3)), [7]]
    new_tokens = 12
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    engine = build_engine(model_path=str(tmp_path), num_blocks=64, max_num_batched_tokens=32)
    assert engine.tokenizer is None
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, params)
    got = run_to_completion(engine)
    assert [got[f"t{i}"] for i in range(len(prompts))] == expected
    engine.assert_no_leaks()


def test_dummy_load_format_needs_only_config_json(tmp_path):
    """load_format="dummy" builds random weights of config.json's shape (speed runs)."""
    make_tiny_checkpoint(tmp_path, vocab_size=VOCAB_SIZE, weights=False)
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError):
        build_engine(model_path=str(tmp_path), num_blocks=64)
    engine = build_engine(model_path=str(tmp_path), num_blocks=64, load_format="dummy")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("a", [5, 17, 300, 42], params)
    engine.add_request("b", [5, 17, 300, 42], params)
    got = run_to_completion(engine)
    assert len(got["a"]) == 5 and got["a"] == got["b"]
    assert all(0 <= t < VOCAB_SIZE for t in got["a"])
    engine.assert_no_leaks()
    with pytest.raises(ValueError, match="load_format"):
        build_engine(model_path=str(tmp_path), num_blocks=64, load_format="npz")
