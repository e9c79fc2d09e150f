"""serve_bench's seeded workloads (sharegpt lengths, multi-turn conversations) and the closed
loop that sends a conversation's turns one after the other."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from bench.lib.serve_args import build_parser, check_args, rate_runs
from bench.lib.serve_client import BenchRequest, Client, RequestResult, Sampling
from bench.lib.serve_run import run_timed
from bench.lib.serve_workload import (
    SHAREGPT_MIN_INPUT,
    arrival_offsets,
    build_conversations,
    build_requests,
    single_turns,
    text_encoder,
)


def make_args(*argv: str):
    args = build_parser().parse_args(list(argv))
    check_args(args)
    args.rate, args.seed = args.rates[0], args.seed
    return args


def test_a_rates_run_is_seeded_by_its_value_not_its_place_in_the_list() -> None:
    def seeds(*rates: str) -> dict[float, int]:
        args = build_parser().parse_args(["--seed", "7", "--rate", *rates])
        return {run.rate: run.seed for run in rate_runs(args)}

    short, long = seeds("8", "12", "16"), seeds("4", "8", "12", "16")
    assert short == {rate: long[rate] for rate in short}  # 8 req/s draws alike in both lists
    assert len(set(long.values())) == 4  # one server's runs share no prompts
    assert seeds("0.5", "1.5", "inf") == {0.5: 507, 1.5: 1507, float("inf"): 7}  # inf: at once
    args = build_parser().parse_args(["--seed", "7", "--rate", "12", "8"])
    assert [run.rate for run in rate_runs(args)] == [12, 8]  # in the order given


def sharegpt_args(*argv: str):
    return make_args("--workload", "sharegpt", "--num-requests", "400", *argv)


def multi_turn_args(*argv: str):
    return make_args(
        *("--transport", "grpc", "--workload", "multi-turn", "--num-conversations", "3"),
        *("--turns", "3", "--input-len", "20", "--turn-input-len", "5", "--output-len", "4"),
        *argv,
    )


def test_sharegpt_is_deterministic_for_a_seed() -> None:
    assert build_requests(sharegpt_args()) == build_requests(sharegpt_args())
    other = build_requests(sharegpt_args("--seed", "1"))
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in build_requests(sharegpt_args())]


def test_sharegpt_lengths_are_heavy_tailed_near_the_published_means() -> None:
    requests = build_requests(sharegpt_args("--num-requests", "4000"))
    inputs = [len(r.prompt_ids) for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert 180 < statistics.mean(inputs) < 260
    assert 160 < statistics.mean(outputs) < 240
    assert statistics.median(inputs) < 0.75 * statistics.mean(inputs)  # a long right tail
    assert max(inputs) > 1000


def test_sharegpt_lengths_are_clipped() -> None:
    requests = build_requests(sharegpt_args("--max-input-len", "64", "--max-output-len", "16"))
    inputs = [len(r.prompt_ids) for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert min(inputs) >= SHAREGPT_MIN_INPUT and max(inputs) == 64
    assert min(outputs) >= 1 and max(outputs) == 16


def test_sharegpt_refuses_clips_below_the_minimum() -> None:
    with pytest.raises(ValueError, match="--max-input-len >= 4"):
        sharegpt_args("--max-input-len", "3")


def test_multi_turn_runs_over_http_with_token_id_prompts_only() -> None:
    assert make_args("--workload", "multi-turn").transport == "http"
    with pytest.raises(ValueError, match="use --endpoint completions"):
        make_args("--workload", "multi-turn", "--endpoint", "chat")
    with pytest.raises(ValueError, match="no such file"):
        make_args("--workload", "multi-turn", "--tokenizer", "/nonexistent/tokenizer.json")


def test_multi_turn_rate_is_conversation_starts() -> None:
    args = multi_turn_args("--rate", "2", "--arrival", "fixed")
    assert arrival_offsets(args) == [0.0, 0.5, 1.0]  # one per conversation, not per turn


def test_conversations_are_seeded_and_indexed_by_turn() -> None:
    conversations = build_conversations(multi_turn_args())
    assert conversations == build_conversations(multi_turn_args())
    assert [len(c.turns) for c in conversations] == [3, 3, 3]
    assert [t.index for c in conversations for t in c.turns] == list(range(9))
    second = conversations[1]
    assert [(t.conversation, t.turn) for t in second.turns] == [(1, 0), (1, 1), (1, 2)]
    assert [len(t.prompt_ids) for t in second.turns] == [20, 5, 5]  # first prompt, then fresh


def test_the_next_turn_resends_the_history_with_what_was_generated() -> None:
    conversation = build_conversations(multi_turn_args())[0]
    first = conversation.first_request()
    result = RequestResult(first.index, -1, ok=True, output_ids=[7, 8, 9, 10])
    second = conversation.next_request(first, result)
    assert second is not None
    fresh = conversation.turns[1].prompt_ids
    assert second.prompt_ids == (*first.prompt_ids, 7, 8, 9, 10, *fresh)
    assert (second.turn, second.max_tokens) == (1, 4)
    third = conversation.next_request(second, RequestResult(1, -1, ok=True, output_ids=[1]))
    assert third is not None and third.prompt_ids[: len(second.prompt_ids)] == second.prompt_ids
    assert conversation.next_request(third, result) is None


def test_over_http_the_next_turn_resends_the_output_text_encoded() -> None:
    conversation = build_conversations(multi_turn_args())[0]
    first = conversation.first_request()
    encoded = {"abc": [5, 6], "": []}
    result = RequestResult(first.index, -1, ok=True, output_tokens=3, output_text="abc")
    second = conversation.next_request(first, result, encoded.__getitem__)
    assert second is not None
    assert second.prompt_ids == (*first.prompt_ids, 5, 6, *conversation.turns[1].prompt_ids)
    # The text is what counts, not how many tokens the server said it generated, nor any ids.
    result.output_ids = [1, 2, 3]
    assert conversation.next_request(first, result, encoded.__getitem__) == second


def test_the_text_encoder_is_the_tokenizers_without_special_tokens() -> None:
    from tokenizers import Tokenizer

    from engine.models.loader import resolve_model

    path = str(resolve_model("default") / "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    encode = text_encoder(path)
    text = " Once upon a time, a lighthouse."
    ids = encode(text)
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    assert encode("") == []


class EchoClient(Client):
    """Generates max_tokens ids (the prompt length, repeated) and records what it was sent;
    fails the requests whose index is in fail."""

    def __init__(self, fail: frozenset[int] = frozenset()):
        super().__init__(Sampling(), timeout_s=10)
        self.sent: list[BenchRequest] = []
        self.fail = fail

    async def _stream(self, request: BenchRequest, result: RequestResult) -> None:
        self.sent.append(request)
        await asyncio.sleep(0)
        if request.index in self.fail:
            result.error = "refused"
            return
        result.output_ids = [len(request.prompt_ids)] * request.max_tokens
        result.output_tokens = request.max_tokens
        result.prompt_tokens = len(request.prompt_ids)
        self._on_tokens(result, request.max_tokens)

    async def close(self) -> None:
        pass


def test_turns_are_sent_in_order_each_after_the_previous_one() -> None:
    conversations = build_conversations(multi_turn_args())
    client = EchoClient()
    results, _, _ = asyncio.run(run_timed(client, conversations, [0.0] * 3, 0, 10.0))
    assert [r.index for r in results] == list(range(9))
    assert all(r.ok for r in results)
    by_conversation = [[r for r in client.sent if r.conversation == c] for c in range(3)]
    for sent in by_conversation:
        assert [r.turn for r in sent] == [0, 1, 2]
        assert [len(r.prompt_ids) for r in sent] == [20, 29, 38]  # + 4 generated + 5 fresh
        assert sent[2].prompt_ids[20:24] == (20,) * 4  # turn 0's output, in turn 2's history
    assert [(r.conversation, r.turn) for r in results[3:6]] == [(1, 0), (1, 1), (1, 2)]


class TextClient(EchoClient):
    """An OpenAI-like client: streams text ("x"s, then the prompt's 2-digit length), no ids."""

    async def _stream(self, request: BenchRequest, result: RequestResult) -> None:
        await super()._stream(request, result)
        result.output_ids = []
        result.output_text = "x" * (request.max_tokens - 2) + str(len(request.prompt_ids))


def test_an_http_conversation_resends_each_turns_text_encoded() -> None:
    conversations = build_conversations(multi_turn_args())
    client = TextClient()

    def encode(text: str) -> list[int]:  # one id per character: "x" -> 0, a digit -> 1000 + it
        return [0 if c == "x" else 1000 + int(c) for c in text]

    results, _, _ = asyncio.run(run_timed(client, conversations, [0.0] * 3, 0, 10.0, encode=encode))
    assert all(r.ok for r in results)
    sent = [r for r in client.sent if r.conversation == 0]
    assert [len(r.prompt_ids) for r in sent] == [20, 29, 38]  # + 4 encoded + 5 fresh
    assert sent[1].prompt_ids[20:24] == (0, 0, 1002, 1000)  # turn 0's text "xx20"
    assert sent[2].prompt_ids[:29] == sent[1].prompt_ids


def test_a_failed_turn_stops_its_conversation_only() -> None:
    conversations = build_conversations(multi_turn_args())
    client = EchoClient(fail=frozenset({4}))  # conversation 1, turn 1
    results, _, _ = asyncio.run(run_timed(client, conversations, [0.0] * 3, 0, 10.0))
    assert [r.ok for r in results] == [True] * 4 + [False, False] + [True] * 3
    assert results[4].error == "refused"
    assert results[5].error == "not sent: an earlier turn failed"
    assert (results[5].conversation, results[5].turn) == (1, 2)
    assert len(client.sent) == 8


def test_single_request_workloads_run_as_one_turn_conversations() -> None:
    args = make_args("--num-requests", "4", "--input-len", "8", "--output-len", "2")
    requests = build_requests(args)
    client = EchoClient()
    results, _, duration = asyncio.run(
        run_timed(client, single_turns(requests), arrival_offsets(args), 2, 10.0)
    )
    assert client.sent == requests
    assert [r.ok for r in results] == [True] * 4 and duration >= 0


def test_mix_needs_a_launched_http_server_and_floods_from_another_seed() -> None:
    from bench.lib.mixed_load import KEYS_FILE, batch_requests
    from router.access import ApiKeys
    from router.traffic_class import TrafficClass

    for argv in (["--mix"], ["--mix", "--launch", "--transport", "grpc"]):
        with pytest.raises(ValueError, match="--mix needs --launch"):
            make_args(*argv)
    args = make_args("--mix", "--launch", "--num-requests", "4", "--mix-batch-requests", "6")
    flood = batch_requests(args)
    assert len(flood) == 6 and {r.max_tokens for r in flood} == {args.mix_batch_output_len}
    chats = {r.prompt_ids for r in build_requests(args)}
    assert not chats & {r.prompt_ids for r in flood}
    keys = ApiKeys.parse(KEYS_FILE)  # the bench's key file is one the router takes
    assert keys.key_class("jobs").kind is TrafficClass.BATCH
    assert keys.key_class("jobs-plain").kind is TrafficClass.INTERACTIVE
