"""PromptEncoder: chat templates, tokenization and detokenization on a bounded thread pool beside
the router's event loop (it owns the pool), so one long prompt never delays another request,
/health or a stream; a prompt that provably cannot fit the context is refused before it is
tokenized. The tokenizer's encode and decode release the GIL while they work.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from router.errors import InvalidRequest
from router.tokenizer import RouterTokenizer

T = TypeVar("T")

# Threads that tokenize at once; more prompts wait their turn (the request bound caps them).
DEFAULT_NUM_THREADS = min(4, os.cpu_count() or 1)

Messages = Sequence[Mapping[str, Any]]


class PromptEncoder:
    """Every call runs on the pool; the coroutine waits without holding the loop."""

    def __init__(
        self, tokenizer: RouterTokenizer, max_model_len: int, num_threads: int = DEFAULT_NUM_THREADS
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kvrelay-tokenize")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def prompt_ids(self, prompt: str | None, messages: Messages | None) -> list[int]:
        """The token ids to generate from: the chat messages rendered by the chat template, or
        the prompt text. Raises InvalidRequest naming `messages` or `prompt` when the template
        refuses the messages or the text is provably longer than the context."""
        return await self._run(self._prompt_ids, prompt, messages)

    async def tokenize(
        self,
        prompt: str | None,
        messages: Messages | None,
        add_special_tokens: bool,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """/tokenize: the prompt's or the rendered chat's ids, whatever their length."""
        return await self._run(
            self._tokenize, prompt, messages, add_special_tokens, add_generation_prompt
        )

    async def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return await self._run(self.tokenizer.decode, token_ids, skip_special_tokens)

    # ---- on the pool's threads -----------------------------------------------------------
    def _render(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt)
        except ValueError as e:
            raise InvalidRequest(str(e), "messages") from None

    def _prompt_ids(self, prompt: str | None, messages: Messages | None) -> list[int]:
        field = "prompt" if messages is None else "messages"
        text = self._render(messages) if messages is not None else prompt or ""
        at_least = self.tokenizer.min_num_tokens(text)
        if at_least >= self.max_model_len:
            raise InvalidRequest(
                f"the {field} has at least {at_least} tokens ({len(text.encode())} bytes of "
                f"text), but this model's context length (max_model_len) is "
                f"{self.max_model_len} tokens and the prompt must leave room for at least one "
                "output token",
                field,
                "context_length_exceeded",
            )
        return self.tokenizer.encode(text, add_special_tokens=messages is None)

    def _tokenize(
        self,
        prompt: str | None,
        messages: Messages | None,
        add_special_tokens: bool,
        add_generation_prompt: bool,
    ) -> list[int]:
        if messages is not None:
            text = self._render(messages, add_generation_prompt)
        else:
            text = prompt or ""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
