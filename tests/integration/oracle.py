"""The transformers oracle: greedy generate on the default model loaded straight from its GGUF."""

from __future__ import annotations

import functools

import torch

from engine.models.loader import default_gguf_path

NUM_NEW_TOKENS = 20


@functools.cache
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval()


@functools.cache
def _greedy(prompt_ids: tuple[int, ...], num_new_tokens: int) -> tuple[int, ...]:
    model = hf_model()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id,
        )
    return tuple(out[0, len(prompt_ids) :].tolist())


def hf_greedy(prompt_ids: list[int], num_new_tokens: int = NUM_NEW_TOKENS) -> list[int]:
    return list(_greedy(tuple(prompt_ids), num_new_tokens))


def oracle_prompts(tokenizer) -> list[list[int]]:
    """8 prompts, chat-templated and raw, from 1 to 600+ tokens."""
    story = (
        "The lighthouse keeper counted the ships that passed each evening and wrote their "
        "names in a ledger bound in green leather. "
    )
    facts = " ".join(
        f"Fact {i}: the number {i} squared is {i * i}, and its successor is {i + 1}."
        for i in range(1, 22)
    )
    system = "You are a careful assistant. " + " ".join(
        f"Rule {i}: answer politely and briefly, citing rule {i}." for i in range(1, 25)
    )
    chat = tokenizer.apply_chat_template
    prompts = [
        tokenizer.encode("Hi"),
        tokenizer.encode("The quick brown fox"),
        chat([{"role": "user", "content": "What is the capital of France?"}]),
        chat([{"role": "user", "content": "Write a haiku about the sea."}]),
        tokenizer.encode(story * 8),
        chat([{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]),
        tokenizer.encode(facts + " " + story * 6),
        chat([{"role": "user", "content": "List three prime numbers."}]),
    ]
    return prompts
