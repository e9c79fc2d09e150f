"""`kvrelay serve --models-file PATH`: the models a cluster serves side by side, read from YAML or
JSON, each with its pool sizes and the engine flags it sets beyond the command line's; turned
into ModelPools before any process starts. Holds no state.

    models:
      - model: path/to/hf-folder         # required: a name, .gguf file or HF folder
        prefill: 1                       # default: --prefill
        decode: 2                        # default: --decode
        flags: {kv-cache-gib: 0.5, max-model-len: 2048}   # any engine flag of `kvrelay serve`
        autoscale: {decode: "1:4"}       # default: --autoscale-prefill / --autoscale-decode
      - model: path/to/other.gguf
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.cluster_state import MAX_POOL_SIZE
from deploy.autoscale import AutoscaleConfig
from deploy.engine_flags import add_engine_flags
from deploy.local_cluster import ModelPools
from engine.config import EngineConfig

ENTRY_FIELDS = frozenset({"model", "prefill", "decode", "flags", "autoscale"})
AUTOSCALE_ROLES = ("prefill", "decode")

AutoscaleFrom = Callable[[argparse.Namespace], AutoscaleConfig | None]


def read_models_file(
    path: str,
    args: argparse.Namespace,
    engine_from_args: Callable[[argparse.Namespace], EngineConfig],
    autoscale_from_args: AutoscaleFrom,
) -> list[ModelPools]:
    """Each entry's ModelPools: its engine from the command line's engine flags with the
    entry's own on top (`engine_from_args` checks them as on the command line), its sizes or
    --prefill / --decode, its autoscale bounds or --autoscale-prefill / --autoscale-decode
    (`autoscale_from_args` checks them against its sizes). ValueError naming the file, the
    entry and the field."""
    import yaml

    try:
        text = Path(path).read_text()
        data = _json(text)
        if data is None:
            data = yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--models-file {path}: {e}") from None
    entries = data.get("models") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models-file {path}: wants `models:`, a list of one or more models")
    return [
        _pools(f"--models-file {path}: models[{i}]", e, args, engine_from_args, autoscale_from_args)
        for i, e in enumerate(entries)
    ]


def _json(text: str) -> Any:
    """text read as JSON when it is JSON (else None: YAML). JSON is YAML too, but PyYAML reads
    the escape of a character past U+FFFF (json.dumps writes one so) as two lone surrogates."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _pools(
    where: str,
    entry: Any,
    args: argparse.Namespace,
    engine_from_args: Callable[[argparse.Namespace], EngineConfig],
    autoscale_from_args: AutoscaleFrom,
) -> ModelPools:
    if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
        raise ValueError(f"{where}: wants a mapping with `model: NAME_OR_PATH`")
    unknown = sorted(set(entry) - ENTRY_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {sorted(ENTRY_FIELDS)})")
    sizes = {}
    for role in ("prefill", "decode"):
        size = entry.get(role, getattr(args, role))
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_POOL_SIZE:
            if role == "prefill" and size == 0 == args.prefill:
                sizes[role] = 0  # aggregated, as the command line's --prefill 0 makes every model
                continue
            raise ValueError(
                f"{where}.{role}: wants a whole number in [1, {MAX_POOL_SIZE}], got {size!r}"
                + (" (aggregated workers: --prefill 0 for every model)" if size == 0 else "")
            )
        sizes[role] = size
    if sizes["prefill"] and not args.prefill:
        raise ValueError(f"{where}.prefill: --prefill 0 (aggregated) is every model's")
    flags = entry.get("flags") or {}
    if not isinstance(flags, dict):
        raise ValueError(f"{where}.flags: wants a mapping of engine flag -> value")
    ns = _engine_args(f"{where}.flags", flags, args)
    ns.model, ns.model_flag = entry["model"], None
    try:
        engine = engine_from_args(ns)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    bounds = entry.get("autoscale") or {}
    if not isinstance(bounds, dict) or not set(bounds) <= set(AUTOSCALE_ROLES):
        raise ValueError(
            f'{where}.autoscale: wants a mapping of prefill and/or decode -> "MIN:MAX", '
            f"got {bounds!r}"
        )
    sized = argparse.Namespace(**{**vars(args), **sizes})
    for role, text in bounds.items():
        if text is not None and not isinstance(text, str):  # YAML reads 1:4 as base-60 64
            raise ValueError(
                f'{where}.autoscale.{role}: wants "MIN:MAX" in quotes (YAML reads an unquoted '
                f"1:4 as a number), got {text!r}"
            )
        setattr(sized, f"autoscale_{role}", text)
    try:
        autoscale = autoscale_from_args(sized)
    except ValueError as e:
        raise ValueError(f"{where}.autoscale: {e}") from None
    return ModelPools(engine, sizes["prefill"], sizes["decode"], autoscale)


def _engine_args(where: str, flags: dict[str, Any], args: argparse.Namespace) -> argparse.Namespace:
    """The command line's arguments with `flags` (engine flags only) parsed on top."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_engine_flags(parser)
    engine_dests = {a.dest for a in parser._actions}
    parser.set_defaults(
        **{dest: getattr(args, dest) for dest in engine_dests if hasattr(args, dest)}
    )
    argv: list[str] = []
    for name, value in flags.items():
        flag = "--" + str(name).removeprefix("--").replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv.append(f"{flag}={value}")  # one word: a value may begin with "-"
    try:
        ns, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"{where}: {e}") from None
    if rest:
        flag = rest[0].partition("=")[0]
        raise ValueError(f"{where}: {flag!r} is not an engine flag of `kvrelay serve`")
    for name, value in vars(args).items():  # what the engine flags do not cover, as given
        if name not in engine_dests:
            setattr(ns, name, value)
    return ns
