"""The Protocols the router and the controller type actor handles with
(common/worker_actors.py) say what the actor classes really take and return: each method
exists, its positional parameters have the Protocol's types (the rest have defaults), and its
result (awaited, for an async method) is the Protocol's."""

from __future__ import annotations

import inspect
from typing import get_args, get_type_hints

import pytest

from common.worker_actors import ControllerActor, DecodeActor, PrefillActor
from decode_worker.worker import DecodeWorker
from deploy.controller import Controller
from prefill_worker.worker import PrefillWorker


@pytest.mark.parametrize(
    ("protocol", "actor_class"),
    [(PrefillActor, PrefillWorker), (DecodeActor, DecodeWorker), (ControllerActor, Controller)],
)
def test_each_remote_method_matches_the_actor(protocol: type, actor_class: type) -> None:
    methods = get_type_hints(protocol)
    for name, hint in methods.items():
        arg_types, result = get_args(hint)
        method = getattr(actor_class, name)
        params = list(inspect.signature(method).parameters.values())[1:]  # less self
        required = [p for p in params if p.default is inspect.Parameter.empty]
        assert len(required) <= len(arg_types) <= len(params), name
        hints = get_type_hints(method)
        assert tuple(hints[p.name] for p in params[: len(arg_types)]) == arg_types, name
        assert hints["return"] == result, name
