"""Two ranks, sharded or not, equal one process under HostAdamW's options (tests/ooc/dp_runs.py):
clipping, bf16 parameters, summing on the device, delayed updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ooc.dp_runs import assert_variant_equals_one_process, variant_runs, weights_of

pytestmark = pytest.mark.slow

NAMES = ["clip", "bf16", "device-sum", "delayed"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dp-variants")
    variant_runs(root, NAMES)
    return root


@pytest.mark.parametrize("variant", NAMES)
def test_options_keep_two_ranks_sharded_or_not_equal_to_one_process(runs: Path, variant: str) -> None:
    """Clipping (the sharded norm is summed across owners), bf16 parameters (fp32 masters, staging
    buffers, broadcasts in bf16), summing before the host copy, one-step-delayed updates."""
    assert_variant_equals_one_process(runs, variant)


def test_delayed_update_versions_export_the_newest_weights_alike(runs: Path) -> None:
    """``delayed_update``: a version's model file holds the parameters one update behind the masters
    (a resume needs them so); ``export()`` writes the masters, assembled from every rank's share when
    sharded, and gives two ranks, sharded or not, the weights of one process (NOTE [a delayed
    version's newest weights] in ooc.checkpoint)."""
    from dataclasses import replace

    import safetensors.torch

    from ooc.apps.demo import CharData, load_text
    from ooc.checkpoint import Checkpointer
    from ooc.models.gpt import GPT, GPT_PRESETS

    model = GPT(replace(GPT_PRESETS["nano"], vocab_size=len(CharData.from_text(load_text()).chars)))
    exported = {name: safetensors.torch.load_file(Checkpointer(runs / name, model).export(None, runs / f"{name}-export/"))
                for name in ("delayed-one", "delayed", "delayed-sharded")}
    saved = weights_of(runs / "delayed-one")
    one = exported["delayed-one"]
    assert one.keys() == saved.keys()
    assert all(not torch.equal(one[k], saved[k]) for k in saved)  # every weight took the last update
    for name in ("delayed", "delayed-sharded"):
        assert all(torch.equal(exported[name][k], one[k]) for k in one), name
