"""The host-update pipeline: runs each bucket's stages (:mod:`ooc.optim.stages`) on their threads.

NOTE [the pipeline of one bucket]
``launch`` runs COPY_OUT on the training thread and queues the bucket's job to the exchange
thread, which takes buckets in canonical order (every rank issues collectives in the same order),
runs EXCHANGE and queues the job to the update thread, which runs UPDATE and COPY_IN. The block's
next forward waits for the new weights (a forward pre-hook): the gate. Without a model to pipeline
with and without ranks, every stage runs on the calling thread in ``step()`` (``inline``).

NOTE [a step is a transaction]
The updates a backward starts belong to the step that ``step()`` closes (commits). The pipeline
tracks the backward itself: a tensor hook on the model's outputs marks its start (``begin_backward``)
and a callback queued on that (outermost) backward its end (``end_backward``); a bucket launches when
each of its parameters has its gradient in the ``accumulate``-th backward of the step. What happens
off that path:
- A backward that ends early (an exception from a hook, Ctrl-C): the next forward, or ``zero_grad()``,
  resets the step (``discard``): the buckets already launched keep their update, the others drop
  their gradient count, and an :class:`UncommittedStepWarning` names both. The next step then works.
- ``backward()`` without ``step()`` (gradient inspection) followed by ``zero_grad()``: the same reset
  and warning (every bucket took its update). A forward before ``step()`` warns that it reads the new
  weights; a second backward then raises (``accumulate=k``).
- Undoing a launched update needs a second copy of the host state of every bucket updated in the
  backward (the fp32 weights and both moments: 12 bytes per parameter), doubling the optimizer's
  host memory, the scarce resource here; so it is opt-in: with ``rollback`` each update first
  copies its parameters' state aside (``_save``, update thread), and the reset puts it back and
  re-copies the weights (``_restore``), without a warning: the step is undone whole, as
  ``zero_grad()`` undoes it for torch's optimizers. Not with ``delayed_update``, whose launch copies
  the previous update into the parameters (undoing that needs a second backup). ``step()`` commits simply by launching the next
  step's updates, which overwrite the copies. Without it, build the optimizer with
  ``pipeline=False`` to look at gradients without updating.
- A parameter whose gradient arrives in parts (a weight tied across blocks under recompute: each
  recomputed block runs its own backward) is updated once: a bucket holding a parameter that several
  blocks or modules use launches at the end of the backward instead of in a gradient hook. A
  block called twice in one forward is seen by its forward pre-hook and treated alike. A parameter
  found arriving twice in one backward otherwise is an error that says so, and its bucket launches at
  the end of every later backward.
- With ``max_grad_norm`` no update runs before ``step()``, so the reset drops them all: a real
  rollback, without a warning.
- The forward gate still orders the weights: a forward waits for every launched update of its
  blocks whatever the step's fate.
"""

from __future__ import annotations

import enum
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ooc.backend import Event
from ooc.errors import OocError
from ooc.optim.layout import release_buffers
from ooc.optim.loss_scale import LossScale, ScaleState
from ooc.optim.stages import Hyper, Job, Stage, StageListener, Stages

_WAIT_SLICE_S = 0.05

_JOIN_S = 5.0
"""How long :meth:`UpdatePipeline.close` waits for each host thread to take its STOP."""


class PipelineError(OocError, RuntimeError):
    """A host update or gradient exchange failed (the cause is chained), or a gradient arrived after
    its bucket's update started."""


class UncommittedStepWarning(UserWarning):
    """Updates a backward started were never committed by ``step()`` (NOTE [a step is a transaction])."""


@dataclass(frozen=True)
class PipelineConfig:
    """How the host updates are scheduled (the :class:`~ooc.optim.HostAdamW` options of the same names).

    - ``delayed_update``: a bucket's new weights are copied in at its launch in the next step.
    - ``accumulate``: backward passes per step; a bucket launches after its ``accumulate``-th gradient.
    - ``max_grad_norm``: clip by the global norm; the updates then wait for ``step()``.
    - ``loss_scale``: dynamic loss scaling (NOTE [loss scaling in the optimizer] in ooc.optim.loss_scale);
      the updates then wait for ``step()`` too.
    - ``rollback``: keep each bucket's host state from before its update until ``step()`` commits it,
      so that a step no ``step()`` commits is undone (NOTE [a step is a transaction]).
    - ``inline``: run every stage on the calling thread at ``step()`` (no overlap to gain: no model
      to pipeline with, no ranks to exchange with), which saves two thread hand-offs.
    """

    delayed_update: bool = False
    accumulate: int = 1
    max_grad_norm: float | None = None
    rollback: bool = False
    inline: bool = False
    loss_scale: LossScale | None = None

    @property
    def holds_updates(self) -> bool:
        """Whether the updates wait for ``step()``: the step's decision needs every gradient (the
        global norm's clip factor; whether the loss scale overflowed anywhere)."""
        return self.max_grad_norm is not None or self.loss_scale is not None

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate must be an int >= 1 (backward passes per step), got {self.accumulate!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.rollback and self.delayed_update:
            # The launch copies the previous update into the parameters inside the backward; undoing
            # that would need the weights from before it too (a second backup).
            raise ValueError("rollback=True cannot be combined with delayed_update=True: a step's launch already "
                             "copies the previous update into the parameters. Choose one.")


class Signal(enum.Enum):
    """Queue messages other than a bucket's job."""

    END_OF_STEP = "end of step"
    """``step()`` was called: every bucket of this step has been queued."""
    STOP = "stop"
    """The optimizer is closing: the thread ends."""
    DISCARD = "discard"
    """The step was reset without ``step()``: jobs held for clipping are dropped, not applied."""


Message = Job | Signal


@dataclass
class _BucketState:
    arrived: set[int] = field(default_factory=set)
    """Ids of the bucket's parameters whose gradient arrived in this backward."""
    launched: bool = False
    launched_in: int = -1
    """The serial number of the backward that launched the bucket (-1: ``step()``)."""
    forwards: int = 0
    """Forwards of the bucket's block in the model's current forward (recompute not counted)."""
    at_end: bool = False
    """Launch at the end of the backward (a parameter's gradient arrives in parts), not in a hook."""
    done: threading.Event = field(default_factory=threading.Event)
    gate: list[Event] = field(default_factory=list)
    """The H2D copies of the bucket's last copy in, which every gate waits for until the next copy in
    replaces them (NOTE [a gate waits on every stream])."""
    pending_h2d: bool = False
    """delayed_update: the staging buffer holds weights not yet copied to the parameters."""
    backed_up: bool = False
    """``rollback``: the backup holds the state from before this step's update (set on the update
    thread; cleared at launch)."""
    backed_up_ids: frozenset[int] = frozenset()
    """``rollback``: the ids of the parameters that update changed (on every rank), whose backups
    hold their state from before it."""
    held_readers: list[object] = field(default_factory=list)
    """Clipping: the compute streams (``Backend.compute_stream``) of the forwards that read the
    weights while this step's update was held for ``step()`` (NOTE [reads of held weights])."""
    after: tuple[Event, ...] = ()
    """Events of reads of the weights on other streams that the bucket's next copies in wait for
    (then cleared): clipping's compute event set by ``step()`` before it releases the update (NOTE
    [reads of held weights]), a checkpoint's copies (NOTE [weights read on another stream])."""

    def __post_init__(self) -> None:
        self.done.set()


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size: a gradient's bits read as integers (``_fingerprint``)."""


def _fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """The sum of the bits of every value of ``grad`` read as integers of its width, wrapping (a 0-d
    tensor on its device; NOTE [gradients read in the backward]). A bit-level view and a sum in that
    same dtype: no converted copy of the gradient, and an exact integer sum, so the same values give
    the same fingerprint whatever the reduction's order, and a changed value almost surely another
    (a change of one width-wide sum per changed gradient goes unseen: 2**-16 for bf16, 2**-32 for fp32)."""
    grad = grad.detach()
    bits = _SAME_WIDTH_INT[grad.element_size()]
    return grad.view(bits).sum(dtype=bits)


def _under_several_processes() -> bool:
    """A torch.distributed process group of more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _same_fingerprint(grad: torch.Tensor | None, before: torch.Tensor) -> bool:
    """``grad`` (a gradient now; ``None`` once dropped) has the values whose fingerprint is ``before``."""
    if grad is None or grad.element_size() != before.element_size():
        return False
    # On the host: a streamed weight's gradient may have moved to another device since (``grad_moved``).
    return torch.equal(_fingerprint(grad).cpu(), before.cpu())


class UpdatePipeline:
    """Runs the host AdamW updates of a :class:`~ooc.optim.HostAdamW`, bucket by bucket."""

    def __init__(self, stages: Stages, config: PipelineConfig,
                 listeners: Callable[[], Sequence[StageListener]] = tuple, shared: Sequence[int] = ()) -> None:
        """``listeners``: returns the callables to call with (bucket, stage) as each stage ends (NOTE
        [stage listeners] in ooc.optim.stages), looked up at each call. ``shared``: buckets holding a
        parameter that several blocks or modules use (launched at the end of the backward)."""
        self.stages = stages
        self.config = config
        self.buckets = stages.layout.buckets
        self.listeners = listeners
        self.status = [_BucketState(at_end=i in shared) for i in range(len(self.buckets))]
        self.in_backward = False
        """A backward of the model's outputs began and has not ended (cleared by ``end_backward``)."""
        self.backwards = 0
        """Backward passes ended since the last ``step()``."""
        self._short_steps = 0
        """``step()`` calls in a row that came after fewer than ``accumulate`` backward passes."""
        self._serial = 0
        self._backup: dict[int, dict[str, torch.Tensor]] = {}
        """``rollback``: per parameter id, a copy of its host state from before the bucket's last update."""
        if config.rollback:
            layout = stages.layout
            for bucket in self.buckets:
                for p in bucket.params:
                    if layout.mine(p):
                        self._backup[id(p)] = {name: torch.empty(p.shape, dtype=torch.float32)
                                               for name in ("target", "exp_avg", "exp_avg_sq")}
                        self._backup[id(p)]["step"] = torch.zeros((), dtype=torch.float32)
        self.error: BaseException | None = None
        self._reported = False
        """``error`` has been raised on the training thread (``raise_error``)."""
        self._read_grads: dict[int, tuple[int, torch.Tensor, torch.Tensor, int, torch.Tensor]] = {}
        """Per parameter id, (bucket, parameter, gradient, the gradient's version, its fingerprint) as a
        launch before ``step()`` read them (NOTE [gradients read in the backward])."""
        self._launched_hyper: dict[int, dict[int, Hyper]] = {}
        """Per bucket launched before ``step()``, the settings its job took (NOTE [settings read in the backward])."""
        self._grads_read_until: Event | None = None
        """The last copy out of a gradient issued since compute last waited for one (NOTE [gradients
        written after the backward])."""
        self._versions = self._written_weights_to_watch()
        """Per parameter id, the parameter's version counter when its master last took what was written
        into it (NOTE [weights written outside the optimizer])."""
        self._step_jobs: list[Job] = []
        self._others: dict[int, torch.Tensor] = {}
        """Clipping: the norms of the step's gradients no bucket holds (``finish_step``)."""
        self._coef: torch.Tensor | None = None
        self._clipped = threading.Event()
        """Held updates: ``_coef`` and ``skipped`` hold the last ``finish_step``'s clip factor and whether it
        skipped the step (set by the update thread)."""
        self._clipped.set()
        self.scale = ScaleState(config.loss_scale) if config.loss_scale is not None else None
        """The running loss scale (NOTE [loss scaling in the optimizer] in ooc.optim.loss_scale)."""
        self.skipped = False
        self._found_inf = False
        self.inline = config.inline and stages.comm is None
        self._exchange_q: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._update_q: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._threads = [] if self.inline else [
            threading.Thread(target=self._guard, args=(self._exchange_loop, True), name="ooc-exchange", daemon=True),
            threading.Thread(target=self._guard, args=(self._update_loop, True), name="ooc-host-update", daemon=True),
        ]
        self.closed = False
        for thread in self._threads:
            thread.start()

    def _ended(self, index: int, stage: Stage) -> None:
        for listener in self.listeners():
            listener(index, stage)

    # training thread ---------------------------------------------------------------------------

    def begin_backward(self) -> bool:
        """A backward through the model's outputs starts (a tensor hook on them). Returns whether it
        is a new one (the caller then queues ``end_backward`` on it)."""
        if self.in_backward:
            return False
        self.in_backward = True
        self._serial += 1
        return True

    def end_backward(self) -> None:
        """The backward ended (a callback queued on it): buckets waiting for its end launch; then
        the compute after it waits for their copies out (NOTE [gradients written after the backward])."""
        self.in_backward = False
        self.backwards += 1
        for i, status in enumerate(self.status):
            if status.arrived and not status.launched and status.at_end and self._last_backward():
                self.launch(i)
            status.arrived = set()
        self._order_grad_writes()

    def _order_grad_writes(self) -> None:
        """Make the compute stream wait for the copies out of the gradients issued so far, before
        any later kernel may write a gradient.

        NOTE [gradients written after the backward]
        A bucket's launch issues the D2H copies of its gradients on the copy stream (COPY_OUT, NOTE
        [the stages of one bucket] in ooc.optim.stages), and nothing made the compute stream wait
        for them: the exchange thread waits for them on the host, later. A loop or a framework
        writes the gradients in place between ``backward()`` and ``step()``: ``clip_grad_norm_``
        (``transformers.Trainer`` logs the norm with ``clip_grad_norm_(params, inf)`` after every
        backward, a multiply by 1), ``GradScaler.unscale_``, gradient noise, a scale of one's own;
        and so does a second backward's accumulation. On a GPU such a kernel ran while the copies of
        the buckets launched last (the first blocks' and the embeddings') still read the same
        memory, and the update took some values old and some new; on the CPU backend the order
        checker raised ``StreamOrderError`` (with ``delayed_update`` every parameter is copied out,
        so the plain CPU backend's Trainer runs failed now and then, and with chaos every time). So
        at the end of the backward (``end_backward``, after the launches that wait for it) and at
        every reset of the step (``step()`` launches the rest and resets) the compute stream waits
        for the last copy out issued (the copies on one engine run in issue order): a write after
        the backward lands after the copies have read the gradients as the backward left them. The
        update therefore always takes those (what NOTE [gradients read in the backward] promises,
        deterministically now); a change of their values makes ``step()`` raise, a scale by 1
        passes. The cost is a GPU-side wait (the host goes on queueing): the compute after the
        backward starts once the last bucket's gradients are on the host. The next forward waited
        for that already, with or without ``delayed_update``: its gate of each bucket waits on the
        host for the bucket's update, which follows its copies out, and the buckets launched last
        (the embeddings', the first blocks') are gated first. So only the loop's own work between
        the backward and that gate waits earlier. Not covered: a backward whose start the pipeline
        did not see (outputs its hook cannot reach), whose launches are ordered only at ``step()``;
        and own-master parameters (host fp32 on the plain CPU backend, not with ``delayed_update``),
        which have no copies out: the update thread reads their gradients themselves, so a change
        of values there races that read (a scale by 1 is harmless; ``step()`` refuses any other)."""
        last, self._grads_read_until = self._grads_read_until, None
        if last is not None:
            # The compute stream (the caller's: autograd runs final callbacks on it) must not write a
            # gradient while a copy out still reads it; one wait covers every earlier copy of the engine.
            self.stages.backend.wait_compute(last)

    def _last_backward(self) -> bool:
        """The backward under way (or just ended) is the step's last (``accumulate``). Where no
        backward was ever seen to start (outputs the hook could not reach), only ``accumulate=1``
        can tell: the rest launch at ``step()``."""
        if self._serial == 0:
            return self.config.accumulate == 1
        return self.backwards + (1 if self.in_backward else 0) >= self.config.accumulate

    def on_grad(self, bucket: int, p: object) -> None:
        """``p`` of ``bucket`` has its gradient for this backward (post-accumulate-grad hook)."""
        self.raise_error()
        status = self.status[bucket]
        name = self.buckets[bucket].name
        if id(p) in status.arrived:
            # The same backward delivers this parameter's gradient twice: it is used in several
            # places whose backward runs separately (a block called twice under recompute).
            at_end, status.at_end = status.at_end, True
            if status.launched and not at_end:
                raise PipelineError(
                    f"a parameter of {name} received a second gradient in the same backward, after its bucket's "
                    "host update had started: the parameter is used more than once (a block called twice, or a "
                    "weight shared with another module) and its gradient arrives in parts. This step updated it "
                    f"with a partial gradient; from now on {name} is updated at the end of each backward."
                )
            return
        if status.launched:
            if self.in_backward and status.launched_in == self._serial:
                raise PipelineError(
                    f"a gradient of {name} arrived after its host update started, in the same backward: a parameter "
                    "is shared with another bucket's module and its gradient arrives in parts."
                )
            raise PipelineError(self._too_many_backwards(name))
        status.arrived.add(id(p))
        # A frozen parameter (requires_grad=False, yet passed to the optimizer, as model.parameters()
        # does) never gets a gradient: counting it held the bucket's update until step().
        expected = sum(q.requires_grad for q in self.buckets[bucket].params)
        if not status.at_end and len(status.arrived) == expected and self._last_backward():
            self.launch(bucket)

    def _too_many_backwards(self, name: str) -> str:
        """The refusal of a backward past the step's last (``accumulate``): a framework's accumulation
        set apart from HostAdamW's is the usual cause, so it names both settings."""
        k = self.config.accumulate
        frameworks = ("transformers.Trainer's gradient_accumulation_steps, Lightning's accumulate_grad_batches, "
                      "or your loop's backward passes per step")
        if k == 1:
            return (f"a gradient of {name} arrived after its host update started: a second backward without step() "
                    "in between. For gradient accumulation over k backward passes per step, build HostAdamW with "
                    f"accumulate=k, k as in the loop that calls it ({frameworks}).")
        return (f"a gradient of {name} arrived after its host update started: backward pass {self.backwards + 1} "
                f"since the last step(), but HostAdamW(accumulate={k}) updates after backward pass {k}. Build it with "
                f"accumulate= equal to the backward passes per step ({frameworks}).")

    def before_block_forward(self, index: int) -> None:
        """A block's forward (not a recompute inside the backward) is about to run: a block called
        twice in one forward gets its gradient in parts, so its bucket launches at the end of the
        backward. Then its weights must be this step's (the gate)."""
        status = self.status[index]
        if not self.in_backward:
            status.forwards += 1
            if status.forwards > 1:
                status.at_end = True
        self.gate((index,))

    def before_forward(self, outside: Sequence[int]) -> None:
        """The model's forward is about to run: a backward that never ended resets the step (NOTE [a
        step is a transaction]); the modules outside the chain get their new weights (the gate)."""
        if self.in_backward:
            if self.stages.comm is not None and not any(status.launched for status in self.status):
                raise PipelineError(
                    "the previous backward ended early (an exception or an interrupt) and neither step() nor "
                    "zero_grad() followed: its partial gradients are in .grad, and this step would sum them across the "
                    "ranks with its own. Call zero_grad() and run the step again (no rank has exchanged any of it yet)."
                )
            self.discard("the previous backward ended early (an exception or an interrupt) and no step() followed")
        launched = [b.name for b, s in zip(self.buckets, self.status) if s.launched]
        if launched and not self.config.holds_updates:  # held, they wait for step(): old weights
            warnings.warn(
                f"a forward between the backward and step(): the host updates of {', '.join(launched)} started in "
                "the backward (pipeline=True), so this forward reads their new weights. Call step() first, or build "
                "HostAdamW with pipeline=False.", UncommittedStepWarning, stacklevel=3)
        for status in self.status:
            status.forwards = 0
        self.gate(outside)

    def open_step(self) -> bool:
        """Some bucket launched, or a backward started, since the last ``step()``."""
        return self.in_backward or any(s.launched or s.arrived for s in self.status)

    def discard(self, why: str, *, warn: bool = True) -> str:
        """Reset a step that no ``step()`` will commit (NOTE [a step is a transaction]): with
        ``rollback`` (or clipping) the launched updates are undone, else a warning names them (they
        stay applied). Returns what the warning says of them ("" if undone), for a caller that raises
        instead (``warn=False``: one message, not a warning and an error about the same step)."""
        launched = [self.buckets[i].name for i, s in enumerate(self.status) if s.launched]
        # NOTE [a backward that ended early]
        # Data-parallel, a backward that raised on one rank (an error in a block, a KeyboardInterrupt
        # caught by the loop) before any of its buckets launched has sent nothing to the others, which
        # wait in this step's exchange: zero_grad() resets it, and the step run again meets them. With
        # pipeline=False (no bucket launches before step()) nothing watched the backward, and a loop
        # that went on without zero_grad() summed the partial gradients into the next step without a
        # word (DistributedDataParallel refuses that forward): before_forward refuses it now. Once a
        # bucket has launched, its exchange has begun, and no rank can take the step back.
        if self.stages.comm is not None and launched:
            raise PipelineError(
                f"{why}: the ranks cannot agree on a half-done data-parallel step. Restart the ranks from a checkpoint."
            )
        if self.config.rollback and not self.config.holds_updates:
            for i, status in enumerate(self.status):
                if status.launched:
                    self._wait_done(i)
                    self._restore(i)
        elif self.config.holds_updates:
            # Clipping (or loss scaling) holds every update until step() (NOTE [clipping stalls the pipeline]): none ran,
            # so dropping them undoes the step whole, as zero_grad() does for torch's optimizers.
            if launched:
                self._to_exchange(Signal.DISCARD)
        elif launched and not self.config.rollback:
            others = [self.buckets[i].name for i, s in enumerate(self.status) if not s.launched]
            applied = (f"the host updates of {', '.join(launched)} had started and are applied (pipeline=True updates "
                       "weights during the backward)" + (f"; {', '.join(others)} took no update" if others else ""))
            if warn:
                warnings.warn(
                    f"{why}: {applied}. The step is reset; call zero_grad() before the next backward. To inspect "
                    "gradients without updating, build HostAdamW with pipeline=False (or rollback=True to undo such "
                    "steps).", UncommittedStepWarning, stacklevel=3)
            self._reset()
            return applied
        self._reset()
        return ""

    def supersede(self) -> None:
        """``load_state_dict`` with a step open (a backward no ``step()`` followed, as when a step
        raised and the loop restores a checkpoint): the state loaded next replaces whatever the
        step's launched updates did, so they are neither undone nor reported at the next
        ``zero_grad()`` (with ``rollback`` that put the state from before them back over the loaded
        one). With clipping the step's updates are held until ``step()``, and are left to
        :meth:`discard`."""
        if self.config.holds_updates:
            return
        if self.stages.comm is not None and any(s.launched for s in self.status):
            self.discard("load_state_dict() after a backward without step()")  # raises: ranks cannot agree
        self._reset()

    def _restore(self, index: int) -> None:
        """``rollback``: put back the bucket's host state from before this step's update, and its
        weights (the update thread is idle for this bucket: its job is done)."""
        status = self.status[index]
        if not status.backed_up:
            return  # launched without gradients: nothing was updated
        layout, state_of = self.stages.layout, self.stages.state.state_of
        restored = []
        with torch.no_grad():
            for p in self.buckets[index].params:
                backup = self._backup.get(id(p))
                if backup is None or id(p) not in status.backed_up_ids:
                    continue  # another rank's, or without a gradient: the update left it alone
                state = state_of(p)
                state.get("master", layout.home[id(p)]).copy_(backup["target"])
                for name in ("exp_avg", "exp_avg_sq", "step"):
                    state[name].copy_(backup[name])
                restored.append(id(p))
        status.backed_up = False
        if self.config.delayed_update:
            status.pending_h2d = False  # the parameters hold the restored weights already (copied at launch)
            return
        self.stages.stage_weights(index, restored, arriving=status.backed_up_ids)
        # The update's own copies into the parameters were issued; these follow them on the copy
        # stream, and the bucket's next forward waits for them (the gate). They also wait for the
        # compute queued so far: a forward since the backward (warned: it read the new weights) may
        # still be reading the weights they overwrite.
        status.gate = self.stages.copy_in(index, after=(self.stages.backend.record_compute(), *status.after))
        status.after = ()

    def _save(self, job: Job) -> None:
        """``rollback``: the host state of the job's parameters, before the update changes it."""
        layout, state_of = self.stages.layout, self.stages.state.state_of
        with torch.no_grad():
            for pid in job.grads:
                backup = self._backup.get(pid)
                if backup is None:
                    continue
                p = layout.params[pid]
                state = state_of(p)
                backup["target"].copy_(state.get("master", layout.home[pid]))
                for name in ("exp_avg", "exp_avg_sq", "step"):
                    backup[name].copy_(state[name])
        self.status[job.bucket].backed_up_ids = job.present
        self.status[job.bucket].backed_up = True

    def _reset(self) -> None:
        self.in_backward = False
        self.backwards = 0
        for status in self.status:
            status.arrived = set()
            status.launched = False
            status.held_readers = []
        self._read_grads = {}
        self._launched_hyper = {}
        self._order_grad_writes()

    def launch(self, index: int) -> None:
        """Hand the bucket's gradients to the host: issue their copies out and queue the update."""
        status = self.status[index]
        job = self.stages.job(index)
        if self.config.rollback:
            self._wait_done(index)  # the previous step's update has set its backed_up flag
        status.launched = True
        status.launched_in = self._serial if self.in_backward else -1
        status.backed_up = False
        for p in self.buckets[index].params:
            self.note_grad(index, p)
        self._launched_hyper[index] = job.hyper
        if not job.grads and self.stages.comm is None:
            return
        # Data-parallel, a bucket without gradients here goes on all the same: another rank's may
        # have some, which this rank then updates with (NOTE [gradients missing on some ranks]).
        # The previous step's job of this bucket must be done with its buffers before they are
        # rewritten (it is, unless delayed_update: then its update had this whole step to finish).
        self._wait_done(index)
        self._adopt_written_weights(index)
        status.done.clear()
        try:
            compute, last_copy = self.stages.copy_out(job)
            if last_copy is not None:
                self._grads_read_until = last_copy  # waited for at the backward's end (_order_grad_writes)
            if self.config.delayed_update and status.pending_h2d:
                # The previous update's weights go in now that this step's backward of the bucket has
                # read the old ones: this hook runs when the host has *queued* that backward, so the
                # copies wait on the compute event recorded after it, not just on the host reaching here
                # (and on reads of the old ones on other streams: NOTE [weights read on another stream]).
                status.gate = self.stages.copy_in(index, after=(compute, *status.after))
                status.after = ()
                status.pending_h2d = False
                self._ended(index, Stage.COPY_IN)
            self._ended(index, Stage.COPY_OUT)
        except BaseException as exc:
            # No job will set this bucket's done: stop as a failed stage on a host thread does, or
            # every later wait for the bucket would hang (NOTE [stage listeners]).
            self._stop(exc)
            raise
        self._to_exchange(job)

    def _written_weights_to_watch(self) -> dict[int, int]:
        """The parameters whose master is a copy of their own (not with ``delayed_update``, whose
        parameters lag their masters on purpose; not a streamed weight, whose home is its host copy),
        with their version counters now."""
        if self.config.delayed_update:
            return {}
        layout = self.stages.layout
        return {id(p): p._version for bucket in self.buckets for p in bucket.params
                if layout.home[id(p)] is p and layout.mine(p) and "master" in self.stages.state.state_of(p)}

    def watch_written_weights(self, params: Sequence[torch.Tensor]) -> None:
        """``params`` hold their masters' values (a load the masters adopted): their writes count from
        now (NOTE [weights written outside the optimizer])."""
        for p in params:
            if id(p) in self._versions:
                self._versions[id(p)] = p._version

    @torch.no_grad()
    def _adopt_written_weights(self, index: int) -> None:
        """Before the bucket's update reads its masters: values written into its parameters since
        (outside the optimizer) go into the masters.

        NOTE [weights written outside the optimizer]
        A parameter that is not its own master (bf16 and fp16 ones; on a GPU every one) holds a copy
        of its fp32 master on the host, and each update starts from the master. A write into the
        parameter after ``step()`` -- a weight clamp (a WGAN critic's), a max-norm projection, a mask,
        what ``torch.optim.AdamW`` simply updates from -- was lost at the next update, and the weights
        drifted from AdamW's without a word. The optimizer's own copies into the parameters write
        through ``.data``, which leaves the version counter alone, so a changed counter means
        someone else wrote: then the values that differ from the master's, cast to the parameter's
        dtype, go into the master (one copy to the host of the parameter; values the master already
        holds, as after a load whose master it adopted or a checkpoint restore, keep its fp32 bits).
        Writes through ``.data`` are not seen (``model.load_state_dict`` is: NOTE [loads into the
        model] in ooc.optim.host_adamw); a write before the optimizer's copies of the same step land
        (without ``synchronize()``) is overwritten by them, as the class doc says."""
        for p in self.buckets[index].params:
            seen = self._versions.get(id(p))
            if seen is None or p._version == seen:
                continue
            master = self.stages.state.state_of(p)["master"]
            now = p.detach().to("cpu")  # a device copy waits for the write
            changed = now != master.to(p.dtype)
            master[changed] = now[changed].to(master.dtype)
            self._versions[id(p)] = p._version

    def _to_exchange(self, item: Message) -> None:
        if not self.inline:
            self._exchange_q.put(item)
            return
        self.raise_error()
        self._guard(lambda: self._on_update_item(item) if isinstance(item, Signal) else self._exchange(item))
        self.raise_error()

    def _to_update(self, job: Job) -> None:
        if self.inline:
            self._on_update_item(job)
        else:
            self._update_q.put(job)

    def finish_step(self, others: dict[int, torch.Tensor] | None = None, found_inf: bool = False) -> None:
        """``step()``: launch what no hook launched (unused parameters, no model), and close the step.
        ``others``: with clipping, the norms of gradients no bucket holds (``Stages.clip``); the
        clip factor is then :meth:`clip_factor`'s. ``found_inf``: with loss scaling, whether a
        gradient no bucket holds overflowed (``skipped`` then says whether the step was skipped)."""
        self.raise_error()
        self._check_grads_unchanged()
        self._check_settings_unchanged()
        if self.config.holds_updates:
            # The last step's clip must have read its norms and set its factor before these replace
            # them: a step() without device-kept gradients does not wait for it (the update thread
            # may still be behind when nothing else waited on it, as after a step without gradients).
            self.clip_factor()
        recorded: list[tuple[object, Event]] = []
        for status in self.status:
            for stream in status.held_readers:
                # NOTE [reads of held weights]: the copies in must not pass the forwards queued so
                # far on any stream that read the weights; one event per stream, after them.
                event = next((e for s, e in recorded if s == stream), None)
                if event is None:
                    event = self.stages.backend.record_on(stream)
                    recorded.append((stream, event))
                status.after = (*status.after, event)
            status.held_readers = []
        self._check_window()
        for i, status in enumerate(self.status):
            if not status.launched:
                self.launch(i)
        # Only now, with the end queued next: a launch that raised leaves no clip to wait for.
        self._others = others or {}
        self._found_inf = found_inf
        self._clipped.clear()
        self._to_exchange(Signal.END_OF_STEP)
        self._reset()

    def _check_window(self) -> None:
        """Warn once where ``step()`` keeps coming before the ``accumulate``-th backward: a framework
        stepping every batch (``transformers.Trainer``'s ``gradient_accumulation_steps`` or Lightning's
        ``accumulate_grad_batches`` left at 1) under ``HostAdamW(accumulate=k)`` trained without the
        accumulation the user set there, each update waiting for ``step()``, without a word. One short
        window is an epoch's end; two in a row is the sign (a backward the hooks never saw counts none)."""
        k = self.config.accumulate
        if not 0 < self.backwards < k:
            self._short_steps = 0
            return
        self._short_steps += 1
        if self._short_steps == 2:
            warnings.warn(
                f"step() came after {self.backwards} backward pass(es), twice in a row, but HostAdamW(accumulate={k}) "
                f"expects {k} per step: each step() updates with the gradients of the passes it got (no "
                f"accumulation over {k}), and the updates wait for step() instead of running in the backward. "
                "Build HostAdamW with accumulate= equal to the backward passes per step (transformers.Trainer's "
                "gradient_accumulation_steps, Lightning's accumulate_grad_batches).", UserWarning, stacklevel=4)

    def _check_grads_unchanged(self) -> None:
        """Raise if a gradient a launch before ``step()`` read was changed or replaced since.

        NOTE [gradients read in the backward]
        A bucket launched in the backward copies (or, own-master, reads) its gradients then, not at
        ``step()``. A change to them in between -- ``torch.nn.utils.clip_grad_norm_`` or
        ``GradScaler.unscale_`` in the user's loop, ``transformers.Trainer``'s clipping at its default
        ``max_grad_norm=1.0`` -- came too late and the updates used the gradients as they were,
        without a word. Each launch notes every gradient's version counter (bumped by any in-place
        op) and a fingerprint of all its values (``_fingerprint``: one read of the gradient on its
        device); ``step()`` compares the fingerprints of those an op wrote since: a change makes it
        reset the step (NOTE [a step is a transaction]) and raise, saying how to clip. A scale by 1
        (``transformers.Trainer`` logs the norm with ``clip_grad_norm_(..., inf)``; a clip under a
        norm below its limit) changes nothing and passes. The change itself waits for the launches'
        copies out, so the update took the gradients as the backward left them, not some values of
        each (NOTE [gradients written after the backward]). The check used to compare only the first 16
        values of each gradient, and let a change that spared them through: ``clip_grad_value_``
        (Lightning's ``gradient_clip_algorithm="value"``) clamping other values, rows masked after
        the backward. ooc itself writes no gradient there; it moves a streamed weight's to a new
        tensor of the same values, which the check follows (``grad_moved``).
        Data-parallel, the gradients between the backward and ``step()`` are each rank's own, not the
        average DistributedDataParallel leaves there: a clip in the loop clipped each rank by its own
        norm, and with ``pipeline=False`` (which the advice below named) nothing read them before
        ``step()`` and the weights parted from DDP's without a word. So data-parallel HostAdamW notes
        every gradient as it arrives (``note_grad``), pipelined or not, and the check refuses any
        change, pointing to ``max_grad_norm=``."""
        touched = [(bucket, p, before) for bucket, p, grad, version, before in self._read_grads.values()
                   if p.grad is not grad or grad._version != version]
        # Values compared only where an op wrote (a device read waits for it; rare): a scale by 1.0
        # (Trainer's clip_grad_norm_(..., inf) that only logs the norm) changes nothing.
        changed = sorted({bucket for bucket, p, before in touched if not _same_fingerprint(p.grad, before)})
        if not changed:
            return
        changed = [self.buckets[i].name for i in changed]
        if self.stages.comm is not None:
            # Not reset: the other ranks may be in this step's exchange already (a rank whose clip
            # changed nothing goes on), so this rank cannot run it again alone.
            raise PipelineError(
                f"the gradients of {', '.join(changed)} changed between the backward and step() (e.g. "
                "torch.nn.utils.clip_grad_norm_, clip_grad_value_ or GradScaler.unscale_ in the loop): with "
                "data_parallel, the gradients a loop sees there are this rank's own, not yet averaged across the ranks "
                "as DistributedDataParallel's are, so a clip there clips each rank by its own norm and the weights "
                "part from DDP's. Clip by norm with HostAdamW(max_grad_norm=...), which clips the averaged gradients "
                "by their global norm; for a GradScaler (fp16), HostAdamW(loss_scale=ooc.optim.LossScale()) with "
                "opt.scale(loss).backward(), which skips a step on every rank alike. Restart the ranks (from a "
                "checkpoint if this step's updates began)"
            )
        why = (f"the gradients of {', '.join(changed)} changed between the backward and step(), after their host "
               "update had read them (e.g. torch.nn.utils.clip_grad_norm_, clip_grad_value_ or GradScaler.unscale_ in "
               "the loop; Lightning's gradient_clip_val; transformers.Trainer clips at its default max_grad_norm=1.0)")
        applied = self.discard(why, warn=False)
        reset = (f"The step was reset, but {applied}: call zero_grad() before the next backward" if applied else
                 "The step was reset, its updates undone: call zero_grad() and run it again")
        if self.stages.comm is None and _under_several_processes():
            raise PipelineError(
                f"{why}: with several processes, the likely cause is torch's DistributedDataParallel (accelerate and "
                "transformers.Trainer wrap the model in it), which averages the gradients across ranks at the end of the "
                "backward, after a pipelined HostAdamW read each rank's own. Train data-parallel with HostAdamW("
                "data_parallel=ooc.distributed.DataParallel(...)) on the model not wrapped in DistributedDataParallel, "
                "which averages each block's gradients before its update, or build HostAdamW(pipeline=False) to read "
                f"them in step(). {reset}"
            )
        raise PipelineError(
            f"{why}: a pipelined HostAdamW reads each block's gradients as its backward ends, so the change came too "
            "late. Clip by norm with HostAdamW(max_grad_norm=...) (with transformers.Trainer also TrainingArguments("
            "max_grad_norm=0), with Lightning no gradient_clip_val); for a GradScaler (fp16), scale with "
            "HostAdamW(loss_scale=ooc.optim.LossScale()) and opt.scale(loss).backward(); or build HostAdamW(pipeline=False) "
            f"to read the gradients in step() (any other change to them). {reset}"
        )

    def _check_settings_unchanged(self) -> None:
        """Raise if a parameter group's settings changed since a bucket launched with them before ``step()``.

        NOTE [settings read in the backward]
        A bucket's job takes its groups' learning rate, betas, eps and weight decay at its launch, in
        the backward (``Stages.job``), as it takes the gradients. A loop that sets the learning rate
        between ``backward()`` and ``step()`` (``for g in opt.param_groups: g["lr"] = get_lr(step)``
        right before ``opt.step()``, as build-nanogpt and llm.c do; a ``transformers.Trainer`` callback's
        ``on_pre_optimizer_step``) had the host buckets updated with the last step's value and the
        parameters kept on the device (``device_params_below``) with the new one, without a word. So
        ``step()`` compares: a change resets the step (NOTE [a step is a transaction]) and raises, saying
        to set it before the backward (an LR scheduler stepped after ``opt.step()`` does) or to build
        ``pipeline=False``."""
        if not self._launched_hyper:
            return
        state, layout = self.stages.state, self.stages.layout
        changed = sorted({index for index, hyper in self._launched_hyper.items()
                          if any(h != state.hyper_of(layout.params[pid]) for pid, h in hyper.items())})
        if not changed:
            return
        names = ", ".join(self.buckets[i].name for i in changed)
        why = (f"a parameter group's lr, betas, eps or weight_decay changed between the backward and step(), after "
               f"the host updates of {names} had taken them at their launch in the backward")
        fix = ("Set them before the backward (an LR scheduler's step() after opt.step() does; a loop that sets "
               "param_groups' lr right before opt.step() should set it before the forward), or build "
               "HostAdamW(pipeline=False), which reads them in step()")
        if self.stages.comm is not None:
            # Not reset: the other ranks may be in this step's exchange already (NOTE [gradients read in the backward]).
            raise PipelineError(f"{why}. {fix}. Restart the ranks (from a checkpoint if this step's updates began)")
        applied = self.discard(why, warn=False)
        reset = (f"The step was reset, but {applied}: call zero_grad() before the next backward" if applied else
                 "The step was reset, its updates undone: call zero_grad() and run it again")
        raise PipelineError(f"{why}. {fix}. {reset}")

    def note_grad(self, bucket: int, p: torch.Tensor) -> None:
        """Note the gradient of ``p`` (of ``bucket``) as it is now, for ``step()`` to check that it
        stays so (NOTE [gradients read in the backward])."""
        if (grad := p.grad) is not None:
            self._read_grads[id(p)] = (bucket, p, grad, grad._version, _fingerprint(grad))

    def forget_grads(self) -> None:
        """``zero_grad()``: the gradients noted are gone."""
        self._read_grads = {}

    def grad_moved(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """ooc moved ``param``'s gradient to a new tensor of the same values (a streamed weight's,
        between device and host): the check at ``step()`` follows it (NOTE [gradients read in the
        backward])."""
        read = self._read_grads.get(id(param))
        if read is not None:
            self._read_grads[id(param)] = (read[0], param, grad, grad._version, read[4])

    def after_load(self) -> None:
        """After ``load_state_dict`` with ``delayed_update``: the loaded masters are the update the
        parameters have not taken yet, so they become the pending copy-in of each bucket (sharded:
        each owner's share is broadcast now, while the update thread is idle)."""
        if not self.config.delayed_update:
            return
        layout, state = self.stages.layout, self.stages.state
        for index, bucket in enumerate(self.buckets):
            mine = [id(p) for p in bucket.params if layout.mine(p) and "master" in state.state_of(p)]
            self.stages.stage_weights(index, mine, arriving=[id(p) for p in bucket.params])
            self.status[index].pending_h2d = True

    def gate(self, indices: Sequence[int]) -> None:
        """Before a forward: the weights of these buckets must be the updated ones.

        NOTE [a gate waits on every stream]
        The wait for a bucket's copies in is a GPU-side wait of the caller's current stream
        (``wait_compute``), not of the host: it orders only the work queued on that stream later.
        The gate used to forget the copies' events once one caller had waited for them, so a
        ``synchronize()`` made on one stream left the forward on another unordered after them:
        training under ``with torch.cuda.stream(s)`` with ``ckpt.save()``, ``opt.synchronize()`` or
        ``model.state_dict()`` outside that block (on the default stream), or from another thread.
        The next forward's gate then found nothing to wait for and read weights the H2D copies were
        still writing (some of the last update's, some of the one before). So the events stay until
        the bucket's next copy in replaces them, and every gate waits for the last of them on its own
        stream (one wait per bucket and forward: a wait for a copy that is done costs the host a few
        microseconds and the stream nothing)."""
        for i in indices:
            if self._held_for_step(i):
                readers, stream = self.status[i].held_readers, self.stages.backend.compute_stream()
                if stream not in readers:
                    readers.append(stream)
            else:
                self._wait_done(i)
            if self.status[i].gate:
                # The caller's stream reads these parameters next: it must not pass their H2D copies,
                # whichever stream waited for them before (NOTE [a gate waits on every stream]). The
                # copies went in order on the backend's one H2D stream: the last one's event covers all.
                self.stages.backend.wait_compute(self.status[i].gate[-1])

    def copies_in_after(self, event: Event) -> None:
        """Every bucket's next copies into its parameters wait for ``event``, recorded after reads of
        the weights on a stream the training's compute may not wait for.

        NOTE [weights read on another stream]
        The gate orders a reader after the copies in (NOTE [a gate waits on every stream]); the other
        way round, a bucket's copies in wait only for the training's own compute: the update's for
        the compute event recorded after the bucket's backward (the exchange waited for it), a
        ``delayed_update`` launch's for that event itself. A checkpoint that copies the live weights
        to the host without waiting (``Checkpointer.save`` without a lazy snapshot: ``delayed_update``
        or ``lazy=False``; NOTE [device state copied asynchronously] in ooc.checkpoint) issues them on
        its caller's stream. Called outside the training's ``with torch.cuda.stream(s)`` block, those
        copies were ordered before nothing of the next step: its copies in could overwrite weights
        the version had not read yet (one queued behind other work on the default stream), and the
        version held some weights of the next update under valid checksums. So the reader hands the
        event recorded after its reads here, and the next copies in of each bucket wait for it on the
        copy stream (``after``): the training's stream waits for nothing. A bucket that copies nothing
        in for a long while (frozen parameters) keeps only the events not yet complete, not one per save."""
        for status in self.status:
            status.after = (*(e for e in status.after if not e.query()), event)

    def _held_for_step(self, index: int) -> bool:
        """The bucket's update of this step is held until ``step()`` (clipping: NOTE [clipping stalls
        the pipeline]): it has not touched the weights, and waiting for it before ``step()`` would
        wait forever (a forward, ``state_dict()`` or a restore after a backward without ``step()``).
        Its launch waited for the bucket's previous update, whose copies in the gate still holds.

        NOTE [reads of held weights]
        Such a forward reads the weights the held update's copies in will overwrite once ``step()``
        releases it, and those copies wait on no compute event of their own (NOTE [the pipeline of
        one bucket]: the exchange waited for the one after the bucket's backward, which this forward
        follows). On a GPU its kernels may still be queued then: so ``step()`` records a compute
        event after them, and the update's copies in wait for it (``_BucketState.after``). The event
        was recorded on ``step()``'s stream alone, so a forward on another stream (an evaluation under
        ``with torch.cuda.stream(e)``; another thread on the CPU twin) could still be reading the
        weights when the copies overwrote them: each gate notes its caller's stream, and ``step()``
        records the event on every stream noted (``Backend.record_on``)."""
        return self.config.holds_updates and self.status[index].launched

    def clip_factor(self) -> torch.Tensor | None:
        """With held updates, after ``finish_step``: wait for the step's decision; the clip factor
        (None: no gradient, no clipping, or a skipped step)."""
        while not self._clipped.wait(_WAIT_SLICE_S):
            self.raise_error()
        self.raise_error()
        return self._coef

    def held(self) -> list[int]:
        """The buckets whose update of this step is held until ``step()`` (``_held_for_step``)."""
        return [i for i in range(len(self.status)) if self._held_for_step(i)]

    def applied(self) -> list[int]:
        """The buckets whose update of the open step started in the backward, which no ``step()`` has
        committed yet (not those clipping holds for ``step()``)."""
        if self.config.holds_updates:
            return []
        return [i for i, s in enumerate(self.status) if s.launched]

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
            self._reported = True
            raise PipelineError(
                f"ooc's host optimizer stopped: {self.error}. It cannot go on (this step's updates may have reached "
                "some buckets and not others): close() it, restore the model and optimizer from your last checkpoint "
                "and build a new HostAdamW") from self.error

    def settle(self) -> None:
        """Before ``close()``: wait for the updates of the steps ``step()`` closed, and raise a failure of
        the host threads that nothing has raised yet.

        NOTE [close waits for the last step]
        ``step()`` returns with the updates of its last buckets (and, data-parallel, their exchange)
        still running, and ``zero_grad()`` after it waits for nothing. ``close()`` stopped the threads
        at once, giving each :data:`_JOIN_S` to end, so a loop that closed the optimizer after its last
        ``step()`` and read or saved the weights could get some buckets without that step's update, or
        in the middle of it, without a word: data-parallel, whenever another rank reached the last
        exchange more than twice that late (its batch was longer); and an exchange that failed then (a
        rank gone) was never reported. The buckets a step still open launched are not waited for:
        their exchange may wait for buckets this rank never launches (a backward that raised), and
        ``step()`` never committed them."""
        if self.error is None:
            self.gate([i for i, status in enumerate(self.status) if not status.launched])  # raises a failure
        elif not self._reported:
            self.raise_error()

    def holds_delayed(self) -> bool:
        """``delayed_update``: some bucket's last committed update is still only in its staged weights."""
        return self.config.delayed_update and any(s.pending_h2d and not s.launched for s in self.status)

    def flush_delayed(self) -> None:
        """``delayed_update``, once training is over (``close()``, after :meth:`settle`): copy each
        bucket's staged weights, the last committed update, into its parameters, so the model holds
        the newest weights (NOTE [the last delayed update at the end]). A bucket that an open step
        launched is left alone: its staged weights are that uncommitted step's.

        NOTE [the last delayed update at the end]
        With ``delayed_update`` a bucket's new weights go in at its launch in the next step, so after
        the last ``step()`` only the masters held its update: ``model.state_dict()``, ``torch.save``
        and HF's ``save_pretrained`` after ``close()`` gave the weights one update behind the
        optimizer. ``synchronize()`` keeps the lag (the next forward must run on the older weights,
        or the delayed schedule changes); ``close()`` ends training, so it puts the update in.
        A streamed parameter's copies go into its home, the streamer's host copy; after ``ooc.unwrap``
        (which brings it back to the device, before ``close()``) the parameter no longer reads that
        copy, so its data then takes the home's new weights too."""
        if not self.config.delayed_update or self.error is not None:
            return
        # The copies may overwrite weights that compute queued so far still reads (a forward since
        # the last step): they wait for it.
        after = (self.stages.backend.record_compute(),)
        events = []
        flushed: list[int] = []
        for index, status in enumerate(self.status):
            if status.pending_h2d and not status.launched:
                flushed += self.stages.staged[index]
                events += self.stages.copy_in(index, after=(*after, *status.after))
                status.after = ()
                status.pending_h2d = False
                self._ended(index, Stage.COPY_IN)
        for event in events:
            # The host waits: close() releases the staging buffers these copies read, and the caller
            # reads the parameters next.
            event.synchronize()
        self._into_moved_weights(flushed)

    @torch.no_grad()
    def _into_moved_weights(self, ids: Sequence[int]) -> None:
        """The parameters ``ids`` whose data is no longer their home (a streamed weight ``ooc.unwrap``
        brought back to the device) take their home's weights (NOTE [the last delayed update at the end])."""
        layout = self.stages.layout
        for pid in ids:
            p, home = layout.params[pid], layout.home[pid]
            data = p.data
            if home is p or data.data_ptr() == home.data_ptr() or data.shape != home.shape or data.dtype != home.dtype:
                continue  # its home, or a tensor of another shape or dtype the caller put there since
            # Through .data, as the optimizer's copies in write (NOTE [weights written outside the
            # optimizer]). A synchronous copy on the compute stream, after the work queued there that
            # reads the parameter; the host (the optimizer's caller) reads it next.
            data.copy_(home)

    def close(self) -> None:
        """Stop the host threads (at most a few seconds each) and free the buffers.

        NOTE [threads stop at exit]
        A script that ended, or raised, with a HostAdamW still open used to leave its two daemon
        threads to the interpreter's teardown, and the process died with SIGABRT ("terminate
        called without an active exception") about one time in eight, after the script's own
        output. HostAdamW therefore also closes its pipeline at exit (``weakref.finalize``, run by
        ``atexit``): the threads take their STOP and end before the interpreter does, and so do the
        CPU backend's copy engines. No collective runs then (the communicator is closed only by
        ``close()``)."""
        if not self.closed:
            self.closed = True
            self._exchange_q.put(Signal.STOP)
            for thread in self._threads:
                thread.join(timeout=_JOIN_S)
            if not any(thread.is_alive() for thread in self._threads):
                # A thread still running may still use the buffers: they stay carved (a leak, not a race).
                release_buffers(self.stages.layout, self.stages.backend)

    # worker threads ----------------------------------------------------------------------------

    def _guard(self, loop: Callable[[], None], own_thread: bool = False) -> None:
        """Run ``loop``; a failure stops the optimizer. ``own_thread``: on a thread of the pipeline's
        own, whose device work goes on a stream of its own (NOTE [a stream per ooc thread] in
        ooc.backend.cuda); not inline on the training thread, whose stream is its compute's."""
        try:
            # Before any CUDA call of this thread: its current device is the model's, not cuda:0.
            self.stages.backend.bind_thread(own_stream=own_thread)
            loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._stop(exc)

    def _stop(self, exc: BaseException) -> None:
        """A stage failed with ``exc``: the optimizer stops; every waiter wakes up and raises it."""
        self.error = exc
        for status in self.status:
            status.done.set()
        self._update_q.put(Signal.STOP)

    def _exchange_loop(self) -> None:
        held: dict[int, Job] = {}
        expected = 0
        while True:
            item = self._exchange_q.get()
            if item is Signal.STOP:
                self._update_q.put(Signal.STOP)
                return
            if item is Signal.DISCARD:
                self._update_q.put(item)  # nothing is held: only without data parallelism
                continue
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
        self.stages.exchange(job)
        if not job.grads:
            self.status[job.bucket].done.set()  # no rank had a gradient for it: nothing to update
            return
        self._ended(job.bucket, Stage.EXCHANGE)
        self._to_update(job)

    def _update_loop(self) -> None:
        while (item := self._update_q.get()) is not Signal.STOP:
            self._on_update_item(item)

    def _on_update_item(self, item: Message) -> None:
        if item is Signal.DISCARD:
            for job in self._step_jobs:
                self.status[job.bucket].done.set()
            self._step_jobs = []
            return
        if item is Signal.END_OF_STEP:
            if self.config.holds_updates:
                self._end_held_step()
            self._step_jobs = []
            return
        if self.config.holds_updates:
            # NOTE [clipping stalls the pipeline]: the global norm needs every bucket's gradient,
            # so with clipping the updates wait for step(); only the copies out and the exchange
            # still overlap the backward.
            self.stages.to_host_fp32(item)
            self._step_jobs.append(item)
            return
        self._update(item)

    def _end_held_step(self) -> None:
        """``step()`` closed a step whose updates were held: unscale and check the gradients (loss
        scaling), clip them, and run the updates, or skip them all if a gradient overflowed."""
        skipped = False
        if self.scale is not None:
            skipped = self.stages.unscale(self._step_jobs, self.scale.inverse(), self._found_inf)
            self.scale.update(skipped)
        self._coef = None
        if not skipped and self.config.max_grad_norm is not None:
            self._coef = self.stages.clip(self._step_jobs, self._others)
        self.skipped = skipped
        self._clipped.set()
        for job in self._step_jobs:
            if skipped:
                self.status[job.bucket].done.set()  # NOTE [loss scaling in the optimizer]: no update
            else:
                self._update(job)

    def _update(self, job: Job) -> None:
        status = self.status[job.bucket]
        if self.config.rollback:
            self._save(job)
        self.stages.update(job)
        self._ended(job.bucket, Stage.UPDATE)
        self.stages.stage_weights(job.bucket, list(job.grads), arriving=job.present)
        if self.config.delayed_update:
            status.pending_h2d = True
        else:
            # No compute event to wait on: this thread waited (EXCHANGE) for the copy-out's compute
            # event, recorded after the bucket's backward, so that backward no longer reads the old
            # weights. The next forward waits for these copies at the gate.
            status.gate = self.stages.copy_in(job.bucket, after=status.after)
            status.after = ()
            self._ended(job.bucket, Stage.COPY_IN)
        status.done.set()
