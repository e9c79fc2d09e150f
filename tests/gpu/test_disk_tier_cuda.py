"""The disk tier on a GPU engine (CUDA graphs, async scheduling, the offload and copy-back
streams): blocks spilled from the pinned host tier and from device blocks, loaded back into
device blocks, token for token the same as an engine without tiers; a restart hits them too."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import build_engine
from tests.integration.test_disk_tier import BLOCK, disk_of, prompts, serve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


HEAD_DIM = 64  # one FlashInfer runs (the CPU test's tiny Llama has heads of 16)


def gpu_engine(model, disk=None, host_blocks: int = 2):
    tiers = {}
    if disk is not None:
        tiers = {"disk_kv_cache_bytes": 64 << 20, "disk_kv_path": disk}
    block_bytes = 2 * 2 * 2 * BLOCK * HEAD_DIM * 2  # bfloat16
    return build_engine(
        model_path=str(model),
        device="cuda",
        num_blocks=10,
        host_kv_cache_bytes=host_blocks * block_bytes,
        max_num_seqs=1,
        **tiers,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.factories import make_tiny_checkpoint

    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("disk-cuda") / "tiny-llama", head_dim=HEAD_DIM
    )


@pytest.mark.parametrize("host_blocks", [2, 0])
def test_disk_hits_on_cuda_are_token_exact_and_survive_a_restart(tiny, tmp_path, host_blocks):
    batch = prompts(15)
    want = [tokens for tokens, _ in serve(gpu_engine(tiny), batch)]
    eng = gpu_engine(tiny, tmp_path / "disk", host_blocks)
    assert [tokens for tokens, _ in serve(eng, batch)] == want
    again = serve(eng, batch)
    assert [tokens for tokens, _ in again] == want
    assert all(cached == 8 * BLOCK for _, cached in again[:12]), [c for _, c in again]
    assert disk_of(eng).num_hit_blocks >= 80 and disk_of(eng).num_bad_files == 0
    eng.shutdown()
    restarted = gpu_engine(tiny, tmp_path / "disk", host_blocks)
    got = serve(restarted, batch)
    assert [tokens for tokens, _ in got] == want
    assert all(cached == 8 * BLOCK for _, cached in got), [c for _, c in got]
