"""RECOMPUTE: run a block's forward without keeping its saved tensors, and re-run it when backward needs them.

NOTE [recompute through saved-tensor hooks]
This is the mechanism of ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, written for ooc
(torch's version lives in private functions whose signatures change between releases, and it lacks
what ooc adds below). The block's forward runs normally, inside the caller's autograd graph, under a
pack hook that replaces every saved tensor by an empty ``_Holder``. The first time backward unpacks
one of them, the block's forward is re-run under a second pack hook that puts each re-saved tensor
into its holder, in order, and stops the re-run (``_StopRecompute``) once the last holder is filled.
Each holder hands its tensor out once and forgets it. Because every node of the block stays a node
of the caller's graph, everything autograd does works as without ooc: ``autograd.grad`` with
``inputs=``, ``backward(inputs=...)``, hooks, double backward (``create_graph=True``), backward
inside the block's forward, outputs that do not require grad when nothing in the block does.

Recomputed tensors belong to one backward (keyed by autograd's graph task id): a second backward
over a graph kept with ``retain_graph=True`` re-runs the block again.

What ooc adds to torch's mechanism:
- The block's tensor arguments are held through the block's own pack hook (``save_input``), so they
  are counted by the tracker and swapped to the host when the plan says ``swap_input``.
- Every tensor the re-run saves goes through the runtime's ``recompute_pack`` hook (the tracker
  counts it as "recompute", at the block's backward start, as the schedule does).
- The re-run replays the CPU and the block device's RNG state (dropout masks repeat bit for bit),
  Python's and numpy's global generators (NOTE [generators a re-run replays] in ``ooc.rng``) and
  the autocast state of the first run, and updates a copy of the block's buffers, so BatchNorm
  running statistics are updated once per step, as without ooc (torch's checkpoint updates them twice).
- Every re-run is checked: a different number of saved tensors, or a different shape, dtype or
  device of one, raises :class:`RecomputeError` naming the block; ``check_recompute=True`` also
  compares the values bit for bit (against host copies taken in the forward).
- A block that modifies one of its tensor arguments in place, or whose argument is modified in place
  before its backward, cannot be re-run from that argument: that raises too, never a wrong gradient.
- Selective recompute (``cached_ops``): the forward keeps the outputs of some ops and the re-run
  takes them instead of running those ops again (NOTE [selective recompute] in ``ooc.op_profile``),
  and leaves out the ops whose outputs only those read (NOTE [the re-run leaves ops out]); those of
  ``swapped_ops`` wait on the host in between, moved by the swap engine.

NOTE [the re-run sees the forward's state]
Autograd checks that a saved tensor was not modified in place before backward reads it (its
version counter), but not through saved-tensor hooks, and a re-run reads the model as it is at
backward time. So the frame keeps what the block's forward saw (``BlockState``) and checks the rest:
- Buffers: each re-run reads a copy of their values from before the forward, and its updates go to
  that copy (a spectral norm's power iteration reads and updates its ``u`` buffer; a re-run from the
  updated one gave other weights, hence wrong gradients, silently).
- Parameters and buffers replaced between the forward and the backward (``torch.func.functional_call``
  swaps them in for the call only) are put back for the re-run; training flags and
  generator objects (``torch.Generator``, ``random.Random``, numpy's; arguments, or attributes of the
  block's modules, also inside a container, a helper object or a closure: ``ooc.rng.generators_in``) too.
- A tensor the forward saved that is still alive (a parameter, a tensor held by the caller, the
  block's output) and modified in place before the re-run, or a re-saved tensor modified after the
  re-run saved it, raises :class:`RecomputeError` where plain PyTorch raises its "modified by an
  inplace operation" error: the re-run would read the new values.
- So does a parameter or non-persistent buffer of the block that the forward read without saving it
  (a linear's bias: ``addmm`` saves its two matrices only) and that is modified in place before the
  re-run (an optimizer step, or a ``no_grad`` update, on it alone). Plain PyTorch raises nothing
  there: its backward uses what the forward saved, computed from the old value, which the re-run
  cannot get back; it used to read the new value, and the gradients of another function came out
  silently (``BlockState.check_unchanged``).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_unflatten

from ooc import nvtx
from ooc.errors import OocError, check_saved_tensors_hooks_enabled
from ooc.hf import cache_argument
from ooc.op_profile import ForwardCache, OpCounter, Replay
from ooc.rng import (
    EntropyWatch,
    GeneratorStates,
    NumpyReadWatch,
    RngState,
    generators_in,
    note_numpy_draws,
    numpy_draws,
    numpy_mark,
)


class RecomputeError(OocError, RuntimeError):
    """A recomputed block cannot be re-run faithfully (its re-run differs from its forward)."""


class AutocastState:
    """Autocast as the first run saw it, for the block's device type and for the CPU."""

    __slots__ = ("states",)

    def __init__(self, device: torch.device) -> None:
        kinds = dict.fromkeys((device.type, "cpu"))
        self.states = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k), torch.is_autocast_cache_enabled())
                       for k in kinds]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype, cache in self.states:
                stack.enter_context(torch.autocast(kind, dtype, enabled, cache))
            yield


class BlockState:
    """The block's parameters, buffers, training flags and generators as its forward saw them
    (NOTE [the re-run sees the forward's state]). Taken before the forward.

    Persistent buffers (model state: BatchNorm statistics, a spectral norm's vectors; small) are
    copied; non-persistent ones (constants such as causal masks, possibly large) are held as they
    are, and a forward that modifies one in place is refused (``check_constants``)."""

    __slots__ = ("tensors", "buffers", "constants", "training", "attributes", "held", "held_versions", "generators", "ptrs",
                 "copy_ptrs", "names", "versions")

    def __init__(self, module: torch.nn.Module, leaves: list[Any]) -> None:
        self.tensors: list[tuple[dict, str, torch.Tensor]] = []
        """Parameters and non-persistent buffers: put back by identity if replaced."""
        self.names: list[str] = []
        """Per entry of ``tensors``: "parameter <qualified name>" or "buffer <qualified name>", for errors."""
        self.versions: list[int] = []
        """Per entry of ``tensors``: its version after the forward (``mark_versions``)."""
        self.buffers: list[tuple[dict, str, torch.Tensor]] = []
        """Persistent buffers: a copy of their values before the forward."""
        self.constants: list[tuple[torch.Tensor, int]] = []
        """Non-persistent buffers and their versions before the forward."""
        self.training: list[tuple[torch.nn.Module, bool]] = []
        self.attributes: list[tuple[torch.nn.Module, dict[str, Any]]] = []
        """Per module: its own attributes before the forward (NOTE [attributes a forward sets])."""
        self.held: list[tuple[str, torch.Tensor, int]] = []
        """The tensors among ``attributes`` (the re-run reads them): qualified name, tensor, version before the forward."""
        self.held_versions: list[int] = []
        """Per entry of ``held``: its version after the forward (``mark_versions``)."""
        named = list(module.named_modules())
        modules = [m for _, m in named]
        for prefix, m in named:
            self.training.append((m, m.training))
            attributes = own_attributes(m)
            self.attributes.append((m, attributes))
            # An inference tensor (made under torch.inference_mode) has no version, and nothing changes it in place.
            self.held += [(f"{prefix}.{k}" if prefix else k, v, v._version) for k, v in attributes.items()
                          if isinstance(v, torch.Tensor) and not v.is_inference()]
            for name, t in m._parameters.items():
                if t is not None:
                    self.tensors.append((m._parameters, name, t))
                    self.names.append(f"parameter {prefix}.{name}" if prefix else f"parameter {name}")
            for name, t in m._buffers.items():
                if t is None:
                    continue
                if name in m._non_persistent_buffers_set:
                    self.tensors.append((m._buffers, name, t))
                    self.names.append(f"buffer {prefix}.{name}" if prefix else f"buffer {name}")
                    self.constants.append((t, t._version))
                else:
                    self.buffers.append((m._buffers, name, t.detach().clone()))
        self.generators = GeneratorStates(generators_in(leaves, modules))
        owners = [t for _, _, t in self.tensors] + [d[name] for d, name, _ in self.buffers]
        self.ptrs = {t.untyped_storage().data_ptr(): t for t in owners if t.layout == torch.strided}
        """Storage address -> the parameter or buffer that owns it (the block's model state)."""
        self.copy_ptrs: frozenset[int] = frozenset()
        """Storages of the buffer copies the current re-run reads (see ``restored``)."""

    def check_constants(self, name: str) -> None:
        """After the forward: refuse a forward that modified a non-persistent buffer in place (its value
        before the forward, which the re-run must read, was not copied)."""
        for tensor, version in self.constants:
            if tensor._version != version:
                raise RecomputeError(
                    f"block {name} modifies a non-persistent buffer {tuple(tensor.shape)} in place in its forward, so "
                    "a re-run would read another value; register it as a persistent buffer (ooc then copies it "
                    "before the forward), or plan this block as keep or swap"
                )
        for label, tensor, version in self.held:
            if tensor._version != version:
                raise RecomputeError(
                    f"block {name} modifies its tensor attribute {label} {tuple(tensor.shape)} in place in its forward, "
                    "so a re-run would read another value and change it again (NOTE [attributes a forward sets]); "
                    "register it as a persistent buffer (ooc then copies it before the forward), assign a new tensor "
                    "instead of changing it in place, or plan this block as keep or swap"
                )

    def mark_versions(self) -> None:
        """After the forward, and after each re-run (what a re-run changes in place, an embedding's
        ``max_norm`` renormalising its rows, is the forward's doing again): the versions
        ``check_unchanged`` compares."""
        self.versions = [t._version for _, _, t in self.tensors]
        self.held_versions = [t._version for _, t, _ in self.held]

    def check_unchanged(self, name: str) -> None:
        """Before a re-run: refuse one that would read a parameter or non-persistent buffer changed in
        place since the forward. Those the forward saved are checked as saved tensors; this catches the
        ones it read without saving (a linear's bias: ``addmm`` saves its matrices only), whose new value
        would flow into what the re-run saves, where plain PyTorch's backward uses the forward's."""
        for (_, _, tensor), label, version in zip(self.tensors, self.names, self.versions):
            if tensor._version != version:
                raise RecomputeError(
                    f"block {name}: its {label} {tuple(tensor.shape)} was modified in place after the block's forward "
                    "(an optimizer step or a no_grad update between the forward and the backward), so the block's re-run "
                    "would read the new value where plain PyTorch's backward uses the forward's; run the backward before "
                    "changing it, or plan this block as keep or swap"
                )
        for (label, tensor, _), version in zip(self.held, self.held_versions):
            if tensor._version != version:
                raise RecomputeError(
                    f"block {name}: its tensor attribute {label} {tuple(tensor.shape)} was modified in place after the "
                    "block's forward, so the block's re-run would read the new value where plain PyTorch's backward uses "
                    "what the forward computed from the old one; run the backward before changing it, or plan this block "
                    "as keep or swap"
                )

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the re-run on the forward's state; put the current one back after."""
        current: list[tuple[dict, str, torch.Tensor | None]] = []
        flags = [(m, m.training, training) for m, training in self.training if m.training != training]
        generators = self.generators.now()
        attributes = [(m, own_attributes(m)) for m, _ in self.attributes]  # as the re-run finds them
        try:
            for d, name, tensor in self.tensors:
                if (now := d.get(name)) is not tensor:
                    current.append((d, name, now))
                    d[name] = tensor
            copies = set()
            for d, name, before in self.buffers:
                current.append((d, name, d.get(name)))
                d[name] = before.clone()  # updated by this re-run, then dropped
                copies.add(d[name].untyped_storage().data_ptr())
            self.copy_ptrs = frozenset(copies)
            for m, _, training in flags:
                m.training = training
            for m, before in self.attributes:
                set_attributes(m, before)
            self.generators.restore()
            yield
        finally:
            self.copy_ptrs = frozenset()
            for d, name, tensor in current:
                d[name] = tensor
            for m, now in attributes:
                set_attributes(m, now)
            for m, training, _ in flags:
                m.training = training
            generators.restore()


_MODULE_KEYS = frozenset(torch.nn.Module().__dict__) | {"forward", "__deepcopy__"}
"""``nn.Module``'s own entries of an instance's ``__dict__`` (parameters, buffers, submodules, hooks, the
training flag: ``BlockState`` handles those apart), the ``forward`` ooc installs on a block and the
``__deepcopy__`` it installs on a wrapped model (``ooc.plain_copy``)."""


def own_attributes(module: torch.nn.Module) -> dict[str, Any]:
    """The attributes a module's code keeps on it: a step counter, a state, a tensor kept for display.

    NOTE [attributes a forward sets]
    A forward may set attributes of its modules: a counter (``self.step += 1``) that an annealed
    temperature reads, a state carried to the next call (``self.memory = out.detach()``), a tensor kept
    for display (an attention map, a mixture of experts' ``self.aux_loss``, ``retain_grad()`` on it).
    A re-run runs the forward again: it read the values the forward had set (the counter one step
    on, the next call's state: other saved tensors, wrong gradients, silently), set them again (the
    counter counted each step twice) and left its own tensors on the modules (their ``.grad`` None
    after the backward, where ``retain_grad()`` fills the forward's). So the re-run starts from the
    attributes as they were before the forward and, once it ends, they are put back as it found them.
    Only the modules' own attributes (an entry of their ``__dict__``, replaced or added): a change
    inside an object they hold (a list appended to, a config's field) is the re-run's again. A value
    the forward replaces stays alive until the block's backward (the re-run reads it). A tensor among
    them changed in place, by the forward or between it and the re-run, cannot be put back: that is
    refused (``BlockState.check_constants``, ``check_unchanged``), as for a non-persistent buffer."""
    return {k: v for k, v in module.__dict__.items() if k not in _MODULE_KEYS}


def set_attributes(module: torch.nn.Module, attributes: dict[str, Any]) -> None:
    """Make ``module``'s own attributes ``attributes``: those that differ set back, those added since removed."""
    own = module.__dict__
    for name in [k for k in own if k not in _MODULE_KEYS and k not in attributes]:
        del own[name]
    for name, value in attributes.items():
        if own.get(name, _MISSING) is not value:
            own[name] = value


_MISSING = object()


class PlanMismatchWarning(UserWarning):
    """A selectively recomputed block's forward did not fit its plan's ``cached_ops`` (NOTE [a
    forward the plan does not fit] in ``ooc.op_profile``): its re-run ran whole, as a plain one."""


_FALLBACK = ("This backward re-ran the block whole, without the cache (plain recompute: the same gradients, more "
             "time, and the outputs cached before it stopped held besides)")

_EVAL_HINT = ("; the block's forward ran with modules in eval mode (model.eval() turns dropout off), which runs other "
              "ops than the training step its op-level profile measured: call model.train() before a forward you "
              "differentiate, or profile and plan in eval mode")


class _StopRecompute(BaseException):
    """Raised by the re-run's pack hook once every saved tensor the backward needs is recomputed.

    A ``BaseException``: a block whose forward catches ``Exception`` (a fallback path) must not
    swallow it and run on into tensors its forward never saved."""


class _Holder:
    """Stands in for one saved tensor of the block's forward; holds its recomputed value per backward.

    ``tensors[gid]`` is the tensor recomputed for graph task ``gid`` until backward unpacks it, then
    None (a tensor is handed out once, so it dies with the node that used it, even under
    ``retain_graph=True``).
    """

    __slots__ = ("tensors", "versions", "__weakref__")

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor | None] = {}
        self.versions: dict[int, int] = {}
        """The version of ``tensors[gid]`` when the re-run saved it (checked when it is unpacked)."""


_outside_backward = itertools.count(-2, -1)
"""Keys of the re-runs that reads outside a backward trigger (NOTE [a saved tensor read outside a backward]);
negative, where a backward's graph task id is not."""


def _uncounted(tensor: torch.Tensor) -> None:
    """The accounting of a re-run outside a backward: none (NOTE [a saved tensor read outside a backward])."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor classes without a ``__torch_dispatch__`` of their own (``_detach``)."""


def _detach(tensor: torch.Tensor, replay: Replay | None) -> torch.Tensor:
    """``tensor.detach()`` in a re-run's pack hook. Where the selective re-run's ``Replay`` is the one
    dispatch mode (paused here: NOTE [counting a block's ops] in ``ooc.op_profile``) and the tensor has
    no ``__torch_dispatch__`` of its own (a plain tensor or a parameter), that mode would only pass the
    detach on to its kernel: it goes there directly (a microsecond, not three, per tensor the re-run
    saves). Another mode, or a tensor subclass, sees it as before."""
    if (replay is not None and type(tensor) in _PLAIN and torch._C._len_torch_dispatch_stack() == 1
            and torch._C._get_dispatch_stack_at(0) is replay):
        with torch._C._DisableTorchDispatch():
            return tensor.detach()
    return tensor.detach()


def _meta(t: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return (t.shape, t.dtype, t.device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


class _RerunSaved:
    """A tensor a re-run saved, as the re-run's own graph holds it until the re-run ends (NOTE [a re-run's
    graph outlives it])."""

    __slots__ = ("block", "tensor")

    def __init__(self, block: str, tensor: torch.Tensor) -> None:
        self.block = block
        self.tensor: torch.Tensor | None = tensor


def _unpack_rerun(box: _RerunSaved) -> torch.Tensor:
    if box.tensor is None:
        raise RecomputeError(
            f"a backward reached the graph of block {box.block}'s re-run, whose saved tensors are freed when the "
            "re-run ends (NOTE [a re-run's graph outlives it] in ooc.recompute): the tensor it starts from was made "
            "by the re-run (the block keeps it on a module, and the re-run replaced the forward's). Plain PyTorch "
            "raises here too when the backward already freed that graph; keep the forward's tensor (read it before "
            "the backward), or plan this block as keep or swap"
        )
    return box.tensor


def _release_leaves(leaves: list[torch.Tensor]) -> None:
    """Point the leaves under a re-run's arguments (``_arguments``: the block got views of them) at empty
    storages once the re-run is over (NOTE [a re-run's graph outlives it]): the re-run's graph holds
    each leaf (its ``AccumulateGrad`` node), and the leaf the held argument's storage. The views, and
    the aliases the holders keep, hold that storage themselves, which ``.data`` leaves alone."""
    for leaf in leaves:
        if leaf.layout == torch.strided:
            # ooc's bookkeeping, not the block's: no dispatch mode of the caller's sees it (``_detach``).
            with torch._C._DisableTorchDispatch():
                leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)


@contextlib.contextmanager
def _unbatched() -> Iterator[None]:
    """Run a re-run outside any vmap its backward runs under.

    NOTE [a re-run under a batched backward]
    ``torch.autograd.grad(..., is_grads_batched=True)`` (and ``autograd.functional.jacobian(...,
    vectorize=True)``, built on it) runs the backward under the legacy vmap's mode, and with it the
    re-runs it triggers, where a random op (dropout) raised "vmap: We do not yet support calling random
    operations inside of vmap"; ``torch.func.vmap`` over a backward likewise. The forward ran
    unbatched (ooc refuses torch.func transforms over it), and its re-run, which computes tensors
    the forward saved, does too: the mode's nesting is stepped down to 0 for it (no getter for the
    level: one step up, read, and back) and functorch's layers are left out."""
    level = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    for _ in range(level):
        torch._C._vmapmode_decrement_nesting()
    try:
        with torch._C._DisableFuncTorch():
            yield
    finally:
        for _ in range(level):
            torch._C._vmapmode_increment_nesting()


class RecomputeFrame:
    """One recomputed call of a block: its held arguments, the state to replay, the holders to fill."""

    def __init__(
        self,
        forward: Callable[..., Any],
        module: torch.nn.Module,
        name: str,
        device: torch.device,
        recompute_pack: Callable[[], Callable[[torch.Tensor], object]],
        range_name: str,
        timer: Callable[[str], contextlib.AbstractContextManager],
        check_values: bool,
    ) -> None:
        self.forward = forward
        self.module = module
        self.name = name
        self.device = device
        self.recompute_pack = recompute_pack
        self.range_name = range_name
        self.timer = timer
        self.check_values = check_values
        # NOTE [numpy's state where it is drawn] in ooc.rng: numpy's state only for a block that draws from it.
        mark = numpy_mark()
        self.numpy_known = numpy_draws(module, mark)
        self.rng = RngState(device, numpy=self.numpy_known is not False)
        self.numpy_before = mark if self.numpy_known is False else None
        self.autocast = AutocastState(device)
        self.leaves: list[Any] = []
        self.spec: Any = None
        self.tensor_slots: list[int] = []
        self.requires_grad: list[bool] = []
        self.is_leaf: list[bool] = []
        self.versions: list[tuple[torch.Tensor, int] | None] = []
        self.in_flight: list[Callable[[], bool] | None] = []
        """Per tensor argument copied to the host (``swap_input``): whether the caller modified it in
        place while the copy could still read it (``hold_inputs``)."""
        self.load_input: Callable[[object], torch.Tensor] = lambda packed: packed  # type: ignore[assignment, return-value]
        self.holders: list[weakref.ref[_Holder]] = []
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.values: list[torch.Tensor | None] = []
        self.state: BlockState | None = None
        self.saved: list[tuple[Callable[[], torch.Tensor | None], int]] = []
        """Per tensor the forward saved: how to reach it if it is still alive, and its version then."""
        self.counts: dict[int, int] = {}
        self.done: set[int] = set()
        self.forward_done = False
        self.unchecked = False
        self.cache: ForwardCache | None = None
        """Selective recompute: the forward's cached op outputs (NOTE [selective recompute] in ooc.op_profile)."""

    def _uncounted(self, mode: OpCounter | None) -> contextlib.AbstractContextManager:
        """Ops this frame runs inside a hook are not the block's (NOTE [counting a block's ops])."""
        return contextlib.nullcontext() if mode is None else mode.paused()

    # -- the first run ------------------------------------------------------------------------

    def hold_inputs(
        self, leaves: list[Any], spec: Any, save_input: Callable[[torch.Tensor], object],
        load_input: Callable[[object], torch.Tensor],
    ) -> None:
        """Hold the call's tensor arguments through ``save_input`` (the block's pack hook)."""
        self.spec = spec
        self.load_input = load_input
        self.tensor_slots = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.requires_grad = [leaves[k].requires_grad for k in self.tensor_slots]
        self.is_leaf = [leaves[k].is_leaf for k in self.tensor_slots]
        self.state = BlockState(self.module, leaves)
        self.leaves = list(leaves)
        for k in self.tensor_slots:
            self.leaves[k] = held = save_input(leaves[k])
            # A copy to the host (``swap_input``) reads the argument until the schedule orders it before
            # compute (after the next block's forward): an in-place change by the caller before then
            # (``x += block(x)``) races it, and the re-run would start from either value. Watched through
            # an alias that shares the argument's version counter (the argument may die before then).
            watch = getattr(held, "watch", None)
            self.in_flight.append(None if watch is None else watch(leaves[k].detach()))

    def note_versions(self, leaves: list[Any], before: list[int]) -> None:
        """After the first run: refuse a block that modified an argument in place; remember the versions
        of the arguments held as themselves, to refuse a re-run from one modified later."""
        for k, version in zip(self.tensor_slots, before):
            if leaves[k]._version != version:
                raise RecomputeError(
                    f"block {self.name} modifies its argument {k} in place, so it cannot be recomputed from "
                    "that argument (its value before the block is gone); plan this block as keep or swap, "
                    "or make the operation out of place"
                )
        self.state.check_constants(self.name)
        if (parent := self.state.generators.spawned()) is not None:
            raise RecomputeError(
                f"block {self.name} spawns from a numpy seed sequence it holds ({type(parent).__name__}.spawn), whose "
                "count of children numpy cannot set back, so its re-run would spawn other children and draw other "
                "numbers (NOTE [spawned children] in ooc.rng). Spawn the children once, outside the forward, and hold "
                "them; or seed a generator in the forward from torch's (torch.randint(2**31, ()).item()); or plan this "
                "block as keep or swap"
            )
        self.state.mark_versions()
        # A kept argument is held as itself or as a detached view (same version counter); a swapped
        # one is a copy, which nothing can modify.
        self.versions = [(held, held._version) if isinstance(held := self.leaves[k], torch.Tensor) else None
                         for k in self.tensor_slots]

    def pack_forward(self, tensor: torch.Tensor) -> _Holder:
        with self._uncounted(self.cache):
            if self.cache is not None:
                self.cache.note_saved(tensor)  # its op cannot be left out of the re-run
            return self._pack_forward(tensor)

    def _pack_forward(self, tensor: torch.Tensor) -> _Holder:
        holder = _Holder()
        self.holders.append(weakref.ref(holder))
        self.metas.append(_meta(tensor))
        owner = self.state.ptrs.get(tensor.untyped_storage().data_ptr()) if tensor.layout == torch.strided else None
        # A view of a parameter (``weight.t()``) dies with the forward, but shares its owner's version
        # counter; holding the owner costs nothing (a streamed parameter's device buffer is not held).
        self.saved.append(((lambda: owner) if owner is not None else weakref.ref(tensor), tensor._version))
        if self.check_values:
            # Model state (BatchNorm's running statistics) legitimately differs in the re-run: not compared.
            self.values.append(None if owner is not None else tensor.detach().to("cpu", copy=True))
        return holder

    def _check_saved_versions(self) -> None:
        for index, (reach, version) in enumerate(self.saved):
            tensor = reach()
            if tensor is not None and tensor._version != version:
                raise RecomputeError(
                    f"block {self.name}: tensor {index} {tuple(tensor.shape)} that its forward saved for backward was "
                    "modified in place after the forward (plain PyTorch raises \"one of the variables needed for "
                    "gradient computation has been modified by an inplace operation\" here); make that operation "
                    "out of place, or run it after the backward"
                )

    def _refresh_saved_versions(self) -> None:
        # What the re-run itself changed in place is the forward's doing again, not the caller's.
        self.saved = [(reach, version if (t := reach()) is None else t._version) for reach, version in self.saved]

    def unpack(self, holder: _Holder) -> torch.Tensor:
        """The recomputed tensor ``holder`` stands for, re-running the block if this backward has not yet.

        NOTE [a saved tensor read outside a backward]
        Reading a saved tensor through its node (``loss.grad_fn.next_functions[0][0]._saved_self``, a
        graph visualiser, a debugger) unpacks it outside any backward (graph task id -1). The block is
        re-run for it, from the forward's RNG, autocast and buffer state, and the generators are put
        back after, as for a backward, so nothing a later step or this step's backward computes
        changes. But each such read kept the re-run's other saved tensors in their holders, under a
        key no backward asks for, until the graph died: reading every saved tensor of a block held a
        copy of its activations per read, N reads N copies, where plain PyTorch holds none; and the
        tracker counted each copy as the block's recomputed bytes until its backward ended (a peak
        above the plan's). The read now takes its one tensor,
        drops the rest of its re-run and counts none of it (the caller holds what it took, as any
        tensor of its own): each read costs a re-run of the block, in time, and nothing after it."""
        gid = torch._C._current_graph_task_id()  # what torch's own checkpoint keys its re-runs by
        if gid != -1:
            return self._take(holder, gid)
        gid = next(_outside_backward)
        try:
            return self._take(holder, gid)
        finally:
            self._forget(gid)

    def _forget(self, gid: int) -> None:
        """Drop what the re-run for ``gid`` left in the holders (NOTE [a saved tensor read outside a backward])."""
        for ref in self.holders:
            if (holder := ref()) is not None:
                holder.tensors.pop(gid, None)
                holder.versions.pop(gid, None)
        self.counts.pop(gid, None)
        self.done.discard(gid)

    def _take(self, holder: _Holder, gid: int) -> torch.Tensor:
        if gid not in self.done:
            self.recompute(gid)
        if gid not in holder.tensors:
            raise RecomputeError(f"block {self.name}: a saved tensor was not recomputed (was it saved after the "
                                 "backward that unpacked it started?)")
        tensor = holder.tensors[gid]
        if tensor is None:
            raise RecomputeError(
                f"block {self.name}: a recomputed saved tensor is unpacked a second time in one backward; "
                "read ctx.saved_tensors once per backward call"
            )
        holder.tensors[gid] = None
        if tensor._version != holder.versions[gid]:
            raise RecomputeError(
                f"block {self.name}: a tensor {tuple(tensor.shape)} it saved for backward is modified in place later "
                "in its forward (plain PyTorch raises \"one of the variables needed for gradient computation has "
                "been modified by an inplace operation\" here); make that operation out of place"
            )
        return tensor

    # -- the re-run -----------------------------------------------------------------------------

    def _arguments(self) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
        """The re-run's arguments, and the leaves made for it (``_release_leaves``)."""
        leaves = list(self.leaves)
        made: list[torch.Tensor] = []
        for n, k in enumerate(self.tensor_slots):
            held = self.versions[n] if n < len(self.versions) else None
            if held is not None and held[0]._version != held[1]:
                raise RecomputeError(
                    f"block {self.name}: its argument {k} was modified in place after the block's forward, so "
                    "the block cannot be recomputed from it; plan this block as keep or swap, or make that "
                    "operation out of place"
                )
            modified = self.in_flight[n] if n < len(self.in_flight) else None
            if modified is not None and modified():
                raise RecomputeError(
                    f"block {self.name}: its argument {k} was modified in place after the block's forward while its "
                    "copy to the host was in flight (its plan swaps the block's input, swap_input), so the copy may "
                    "hold either value; make that operation out of place, run it after the next block's forward, "
                    "or plan this block without swap_input"
                )
            tensor = self.load_input(leaves[k])
            if self.requires_grad[n] and not tensor.requires_grad:
                # Ops save different tensors depending on which inputs require grad: match the first run.
                tensor = tensor.detach().requires_grad_()
                if not self.is_leaf[n]:
                    # Nor a leaf where the first run's was none: autocast caches its casts of leaves that
                    # require grad (as of weights), so a block that casts its input for two linears
                    # would cast it once, and a selective re-run would count other ops. A view is none.
                    # The block never sees the leaf under it, which the re-run's graph holds after the
                    # re-run (NOTE [a re-run's graph outlives it]); where the block's argument is the
                    # leaf itself (the caller's, one per step), it may keep it, and it stays.
                    made.append(tensor)
                    with torch.enable_grad():
                        tensor = tensor.view_as(tensor)
            leaves[k] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs, made

    def pack_recomputed(self, gid: int, account: Callable[[torch.Tensor], object], replay: Replay | None = None
                        ) -> tuple[Callable[[torch.Tensor], object], Callable[[], None]]:
        """The pack hook of the re-run for graph task ``gid``, and what drops its references once the
        re-run is over; the unpack hook is :func:`_unpack_rerun`.

        NOTE [a re-run's graph outlives it]
        A node of the re-run's graph can outlive the re-run: a tensor the block's forward keeps on a
        module (an attention map kept for display, a mixture of experts' ``self.aux_loss``, the weight
        ``torch.nn.utils.prune`` computes in a pre-hook) is the re-run's after the backward, and holds
        the re-run's graph until the next forward replaces it. That graph's nodes never run, so they
        kept what the re-run saved up to there (the block's input, its activations), and autograd keeps
        the pack hook with each of them, which held this frame (and the runtime's accounting hook, and
        the replay with its cache): the block's input, on the device again where it was swapped, and
        its cached outputs too. A step's worth of activations stayed alive into the next forward, where
        plain PyTorch, whose nodes of that graph ran in the backward, frees them. So the re-run's graph
        holds each saved tensor in a box, emptied when the re-run ends (ooc needs that graph only
        while it runs: a backward inside the block's forward; the backward uses the holders), and the
        hook reaches the frame through a list emptied then too. A backward through such a kept tensor
        afterwards raises, as plain PyTorch does for a graph its backward has freed."""
        live: list[Any] = [self, account, replay]
        boxes: list[_RerunSaved] = []
        name = self.name

        def pack(tensor: torch.Tensor) -> _RerunSaved:
            frame, account_, replay_ = live
            with frame._uncounted(replay_):
                box = _RerunSaved(name, frame._pack_recomputed(gid, account_, replay_, tensor))
            boxes.append(box)
            return box

        def close() -> None:
            live.clear()
            for box in boxes:
                box.tensor = None
            boxes.clear()

        return pack, close

    def _pack_recomputed(self, gid: int, account: Callable[[torch.Tensor], object], replay: Replay | None,
                         tensor: torch.Tensor) -> object:
        if replay is not None:
            replay.check_saved(tensor)  # not the uninitialised output of an op the re-run left out
        index = self.counts.get(gid, 0)
        self.counts[gid] = index + 1
        # Detached: a packed output that points back to its own node would be a reference cycle
        # autograd cannot break (the re-run's graph, and this frame with it, would never be freed).
        tensor = _detach(tensor, replay) if tensor.requires_grad else tensor
        if index >= len(self.holders):
            if not self.forward_done:
                # A backward inside the block's forward re-runs it while more is still to be saved.
                self.unchecked = True
                return tensor
            raise RecomputeError(
                f"block {self.name} saved more tensors when recomputed than in its forward "
                f"({len(self.holders)}): its forward is not deterministic (data-dependent control flow, "
                "or state changed between the runs); plan this block as keep or swap"
            )
        holder = self.holders[index]()
        if holder is not None:  # None: its node already ran (a backward inside the forward)
            ptr = tensor.untyped_storage().data_ptr()
            # A copy of a buffer (BatchNorm saves its running statistics) is model state, as the
            # buffer the forward saved was: neither is counted as an activation. A cached op's
            # output was counted when the forward cached it (NOTE [selective recompute]).
            if (self.state is None or ptr not in self.state.copy_ptrs) and (replay is None or ptr not in replay.ptrs):
                account(tensor)
            holder.tensors[gid] = tensor
            holder.versions[gid] = tensor._version
        if index + 1 == len(self.holders):
            raise _StopRecompute
        # The re-run's own graph may be backwarded (a backward inside the block's forward).
        return tensor

    def recompute(self, gid: int) -> None:
        """Re-run the block for graph task ``gid``, filling the holders. The tracker counts what the re-run
        saves, except for a read outside a backward (``gid`` from ``_outside_backward``: NOTE [a saved
        tensor read outside a backward])."""
        check_saved_tensors_hooks_enabled(f"the backward that re-runs recomputed block {self.name} ran")
        args, kwargs, made = self._arguments()
        self._check_saved_versions()
        self.state.check_unchanged(self.name)
        replay = None
        if self.cache is not None and self.cache.refused is not None:
            # NOTE [a forward the plan does not fit] in ooc.op_profile: the forward ran as plain
            # PyTorch, and so does its re-run, whole.
            warnings.warn(f"{self.cache.refused}{_EVAL_HINT * self._ran_in_eval_mode()}. {_FALLBACK}",
                          PlanMismatchWarning, stacklevel=2)
        elif self.cache is not None:
            if not self.cache.done:
                raise RecomputeError(
                    f"block {self.name} is re-run by a backward inside its own forward, before the outputs its plan "
                    "caches are all there; plan this block without cached_ops"
                )
            replay = Replay(self.cache, self.load_input)
            # A backward inside the forward's autocast (its nesting never back at 0) finds the
            # forward's casts of the weights still cached: the re-run would dispatch no _to_copy for
            # them and count other ops than the forward, which cast each weight anew (a step enters
            # autocast afresh). Start the re-run from an empty cache, as a step's forward does.
            torch.clear_autocast_cache()
        pack, close = self.pack_recomputed(gid, self.recompute_pack() if gid >= 0 else _uncounted, replay)
        # No numpy state taken for this re-run: its mark says whether the re-run moved the generator anyway.
        numpy_before = numpy_mark() if self.rng.numpy is None else None
        with nvtx.range(self.range_name), self.timer("recompute"):
            try:
                with (
                    # The first run already updated the buffers (BatchNorm statistics) for this step: the
                    # re-run updates a copy of their values from before it (NOTE [the re-run sees the forward's state]).
                    self.state.restored(),
                    self.rng.restored(),
                    self.autocast.restored(),
                    torch.enable_grad(),
                    _unbatched(),
                    saved_tensors_hooks(pack, _unpack_rerun),
                    contextlib.nullcontext() if replay is None else replay,  # innermost: counts the block's ops alone
                ):
                    try:
                        self.forward(*args, **kwargs)
                    except _StopRecompute:
                        pass
            finally:
                # NOTE [a re-run's graph outlives it]; outside the replay, whose mode would count the
                # empty storages as ops of the block.
                close()
                _release_leaves(made)
        self._refresh_saved_versions()
        self.state.mark_versions()
        self.done.add(gid)
        self._check_numpy_kept(numpy_before)
        self._check(gid)

    def _check_numpy_kept(self, before: tuple[int, ...] | None) -> None:
        """After a re-run that took no numpy state: refuse one that moved numpy's global generator (NOTE
        [numpy's state where it is drawn] in ooc.rng), which cannot be put back."""
        if before is None or numpy_mark() == before:
            return
        note_numpy_draws(self.module, True)
        raise RecomputeError(
            f"block {self.name} moved numpy's global generator in its re-run but not in its forward (it reseeds it "
            "to the state its forward found, as a second block that calls np.random.seed does; or another thread "
            "drew from it meanwhile), so numpy's generator is not where plain PyTorch leaves it after this backward "
            "(NOTE [numpy's state where it is drawn] in ooc.rng). It keeps numpy's state from now on: zero the "
            "gradients (this backward stopped part way) and run this step again. To avoid this, draw from a generator the block holds (np.random.default_rng(seed) as an "
            "attribute), or plan this block as keep or swap"
        )

    def note_numpy_draws(self, read: bool) -> None:
        """After the forward: record whether a block seen for the first time drew from numpy's global
        generator (or ``read``: read or set its state, NOTE [a forward that puts numpy's state back] in
        ooc.rng), and refuse a block that starts drawing from it now (NOTE [numpy's state where it is
        drawn] in ooc.rng: its re-run would draw other numbers)."""
        if self.numpy_known is None:
            if self.rng.numpy is not None:  # else numpy.random was not imported yet: the next forward looks
                note_numpy_draws(self.module, read or self.rng.numpy_changed())
        elif self.numpy_known is False and numpy_mark() != self.numpy_before:
            note_numpy_draws(self.module, True)
            raise RecomputeError(
                f"block {self.name} drew from numpy's global generator in this forward but not in its first (or another "
                "thread drew from it during the forward), so its recompute did not keep numpy's state and its re-run "
                "would draw other numbers (NOTE [numpy's state where it is drawn] in ooc.rng). It keeps it from now on: "
                "run this step again. To avoid this, draw from torch's generator or a generator the block (or the "
                "other thread) holds, or plan this block as keep or swap"
            )

    def _ran_in_eval_mode(self) -> bool:
        """Some module of the block was in eval mode in its forward (as ``BlockState`` saw it)."""
        return self.state is not None and not all(training for _, training in self.state.training)

    def _check(self, gid: int) -> None:
        if self.unchecked:
            return
        count = self.counts.get(gid, 0)
        if count != len(self.holders):
            raise RecomputeError(
                f"block {self.name} saved {count} tensors when recomputed but {len(self.holders)} in its "
                "forward: its forward is not deterministic (data-dependent control flow, or state changed "
                "between the runs); plan this block as keep or swap"
            )
        for index, ref in enumerate(self.holders):
            holder = ref()
            if holder is None or holder.tensors.get(gid) is None:
                continue
            tensor = holder.tensors[gid]
            if _meta(tensor) != self.metas[index]:
                raise RecomputeError(
                    f"block {self.name}: saved tensor {index} was {self.metas[index]} in the forward but "
                    f"{_meta(tensor)} when recomputed; the forward is not deterministic, plan this block as "
                    "keep or swap"
                )
            value = self.values[index] if self.check_values else None
            if value is not None and not torch.equal(_bits(tensor.cpu()), _bits(value)):
                raise RecomputeError(
                    f"block {self.name}: saved tensor {index} {tuple(tensor.shape)} has other values when "
                    "recomputed than in the forward (check_recompute=True); the forward is not deterministic "
                    "(a generator ooc does not replay, see NOTE [generators a re-run replays] in ooc.rng; "
                    "nondeterministic kernels; state changed between the runs); "
                    "plan this block as keep or swap"
                )


def run_recomputed(
    forward: Callable[..., Any],
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    name: str,
    device: torch.device,
    save_input: Callable[[torch.Tensor], object],
    load_input: Callable[[object], torch.Tensor],
    recompute_pack: Callable[[], Callable[[torch.Tensor], object]],
    range_name: str,
    timer: Callable[[str], contextlib.AbstractContextManager],
    check_recompute: bool = False,
    cached_ops: tuple[int, ...] = (),
    keep_cached: Callable[[torch.Tensor], object] | None = None,
    swapped_ops: tuple[int, ...] = (),
    swap_cached: Callable[[torch.Tensor], object] | None = None,
    op_signature: str | None = None,
    observe: Callable[[torch.Tensor, str], None] | None = None,
) -> Any:
    """Run ``forward(*args, **kwargs)`` (``module``'s forward) keeping only its tensor arguments for backward.

    The arguments go through ``save_input`` and come back through ``load_input`` (the block's pack
    hook and ooc's unpack); each tensor the re-run saves goes through a hook from ``recompute_pack()``
    (called once per re-run). ``timer(what)`` times the phases "forward" and "recompute";
    ``range_name`` names the re-run's NVTX range; ``name`` (the block's) is in every error.
    ``check_recompute``: also compare the re-run's saved values with the forward's, bit for bit
    (keeps a host copy of every saved tensor of the block until its backward).
    ``cached_ops``: selective recompute (NOTE [selective recompute] in ``ooc.op_profile``): the
    outputs of these ops of the forward (counted in dispatch order) go through ``keep_cached`` and the
    re-run returns them instead of running the ops (their storages come back through ``load_input``).
    ``swapped_ops`` (among ``cached_ops``): these outputs go through ``swap_cached`` instead (the
    swap engine: NOTE [swapped cached ops] in ``ooc.scheduler.schedule``); an output the block returns
    cannot be swapped (it is the next block's input) and raises :class:`RecomputeError`, unless this
    forward ran other ops than the profiled one whose ``op_signature`` the plan carries (then the
    re-run runs whole: NOTE [a forward the plan does not fit] in ``ooc.op_profile``).
    ``observe(tensor, role)``: called in the forward with each tensor argument (role "input") and
    each tensor the forward saves (role "saved"), while it lives (the first step's storage sharing:
    ``ooc.storage_sharing.SharingMeter``).
    Returns what ``forward`` returns, with the same structure and autograd graph as without ooc.
    """
    leaves, spec = tree_flatten((args, kwargs))
    if (cache := cache_argument([*args, *kwargs.values(), *leaves])) is not None:
        raise RecomputeError(
            f"block {name} was passed a key/value cache ({cache}: the model was called with use_cache=True); a "
            "recomputed layer would append its keys and values to it a second time (NOTE [caches and recompute] in "
            "ooc.hf). Call the model with use_cache=False for training (ooc already turned the config's default "
            "off), or plan this block as keep or swap"
        )
    if swapped_ops and not set(swapped_ops) <= set(cached_ops):  # before the input is held (and swapped)
        raise ValueError(f"run_recomputed: swapped_ops {sorted(set(swapped_ops) - set(cached_ops))[:8]} are not among "
                         "cached_ops")
    if cached_ops and (keep_cached is None or (swapped_ops and swap_cached is None)):
        raise ValueError("run_recomputed: cached_ops needs keep_cached, and swapped_ops needs swap_cached")
    frame = RecomputeFrame(forward, module, name, device, recompute_pack, range_name, timer, check_recompute)
    frame.hold_inputs(leaves, spec, save_input, load_input)
    before = [leaves[k]._version for k in frame.tensor_slots]
    if cached_ops:
        frame.cache = ForwardCache(name, tuple(cached_ops), keep_cached, RecomputeError,
                                   swapped=tuple(swapped_ops), swap=swap_cached, eval_mode=frame._ran_in_eval_mode(),
                                   signature=op_signature)
    pack_forward = frame.pack_forward
    if observe is not None:
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                observe(leaf, "input")

        def pack_forward(tensor: torch.Tensor) -> _Holder:
            observe(tensor, "saved")
            return frame.pack_forward(tensor)

    with (
        saved_tensors_hooks(pack_forward, frame.unpack),
        timer("forward"),
        EntropyWatch(module) as entropy,  # its first forward only (NOTE [generators seeded from the OS] in ooc.rng)
        # The forward whose numpy draws are recorded (NOTE [a forward that puts numpy's state back] in ooc.rng).
        NumpyReadWatch(frame.numpy_known is None) as numpy_reads,
        contextlib.nullcontext() if frame.cache is None else frame.cache,  # innermost: counts the block's ops alone
    ):
        out = forward(*args, **kwargs)
    if entropy.found is not None:
        raise RecomputeError(
            f"block {name} seeds a generator from the OS in its forward ({entropy.found}), so its re-run would draw "
            "other numbers than its forward and its gradients would be wrong (NOTE [generators seeded from the OS] in "
            "ooc.rng). Seed it from a number, or from a generator ooc replays (torch.randint(2**31, ()).item()), "
            "or make it once and hold it on the module; or plan this block as keep or swap"
        )
    frame.note_numpy_draws(numpy_reads.read)
    if frame.cache is not None:
        frame.cache.finish(out)
    frame.forward_done = True
    frame.note_versions(leaves, before)
    return out
