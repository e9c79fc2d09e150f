"""LLM: offline batch generation on one Engine (owns the engine and a request counter)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.engine import Engine, EngineConfig
from engine.finish_reason import FinishReason
from engine.sampling.sampler import TopLogprobs
from engine.sampling.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when params.top_logprobs


class LLM:
    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: Engine | None = None,
        tensor_parallel_size: int | None = None,
    ):
        """tensor_parallel_size: overrides config's (ranks run as local processes; shutdown()
        ends them)."""
        if tensor_parallel_size is not None:
            config = replace(config or EngineConfig(), tensor_parallel_size=tensor_parallel_size)
        self.engine = engine or Engine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """End the engine's tensor-parallel ranks (nothing to do with one rank)."""
        self.engine.shutdown()

    def chat_prompt(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        return self.engine.tokenizer.apply_chat_template(messages)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion in continuous batches; results in prompt order."""
        params_list = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if any(p.n > 1 for p in params_list):  # one Completion per prompt
            raise ValueError("LLM.generate takes n=1; Engine outputs carry each choice's index")
        engine = self.engine
        order: dict[str, Completion] = {}
        uses_stop_strings: set[str] = set()
        for prompt, p in zip(prompts, params_list, strict=True):
            req_id = f"llm-{next(self._ids)}"
            req = engine.add_request(req_id, prompt, p)
            order[req_id] = Completion(list(req.prompt_token_ids))
            if p.stop:
                uses_stop_strings.add(req_id)
        while engine.has_unfinished_requests:
            for out in engine.step():
                done = order[out.req_id]
                done.token_ids.extend(out.new_token_ids)
                done.text += out.new_text
                done.logprobs.extend(out.new_logprobs or ())
                done.top_logprobs.extend(out.new_top_logprobs or ())
                done.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    done.finish_reason = out.finish_reason
        if engine.tokenizer is not None:
            for req_id, done in order.items():
                if req_id not in uses_stop_strings:  # those carry their cut text already
                    done.text = engine.tokenizer.decode(done.token_ids)
        return list(order.values())
