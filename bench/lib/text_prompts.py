"""engine_bench's prompts: deterministic English-like text of chosen token lengths, every other
prompt chat-templated, from a seeded RNG; stateless.
"""

from __future__ import annotations

import random
from typing import Any

_WORD_TEXT = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place "
    "well such here take why things help put years different away again off went old number "
    "great tell men say small every found still between name should home big give air line set "
    "own under read last never us left end along while might next sound below saw something "
    "thought both few those always looked show large often together asked house world going "
    "want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth "
    "need far hand high year mother light parts country father let night following picture "
    "being study second eyes soon times story boys since white days ever paper hard near "
    "sentence better best across during today others however sure means knew try told young "
    "river mountain city engine memory cache token model server request network garden"
)

_WORDS = _WORD_TEXT.split()

_CHAT_TASKS = (
    "Summarize the following notes in two sentences:",
    "Rewrite this text as a short poem:",
    "List three questions a reader might ask about this passage:",
    "Explain the main idea of this paragraph to a child:",
    "Translate the gist of this text into plain English:",
)


def _random_text(rng: random.Random, num_words: int) -> str:
    sentences, words = [], []
    for _ in range(num_words):
        words.append(rng.choice(_WORDS))
        if len(words) >= rng.randint(6, 18):
            sentences.append(" ".join(words).capitalize() + ".")
            words = []
    if words:
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def build_prompts(
    tokenizer: Any, num_prompts: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """Deterministic prompts: every other one chat-templated, lengths uniform in [min, max]."""
    rng = random.Random(seed)
    task = max(_CHAT_TASKS, key=len)
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{task}\n\n"}], tokenize=False, add_generation_prompt=True
    )
    chat_overhead = len(tokenizer.encode(template, add_special_tokens=False))
    prompts = []
    for i in range(num_prompts):
        target = rng.randint(min_len, max_len)
        is_chat = i % 2 == 0 and target > chat_overhead + 4
        body_len = target - chat_overhead if is_chat else target
        body = tokenizer.encode(_random_text(rng, body_len + 8), add_special_tokens=False)
        body_text = tokenizer.decode(body[:body_len])
        if is_chat:
            content = f"{rng.choice(_CHAT_TASKS)}\n\n{body_text}"
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(body_text, add_special_tokens=True)[:target])
    return prompts
