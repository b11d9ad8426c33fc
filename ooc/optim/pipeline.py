"""The host-update pipeline: runs each bucket's stages (:mod:`ooc.optim.stages`) on their threads.

NOTE [the pipeline of one bucket]
``launch`` runs COPY_OUT on the training thread and queues the bucket's job to the exchange
thread, which takes buckets in canonical order (every rank issues collectives in the same order),
runs EXCHANGE and queues the job to the update thread, which runs UPDATE and COPY_IN. The block's
next forward waits for the new weights (a forward pre-hook): the gate. Without a model to pipeline
with and without ranks, every stage runs on the calling thread in ``step()`` (``inline``).
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ooc.backend import Event
from ooc.errors import OocError
from ooc.optim.stages import Job, Stage, StageListener, Stages

_WAIT_SLICE_S = 0.05


class PipelineError(OocError, RuntimeError):
    """A host update or gradient exchange failed (the cause is chained), or a gradient arrived after
    its bucket's update started."""


@dataclass(frozen=True)
class PipelineConfig:
    """How the host updates are scheduled (the :class:`~ooc.optim.HostAdamW` options of the same names).

    - ``delayed_update``: a bucket's new weights are copied in at its launch in the next step.
    - ``accumulate``: backward passes per step; a bucket launches after its ``accumulate``-th gradient.
    - ``max_grad_norm``: clip by the global norm; the updates then wait for ``step()``.
    - ``inline``: run every stage on the calling thread at ``step()`` (no overlap to gain: no model
      to pipeline with, no ranks to exchange with), which saves two thread hand-offs.
    """

    delayed_update: bool = False
    accumulate: int = 1
    max_grad_norm: float | None = None
    inline: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate must be an int >= 1 (backward passes per step), got {self.accumulate!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


class Signal(enum.Enum):
    """Queue messages other than a bucket's job."""

    END_OF_STEP = "end of step"
    """``step()`` was called: every bucket of this step has been queued."""
    STOP = "stop"
    """The optimizer is closing: the thread ends."""


Message = Job | Signal


@dataclass
class _BucketState:
    hits: int = 0
    launched: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    gate: list[Event] = field(default_factory=list)
    """H2D copies the bucket's next forward waits for."""
    pending_h2d: bool = False
    """delayed_update: the staging buffer holds weights not yet copied to the parameters."""

    def __post_init__(self) -> None:
        self.done.set()


class UpdatePipeline:
    """Runs the host AdamW updates of a :class:`~ooc.optim.HostAdamW`, bucket by bucket."""

    def __init__(self, stages: Stages, config: PipelineConfig,
                 listeners: Callable[[], Sequence[StageListener]] = tuple) -> None:
        """``listeners``: returns the callables to call with (bucket, stage) as each stage ends (NOTE
        [stage listeners] in ooc.optim.stages), looked up at each call."""
        self.stages = stages
        self.config = config
        self.buckets = stages.layout.buckets
        self.listeners = listeners
        self.status = [_BucketState() for _ in self.buckets]
        self.error: BaseException | None = None
        self._step_jobs: list[Job] = []
        self.inline = config.inline and stages.comm is None
        self._exchange_q: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._update_q: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._threads = [] if self.inline else [
            threading.Thread(target=self._guard, args=(self._exchange_loop,), name="ooc-exchange", daemon=True),
            threading.Thread(target=self._guard, args=(self._update_loop,), name="ooc-host-update", daemon=True),
        ]
        self.closed = False
        for thread in self._threads:
            thread.start()

    def _ended(self, index: int, stage: Stage) -> None:
        for listener in self.listeners():
            listener(index, stage)

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
        if status.hits == len(self.buckets[bucket].params) * self.config.accumulate:
            self.launch(bucket)

    def launch(self, index: int) -> None:
        """Hand the bucket's gradients to the host: issue their copies out and queue the update."""
        status = self.status[index]
        job = self.stages.job(index)
        status.launched = True
        if not job.grads:
            if self.stages.comm is not None:
                self._to_exchange(job)  # holds the bucket's place in the canonical order
            return
        # The previous step's job of this bucket must be done with its buffers before they are
        # rewritten (it is, unless delayed_update: then its update had this whole step to finish).
        self._wait_done(index)
        status.done.clear()
        compute = self.stages.copy_out(job)
        if self.config.delayed_update and status.pending_h2d:
            # The previous update's weights go in now that this step's backward of the bucket has
            # read the old ones: this hook runs when the host has *queued* that backward, so the
            # copies wait on the compute event recorded after it, not just on the host reaching here.
            status.gate = self.stages.copy_in(index, after=(compute,))
            status.pending_h2d = False
            self._ended(index, Stage.COPY_IN)
        self._ended(index, Stage.COPY_OUT)
        self._to_exchange(job)

    def _to_exchange(self, item: Message) -> None:
        if not self.inline:
            self._exchange_q.put(item)
            return
        self.raise_error()
        self._guard(lambda: self._on_update_item(item) if item is Signal.END_OF_STEP else self._exchange(item))
        self.raise_error()

    def _to_update(self, job: Job) -> None:
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
        self._to_exchange(Signal.END_OF_STEP)
        for status in self.status:
            status.hits = 0
            status.launched = False

    def after_load(self) -> None:
        """After ``load_state_dict`` with ``delayed_update``: the loaded masters are the update the
        parameters have not taken yet, so they become the pending copy-in of each bucket (sharded:
        each owner's share is broadcast now, while the update thread is idle)."""
        if not self.config.delayed_update:
            return
        layout, state = self.stages.layout, self.stages.state
        for index, bucket in enumerate(self.buckets):
            mine = [id(p) for p in bucket.params if layout.mine(p) and "master" in state.state_of(p)]
            self.stages.stage_weights(index, mine)
            self.status[index].pending_h2d = True

    def gate(self, indices: Sequence[int]) -> None:
        """Before a forward: the weights of these buckets must be the updated ones."""
        for i in indices:
            self._wait_done(i)
            for event in self.status[i].gate:
                # The forward reads these parameters: compute must not pass their H2D copies.
                self.stages.backend.wait_compute(event)
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
            self._exchange_q.put(Signal.STOP)
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
            self._update_q.put(Signal.STOP)

    def _exchange_loop(self) -> None:
        held: dict[int, Job] = {}
        expected = 0
        while True:
            item = self._exchange_q.get()
            if item is Signal.STOP:
                self._update_q.put(Signal.STOP)
                return
            if item is Signal.END_OF_STEP:
                for index in sorted(held):  # only without data parallelism: nothing is held there
                    self._exchange(held.pop(index))
                expected = 0
                self._update_q.put(Signal.END_OF_STEP)
                continue
            if self.stages.comm is None:
                self._exchange(item)
                continue
            # Every rank issues its collectives in canonical bucket order, whatever order hooks fired in:
            # with data parallelism every bucket queues one job per step, with gradients or without.
            held[item.bucket] = item
            while expected in held:
                self._exchange(held.pop(expected))
                expected += 1

    def _exchange(self, job: Job) -> None:
        if not job.grads:
            return
        self.stages.exchange(job)
        self._ended(job.bucket, Stage.EXCHANGE)
        self._to_update(job)

    def _update_loop(self) -> None:
        while (item := self._update_q.get()) is not Signal.STOP:
            self._on_update_item(item)

    def _on_update_item(self, item: Message) -> None:
        if item is Signal.END_OF_STEP:
            if self.config.max_grad_norm is not None:
                self.stages.clip(self._step_jobs)
                for job in self._step_jobs:
                    self._update(job)
            self._step_jobs = []
            return
        if self.config.max_grad_norm is not None:
            # NOTE [clipping stalls the pipeline]: the global norm needs every bucket's gradient,
            # so with clipping the updates wait for step(); only the copies out and the exchange
            # still overlap the backward.
            self.stages.to_host_fp32(item)
            self._step_jobs.append(item)
            return
        self._update(item)

    def _update(self, job: Job) -> None:
        status = self.status[job.bucket]
        self.stages.update(job)
        self._ended(job.bucket, Stage.UPDATE)
        self.stages.stage_weights(job.bucket, list(job.grads))
        if self.config.delayed_update:
            status.pending_h2d = True
        else:
            # No compute event to wait on: this thread waited (EXCHANGE) for the copy-out's compute
            # event, recorded after the bucket's backward, so that backward no longer reads the old
            # weights. The next forward waits for these copies at the gate.
            status.gate = self.stages.copy_in(job.bucket)
            self._ended(job.bucket, Stage.COPY_IN)
        status.done.set()
