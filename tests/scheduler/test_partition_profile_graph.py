"""A profiled chain (measured, or an analytic preset) as a training graph for the partitioners."""

import numpy as np
import pytest

from ooc.apps.partition import load_graph
from ooc.scheduler.partition import Devices, partition
from ooc.scheduler.partition.synthetic import LAUNCH_S, profile_graph
from ooc.scheduler.profile import BlockProfile, OpProfile, Profile

PRESET = "profiles/analytic-h100-sxm-gpt2-xl-s1024.json"


def _block(name, ops):
    return BlockProfile(name=name, forward_s=3e-3, backward_s=9e-3, saved_bytes=400, swappable_bytes=400,
                        input_bytes=100, input_swappable_bytes=100, output_bytes=100, param_bytes=64, grad_bytes=64,
                        ops=ops)


def test_a_block_becomes_its_ops_with_its_forward_and_backward_time():
    ops = (OpProfile("aten.mm", 2e-3, 300, 300), OpProfile("aten.gelu", 1e-3, 100, 100))
    graph = profile_graph(Profile(blocks=(_block("b0", ops), _block("b1", ()))))
    # 2 weights, 3 forward ops, the loss, 3 gradient ops
    assert len(graph.names) == 9
    by_name = dict(zip(graph.names, graph.time_s))
    assert by_name["b0.0.aten.mm"] == 2e-3 and by_name["b0.1.aten.gelu"] == 1e-3 and by_name["b1.0.b1"] == 3e-3
    assert by_name["grad.b0.0.aten.mm"] == pytest.approx(6e-3) and by_name["grad.b0.1.aten.gelu"] == pytest.approx(3e-3)
    assert by_name["grad.b1.0.b1"] == pytest.approx(9e-3)
    held = dict(zip(graph.names, graph.held_bytes))
    assert held["b0.0.aten.mm"] == 300 and held["b1.0.b1"] == 400 and held["w.b0"] == 64


def test_an_analytic_preset_partitions_and_keeps_its_work():
    prof = Profile.load(PRESET)
    graph = load_graph(PRESET)
    assert float(np.sum(graph.time_s)) == pytest.approx(
        sum(b.forward_s + b.backward_s for b in prof.blocks) + LAUNCH_S, rel=1e-9)  # the loss node launches
    capacity = int(np.sum(graph.held_bytes)) // 3  # no device could hold the whole step
    best = partition(graph, Devices.uniform(4, capacity))
    assert best.fits and max(best.simulation.peak_bytes) <= capacity
    assert len(set(best.placement.device.tolist())) > 1
