"""engine/blas_choice.py on the CPU: BlasLinear is an nn.Linear with the same parameters and
results, runs on the library its table names for a row count (and only then, and only inside
choices_in_force); FlashInfer's refusal leaves torch's libraries and is logged once a shape;
torch's setting comes back after (and is left alone when already right; torch's setting faked, as
a CPU build takes only cuBLAS); tune_rows keeps the faster library of each shape's group (timed
with a fake timer: the one module under test), a tie keeping the default; KVRELAY_BLAS_TUNE is
read strictly and is off by default."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import nn

from engine import blas_choice
from engine.blas_choice import (
    BlasLinear,
    Timer,
    blas_summary,
    choices_in_force,
    chosen_libraries,
    layers_by_shape,
    preferred_blas,
    tune_rows,
    tuning_wanted,
)


@pytest.fixture
def tune_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    yield monkeypatch
    monkeypatch.delenv(blas_choice.ENV, raising=False)
    tuning_wanted.cache_clear()


def two_shapes() -> nn.ModuleList:
    """Two (8 -> 16) projections and one (16 -> 8), as a model's layers would be."""
    torch.manual_seed(0)
    return nn.ModuleList([BlasLinear(8, 16, bias=False), BlasLinear(8, 16), BlasLinear(16, 8)])


def test_blas_linear_is_a_linear_with_the_same_state_and_results() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(8, 16)
    chosen = BlasLinear(8, 16)
    assert isinstance(chosen, nn.Linear)
    assert chosen.state_dict().keys() == plain.state_dict().keys()
    chosen.load_state_dict(plain.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(chosen(x), plain(x))


def test_the_library_chosen_for_a_row_count_is_the_one_in_force(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered: list[str] = []

    @contextlib.contextmanager
    def recording(library: str) -> Iterator[None]:
        entered.append(library)
        yield

    monkeypatch.setattr(blas_choice, "preferred_blas", recording)
    layer = BlasLinear(8, 16)
    layer.blas_by_rows[3] = "cublaslt"
    with torch.no_grad():
        x = torch.randn(3, 8)
        with choices_in_force():
            assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
            assert entered == ["cublaslt"]
            layer(torch.randn(5, 8))  # no choice at 5 rows: torch's default, untouched
        assert entered == ["cublaslt"]
        layer(x)  # outside a decode graph's capture: torch's default at any row count
    assert entered == ["cublaslt"]


class FakeBlasSetting:
    """torch's preferred-BLAS getter / setter over a plain value (a CPU build of torch takes only
    cuBLAS), recording each library set."""

    def __init__(self) -> None:
        self.value = torch._C._BlasBackend.Cublas
        self.set: list[str] = []

    def __call__(self, backend: str | torch._C._BlasBackend | None = None) -> torch._C._BlasBackend:
        if backend is not None:
            name = backend if isinstance(backend, str) else backend.name.lower()
            self.set.append(name)
            self.value = torch.backends.cuda._BlasBackends[name]
        return self.value


@pytest.fixture
def blas_setting(monkeypatch: pytest.MonkeyPatch) -> FakeBlasSetting:
    fake = FakeBlasSetting()
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", fake)
    return fake


def test_preferred_blas_switches_inside_and_puts_the_setting_back_on_error(
    blas_setting: FakeBlasSetting,
) -> None:
    with pytest.raises(RuntimeError, match="inside"), preferred_blas("cublaslt"):
        assert blas_choice.library_in_force() == "cublaslt"
        raise RuntimeError("inside")
    assert blas_choice.library_in_force() == "cublas"
    assert blas_setting.set == ["cublaslt", "cublas"]


def test_preferred_blas_leaves_the_library_in_force_untouched(
    blas_setting: FakeBlasSetting,
) -> None:
    with preferred_blas("cublas"):
        assert blas_choice.library_in_force() == "cublas"
    assert blas_setting.set == []


def test_library_in_force_names_torch_setting(blas_setting: FakeBlasSetting) -> None:
    assert blas_choice.library_in_force() == "cublas"
    blas_setting.value = torch._C._BlasBackend.Cublaslt
    assert blas_choice.library_in_force() == "cublaslt"


def fake_timer(num_rows: int, faster: dict[tuple[int, int], str], calls: list[tuple]) -> Timer:
    """Seconds by (shape, library): the library `faster` names for a shape takes 1, the other
    2; a shape it does not name takes 1 on both (a tie)."""

    def timer(layers: Sequence[BlasLinear], x: torch.Tensor, library: str) -> float:
        shape = (layers[0].out_features, layers[0].in_features)
        assert all((layer.out_features, layer.in_features) == shape for layer in layers)
        assert x.shape == (num_rows, shape[1])
        calls.append((shape, library, len(layers)))
        if shape not in faster:
            return 1.0
        return 1.0 if faster[shape] == library else 2.0

    return timer


def test_tune_rows_keeps_the_faster_library_per_shape_and_a_tie_keeps_the_default() -> None:
    """On the CPU the candidates are torch's two libraries (FlashInfer needs bf16 on CUDA)."""
    model = two_shapes()
    calls: list[tuple] = []
    chosen = tune_rows(model, 384, fake_timer(384, {(16, 8): "cublaslt"}, calls))
    assert chosen == {"16x8": "cublaslt", "8x16": "cublas"}
    assert [layer.blas_by_rows for layer in model] == [
        {384: "cublaslt"},
        {384: "cublaslt"},
        {384: "cublas"},
    ]
    assert sorted(calls) == sorted(  # each library once per group, over all of its layers
        [((16, 8), library, 2) for library in blas_choice.TORCH_LIBRARIES]
        + [((8, 16), library, 1) for library in blas_choice.TORCH_LIBRARIES]
    )
    tune_rows(model, 8, fake_timer(8, {(8, 16): "cublaslt", (16, 8): "cublas"}, []))
    assert chosen_libraries(model) == {
        8: {"16x8": "cublas", "8x16": "cublaslt"},
        384: {"16x8": "cublaslt", "8x16": "cublas"},
    }
    assert blas_summary(model) == (
        "cublas 2, cublaslt 2 of 4 (size, shape) pairs; at 384: 16x8 cublaslt, 8x16 cublas"
    )
    assert blas_summary(two_shapes()) == "none tuned"


def test_layers_by_shape_groups_only_blas_linears() -> None:
    model = nn.ModuleList([*two_shapes(), nn.Linear(8, 16)])
    groups = layers_by_shape(model)
    assert {shape: len(layers) for shape, layers in groups.items()} == {(16, 8): 2, (8, 16): 1}


@pytest.mark.parametrize(("raw", "want"), [("0", False), ("1", True), (" 1 ", True)])
def test_tuning_setting(tune_env: pytest.MonkeyPatch, raw: str, want: bool) -> None:
    tune_env.setenv(blas_choice.ENV, raw)
    tuning_wanted.cache_clear()
    assert tuning_wanted() is want


def test_tuning_setting_refuses_other_values(tune_env: pytest.MonkeyPatch) -> None:
    tune_env.setenv(blas_choice.ENV, "yes")
    tuning_wanted.cache_clear()
    with pytest.raises(ValueError, match="KVRELAY_BLAS_TUNE must be 0 or 1"):
        tuning_wanted()


def test_tuning_is_off_by_default(tune_env: pytest.MonkeyPatch) -> None:
    tune_env.delenv(blas_choice.ENV, raising=False)
    tuning_wanted.cache_clear()
    assert tuning_wanted() is False


def test_flashinfer_is_timed_where_its_candidates_say_so() -> None:
    model = two_shapes()
    timer = fake_timer(16, {(16, 8): "flashinfer", (8, 16): "cublaslt"}, [])
    chosen = tune_rows(model, 16, timer, libraries=lambda layers, x: blas_choice.LIBRARIES)
    assert chosen == {"16x8": "flashinfer", "8x16": "cublaslt"}


def test_flashinfer_is_no_candidate_off_cuda_or_with_a_bias() -> None:
    model = two_shapes()
    groups = layers_by_shape(model)
    x = torch.randn(4, 8)
    assert blas_choice.candidates(groups[(16, 8)], x) == blas_choice.TORCH_LIBRARIES
    assert not blas_choice.flashinfer_can_run(model[0])  # on the CPU
    assert not blas_choice.flashinfer_can_run(model[1])  # and a bias


def test_a_flashinfer_choice_runs_through_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, bool]] = []

    def fake_flashinfer(x: torch.Tensor, weight: torch.Tensor, tune: bool = False) -> torch.Tensor:
        calls.append((x.shape[0], tune))
        return x @ weight.t()

    monkeypatch.setattr(blas_choice, "flashinfer_linear", fake_flashinfer)
    layer = BlasLinear(8, 16, bias=False)
    layer.blas_by_rows[4] = "flashinfer"
    with torch.no_grad(), choices_in_force():
        x = torch.randn(4, 8)
        assert torch.equal(layer(x), x @ layer.weight.t())
    assert calls == [(4, False)]


def test_a_flashinfer_refusal_leaves_torch_libraries_and_is_logged_once_per_shape(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refusing(x: torch.Tensor, weight: torch.Tensor, tune: bool = False) -> torch.Tensor:
        raise RuntimeError(f"no algorithm for {x.shape[0]} rows")

    monkeypatch.setattr(blas_choice, "flashinfer_can_run", lambda layer: True)
    monkeypatch.setattr(blas_choice, "flashinfer_linear", refusing)
    monkeypatch.setattr(blas_choice, "_refusals_logged", set())
    layers = [BlasLinear(8, 4, bias=False)]
    with caplog.at_level(logging.WARNING, logger=blas_choice.__name__):
        for num_rows in (4, 16):
            assert blas_choice.candidates(layers, torch.zeros(num_rows, 8)) == (
                blas_choice.TORCH_LIBRARIES
            )
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refusals == [
        "FlashInfer's mm_bf16 refused the 4x8 projections (torch's libraries only): "
        "RuntimeError: no algorithm for 4 rows"
    ]


def test_a_group_tuned_at_a_row_count_is_not_timed_again() -> None:
    model = two_shapes()
    tune_rows(model, 16, fake_timer(16, {(16, 8): "cublaslt"}, []))
    calls: list[tuple] = []
    again = tune_rows(model, 16, fake_timer(16, {(16, 8): "cublas"}, calls))
    assert calls == []
    assert again == {"16x8": "cublaslt", "8x16": "cublas"}


def test_the_setting_says_so_where_no_decode_graph_is_captured(
    tune_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.backend_builder import report_blas_tuning

    tune_env.setenv(blas_choice.ENV, "1")
    tuning_wanted.cache_clear()
    report_blas_tuning(two_shapes(), None)
    assert "KVRELAY_BLAS_TUNE=1 ignored: this engine captures no decode CUDA graphs" in (
        capsys.readouterr().err
    )
    tune_env.setenv(blas_choice.ENV, "0")
    tuning_wanted.cache_clear()
    report_blas_tuning(two_shapes(), None)
    assert capsys.readouterr().err == ""
