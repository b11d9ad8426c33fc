"""``ooc.wrap``: run a model's blocks under a plan, through forward wrappers and autograd hooks.

NOTE [one step, as the runtime sees it]
- Block ``i``'s forward runs under the block's pack hook (keep, swap), or under recompute's hooks
  (NOTE [recompute through saved-tensor hooks] in ``ooc.recompute``).
  Swapped storages start their copy out at once; at the end of the forward the schedule's releases
  run (the previous block's swapped storages, after their copies).
- A grad hook on the block's outputs marks the start of the block's backward: the schedule's
  releases-before-backward and copies-back for that point are issued there.
- An engine callback closes the step at the end of the backward.
Every forward that runs the first block with grad enabled opens a new ``_Pass``; hooks hold their
pass, so two graphs alive at once (gradient accumulation over two forwards) do not mix. Only the
graph holds a pass (the runtime keeps a weak reference): a graph dropped without its backward (a
forward that raised, a validation forward without ``no_grad``) takes its pass with it, and the pass
frees its kept bytes (NOTE [kept tensors are detached] in ``ooc.saved`` keeps that graph collectable).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.autograd import forward_ad
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks
from torch.utils._pytree import tree_leaves

from ooc import nvtx
from ooc.backend import Backend
from ooc.blocks import Chain, check_first_forward, shared_parameter_ids
from ooc.errors import BlockError, SavedTensorModifiedError, WrapError, check_saved_tensors_hooks_enabled
from ooc.hf import caches_off_in_forwards, check_block_not_checkpointed, check_no_hf_checkpointing, layerdrop
from ooc.plain_copy import PlainDeepCopy
from ooc.pool import HostPool
from ooc.recompute import run_recomputed
from ooc.rng import Opaque
from ooc.saved import CompressedStorage, DeviceLedger, SwapContext, SwappedStorage, SwappedView, make_pack_hook, unpack
from ooc.scheduler.codecs import CODECS, unsupported
from ooc.scheduler.plan import Codec, Plan, PlanError, Policy
from ooc.scheduler.schedule import Schedule, build_schedule
from ooc.scheduler.units import format_bytes
from ooc.streaming import ParamStreamer, StreamedView
from ooc.timm_models import check_not_checkpointed as check_timm_not_checkpointed
from ooc.timm_models import flag_holders as timm_flag_holders
from ooc.tracker import MemoryReport, MemoryTracker

_RUNTIMES: "weakref.WeakKeyDictionary[nn.Module, Runtime]" = weakref.WeakKeyDictionary()


class Recorder(Protocol):
    """What the runtime reports of the steps it runs while one is attached (``Runtime.record``).

    The profiler's ``StepRecorder`` is one: it turns the reports into a profile. While one is
    attached, a storage that several blocks hold is counted by each of them (a profile's bytes are per
    block; NOTE [storages shared between blocks] in ``ooc.scheduler.sharing``).
    """

    marks_backward: bool
    """Whether the runtime should call ``mark(block, "backward_end")`` from a grad hook on each
    block's inputs (it always calls ``mark(block, "backward_start")`` when a block's backward starts)."""
    log: list
    """The tracker appends every allocation and free here: (what, block, bytes, dtype or None)."""

    def __call__(self, block: int, what: str) -> contextlib.AbstractContextManager:
        """Wraps one phase (``forward``, ``recompute``) of one block."""

    def mark(self, block: int, what: str) -> None:
        """A point in a block's backward: ``backward_start`` or ``backward_end``."""

    def finish(self) -> Any:
        """What a deferred plan is chosen from (``Runtime.begin_deferred``), at the end of the step."""

    def discard(self) -> None:
        """Forget every report so far: they were of a forward whose graph was dropped without a
        backward (NOTE [a forward dropped before the measured step])."""

    def observer(self, block: int) -> Callable[[torch.Tensor, str], None] | None:
        """Called with each tensor argument ("input") and saved tensor ("saved") of a recomputed
        block's forward (``run_recomputed``'s ``observe``), or None."""


class _NoRecorder:
    """The runtime's recorder hooks, doing nothing while no recorder is attached."""

    marks_backward = False

    @contextlib.contextmanager
    def __call__(self, block: int, what: str) -> Iterator[None]:
        yield

    def mark(self, block: int, what: str) -> None:
        pass

    def observer(self, block: int) -> None:
        """What a recomputed block's forward reports its tensors to (none)."""
        return None

    def discard(self) -> None:
        pass


def _state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``model``'s modules, read from their own dicts, once per pass.
    ``model.parameters()`` and ``buffers()`` walk ``named_modules``, which names every module and
    keeps a set of those seen: ``state_storage_ptrs`` took 860 us per pass on GPT-2 small here
    through them, 70 us through this walk. A tensor tied to two modules (or a module held twice)
    comes twice; the storage set does not mind."""
    tensors: list[torch.Tensor | None] = []
    stack: list[nn.Module | None] = [model]
    while stack:
        module = stack.pop()
        if module is not None:  # a submodule, parameter or buffer may be registered as None
            tensors.extend(module._parameters.values())
            tensors.extend(module._buffers.values())
            stack.extend(module._modules.values())
    return [t for t in tensors if t is not None]


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _free_all_kept(tracker: MemoryTracker, kept: list[int]) -> None:
    for block, nbytes in enumerate(kept):
        if nbytes:
            tracker.free(block, nbytes)
            kept[block] = 0


class _Pass:
    """One forward and its backward through the chain."""

    def __init__(self, runtime: "Runtime") -> None:
        self.rt = runtime
        n = len(runtime.chain)
        self.swapped: list[list[weakref.ref[SwappedStorage]]] = [[] for _ in range(n)]
        self.frame_swapped: list[list[SwappedStorage]] = [[] for _ in range(n)]
        """A recomputed block's swapped records (its input, its swapped cached outputs), held until
        the block's backward is over. NOTE [a frame that saves nothing]: their owner is the block's
        recompute frame, which the graph holds through the unpack hooks of what the block saved; a
        block that saves nothing (an identity, ``x * 2``) leaves no hook, so the frame and the records
        died with its forward and their bytes were freed before the RELEASE the schedule plans for
        them. Held here too, they live as the schedule says: released, copied back, freed when the
        block's backward ends, as a kept block's bytes are (``free_kept``)."""
        self.kept = [0] * n
        self.nonfinite = runtime.swap_ctx.start_forward()
        """NaN/Inf groups met while this pass's forward compressed (NOTE [non-finite counts per forward])."""
        self.last_forward = -1
        self.backward_started = False
        self.backward_id = -1
        """The graph task of the backward whose end callback is queued (``on_backward_start``)."""
        self.started: set[int] = set()
        """The blocks whose backward started in backward ``backward_id`` (NOTE [a backward that enters a
        block elsewhere])."""
        self.differentiable: set[int] = set()
        """The blocks whose forward in this pass returned an output with a ``grad_fn``: those a backward
        from the loss reaches (NOTE [a measured step's backward reaches every block])."""
        self.running = -1
        """The block whose forward is running, else -1: a backward inside it starts nothing."""
        self.bwd_range: nvtx.Range | None = None
        self.skip_ptrs = runtime.state_storage_ptrs()
        # While a recorder measures a profile, each block counts all it holds: a profile's bytes are
        # per block, and the schedule applies the sharing rule itself (NOTE [storages shared between
        # blocks] in ooc.scheduler.sharing).
        self.device_ledger = DeviceLedger() if isinstance(runtime.timer, _NoRecorder) else None
        """Kept storages of this pass's forward, each counted by its first keeper."""
        self.saved_versions: dict[int, tuple[int, weakref.ref, int]] = {}
        """id(packed) -> (block, the tensor whose version counter it shares, its version at pack);
        NOTE [saved tensors modified in place]."""
        self.compressed_saves: list[tuple[SwappedStorage, torch.Tensor, int]] = []
        """The compressed records the running block's forward made, each beside an alias of its source
        and the source's version at the save, until ``seal_compressed`` (NOTE [saved tensors modified in place])."""
        # A graph dropped without a backward frees its saved tensors with it. A finalizer, not
        # ``__del__``: it exists only once the pass is whole (torch.compile builds and drops objects
        # whose ``__init__`` never ran, and their ``__del__`` printed "Exception ignored" tracebacks).
        weakref.finalize(self, _free_all_kept, runtime.tracker, self.kept)
        self.timing_hooks: list[torch.utils.hooks.RemovableHandle] = []
        """Hooks that mark a block's backward end for a recorder. Those on parameters would outlive
        the pass (and fire in every later backward, an ``autograd.grad`` included, where torch
        refuses a multi-grad hook on a leaf): removed when the backward ends or the graph dies."""
        weakref.finalize(self, _remove_all, self.timing_hooks)

    def pack_hook(self, block: int, *, swap: bool, what: str, swap_all: bool = False) -> Callable[[torch.Tensor], object]:
        """The block's pack hook; ``swap_all``: swap every storage, uncompressed, whatever its size
        (swapped cached outputs: NOTE [swapped cached ops] in ``ooc.scheduler.schedule``)."""
        rt = self.rt
        swapped, held = self.swapped[block], self.frame_swapped[block]
        recomputed = rt.plan.blocks[block].policy is Policy.RECOMPUTE

        def on_swapped(storage: SwappedStorage) -> None:
            swapped.append(weakref.ref(storage))
            if recomputed:
                held.append(storage)  # NOTE [a frame that saves nothing]

        return make_pack_hook(
            codec=rt.plan.blocks[block].codec if swap and not swap_all else Codec.NONE,
            swap_all=swap_all,
            block=block,
            swap=swap,
            what=what,
            device=rt.backend.device,
            skip_ptrs=self.skip_ptrs,
            min_swap_bytes=rt.plan.min_swap_bytes,
            ctx=rt.swap_ctx,
            on_kept=self.keep,
            on_swapped=on_swapped,
            param_view=rt.streamer.view_of if rt.plan.blocks[block].streamed else None,
            # The forward's keeps share one ledger; a re-run counts what it re-saves on its own.
            shared=self.device_ledger if what == "save" else None,
        )

    def versioned(self, block: int, pack: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], object]:
        """``pack`` that also records each saved tensor's version (NOTE [saved tensors modified in place]).

        NOTE [saved tensors modified in place]
        Autograd raises "modified by an inplace operation" when a saved tensor's version changed
        between its save and its use, but not for tensors saved through saved-tensor hooks, which
        every plan uses: an optimizer step between forward and backward (a GAN's classic mistake)
        would then give gradients of the new weights, silently. So the pack hook records the
        version of what it packs (for a kept tensor, the detached alias autograd holds, which shares
        the version counter; for a swapped one, the caller's tensor, while it lives, and until the
        copy out is ordered before compute, whether it lives or not: a change before then raced the
        copy, and the caller's tensor may die before the backward, leaving only the host copy; for a
        view of a streamed parameter, the parameter, whose version counter the view shared) and
        ``unpack`` compares it, as autograd would, when the backward uses the tensor. Recomputed blocks make
        the same check themselves (NOTE [the re-run sees the forward's state] in ooc.recompute).
        A compressed record holds codes taken at the save, not its source: the source's version is
        compared when the block's forward ends (``seal_compressed``), while the pack hook still holds the
        source; a change after that through a tensor that dies before the backward goes unseen.
        NOTE [saved again after an in-place change]
        A kept tensor without a ``grad_fn`` is packed as itself (NOTE [kept tensors are detached] in
        ooc.saved), so the table keyed by what the pack returns had one entry for two saves of it, and
        a save after an in-place change (a mask made without grad, used, scaled in place, used again;
        a tensor the caller changes between two blocks that save it) overwrote the first save's version:
        the first save's backward read the changed values without a word, where plain PyTorch raises.
        Such a save gets an alias of its own (``detach()``: the same storage and version counter).
        A swapped (or compressed) tensor that is a view is watched through its base, which shares its
        version counter: the view often dies with the forward (``h[:, :32]`` saved by the next op)
        while its base lives on (a probe or hook that keeps ``h``), and a change to the base went
        unseen where plain PyTorch raises. A living alias holds the base, so a change through one is
        seen; only the weak reference is held, so the base's storage is freed as before when it dies.
        """
        versions = self.saved_versions

        def pack_versioned(tensor: torch.Tensor) -> object:
            packed = pack(tensor)
            if packed is tensor and (entry := versions.get(id(packed))) is not None and entry[2] != packed._version:
                packed = tensor.detach()  # NOTE [saved again after an in-place change]
            if isinstance(packed, StreamedView):
                # The view itself dies with the forward's device copy; the backward's is rebuilt
                # from the parameter's bytes as they are then.
                watched = packed.parameter
            elif isinstance(packed, torch.Tensor):
                watched = packed
            else:
                # A swapped view's base, which shares its version counter and outlives it: a view that
                # died with the forward left its base to be changed, unseen (NOTE [saved tensors
                # modified in place]).
                watched = tensor if tensor._base is None else tensor._base
            # A compressed record read its bytes when it encoded them, at the save: no copy races.
            # Detached (the same version counter), or node -> record -> tensor -> grad_fn -> node
            # would be a cycle that keeps a dropped graph alive (NOTE [kept tensors are detached]).
            # Weakly: the record frees its copied-back bytes when autograd drops its last view.
            raced = None
            if isinstance(packed, SwappedView):
                if isinstance(packed.storage, CompressedStorage):
                    self.compressed_saves.append((packed.storage, tensor.detach(), tensor._version))
                else:
                    packed.storage.watch(tensor.detach())
                raced = weakref.ref(packed.storage)
            versions[id(packed)] = (block, weakref.ref(watched), watched._version, tuple(watched.shape), raced)
            return packed

        return pack_versioned

    def seal_compressed(self) -> None:
        """The running block's forward is over: a compressed record whose source was changed in place
        since its save is marked modified (its backward raises), and the sources' aliases go."""
        for record, alias, version in self.compressed_saves:
            if alias._version != version:
                record.modified = True
        self.compressed_saves.clear()

    def enter(self, block: int) -> None:
        """A backward reads a saved tensor of ``block``: start the block's backward if its outputs' hook
        did not (NOTE [a backward that enters a block elsewhere])."""
        if block != self.running and torch._C._current_graph_task_id() != -1:
            self.on_backward_start(block)

    def loader(self, block: int) -> Callable[[object], torch.Tensor]:
        """``unpack`` for what a recomputed ``block`` holds (its arguments, its cached outputs), which
        its re-run reads first: the block's backward has started then (``enter``)."""

        def load(packed: object) -> torch.Tensor:
            self.enter(block)
            return unpack(packed)

        return load

    def unpack(self, packed: object) -> torch.Tensor:
        entry = self.saved_versions.get(id(packed))
        if entry is not None:
            block, ref, version, shape, raced = entry
            self.enter(block)
            watched = ref()
            changed = watched is not None and watched._version != version
            if changed or (raced is not None and (record := raced()) is not None and record.modified_in_flight()):
                raise self._modified(block, shape, f"version {version} -> {watched._version}" if changed
                                     else "in its forward, after it was compressed" if isinstance(record, CompressedStorage)
                                     else "while its copy to the host was in flight")
        return unpack(packed)

    def _modified(self, block: int, shape: tuple[int, ...], how: str) -> SavedTensorModifiedError:
        return SavedTensorModifiedError(
            f"a tensor that block {self.rt.chain.names[block]!r} saved for its backward (shape {shape}) was modified "
            f"in place after the forward ({how}); plain PyTorch raises here "
            "too (\"modified by an inplace operation\"). Run the backward before changing it (e.g. before "
            "optimizer.step()), or change a clone"
        )

    def keep_hooks(self, block: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """The pack and unpack hooks of a KEEP block whose weights are not streamed, outside a profile.

        NOTE [the kept path]
        A block's hooks run once per tensor it saves (about 25 per GPT-2 block). Through the general
        pair (``make_pack_hook`` under ``versioned``, and ``unpack``) a kept tensor cost 25 us of host
        time on an H200's host: 7.5 ms per GPT-2 small step (batch 4 x 512), which made an all-KEEP
        step 10% slower than plain PyTorch there, against 2% for hooks that do nothing. A kept tensor
        needs less than the general pair does for a swapped one: this pack returns the detached alias
        (NOTE [kept tensors are detached] in ooc.saved), counts its storage as ``make_pack_hook`` does
        for a kept one (once per block, not on another device, not a state storage, not one an
        earlier block of the pass counts), and records its version under the alias's id; the unpack
        is handed that alias itself, so it compares the version without the weak reference and the
        entry the general pair keeps for a tensor it may no longer hold (NOTE [saved tensors modified
        in place]). Outside a profile only: a recorder's log wants what the general pack reports.
        """
        device, skip_ptrs, shared = self.rt.backend.device, self.skip_ptrs, self.device_ledger
        kept, tracker = self.kept, self.rt.tracker
        seen: set[int] = set()
        versions: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            alias = tensor if tensor.grad_fn is None else tensor.detach()
            if versions.get(id(alias), alias._version) != alias._version:
                alias = tensor.detach()  # NOTE [saved again after an in-place change]
            versions[id(alias)] = alias._version
            if tensor.device == device:
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in skip_ptrs and ptr not in seen:
                    seen.add(ptr)
                    nbytes = storage.nbytes()
                    if nbytes and not shared.counted_before(ptr, block):
                        kept[block] += nbytes
                        tracker.alloc(block, nbytes, "save", tensor.dtype)
                        shared.count(ptr, block, alias)
            return alias

        def unpack_kept(alias: torch.Tensor) -> torch.Tensor:
            self.enter(block)  # NOTE [a backward that enters a block elsewhere]
            version = versions.get(id(alias))
            if version is not None and alias._version != version:
                raise self._modified(block, tuple(alias.shape), f"version {version} -> {alias._version}")
            return alias

        return pack, unpack_kept

    def keep(self, block: int, nbytes: int, what: str, dtype: torch.dtype) -> None:
        self.kept[block] += nbytes
        self.rt.tracker.alloc(block, nbytes, what, dtype)

    def free_kept(self, blocks: range) -> None:
        """The kept storages of ``blocks`` are gone: their backward is over (or their graph is)."""
        for block in blocks:
            self.frame_swapped[block].clear()  # NOTE [a frame that saves nothing]
            if self.kept[block]:
                self.rt.tracker.free(block, self.kept[block])
                self.kept[block] = 0

    def _live(self, block: int) -> list[SwappedStorage]:
        return [s for s in (ref() for ref in self.swapped[block]) if s is not None]

    def release(self, block: int) -> None:
        for storage in self._live(block):
            storage.release()

    def prefetch(self, block: int) -> None:
        storages = self._live(block)
        if storages:
            with nvtx.range(f"ooc/swap_in/{self.rt.chain.names[block]}"):
                for storage in storages:
                    storage.prefetch()

    def on_backward_start(self, block: int) -> None:
        """Block ``block``'s backward starts: called by the hook on its outputs, or by the first read of
        one of its saved tensors in a backward (``enter``), whichever comes first.

        NOTE [a backward that enters a block elsewhere]
        A backward usually reaches a block through the outputs it returned, whose grad hook runs
        before any node of the block. Not always: a loss the block left on the side (a mixture of
        experts' load-balancing loss kept as ``self.aux_loss``, backwarded alone or before the main
        path arrives) or outputs ooc cannot see (a dataclass, an object holding the tensors) reach the
        block's nodes with no hook run. Then nothing streamed its weights in (the backward raised on
        a weight still on the host), prefetched or decoded its swapped tensors, or queued the end of
        the backward. So the first read of a saved tensor of the block in a backward starts it too;
        once per block and backward, whichever comes first."""
        backward = torch._C._current_graph_task_id()  # what torch's own checkpoint tells backwards apart by
        if backward == self.backward_id and block in self.started:
            return
        schedule = self.rt.schedule
        # Every node of the blocks after this one has run: autograd has dropped their tensors.
        self.free_kept(range(block + 1, len(self.kept)))
        streamer = self.rt.streamer
        if block + 1 < len(self.kept):
            streamer.release_after_backward(block + 1)
        for j in schedule.stream_ins_before_backward[block]:
            streamer.issue(j)
        streamer.attach(block)
        if backward != self.backward_id:
            # Runs once this whole backward is done, whichever block it ends in. Once per backward,
            # not per pass: a second backward through a retained graph (or a second loss sharing it)
            # brings streamed weights back and re-saves recomputed tensors, which its end returns.
            self.backward_id = backward
            self.started = set()
            torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)
        self.started.add(block)
        if not self.backward_started:
            self.backward_started = True
            # Every compressed storage of the forward has been encoded: one read of their NaN/Inf
            # counts per step (the check the quantize kernel would otherwise sync for per storage).
            self.nonfinite.check()
            for j in schedule.releases_before_backward:
                self.release(j)
        if self.bwd_range is not None:
            self.bwd_range.end()
        self.rt.timer.mark(block, "backward_start")
        self.bwd_range = nvtx.start(f"ooc/bwd/{self.rt.chain.names[block]}")
        for j in schedule.swap_ins_before_backward[block]:
            self.prefetch(j)
        compressed = [s for s in self._live(block) if isinstance(s, CompressedStorage)]
        # Largest codes last: the transient (one storage's codes beside its output) is then the
        # largest codes on top of everything decoded, as the schedule's DECODE op counts it.
        for storage in sorted(compressed, key=lambda s: s.nbytes):
            storage.decode()  # NOTE [compressed swap] in ooc.saved

    def on_backward_end(self) -> None:
        _remove_all(self.timing_hooks)
        self.free_kept(range(len(self.kept)))
        self.rt.streamer.release_all()
        if self.bwd_range is not None:
            self.bwd_range.end()
            self.bwd_range = None
        self.rt.steps += 1
        if self.rt.deferred is not None:
            # This step ran the measuring plan, not one chosen for the budget.
            if unreached := sorted(self.differentiable - self.started):
                self.rt.measure_again(unreached)
            elif not self.rt.measured_in_part:  # a backward of this pass before left blocks out
                self.rt.finish_deferred()
        else:
            self.rt.check_budget()


def _refuse_copy(_self: object, _protocol: int = 2) -> Any:
    """``__reduce_ex__`` of what ``wrap`` puts on a model: copying or pickling it would copy the
    runtime (threads, locks, the host pool), or leave the copy calling into this one."""
    raise WrapError(
        "a model wrapped by ooc (or a block of it) cannot be pickled or deep-copied alone (torch.save(model), "
        "copy.deepcopy(block)): its blocks run through this model's runtime. Copy the weights instead "
        "(model.state_dict() into a new model, or torch.save(model.state_dict())), take copy.deepcopy(model) of the "
        "whole wrapped model (a plain, unwrapped copy of it), or call ooc.unwrap(model) first and wrap again afterwards"
    )


def _refuse_functorch_transform() -> None:
    """Raise :class:`WrapError` inside a ``torch.func`` transform (vmap, grad, jacrev, jvp, vjp, ...).

    Its tensors are wrappers without storage (vmap's batched tensors, jvp's dual ones), which the pack
    hooks cannot count or copy, and torch.func refuses saved-tensor hooks under grad/vjp/jacrev: each
    failed with an error of its own that named neither ooc nor the way out.
    """
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise WrapError(
            "a torch.func transform (vmap, grad, jacrev, jvp, vjp, ...) runs over this wrapped model: ooc's "
            "saved-tensor hooks and copies need real tensors, and torch.func does not take saved-tensor hooks. "
            "Call ooc.unwrap(model) before the torch.func transform (wrap again afterwards), or use "
            "torch.autograd.grad"
        )


class _AttachWeights:
    """A block's first forward pre-hook: its streamed weights go to the device before the caller's
    pre-hooks run, so a hook that changes them in place changes the device copy, which the release
    keeps, not a host copy that a copy in may still read (NOTE [weights changed around a stream-in]
    in ooc.streaming)."""

    __reduce_ex__ = _refuse_copy

    def __init__(self, runtime: "Runtime", index: int) -> None:
        self.rt = runtime
        self.index = index

    def __call__(self, _module: nn.Module, _args: Any) -> None:
        self.rt.streamer.attach(self.index)


class _ReleaseWeights:
    """The wrapped model's last forward hook, called also when its forward raises: every streamed
    block's weights go back to the host (NOTE [a forward that raises] in ooc.streaming). The streamer
    is looked up at each call: a plan chosen after the first step may stream."""

    __reduce_ex__ = _refuse_copy

    def __init__(self, runtime: "Runtime") -> None:
        self.rt = runtime

    def __call__(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self.rt.streamer.release_all()


def _refuse_dual_tensors(name: str, args: tuple, kwargs: dict) -> None:
    """Raise :class:`WrapError` if a block's argument is a forward-mode AD dual tensor while grad is on:
    autograd would save dual tensors, whose storage ooc's pack hooks cannot read (they raised torch's
    "Attempted to access the data pointer on an invalid python storage")."""
    if any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
           for t in tree_leaves((args, kwargs))):
        raise WrapError(
            f"block {name!r} got a forward-mode AD dual tensor (torch.autograd.forward_ad) with grad enabled: ooc's "
            "saved-tensor hooks cannot hold the dual tensors autograd would save. Run the forward-mode pass under "
            "torch.no_grad() (it saves nothing and needs no backward), use double backward for a Hessian-vector "
            "product, or call ooc.unwrap(model) first"
        )


class _BlockForward(Opaque):
    """Stands in for ``block.forward`` while the model is wrapped (``Opaque``: the search for a block's
    generators does not look into the runtime it holds)."""

    __reduce_ex__ = _refuse_copy

    def __init__(self, runtime: "Runtime", index: int, original: Callable[..., Any]) -> None:
        self.rt = runtime
        self.index = index
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rt, i = self.rt, self.index
        check_block_not_checkpointed(rt.model, rt.chain.modules[i], rt.chain.names[i])
        if rt.timm_flags and (rt.chain.modules[i].training or torch.is_grad_enabled()):
            # Turned on after wrap. timm checkpoints in eval mode too (a fine-tune with frozen batch norm).
            check_timm_not_checkpointed(rt.model, rt.timm_flags)
        if rt.first_calls is not None:
            rt.first_calls.append((i, torch.is_grad_enabled()))  # NOTE [blocks run without grad]
        if torch.is_grad_enabled() and forward_ad._current_level >= 0:
            _refuse_dual_tensors(rt.chain.names[i], args, kwargs)
        if not torch.is_grad_enabled():
            rt.streamer.attach(i)
            try:
                return self.original(*args, **kwargs)  # nothing is saved without autograd
            finally:
                rt.streamer.release(i)
        _refuse_functorch_transform()
        check_saved_tensors_hooks_enabled(f"block {rt.chain.names[i]!r} of a wrapped model ran with grad enabled")
        step = rt.pass_for(i)
        decision = rt.plan.blocks[i]
        fwd = nvtx.start(f"ooc/fwd/{rt.chain.names[i]}")
        for j in rt.schedule.stream_ins_before_forward[i]:
            rt.streamer.issue(j)
        rt.streamer.attach(i)
        step.running = i
        try:
            if decision.policy is Policy.RECOMPUTE:
                out = run_recomputed(
                    self.original,
                    rt.chain.modules[i],
                    args,
                    kwargs,
                    name=rt.chain.names[i],
                    device=rt.backend.device,
                    save_input=step.pack_hook(i, swap=decision.swap_input, what="save"),
                    load_input=step.loader(i),
                    recompute_pack=lambda: step.pack_hook(i, swap=False, what="recompute"),
                    range_name=f"ooc/recompute/{rt.chain.names[i]}",
                    timer=lambda what: rt.timer(i, what),
                    check_recompute=rt.check_recompute,
                    cached_ops=decision.cached_ops,
                    # Cached op outputs are kept and counted as "cache" until the block's backward ends
                    # (NOTE [selective recompute] in ooc.op_profile), ...
                    keep_cached=step.pack_hook(i, swap=False, what="cache") if decision.cached_ops else None,
                    # ... except those of swapped_ops: the swap engine copies them out now, the schedule's
                    # RELEASE and SWAP_IN of this block move them with its other swapped bytes, and they
                    # are registered with this pass like them (NOTE [swapped cached ops] in ooc.scheduler.schedule).
                    swapped_ops=decision.swapped_ops,
                    op_signature=decision.op_signature,
                    swap_cached=step.pack_hook(i, swap=True, what="cache", swap_all=True) if decision.swapped_ops else None,
                    observe=rt.timer.observer(i),  # the first step of wrap(budget=...): its shared storages
                )
            else:
                if decision.policy is Policy.KEEP and not decision.streamed and step.device_ledger is not None:
                    pack, unpack_saved = step.keep_hooks(i)  # NOTE [the kept path]
                else:
                    pack, unpack_saved = step.versioned(i, step.pack_hook(i, swap=decision.policy is Policy.SWAP, what="save")), step.unpack
                try:
                    with saved_tensors_hooks(pack, unpack_saved), rt.timer(i, "forward"):
                        out = self.original(*args, **kwargs)
                finally:
                    step.seal_compressed()
            for j in rt.schedule.releases_after_forward[i]:
                step.release(j)
        finally:
            step.running = -1
            rt.streamer.release(i)
            fwd.end()
        if rt.timer.marks_backward:
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                step.timing_hooks.append(register_multi_grad_hook(inputs, lambda _grad: rt.timer.mark(i, "backward_end"), mode="any"))
            elif params := [p for p in rt.chain.modules[i].parameters() if p.requires_grad]:
                # No input needs a gradient (raw data): the block's backward ends with its parameters'.
                step.timing_hooks.append(register_multi_grad_hook(params, lambda _grads: rt.timer.mark(i, "backward_end"), mode="all"))
        # Outputs the block computed (with a grad_fn): a leaf it returns (its parameter, or an argument
        # passed through) has no node of the block behind it, and a hook on it outlives the graph:
        # one was added per forward and each fired in every later backward, keeping its pass alive.
        if isinstance(out, torch.Tensor):
            outputs = [out] if out.grad_fn is not None else []
        else:
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if outputs:
            step.differentiable.add(i)
        if len(outputs) == 1:
            outputs[0].register_hook(lambda _grad: step.on_backward_start(i))  # half the cost of a multi-hook
        elif outputs:
            register_multi_grad_hook(outputs, lambda _grad: step.on_backward_start(i), mode="any")
        return out


class BudgetExceededWarning(UserWarning):
    """A step's device-resident saved activations (with ``include_params``, plus parameters) went over
    the budget its plan was chosen for (NOTE [a plan is for the batch it measured])."""


class Runtime:
    """Everything ``wrap`` installs on one model."""

    __reduce_ex__ = _refuse_copy  # its bound methods are the model's first-forward hooks

    def __init__(self, model: nn.Module, chain: Chain, plan: Plan, backend: Backend, *, owns_backend: bool = False) -> None:
        self.model = model
        self.owns_backend = owns_backend
        """Made by ``wrap`` from a name: its copy threads stop at ``unwrap``."""
        self.chain = chain
        self.plan = plan
        self.backend = backend
        self.schedule: Schedule = build_schedule(plan)
        self.tracker = MemoryTracker(len(chain), backend.device)
        self.pool = HostPool(backend)
        self.swap_ctx = SwapContext(backend, self.pool, self.tracker, list(chain.names))
        self.streamer = self._make_streamer(plan)
        self.check_recompute = False
        """Compare each recomputed block's re-saved values with its forward's (``run_recomputed``)."""
        self.timer: Recorder | _NoRecorder = _NoRecorder()
        """The attached recorder (``record``), whose hooks the blocks call."""
        self.steps = 0
        self.budget: tuple[int, bool] | None = None
        """``(bytes, include_params)`` of the budget the plan was chosen for by ``wrap``, else None;
        checked after each backward (``check_budget``) until one step goes over it."""
        self.deferred: Callable[[], Plan] | None = None
        self.measured_in_part = False
        """The deferred plan's measured step ended with a backward that left blocks out: the next step
        measures again (NOTE [a measured step's backward reaches every block])."""
        self.said_measured_in_part = False
        self._current: weakref.ref[_Pass] | None = None
        """The pass of the latest forward, held by its graph alone (NOTE [one step, as the runtime sees it])."""
        self._state_key: tuple[int, ...] = ()
        self._state_ptrs: frozenset[int] = frozenset()
        self._installed: list[tuple[nn.Module, Any]] = []
        self.timm_flags = timm_flag_holders(model)
        """The modules with a boolean ``grad_checkpointing`` flag, timm's and others' (NOTE [timm's gradient
        checkpointing] in ooc.timm_models)."""
        self.on_uninstall: list[Callable[[], None]] = []
        """Undo what was changed on the model at install (HF caches: NOTE [caches and recompute] in ooc.hf)."""
        self.first_calls: list[tuple[int, bool]] | None = None
        """The blocks run during the model's first training forward, each with whether grad was enabled
        in its call, checked when it ends (NOTE [blocks run without grad])."""
        self._first_forward_hooks: list[Any] = []
        self._attach_hooks: list[Any] = []
        """Forward pre-hooks that bring a block's streamed weights in before the caller's pre-hooks."""

    def _make_streamer(self, plan: Plan) -> ParamStreamer:
        if any(b.streamed for b in plan.blocks):
            settle_weights(self.model)  # NOTE [weights move at rest]
        streamer = ParamStreamer(self.chain, plan, self.backend, self.tracker, shared_parameter_ids(self.model, self.chain))
        streamed = streamer.streamed_param_ids
        self.tracker.set_resident_params(sum(
            p.numel() * p.element_size() for p in self.model.parameters() if id(p) not in streamed))
        return streamer

    def state_storage_ptrs(self) -> frozenset[int]:
        """Storages of parameters and buffers: model state, never counted or swapped.

        Cached while every state tensor keeps its address (``model.to(...)`` or a new parameter
        changes one and refreshes the set).
        """
        tensors = _state_tensors(self.model)
        try:
            key = tuple(t.data_ptr() for t in tensors)
        except RuntimeError as exc:  # a tensor without storage: torch.func's wrappers, a fake or meta tensor
            raise WrapError(
                "a parameter or buffer of this wrapped model has no storage (torch.func.grad/vmap/functional_call "
                "with transformed tensors, or a fake/meta tensor): ooc's saved-tensor hooks and copies need real "
                "tensors. Call ooc.unwrap(model) before a torch.func transform, or use torch.autograd.grad"
            ) from exc
        if key != self._state_key:
            self._state_key = key
            self._state_ptrs = frozenset(t.untyped_storage().data_ptr() for t in tensors)
        return self._state_ptrs

    def pass_for(self, block: int) -> _Pass:
        current = None if self._current is None else self._current()
        if current is None and self._current is not None and self.deferred is not None:
            # NOTE [a forward dropped before the measured step]
            # The first training step of wrap(budget=...) without a sample is measured for the plan.
            # A forward before it whose graph died without a backward (a validation loss without
            # no_grad, in train or eval mode) is no part of that step: its records went into the
            # profile beside the step's (each block's input bytes doubled, its times mixed with an
            # eval forward's). A forward while an earlier graph is alive (two forwards, one backward)
            # is part of the step, and stays.
            self.timer.discard()
        if current is None or block <= current.last_forward:
            if self.measured_in_part and self.deferred is not None:
                self.timer.discard()  # NOTE [a measured step's backward reaches every block]
            self.measured_in_part = False
            current = _Pass(self)
            self._current = weakref.ref(current)
            self.tracker.start_step()
        current.last_forward = block
        return current

    def install(self) -> None:
        for i, module in enumerate(self.chain.modules):
            previous = module.__dict__.get("forward")
            module.forward = _BlockForward(self, i, module.forward)
            self._installed.append((module, previous))
            self._attach_hooks.append(module.register_forward_pre_hook(_AttachWeights(self, i), prepend=True))
        self._first_forward_hooks = [
            self.model.register_forward_pre_hook(self._start_first_forward),
            self.model.register_forward_hook(self._end_first_forward),
        ]
        self._attach_hooks.append(self.model.register_forward_hook(_ReleaseWeights(self), always_call=True))
        # NOTE [a deep copy of a wrapped model] in ooc.plain_copy: copy.deepcopy(model) gives the user's module.
        self.model.__dict__["__deepcopy__"] = PlainDeepCopy(self.model, lambda: list(self._installed),
                                                            lambda: settle_weights(self.model))

    def _start_first_forward(self, _module: nn.Module, _args: Any) -> None:
        self.first_calls = [] if torch.is_grad_enabled() else None

    def _end_first_forward(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        """NOTE [blocks run without grad]
        A training forward may run some blocks under ``torch.no_grad()`` (a frozen bottom of the chain:
        ``with torch.no_grad(): h = self.layers[:k](h)``). Such a call saves nothing and runs as plain
        PyTorch, so any plan fits it: the chain check counts it where the block ran. (It counted only
        calls with grad, said the frozen blocks "never ran", and unwrapped a model plain PyTorch
        trains.) A block that also ran with grad (a target computed by the same layers without grad,
        then the training pass) is checked by its calls with grad alone, as before."""
        first, self.first_calls = self.first_calls, None
        if first is None:
            return
        with_grad = {i for i, grad in first if grad}
        calls = [i for i, grad in first if grad or i not in with_grad]
        for handle in self._first_forward_hooks:
            handle.remove()
        self._first_forward_hooks = []
        try:
            # A deferred plan is chosen from this step's measurements: every block must run in it.
            check_first_forward(self.chain, calls, layerdrop=layerdrop(self.model), skips=self.deferred is None)
        except BlockError as exc:
            # The chain does not describe this model's forward: leave the model as it was.
            unwrap(self.model)
            raise BlockError(f"{exc} ooc unwrapped the model.") from None

    def uninstall(self) -> None:
        for handle in (*self._first_forward_hooks, *self._attach_hooks):
            handle.remove()
        self._first_forward_hooks, self._attach_hooks = [], []
        for module, previous in self._installed:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._installed.clear()
        self.model.__dict__.pop("__deepcopy__", None)
        self._current = None
        self.backend.synchronize()
        self._restore_streamer()
        for undo in self.on_uninstall:
            undo()
        self.on_uninstall.clear()
        if self.owns_backend:
            self.backend.close()

    def record(self, recorder: Recorder | None) -> None:
        """Report the steps that follow to ``recorder`` (phase times, marks and the tracker's log);
        ``None`` detaches it."""
        self.timer = _NoRecorder() if recorder is None else recorder
        self.tracker.log = None if recorder is None else recorder.log

    def begin_deferred(self, recorder: Recorder, choose: Callable[[Any], Plan]) -> None:
        """Report the next step (run under the current plan) to ``recorder`` and, when its backward
        ends, switch to ``choose(recorder.finish())``: ``wrap(model, budget=...)`` without a sample."""
        self.deferred = lambda: choose(recorder.finish())
        self.record(recorder)

    def measure_again(self, unreached: list[int]) -> None:
        """NOTE [a measured step's backward reaches every block]
        ``wrap(model, budget=...)`` without a sample plans from the first training step, every block
        recomputed, and a recomputed block's saved bytes are measured by its re-run, in the backward. A
        backward that leaves blocks out (``backward(inputs=...)`` or ``torch.autograd.grad`` with respect
        to a later block's parameters: autograd runs no node of the blocks before) re-runs none of them,
        and the plan was chosen from a profile where they saved nothing: it kept them all, and the next
        step went over the budget (by 2.7x on the nano GPT). So such a backward chooses no plan: the
        blocks stay recomputed, and the next step is measured afresh (its forward discards these
        records), until a step's backward reaches every block whose forward returned an output with a
        ``grad_fn``. A second backward through the same graph (``retain_graph=True``) that reaches every
        block chooses none either: its blocks' re-runs would be counted beside the first's (a plan for
        twice their bytes, or a ``BudgetError``). Said once per wrap."""
        self.measured_in_part = True
        if self.said_measured_in_part:
            return
        self.said_measured_in_part = True
        names = ", ".join(self.chain.names[i] for i in unreached)
        warnings.warn(
            f"the step ooc measures to choose a plan for the budget ended with a backward that did not reach block(s) "
            f"{names} (backward(inputs=...) or torch.autograd.grad with respect to a subset of the parameters), so it "
            "measured no saved bytes for them: every block stays recomputed, and the next step whose backward reaches "
            "every block is measured instead. To plan now, pass wrap(..., sample=<a batch>) (NOTE [a measured step's "
            "backward reaches every block] in ooc.runtime). Said once per wrap.",
            UserWarning, stacklevel=2,
        )

    def finish_deferred(self) -> None:
        choose, self.deferred = self.deferred, None
        try:
            plan = choose()
        except Exception:
            # Nothing fits: leave the model as it was before wrap (its gradients of this step stay).
            unwrap(self.model)
            raise
        finally:
            self.record(None)
        self.plan = plan
        self.schedule = build_schedule(plan)
        if any(b.streamed for b in plan.blocks):
            self._restore_streamer()
            self.streamer = self._make_streamer(plan)

    def check_budget(self) -> None:
        """NOTE [a plan is for the batch it measured]
        A plan chosen for a budget fits the saved activations of the batch its profile measured (the
        sample, or the first training step): their bytes grow with the batch and the sequence length,
        and nothing re-plans. A larger batch or a longer sequence went over the budget without a word
        (4x the batch, 4x the bytes: an out-of-memory error on the device, or none on the CPU). So does a
        training forward under ``torch.autocast`` planned from a sample profiled without it: each block
        saves its weights' low-precision copies too (a ResNet-18 at batch 2 under CPU bf16 autocast: 18.5
        MiB against a plan for 500 KiB), and a model profiled in eval mode (Hugging Face's from_pretrained
        returns it so) that trains in train mode: dropout saves its masks (``ooc.plan`` and ``wrap`` warn
        of eval mode before they profile). So a step whose tracked peak exceeds the budget warns, once per
        wrap, saying how to plan for the largest batch."""
        if self.budget is None:
            return
        budget, include_params = self.budget
        report = self.tracker.report(0, None)
        peak = report.peak_bytes + (report.param_peak_bytes if include_params else 0)
        if peak <= budget:
            return
        self.budget = None
        what = "parameters and saved activations" if include_params else "saved activations"
        warnings.warn(
            f"this step's {what} on the device peaked at {format_bytes(peak)}, over the budget of "
            f"{format_bytes(budget)} the plan was chosen for: a plan fits the batch it was profiled on, and this "
            "forward saves more (a larger batch, a longer sequence, train mode where the profile ran in eval mode, or "
            "torch.autocast that the profile ran without: its low-precision copies of the weights are saved too). Plan "
            "for the largest batch: ooc.unwrap(model), then ooc.wrap(model, budget=..., sample=<the largest batch>), in "
            "train mode and under the training forward's autocast (NOTE [a plan is for the batch it measured] in "
            "ooc.runtime). Said once per wrap.",
            BudgetExceededWarning, stacklevel=2,
        )

    def _restore_streamer(self) -> None:
        """Streamed weights back to the device for good (NOTE [weights move at rest])."""
        if self.streamer.blocks:
            settle_weights(self.model)
        self.streamer.restore()

    def report(self) -> MemoryReport:
        return self.tracker.report(self.pool.allocated_bytes, self.backend.max_memory_allocated())


def check_not_wrapped(model: nn.Module, *, why: str = "to change its plan") -> None:
    """Raise :class:`WrapError` if ``model``, a module inside it or a model around it is wrapped;
    ``why`` ends the advice to unwrap first."""
    if model in _RUNTIMES:
        raise WrapError(f"this model is already wrapped by ooc; call ooc.unwrap(model) first {why}")
    inside = set(model.modules())
    for wrapped in list(_RUNTIMES.keys()):
        if wrapped in inside:
            raise WrapError(f"a module inside this model ({type(wrapped).__name__}) is already wrapped by ooc; "
                            "call ooc.unwrap on it first, or wrap only one of the two")
        if any(m is model for m in wrapped.modules()):
            raise WrapError(f"this module is inside a model ({type(wrapped).__name__}) already wrapped by ooc; "
                            "call ooc.unwrap on that model first, or wrap only one of the two")


def check_trainable(model: nn.Module) -> None:
    """Raise :class:`WrapError` unless ``model`` is an unwrapped module with something to train."""
    if not isinstance(model, nn.Module):
        raise WrapError(f"ooc.wrap takes an nn.Module, got {type(model).__name__}")
    check_not_wrapped(model)
    check_no_hf_checkpointing(model)
    check_timm_not_checkpointed(model, timm_flag_holders(model))
    if not any(p.requires_grad for p in model.parameters()):
        raise WrapError(
            "the model has no parameters that require grad, so there is no backward to plan for; "
            "ooc is for training (use torch.no_grad() for inference)"
        )
    # A lazy module's parameters take their shapes in its first forward: ooc sizes and places every
    # parameter at wrap (torch's "Attempted to use an uninitialized parameter" came from its bookkeeping).
    lazy = [name for name, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise WrapError(
            f"parameter {lazy[0]} of the model is not initialized yet (a lazy module: nn.LazyLinear, nn.LazyConv2d, "
            f"...; {len(lazy)} such parameters), and ooc sizes and places every parameter when it wraps. Run one "
            "forward on a batch first (model(batch) under torch.no_grad()), then ooc.wrap(model, ...)"
        )


def check_codecs(plan: Plan, cuda_capability: tuple[int, int] | None) -> None:
    """Raise :class:`PlanError` if a block's codec does not run on a GPU of this compute capability
    (``None``: not a CUDA device, where every codec runs)."""
    for spec in unsupported((b.codec for b in plan.blocks), cuda_capability):
        major, minor = spec.min_cuda_capability
        others = [c.value for c, s in CODECS.items() if s.supported(cuda_capability)]
        raise PlanError(
            f"codec {spec.codec.value} needs a GPU of compute capability {major}.{minor} or newer, this one is "
            f"{cuda_capability[0]}.{cuda_capability[1]}; use another codec ({', '.join(others)}) or none"
        )


def install(model: nn.Module, chain: Chain, plan: Plan, backend: Backend, *, owns_backend: bool = False,
            check_recompute: bool = False) -> Runtime:
    if len(plan) != len(chain):
        raise PlanError(
            f"the plan has {len(plan)} blocks but the model has {len(chain)} ({chain.names[0]} ... "
            f"{chain.names[-1]}); make a plan for this model, e.g. Plan.uniform('keep', {len(chain)})"
        )
    check_codecs(plan, torch.cuda.get_device_capability(backend.device) if backend.device.type == "cuda" else None)
    runtime = Runtime(model, chain, plan, backend, owns_backend=owns_backend)
    runtime.check_recompute = check_recompute
    runtime.on_uninstall.append(caches_off_in_forwards(model, chain.modules))
    runtime.install()
    _RUNTIMES[model] = runtime
    return runtime


_WEIGHT_WRITERS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakMethod] = weakref.WeakKeyDictionary()
"""Per model, ``settle`` of the host optimizer that writes its parameters (``register_weight_writer``)."""


def register_weight_writer(model: nn.Module, settle: Callable[[], None]) -> None:
    """``settle``, a bound method of a host optimizer that writes ``model``'s parameters from its
    own threads, returns once none of its writes is in flight. Held weakly: a collected optimizer
    writes nothing.

    NOTE [weights move at rest]
    A streaming plan installed by ``ooc.wrap`` copies each streamed parameter to a host buffer and
    points the parameter at it; ``ooc.unwrap`` copies it back to a new device buffer. A host
    optimizer's updates of the last ``step()`` may still be on their way into the old storage then
    (``step()`` returns without waiting for them): the copy took the weights from before them, or
    they landed in a storage the model no longer reads, and training went on from neither (the
    optimizer refuses the next forward, and a user who then rebuilds it from its ``state_dict`` as
    told carried the loss on). So both first wait for the writes in flight."""
    _WEIGHT_WRITERS[model] = weakref.WeakMethod(settle)


def settle_weights(model: nn.Module) -> None:
    """Wait until no registered writer's update of ``model``'s parameters is in flight."""
    ref = _WEIGHT_WRITERS.get(model)
    settle = ref() if ref is not None else None
    if settle is not None:
        settle()


def runtime_of(model: nn.Module) -> Runtime:
    try:
        return _RUNTIMES[model]
    except (KeyError, TypeError):
        raise WrapError("this model is not wrapped by ooc; call ooc.wrap(model, ...) first") from None


def unwrap(model: nn.Module) -> nn.Module:
    """Remove everything :func:`ooc.wrap` installed; the model runs as plain PyTorch again."""
    runtime = runtime_of(model)
    runtime.uninstall()
    del _RUNTIMES[model]
    return model


def memory_report(model: nn.Module) -> MemoryReport:
    """Device-resident saved-activation bytes of a wrapped model: last step's peak, per block, moved bytes."""
    return runtime_of(model).report()


def is_wrapped(model: nn.Module) -> bool:
    return model in _RUNTIMES


def weight_streamer(model: nn.Module) -> ParamStreamer | None:
    """The streamer of a wrapped model whose plan streams weights (NOTE [streamed parameters] in
    ooc.streaming), else ``None``: a host optimizer updates its host copies and waits in its
    ``before_stream_in`` callbacks."""
    runtime = _RUNTIMES.get(model)
    return runtime.streamer if runtime is not None and runtime.streamer.blocks else None
