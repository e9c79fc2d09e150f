"""ChoiceTrackers (router/choices.py): each choice's own stop strings and finish, the request's
end once every choice has ended, usage with the prompt counted once."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from common.messages import GenerateRequest, TokenDelta
from common.placement_rules import SloTargets
from engine.finish_reason import FinishReason
from engine.sampling.sampling_params import SamplingParams
from router.choices import ChoiceTrackers
from router.errors import BackendError, BackendUnavailable
from router.http_server import _backend_failed
from router.metrics import RouterMetrics
from router.request_spec import Prepared
from router.tokenizer import RouterTokenizer
from router.traffic_class import KeyClass, TrafficClass

PROMPT = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir) -> RouterTokenizer:
    return RouterTokenizer(smollm_dir)


def make_trackers(tokenizer: RouterTokenizer, n: int, stop: tuple[str, ...] = ()) -> ChoiceTrackers:
    request = GenerateRequest("r", PROMPT, SamplingParams(max_tokens=8, n=n), model="tiny")
    return ChoiceTrackers(tokenizer, Prepared(request, stop, arrival=0.0), RouterMetrics())


def delta(index: int, token_ids: list[int], finished: bool = False) -> TokenDelta:
    reason = "length" if finished else None
    return TokenDelta("r", tuple(token_ids), finished, reason, len(PROMPT), 2, index=index)


def test_the_request_ends_when_every_choice_has_and_usage_sums_the_choices(
    tokenizer: RouterTokenizer,
) -> None:
    trackers = make_trackers(tokenizer, n=2)
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    first = trackers.on_delta(delta(1, ids, finished=True))
    assert first is not None and first.index == 1 and first.finish_reason == "length"
    assert first.usage is None and not trackers.finished
    last = trackers.on_delta(delta(0, ids[:1], finished=True))
    assert last is not None and last.index == 0 and trackers.finished
    assert trackers.backend_finished
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, len(ids) + 1)


def test_a_choice_ended_by_its_stop_string_drops_its_later_deltas(
    tokenizer: RouterTokenizer,
) -> None:
    trackers = make_trackers(tokenizer, n=2, stop=(" two",))
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    stopped = trackers.on_delta(delta(0, ids))
    assert stopped is not None and stopped.finish_reason == "stop" and stopped.text == " one"
    assert trackers.on_delta(delta(0, ids[:1], finished=True)) is None  # dropped
    assert not trackers.finished
    other = trackers.on_delta(delta(1, ids[:1], finished=True))
    assert other is not None and other.text == " one" and trackers.finished
    assert trackers.backend_finished  # both choices' final deltas arrived


def test_a_delta_for_a_choice_the_request_has_not_is_refused(tokenizer: RouterTokenizer) -> None:
    with pytest.raises(ValueError, match="choice 3"):
        make_trackers(tokenizer, n=2).on_delta(delta(3, [5]))


def test_the_time_to_first_token_is_observed_once_a_request(tokenizer: RouterTokenizer) -> None:
    trackers = make_trackers(tokenizer, n=3)
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    for index in (2, 0, 1):  # each choice's first token
        trackers.on_delta(delta(index, ids[:1]))
    ttft = trackers.metrics.ttft.collect()[0]
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count == 1  # one request (each choice counted it: 3)
    assert {s.labels["model"] for s in ttft.samples} == {"tiny"}  # by served model


def test_a_lost_worker_none_replaced_is_unavailable_and_a_refusal_no_finished_request(
    tokenizer: RouterTokenizer,
) -> None:
    lost = TokenDelta("r", (), True, FinishReason.ERROR, error="worker died", unavailable=True)
    with pytest.raises(BackendUnavailable, match="worker died"):  # HTTP 503, UNAVAILABLE
        make_trackers(tokenizer, n=1).on_delta(lost)
    failed = replace(lost, unavailable=False)
    with pytest.raises(BackendError) as raised:  # HTTP 500, INTERNAL
        make_trackers(tokenizer, n=1).on_delta(failed)
    assert not isinstance(raised.value, BackendUnavailable)
    assert _backend_failed(BackendUnavailable("gone")).status == 503
    assert _backend_failed(BackendUnavailable("gone")).headers["Retry-After"] == "1"
    assert _backend_failed(BackendError("bug")).status == 500
    refused = make_trackers(tokenizer, n=1)
    refused.refused = True  # the backend refused it before any output (503)
    refused.record_end()
    registry = refused.metrics.registry
    assert registry.get_sample_value("kvrelay_unavailable_requests_total") == 1
    assert registry.get_sample_value("kvrelay_requests_total", {"finish_reason": "abort"}) is None


def test_a_finished_request_is_judged_once_against_each_objective_by_its_class(
    tokenizer: RouterTokenizer,
) -> None:
    """kvrelay_slo_requests: an n = 2 request counts once (choice 0's timing), by its key's
    class; its first token came long after its arrival (time 0 on the monotonic clock) and
    well within a TTFT objective of 10^15 ms, its two tokens a gap apart over a TPOT objective
    of 10^-9 ms; a request of no objectives is not judged, nor one with deadline_s."""
    request = GenerateRequest("r", PROMPT, SamplingParams(max_tokens=8, n=2), model="tiny")
    batch = Prepared(request, (), arrival=0.0, key_class=KeyClass(TrafficClass.BATCH))
    metrics = RouterMetrics()
    slo = SloTargets(ttft_ms=1e15, tpot_ms=1e-9)
    trackers = ChoiceTrackers(tokenizer, batch, metrics, slo)
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    for index in (0, 1):
        trackers.on_delta(delta(index, ids[:1]))
        time.sleep(0.002)  # the two tokens a gap apart, on any clock's resolution
        trackers.on_delta(delta(index, ids[1:2], finished=True))
    trackers.record_end()

    def count(objective: str, met: str, traffic_class: str = "batch") -> float | None:
        labels = dict(model="tiny", traffic_class=traffic_class, objective=objective, met=met)
        return metrics.registry.get_sample_value("kvrelay_slo_requests_total", labels)

    assert (count("ttft", "true"), count("ttft", "false")) == (1.0, None)
    assert (count("tpot", "false"), count("tpot", "true")) == (1.0, None)
    single = replace(request, sampling=SamplingParams(max_tokens=8))
    plain = ChoiceTrackers(tokenizer, Prepared(single, (), arrival=0.0), metrics)  # none
    plain.on_delta(delta(0, ids, finished=True))
    plain.record_end()
    assert count("ttft", "true", "interactive") is None
    # a batch request with deadline_s is placed without the objectives: not judged by them
    late = replace(request, req_id="late", deadline_s=60.0)
    late_prepared = Prepared(late, (), arrival=0.0, key_class=KeyClass(TrafficClass.BATCH))
    deadline = ChoiceTrackers(tokenizer, late_prepared, metrics, slo)
    for index in (0, 1):
        deadline.on_delta(delta(index, ids, finished=True))
    deadline.record_end()
    assert (count("ttft", "true"), count("ttft", "false")) == (1.0, None)
