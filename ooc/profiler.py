"""Measuring a model's blocks: the profile the planner and the simulator consume.

The model runs ``reps`` steps with every block recomputed, so profiling needs no more device memory
than the leanest plan: each block's activations exist only while that block's backward runs. The
byte counts come from the runtime's own tracker, so they follow exactly the accounting the runtime
applies when it later executes a plan (see NOTE [accounting by storage] in ``ooc.saved``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ooc.backend import Backend, resolve_backend
from ooc.blocks import find_blocks, shared_parameter_ids
from ooc.clock import Clock
from ooc.codec_error import measure_codec_errors
from ooc.errors import OocError, WrapError, check_saved_tensors_hooks_enabled
from ooc.hf import disable_caches
from ooc.op_profile import measure_ops
from ooc.recompute import own_attributes, set_attributes
from ooc.rng import GeneratorStates, RngState, generators_in
from ooc.runtime import check_trainable, install, is_wrapped, unwrap
from ooc.scheduler.codecs import CODECS, FLOAT_ITEMSIZE, dtype_name, swapped_sizes
from ooc.scheduler.plan import DEFAULT_MIN_SWAP_BYTES, Plan, Policy
from ooc.scheduler.profile import BlockProfile, OpProfile, Profile, SharedParameter, SharedStorage, machine_header
from ooc.storage_sharing import SharingMeter, measure_shared_storages


def default_loss(output: Any) -> torch.Tensor:
    """The first floating scalar in the output (e.g. ``(logits, loss)``), else the mean of the first
    floating tensor."""
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise WrapError("the model's output has no floating tensor to differentiate; pass loss_fn=...")
    scalars = [t for t in floats if t.numel() == 1]
    return scalars[0].sum() if scalars else floats[0].float().mean()


def call_model(model: nn.Module, sample: Any) -> Any:
    """``model(sample)``, ``model(*sample)`` for a tuple/list, ``model(**sample)`` for a mapping (a
    dict, or a Hugging Face tokenizer's or collator's ``BatchEncoding``, which is not a dict).

    An error of the forward (not ooc's own) gets a note saying how ooc called the model: a data
    loader's ``(inputs, labels)`` pair passed as the sample became two arguments, and the error came
    from deep inside the model (timm's ViT: "Expected attn_mask dtype to be bool or float")."""
    try:
        if isinstance(sample, Mapping):
            return model(**sample)
        if isinstance(sample, (tuple, list)):
            return model(*sample)
        return model(sample)
    except OocError:
        raise
    except Exception as exc:
        exc.add_note(_how_called(model, sample))
        raise


def _how_called(model: nn.Module, sample: Any) -> str:
    def show(value: Any) -> str:
        return f"Tensor{tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__

    name = type(model).__name__
    if isinstance(sample, Mapping):
        call = f"{name}(**sample) with keywords {', '.join(f'{k}={show(v)}' for k, v in sample.items())}"
    elif isinstance(sample, (tuple, list)):
        call = f"{name}(*sample) with {len(sample)} argument(s) {', '.join(show(v) for v in sample)}"
    else:
        call = f"{name}(sample) with {show(sample)}"
    return (f"ooc called {call}. A sample is one input as the model itself takes it: a tuple or list is its "
            "positional arguments, a mapping its keywords; for a data loader's (inputs, labels) pair pass "
            "sample=inputs")


class ModelState:
    """Gradients, buffers, the modules' own attributes and RNG state (every generator ``RngState`` holds,
    and the generator objects the model's modules hold: ``ooc.rng.generators_in``), so profiling leaves
    the model, and the numbers the next forward draws, as it found them.

    The attributes as a recomputed block's re-run sees them (NOTE [attributes a forward sets] in
    ``ooc.recompute``): a forward that counts its calls (an annealed temperature) or carries a state
    to the next call (``self.memory = out.detach()``) was left by a profile's steps (15 forwards for
    ``wrap(sample=...)``) that many calls on, and trained apart from plain PyTorch from its first step.
    A tensor among them that a forward changes in place (``self.ema.mul_(0.9).add_(...)``, a counter
    ``self.n += 1`` on a tensor: not a buffer) is copied, as the buffers are, and its value put back:
    putting back the attribute alone left ``ooc.describe(model, sample)`` two calls on. Tensors that
    share a parameter's or buffer's storage are not copied (the buffers are, a parameter is model state)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
        self.buffers = [(b, b.clone()) for b in model.buffers()]
        self.attributes = [(m, own_attributes(m)) for m in model.modules()]
        self.held = _held_tensors(model, self.attributes)
        self.rng = RngState(device)
        self.generators = GeneratorStates(generators_in([], model.modules()))

    def restore(self) -> None:
        with torch.no_grad():
            for p, grad in self.grads:
                p.grad = grad
            for b, saved in self.buffers:
                _put_back(b, saved)
        for m, attributes in self.attributes:
            set_attributes(m, attributes)
        with torch.no_grad():
            for t, version, saved in self.held:
                if t._version != version:
                    _put_back(t, saved)
        self.rng.restore()
        self.generators.restore()


def _held_tensors(model: nn.Module, attributes: list[tuple[nn.Module, dict[str, Any]]]
                  ) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """The tensors among the modules' own ``attributes`` (``ModelState``), each once, with its version and
    a copy of its value; not those sharing a parameter's or buffer's storage, nor inference tensors
    (no version, and nothing outside ``torch.inference_mode`` changes them in place)."""
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()] if t.layout == torch.strided}
    held: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
    for _, own in attributes:
        for value in own.values():
            if (isinstance(value, torch.Tensor) and id(value) not in held and value.layout == torch.strided
                    and not value.is_inference() and value.untyped_storage().data_ptr() not in state):
                held[id(value)] = (value, value._version, value.detach().clone())
    return list(held.values())


def _put_back(tensor: torch.Tensor, saved: torch.Tensor) -> None:
    """``tensor``'s value made ``saved`` again (under no_grad), in place: the same object, as the module holds it."""
    if tensor.shape == saved.shape:
        tensor.copy_(saved)
    else:
        # A forward that resized it (a quantization-aware observer's min/max buffers start empty and
        # take the channels' shape): its own storage again, as it was.
        tensor.set_(saved)


def _bytes(tensors: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


class StepRecorder:
    """Records what a runtime reports of its steps (``Runtime.record``): each block's phase times,
    as lists of seconds ready for a median, and the tracker's log of allocations.

    Forwards and re-runs are timed directly; a block's backward runs inside autograd, from the grad
    hook on its outputs (``backward_start``, moved past a recomputed block's re-run) to the one on its
    inputs, or on its parameters when no input requires grad (``backward_end``).

    On CUDA the stamps are events on the compute stream (``ooc.clock``): nothing waits for the GPU
    between phases, so a phase's time is what its kernels add to a step's timeline with the host's
    launches hidden under the kernels before them, as in training. (Synchronizing around each phase
    instead added each phase's launch latency and first launches: GPT-2 small's keep-all step
    profiled 57.9 ms against 48.8 ms measured on an H200.)
    """

    marks_backward = True

    def __init__(self, backend: Backend, num_blocks: int) -> None:
        self.backend = backend
        self.clock = Clock(backend.device)
        self.stamps: dict[str, list[list[tuple[Any, Any]]]] = {
            w: [[] for _ in range(num_blocks)] for w in ("forward", "recompute", "backward")
        }
        """Per phase, per block: (start, end) stamps of ``clock``, read in ``medians``."""
        self.log: list = []
        """The tracker's entries: (what, block, bytes, dtype or None)."""
        self._started: dict[int, Any] = {}

    def mark(self, block: int, what: str) -> None:
        now = self.clock.now()
        if what == "backward_start":
            self._started[block] = now
        elif block in self._started:
            self.stamps["backward"][block].append((self._started.pop(block), now))

    @contextlib.contextmanager
    def __call__(self, block: int, what: str) -> Iterator[None]:
        start = self.clock.now()
        yield
        end = self.clock.now()
        self.stamps[what][block].append((start, end))
        if what == "recompute" and block in self._started:
            # A recomputed block re-runs at its backward's start: its backward proper starts now.
            self._started[block] = end

    def clear_times(self) -> None:
        for series in self.stamps.values():
            for s in series:
                s.clear()
        self._started.clear()

    def discard(self) -> None:
        """Forget the times and the log so far (the log in place: the runtime's tracker appends to it)."""
        self.clear_times()
        self.log.clear()

    def medians(self) -> dict[str, list[float]]:
        """Per phase, each block's median seconds (0 where it was never timed)."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.backend.device)  # every stamp's event has completed (Clock.seconds)
        return {w: [statistics.median(self.clock.seconds(*pair) for pair in s) if s else 0.0 for s in series]
                for w, series in self.stamps.items()}

    def finish(self) -> dict[str, list[float]]:
        return self.medians()

    def observer(self, block: int) -> Callable[[torch.Tensor, str], None] | None:
        """What block ``block``'s recomputed forward reports its tensors to (``run_recomputed``'s ``observe``)."""
        return None


class FirstStepRecorder(StepRecorder):
    """Records the first training step of ``wrap(model, budget=...)`` without a sample (every block
    recomputed); ``finish`` makes its profile."""

    def __init__(self, model: nn.Module, chain, backend: Backend, min_swap_bytes: int) -> None:  # noqa: ANN001
        super().__init__(backend, len(chain))
        self.model, self.chain, self.min_swap_bytes = model, chain, min_swap_bytes
        self.sharing: SharingMeter | None = None
        """The storages each block holds in the step's forward (NOTE [storages shared between blocks]
        in ooc.scheduler.sharing): its profile counts each shared storage once, as ``ooc.profile``'s."""

    def observer(self, block: int) -> Callable[[torch.Tensor, str], None]:
        if self.sharing is None:
            # Made at the step's forward: a model.to() after wrap moved the parameters.
            state = frozenset(t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))
            self.sharing = SharingMeter(len(self.chain), skip_ptrs=state, device=self.backend.device)
        sharing = self.sharing
        return lambda tensor, role: sharing.note(block, tensor, role)

    def discard(self) -> None:
        super().discard()
        self.sharing = None

    def finish(self) -> Profile:
        med = self.medians()
        return block_profiles_to_profile(
            self.chain, self.log, med["forward"], med["backward"], [0] * len(self.chain), self.min_swap_bytes, 0.0,
            rerun_s=med["recompute"],
            model=type(self.model).__name__, machine={"backend": self.backend.name, "device": str(self.backend.device)},
            notes="the first training step under wrap(model, budget=...): times include its warm-up",
            outside_param_bytes=outside_param_bytes(self.model, self.chain),
            shared_params=shared_parameter_ids(self.model, self.chain),
            shared=None if self.sharing is None else self.sharing.result(),
        )


def _run_steps(model: nn.Module, chain, plan: Plan, backend: Backend, sample: Any, loss_fn, reps: int) -> tuple[StepRecorder, list[float]]:
    """``reps`` timed steps (after one warm-up) of ``model`` under ``plan``: the recorder (its log
    holds the last step) and each step's seconds."""
    runtime = install(model, chain, plan, backend)
    recorder = StepRecorder(backend, len(chain))
    runtime.record(recorder)
    totals: list[float] = []
    try:
        for rep in range(reps + 1):  # the first run warms up allocators and kernels
            recorder.log.clear()
            if rep == 1:
                recorder.clear_times()
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = loss_fn(call_model(model, sample))
            loss.backward()
            if backend.device.type == "cuda":
                torch.cuda.synchronize(backend.device)
            totals.append(time.perf_counter() - start)
            del loss
    finally:
        runtime.record(None)
        if is_wrapped(model):  # a chain that did not run unwraps itself (NOTE [which chain] in ooc.blocks)
            unwrap(model)
    return recorder, totals[1:]


def _keep_all_fits(backend: Backend, keep_peak: int) -> bool:
    if backend.device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(backend.device)
    return keep_peak < 0.6 * free


def profile(
    model: nn.Module,
    sample: Any,
    *,
    blocks: object = None,
    reps: int = 3,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    backend: str | Backend = "auto",
    min_swap_bytes: int = DEFAULT_MIN_SWAP_BYTES,
    name: str | None = None,
    codec_errors: bool = True,
    ops: bool = False,
) -> Profile:
    """Measure per-block forward/backward time (median of ``reps``) and saved/input/output/param bytes.

    ``sample`` is one batch as the model takes it (a tensor, a tuple of args, or a dict of kwargs).
    Bytes come from a pass with every block recomputed (the least memory any plan needs). Times come
    from a pass with every block kept, when that fits (always on CPU): a kept block's backward reads
    activations made long before, as in training, where a recomputed one finds them in cache. Each
    block's re-run time (``BlockProfile.rerun_s``: it stops at the block's last saved tensor) comes
    from the pass with every block recomputed.
    ``codec_errors``: also measure how far each lossy codec moves each block's gradients (one more
    step, then each block differentiated once per codec; NOTE [codec error] in ``ooc.codec_error``),
    which the planner reads to keep a codec off the blocks it would harm.
    ``ops``: also measure each block's forward op by op (``BlockProfile.ops``, NOTE [op-level
    profile] in ``ooc.scheduler.profile``; ``reps`` more forwards, each op timed by stamps around its
    kernels), what the op-level planner needs for selective recompute.
    The model's gradients, buffers, modules' own attributes and RNG state are restored afterwards.
    """
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    check_saved_tensors_hooks_enabled("ooc profiled the model on a sample (ooc.profile, ooc.plan, or ooc.wrap with "
                                      "a sample)", measuring=True)
    check_trainable(model)
    chain = find_blocks(model, blocks)
    backend_obj = resolve_backend(backend, model)
    state = ModelState(model, backend_obj.device)
    # Every measurement runs as the runtime will, HF key/value caches off (they change a layer's ops),
    # without a word: each runtime installed below finds them off already and says nothing either
    # (it said so once per measurement, four times for one wrap(sample=...)).
    restore_caches = disable_caches(model)
    outputs = [0] * len(chain)
    handles = [
        m.register_forward_hook(lambda _m, _a, out, i=i: outputs.__setitem__(i, _bytes(out)))
        for i, m in enumerate(chain.modules)
    ]
    n = len(chain)
    try:
        try:
            recompute = Plan.uniform(Policy.RECOMPUTE, n, min_swap_bytes=min_swap_bytes)
            recorder, totals = _run_steps(model, chain, recompute, backend_obj, sample, loss_fn, reps)
            med, log = recorder.medians(), recorder.log
            # Every block recomputed: its forward (with autograd, saving nothing) and its re-run,
            # which stops at its last save (NOTE [a re-run stops at the last save]).
            forward_s, backward_s, rerun_s = med["forward"], med["backward"], med["recompute"]
            outside = statistics.median(totals) - sum(med["forward"]) - sum(med["recompute"]) - sum(med["backward"])
            saved_total = sum(_sums(log, "recompute", n, min_swap_bytes)[0])
            if _keep_all_fits(backend_obj, saved_total):
                keep = Plan.uniform(Policy.KEEP, n, min_swap_bytes=min_swap_bytes)
                krecorder, ktotals = _run_steps(model, chain, keep, backend_obj, sample, loss_fn, reps)
                kmed = krecorder.medians()
                if all(kmed["backward"]):
                    forward_s, backward_s = kmed["forward"], kmed["backward"]
                    outside = statistics.median(ktotals) - sum(forward_s) - sum(backward_s)
        finally:
            for h in handles:
                h.remove()
        state_ptrs = frozenset(t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()))
        shared = measure_shared_storages(list(chain.modules), lambda: call_model(model, sample), skip_ptrs=state_ptrs,
                                         device=backend_obj.device)
        # After the output hooks are gone: the measurement re-runs blocks on their own.
        errors = _codec_errors(model, chain, recompute, backend_obj, sample, loss_fn) if codec_errors else None
        op_profiles = _op_profiles(model, chain, backend_obj, sample, reps) if ops else None
    finally:
        restore_caches()
        state.restore()
        if not isinstance(backend, Backend):
            backend_obj.close()

    return block_profiles_to_profile(
        chain, log, forward_s, backward_s, outputs, min_swap_bytes, outside,
        rerun_s=rerun_s,
        model=name or type(model).__name__,
        machine={**machine_header(), "backend": backend_obj.name, "device": str(backend_obj.device)},
        notes=f"median of {reps} steps after one warm-up; outside_forward_s holds all time outside the chain",
        outside_param_bytes=outside_param_bytes(model, chain),
        shared_params=shared_parameter_ids(model, chain),
        codec_errors=errors,
        shared=shared,
        ops=op_profiles,
    )


def _op_profiles(model: nn.Module, chain, backend: Backend, sample: Any, reps: int) -> list[tuple[OpProfile, ...]]:  # noqa: ANN001
    """Per block, its forward op by op, measured as the runtime will see it (``profile`` has turned the
    model's key/value caches off, as ``wrap`` does)."""
    return measure_ops(list(chain.modules), list(chain.names), lambda: call_model(model, sample),
                       device=backend.device, reps=reps)


def _codec_errors(model: nn.Module, chain, plan: Plan, backend: Backend, sample: Any, loss_fn) -> list[dict[str, float]]:  # noqa: ANN001
    """Per block, each codec's gradient error (NOTE [codec error]), from one step under ``plan``."""
    def capture_step() -> None:
        install(model, chain, plan, backend)
        try:
            model.zero_grad(set_to_none=True)
            loss_fn(call_model(model, sample)).backward()
        finally:
            if is_wrapped(model):
                unwrap(model)

    capability = torch.cuda.get_device_capability(backend.device) if backend.device.type == "cuda" else None
    codecs = [c for c, spec in CODECS.items() if spec.supported(capability)]
    state = frozenset(t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()))
    return measure_codec_errors(list(chain.modules), capture_step, codecs, skip_ptrs=state,
                                min_swap_bytes=plan.min_swap_bytes, device=backend.device)


def outside_param_bytes(model, chain) -> int:  # noqa: ANN001
    """Bytes of the model's parameters that belong to no block of the chain."""
    inside = {id(p) for m in chain.modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)


def block_profiles_to_profile(
    chain, log: list, forward_s: list[float], backward_s: list[float], outputs: list[int], min_swap_bytes: int,
    outside_s: float, *, model: str, machine: dict[str, str], notes: str, outside_param_bytes: int = 0,
    codec_errors: list[dict[str, float]] | None = None, shared: list[tuple[SharedStorage, ...]] | None = None,
    ops: list[tuple[OpProfile, ...]] | None = None, rerun_s: list[float] | None = None,
    shared_params: frozenset[int] = frozenset(),
) -> Profile:
    """A profile from the tracker's log of an all-recompute step (bytes) and measured times;
    ``shared``: per block, the storages other blocks hold too (``ooc.storage_sharing``);
    ``shared_params``: ``id`` of the parameters that stay resident (``ooc.blocks.shared_parameter_ids``);
    ``rerun_s``: per block, its plain re-run's seconds (``BlockProfile.rerun_s``)."""
    n = len(chain)
    saved_bytes, swappable, swappable_count, saved_compressed = _sums(log, "recompute", n, min_swap_bytes)
    inputs, inputs_swappable, inputs_count, inputs_compressed = _sums(log, "save", n, min_swap_bytes)
    activation_dtypes = _activation_dtypes(log, n, min_swap_bytes)
    block_profiles = []
    numbers: dict[int, int] = {}  # a shared parameter's id within the profile: the order it is first met
    for i, module in enumerate(chain.modules):
        params = list(module.parameters())
        block_profiles.append(
            BlockProfile(
                name=chain.names[i],
                forward_s=forward_s[i],
                backward_s=backward_s[i],
                saved_bytes=saved_bytes[i],
                swappable_bytes=swappable[i],
                input_bytes=inputs[i],
                input_swappable_bytes=inputs_swappable[i],
                output_bytes=outputs[i],
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                grad_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
                swappable_storages=swappable_count[i],
                input_swappable_storages=inputs_count[i],
                compressed=tuple(
                    (c, saved_compressed[0][i][c], inputs_compressed[0][i][c], saved_compressed[1][i][c], inputs_compressed[1][i][c])
                    for c in saved_compressed[0][i]
                ),
                codec_error=() if codec_errors is None else tuple(codec_errors[i].items()),
                shared=() if shared is None else shared[i],
                shared_params=tuple(SharedParameter(numbers.setdefault(id(p), len(numbers)), p.numel() * p.element_size())
                                    for p in params if id(p) in shared_params),
                ops=() if ops is None else ops[i],
                rerun_s=None if rerun_s is None else rerun_s[i],
                activation_dtype=activation_dtypes[i],
            )
        )
    return Profile(
        blocks=tuple(block_profiles),
        min_swap_bytes=min_swap_bytes,
        outside_forward_s=max(0.0, outside_s),
        outside_backward_s=0.0,
        outside_param_bytes=outside_param_bytes,
        model=model,
        source="measured",
        machine=machine,
        notes=notes,
    )


def _activation_dtypes(log: list, n: int, min_swap_bytes: int) -> list[str | None]:
    """Per block: the floating-point dtype (``FLOAT_ITEMSIZE``) of most of its swappable saved and
    input bytes (``BlockProfile.activation_dtype``; the profile records each codec's bytes anyway,
    so this only describes the block), ``None`` where none is floating-point."""
    seen: list[dict[str, int]] = [{} for _ in range(n)]
    for kind, block, nbytes, dtype in log:
        if kind in ("recompute", "save") and nbytes >= min_swap_bytes and dtype is not None:
            name = dtype_name(dtype)
            if name in FLOAT_ITEMSIZE:
                seen[block][name] = seen[block].get(name, 0) + nbytes
    return [max(counts, key=counts.__getitem__) if counts else None for counts in seen]


def _sums(log: list, what: str, n: int, min_swap_bytes: int) -> tuple[list[int], list[int], list[int], tuple[list[dict[str, int]], list[dict[str, int]]]]:
    """Per block: bytes the tracker saw allocated as ``what``; those in swappable storages; how many
    swappable storages; per codec, the swappable bytes once compressed and the largest storage's codes."""
    total, large, count = [0] * n, [0] * n, [0] * n
    storages: list[list[tuple[int, Any]]] = [[] for _ in range(n)]
    for kind, block, nbytes, dtype in log:
        if kind == what:
            total[block] += nbytes
            if nbytes >= min_swap_bytes:
                large[block] += nbytes
                count[block] += 1
                storages[block].append((nbytes, dtype))
    sizes = [{codec.value: swapped_sizes(codec, held) for codec in CODECS} for held in storages]
    compressed = [{codec: size[0] for codec, size in block.items()} for block in sizes]
    largest = [{codec: size[1] for codec, size in block.items()} for block in sizes]
    return total, large, count, (compressed, largest)
