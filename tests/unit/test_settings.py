"""engine/settings.py: every KVRELAY_* variable parsed one way, a bad value refused naming the
variable and what it accepts, an unknown KVRELAY_* variable (a removed experiment's switch)
refused listing the known ones; EngineConfig reads the environment once, where it is built,
and carries its settings through replace() and pickling (as Ray sends it to a worker), so an
engine built from it never reads the environment again; the settings reach where they are used
(FP8 accumulation, the CPU kernel, the state folder)."""

from __future__ import annotations

import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from deploy import cluster_address
from engine.config import EngineConfig, ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.quant.config import resolve_quantization
from engine.quant.fp8 import Fp8Linear
from engine.settings import KNOWN, Settings, SettingsError
from tests.factories import make_model_config

STALE = "KVRELAY_FP8_SPLIT_K"  # a deleted experiment's switch (docs/gpu.md's example)
ADOPTED = "KVRELAY_MIXED_GRAPHS"  # an experiment that won: the default now, with no switch
UNKNOWN = (STALE, ADOPTED, "KVRELAY_NOT_A_SETTING")


@pytest.fixture
def no_kvrelay_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The test's own environment: no KVRELAY_* variable from the machine's."""
    for name in [k for k in os.environ if k.startswith("KVRELAY_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_the_defaults() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.fp8_fast_accum is True and settings.cpu_kernel is True
    assert settings.cache_dir == Path.home() / ".cache" / "kvrelay"
    assert settings.state_dir == Path(f"/tmp/kvrelay-{os.getuid()}")
    assert KNOWN == (
        "KVRELAY_FP8_FAST_ACCUM",
        "KVRELAY_CPU_KERNEL",
        "KVRELAY_CACHE_DIR",
        "KVRELAY_STATE_DIR",
    )


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("KVRELAY_FP8_FAST_ACCUM", "fp8_fast_accum"),
        ("KVRELAY_CPU_KERNEL", "cpu_kernel"),
    ],
)
def test_on_off_settings(name: str, field: str) -> None:
    assert getattr(Settings.from_env({name: "0"}), field) is False
    assert getattr(Settings.from_env({name: " 1 "}), field) is True


@pytest.mark.parametrize(
    ("name", "field"),
    [("KVRELAY_CACHE_DIR", "cache_dir"), ("KVRELAY_STATE_DIR", "state_dir")],
)
def test_folder_settings(name: str, field: str, tmp_path: Path) -> None:
    assert getattr(Settings.from_env({name: str(tmp_path)}), field) == tmp_path
    assert getattr(Settings.from_env({name: "~/kv"}), field) == Path.home() / "kv"


@pytest.mark.parametrize(
    ("name", "raw", "accepted"),
    [
        ("KVRELAY_FP8_FAST_ACCUM", "yes", "must be 0 or 1"),
        ("KVRELAY_FP8_FAST_ACCUM", "", "must be 0 or 1"),
        ("KVRELAY_CPU_KERNEL", "2", "must be 0 or 1"),
        ("KVRELAY_CPU_KERNEL", "off", "must be 0 or 1"),
        ("KVRELAY_CACHE_DIR", "", "must be a folder path"),
        ("KVRELAY_STATE_DIR", "  ", "must be a folder path"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name: str, raw: str, accepted: str) -> None:
    with pytest.raises(SettingsError, match=f"{name} {accepted}, got {raw!r}"):
        Settings.from_env({name: raw})
    assert issubclass(SettingsError, ValueError)


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_kvrelay_variable_is_refused_listing_the_known_ones(name: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env({name: "1", "KVRELAY_CPU_KERNEL": "1"})
    message = str(refused.value)
    assert f"unknown kvrelay setting {name};" in message
    assert all(known in message for known in KNOWN)


def test_every_unknown_variable_is_named_and_others_are_left_alone() -> None:
    with pytest.raises(SettingsError, match="settings KVRELAY_A, KVRELAY_B;"):
        Settings.from_env({"KVRELAY_B": "1", "KVRELAY_A": "1"})
    other = {"UCX_TLS": "tcp", "HOME": "/nowhere", "RAY_ADDRESS": "x", "kvrelay_cpu_kernel": "?"}
    assert Settings.from_env(other) == Settings()


def test_describe_is_one_line_of_every_variable() -> None:
    line = Settings(fp8_fast_accum=False, cache_dir=Path("/c")).describe()
    assert "\n" not in line
    assert line.startswith("settings: KVRELAY_FP8_FAST_ACCUM=0 KVRELAY_CPU_KERNEL=1")
    assert "KVRELAY_CACHE_DIR=/c" in line
    assert all(name in line for name in KNOWN)


def test_from_env_reads_the_process_environment(no_kvrelay_env: pytest.MonkeyPatch) -> None:
    no_kvrelay_env.setenv("KVRELAY_FP8_FAST_ACCUM", "0")
    assert Settings.from_env().fp8_fast_accum is False
    no_kvrelay_env.setenv(STALE, "1")
    with pytest.raises(SettingsError, match=STALE):
        Settings.from_env()


def test_engine_config_reads_the_environment_once_and_carries_it(
    no_kvrelay_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_kvrelay_env.setenv("KVRELAY_CPU_KERNEL", "0")
    no_kvrelay_env.setenv("KVRELAY_STATE_DIR", str(tmp_path))
    config = EngineConfig()
    want = Settings(cpu_kernel=False, state_dir=tmp_path)
    assert config.settings == want
    # A worker's own environment, even a stale one, is not read again: the driver's settings
    # travel with the config (Ray pickles it) and through replace().
    no_kvrelay_env.delenv("KVRELAY_CPU_KERNEL")
    no_kvrelay_env.setenv(STALE, "1")
    sent = pickle.loads(pickle.dumps(config))
    assert sent.settings == want
    assert replace(sent, seed=3).settings == want
    with pytest.raises(SettingsError, match=STALE):
        EngineConfig()  # a config built here would read it, and refuse it


def test_an_engine_reads_no_environment_of_its_own(
    no_kvrelay_env: pytest.MonkeyPatch, make_engine
) -> None:
    """An engine built from a config (as a Ray worker is) uses the config's settings: a stale
    KVRELAY_* variable in its process's environment is not read, so not refused there."""
    config_settings = Settings(cpu_kernel=False)
    no_kvrelay_env.setenv(STALE, "1")
    engine = make_engine(settings=config_settings)
    assert engine.config.settings == config_settings
    assert engine.runner.attention.decode_kernel == "torch"


@pytest.mark.parametrize("fast", [True, False])
def test_fp8_layers_accumulate_as_the_settings_say(fast: bool) -> None:
    config: ModelConfig = make_model_config(hidden_size=32, intermediate_size=48, head_dim=8)
    model = LlamaForCausalLM(config, 128, resolve_quantization("fp8", None, fast))
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * config.num_layers
    assert all(layer.fast_accum is fast for layer in layers)


def test_the_state_folder_follows_the_settings(
    no_kvrelay_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_kvrelay_env.setenv("KVRELAY_STATE_DIR", str(tmp_path))
    assert cluster_address.state_dir() == tmp_path
    assert cluster_address.state_file("alpha") == tmp_path / "serve-alpha.json"
    no_kvrelay_env.setenv(STALE, "1")
    with pytest.raises(SettingsError, match=STALE):
        cluster_address.state_dir()
