"""The four stages of one bucket's host update, and the listeners that can hook each of them.

NOTE [the stages of one bucket]
1. ``COPY_OUT`` (training thread, in the post-accumulate-grad hook of the bucket's last parameter,
   or at ``step()``): the gradients' D2H copies are issued after a compute event; compute after the
   backward waits for them before it may write a gradient (NOTE [gradients written after the
   backward] in ooc.optim.pipeline). Data-parallel "device" reduction instead concatenates the
   gradients on the device.
2. ``EXCHANGE`` (exchange thread): the copies are waited for and the gradients summed across ranks
   (sharded: each owner's range reduced to its owner) on the exchange thread's process group.
3. ``UPDATE`` (update thread): torch's fused AdamW runs on the fp32 host masters and moments.
4. ``COPY_IN`` (update thread): the new weights go into the staging buffer in the parameter's
   dtype, sharded owners broadcast their ranges (the update thread's process group), and the H2D
   copies into the parameters are issued. With ``delayed_update`` the H2D copies are issued only
   when the bucket launches in the *next* step (training thread), so that step's forward and
   backward run on weights one update old (ZeRO-Offload's DPU).
Own-master parameters (host fp32 on the plain CPU backend) skip the copies: the update writes them
in place; their COPY_OUT and COPY_IN stages still run (and are reported), with nothing to copy.

NOTE [stage listeners]
A listener is a callable ``listener(bucket, stage)`` in :attr:`HostAdamW.stage_listeners`; it is
called when ``stage`` of bucket ``bucket`` (an index into ``HostAdamW.buckets``) has ended, on the
thread that ran the stage, before that thread goes on. For one bucket the stages of a step come in
the order COPY_OUT, EXCHANGE, UPDATE, COPY_IN (with ``delayed_update``, a step's COPY_IN comes just
before the next step's COPY_OUT), and never overlap the next step's. After UPDATE the bucket's
masters and moments hold this step's update and stay unchanged until its next UPDATE, which runs
on the same thread after the listener has returned: a snapshot taken (or waited for) in an UPDATE
listener is consistent. A listener that raises stops the optimizer like any failed stage (the error
is raised on the training thread). Buckets none of whose parameters got a gradient run no stage
(data-parallel: on any rank; such a bucket runs COPY_OUT, with nothing to copy, before the exchange
finds that out).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.optim.adamw import adamw

from ooc.backend import Backend, Event
from ooc.optim.layout import Layout, Segment, storage_span


class Stage(enum.Enum):
    """A stage of one bucket's update, in the order they run (NOTE [the stages of one bucket])."""

    COPY_OUT = "copy out"
    EXCHANGE = "exchange"
    UPDATE = "update"
    COPY_IN = "copy in"


StageListener = Callable[[int, Stage], None]
"""Called with (bucket index, stage) when the stage ends (NOTE [stage listeners])."""


@dataclass(frozen=True)
class Hyper:
    """One parameter group's AdamW settings, read when the bucket launches (so an LR scheduler's
    change after ``step()`` applies to the next step only)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclass
class Job:
    """One bucket's update in one step, handed from stage to stage (thread to thread)."""

    bucket: int
    grads: dict[int, torch.Tensor]
    """Per parameter id (only those with a gradient): the gradient where it is read directly
    (own-master parameters), replaced by the fp32 host gradient before the update."""
    hyper: dict[int, Hyper]
    after: list[Event] = field(default_factory=list)
    """What the exchange waits for before it reads the gradients."""
    on_host: bool = False
    """``grads`` holds the reduced fp32 host gradients."""
    present: frozenset[int] = frozenset()
    """The ids of the bucket's parameters that had a gradient at launch; after the exchange, on any
    rank (the same set on every rank: sharded, the owners update and broadcast them; ``grads`` keeps
    only this rank's)."""


class Communicator(Protocol):
    """What the stages need from data parallelism (built by :mod:`ooc.distributed`).

    ``all_reduce`` and ``reduce`` run on the exchange thread, ``broadcast`` and ``sum_vector`` on
    the update thread: each thread has its own process group, so their collectives never interleave
    differently on two ranks. The update thread's tensors (staging and flat buffers, the norms) are
    host tensors: its group must carry host memory (gloo, even when the exchange runs on NCCL).
    """

    world: int
    rank: int
    sharded: bool

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def reduce(self, tensor: torch.Tensor, dst: int) -> None: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def sum_vector(self, tensor: torch.Tensor) -> None: ...


class HostState(Protocol):
    """The optimizer's per-parameter state and settings, looked up at each use (``load_state_dict``
    replaces both)."""

    def state_of(self, p: torch.Tensor) -> dict[str, Any]: ...

    def hyper_of(self, p: torch.Tensor) -> Hyper: ...


class Stages:
    """The work of each stage, for any bucket; :class:`~ooc.optim.pipeline.UpdatePipeline` decides
    on which thread and when each runs."""

    def __init__(self, *, layout: Layout, backend: Backend, comm: Communicator | None, state: HostState,
                 reduce_on_device: bool = False, max_grad_norm: float | None = None) -> None:
        self.layout = layout
        self.backend = backend
        self.comm = comm
        self.state = state
        self.reduce_on_device = reduce_on_device and comm is not None
        self.max_grad_norm = max_grad_norm
        self.staging_readers: list[list[Event]] = [[] for _ in layout.buckets]
        """Per bucket, the H2D copies last issued from its staging buffers: not rewritten before
        they finish."""
        self.staged: list[set[int]] = [set() for _ in layout.buckets]
        """Per bucket, the ids of the parameters whose new weights wait in its staging buffers for
        ``copy_in`` (NOTE [only staged weights go in])."""

    def job(self, index: int) -> Job:
        """This step's job of bucket ``index``: its gradients (training thread, at launch)."""
        params = self.layout.buckets[index].params
        grads = {id(p): p.grad for p in params if p.grad is not None}
        # Every parameter's settings: data-parallel, one without a gradient here may have one on another rank.
        return Job(index, grads, {id(p): self.state.hyper_of(p) for p in params}, present=frozenset(grads))

    # 1. training thread ------------------------------------------------------------------------

    def copy_out(self, job: Job) -> tuple[Event, Event | None]:
        """Issue the copies of ``job``'s gradients to the host; returns the compute event they wait on
        and the last copy's event (None: nothing copied), after which no copy reads a gradient (copies
        on one engine run in issue order): compute must not write them before it (NOTE [gradients
        written after the backward] in ooc.optim.pipeline)."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for seg in self.layout.segments[job.bucket]:
            if self.reduce_on_device:
                # Side by side on the device (compute-stream copies): one collective per bucket.
                _gather(seg, seg.device_flat, job.grads)
            elif seg.host_grad is not None:
                for p, view in zip(seg.params, seg.views(seg.host_grad)):
                    if id(p) in job.grads:
                        # A non-contiguous gradient (channels_last) is made contiguous by a kernel on
                        # the compute stream: the copy's source is written there.
                        copies.append((view.view(-1), job.grads[id(p)].contiguous().view(-1)))
        # After the sources above are built (and after the bucket's backward, queued before this
        # hook): the copies and the exchange must not read the gradients before compute wrote them.
        compute = self.backend.record_compute()
        last = None
        for dst, src in copies:
            last = self.backend.copy_d2h(dst, src, (compute,))
            job.after.append(last)
        job.after.append(compute)
        return compute, last

    # 2. exchange thread ------------------------------------------------------------------------

    def exchange(self, job: Job) -> None:
        """Wait for the job's gradients and sum them across ranks; ``job.grads`` then holds every
        parameter with a gradient on some rank (NOTE [gradients missing on some ranks])."""
        for event in job.after:
            event.synchronize()  # the gradients are on the host (device mode: concatenated)
        if self.comm is None:
            return
        self._agree_on_present(job)
        if not job.present:
            return  # no rank has a gradient here: no collective on any rank
        for seg in self.layout.segments[job.bucket]:
            if self.reduce_on_device:
                flat = seg.device_flat
                self._reduce(seg, flat)
                if seg.host_grad is not None:
                    # NOTE: a collective is ordered on the issuing thread's current stream (NCCL
                    # makes that stream wait for it), not on the D2H stream: record an event there,
                    # after the collective, for the copy to wait on. Then wait on the host: the
                    # update reads the host copy next.
                    reduced = self.backend.record_compute()
                    self.backend.copy_d2h(seg.host_grad, flat, (reduced,)).synchronize()
                    flat = seg.host_grad
                else:
                    # Own masters (the plain CPU backend) take the reduced gradients where they are:
                    # the host waits for the collective before the update thread reads them, and
                    # before the buffer may be freed (no copy's event says it is done here).
                    self.backend.record_compute().synchronize()
            elif seg.host_grad is None:
                # Own-master gradients are separate tensors: side by side for one collective.
                _gather(seg, seg.flat, job.grads)
                self._reduce(seg, seg.flat)
                flat = seg.flat
            else:
                for p, view in zip(seg.params, seg.views(seg.host_grad)):
                    if id(p) in job.present and id(p) not in job.grads:
                        view.zero_()  # copy_out left it as an earlier step wrote it; the copies are done
                self._reduce(seg, seg.host_grad)
                flat = seg.host_grad
            job.grads.update(_present(seg, seg.views(flat), job.present))

    def _agree_on_present(self, job: Job) -> None:
        """Set ``job.present`` to the bucket's parameters that have a gradient on any rank (a collective
        on the exchange thread's group, in the buffers' place: the device's, reducing there).

        NOTE [gradients missing on some ranks]
        A parameter the batch of one rank does not use (an auxiliary head, a branch the data takes)
        has no gradient there. torch's DistributedDataParallel(find_unused_parameters=True) averages
        it with zeros from that rank, and every rank updates it. A rank skipped the exchange of a
        bucket without gradients, so the other's collective met its next bucket's (gloo aborts the
        process on sizes that differ; equal sizes summed two buckets' gradients), and updated only
        the parameters with a gradient of its own, while the others updated them too: the ranks'
        weights parted without a word. So every rank exchanges every bucket each step, first the
        flags of which parameters have a gradient, summed: a gradient missing here counts as zeros
        (gathered ones are zeroed; a host copy-out buffer keeps an earlier step's values, so those
        are zeroed here), and every rank updates the same parameters, as under DDP."""
        bucket = self.layout.buckets[job.bucket]
        device = self.layout.segments[job.bucket][0].device_flat.device if self.reduce_on_device else "cpu"
        flags = torch.tensor([id(p) in job.grads for p in bucket.params], dtype=torch.int32, device=device)
        self.comm.all_reduce(flags)
        job.present = frozenset(id(p) for p, n in zip(bucket.params, flags.tolist()) if n > 0)

    def _reduce(self, seg: Segment, flat: torch.Tensor) -> None:
        if self.comm is None:
            return
        if not self.layout.sharded:
            self.comm.all_reduce(flat)
            return
        for rank, start, end in seg.owner_ranges(self.layout.world):
            # Sharded: only the owner updates these parameters, so only it needs their sum.
            self.comm.reduce(flat[start:end], dst=rank)

    # 3. update thread --------------------------------------------------------------------------

    def to_host_fp32(self, job: Job) -> None:
        """Replace ``job.grads`` by the fp32 host gradients this rank updates, as means over ranks."""
        if job.on_host:
            return
        world = self.layout.world
        out: dict[int, torch.Tensor] = {}
        for seg in self.layout.segments[job.bucket]:
            sources = seg.views(seg.host_grad) if seg.host_grad is not None else [job.grads.get(id(p)) for p in seg.params]
            for i, (p, grad) in enumerate(zip(seg.params, sources)):
                if id(p) not in job.grads or not self.layout.mine(p):
                    continue
                if grad.dtype != torch.float32:
                    grad = seg.grad32_view(i).copy_(grad)  # preallocated: no fresh buffer per step
                if world > 1:
                    grad.div_(world)  # our own buffer (flat, host copy or grad32): the sum becomes the mean
                out[id(p)] = grad
        job.grads = out
        job.on_host = True

    def unscale(self, jobs: Sequence[Job], inverse: torch.Tensor, found_elsewhere: bool) -> bool:
        """Loss scaling: multiply every gradient of ``jobs`` (fp32, on the host) by ``inverse`` (the
        scale's reciprocal) and return whether any gradient, of any rank, is inf or NaN (NOTE [loss
        scaling in the optimizer] in ooc.optim.loss_scale). ``found_elsewhere``: whether one no bucket
        holds (``device_params_below``, checked in ``step()``) is. Unsharded, every rank holds the
        same averaged gradients and decides alike; sharded, each holds its own share, and the ranks
        add up what they found."""
        grads = [g for job in jobs for g in job.grads.values()]
        found = torch.full((1,), float(found_elsewhere), dtype=torch.float32)
        if grads:
            # GradScaler's own kernel: one pass that unscales and flags a non-finite value.
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse)
        if self.layout.sharded:
            self.comm.sum_vector(found)
        return bool(found.item() > 0)

    def clip(self, jobs: Sequence[Job], others: dict[int, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Scale every gradient of ``jobs`` (fp32, on the host) by the global norm's clip factor, and
        return it (None: no gradient). ``others``: parameter id -> the norm (a 0-d host tensor) of
        a gradient no bucket holds (``device_params_below``: on the device, the same on every rank),
        counted in the global norm at the parameter's place, as ``clip_grad_norm_`` stacks them."""
        grads = {pid: g for job in jobs for pid, g in job.grads.items()}
        others = others or {}
        order = self.layout.norm_order
        norms = torch.zeros(len(order), dtype=torch.float32)
        for i, p in enumerate(order):
            if id(p) in grads:
                norms[i] = torch.linalg.vector_norm(grads[id(p)])
            elif id(p) in others and (not self.layout.sharded or self.layout.rank == 0):
                norms[i] = others[id(p)]  # sharded: one rank adds it, as an owner does its own
        if self.layout.sharded:
            self.comm.sum_vector(norms)  # each norm comes from its owner; the other ranks add zeros
        # NOTE [only gradients that exist are stacked]: clip_grad_norm_ stacks the norms of the
        # gradients that exist, and the total is a vectorized sum whose lanes follow the positions,
        # so a zero left in the place of a missing one (a frozen layer, a branch no rank took) moves
        # the others to other lanes and changes the total's last bits. Sharded, the zeros of every
        # parameter without a gradient stayed in, and the clip factor parted from the unsharded run's
        # and one process's. ``present`` is the same on every rank (NOTE [gradients missing on some ranks]).
        present = {pid for job in jobs for pid in job.present}
        norms = norms[[i for i, p in enumerate(order) if id(p) in present or id(p) in others]]
        if norms.numel() == 0:
            return None
        total = torch.linalg.vector_norm(norms)
        # As torch.nn.utils.clip_grad_norm_: scale by max_norm / (total + 1e-6), never above 1.
        coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        for grad in grads.values():
            grad.mul_(coef)
        return coef

    def update(self, job: Job) -> None:
        """AdamW on the masters (or own-master parameters) and moments of the job's parameters."""
        self.to_host_fp32(job)
        by_hyper: dict[Hyper, tuple[list[torch.Tensor], ...]] = {}
        for pid, grad in job.grads.items():
            p = self.layout.params[pid]
            state = self.state.state_of(p)
            lists = by_hyper.setdefault(job.hyper[pid], ([], [], [], [], []))
            items = (state.get("master", self.layout.home[pid]), grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
            for lst, item in zip(lists, items):
                lst.append(item)
        for h, (targets, grads, exp_avgs, exp_avg_sqs, steps) in by_hyper.items():
            with torch.no_grad():
                adamw(targets, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, fused=True, amsgrad=False,
                      beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps, maximize=False)

    # 4. update thread (the H2D copies: training thread with delayed_update) ---------------------

    def stage_weights(self, index: int, updated: Sequence[int], *, arriving: Sequence[int] | None = None) -> None:
        """The new weights of the parameters ``updated`` (ids, this rank's) into the bucket's staging
        buffers (own-master: they are in the parameters already); sharded, each owner's range then
        goes to every rank. ``arriving``: the ids whose new weights the staging buffers hold after
        this (sharded: the owners' ``updated`` too; default ``updated``), which ``copy_in`` moves."""
        for event in self.staging_readers[index]:
            event.synchronize()  # the last H2D copies out of the staging buffer have read it
        layout = self.layout
        updated = set(updated)
        for seg in layout.segments[index]:
            if seg.staging is not None:
                homes = [layout.home[id(p)] for p in seg.params]
                for p, view in zip(seg.params, seg.weight_views(seg.staging, homes)):
                    if id(p) in updated:
                        view.copy_(self.state.state_of(p)["master"])
            if not layout.sharded:
                continue
            for rank, start, end in seg.owner_ranges(layout.world):
                if seg.staging is not None:
                    self.comm.broadcast(seg.staging[start:end], src=rank)
                    continue
                # Own-master weights: through the flat buffer (its gradients are consumed by now).
                owned = [(layout.home[id(p)], view) for p, o, view in zip(seg.params, seg.owners, seg.views(seg.flat))
                         if o == rank]
                with torch.no_grad():
                    if rank == layout.rank:
                        for home, view in owned:
                            view.copy_(home)
                    self.comm.broadcast(seg.flat[start:end], src=rank)
                    if rank != layout.rank:
                        for home, view in owned:
                            home.copy_(view)
        self.staged[index].update(updated if arriving is None else arriving)

    def copy_in(self, index: int, after: tuple[Event, ...] = ()) -> list[Event]:
        """Issue the H2D copies of the bucket's staged weights into the parameters, after ``after``;
        returns their events (the bucket's next forward waits for them).

        NOTE [only staged weights go in]
        A staging slot holds a weight only once an update (or a load, or a rollback) staged one: a
        parameter without a gradient (frozen, or unused so far) has zeros there, or the last weight
        it had. So only the parameters staged since the last ``copy_in`` are copied, as torch's
        AdamW leaves a parameter whose ``.grad`` is None alone; copying the whole buffer put zeros
        into frozen weights on the first step."""
        events = []
        staged, self.staged[index] = self.staged[index], set()
        for seg in self.layout.segments[index]:
            if seg.staging is None:
                continue
            for p, o in zip(seg.params, seg.offsets):
                if id(p) not in staged:
                    continue
                # Staged in the home's own layout (stage_weights): the bytes go as they are. Through
                # .data: the parameter's version counter moves only for writes from outside (NOTE
                # [weights written outside the optimizer] in ooc.optim.pipeline).
                dst = storage_span(self.layout.home[id(p)].data)
                events.append(self.backend.copy_h2d(dst, seg.staging[o:o + p.numel()], after))
        self.staging_readers[index] = list(events)
        return events


def _present(seg: Segment, views: list[torch.Tensor], present: frozenset[int]) -> dict[int, torch.Tensor]:
    """The reduced views of the parameters that had a gradient (on some rank)."""
    return {id(p): v for p, v in zip(seg.params, views) if id(p) in present}


@torch.no_grad()
def _gather(seg: Segment, flat: torch.Tensor, grads: dict[int, torch.Tensor]) -> None:
    """The segment's gradients side by side in ``flat`` (zeros for parameters without one)."""
    for p, view in zip(seg.params, seg.views(flat)):
        if id(p) in grads:
            view.copy_(grads[id(p)])
        else:
            view.zero_()
