"""AdamW whose fp32 master weights and moments live in host memory.

The device keeps only working copies of the parameters in their own dtype (fp32, bf16 or fp16); each
step brings the gradients to the host, runs torch's fused CPU AdamW kernel on the master weights and
copies the result back. On the CPU backend an fp32 parameter is its own master, so the step is the
fused kernel alone, and results equal ``torch.optim.AdamW(fused=True)`` bit for bit.

With ``model=model`` the updates run block by block on host threads while the backward goes on
(:mod:`ooc.optim.pipeline`, :mod:`ooc.optim.stages`); with ``data_parallel`` the gradients are averaged across ranks on the
way (:mod:`ooc.distributed`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.optim.adamw import adamw
from torch.utils.weak import WeakIdKeyDictionary

from ooc.backend import Backend, Event, backend_on, check_backend_device, resolve_backend, tensors_device
from ooc.blocks import Chain, find_blocks
from ooc.distributed import DataParallel, GroupCommunicator, join_world
from ooc.errors import BlockError, OocError
from ooc.optim.buckets import Bucket, make_buckets
from ooc.optim.frameworks import caller_running, evaluating_after_training, hooks_follow_step, saving_after_training
from ooc.optim.layout import dense, grad32_elements, make_layout, storage_span
from ooc.optim.loss_scale import LossScale
from ooc.optim.pipeline import PipelineConfig, PipelineError, UpdatePipeline
from ooc.optim.stages import Hyper, StageListener, Stages
from ooc.runtime import is_wrapped, register_weight_writer, runtime_of, weight_streamer
from ooc.scheduler.units import format_bytes
from ooc.streaming import ParamStreamer


class HostMemoryError(OocError, MemoryError):
    """The host cannot hold the optimizer's state; raised before anything is allocated."""

    def __init__(self, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"HostAdamW needs {format_bytes(needed)} ({needed} bytes) of host memory for fp32 master weights "
            f"and Adam moments, but {format_bytes(available)} ({available} bytes) are available. Free host "
            "memory, or keep part of the model on a device optimizer."
        )


def available_host_bytes() -> int:
    """Memory the kernel reports available now (MemAvailable), else the free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class HostAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` whose fp32 master weights and moments live in host memory.

    LR schedulers, ``state_dict`` and ``load_state_dict`` work as for any ``torch.optim.Optimizer``.
    The update is torch's fused CPU AdamW kernel, so on the CPU in fp32 the weights equal
    ``torch.optim.AdamW(fused=True)`` bit for bit.

    - ``params``: the parameters or parameter groups, as for torch's optimizers; or the model itself
      (``HostAdamW(model)``: its parameters, and ``model=model``), as transformers.Trainer passes it
      for ``optimizer_cls_and_kwargs=(HostAdamW, {"model": model, ...})``.
    - ``model``: the module being trained. Each block of its chain (found as ``ooc.wrap`` finds
      it) and each top-level module outside the chain is a bucket (without a model, all parameters
      are one bucket); a wrapped model's backend and streamed weights are used.
    - ``pipeline`` (with ``model``): when a bucket's last gradient arrives its update starts on a
      host thread while the backward goes on, and the bucket's next forward waits for its new
      weights. ``step()`` then returns at once; call :meth:`synchronize` before reading parameters
      outside a forward (``model.state_dict()`` and ``self.state_dict()`` do it for you). Under a
      framework (``step(closure)``, as Lightning calls it, or through accelerate's wrapper, as
      transformers.Trainer does), or with step post-hooks registered, ``step()`` waits for its updates,
      since those hooks read the weights before the next forward (NOTE [a framework's hooks after
      step()] in ooc.optim.frameworks). With
      ``pipeline=False`` (or no model) every update runs in ``step()``. Pipelining pays where host
      cores idle during the backward (training on a GPU); where compute keeps every core busy (the
      CPU backend) the update thread only competes with it. The updates a backward starts are
      applied then: a backward without ``step()`` (one that raised, or gradient inspection) is
      reported by an :class:`~ooc.optim.pipeline.UncommittedStepWarning` at the next forward or
      ``zero_grad()``, which resets the step (NOTE [a step is a transaction] in ooc.optim.pipeline);
      use ``pipeline=False`` to look at gradients without updating. One live HostAdamW per model.
    - ``backend``: the device interface (default: the wrapped model's, else ``"auto"``).
    - ``delayed_update``: each step's forward and backward run on weights one update old, so the
      update overlaps the next step whole (ZeRO-Offload's DPU). This changes the numerics: the
      result is AdamW with gradients one step stale. The parameters lag the masters by one update,
      ``synchronize()`` included; ``close()`` puts the last update in (NOTE [the last delayed
      update at the end] in ooc.optim.pipeline), and so does a framework's save after its training
      (NOTE [the last delayed update at a framework's final save]).
    - ``accumulate``: backward passes per ``step()`` (gradient accumulation); a bucket's update
      starts after its ``accumulate``-th gradient.
    - ``max_grad_norm``: clip by the global norm, as ``torch.nn.utils.clip_grad_norm_``. The norm
      needs every gradient, so updates wait for ``step()``; only the copies and the data-parallel
      exchange still overlap the backward.
    - ``loss_scale``: a :class:`~ooc.optim.LossScale` for fp16 training: multiply the loss by
      :meth:`scale` (``opt.scale(loss).backward()``) and ``step()`` unscales the averaged gradients,
      skips the step where one is inf or NaN on any rank, and grows or shrinks the scale as
      ``torch.amp.GradScaler`` does (NOTE [loss scaling in the optimizer] in ooc.optim.loss_scale).
      Use it instead of a GradScaler, which cannot drive a pipelined or data-parallel HostAdamW. As
      with ``max_grad_norm``, updates wait for ``step()``.
    - ``rollback``: keep each bucket's host state from before its update (masters and moments: 12
      more bytes of host memory per parameter) until ``step()`` commits the step, so that a step
      no ``step()`` commits (an interrupted backward, gradient inspection) is undone at the next
      forward or ``zero_grad()`` instead of being reported (NOTE [a step is a transaction]).
    - ``device_params_below``: parameters with fewer elements stay on their device with their state
      (norm scales, biases), updated in ``step()`` by torch's AdamW there. With ``max_grad_norm``
      their gradients count in the global norm, and ``step()`` waits for the clip factor (every
      bucket's gradient on the host) before it updates them.
    - ``data_parallel``: a :class:`ooc.distributed.DataParallel`; gradients are averaged across the
      ranks of the default process group, bucket by bucket, overlapping the backward.

    Host memory needed (8 bytes per parameter for the moments, 4 more for a master copy where the
    parameter is not itself a host fp32 tensor, plus transfer buffers and, for bf16/fp16 parameters,
    fp32 gradients of one bucket, or of all with ``max_grad_norm``) is checked before anything is
    allocated. Tensor shapes are the parameters' own; nothing is reshaped. ``add_param_group`` is
    refused after construction, and ``load_state_dict`` refuses a state saved with other parameter
    dtypes, ``delayed_update`` or data-parallel layout, or by another rank when sharded (``state_dict()["ooc"]``; ``accumulate``,
    ``max_grad_norm`` and the others leave the state's layout alone and may change on a resume).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        model: nn.Module | None = None,
        pipeline: bool = True,
        backend: str | Backend | None = None,
        delayed_update: bool = False,
        accumulate: int = 1,
        max_grad_norm: float | None = None,
        rollback: bool = False,
        device_params_below: int = 0,
        data_parallel: DataParallel | None = None,
        loss_scale: LossScale | None = None,
    ) -> None:
        if isinstance(params, nn.Module):
            model, params = _model_as_params(params, model)
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            _check_number(name, value)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for b in betas:
            _check_number("betas", b)
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        for name, flag in (("delayed_update", delayed_update), ("rollback", rollback)):
            if not isinstance(flag, bool):
                # A string such as "no" would read as True.
                raise TypeError(f"{name} is True or False, got {flag!r} ({type(flag).__name__})")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))):
            raise TypeError(f"max_grad_norm must be a number or None, got {max_grad_norm!r}")
        if loss_scale is not None and not isinstance(loss_scale, LossScale):
            raise TypeError(f"loss_scale is an ooc.optim.LossScale (e.g. LossScale() for GradScaler's defaults) or None, "
                            f"got {loss_scale!r}")
        if isinstance(device_params_below, bool) or not isinstance(device_params_below, int):
            raise TypeError(f"device_params_below is a number of elements (an int), got {device_params_below!r}")
        config = PipelineConfig(delayed_update=delayed_update, accumulate=accumulate, max_grad_norm=max_grad_norm,
                                rollback=rollback, inline=model is None or not pipeline, loss_scale=loss_scale)
        if device_params_below < 0:
            raise ValueError(f"device_params_below must be >= 0, got {device_params_below}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be the nn.Module being trained, got {type(model).__name__}")
        if not isinstance(pipeline, bool):
            raise TypeError(f"pipeline is True or False (pass the module being trained as model=...), got "
                            f"{type(pipeline).__name__}")
        if model is not None:
            _claim(model)
        self._building = True
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._building = False
        tensors = [p for group in self.param_groups for p in group["params"]]
        for p in tensors:
            if not p.is_floating_point():
                raise TypeError(f"HostAdamW optimizes floating-point parameters, got {p.dtype}")
        if len({id(p) for p in tensors}) != len(tensors):
            # torch's optimizers only warn; here each copy would take its own host state and bucket slot,
            # and the weights would end other than torch.optim.AdamW's.
            raise ValueError("HostAdamW got the same parameter more than once (in one group or in two); pass each "
                             "parameter once, e.g. list(model.parameters()), which leaves out tied duplicates")
        _claim_parameters(tensors)
        if model is not None and tensors and not {id(p) for p in tensors} & {id(q) for q in model.parameters()}:
            # Its forward hooks would gate nothing of these parameters: a forward could read weights
            # while the host thread writes them.
            raise ValueError(f"model= must be the module whose parameters this optimizer trains; none of the "
                             f"{len(tensors)} parameters belongs to the {type(model).__name__} given")
        self.delayed_update = delayed_update
        self._accumulate = accumulate
        self.stage_listeners: list[StageListener] = []
        """Called with (bucket index, :class:`~ooc.optim.stages.Stage`) as each stage of a bucket's
        update ends, on the thread that ran it (NOTE [stage listeners] in ooc.optim.stages)."""
        self._device_params = [p for p in tensors if p.numel() < device_params_below]
        small = {id(p) for p in self._device_params}
        host_params = [p for p in tensors if id(p) not in small]

        backend_obj, self._owns_backend = _backend_for(backend, model, tensors)
        self.backend = backend_obj

        streamer = weight_streamer(model) if model is not None else None
        home = {id(p): _home_of(p, streamer) for p in tensors}

        def own_master(p: torch.Tensor) -> bool:
            weights = home[id(p)]
            return weights.device.type == "cpu" and p.dtype == torch.float32 and not backend_obj.separate_memory \
                and not delayed_update

        chain = _chain_of(model)
        self._buckets = make_buckets(model, chain, host_params)
        comm = None
        owner = {id(p): 0 for p in host_params}
        try:
            if data_parallel is not None:
                plan_json = runtime_of(model).plan.to_json() if model is not None and is_wrapped(model) else None
                options = dict(lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay,
                               delayed_update=delayed_update, accumulate=accumulate, max_grad_norm=max_grad_norm,
                               device_params_below=device_params_below,
                               loss_scale=None if loss_scale is None else dataclasses.asdict(loss_scale))
                comm, owner = join_world(data_parallel, model=model, params=tensors, host_params=host_params,
                                         options=options, plan_json=plan_json, groups=self.param_groups)
            rank = comm.rank if comm else 0
            sharded = comm is not None and comm.sharded

            def is_mine(p: torch.Tensor) -> bool:
                return not sharded or owner[id(p)] == rank

            mine = [p for p in host_params if is_mine(p)]
            needed = _host_bytes_needed(mine, host_params, own_master, data_parallel=comm is not None) \
                + 4 * grad32_elements(self._buckets, is_mine, per_bucket=config.holds_updates) \
                + (sum(12 * p.numel() + 4 for p in mine) if rollback else 0)
            available = available_host_bytes()
            if needed > available:
                raise HostMemoryError(needed, available)
            for p in mine:
                self.state[p] = self._fresh_state(p, own=own_master(p))
            for p in self._device_params:
                self.state[p] = self._fresh_device_state(p)
            reduce_on_device = comm is not None and comm.reduce_on == "device"
            layout = make_layout(
                self._buckets, backend=backend_obj, own_master=own_master, home=home, owner=owner,
                norm_order=_norm_order(model, tensors), rank=rank,
                world=comm.world if comm else 1, sharded=sharded, exchange=comm is not None,
                reduce_on_device=reduce_on_device, grad32_per_bucket=config.holds_updates,
            )
            # Before the pipeline's threads start: a failed broadcast leaves nothing running.
            buffers = _BufferSync(comm, model) \
                if comm is not None and data_parallel.broadcast_buffers and model is not None else None
            state_view = _StateView(self)
            stages = Stages(layout=layout, backend=backend_obj, comm=comm, state=state_view,
                            reduce_on_device=reduce_on_device, max_grad_norm=max_grad_norm)
            self._pipeline = UpdatePipeline(stages, config, state_view.listeners,
                                            shared=_shared_buckets(model, chain, self._buckets))
        except BaseException:
            if comm is not None:
                comm.close()
            if self._owns_backend:
                backend_obj.close()
            raise
        self._comm = comm
        self._buffers = buffers
        self._pipelined = model is not None and pipeline
        self._loss_scaled = False
        """``loss_scale``: ``scale()`` was called since the last ``step()`` (NOTE [a loss scale no backward used])."""
        self._handles = self._install_hooks(model, chain, on_grad=pipeline) if model is not None else []
        if comm is not None and not self._pipelined:
            self._handles += self._note_grads()
        if streamer is not None:
            self._handles.append(_StreamGate(streamer, self._pipeline, self._buckets))
        self._finalizer = weakref.finalize(self, _shutdown, self._pipeline, self._handles, comm,
                                           backend_obj if self._owns_backend else None)
        self._finalizer.atexit = False  # no collectives at exit: the ranks may be gone
        # But the host threads stop before the interpreter goes (NOTE [threads stop at exit]).
        weakref.finalize(self, self._pipeline.close)
        for p in tensors:
            _PARAMETER_OWNER[p] = weakref.ref(self)
        if model is not None:
            _OWNER[model] = weakref.ref(self)
            register_weight_writer(model, self._settle)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The groups of parameters updated together, in canonical order; a stage listener's bucket
        index is a position in this tuple."""
        return self._buckets

    def held_buckets(self) -> list[int]:
        """Indices (in :attr:`buckets`) of the buckets whose update of the open step waits for
        ``step()`` (``max_grad_norm``: NOTE [clipping stalls the pipeline] in ooc.optim.pipeline):
        their EXCHANGE has ended, yet their state and weights change at ``step()``."""
        return self._pipeline.held()

    def copies_in_after(self, event: Event) -> None:
        """The next copies of new weights into the parameters wait for ``event`` (of :attr:`backend`),
        recorded after the caller's reads of them on its own stream (NOTE [weights read on another
        stream] in ooc.optim.pipeline): a checkpoint's copies of the live weights."""
        self._pipeline.copies_in_after(event)

    def uncommitted_buckets(self) -> list[int]:
        """Indices (in :attr:`buckets`) of the buckets whose update of the open step started in the
        backward (``pipeline=True``) and that no ``step()`` has committed yet: their state and weights
        already hold it, and ``zero_grad()`` undoes it with ``rollback`` (NOTE [a step is a
        transaction] in ooc.optim.pipeline)."""
        return self._pipeline.applied()

    @staticmethod
    def _host_zeros_like(p: torch.Tensor) -> torch.Tensor:
        # Not pinned: masters and moments never cross PCIe (the staging and gradient buffers do).
        return torch.zeros(p.shape, dtype=torch.float32)

    def _fresh_state(self, p: torch.Tensor, *, own: bool) -> dict[str, torch.Tensor]:
        state = _HostState({
            "step": torch.tensor(0.0),
            "exp_avg": self._host_zeros_like(p),
            "exp_avg_sq": self._host_zeros_like(p),
        })
        if not own:
            master = self._host_zeros_like(p)
            master.copy_(p.detach())
            state["master"] = master
        return state

    @staticmethod
    def _fresh_device_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of a parameter kept on its device (``device_params_below``) before any update:
        ``step`` on the parameter's device, as torch.optim.AdamW(fused=True) keeps it (the fused
        CUDA kernel takes no CPU tensor)."""
        return {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p)}

    def _fresh_like(self, p: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """A never-updated state of ``p`` laid out as ``state`` (on the host or on ``p``'s device, with
        or without a master), its master taken from the weight the model holds now."""
        if not isinstance(state, _HostState):
            return self._fresh_device_state(p)
        home = self._pipeline.stages.layout.home[id(p)]
        return self._fresh_state(home, own="master" not in state)

    def _install_hooks(self, model: nn.Module, chain: Chain | None, *, on_grad: bool) -> list[Any]:
        """Forward gates and the ``state_dict`` wait; with ``on_grad``, the gradient hooks that
        launch each bucket's update inside the backward."""
        pipe = self._pipeline
        handles = []
        for bucket in self._buckets:
            for p in bucket.params:
                if on_grad and p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(lambda q, i=bucket.index: pipe.on_grad(i, q)))
            if bucket.block is not None and chain is not None:
                # The block's forward reads its parameters: they must hold this step's update.
                handles.append(chain.modules[bucket.block].register_forward_pre_hook(
                    lambda _m, _args, i=bucket.index: pipe.before_block_forward(i)))
        outside = tuple(b.index for b in self._buckets if b.block is None)
        streamer = weight_streamer(model)
        buffers = self._buffers

        def before_forward(_m: nn.Module, _args: Any) -> None:
            _check_same_streamer(model, streamer)
            pipe.before_forward(outside)
            if not torch.is_grad_enabled() and pipe.holds_delayed() and evaluating_after_training():
                # NOTE [the last delayed update at a framework's final save]: its evaluation too.
                pipe.synchronize()
                pipe.flush_delayed()
            if buffers is not None:
                buffers.before_forward(model)

        handles.append(model.register_forward_pre_hook(before_forward))
        if on_grad or self._comm is not None:
            # Data-parallel without the pipeline too: a backward that ended early leaves partial
            # gradients that the next step() must not exchange (NOTE [a backward that ended early]).
            handles.append(model.register_forward_hook(lambda _m, _args, out: _watch_backward(pipe, out)))
        handles.append(model.register_state_dict_pre_hook(lambda *_: _before_model_state_dict(pipe)))
        loads = _LoadsIntoTheModel(weakref.ref(self))
        handles.append(model.register_load_state_dict_pre_hook(loads.before))
        handles.append(model.register_load_state_dict_post_hook(loads.after))
        return handles

    def _note_grads(self) -> list[Any]:
        """Data-parallel without the pipeline's gradient hooks: hooks that note each gradient as it
        arrives, for ``step()`` to refuse a change made in the loop, which would see this rank's own
        gradients, not their average (NOTE [gradients read in the backward] in ooc.optim.pipeline)."""
        pipe = self._pipeline
        return [p.register_post_accumulate_grad_hook(lambda q, i=bucket.index: pipe.note_grad(i, q))
                for bucket in self._buckets for p in bucket.params if p.requires_grad]

    def _loaded_over_masters(self, model: nn.Module, state_dict: dict[str, Any],
                             prefix: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The parameters of ``model`` with a master here that ``state_dict`` (being loaded into
        ``model`` under ``prefix``) gives other values than their master's (NOTE [loads into the
        model]), and all those with a master that it loads."""
        changed: dict[int, torch.Tensor] = {}
        loaded: dict[int, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            value = state_dict.get(prefix + name)
            master = self.state[p].get("master") if p in self.state else None
            if master is None or not isinstance(value, torch.Tensor) or value.shape != p.shape:
                # Its own master, another rank's, kept on its device, or not loaded (load_state_dict
                # reports a wrong shape itself).
                continue
            loaded[id(p)] = p
            if id(p) not in changed and not torch.equal(value.detach().to("cpu", p.dtype), master.to(p.dtype)):
                changed[id(p)] = p
        return list(changed.values()), list(loaded.values())

    def _adopt_loaded(self, params: list[torch.Tensor], loaded: list[torch.Tensor]) -> None:
        """``params`` hold weights loaded into the model: they become their masters (NOTE [loads
        into the model]). ``loaded``: every parameter with a master that the load wrote, which now
        holds its master's values (NOTE [weights written outside the optimizer] in ooc.optim.pipeline)."""
        home = self._pipeline.stages.layout.home
        for p in params:
            # A device weight's copy into pageable host memory returns once the bytes are there,
            # after the load's copy into it (issued before, on the same stream).
            self.state[p]["master"].copy_(home[id(p)].detach())
        self._pipeline.after_load()  # delayed_update: the pending copies in, now from these masters
        self._pipeline.watch_written_weights(loaded)  # the load's writes are in their masters now

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        """Apply this step's gradients. With ``pipeline`` most updates have started in the backward
        already and the rest start here; this returns without waiting for them (see the class doc)."""
        if not self._finalizer.alive:
            # Its threads and hooks are gone: the step would return having updated nothing.
            raise OocError("step() on a closed HostAdamW: close() ended it. Build a new HostAdamW for the model "
                           "(load this one's state_dict() into it to go on from its state).")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pipeline.in_backward:
            raise PipelineError(
                "step() after a backward that did not finish (it raised or was interrupted): its gradients are "
                "partial. Call zero_grad() and run the forward and backward again."
            )
        if (found := getattr(self, "found_inf", None)) is not None and not self._take_grad_scaler(found):
            return loss  # GradScaler found an inf: it skips this step (and backs its scale off)
        if found is None and _called_by_grad_scaler() \
                and (refusal := self._grad_scaler_refusal(False, behind_a_wrapper=True)) is not None:
            raise refusal
        self._check_loss_scaled()
        params = self._reduced_device_grads()
        pipe = self._pipeline
        found_inf = False
        clipped = pipe.config.max_grad_norm is not None and bool(params)
        grad_scale = None
        if pipe.scale is not None and params:
            # NOTE [loss scaling in the optimizer]: the device-kept gradients are checked here, with the
            # scale of the last step's decision (which this step's loss was scaled by). The fused kernel
            # unscales them in fp32, as torch.optim.AdamW(fused=True) under a GradScaler: in place, an
            # fp16 gradient below fp16's normal range lost its low bits or became 0. Clipping needs
            # them unscaled for the norm first (GradScaler.unscale_, which refuses fp16 gradients).
            pipe.clip_factor()
            fused = all(p.device.type in ("cpu", "cuda") for p in params)
            # A copy: the step's decision (finish_step) updates the scale in place.
            grad_scale = pipe.scale.scale.clone() if fused and not clipped else None
            inverse = pipe.scale.inverse() if grad_scale is None else torch.ones((1,), dtype=torch.float32)
            found_inf = any([_unscale_in_place(grads, inverse) for grads in _by_device_and_dtype([p.grad for p in params])])
        # Clipping: the device-kept gradients count in the global norm (on the update thread, with
        # the buckets'), and the factor it gives scales them too, as clip_grad_norm_ does.
        norms = None
        if clipped:
            norms = {id(p): torch.linalg.vector_norm(p.grad).to("cpu", torch.float32) for p in params}
            self.backend.record_compute().synchronize()  # the update thread reads them (a CUDA .to("cpu") waited already)
        pipe.finish_step(norms, found_inf=found_inf)
        self._loss_scaled = False
        if pipe.config.holds_updates and params:
            coef = pipe.clip_factor()  # the step's decision: its clip factor, and whether it was skipped
            if pipe.skipped:
                params = []
            elif coef is not None:
                for p in params:
                    p.grad.mul_(coef.to(p.grad.device))
        self._step_device_params(params, grad_scale)
        if self._buffers is not None:
            self._buffers.forwards = 0
        if not self._pipelined or hooks_follow_step(self, closure):
            # Hooks after step() (a framework's, step post-hooks) read and write the weights before the
            # next forward's gates would wait for them: NOTE [a framework's hooks after step()] in
            # ooc.optim.frameworks.
            self.synchronize()
        return loss

    def _check_loss_scaled(self) -> None:
        """With ``loss_scale``, refuse a step whose gradients no ``scale(loss)`` scaled; the step is reset.

        NOTE [a loss scale no backward used]
        ``step()`` divides the gradients by the loss scale, so it must have multiplied the loss the
        backward ran on. A framework calls ``backward()`` itself (``transformers.Trainer``: its
        ``training_step``; Lightning: ``LightningModule.backward``) on the loss it was given: handed a
        HostAdamW built with ``loss_scale=``, it trained on the gradients divided by the scale (65536 at
        first) without a word, and fp16 gradients got none of the protection from underflow the scale is
        for. The updates wait for ``step()`` with a loss scale, so none has run: the step is reset whole."""
        if self._pipeline.scale is None or self._loss_scaled:
            return
        if not (self._pipeline.open_step() or any(p.grad is not None for g in self.param_groups for p in g["params"])):
            return  # no backward since the last step: the step has nothing to unscale
        why = ("step() on a HostAdamW built with loss_scale=, but no opt.scale(loss) since the last step(): the backward "
               "ran on the unscaled loss, and step() would divide the gradients by the scale (fp16 ones got no "
               "protection from underflow). A framework calls backward() itself: under Lightning, override "
               "LightningModule.backward(self, loss, *args, **kwargs) to run "
               "self.optimizers().optimizer.scale(loss).backward(); under transformers.Trainer, build HostAdamW without "
               "loss_scale and with pipeline=False, and let TrainingArguments(fp16=True) scale with its GradScaler "
               "(bf16 and fp32 need no loss scale at all). The step was reset: call zero_grad() before "
               "the next backward")
        self._pipeline.discard(why, warn=False)
        raise OocError(why)

    _step_supports_amp_scaling = True
    """NOTE [a GradScaler drives HostAdamW]: ``torch.amp.GradScaler.step`` then passes its scale and what it
    found as ``self.grad_scale`` and ``self.found_inf`` instead of unscaling the gradients itself."""

    def _take_grad_scaler(self, found_inf: torch.Tensor) -> bool:
        """A ``torch.amp.GradScaler`` calls ``step()``; whether to update (False: it found an inf).

        NOTE [a GradScaler drives HostAdamW]
        GradScaler unscales the gradients with a kernel that leaves their version counters alone, so
        the check of gradients changed after a pipelined update read them (NOTE [gradients read in
        the backward] in ooc.optim.pipeline) did not see it: a pipelined HostAdamW trained on the
        scaled gradients, and an inf reached the weights, without a word. With
        ``_step_supports_amp_scaling`` GradScaler leaves the gradients as they are and hands its
        scale (``grad_scale``; None after the loop's own ``unscale_``) and ``found_inf`` to
        ``step()``. Where the updates read the gradients in ``step()`` (``pipeline=False``, one
        rank) this unscales them and skips as GradScaler would; where they ran in the backward on
        the scaled gradients, or data-parallel, where GradScaler's check and scale are each rank's
        own (the ranks would part: one skipping, one not; their scales apart), the step is refused,
        pointing to ``loss_scale=`` (NOTE [loss scaling in the optimizer] in ooc.optim.loss_scale). So
        are fp16 gradients with GradScaler's scale: unscaled in place, in fp16, they lost what lay
        below fp16's normal range (GradScaler.unscale_ refuses them for that; ``loss_scale=``
        unscales them in fp32)."""
        scale = getattr(self, "grad_scale", None)
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        refusal = self._grad_scaler_refusal(scale is not None and any(g.dtype == torch.float16 for g in grads))
        if refusal is not None:
            # GradScaler deletes what it set only after a step() that returns.
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise refusal
        if found_inf.item() > 0:
            return False
        if scale is not None:
            inverse = scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
            for same in _by_device_and_dtype(grads):
                _unscale_in_place(same, inverse)
        return True

    def _grad_scaler_refusal(self, fp16_to_unscale: bool, *, behind_a_wrapper: bool = False) -> OocError | None:
        """Why a GradScaler cannot drive this HostAdamW (NOTE [a GradScaler drives HostAdamW]), or
        None; a pipelined step is reset first. ``fp16_to_unscale``: GradScaler left fp16 gradients
        for ``step()`` to unscale. ``behind_a_wrapper``: GradScaler unscaled the gradients itself
        (NOTE [a GradScaler behind a wrapper])."""
        drives = ("a torch.amp.GradScaler drives this HostAdamW through an optimizer wrapper that hides its "
                  "_step_supports_amp_scaling, so GradScaler unscaled the gradients itself"
                  if behind_a_wrapper else "a torch.amp.GradScaler drives this HostAdamW")
        fix = ("use HostAdamW(..., loss_scale=ooc.optim.LossScale()) and opt.scale(loss).backward() instead of a "
               "GradScaler (it unscales the averaged gradients and skips a step on every rank alike)")
        if self._pipeline.scale is not None:
            return OocError(f"this HostAdamW scales the loss itself (loss_scale=...) and {drives}: it scaled the loss "
                            f"too. {fix[0].upper()}{fix[1:]}, not both")
        if self._comm is not None or self._pipelined:
            where = ("data-parallel, GradScaler checks and scales each rank's own gradients, so the ranks would part"
                     if self._comm is not None else
                     "this pipelined HostAdamW updated in the backward, on the scaled gradients")
            applied = self._pipeline.discard(f"{drives} ({where})", warn=False) if self._comm is None else ""
            return PipelineError(f"{drives}: {where}. {fix}; or, on one rank, "
                                 "HostAdamW(pipeline=False), which reads the gradients in step()"
                                 + (f". The step was reset, but {applied}: call zero_grad() before the next backward"
                                    if applied else ""))
        if fp16_to_unscale:
            return OocError(f"a torch.amp.GradScaler drives this HostAdamW with fp16 gradients: unscaled here, in fp16, "
                            f"they would lose what lies below fp16's normal range (GradScaler.unscale_ refuses fp16 "
                            f"gradients for that). {fix[0].upper()}{fix[1:]}: it unscales them in fp32")
        return None

    def _reduced_device_grads(self) -> list[torch.Tensor]:
        """The parameters kept on their device that have a gradient (on some rank), averaged across
        the ranks: a rank without one takes zeros, as DDP does (NOTE [gradients missing on some
        ranks] in ooc.optim.stages)."""
        if self._comm is None or not self._device_params:
            return [p for p in self._device_params if p.grad is not None]
        # On the training thread's group, on the parameters' device as its backend needs.
        flags = torch.tensor([p.grad is not None for p in self._device_params], dtype=torch.int32,
                             device=self._device_params[0].device)
        self._comm.all_reduce(flags, thread="training")
        params = [p for p, n in zip(self._device_params, flags.tolist()) if n > 0]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._comm.all_reduce(p.grad, thread="training")
            p.grad.div_(self._comm.world)
        return params

    def _step_device_params(self, params: list[torch.Tensor], grad_scale: torch.Tensor | None = None) -> None:
        """torch's AdamW on the parameters kept on their device; ``grad_scale``: the loss scale their
        gradients still hold, which the fused kernel divides them by (NOTE [loss scaling in the optimizer])."""
        if not params:
            return
        for group in self.param_groups:
            mine = [p for p in group["params"] if any(p is q for q in params)]
            if not mine:
                continue
            state = [self.state[p] for p in mine]
            beta1, beta2 = group["betas"]
            adamw(mine, [p.grad for p in mine], [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state], [],
                  [s["step"] for s in state], foreach=False, fused=mine[0].device.type in ("cpu", "cuda"),
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False,
                  grad_scale=None if grad_scale is None else grad_scale.to(mine[0].device))

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (with ``loss_scale``; NOTE [loss scaling in the optimizer] in
        ooc.optim.loss_scale): call ``backward()`` on this, as on ``GradScaler.scale(loss)``. It waits
        for the last ``step()``'s decision, which may have changed the scale."""
        if self._pipeline.scale is None:
            raise OocError("HostAdamW.scale(loss) needs HostAdamW(..., loss_scale=ooc.optim.LossScale()); this one "
                           "has no loss scale (bf16 and fp32 training need none: call loss.backward())")
        self._pipeline.clip_factor()
        self._loss_scaled = True
        return loss * self._pipeline.scale.scale.to(loss.device)

    def get_scale(self) -> float | None:
        """The current loss scale (None without ``loss_scale``), after the last ``step()``'s decision."""
        if self._pipeline.scale is None:
            return None
        self._pipeline.clip_factor()
        return float(self._pipeline.scale.scale.item())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``step()`` was skipped because a gradient was inf or NaN (``loss_scale``)."""
        if self._pipeline.scale is None:
            return False
        self._pipeline.clip_factor()
        return self._pipeline.skipped

    def synchronize(self) -> None:
        """Wait until every update issued so far is in the parameters (with ``delayed_update``: the
        ones the next forward will use, one update behind the masters; ``close()`` puts the last one in)."""
        self._pipeline.synchronize()

    def _settle(self) -> None:
        """``ooc.wrap`` or ``ooc.unwrap`` moves the weights: wait for the updates in flight (NOTE
        [weights move at rest] in ooc.runtime). A closed optimizer, or one stopped by an error,
        writes nothing more."""
        if self._finalizer.alive and self._pipeline.error is None:
            self._pipeline.synchronize()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``Optimizer.zero_grad``; without ``step()`` after a backward, also resets the step
        (NOTE [a step is a transaction] in ooc.optim.pipeline: a warning names the updates applied)."""
        if self._pipeline.in_backward:
            # A backward that raised (caught by the loop, which zeroes and goes on): the cause is its
            # error, not a GradScaler; data-parallel, the refusal that ends the run named only GradScaler.
            self._pipeline.discard("zero_grad() after a backward that did not finish (it raised or was interrupted)")
        elif self._pipeline.open_step():
            # A GradScaler that found an inf skips step() without a word to this optimizer (behind a
            # wrapper that hides _step_supports_amp_scaling: NOTE [a GradScaler behind a wrapper]).
            self._pipeline.discard("zero_grad() without step() after a backward (a torch.amp.GradScaler that found an "
                                   "inf or NaN skips step(): for fp16, scale with HostAdamW(loss_scale=ooc.optim."
                                   "LossScale()) and opt.scale(loss).backward() instead)")
        if not set_to_none:
            self.synchronize()  # the host thread may still read gradients that zeroing would overwrite
        self._pipeline.forget_grads()
        if self._buffers is not None:
            self._buffers.forwards = 0
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: every parameter's buckets, buffers and hooks are laid out
        once, so a group added later would never be trained."""
        if getattr(self, "_building", True):
            super().add_param_group(param_group)
            return
        raise OocError(
            "HostAdamW does not support add_param_group after construction: its host buffers, buckets and "
            "gradient hooks are laid out once, so the new parameters would never be trained. Build a new "
            "HostAdamW with every parameter group (close() the old one first)."
        )

    def _depends_on(self) -> dict[str, Any]:
        """What the host state's layout depends on, checked by ``load_state_dict``."""
        comm = self._comm
        return {
            "dtypes": [str(p.dtype) for group in self.param_groups for p in group["params"]],
            "delayed_update": self.delayed_update,
            "world": comm.world if comm is not None else 1,
            "sharded": bool(comm is not None and comm.sharded),
            # NOTE [a shard is its rank's]: sharded, a rank's state holds only the parameters it owns.
            # Loaded on another rank (every rank loading rank 0's file, the torch.save habit), the
            # base class took it whole: that rank's own parameters got a fresh state (moments zero,
            # step 0) and the loaded ones were another rank's to update, without a word.
            "rank": comm.rank if comm is not None and comm.sharded else None,
        }

    def state_dict(self) -> dict[str, Any]:
        self.synchronize()
        saved = super().state_dict()
        # Plain dicts: torch.load(weights_only=True), as transformers.Trainer resumes, takes no other class.
        saved["state"] = {k: dict(v) if isinstance(v, _HostState) else v for k, v in saved["state"].items()
                          if not _never_updated(v)}
        saved["param_groups"] = [{**group, **_FUSED_ADAMW} for group in saved["param_groups"]]
        info = self._depends_on()
        if self._pipeline.scale is not None:
            info["loss_scale"] = self._pipeline.scale.state()  # NOTE [loss scaling in the optimizer]
        return {**saved, "ooc": info}

    def _check_compatible(self, saved: dict[str, Any] | None) -> None:
        if saved is None:
            return  # a checkpoint from before these were recorded, or from another optimizer
        now = self._depends_on()
        wrong = [f"{key}: saved {saved[key]!r}, now {now[key]!r}" for key in now
                 if key in saved and saved[key] != now[key] and key != "dtypes"]
        if "dtypes" in saved and saved["dtypes"] != now["dtypes"]:
            diffs = [(i, a, b) for i, (a, b) in enumerate(zip(saved["dtypes"], now["dtypes"])) if a != b]
            first = f"parameter {diffs[0][0]} was {diffs[0][1]}, now {diffs[0][2]}" if diffs else "a different count"
            wrong.insert(0, f"dtypes: {first}")
        if wrong:
            placed = any(key in saved and saved[key] != now[key] for key in ("world", "sharded", "rank"))
            raise OocError(
                "this HostAdamW checkpoint was saved with other options than this optimizer's ("
                + "; ".join(wrong) + "). Its host state would not fit them: build the optimizer (and the model's "
                "parameter dtypes) as they were when it was saved, or start the optimizer state afresh."
                + (" A data-parallel state_dict() is the saving rank's: sharded, it holds only the state of the "
                   "parameters that rank owns, so each rank loads the one it saved; ooc.checkpoint.Checkpointer saves "
                   "every rank's and restores them on any number of ranks, sharded or not." if placed else "")
            )

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Raise ``OocError`` unless ``state_dict`` (from :meth:`state_dict`) was saved with this
        optimizer's options (parameter dtypes, ``delayed_update``): what ``load_state_dict`` checks
        first, for a caller that loads other state (the model's weights) before it."""
        self._check_compatible(state_dict.get("ooc"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``Optimizer.load_state_dict``, but each state tensor is copied exactly: the host state
        (fp32 masters and moments, whatever the parameter's dtype, and ``step``) into host memory.
        The base class would first cast every state tensor to its parameter's dtype and device,
        truncating the fp32 state of bf16/fp16 parameters and staging all of it in device memory.
        The state of parameters kept on their device (``device_params_below``) goes there, as the
        base class puts it, with ``step`` on the device too (the fused kernel's rule). A state without
        masters (a torch optimizer's, from training begun without ooc) gives each parameter that has
        one here its weight as master, and a saved master of a parameter that is its own master here is
        dropped (NOTE [loaded masters follow this layout])."""
        self.synchronize()
        self._check_compatible(state_dict.get("ooc"))
        info = state_dict.get("ooc")
        if self._pipeline.open_step():
            self._pipeline.supersede()
        state_dict = {k: v for k, v in state_dict.items() if k != "ooc"}
        saved = state_dict["state"]
        before = {p: state for p, state in self.state.items() if isinstance(p, torch.Tensor)}
        # The base class checks the groups and maps saved ids to parameters; given no state
        # tensors, it casts none.
        super().load_state_dict({**state_dict, "state": {k: {} for k in saved}})
        id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                          itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
        device_ids = {id(p) for p in self._device_params}
        layout = self._pipeline.stages.layout
        for key, value in saved.items():
            p = id_map.get(key)
            if p is None:
                self.state[key] = value  # not a parameter's: kept as is, as the base class does
                continue
            if id(p) not in device_ids and not layout.mine(p):
                # NOTE [a shard loads its own]: sharded, a state that holds every parameter's (a torch
                # optimizer's, from training begun without ooc, loaded on every rank) gave each rank the
                # state of parameters another rank owns and updates. It stayed as loaded, and a
                # Checkpointer version then held two states of each such parameter, the owner's and a
                # stale one, which a restore could take: the run went on from moments steps old
                # without a word. Each rank keeps the state of the parameters it owns (host memory too).
                self.state.pop(p, None)
                continue
            loaded = {name: _loaded(p, name, v, on_device=id(p) in device_ids) for name, v in value.items()}
            # NOTE [loaded masters follow this layout]
            # Whether a parameter has a master apart from it is this optimizer's layout (its device,
            # dtype, backend), not the saver's: the update reads state["master"] where there is one
            # and writes no other copy. A torch optimizer's state has none (training begun without
            # ooc): its parameter was its master. A state saved on a GPU has one for every parameter:
            # resumed where the parameter is its own (fp32 on the CPU), the update moved the loaded
            # master and never the parameter; the parameter, loaded with the model, holds its values.
            if p in before and "master" not in before[p]:
                loaded.pop("master", None)
            elif "master" in before.get(p, {}) and "master" not in loaded:
                loaded["master"] = self._fresh_like(p, before[p])["master"]
            self.state[p] = loaded if id(p) in device_ids else _HostState(loaded)
        for p, state in before.items():
            if p not in self.state:  # never updated when saved (NOTE [a fresh state is not saved])
                self.state[p] = self._fresh_like(p, state)
        if self._pipeline.scale is not None and isinstance(info, dict) and "loss_scale" in info:
            # After the base class's checks: a load they refuse leaves the scale as it was.
            self._pipeline.scale.load(info["loss_scale"])
        self._pipeline.after_load()

    def close(self) -> None:
        """Wait for the updates of the last ``step()`` (NOTE [close waits for the last step] in
        ooc.optim.pipeline; with ``delayed_update``, also copy the last one into the parameters, which
        ``synchronize()`` leaves one update behind: NOTE [the last delayed update at the end]), then stop the host threads and remove the hooks (the optimizer is
        unusable afterwards; also done, without the wait, when it is garbage-collected). Raises the
        failure of an update or gradient exchange that no call has raised yet (the weights may then
        lack that step's update in some buckets), after closing."""
        try:
            if self._finalizer.alive:
                self._pipeline.settle()
                self._pipeline.flush_delayed()  # NOTE [the last delayed update at the end]
        finally:
            self._finalizer()


class _BufferSync:
    """Data-parallel: the model's buffers become rank 0's before each step's first forward (in training
    mode, with grad enabled).

    NOTE [buffers follow rank 0]
    ``DistributedDataParallel`` broadcasts rank 0's buffers before a forward that follows one which
    synced gradients (with grad enabled, outside ``no_sync()``): in a loop, before each step's first
    forward. So every rank's BatchNorm running statistics are rank 0's updated by its own batches
    of the step, and every rank evaluates alike. Each rank kept its own here: rank 0's (what a
    checkpoint saves) equalled DDP's, the others' parted from them. So the first forward with grad
    enabled after ``step()`` or ``zero_grad()`` (and the first of all) takes rank 0's buffers first,
    one broadcast each on the training thread's group; ``DataParallel(broadcast_buffers=False)``
    leaves them alone. Forwards without grad take none (DDP's would, after a step): an evaluation
    on rank 0 alone must not wait for the other ranks. Nor do forwards of a model in eval mode
    (``model.eval()``): an evaluation on rank 0 alone that left grad enabled broadcast the buffers where
    the other ranks did not, and every later broadcast and exchange met another's (a timeout, or
    equal-sized buffers taking each other's values); under DDP such a loop evaluates the module
    inside the wrapper, which broadcasts nothing. So a model trained in eval mode throughout (its
    BatchNorm statistics frozen) takes rank 0's buffers once, when the optimizer is built, as DDP's
    constructor gives them."""

    def __init__(self, comm: GroupCommunicator, model: nn.Module) -> None:
        self.comm = comm
        self.forwards = 0
        """Forwards with grad enabled, in training mode, since the last ``step()`` or ``zero_grad()``."""
        self.broadcast(model)  # every rank builds its optimizer: the broadcasts meet

    def before_forward(self, model: nn.Module) -> None:
        if not torch.is_grad_enabled() or not model.training:
            return
        self.forwards += 1
        if self.forwards == 1:
            self.broadcast(model)

    def broadcast(self, model: nn.Module) -> None:
        """Rank 0's buffers into every rank's."""
        with torch.no_grad():
            for buffer in model.buffers():
                # Its memory as it lies (channels_last, transposed: NCCL refuses a tensor not contiguous
                # in its memory format); one that is not dense (an expand()ed view) stays as it is.
                if dense(buffer):
                    self.comm.broadcast(storage_span(buffer), 0, thread="training")


class _HostState(dict):
    """The state of a parameter the host updates (``step``, fp32 moments and master), kept on the host.

    NOTE [host state stays on the host]
    Lightning's ``fit()`` moves every optimizer's state to the training device, at its start and after
    restoring a checkpoint (``lightning.fabric.utilities.optimizer._optimizer_to_device``:
    ``state[p][key] = value.to(device)`` for every key but ``step``). That put HostAdamW's fp32
    moments and masters in device memory, the bytes it exists to keep off the device, and the host
    update then failed on tensors of two devices. So a tensor assigned here that is not a host fp32
    tensor, over a tensor of its shape, is copied into the host tensor held, which stays (the moved
    copy is dropped at once: one parameter's state at a time on the device); a host fp32 tensor is
    taken as it is, and ``state_dict()`` hands out plain dicts."""

    def __setitem__(self, key: str, value: Any) -> None:
        held = self.get(key)
        if isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor) and value.shape == held.shape \
                and (value.device.type != "cpu" or value.dtype != torch.float32):
            held.copy_(value.detach())
            return
        super().__setitem__(key, value)


class _LoadsIntoTheModel:
    """``model.load_state_dict`` hooks of a HostAdamW (held weakly: the model must not keep it alive).

    NOTE [loads into the model]
    A parameter that is not its own master (bf16 or fp16 ones; on a GPU every one: the masters live
    on the host) holds what the optimizer last copied from its fp32 master. ``model.load_state_dict``
    (a fine-tune's pretrained weights, HF Trainer's best model at the end, the model alone restored)
    wrote the parameters and not the masters, and the next update, master plus step, overwrote the
    loaded weights without a word. So a load into the model first waits for the updates in flight
    (they would land over it) and notes the parameters whose loaded values differ from their master;
    once loaded, those masters take the loaded weights (with ``delayed_update``, every bucket's
    pending copy in is staged again from the masters, on every rank alike). The moments stay, as
    ``torch.optim.AdamW``'s do, and so does a master the load leaves as it was (a checkpoint's exact
    fp32 master, loaded before the model). A load with ``assign=True`` is refused: it replaces the
    parameters whose storage the optimizer's buffers and hooks hold. The hooks are the model's: a
    load into one of its submodules alone is not seen (load through the model, or the optimizer's
    state after it)."""

    def __init__(self, optimizer: weakref.ref[HostAdamW]) -> None:
        self._optimizer = optimizer
        self._changed: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def before(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
               *_: Any) -> None:
        optimizer = self._optimizer()
        if optimizer is None or not optimizer._finalizer.alive:
            return
        if local_metadata.get("assign_to_params_buffers"):
            raise OocError(
                "load_state_dict(..., assign=True) would replace the parameters this model's HostAdamW updates (its "
                "buffers and hooks hold them): load without assign=True, or close() the optimizer first and build a "
                "new one after the load"
            )
        optimizer.synchronize()  # an update in flight would land over the loaded weights
        self._changed = optimizer._loaded_over_masters(module, state_dict, prefix)

    def after(self, _module: nn.Module, _incompatible: Any) -> None:
        (changed, loaded), self._changed = self._changed, ([], [])
        optimizer = self._optimizer()
        if optimizer is not None and optimizer._finalizer.alive:
            optimizer._adopt_loaded(changed, loaded)


def _check_same_streamer(model: nn.Module, streamer: ParamStreamer | None) -> None:
    """Raise unless ``model`` streams its weights as it did when the optimizer was built: the buffers,
    gates and master copies were laid out for those weights' homes (the device tensor, or the
    streamer's host copy), and after ``ooc.wrap`` or ``ooc.unwrap`` changed them the updates would
    go to copies the model no longer reads."""
    if weight_streamer(model) is not streamer:
        raise OocError(
            "this model's weight streaming changed after its HostAdamW was built (ooc.wrap or ooc.unwrap with a plan "
            "that streams weights): the optimizer would update copies the model no longer reads. Build the HostAdamW "
            "after ooc.wrap: sd = opt.state_dict(); opt.close(); opt = HostAdamW(...); opt.load_state_dict(sd)"
        )


def _model_as_params(module: nn.Module, model: nn.Module | None) -> tuple[nn.Module, list[torch.Tensor]]:
    """``HostAdamW(module, ...)``: the module is the model, and its parameters the ones to train.
    transformers.Trainer builds an optimizer from ``optimizer_cls_and_kwargs=(HostAdamW, {"model": model,
    ...})`` by passing the model in place of the parameters (its convention for optimizers that need
    the model); the parameter groups it would otherwise pass (no weight decay on norms and biases)
    are not made then: weight decay applies to every parameter."""
    if model is not None and model is not module:
        raise ValueError(f"HostAdamW got a module ({type(module).__name__}) in place of the parameters and another "
                         f"model= ({type(model).__name__}): pass the parameters (or the model alone) first")
    return module, list(module.parameters())


def _called_by_grad_scaler() -> bool:
    """``step()`` was called by ``torch.amp.GradScaler.step`` without ``_step_supports_amp_scaling``.

    NOTE [a GradScaler behind a wrapper]
    An optimizer wrapper that forwards ``step()``, ``zero_grad()`` and ``param_groups`` but not other
    attributes hides ``_step_supports_amp_scaling`` from GradScaler (NOTE [a GradScaler drives
    HostAdamW]): GradScaler then unscales the gradients itself, with a kernel that leaves their version
    counters alone, and calls ``step()`` from ``_maybe_opt_step`` only if it found no inf. A pipelined
    HostAdamW had read them in the backward, and trained on the scaled gradients without a word. Its
    frame among the callers is the one sign GradScaler leaves on this path (it sets nothing on the
    wrapper's optimizer), and costs no read of the gradients; ``step()`` then refuses as with
    ``_step_supports_amp_scaling``, except where the gradients it reads now are right: ``pipeline=False``
    on one rank without ``loss_scale``. An inf found skips ``step()`` altogether; a pipelined step's
    updates that began in the backward (on the non-finite gradients) are then reported at the next
    ``zero_grad()``, whose ``UncommittedStepWarning`` names a GradScaler and ``loss_scale=``: nothing
    reaches this optimizer on that path to refuse it by."""
    return caller_running(torch.amp.GradScaler._maybe_opt_step.__code__) is not None


def _check_number(name: str, value: Any) -> None:
    """A hyperparameter: a real number (or a one-element tensor), finite and >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"{name} must be one number, got a tensor of shape {tuple(value.shape)}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {number}")


_FUSED_ADAMW = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=True,
                    decoupled_weight_decay=True)
"""The ``torch.optim.AdamW`` whose update made HostAdamW's state, written into each saved group.

NOTE [a checkpoint names its update]
``Optimizer.load_state_dict`` takes the saved groups whole, and ``AdamW`` fills the keys they lack
with its defaults (``fused=None``). A HostAdamW checkpoint loaded into ``torch.optim.AdamW(fused=True)``
(training goes on without ooc) named no kernel, and the AdamW went on unfused, a rounding apart from
an uninterrupted fused run; naming the fused kernel, it goes on bit for bit. HostAdamW's own load
ignores these keys (its update is always this one)."""


_OWNER: weakref.WeakKeyDictionary[nn.Module, weakref.ref[HostAdamW]] = weakref.WeakKeyDictionary()
"""The live HostAdamW of each model: two would both update it."""


def _claim(model: nn.Module) -> None:
    """Refuse a second live optimizer on ``model`` (a closed or collected one no longer counts)."""
    ref = _OWNER.get(model)
    other = ref() if ref is not None else None
    if other is not None and other._finalizer.alive:
        raise OocError(
            f"{type(model).__name__} already has a live HostAdamW: two would both update it (a double update). "
            "close() the first optimizer (or drop every reference to it) before building another. Frameworks hold "
            "the one they built: Lightning keeps the optimizers of its last fit() or Tuner.lr_find() in "
            "trainer.optimizers (close them before the next fit(): `for opt in trainer.optimizers: opt.close()`), "
            "transformers.Trainer its own in trainer.optimizer (`trainer.optimizer.optimizer.close()` under "
            "accelerate's wrapper)."
        )


_PARAMETER_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The live HostAdamW of each parameter (by identity: a tensor's ``==`` compares values). The model's
claim alone let ``HostAdamW(model.parameters())`` beside one built with ``model=model`` update the same
weights twice a step."""


def _claim_parameters(tensors: list[torch.Tensor]) -> None:
    """Refuse parameters that a live HostAdamW already updates (a closed or collected one no longer counts)."""
    for p in tensors:
        ref = _PARAMETER_OWNER.get(p)
        other = ref() if ref is not None else None
        if other is not None and other._finalizer.alive:
            name = next((n for g in other.param_groups for n, q in zip(g.get("param_names", ()), g["params"])
                         if q is p), None)
            raise OocError(
                f"a parameter{f' ({name})' if name else ''} of shape {tuple(p.shape)} is already updated by a live "
                "HostAdamW: two would both update it (a double update). close() the first optimizer (or drop every "
                "reference to it) before building another over the same parameters, or give each optimizer "
                "parameters of its own."
            )


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups of one device and dtype, as GradScaler's kernel takes them."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _unscale_in_place(grads: list[torch.Tensor], inverse: torch.Tensor) -> bool:
    """Multiply ``grads`` (on one device, of one dtype) by ``inverse``; whether any was inf or NaN
    (GradScaler's kernel)."""
    found = torch.zeros((1,), dtype=torch.float32, device=grads[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse.to(grads[0].device))
    return bool(found.item() > 0)  # a device read: step() waits for the backward's gradients here


def _shutdown(pipeline: UpdatePipeline, handles: list[Any], comm: GroupCommunicator | None,
              backend: Backend | None) -> None:
    for handle in handles:
        handle.remove()
    pipeline.close()
    if comm is not None:
        comm.close()
    if backend is not None:
        backend.close()


class _StreamGate:
    """A streamed block's parameters are read from the host only after the block's update."""

    def __init__(self, streamer: ParamStreamer, pipe: UpdatePipeline, buckets: tuple[Bucket, ...]) -> None:
        self.streamer = streamer
        self.pipe = pipe
        self.bucket_of = {b.block: b.index for b in buckets if b.block is not None}
        streamer.before_stream_in.append(self)
        streamer.grad_moved.append(pipe.grad_moved)

    def __call__(self, block: int) -> None:
        if block in self.bucket_of:
            self.pipe.gate((self.bucket_of[block],))

    def remove(self) -> None:
        if self in self.streamer.before_stream_in:
            self.streamer.before_stream_in.remove(self)
        if self.pipe.grad_moved in self.streamer.grad_moved:
            self.streamer.grad_moved.remove(self.pipe.grad_moved)


def _home_of(p: torch.Tensor, streamer: ParamStreamer | None) -> torch.Tensor:
    """Where the weights of ``p`` live between steps: a streamed parameter's host copy, else ``p``."""
    host = streamer.host_copy(p) if streamer is not None else None
    return p if host is None else host


class _StateView:
    """The optimizer's state, settings and stage listeners for the pipeline, looked up at each use (``load_state_dict``
    replaces both the state and the groups), and weakly: the host threads must not keep a dropped
    optimizer alive."""

    def __init__(self, opt: HostAdamW) -> None:
        self._opt = weakref.ref(opt)
        self._group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}

    def state_of(self, p: torch.Tensor) -> dict[str, Any]:
        return self._opt().state[p]

    def hyper_of(self, p: torch.Tensor) -> Hyper:
        return _hyper(self._opt().param_groups[self._group_of[id(p)]])

    def listeners(self) -> list[StageListener]:
        return self._opt().stage_listeners


def _never_updated(state: Any) -> bool:
    """A parameter's state as built, before any update (on the host, or on the device for the
    parameters kept there): left out of ``state_dict()``.

    NOTE [a fresh state is not saved]
    ``torch.optim.AdamW`` creates a parameter's state at its first update, so its ``state_dict()``
    holds none for a parameter never updated; HostAdamW builds every host state up front (it checks
    the host memory once, at construction). Its ``state_dict()`` leaves out the states still at step
    0, as AdamW's would, and ``load_state_dict`` gives a parameter without a saved state a fresh one
    (zero moments, step 0, the master from the weight). Beyond matching AdamW, this keeps the bytes
    off the device: ``accelerate``'s ``prepare`` (``transformers.Trainer`` calls it) moves the
    optimizer's whole ``state_dict()`` to the device and loads it back, which for a fresh HostAdamW
    staged all its fp32 moments and masters in device memory at once (2-3x the parameters' bytes,
    more than the device has for the models HostAdamW is for)."""
    return isinstance(state, dict) and isinstance(state.get("step"), torch.Tensor) and float(state["step"]) == 0


def _loaded(p: torch.Tensor, name: str, value: Any, *, on_device: bool) -> Any:
    """A copy of one loaded state value of ``p``: host state in fp32 on the host, exactly; device
    state (``on_device``) in the parameter's dtype on its device; ``step`` as fp32 beside the rest."""
    if not isinstance(value, torch.Tensor):
        return value
    if name == "step":
        return value.detach().to(p.device if on_device else "cpu", torch.float32, copy=True)
    if on_device:
        return value.detach().to(p.device, p.dtype, copy=True)
    return HostAdamW._host_zeros_like(p).copy_(value.detach())


def _before_model_state_dict(pipe: UpdatePipeline) -> None:
    """``model.state_dict()`` waits for the updates in flight; inside a framework's save after training,
    with ``delayed_update``, it first puts the last update into the parameters.

    NOTE [the last delayed update at a framework's final save]
    With ``delayed_update`` the parameters lag the masters by one update until ``close()`` (NOTE [the
    last delayed update at the end] in ooc.optim.pipeline), and ``trainer.save_model()`` after
    ``trainer.train()`` (or Lightning's ``trainer.save_checkpoint`` after ``fit()``) saved the weights one
    update behind unless the user had closed the optimizer first; the framework still holds it then.
    A save by the framework once its training has ended (``Trainer.is_in_train`` False; Lightning's
    state ``finished``) now copies the last update in first, as ``close()`` would. The saves it makes
    while it trains (``save_steps``, ``ModelCheckpoint``) keep the lag: the next forward must read the
    older weights, and a resume from them goes on bit for bit. Training again after such a save runs
    its first step on the newest weights (the copy in is not repeated): one step without the delay.
    Likewise the framework's evaluation after its training (a forward without grad inside Trainer's
    ``evaluate()``/``predict()`` outside ``train()``, Lightning's ``validate()``/``test()``/``predict()``):
    it evaluated the weights one update behind, so the usual ``trainer.train(); trainer.evaluate();
    trainer.save_model()`` reported the metrics of other weights than it saved; it now puts the last
    update in first. The evaluations while it trains (``eval_steps``, Lightning's validation inside
    ``fit()``) keep the lag, as its saves then do. Not caught: a save or a forward of one's own after the
    framework's training (``torch.save(model.state_dict())``, ``model.generate``): ``close()`` the
    optimizer before it, as the README says."""
    pipe.synchronize()
    if pipe.config.delayed_update and saving_after_training():
        pipe.flush_delayed()


def _watch_backward(pipe: UpdatePipeline, out: Any) -> None:
    """Hook the model's outputs so that a backward through them tells the pipeline it began and,
    by a callback queued on that (outermost) backward, that it ended."""
    tensors = [t for t in _tensors_in(out) if t.requires_grad]

    def began(grad: torch.Tensor) -> None:
        if pipe.begin_backward():
            torch.autograd.Variable._execution_engine.queue_callback(pipe.end_backward)

    for t in tensors:
        t.register_hook(began)


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors_in(item)]
    return []


def _shared_buckets(model: nn.Module | None, chain: Chain | None, buckets: tuple[Bucket, ...]) -> list[int]:
    """Buckets holding a parameter that more than one block or top-level module uses (tied weights):
    its gradient may arrive in parts, so the bucket launches at the end of the backward."""
    if model is None:
        return []
    blocks = tuple(chain.names) if chain is not None else ()
    users: dict[int, set[str]] = {}
    for qualified, p in model.named_parameters(remove_duplicate=False):
        user = next((n for n in blocks if qualified.startswith(n + ".")), qualified.split(".")[0])
        users.setdefault(id(p), set()).add(user)
    return [b.index for b in buckets if any(len(users.get(id(p), ())) > 1 for p in b.params)]


def _norm_order(model: nn.Module | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The order in which ``max_grad_norm``'s global norm stacks the parameters' norms: the model's
    (``clip_grad_norm_(model.parameters())``, as transformers.Trainer, accelerate and the usual loop
    call it), then any of ``tensors`` outside the model in the optimizer's order. The stacked norms
    are summed in this order, so another one (the optimizer's, which parameter groups such as
    Trainer's decay / no-decay split reorder) gives a clip factor a rounding apart, and weights that
    drift from the loop's."""
    if model is None:
        return tensors
    mine = {id(p) for p in tensors}
    first = [p for p in model.parameters() if id(p) in mine]
    seen = {id(p) for p in first}
    return first + [p for p in tensors if id(p) not in seen]


def _hyper(group: dict[str, Any]) -> Hyper:
    beta1, beta2 = group["betas"]
    return Hyper(float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])


def _chain_of(model: nn.Module | None) -> Chain | None:
    if model is None:
        return None
    if is_wrapped(model):
        return runtime_of(model).chain
    try:
        return find_blocks(model)
    except BlockError:
        return None  # no chain: one bucket per top-level module


def _backend_for(spec: str | Backend | None, model: nn.Module | None, params: list[torch.Tensor]) -> tuple[Backend, bool]:
    """The backend to copy with, and whether this optimizer made it (and so closes it)."""
    if isinstance(spec, Backend):
        # One on another device would copy the gradients on streams they never ran on. A wrapped
        # model's streamed weights rest on the host: its runtime's backend tells its device.
        wrapped = model is not None and is_wrapped(model)
        check_backend_device(spec.device, runtime_of(model).backend.device if wrapped else tensors_device(params))
        return spec, False
    if spec is None and model is not None and is_wrapped(model):
        return runtime_of(model).backend, False
    if spec is None or spec == "auto":
        spec = "cuda" if params and params[0].is_cuda else "cpu"
    if model is not None:
        return resolve_backend(spec, model), True
    # Without a model, on the parameters' device, not the current one (cuda:0 in a new process):
    # torch copies a cuda:1 tensor on cuda:1's current stream, so a backend on cuda:0 recorded the
    # copies' events on streams they never ran on, and the host read gradients before they landed.
    return backend_on(spec, tensors_device(params)), True


def _host_bytes_needed(mine: list[torch.Tensor], host_params: list[torch.Tensor], own_master, *,  # noqa: ANN001
                       data_parallel: bool) -> int:
    """Moments (+ master) for the parameters this rank updates; transfer buffers for every
    parameter that is not its own master (the gradient in and the new weights out), and with data
    parallelism one exchange buffer for those that are."""
    state = sum(p.numel() * 4 * (2 if own_master(p) else 3) for p in mine)

    def copies(p: torch.Tensor) -> int:
        return (1 if data_parallel else 0) if own_master(p) else 2

    return state + sum(copies(p) * p.numel() * p.element_size() for p in host_params)
