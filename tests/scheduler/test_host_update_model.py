"""The performance model of the host optimizer and the data-parallel exchange (NET and HOST ops)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ooc.scheduler.analytic import gpt2_xl
from ooc.scheduler.dataparallel import choose_reduce_on, predict_with_update
from ooc.scheduler.hardware import preset
from ooc.scheduler.plan import Plan
from ooc.scheduler.schedule import HostUpdate, OpKind, Resource, build_schedule
from ooc.scheduler.simulate import simulate

HW = preset("a100-40gb")
PROFILE = gpt2_xl(1024, 1, HW)
KEEP = Plan.uniform("keep", len(PROFILE))


def _busy(update: HostUpdate, hw=HW, plan=KEEP) -> dict[Resource, float]:  # noqa: ANN001
    return simulate(build_schedule(plan, PROFILE, hw, update), hw).busy_s


def test_the_update_adds_one_chain_of_ops_per_bucket() -> None:
    ops = build_schedule(KEEP, PROFILE, HW, HostUpdate(world=4)).ops
    kinds = [op.kind for op in ops]
    buckets = len(PROFILE) + 1  # every block, and the parameters outside the chain
    for kind in (OpKind.GRAD_OUT, OpKind.HOST_EXCHANGE, OpKind.UPDATE, OpKind.PARAM_IN):
        assert kinds.count(kind) == buckets
    assert OpKind.HOST_EXCHANGE not in [op.kind for op in build_schedule(KEEP, PROFILE, HW, HostUpdate()).ops]


def test_host_work_is_the_fp32_bytes_at_the_measured_rate() -> None:
    fp32 = sum(b.param_bytes for b in PROFILE.blocks) * 2 + PROFILE.outside_param_bytes * 2  # bf16 profile
    busy = _busy(HostUpdate(value_bytes=2))
    assert busy[Resource.HOST] == pytest.approx(fp32 / HW.host_optimizer, rel=1e-6)


def test_overlapping_the_backward_hides_most_of_the_host_work() -> None:
    """GPT-2 XL, micro-batch 16 on an A100: the backward is long enough to hide each block's
    gradient copy, update and weight copy behind the blocks before it; only the last buckets'
    work (block 0, the embeddings) stays exposed."""
    profile = gpt2_xl(1024, 16, HW)
    update = HostUpdate(value_bytes=2)
    alone = predict_with_update(KEEP, profile, HW, None)
    overlapped = predict_with_update(KEEP, profile, HW, update)
    serial = predict_with_update(KEEP, profile, HW, replace(update, overlap=False))
    assert alone < overlapped < serial
    assert (serial - overlapped) / (serial - alone) > 0.8  # 0.85 by the model


def test_sharding_divides_host_work_by_the_world_size() -> None:
    whole = _busy(HostUpdate(world=4))[Resource.HOST]
    sharded = _busy(HostUpdate(world=4, shard=True))[Resource.HOST]
    assert sharded == pytest.approx(whole / 4, rel=1e-3)


def test_host_contention_slows_compute_on_the_cpu_backend() -> None:
    shared = replace(HW, host_contention=1.0, host_optimizer=HW.host_optimizer / 20)
    apart = replace(shared, host_contention=0.0)
    assert predict_with_update(KEEP, PROFILE, shared, HostUpdate()) > predict_with_update(KEEP, PROFILE, apart, HostUpdate())


def test_new_weights_do_not_wait_behind_swap_ins() -> None:
    """PARAM_IN is issued by the update thread when its update ends; a copy back queued earlier on
    the H2D engine that cannot start yet must not hold it."""
    swap = Plan.uniform("swap", len(PROFILE))
    result = simulate(build_schedule(swap, PROFILE, HW, HostUpdate()), HW)
    ops = build_schedule(swap, PROFILE, HW, HostUpdate()).ops
    first_param_in = min(iv.start for iv in result.timeline if ops[iv.op].kind is OpKind.PARAM_IN)
    last_swap_in = max(iv.start for iv in result.timeline if ops[iv.op].kind is OpKind.SWAP_IN)
    assert first_param_in < last_swap_in


def test_the_model_chooses_where_to_sum() -> None:
    """NCCL between GPUs is faster than gloo between hosts: sum on the device. Give the hosts the
    faster network and the model moves the sum there."""
    where, seconds = choose_reduce_on(KEEP, PROFILE, HW, world=8)
    assert where == "device" and seconds["device"] < seconds["host"]
    fast_hosts = replace(HW, net=HW.net / 100, host_net=HW.net)
    where, seconds = choose_reduce_on(KEEP, PROFILE, fast_hosts, world=8)
    assert where == "host" and seconds["host"] < seconds["device"]


def test_a_weight_several_blocks_hold_is_updated_once() -> None:
    """A weight every block holds (ALBERT's shared layer) is one parameter of the optimizer: updated,
    and its gradient copied out and its weight in, once, with the first block that holds it (its
    bucket: ``ooc.optim.buckets``). The model counted it in every holder's bucket."""
    import dataclasses

    from ooc.scheduler.profile import SharedParameter

    shared = 64 * 2**20
    tied = dataclasses.replace(PROFILE, blocks=tuple(
        dataclasses.replace(b, param_bytes=b.param_bytes + shared, grad_bytes=b.grad_bytes + shared,
                            shared_params=(SharedParameter(0, shared),))
        for b in PROFILE.blocks))
    update = HostUpdate(value_bytes=2)
    ops = build_schedule(KEEP, tied, HW, update).ops
    untied = build_schedule(KEEP, PROFILE, HW, update).ops
    fp32_shared = shared * 2
    for kind, extra in ((OpKind.UPDATE, fp32_shared), (OpKind.GRAD_OUT, shared), (OpKind.PARAM_IN, shared)):
        field = "update_bytes" if kind is OpKind.UPDATE else "bytes_moved"
        by_block = {op.block: getattr(op, field) for op in ops if op.kind is kind}
        alone = {op.block: getattr(op, field) for op in untied if op.kind is kind}
        assert by_block == {b: alone[b] + (extra if b == 0 else 0) for b in alone}
