"""The host-update pipeline: gradients leave the device bucket by bucket while the backward goes on.

NOTE [the pipeline of one bucket]
1. ``launch`` (training thread, in the post-accumulate-grad hook of the bucket's last parameter, or
   at ``step()``): records a compute event and issues the gradients' D2H copies after it. Data-
   parallel "device" reduction instead concatenates the gradients on the device first.
2. The exchange thread takes buckets in canonical order (every rank issues collectives in the same
   order): it waits for the copies, then all-reduces (or, sharded, reduces each owner's range to
   its owner) on its own process group.
3. The update thread runs torch's fused AdamW on the host masters, writes the new weights into a
   staging buffer in the parameter's dtype, broadcasts owned ranges when sharded (its own process
   group), and issues the H2D copies into the parameters.
4. The block's next forward waits for those copies (a forward pre-hook): the gate. With
   ``delayed_update`` the copies are issued only when the bucket launches in the *next* step, so
   that step's forward and backward run on weights one update old (ZeRO-Offload's DPU).
Own-master parameters (host fp32 on the plain CPU backend) skip the copies: the update writes them
in place, which the gate orders the same way. Without a model to pipeline with and without ranks,
every stage runs on the calling thread in ``step()`` (``inline``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.optim.adamw import adamw

from ooc.backend import Backend, Event
from ooc.errors import OocError
from ooc.optim.buckets import Bucket

_WAIT_SLICE_S = 0.05


class PipelineError(OocError, RuntimeError):
    """A host update or gradient exchange failed (the cause is chained), or a gradient arrived after
    its bucket's update started."""


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
class Segment:
    """The parameters of one bucket that share a dtype, laid out in one flat host buffer.

    Parameters are ordered by owner rank (sharded), so each owner's range is contiguous.
    """

    params: list[torch.Tensor]
    offsets: list[int]
    dtype: torch.dtype
    owners: list[int]
    host_grad: torch.Tensor | None = None
    """Gradients on the host, in the parameters' dtype (``None`` for own-master segments)."""
    staging: torch.Tensor | None = None
    """New weights in the parameters' dtype, the source of the H2D copies."""
    flat: torch.Tensor | None = None
    """Data parallel, own-master parameters: their gradients side by side for one collective, and
    the owners' new weights for the broadcast (allocated once: a fresh buffer each step costs its
    page faults, ~35 ms per 57 MB here)."""
    device_flat: torch.Tensor | None = None
    """``reduce_on="device"``: the gradients side by side on the device."""

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def owner_ranges(self, world: int) -> list[tuple[int, int, int]]:
        """(owner, start, end) of each owner's contiguous range; empty ranges left out."""
        ranges = []
        for rank in range(world):
            idx = [i for i, o in enumerate(self.owners) if o == rank]
            if idx:
                start = self.offsets[idx[0]]
                end = self.offsets[idx[-1]] + self.params[idx[-1]].numel()
                ranges.append((rank, start, end))
        return ranges


@dataclass
class _Job:
    """One bucket's update in one step, handed from thread to thread."""

    bucket: int
    grads: dict[int, torch.Tensor]
    """Per parameter id (only those with a gradient): the gradient where it is read directly
    (own-master parameters), replaced by the fp32 host gradient before the update."""
    hyper: dict[int, Hyper]
    after: list[Event] = field(default_factory=list)
    on_host: bool = False
    """``grads`` holds the reduced fp32 host gradients."""


@dataclass
class _BucketState:
    hits: int = 0
    launched: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    gate: list[Event] = field(default_factory=list)
    """H2D copies the bucket's next forward waits for."""
    pending_h2d: bool = False
    """delayed_update: the staging buffer holds weights not yet copied to the parameters."""
    staging_readers: list[Event] = field(default_factory=list)
    """The H2D copies last issued from the staging buffer: it is not rewritten before they finish."""

    def __post_init__(self) -> None:
        self.done.set()


class Communicator(Protocol):
    """What the pipeline needs from data parallelism (built by :mod:`ooc.distributed`).

    ``all_reduce`` and ``reduce`` run on the exchange thread, ``broadcast`` and ``sum_vector`` on
    the update thread: each thread has its own process group, so their collectives never interleave
    differently on two ranks.
    """

    world: int
    rank: int
    sharded: bool

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def reduce(self, tensor: torch.Tensor, dst: int) -> None: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def sum_vector(self, tensor: torch.Tensor) -> None: ...


class UpdatePipeline:
    """Runs the host AdamW updates of a :class:`~ooc.optim.HostAdamW`, bucket by bucket."""

    def __init__(
        self,
        *,
        buckets: Sequence[Bucket],
        state_of: Callable[[torch.Tensor], dict[str, Any]],
        hyper_of: Callable[[torch.Tensor], Hyper],
        backend: Backend,
        own_master: Callable[[torch.Tensor], bool],
        home: dict[int, torch.Tensor],
        owner: dict[int, int],
        comm: Communicator | None,
        reduce_on_device: bool,
        delayed_update: bool,
        accumulate: int,
        max_grad_norm: float | None,
        norm_order: Sequence[torch.Tensor],
        inline: bool = False,
    ) -> None:
        """``inline``: run every stage on the calling thread at ``step()`` (no overlap to gain: no
        model to pipeline with, no ranks to exchange with), which saves two thread hand-offs."""
        self.buckets = tuple(buckets)
        self.state_of = state_of
        self.hyper_of = hyper_of
        self.backend = backend
        self.comm = comm
        self.rank = comm.rank if comm else 0
        self.world = comm.world if comm else 1
        self.sharded = comm is not None and comm.sharded
        self.owner = owner
        self.reduce_on_device = reduce_on_device and comm is not None
        self.delayed_update = delayed_update
        self.accumulate = accumulate
        self.max_grad_norm = max_grad_norm
        self.norm_order = list(norm_order)
        self.own = {id(p): own_master(p) for b in self.buckets for p in b.params}
        self.params = {id(p): p for b in self.buckets for p in b.params}
        self.home = home
        """Where the weights the device reads live: the parameter itself, or a streamed parameter's
        host copy (NOTE [streamed parameters] in ooc.streaming)."""
        self.segments = [self._segments(b) for b in self.buckets]
        self.status = [_BucketState() for _ in self.buckets]
        self.error: BaseException | None = None
        self._step_jobs: list[_Job] = []
        self.inline = inline and comm is None
        self._exchange_q: queue.SimpleQueue[_Job | str | None] = queue.SimpleQueue()
        self._update_q: queue.SimpleQueue[_Job | str | None] = queue.SimpleQueue()
        self._threads = [] if self.inline else [
            threading.Thread(target=self._guard, args=(self._exchange_loop,), name="ooc-exchange", daemon=True),
            threading.Thread(target=self._guard, args=(self._update_loop,), name="ooc-host-update", daemon=True),
        ]
        self.closed = False
        for thread in self._threads:
            thread.start()

    def _mine(self, p: torch.Tensor) -> bool:
        return not self.sharded or self.owner[id(p)] == self.rank

    def _segments(self, bucket: Bucket) -> list[Segment]:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in bucket.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        segments = []
        for dtype, params in by_dtype.items():
            params = sorted(params, key=lambda p: self.owner[id(p)])  # stable: keeps registration order
            offsets = _offsets(params)
            total = sum(p.numel() for p in params)
            seg = Segment(params, offsets, dtype, [self.owner[id(p)] for p in params])
            nbytes = total * torch.empty((), dtype=dtype).element_size()
            if not all(self.own[id(p)] for p in params):
                seg.host_grad = self.backend.host_buffer(nbytes).view(dtype)
                seg.staging = self.backend.host_buffer(nbytes).view(dtype)
            elif self.comm is not None:
                seg.flat = self.backend.host_buffer(nbytes).view(dtype)
            if self.reduce_on_device:
                seg.device_flat = self.backend.device_buffer(nbytes).view(dtype)
            segments.append(seg)
        return segments

    # training thread ---------------------------------------------------------------------------

    def on_grad(self, bucket: int) -> None:
        """A parameter of ``bucket`` has its gradient for this backward (post-accumulate-grad hook)."""
        self.raise_error()
        status = self.status[bucket]
        if status.launched:
            raise PipelineError(
                f"a gradient of {self.buckets[bucket].name} arrived after its host update started. For gradient "
                "accumulation over k backward passes per step, build HostAdamW with accumulate=k."
            )
        status.hits += 1
        if status.hits == len(self.buckets[bucket].params) * self.accumulate:
            self.launch(bucket)

    def launch(self, index: int) -> None:
        """Hand the bucket's gradients to the host: issue their copies out and queue the update."""
        bucket, status = self.buckets[index], self.status[index]
        grads = {id(p): p.grad for p in bucket.params if p.grad is not None}
        status.launched = True
        job = _Job(index, grads, {pid: self.hyper_of(self.params[pid]) for pid in grads})
        if not grads:
            if self.comm is not None:
                self._to_exchange(job)  # holds the bucket's place in the canonical order
            return
        # The previous step's job of this bucket must be done with its buffers before they are
        # rewritten (it is, unless delayed_update: then its update had this whole step to finish).
        self._wait_done(index)
        if self.delayed_update and status.pending_h2d:
            # Its weights go in now that this step's backward of the bucket has read the old ones.
            status.gate = self._issue_h2d(index)
            status.pending_h2d = False
        status.done.clear()
        compute = self.backend.record_compute()
        for seg in self.segments[index]:
            if self.reduce_on_device:
                # Side by side on the device (compute-stream copies): one collective per bucket.
                _gather(seg, seg.device_flat, grads)
            elif seg.host_grad is not None:
                for p, view in zip(seg.params, seg.views(seg.host_grad)):
                    if id(p) in grads:
                        src = grads[id(p)].contiguous().view(-1)
                        job.after.append(self.backend.copy_d2h(view.view(-1), src, (compute,)))
        job.after.append(compute)
        self._to_exchange(job)

    def _to_exchange(self, item: _Job | str) -> None:
        if not self.inline:
            self._exchange_q.put(item)
            return
        self.raise_error()
        self._guard(lambda: self._on_update_item(item) if item == "step" else self._exchange(item))
        self.raise_error()

    def _to_update(self, job: _Job) -> None:
        if self.inline:
            self._on_update_item(job)
        else:
            self._update_q.put(job)

    def finish_step(self) -> None:
        """``step()``: launch what no hook launched (unused parameters, no model), and close the step."""
        self.raise_error()
        for i, status in enumerate(self.status):
            if not status.launched:
                self.launch(i)
        self._to_exchange("step")
        for status in self.status:
            status.hits = 0
            status.launched = False

    def after_load(self) -> None:
        """After ``load_state_dict`` with ``delayed_update``: the loaded masters are the update the
        parameters have not taken yet, so they become the pending copy-in of each bucket (sharded:
        each owner's share is broadcast now, while the update thread is idle)."""
        if not self.delayed_update:
            return
        for index, bucket in enumerate(self.buckets):
            mine = {id(p): p for p in bucket.params if self._mine(p) and "master" in self.state_of(p)}
            job = _Job(index, mine, {})  # type: ignore[arg-type]
            for seg in self.segments[index]:
                self._stage_and_share(seg, job)
            self.status[index].pending_h2d = True

    def gate(self, indices: Sequence[int]) -> None:
        """Before a forward: the weights of these buckets must be the updated ones."""
        for i in indices:
            self._wait_done(i)
            for event in self.status[i].gate:
                # The forward reads these parameters: compute must not pass their H2D copies.
                self.backend.wait_compute(event)
            self.status[i].gate = []

    def synchronize(self) -> None:
        """Wait for every update issued; then the parameters hold the newest weights the mode allows
        (with ``delayed_update``, the ones of the previous update)."""
        self.gate(range(len(self.buckets)))

    def _wait_done(self, index: int) -> None:
        while not self.status[index].done.wait(_WAIT_SLICE_S):
            self.raise_error()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise PipelineError(f"ooc's host optimizer stopped: {self.error}") from self.error

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._exchange_q.put(None)
            for thread in self._threads:
                thread.join(timeout=5)

    # worker threads ----------------------------------------------------------------------------

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self.error = exc
            for status in self.status:
                status.done.set()  # waiters wake up and see the error
            self._update_q.put(None)

    def _exchange_loop(self) -> None:
        held: dict[int, _Job] = {}
        expected = 0
        while True:
            item = self._exchange_q.get()
            if item is None:
                self._update_q.put(None)
                return
            if item == "step":
                for index in sorted(held):  # only without data parallelism: nothing is held there
                    self._exchange(held.pop(index))
                expected = 0
                self._update_q.put("step")
                continue
            if self.comm is None:
                self._exchange(item)
                continue
            # Every rank issues its collectives in canonical bucket order, whatever order hooks fired in:
            # with data parallelism every bucket queues one job per step, with gradients or without.
            held[item.bucket] = item
            while expected in held:
                self._exchange(held.pop(expected))
                expected += 1

    def _exchange(self, job: _Job) -> None:
        """Wait for the job's gradients and sum them across ranks; then hand it to the update."""
        if not job.grads:
            return
        for event in job.after:
            event.synchronize()  # the gradients are on the host (device mode: concatenated)
        for seg in self.segments[job.bucket]:
            if self.reduce_on_device:
                flat = seg.device_flat
                self._reduce(seg, flat)
                if seg.host_grad is None:
                    job.grads.update(_present(seg, seg.views(flat), job.grads))
                else:
                    # Reduced on the device; now to the host, and wait: the update reads it next.
                    self.backend.copy_d2h(seg.host_grad, flat, ()).synchronize()
            elif self.comm is not None:
                if seg.host_grad is None:
                    # Own-master gradients are separate tensors: side by side for one collective.
                    _gather(seg, seg.flat, job.grads)
                    self._reduce(seg, seg.flat)
                    job.grads.update(_present(seg, seg.views(seg.flat), job.grads))
                else:
                    self._reduce(seg, seg.host_grad)
        self._to_update(job)

    def _reduce(self, seg: Segment, flat: torch.Tensor) -> None:
        if self.comm is None:
            return
        if not self.sharded:
            self.comm.all_reduce(flat)
            return
        for rank, start, end in seg.owner_ranges(self.world):
            # Sharded: only the owner updates these parameters, so only it needs their sum.
            self.comm.reduce(flat[start:end], dst=rank)

    def _update_loop(self) -> None:
        while (item := self._update_q.get()) is not None:
            self._on_update_item(item)

    def _on_update_item(self, item: _Job | str) -> None:
        if item == "step":
            if self.max_grad_norm is not None:
                self._clip(self._step_jobs)
                for job in self._step_jobs:
                    self._update(job)
            self._step_jobs = []
            return
        if self.max_grad_norm is not None:
            # NOTE [clipping stalls the pipeline]: the global norm needs every bucket's gradient,
            # so with clipping the updates wait for step(); only the copies out and the exchange
            # still overlap the backward.
            self._to_host_fp32(item)
            self._step_jobs.append(item)
            return
        self._update(item)

    def _to_host_fp32(self, job: _Job) -> None:
        """Replace ``job.grads`` by the fp32 host gradients this rank updates, as means over ranks."""
        if job.on_host:
            return
        out: dict[int, torch.Tensor] = {}
        for seg in self.segments[job.bucket]:
            sources = seg.views(seg.host_grad) if seg.host_grad is not None else [job.grads.get(id(p)) for p in seg.params]
            for p, grad in zip(seg.params, sources):
                if id(p) not in job.grads or not self._mine(p):
                    continue
                if grad.dtype != torch.float32:
                    grad = grad.float()
                if self.world > 1:
                    grad.div_(self.world)  # our own buffer (flat or host copy): the sum becomes the mean
                out[id(p)] = grad
        job.grads = out
        job.on_host = True

    def _clip(self, jobs: list[_Job]) -> None:
        grads = {pid: g for job in jobs for pid, g in job.grads.items()}
        norms = torch.zeros(len(self.norm_order), dtype=torch.float32)
        for i, p in enumerate(self.norm_order):
            if id(p) in grads:
                norms[i] = torch.linalg.vector_norm(grads[id(p)])
        if self.sharded:
            self.comm.sum_vector(norms)  # each norm comes from its owner; the other ranks add zeros
        else:
            norms = norms[[i for i, p in enumerate(self.norm_order) if id(p) in grads]]
        if norms.numel() == 0:
            return
        total = torch.linalg.vector_norm(norms)
        # As torch.nn.utils.clip_grad_norm_: scale by max_norm / (total + 1e-6), never above 1.
        coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        for grad in grads.values():
            grad.mul_(coef)

    def _update(self, job: _Job) -> None:
        status = self.status[job.bucket]
        self._to_host_fp32(job)
        by_hyper: dict[Hyper, tuple[list[torch.Tensor], ...]] = {}
        for pid, grad in job.grads.items():
            p = self.params[pid]
            state = self.state_of(p)
            lists = by_hyper.setdefault(job.hyper[pid], ([], [], [], [], []))
            items = (state.get("master", self.home[pid]), grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
            for lst, item in zip(lists, items):
                lst.append(item)
        for h, (targets, grads, exp_avgs, exp_avg_sqs, steps) in by_hyper.items():
            with torch.no_grad():
                adamw(targets, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, fused=True, amsgrad=False,
                      beta1=h.beta1, beta2=h.beta2, lr=h.lr, weight_decay=h.weight_decay, eps=h.eps, maximize=False)
        for event in status.staging_readers:
            event.synchronize()  # the last H2D copies out of the staging buffer have read it
        for seg in self.segments[job.bucket]:
            self._stage_and_share(seg, job)
        if self.delayed_update:
            status.pending_h2d = True
        else:
            status.gate = self._issue_h2d(job.bucket)
        status.done.set()

    def _stage_and_share(self, seg: Segment, job: _Job) -> None:
        """New weights into the staging buffer (own-master: they are in the parameters already);
        sharded, each owner's range then goes to every rank."""
        if seg.staging is not None:
            for p, view in zip(seg.params, seg.views(seg.staging)):
                if id(p) in job.grads:
                    view.copy_(self.state_of(p)["master"])
        if not self.sharded:
            return
        for rank, start, end in seg.owner_ranges(self.world):
            if seg.staging is not None:
                self.comm.broadcast(seg.staging[start:end], src=rank)
                continue
            # Own-master weights: through the flat buffer (its gradients are consumed by now).
            owned = [(self.home[id(p)], view) for p, o, view in zip(seg.params, seg.owners, seg.views(seg.flat))
                     if o == rank]
            with torch.no_grad():
                if rank == self.rank:
                    for home, view in owned:
                        view.copy_(home)
                self.comm.broadcast(seg.flat[start:end], src=rank)
                if rank != self.rank:
                    for home, view in owned:
                        home.copy_(view)

    def _issue_h2d(self, index: int) -> list[Event]:
        events = []
        for seg in self.segments[index]:
            if seg.staging is None:
                continue
            for p, view in zip(seg.params, seg.views(seg.staging)):
                events.append(self.backend.copy_h2d(self.home[id(p)].detach().view(-1), view.reshape(-1), ()))
        self.status[index].staging_readers = list(events)
        return events


def _present(seg: Segment, views: list[torch.Tensor], grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The reduced views of the parameters that had a gradient."""
    return {id(p): v for p, v in zip(seg.params, views) if id(p) in grads}


@torch.no_grad()
def _gather(seg: Segment, flat: torch.Tensor, grads: dict[int, torch.Tensor]) -> None:
    """The segment's gradients side by side in ``flat`` (zeros for parameters without one)."""
    for p, view in zip(seg.params, seg.views(flat)):
        if id(p) in grads:
            view.copy_(grads[id(p)])
        else:
            view.zero_()


def _offsets(params: Sequence[torch.Tensor]) -> list[int]:
    out, total = [], 0
    for p in params:
        out.append(total)
        total += p.numel()
    return out
