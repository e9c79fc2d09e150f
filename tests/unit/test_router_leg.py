"""A request's leg in the router (router/leg.py): its stage moves only along the allowed
transitions (prefill -> handed -> decode -> done, with conditional prefill, first-token ends and
a failed decode), and each stage owes its workers exactly one cleanup call."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from common.messages import FirstToken, KVHandle, WorkerInfo
from common.worker_actors import DecodeActor, PrefillActor
from engine.finish_reason import FinishReason
from router.leg import ALLOWED, CLEANUP, Cleanup, IllegalMove, Leg, LegStage

P, H, D, DONE = LegStage.PREFILL, LegStage.HANDED, LegStage.DECODE, LegStage.DONE
DECODER = WorkerInfo("d0", "decode")


class Calls:
    """A fake actor: every `x.method.remote(*args)` is recorded as (method, args)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, method: str) -> Any:
        calls = self.calls

        class Method:
            @staticmethod
            def remote(*args: Any) -> asyncio.Future[None]:
                calls.append((method, args))
                return asyncio.get_event_loop().create_future()

        return Method


def handle(*finish_reasons: FinishReason | None) -> KVHandle:
    """A prefill worker's answer: choice 0's end first, then the other choices'."""
    first, *others = finish_reasons or (None,)
    epoch = None if all(r is not None for r in (first, *others)) else 7
    choices = tuple(FirstToken(5, finish_reason=r) for r in others)
    return KVHandle(
        "r", "p0", "p0", "agent", (1,), 4, 5, 1, epoch, 30.0, 0, None, first, (), choices
    )


def leg_with_actors() -> tuple[Leg, Calls, Calls]:
    prefill, decode = Calls(), Calls()
    leg = Leg("r", prefill_actor=cast(PrefillActor, prefill))
    leg.decode_actor = cast(DecodeActor, decode)
    return leg, prefill, decode


def test_the_stages_move_forward_only() -> None:
    assert {P: {H, D, DONE}, H: {D}, D: {H, DONE}, DONE: set()} == ALLOWED


@pytest.mark.parametrize("start", list(LegStage))
@pytest.mark.parametrize("to", list(LegStage))
def test_every_move_is_checked(start: LegStage, to: LegStage) -> None:
    leg = Leg("r", stage=start)
    if to in ALLOWED[start]:
        leg.move(to)
        assert leg.stage is to
    else:
        with pytest.raises(IllegalMove, match=f"{start.value} -> {to.value}"):
            leg.move(to)
        assert leg.stage is start


def test_a_remote_prefill_hands_over_then_decodes() -> None:
    prefill = cast(PrefillActor, Calls())
    leg = Leg("r", prefill_actor=prefill)
    leg.prefilled(handle())
    assert leg.stage is H
    leg.decoding(DECODER, cast(DecodeActor, Calls()))
    assert (leg.stage, leg.decode) == (D, DECODER)
    leg.move(DONE)
    with pytest.raises(IllegalMove):
        leg.decoding(DECODER, cast(DecodeActor, Calls()))  # a finished leg takes nothing more


def test_a_prefill_that_ends_every_choice_needs_no_decode() -> None:
    leg = Leg("r", prefill_actor=cast(PrefillActor, Calls()))
    leg.prefilled(handle(FinishReason.LENGTH, FinishReason.STOP))
    assert leg.stage is DONE
    leg = Leg("r", prefill_actor=cast(PrefillActor, Calls()))
    leg.prefilled(handle(FinishReason.STOP, None))  # choice 1 goes on
    assert leg.stage is H


def test_a_local_prefill_goes_straight_to_decode() -> None:
    leg = Leg("r")
    leg.decoding(DECODER, cast(DecodeActor, Calls()))
    assert leg.stage is D
    leg.decode_failed()  # no lease behind it
    assert leg.stage is DONE


def test_a_failed_decode_owes_the_lease_back() -> None:
    leg, _, _ = leg_with_actors()
    leg.prefilled(handle())
    leg.decoding(DECODER, leg.decode_actor)  # type: ignore[arg-type]
    leg.decode_failed()
    assert (leg.stage, leg.cleanup) == (H, Cleanup.RELEASE_LEASE)


def test_each_stage_owes_its_cleanup() -> None:
    assert CLEANUP == {
        P: Cleanup.ABORT_PREFILL,
        H: Cleanup.RELEASE_LEASE,
        D: Cleanup.ABORT_DECODE,
        DONE: Cleanup.NOTHING,
    }


@pytest.mark.parametrize(
    ("stage", "prefill_calls", "decode_calls"),
    [
        (P, [("abort", ("r",))], []),
        (H, [("release", ("r", 7))], []),
        (D, [], [("abort", ("r",))]),
        (DONE, [], []),
    ],
)
def test_the_cleanup_call_of_each_stage(
    stage: LegStage, prefill_calls: list[tuple[str, tuple[Any, ...]]], decode_calls: list[Any]
) -> None:
    async def run() -> None:
        leg, prefill, decode = leg_with_actors()
        leg.handle = handle()
        leg.stage = stage
        assert (leg.cleanup_call() is None) == (stage is DONE)
        assert (prefill.calls, decode.calls) == (prefill_calls, decode_calls)

    asyncio.run(run())


def test_a_prefill_never_reached_owes_nothing() -> None:
    leg = Leg("r")  # its worker could not be asked (gone before the call)
    assert leg.cleanup is Cleanup.ABORT_PREFILL and leg.cleanup_call() is None
