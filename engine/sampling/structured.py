"""Structured outputs: owns the grammar compiler, its cache of compiled grammars (by kind and
spec) and the count of live matchers; each request's GrammarMatcher lives on its Request and is
advanced on every accepted token.

Grammars come from xgrammar. A step's token bitmask is filled on the host for the rows with a
grammar (batched over threads), then applied to the logits on the device before sampling.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch
import xgrammar as xgr

from engine.execution.host_tensors import to_device
from engine.sampling.sampling_params import StructuredOutput
from engine.sampling.validation import InvalidField, structured_field
from engine.step.request import Request
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 256
# xgrammar prefixes its messages with a time stamp and a C++ source location.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*(Check failed: .*? is false:\s*)?")


def _message(error: Exception) -> str:
    text = str(error).strip()
    return _CPP_PREFIX.sub("", text).strip()


class GrammarCompiler:
    """Compiles a StructuredOutput for one tokenizer and vocabulary width; keeps the most recent
    MAX_CACHED_GRAMMARS compiled grammars. The tokenizer's table is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar; raises InvalidField naming the request field when the spec is
        not one xgrammar accepts."""
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            return compiled
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError) as e:
            field = structured_field(spec.kind)
            raise InvalidField(f"{field}: {_message(e)}", field) from None
        self._cache[spec] = compiled
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._grammar_compiler()
        # Compact JSON (no free whitespace): small models otherwise loop on spaces and newlines.
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.spec, any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.spec)
        raise ValueError(f"unknown structured output kind {spec.kind!r}")

    def _grammar_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer.hf_tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler


class Grammars:
    """Starts and releases the GrammarMatcher of each request with a grammar (kept on the
    Request; advance() moves it on), and fills a step's bitmask from them.

    Invariants: a request's matcher has accepted exactly its output tokens so far (those a
    continuation's prompt carries, then each one appended), so the next bitmask is the grammar
    state after them; num_active counts the requests holding a matcher. The engine never runs
    a step ahead of a request with a grammar.
    """

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.vocab_size = compiler.vocab_size
        self.num_active = 0
        self._batch = xgr.BatchGrammarMatcher(max_threads=2)

    def start(self, req: Request, spec: StructuredOutput, output_token_ids: Sequence[int]) -> None:
        """Give req its matcher and replay the output tokens so far into it (a decode worker's
        handoff: the first token; a migrated request: every token already sent)."""
        matcher = xgr.GrammarMatcher(self.compiler.compile(spec))
        replay(matcher, output_token_ids)
        req.grammar = matcher
        self.num_active += 1

    def release(self, req: Request) -> None:
        if req.grammar is not None:
            req.grammar = None
            self.num_active -= 1

    def bitmask(self, reqs: Sequence[Request]) -> TokenBitmask | None:
        """The next-token bitmask of a step's sampling rows (host, int32 [rows, vocab/32]);
        None when no row has a grammar. Rows without one allow every token."""
        if not self.num_active:
            return None
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
        if not rows:
            return None
        mask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        matchers = [reqs[i].grammar for i in rows]
        self._batch.batch_fill_next_token_bitmask(matchers, mask, rows)
        return TokenBitmask(mask, rows)


class TokenBitmask:
    """One step's grammar bitmask on the host and the rows it constrains."""

    def __init__(self, mask: torch.Tensor, rows: list[int]):
        self.mask = mask
        self.rows = rows

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammars refuse to -inf, in place, on logits' device
        (one kernel; the vocabulary width past the tokenizer's is refused too)."""
        mask = to_device(self.mask, logits.device)
        xgr.apply_token_bitmask_inplace(
            logits, mask, vocab_size=logits.shape[-1], indices=self.rows
        )


def new_grammars(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> Grammars:
    """An engine's grammars: vocab_size is the logits' width, stop_token_ids its EOS ids."""
    return Grammars(GrammarCompiler(tokenizer, vocab_size, stop_token_ids))


def advance(req: Request, token_id: int) -> bool:
    """Advance req's matcher (it has one) by an appended token. True: the grammar is done (it
    accepted a stop token), or it refused the token (which its mask forbade); either way the
    request stops."""
    matcher = req.grammar
    assert matcher is not None
    if not matcher.accept_token(token_id):
        logger.warning("request %s: token %d breaks its grammar; stopping it", req.req_id, token_id)
        return True
    return matcher.is_terminated()


def replay(matcher: xgr.GrammarMatcher, token_ids: Sequence[int]) -> None:
    """Advance a fresh matcher through token_ids; ValueError if the grammar refuses one."""
    for i, token_id in enumerate(token_ids):
        if not matcher.accept_token(token_id):
            raise ValueError(f"output token {i} ({token_id}) does not follow the request's grammar")
