"""Structured outputs in the engine (SmolLM2 on CPU): json_schema / json_object / regex / EBNF
outputs follow their grammar, unconstrained rows beside them are unchanged, and a decode or
migrated leg continues from the grammar state its replayed tokens reach."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams, StructuredOutput
from engine.sampling.validation import InvalidField
from engine.step.request import PrefilledChoices

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = StructuredOutput("json_schema", json.dumps(PERSON))
QUESTIONS = [
    "Describe a fictional person as JSON.",
    "Who lives in Paris? Answer in JSON.",
    "Make up a customer record.",
    "Tell me about your best friend.",
]


def prompt(engine: Engine, question: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def run(engine: Engine) -> dict[str, tuple[list[int], str | None]]:
    """Step until idle: req_id -> (token ids, finish reason)."""
    outputs: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens, _ = outputs.get(out.req_id, ([], None))
            outputs[out.req_id] = (tokens + out.new_token_ids, out.finish_reason)
    return outputs


def text(engine: Engine, token_ids: list[int]) -> str:
    assert engine.tokenizer is not None
    return engine.tokenizer.decode(token_ids)


def test_json_schema_outputs_validate_and_free_rows_are_unchanged(make_engine):
    engine = make_engine()
    free = SamplingParams(max_tokens=12, temperature=0)
    engine.add_request("alone", prompt(engine, QUESTIONS[0]), free)
    alone = run(engine)["alone"]
    for i, question in enumerate(QUESTIONS):
        greedy = i % 2 == 0
        params = SamplingParams(
            max_tokens=80, temperature=0 if greedy else 0.8, seed=i, structured=SCHEMA
        )
        engine.add_request(f"json-{i}", prompt(engine, question), params)
    engine.add_request("free", prompt(engine, QUESTIONS[0]), free)
    outputs = run(engine)
    assert outputs["free"] == alone  # a batch mate's grammar masks only its own row
    for i in range(len(QUESTIONS)):
        tokens, reason = outputs[f"json-{i}"]
        assert reason == "stop"
        jsonschema.validate(json.loads(text(engine, tokens)), PERSON)


def test_json_object_regex_and_ebnf_outputs_follow_their_grammar(make_engine):
    engine = make_engine()
    specs = {
        "object": (StructuredOutput("json_object"), "Tom is 30. Give his name and age as JSON."),
        "regex": (
            StructuredOutput("regex", r"[A-Z][a-z]{1,12}, [0-9]{2} years"),
            "Who are you and how old?",
        ),
        "ebnf": (StructuredOutput("grammar", 'root ::= "yes" | "no" | "maybe"'), "Is it blue?"),
    }
    for name, (spec, question) in specs.items():
        params = SamplingParams(max_tokens=60, temperature=0, structured=spec)
        engine.add_request(name, prompt(engine, question), params)
    outputs = run(engine)
    assert all(reason == "stop" for _, reason in outputs.values())
    assert isinstance(json.loads(text(engine, outputs["object"][0])), dict)
    assert re.fullmatch(r"[A-Z][a-z]{1,12}, [0-9]{2} years", text(engine, outputs["regex"][0]))
    assert text(engine, outputs["ebnf"][0]) in ("yes", "no", "maybe")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (StructuredOutput("json_schema", '{"type": "objekt"}'), "response_format"),
        (StructuredOutput("regex", "(["), "guided_regex"),
        (StructuredOutput("grammar", "root ::= undefined_rule"), "guided_grammar"),
    ],
)
def test_a_spec_the_compiler_refuses_names_its_field(make_engine, spec, field):
    engine = make_engine()
    with pytest.raises(InvalidField) as refused:
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured=spec))
    assert refused.value.field == field
    assert not engine.has_unfinished_requests


def test_decode_handoff_and_migration_replay_reach_the_same_output(make_engine):
    """The uninterrupted greedy output equals (a) a decode leg given the first token (replayed
    into its matcher) and (b) a migrated leg whose prompt carries 5 sent tokens."""
    engine = make_engine()
    ids = prompt(engine, QUESTIONS[1])
    params = SamplingParams(max_tokens=80, temperature=0, structured=SCHEMA)
    engine.add_request("whole", ids, params)
    whole, reason = run(engine)["whole"]
    assert reason == "stop" and len(whole) > 6

    assert engine.add_prefilled_request("handoff", ids, whole[0], params) is not None
    engine.fail_kv("handoff")  # recompute the prompt here: the grammar state is what matters
    handoff, _ = run(engine)["handoff"]
    assert [whole[0], *handoff] == whole

    sent = whole[:5]
    resumed = SamplingParams(max_tokens=75, temperature=0, structured=SCHEMA)
    engine.add_request("migrated", ids + sent, resumed, num_resumed_tokens=len(sent))
    migrated, _ = run(engine)["migrated"]
    assert sent + migrated == whole
    # Without the replay the grammar would start over at "{" and refuse this continuation.
    assert not text(engine, migrated).startswith("{")


def test_ignore_eos_still_ends_when_the_grammar_is_done(make_engine):
    engine = make_engine()
    spec = StructuredOutput("grammar", 'root ::= "ok"')
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, structured=spec)
    engine.add_request("ok", prompt(engine, "Say ok."), params)
    tokens, reason = run(engine)["ok"]
    assert reason == "stop" and text(engine, tokens).startswith("ok")


def test_overlapped_steps_never_run_ahead_of_a_grammar(make_engine):
    """With overlapped steps on, a batch holding a grammar request runs step by step (its mask
    needs the token before) and gives the same outputs; a free batch still runs ahead."""
    outputs, steps_ahead = [], []
    for overlap in (False, True):
        engine = make_engine(async_scheduling=overlap)
        ids = prompt(engine, QUESTIONS[2])
        engine.add_request(
            "json", ids, SamplingParams(max_tokens=40, temperature=0, structured=SCHEMA)
        )
        engine.add_request("free", ids, SamplingParams(max_tokens=8, temperature=0))
        outputs.append(run(engine))
        steps_ahead.append(engine.stats.num_steps_ahead)
    assert outputs[0] == outputs[1]
    assert steps_ahead == [0, 0]
    engine.add_request("free-only", ids, SamplingParams(max_tokens=8, temperature=0))
    assert run(engine)["free-only"] == outputs[0]["free"]
    assert engine.stats.num_steps_ahead > 0


def test_prefilled_choices_out_of_range_are_refused_before_the_grammar_starts(make_engine):
    """A prefilled n > 1 request naming a choice index outside [1, n) is refused with nothing
    left behind: no grammar matcher, no reserved block."""
    engine = make_engine()
    params = SamplingParams(max_tokens=8, temperature=0, structured=SCHEMA, n=2)
    with pytest.raises(ValueError, match="choice indexes"):
        engine.add_prefilled_request(
            "bad-choices", [1, 2, 3, 4], 5, params, choices=PrefilledChoices({2: 7}, None)
        )
    assert engine.grammars is not None and engine.grammars.num_active == 0
    engine.assert_no_leaks()
