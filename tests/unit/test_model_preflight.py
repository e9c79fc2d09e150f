"""deploy/model_preflight.py: what `kvrelay serve` refuses about a model folder before any
process starts, each in one line naming the folder and the fault (a worker would find it only
after Ray, Redis and the controller started, and print a traceback each of three tries); and
the loader's side of it: a safetensors index names the files, one it lists that is absent is
named. Real folders written with transformers (tiny random checkpoints) and SmolLM2's tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from common.messages import ServedModel
from deploy.cli import main
from deploy.model_preflight import check_checkpoint
from deploy.worker_launch import warmup_request
from engine.config import served_model_id
from engine.model_source import checkpoint_files, model_source
from tests.factories import make_tiny_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A tiny Qwen3 of SmolLM2's vocabulary, with SmolLM2's tokenizer beside it."""
    folder = make_tiny_checkpoint(
        tmp_path_factory.mktemp("m") / "qwen3", architecture="qwen3", vocab_size=49152,
        max_position_embeddings=256,
    )  # fmt: skip
    for name in TOKENIZER_FILES:
        shutil.copy(smollm_dir / name, folder / name)
    return folder


def copy_of(folder: Path, dst: Path, change=None) -> Path:
    shutil.copytree(folder, dst)
    if change is not None:
        config = json.loads((dst / "config.json").read_text())
        change(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_good_folder_passes_and_is_named_by_its_own_name_even_as_dot(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_checkpoint(qwen3, max_model_len=256)
    monkeypatch.chdir(qwen3)
    assert model_source(".") == qwen3.resolve()
    assert served_model_id(".") == served_model_id(f"{qwen3}/") == "qwen3"
    check_checkpoint(model_source("."))


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda c: c.update(architectures=["FalconForCausalLM"]), "unsupported architecture"),
        (lambda c: c.update(final_logit_softcapping=30.0), "final_logit_softcapping"),
        (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (lambda c: c.pop("num_hidden_layers"), "config.json lacks 'num_hidden_layers'"),
        (lambda c: c.update(vocab_size=1000), "tokenizer.json has 49152 tokens but config.json"),
    ],
)
def test_a_config_the_engine_cannot_serve_is_refused_naming_the_field(
    qwen3: Path, tmp_path: Path, change, said: str
) -> None:
    folder = copy_of(qwen3, tmp_path / "bad", change)
    with pytest.raises(ValueError, match=f"model {folder}") as refused:
        check_checkpoint(folder)
    assert said in str(refused.value)


def test_what_the_folder_lacks_is_named(qwen3: Path, tmp_path: Path) -> None:
    no_tokenizer = copy_of(qwen3, tmp_path / "no-tok")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json \(the router tokenizes"):
        check_checkpoint(no_tokenizer)
    bad_json = copy_of(qwen3, tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{'not': json}")
    with pytest.raises(ValueError, match=rf"{bad_json}/config\.json is not valid JSON"):
        check_checkpoint(bad_json)
    spaced = copy_of(qwen3, tmp_path / "my model")
    with pytest.raises(ValueError, match="served under its folder's name, 'my model'"):
        check_checkpoint(spaced)
    for draft in (no_tokenizer, spaced):  # a --draft-model is neither served nor tokenized with
        check_checkpoint(draft, draft=True)
    no_weights = copy_of(qwen3, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        check_checkpoint(no_weights)
    check_checkpoint(no_weights, weights=False)  # --load-format dummy: none needed


def test_a_max_model_len_past_the_models_context_is_refused(qwen3: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--max-model-len 512 is longer than model qwen3's"):
        check_checkpoint(qwen3, max_model_len=512)

    def mistral(config: dict) -> None:  # a whole-model window (Qwen's use_sliding_window off)
        config.pop("use_sliding_window", None)
        config.update(sliding_window=32, model_type="mistral", architectures=["MistralForCausalLM"])

    windowed = copy_of(qwen3, tmp_path / "mistral", mistral)
    with pytest.raises(ValueError, match=r"sliding_window .* is 32"):
        check_checkpoint(windowed, max_model_len=64)


def test_the_safetensors_index_names_the_files(qwen3: Path, tmp_path: Path) -> None:
    """A repo with consolidated.safetensors beside its indexed shards (as Mistral's ship): the
    index's files only; a shard the index lists that is absent is named."""
    folder = copy_of(qwen3, tmp_path / "indexed")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "consolidated.safetensors").write_bytes(b"not read")
    weight_map = {"lm_head.weight": "model-00001-of-00002.safetensors"}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_files(folder) == [folder / "model-00001-of-00002.safetensors"]
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors, listed in"):
        check_checkpoint(folder)


def test_serve_refuses_before_anything_starts_in_one_line(
    qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    async def started(*args, **kwargs) -> int:
        raise AssertionError("the cluster would have started")

    monkeypatch.setattr("deploy.serve._serve", started)
    folder = copy_of(qwen3, tmp_path / "softcap", lambda c: c.update(attn_logit_softcapping=50.0))
    argv = ["serve", "--model", str(folder), "--http-port", "0", "--grpc-port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: model {folder}: ")
    assert "attn_logit_softcapping" in err[0]
    assert os.path.isdir(folder)


@pytest.mark.parametrize(("context", "prompt", "output"), [(4096, 32, 2), (32, 30, 2), (2, 1, 1)])
def test_the_warm_up_request_fits_a_short_context(context: int, prompt: int, output: int) -> None:
    model = ServedModel("m", "/m", max_model_len=context, vocab_size=100, block_size=16)
    request = warmup_request("w", model)
    assert len(request.prompt_token_ids) == prompt
    assert request.sampling.max_tokens == output
    assert prompt + output <= context


def test_a_link_to_a_model_is_served_under_the_links_name(qwen3: Path, tmp_path: Path) -> None:
    """A friendly name linked to a snapshot folder (as HF's cache has them): the link's name."""
    link = tmp_path / "my-qwen"
    link.symlink_to(qwen3)
    assert served_model_id(str(link)) == "my-qwen"
    assert model_source(str(link)).name == "my-qwen"
    check_checkpoint(model_source(str(link)))
