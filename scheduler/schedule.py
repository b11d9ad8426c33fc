"""The schedule of one training step: ordered ops on resources, with device-memory effects.

The simulator predicts time and memory from it; the runtime asks it what to release after each
block's forward and what to copy back before each block's backward, so a prediction and a run
follow the same ops.

NOTE [memory in program order]
Ops are listed in the order the host issues them. Device memory changes only at well-defined points
of that order: an op allocates ``alloc_bytes`` when issued and frees ``free_bytes`` when the next op
is issued. The runtime frees swapped-out activations only at ``RELEASE`` ops (after waiting for their
copy), allocates copy-back buffers when a ``SWAP_IN`` is issued, and autograd frees a block's saved
tensors inside that block's backward. So the peak is a function of the plan and the profile alone,
independent of how fast copies run, and the measured peak can be held equal to the prediction.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from ooc.scheduler.hardware import Hardware
from ooc.scheduler.oplevel import rerun_saved_s
from ooc.scheduler.plan import Codec, Plan, PlanError, Policy
from ooc.scheduler.profile import BlockProfile, Profile
from ooc.scheduler.sharing import SharedAdjustment, shared_adjustments


class Resource(str, enum.Enum):
    COMPUTE = "compute"
    D2H = "d2h"
    H2D = "h2d"
    NET = "net"
    HOST = "host"


class OpKind(str, enum.Enum):
    FORWARD = "forward"
    STREAM_IN = "stream_in"
    DECODE = "decode"
    SWAP_OUT = "swap_out"
    RELEASE = "release"
    OUTSIDE = "outside"
    SWAP_IN = "swap_in"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    GRAD_OUT = "grad_out"
    EXCHANGE = "exchange"
    HOST_EXCHANGE = "host_exchange"
    UPDATE = "update"
    SHARE = "share"
    PARAM_IN = "param_in"


@dataclass(frozen=True)
class Op:
    index: int
    kind: OpKind
    block: int | None
    resource: Resource
    deps: tuple[int, ...] = ()
    alloc_bytes: int = 0
    free_bytes: int = 0
    transient_bytes: int = 0
    """Held only while the op runs, on top of its allocation (decoding: one storage's codes)."""
    bytes_moved: int = 0
    copies: int = 0
    """Copies a copy op stands for; on a compute op, copies it issues and waits for."""
    duration_s: float = 0.0
    param_alloc: int = 0
    """Streamed parameter bytes brought to the device by this op (a STREAM_IN)."""
    param_free: int = 0
    """Streamed parameter bytes freed when the next op is issued (the block's forward or backward)."""
    floating: bool = False
    """Issued by a host thread when its dependencies end, not in list order: it may pass earlier
    ops queued on its resource (the host optimizer's copies of new weights)."""
    update_bytes: int = 0
    """fp32 parameter bytes an UPDATE op steps."""

    @property
    def label(self) -> str:
        return self.kind.value if self.block is None else f"{self.kind.value}/{self.block}"


@dataclass(frozen=True)
class BlockBytes:
    """What a policy keeps of one block, derived from its profile."""

    forward_alloc: int
    """Allocated during the block's forward."""
    swapped: int
    """Moved to the host (freed at RELEASE, allocated again at SWAP_IN)."""
    recompute_alloc: int
    """Allocated by the recomputation inside the block's backward."""
    copies: int = 0
    """Storages moved each way."""
    decoded: int = 0
    """Growth when compressed storages are decoded as the block's backward starts (full - codes)."""
    decode_transient: int = 0
    """The largest storage's codes, alive while its full-size output is written (decoded last)."""
    shared_swapped: int = 0
    """Swapped bytes an earlier block holds on the device (NOTE [storages shared between blocks]):
    not in ``forward_alloc``, not freed at the release."""

    @property
    def released(self) -> int:
        """Freed at the block's RELEASE."""
        return self.swapped - self.shared_swapped

    @property
    def resident_at_backward(self) -> int:
        """Freed by the block's backward."""
        return self.forward_alloc + self.shared_swapped + self.recompute_alloc + self.decoded


def cached_ops_cost(plan_block, profile_block: BlockProfile) -> tuple[int, int, float]:
    """A selective RECOMPUTE's cached ops (NOTE [op-level profile] in ``ooc.scheduler.profile``):
    the bytes their outputs hold from the forward to the backward, the part of those autograd
    saves (the re-run need not allocate it again), and the forward seconds the re-run skips (the
    cached ops and those it leaves out, NOTE [ops a re-run skips] in ``ooc.scheduler.oplevel``)."""
    ops = profile_block.ops
    for k in plan_block.cached_ops:
        if k >= len(ops):
            raise PlanError(f"block {profile_block.name!r}: cached op {k} is not among its {len(ops)} profiled ops; "
                            "make the plan from this profile (ooc plan) or profile the model at op level again")
        if not ops[k].cacheable:
            raise PlanError(f"block {profile_block.name!r}: op {k} ({ops[k].name}) cannot be cached (random or in place); "
                            "make the plan from this profile (ooc plan)")
    chosen = [ops[k] for k in plan_block.cached_ops]
    return (sum(op.output_bytes for op in chosen), sum(op.saved_bytes for op in chosen),
            rerun_saved_s(ops, plan_block.cached_ops))


def selective_rerun_s(plan_block, profile_block: BlockProfile, hw: Hardware | None) -> float:
    """Seconds a RECOMPUTE block's re-run takes: its forward again up to the block's last saved
    tensor (NOTE [a re-run stops at the last save] in ``ooc.scheduler.profile``), less what a
    selective one skips (a cache lookup is free; NOTE [ops a re-run skips] in
    ``ooc.scheduler.oplevel``), plus what recording and replaying its ops costs a selective one
    (``Hardware.intercept_s``, counted here: the forward and the re-run are one block's, and the
    cost model adds its time the same way)."""
    replayed_s = profile_block.replayed_s
    if not plan_block.cached_ops:
        return replayed_s
    rerun_s = max(0.0, replayed_s - cached_ops_cost(plan_block, profile_block)[2])
    if hw is None:
        return rerun_s
    return rerun_s + hw.intercept_s(len(profile_block.ops), profile_block.forward_s + rerun_s)


def swapped_ops_bytes(plan_block, profile_block: BlockProfile) -> tuple[int, int]:
    """The bytes and storages a selective RECOMPUTE's swapped cached outputs move each way.

    NOTE [swapped cached ops]
    ``BlockPlan.swapped_ops`` (a subset of ``cached_ops``) are cached outputs that do not stay on
    the device: the block's forward allocates them as it would keep them (``forward_alloc``); the
    block's pack hook copies each of their storages to the host whatever its size
    (``min_swap_bytes`` does not apply: the plan chose these tensors one by one) and
    uncompressed; the RELEASE after the next block's forward frees them with the block's other
    swapped bytes (its input, with ``swap_input``), and the SWAP_IN before the block's backward
    allocates them again, so the re-run takes them from the cache as if they had been kept. One
    storage per op is moved (an op whose outputs make several storages counts one copy per op: the
    copy count only prices issue overhead). The same walk with the same bytes as a swapped input,
    so the schedule needs no new op kind."""
    chosen = [profile_block.ops[k] for k in plan_block.swapped_ops if k < len(profile_block.ops)]
    return sum(op.output_bytes for op in chosen), sum(1 for op in chosen if op.output_bytes)


def block_bytes(plan_block, profile_block: BlockProfile | None, shared: SharedAdjustment = SharedAdjustment()) -> BlockBytes:
    """What ``plan_block`` holds of a block, less what an earlier block already counts (``shared``)."""
    full = _block_bytes(plan_block, profile_block)
    if shared == SharedAdjustment():
        return full
    return replace(full, forward_alloc=full.forward_alloc - shared.kept - shared.swapped, shared_swapped=shared.swapped)


def _block_bytes(plan_block, profile_block: BlockProfile | None) -> BlockBytes:
    """A selective RECOMPUTE (``cached_ops``) holds its cached outputs besides what RECOMPUTE
    holds, and its re-run allocates the saved bytes less the cached outputs autograd saves: at the
    block's backward it holds the input, the saved bytes and the cached outputs autograd does not
    save (NOTE [op-level options] in ``ooc.scheduler.oplevel``)."""
    if profile_block is None:
        return BlockBytes(0, 0, 0)
    p = profile_block
    cached, cached_saved = 0, 0
    if plan_block.cached_ops:
        cached, cached_saved, _ = cached_ops_cost(plan_block, p)
    if plan_block.policy is Policy.KEEP:
        return BlockBytes(p.saved_bytes, 0, 0)
    if plan_block.policy is Policy.SWAP:
        held, moved, full, copies, recompute = p.saved_bytes, p.swappable_bytes, p.swappable_bytes, p.swappable_storages, 0
        inputs = False
    elif plan_block.swap_input or plan_block.swapped_ops:
        swapped, swapped_storages = swapped_ops_bytes(plan_block, p)  # NOTE [swapped cached ops]
        held, recompute, inputs = p.input_bytes + cached, p.saved_bytes - cached_saved, True
        moved = full = swapped + (p.input_swappable_bytes if plan_block.swap_input else 0)
        copies = swapped_storages + (p.input_swappable_storages if plan_block.swap_input else 0)
    else:
        return BlockBytes(p.input_bytes + cached, 0, p.saved_bytes - cached_saved)
    transient = 0
    if plan_block.codec is not Codec.NONE:
        # Only the codes stay on the device after the pack; they are decoded back to full size
        # when the block's backward starts (NOTE [compressed swap] in ooc.saved).
        moved, transient = p.compressed_bytes(plan_block.codec.value, inputs=inputs)
    return BlockBytes(held - full + moved, moved, recompute, copies, full - moved, transient)


@dataclass(frozen=True)
class HostUpdate:
    """The host optimizer's share of a step (``ooc.optim.HostAdamW``), for the simulator.

    Per bucket (each block, then the parameters outside the chain): gradients out (D2H), summed
    across ``world`` ranks (NET; before the copy with ``reduce_on="device"``), the AdamW update
    (HOST), with ``shard`` each rank's new weights broadcast (NET), and the new weights in (H2D).
    ``overlap``: buckets start as their backward ends (``HostAdamW(model=...)``); else all after it.
    ``copies``: gradients and weights cross a host link (not on the plain CPU backend in fp32).
    ``value_bytes``: bytes per parameter value on the device. These ops change no device memory.
    """

    world: int = 1
    reduce_on: str = "host"
    shard: bool = False
    overlap: bool = True
    copies: bool = True
    value_bytes: int = 4
    """Bytes per parameter value on the device (4 fp32, 2 bf16/fp16); the update steps fp32 masters."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if self.reduce_on not in ("device", "host"):
            raise ValueError(f"reduce_on must be 'device' or 'host', got {self.reduce_on!r}")


@dataclass(frozen=True)
class Schedule:
    ops: tuple[Op, ...]
    plan: Plan
    releases_after_forward: tuple[tuple[int, ...], ...]
    """``[i]``: blocks whose swapped tensors are released when block ``i``'s forward ends."""
    releases_before_backward: tuple[int, ...]
    """Blocks released when the backward starts (the last swapped block)."""
    swap_ins_before_backward: tuple[tuple[int, ...], ...]
    """``[b]``: blocks whose swapped tensors are copied back when block ``b``'s backward starts."""
    stream_ins_before_forward: tuple[tuple[int, ...], ...] = ()
    """``[i]``: streamed blocks whose parameters are copied in when block ``i``'s forward starts
    (``i`` itself, and ``i+1`` ahead of time)."""
    stream_ins_before_backward: tuple[tuple[int, ...], ...] = ()
    """``[b]``: the same when block ``b``'s backward starts (``b``, and ``b-1`` ahead of time)."""
    _memory: tuple[int, ...] = field(default=(), compare=False, repr=False)
    _param_memory: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def memory_after_op(self) -> tuple[int, ...]:
        """Device bytes held while each op runs (after its allocation, before its free)."""
        return self._memory

    @property
    def peak_bytes(self) -> int:
        return max(self._memory, default=0)

    @property
    def param_memory_after_op(self) -> tuple[int, ...]:
        """Device-resident parameter bytes while each op runs: resident parameters plus the streamed
        blocks present (needs a profile)."""
        return self._param_memory

    @property
    def param_peak_bytes(self) -> int:
        return max(self._param_memory, default=0)


def build_schedule(plan: Plan, profile: Profile | None = None, hardware: Hardware | None = None,
                   update: HostUpdate | None = None) -> Schedule:
    """The ops of one step of ``plan``; byte counts need ``profile``, durations also ``hardware``;
    ``update`` adds the host optimizer's work."""
    n = len(plan)
    if profile is not None and len(profile) != n:
        raise PlanError(f"the plan has {n} blocks, the profile {len(profile)}; they must describe one model")
    prof = list(profile.blocks) if profile is not None else [None] * n
    updated = _bytes_updated(prof) if update is not None and profile is not None else []
    shared = shared_adjustments(plan, profile) if profile is not None else [SharedAdjustment()] * n
    per_block = [block_bytes(plan.blocks[i], prof[i], shared[i]) for i in range(n)]
    swaps = [plan.blocks[i].swaps_anything for i in range(n)]

    ops: list[Op] = []
    last_compute: list[int] = []

    def add(kind: OpKind, block: int | None, resource: Resource, deps: tuple[int, ...] = (), **kw) -> int:
        if resource is Resource.COMPUTE and last_compute:
            deps = (last_compute[-1], *deps)
        op = Op(index=len(ops), kind=kind, block=block, resource=resource, deps=deps, **kw)
        if hardware is not None and prof[0] is not None:
            op = _with_duration(op, prof, profile, hardware, plan)
        ops.append(op)
        if resource is Resource.COMPUTE:
            last_compute.append(op.index)
        return op.index

    streamed = [plan.blocks[i].streamed for i in range(n)]
    params = [p.streamed_param_bytes if p is not None else 0 for p in prof]  # what streaming a block moves

    def stream_in(blocks: tuple[int, ...], issued: dict[int, int]) -> tuple[int, ...]:
        """Copy in the parameters of the streamed ``blocks`` not yet issued in this pass."""
        out = []
        for j in blocks:
            if 0 <= j < n and streamed[j] and j not in issued:
                deps = (last_compute[-1],) if last_compute else ()
                issued[j] = add(OpKind.STREAM_IN, j, Resource.H2D, deps, param_alloc=params[j], bytes_moved=params[j])
                out.append(j)
        return tuple(out)

    swap_out: dict[int, int] = {}
    releases_after: list[tuple[int, ...]] = []
    streamed_fwd: dict[int, int] = {}
    stream_ins_fwd: list[tuple[int, ...]] = []
    for i in range(n):
        stream_ins_fwd.append(stream_in((i, i + 1), streamed_fwd))
        add(OpKind.FORWARD, i, Resource.COMPUTE, (streamed_fwd[i],) if streamed[i] else (),
            alloc_bytes=per_block[i].forward_alloc, copies=per_block[i].copies if swaps[i] else 0,
            param_free=params[i] if streamed[i] else 0)
        if swaps[i]:
            swap_out[i] = add(OpKind.SWAP_OUT, i, Resource.D2H, (last_compute[-1],), bytes_moved=per_block[i].swapped,
                              copies=per_block[i].copies)
        if i > 0 and swaps[i - 1]:
            # The forward of block i overlaps block i-1's copy out; the copy must end before block
            # i+1 starts, which bounds the bytes in flight to two blocks' worth.
            add(OpKind.RELEASE, i - 1, Resource.COMPUTE, (swap_out[i - 1],), free_bytes=per_block[i - 1].released)
            releases_after.append((i - 1,))
        else:
            releases_after.append(())
    add(OpKind.OUTSIDE, None, Resource.COMPUTE)

    releases_before: tuple[int, ...] = ()
    if swaps[n - 1]:
        add(OpKind.RELEASE, n - 1, Resource.COMPUTE, (swap_out[n - 1],), free_bytes=per_block[n - 1].released)
        releases_before = (n - 1,)

    swap_in: dict[int, int] = {}
    swap_ins_before: list[tuple[int, ...]] = [()] * n
    streamed_bwd: dict[int, int] = {}
    stream_ins_bwd: list[tuple[int, ...]] = [()] * n
    for b in range(n - 1, -1, -1):
        stream_ins_bwd[b] = stream_in((b, b - 1), streamed_bwd)
        issued = []
        for j in range(b, max(b - plan.prefetch, 0) - 1, -1):
            if swaps[j] and j not in swap_in:
                # Issued by the host when block b's backward starts, after the copy out finished.
                deps = (swap_out[j],) + ((last_compute[-1],) if last_compute else ())
                swap_in[j] = add(OpKind.SWAP_IN, j, Resource.H2D, deps, alloc_bytes=per_block[j].swapped,
                                 bytes_moved=per_block[j].swapped, copies=per_block[j].copies)
                issued.append(j)
        swap_ins_before[b] = tuple(issued)
        wait = ((swap_in[b],) if b in swap_in else ()) + ((streamed_bwd[b],) if streamed[b] else ())
        issued_copies = sum(per_block[j].copies for j in issued)
        if plan.blocks[b].codec is not Codec.NONE:
            add(OpKind.DECODE, b, Resource.COMPUTE, wait, alloc_bytes=per_block[b].decoded,
                transient_bytes=per_block[b].decode_transient, copies=issued_copies)
            wait, issued_copies = (), 0
        if plan.blocks[b].policy is Policy.RECOMPUTE:
            add(OpKind.RECOMPUTE, b, Resource.COMPUTE, wait, alloc_bytes=per_block[b].recompute_alloc, copies=issued_copies)
            wait, issued_copies = (), 0
        add(OpKind.BACKWARD, b, Resource.COMPUTE, wait, free_bytes=per_block[b].resident_at_backward, copies=issued_copies,
            param_free=params[b] if streamed[b] else 0)
        if update is not None and update.overlap and profile is not None:
            _host_update_ops(add, update, last_compute[-1], b, *updated[b])
    if update is not None and profile is not None:
        after = last_compute[-1]
        if not update.overlap:
            for b in range(n - 1, -1, -1):
                _host_update_ops(add, update, after, b, *updated[b])
        if profile.outside_param_bytes:
            _host_update_ops(add, update, after, None, profile.outside_param_bytes, profile.outside_param_bytes)

    memory, param_memory = [], []
    current = 0
    resident_params = sum(p for p, s in zip(params, streamed) if not s)
    if profile is not None:
        resident_params += profile.shared_param_bytes + profile.outside_param_bytes
    for op in ops:
        current += op.alloc_bytes
        memory.append(current + op.transient_bytes)
        current -= op.free_bytes
        resident_params += op.param_alloc
        param_memory.append(resident_params)
        resident_params -= op.param_free
    return Schedule(
        ops=tuple(ops),
        plan=plan,
        releases_after_forward=tuple(releases_after),
        releases_before_backward=releases_before,
        swap_ins_before_backward=tuple(swap_ins_before),
        stream_ins_before_forward=tuple(stream_ins_fwd),
        stream_ins_before_backward=tuple(stream_ins_bwd),
        _memory=tuple(memory),
        _param_memory=tuple(param_memory) if profile is not None else (),
    )


def _bytes_updated(blocks) -> list[tuple[int, int]]:  # noqa: ANN001
    """Per block, the parameter and gradient bytes its bucket's update moves. A parameter several
    blocks hold is one parameter of the optimizer, in the bucket of the first block that holds it
    (``ooc.optim.buckets``): the others leave it out (its gradient counts once too, where the holders
    agree it has one)."""
    seen: set[int] = set()
    out = []
    for b in blocks:
        counted = sum(p.nbytes for p in b.shared_params if p.id in seen)
        seen.update(p.id for p in b.shared_params)
        out.append((b.param_bytes - counted, max(0, b.grad_bytes - counted)))
    return out


def _host_update_ops(add, update: HostUpdate, after: int, block: int | None, param_bytes: int, grad_bytes: int) -> None:  # noqa: ANN001
    """One bucket's gradients out, exchange, update and weights in (see :class:`HostUpdate`)."""
    w = update.world
    share = 1 / w if update.shard else 1.0
    ring = 2 * (w - 1) / w  # bytes each rank sends per byte all-reduced (a ring)
    exchange_bytes = int(grad_bytes * (ring if not update.shard else (w - 1) / w))
    last = after
    if w > 1 and update.reduce_on == "device":
        last = add(OpKind.EXCHANGE, block, Resource.NET, (last,), bytes_moved=exchange_bytes)
    if update.copies:
        last = add(OpKind.GRAD_OUT, block, Resource.D2H, (last,), bytes_moved=grad_bytes)
    if w > 1 and update.reduce_on == "host":
        last = add(OpKind.HOST_EXCHANGE, block, Resource.NET, (last,), bytes_moved=exchange_bytes)
    fp32_bytes = int(param_bytes * 4 / update.value_bytes * share)
    last = add(OpKind.UPDATE, block, Resource.HOST, (last,), update_bytes=fp32_bytes)
    if update.shard and w > 1:
        # The update thread broadcasts over the exchange's kind of group: gloo for "host".
        kind = OpKind.SHARE if update.reduce_on == "device" else OpKind.HOST_EXCHANGE
        last = add(kind, block, Resource.NET, (last,), bytes_moved=int(param_bytes * (w - 1) / w))
    if update.copies:
        add(OpKind.PARAM_IN, block, Resource.H2D, (last,), bytes_moved=param_bytes, floating=True)


def _with_duration(op: Op, prof: list, profile: Profile, hw: Hardware, plan: Plan) -> Op:
    if op.kind is OpKind.FORWARD:
        duration = prof[op.block].forward_s + op.copies * hw.copy_issue_s
    elif op.kind is OpKind.RECOMPUTE:
        duration = selective_rerun_s(plan.blocks[op.block], prof[op.block], hw) + op.copies * hw.copy_issue_s
    elif op.kind is OpKind.DECODE:
        # dequantization reads the codes and writes the full tensor
        duration = op.copies * hw.copy_issue_s + 2 * (op.alloc_bytes + op.transient_bytes) / hw.d2d
    elif op.kind is OpKind.BACKWARD:
        duration = prof[op.block].backward_s + op.copies * hw.copy_issue_s
    elif op.kind is OpKind.OUTSIDE:
        duration = profile.outside_forward_s + profile.outside_backward_s
    elif op.kind in (OpKind.EXCHANGE, OpKind.SHARE, OpKind.HOST_EXCHANGE):
        bandwidth = hw.host_net if op.kind is OpKind.HOST_EXCHANGE and hw.host_net > 0 else hw.net
        duration = hw.net_latency_s + (op.bytes_moved / bandwidth if bandwidth > 0 else float("inf"))
    elif op.kind is OpKind.UPDATE:
        duration = op.update_bytes / hw.host_optimizer
    elif op.kind in (OpKind.SWAP_OUT, OpKind.SWAP_IN, OpKind.STREAM_IN, OpKind.GRAD_OUT, OpKind.PARAM_IN):
        bandwidth = hw.d2h if op.kind in (OpKind.SWAP_OUT, OpKind.GRAD_OUT) else hw.h2d
        duration = hw.copy_latency_s + op.bytes_moved / bandwidth
    else:
        duration = 0.0
    return replace(op, duration_s=duration)


def peak_bytes(plan: Plan, profile: Profile) -> int:
    """Predicted peak of device-resident saved activations for one step of ``plan``."""
    return build_schedule(plan, profile).peak_bytes
