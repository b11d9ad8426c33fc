"""What happens to one saved tensor: kept on the device (and counted) or swapped to the host.

NOTE [accounting by storage]
Autograd often saves several views of one storage (``x`` and ``x.t()``), and several ops save the
same tensor. Both the tracker and the swap work per *storage*: a block's saved tensors are grouped by
the storage they view, each storage is counted (and copied) once, and every view is rebuilt on the
restored storage with its own offset, size and strides, so layouts, and with them the numerics of
backward, are exactly those of plain PyTorch. Parameters (and views of them) are never counted or
copied. The profile measures blocks with these same rules, so predictions and measurements agree.

Swapped storages are counted by their handles: the tracker sees the copy-out release, the copy-back
allocation and autograd dropping the last view. Kept storages are counted when saved and released
when the block's backward is over (the runtime's ``_Pass.free_kept``), which is when autograd has
dropped them: a chain's backward runs every node of block ``b`` before block ``b-1`` starts
(``tests/ooc/test_memory.py::test_kept_tensors_are_dead_when_released`` checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ooc import nvtx
from ooc.errors import OocError
from ooc.scheduler.codecs import SWAP_GROUP_SIZE, codec_spec
from ooc.scheduler.plan import Codec
from ooc.storage_ref import StorageRef

if TYPE_CHECKING:
    from ooc.backend.base import Backend, Event
    from ooc.pool import HostPool
    from ooc.tracker import MemoryTracker


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a 1-D ``uint8`` tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class NonFiniteActivationError(OocError, ValueError):
    """A saved activation to be compressed held NaN or Inf."""


class NonFiniteCounts:
    """Per block, the NaN/Inf groups the quantize kernels met while one forward compressed its saved
    tensors, counted on the device (``flag``) and read once, by that forward's backward (``check``).

    NOTE [non-finite counts per forward]
    The counts belong to one forward (one ``_Pass``), not to the runtime: several forwards may run
    before one backward (micro-batches summed into one loss), and a forward's graph may be dropped
    without a backward. Zeroing shared counts when a forward starts forgot the NaN of a forward whose
    backward was still to come; keeping them let a dropped forward's NaN fail the next step. Each
    backward reads its own forward's counts, and a dropped forward's die with it.
    """

    __slots__ = ("names", "_counts", "_pending")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._counts: torch.Tensor | None = None
        self._pending = False
        """Whether anything was compressed since the last ``check``."""

    def flag(self, block: int, device: torch.device) -> torch.Tensor:
        """The 1-element device counter that compressing a storage of ``block`` adds its NaN/Inf
        groups to (read once per step by ``check``, not once per storage)."""
        if self._counts is None or self._counts.device != device:
            self._counts = torch.zeros(len(self.names), dtype=torch.int64, device=device)
        self._pending = True
        return self._counts[block:block + 1]

    def check(self) -> None:
        """Raise :class:`NonFiniteActivationError` naming the blocks whose compressed activations
        held NaN or Inf since the last check, and start counting afresh. One host sync, and only
        if anything was compressed."""
        if not self._pending:
            return
        self._pending = False
        # Host sync (once per step): the counts are added on the compute stream, which this read follows.
        counts = self._counts.tolist()
        if not any(counts):
            return
        self._counts.zero_()
        bad = ", ".join(f"{self.names[b]} ({n} group(s))" for b, n in enumerate(counts) if n)
        raise NonFiniteActivationError(
            f"quantize: saved activations of block(s) {bad} hold NaN or Inf; a compressed activation must be finite. "
            "An overflow (fp16) puts them there: check the loss scale. A tensor may also hold -inf by design: an "
            "additive attention mask, which Hugging Face's sdpa attention saves for a batch with padding (use "
            "attn_implementation='eager', which saves none). Else keep these blocks' tensors uncompressed (codec "
            "'none'), or let a planner offered codecs choose: the profile measures each block's codec error, unbounded for "
            "such a block, and the planner gives it none")


class SwapContext:
    """What a swapped storage needs to move itself: backend, host pool, tracker, range names, and
    the current forward's counts of non-finite groups met while compressing (``nonfinite``)."""

    __slots__ = ("backend", "pool", "tracker", "names", "nonfinite")

    def __init__(self, backend: Backend, pool: HostPool, tracker: MemoryTracker, names: list[str]) -> None:
        self.backend = backend
        self.pool = pool
        self.tracker = tracker
        self.names = names
        self.nonfinite = NonFiniteCounts(names)
        """The counts the storages compressed from now on add to (NOTE [non-finite counts per forward])."""

    def start_forward(self) -> NonFiniteCounts:
        """Fresh counts for a forward that starts now; its backward checks them."""
        self.nonfinite = NonFiniteCounts(self.names)
        return self.nonfinite

    def nonfinite_flag(self, block: int, device: torch.device) -> torch.Tensor:
        """``NonFiniteCounts.flag`` of the current forward."""
        return self.nonfinite.flag(block, device)


class SwappedStorage:
    """One storage copied to a host buffer during the forward and back before the backward.

    Life cycle, in the order of the schedule's ops: created (``encode``, then the copy out issued
    after a compute event) -> ``release`` (compute waits for the copy, the device bytes are dropped)
    -> ``prefetch`` (a device buffer is allocated, the copy back is issued) -> ``materialize``
    (compute waits for it) -> garbage (autograd is done with every view; the host buffer goes back
    to the pool). The bytes moved are the storage itself; :class:`CompressedStorage` moves its codes
    instead and adds only their encoding and decoding.
    """

    __slots__ = ("ctx", "block", "nbytes", "counted", "device", "host", "d2h_done", "copied_back", "h2d_done", "watched",
                 "modified", "__weakref__")

    def __init__(self, ctx: SwapContext, block: int, tensor: torch.Tensor, what: str, *, counted: bool = True) -> None:
        self.ctx = ctx
        self.block = block
        self.nbytes = 0
        self.counted = counted
        """Whether the bytes on the device until ``release`` are this record's to count: not when an
        earlier block keeps the same storage (NOTE [storages shared between blocks] in
        ``ooc.scheduler.sharing``); the copy back always is."""
        self.device: torch.Tensor | None = None
        """The bytes moved, on the device until ``release``."""
        self.copied_back: torch.Tensor | None = None
        """Their copy back, from ``prefetch`` on."""
        self.h2d_done: Event | None = None
        self.host: torch.Tensor | None = None
        self.d2h_done: Event | None = None  # stays None if the copy could not be issued (backend closed)
        self.watched: list[tuple[torch.Tensor, int]] = []
        """Tensors in these bytes that must not change while the copy out may read them (``watch``)."""
        self.modified = False
        """One of them was modified in place before ``release`` (``modified_in_flight``)."""
        with nvtx.range(f"ooc/swap_out/{ctx.names[block]}"):
            device_bytes = self.encode(tensor)
            self.nbytes = device_bytes.numel()
            if counted:
                ctx.tracker.alloc(block, self.nbytes, what)
            self.device = device_bytes
            self.host = ctx.pool.acquire(self.nbytes)
            # The copy may start only once compute has produced the bytes it reads (codes too: the
            # quantize kernel runs on the compute stream, CompressedStorage.encode).
            produced = ctx.backend.record_compute()
            self.d2h_done = ctx.backend.copy_d2h(self.host, device_bytes, (produced,))
        ctx.tracker.swapped_out += self.nbytes

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """The device bytes to move, as a 1-D ``uint8`` tensor: here the whole storage (no copy)."""
        return storage_bytes(tensor)

    def watch(self, tensor: torch.Tensor) -> None:
        """Note whether ``tensor`` (in these bytes; a tensor sharing its version counter with the
        caller's) is modified in place before ``release``: an in-place op issued until then is not
        ordered with the copy out, which may read the bytes before or after it (NOTE [swapped cached
        ops] in ``ooc.scheduler.schedule``). Watched: the swapped cached outputs (``ForwardCache``) and
        the swapped saved tensors (NOTE [saved tensors modified in place] in ``ooc.runtime``), whose
        callers' tensors may die before the change is looked for."""
        if self.device is not None:
            self.watched.append((tensor, tensor._version))

    def modified_in_flight(self) -> bool:
        """Whether a watched tensor was modified in place while the copy out was not yet ordered before
        compute (so the host copy may hold either value)."""
        return self.modified or any(t._version != v for t, v in self.watched)

    def release(self) -> None:
        if self.device is None:
            return
        # Compute must not run ahead of the copy out: this bounds the device bytes in flight. Any
        # in-place op issued from here on runs after the copy; the ones before may have raced it.
        self.ctx.backend.wait_compute(self.d2h_done)
        self.modified = self.modified_in_flight()
        self.watched = []  # (they held the device bytes)
        self.device = None
        if self.counted:
            self.ctx.tracker.free(self.block, self.nbytes, "release")

    def prefetch(self) -> None:
        if self.copied_back is not None:
            return
        self.release()
        ctx = self.ctx
        self.copied_back = ctx.backend.device_buffer(self.nbytes)
        ctx.tracker.alloc(self.block, self.nbytes, "swap_in")
        # The copy back waits for the copy out (the host buffer must be full) and for compute to
        # reach the point where the destination was allocated.
        allocated = ctx.backend.record_compute()
        self.h2d_done = ctx.backend.copy_h2d(self.copied_back, self.host, (self.d2h_done, allocated))
        ctx.tracker.swapped_in += self.nbytes

    def arrived(self) -> torch.Tensor:
        """The copied-back bytes, once compute may read them."""
        self.prefetch()
        # Compute reads the copied-back bytes next: it waits for the copy back.
        self.ctx.backend.wait_compute(self.h2d_done)
        return self.copied_back

    def materialize(self) -> torch.Tensor:
        return self.arrived()

    def __del__(self) -> None:
        if not hasattr(self, "ctx"):
            return  # never initialised (torch.compile can build an object without running __init__)
        if (self.device is not None and self.counted) or self.copied_back is not None:
            self.ctx.tracker.free(self.block, self.nbytes)
        # The host buffer may be reused once its last reader (the copy back, else the copy out) ends.
        if self.host is not None:
            self.ctx.pool.release(self.host, self.h2d_done if self.h2d_done is not None else self.d2h_done)


class CompressedStorage(SwappedStorage):
    """A swapped storage kept as codes and scales from its pack until its block's backward.

    NOTE [compressed swap]
    At pack time the whole storage (viewed as its dtype) is quantized per group of SWAP_GROUP_SIZE
    values (``encode``); only the codes and scales are held (one device buffer, scales first) and
    copied to the host. ``release`` drops them after the copy; ``prefetch`` brings them back;
    ``decode`` (run for every such storage when its block's backward starts, so the bytes held are
    a function of the schedule alone) dequantizes into a new storage of the original dtype and drops
    the codes. What compresses, and into how many bytes, is the codec's entry in
    ``ooc.scheduler.codecs.CODECS``, which the profile and the schedule read too.
    """

    __slots__ = ("codec", "dtype", "elements", "full_nbytes", "restored", "_layout")

    def __init__(self, ctx: SwapContext, block: int, tensor: torch.Tensor, what: str, codec: Codec) -> None:
        self.codec, self.dtype = codec, tensor.dtype
        self.full_nbytes = tensor.untyped_storage().nbytes()
        self.elements = self.full_nbytes // tensor.element_size()
        self.restored: torch.Tensor | None = None
        """The decoded storage, from ``decode`` on."""
        super().__init__(ctx, block, tensor, what)

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        from ooc.kernels.quant import quantize

        spec = codec_spec(self.codec)
        flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(tensor.untyped_storage(), 0, (self.elements,), (1,))
        # On the compute stream, where the input was produced and where the buffer is allocated: the
        # kernel writes scales and codes straight into the one buffer the copy out then reads, and
        # the copy waits for a compute event recorded after it. NaN/Inf groups are counted into the
        # block's device flag, read once per step (SwapContext.check_finite), not synced here.
        codes = self.ctx.backend.device_buffer(spec.encoded_nbytes(self.elements))
        q = quantize(flat, codec=spec.kernel, group_size=SWAP_GROUP_SIZE, check_finite=False,
                     nonfinite_flag=self.ctx.nonfinite_flag(self.block, tensor.device), out=codes)
        self._layout = (q.scales.numel() * 4, q.codes.dtype, tuple(q.codes.shape), tuple(q.scales.shape))
        return codes

    def watch(self, tensor: torch.Tensor) -> None:
        """Nothing to watch: the copy out reads the codes, taken from the source at the save (a change to
        the source within the forward is ``seal_compressed``'s, NOTE [saved tensors modified in place]
        in ``ooc.runtime``)."""

    def prefetch(self) -> None:
        if self.restored is not None:
            return  # decoded already: the codes are gone
        super().prefetch()

    def decode(self) -> None:
        if self.restored is not None:
            return
        from ooc.kernels.quant import dequantize
        from ooc.kernels.quant_reference import Quantized

        codes = self.arrived()
        scale_bytes, codes_dtype, codes_shape, scales_shape = self._layout
        q = Quantized(
            codes=codes[scale_bytes:].view(codes_dtype).view(codes_shape),
            scales=codes[:scale_bytes].view(torch.float32).view(scales_shape),
            shape=torch.Size((self.elements,)), dtype=self.dtype, codec=codec_spec(self.codec).kernel, group_size=SWAP_GROUP_SIZE,
        )
        restored = dequantize(q)
        self.ctx.tracker.alloc(self.block, self.full_nbytes, "decode")
        self.restored = storage_bytes(restored)
        self.copied_back = None
        self.ctx.tracker.free(self.block, self.nbytes, "decode")

    def materialize(self) -> torch.Tensor:
        self.decode()
        return self.restored

    def __del__(self) -> None:
        if getattr(self, "restored", None) is not None:
            self.ctx.tracker.free(self.block, self.full_nbytes)
        super().__del__()


class SwappedView:
    __slots__ = ("storage", "dtype", "offset", "size", "stride")

    def __init__(self, storage: SwappedStorage, tensor: torch.Tensor) -> None:
        self.storage = storage
        self.dtype = tensor.dtype
        self.offset = tensor.storage_offset()
        self.size = tensor.size()
        self.stride = tensor.stride()

    def watch(self, tensor: torch.Tensor) -> Callable[[], bool]:
        """``SwappedStorage.watch``: returns whether ``tensor`` was modified in place while its copy out was in flight."""
        self.storage.watch(tensor)
        return self.storage.modified_in_flight

    def unpack(self) -> torch.Tensor:
        data = self.storage.materialize()
        return torch.empty(0, dtype=self.dtype, device=data.device).set_(
            data.untyped_storage(), self.offset, self.size, self.stride
        )


def unpack(packed: object) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    return packed.unpack()  # type: ignore[attr-defined]


class DeviceLedger:
    """The storages that blocks of one pass keep on the device, each counted by the first block that
    keeps it (NOTE [storages shared between blocks] in ``ooc.scheduler.sharing``).

    An entry is trusted only while its storage is alive: a storage address is never taken for another
    storage's while its first one lives. The storage, not the tensor the keeping block holds: a
    recomputed block that saves nothing (an identity, a view) drops its held input at once, while the
    storage lives on in an earlier block and is counted by the first keeper until its backward.
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, StorageRef]] = {}

    def counted_before(self, ptr: int, block: int) -> bool:
        """Whether a keep of this pass counts the live storage at ``ptr`` already: an earlier block's
        (its backward ends after this block's), or an earlier call of this block."""
        entry = self._held.get(ptr)
        if entry is None:
            return False
        first, ref = entry
        if ref.expired():
            del self._held[ptr]
            return False
        return first <= block

    def count(self, ptr: int, block: int, alias: torch.Tensor) -> None:
        """``block`` counts the storage at ``ptr`` (``alias``'s)."""
        self._held[ptr] = (block, StorageRef(alias.untyped_storage()))


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A kept tensor as the pack hook returns it (NOTE [kept tensors are detached])."""
    return tensor if tensor.grad_fn is None else tensor.detach()


def make_pack_hook(
    *,
    block: int,
    swap: bool,
    what: str,
    device: torch.device,
    skip_ptrs: frozenset[int],
    min_swap_bytes: int,
    ctx: SwapContext,
    on_kept: Callable[[int, int, str, torch.dtype], None],
    on_swapped: Callable[[SwappedStorage], None],
    codec: Codec = Codec.NONE,
    param_view: Callable[[torch.Tensor], object | None] | None = None,
    shared: DeviceLedger | None = None,
    swap_all: bool = False,
) -> Callable[[torch.Tensor], object]:
    """The pack hook for one block's forward (or recomputation): keep or swap each saved storage.

    A kept tensor is returned as a tensor (autograd's fast path: a packed non-tensor costs ~7 us per
    saved tensor on CPU), detached, and its storage reported once through
    ``on_kept(block, nbytes, what, dtype)``.

    NOTE [kept tensors are detached]
    The graph node that saves a tensor holds what the pack hook returns. Autograd saves an op's own
    output without its ``grad_fn`` (which points back to that node), but it holds a pack hook's
    result as it is: returning the output itself makes node -> output -> ``grad_fn`` -> node, a
    cycle through C++ that Python's collector cannot see, so a graph dropped without its backward
    (a forward that raised, a validation forward without ``no_grad``) would keep its activations for
    ever. ``detach()`` is the same storage, version counter and layout without the ``grad_fn``;
    unpacking rebuilds the autograd edges from the saved variable, as it does for the tensor itself.
    A tensor without a ``grad_fn`` (a leaf, or one made without grad) closes no cycle and is returned
    as itself, so a backward sees the caller's own object, as in plain PyTorch.
    With a ``codec``, floating-point storages are compressed before their copy out.
    ``skip_ptrs``: storages never counted or moved (parameters and buffers). ``param_view``: for a
    block with streamed parameters, turns a view of one into a reference (NOTE [streamed parameters]).
    ``shared``: the pass's ledger of kept storages; one an earlier block counts is not counted again
    (NOTE [storages shared between blocks] in ``ooc.scheduler.sharing``).
    ``swap_all`` (with ``swap``): every device storage with bytes is swapped uncompressed, whatever
    its size: ``min_swap_bytes`` does not apply (a selective RECOMPUTE's swapped cached outputs,
    which the plan chose one by one: NOTE [swapped cached ops] in ``ooc.scheduler.schedule``).
    """
    if swap_all and (not swap or codec is not Codec.NONE):
        raise ValueError(f"make_pack_hook: swap_all needs swap=True and codec none, got swap={swap}, codec {codec.value}")
    # Per call, a fresh ledger: a storage address is only trusted while this block runs and holds
    # it, never across a release (the allocator may hand the address to another tensor). The ledger
    # dies with this closure when the block's forward ends.
    ledger: dict[int, SwappedStorage | None] = {}
    # A compressed record does not hold its source storage; without this, the allocator could hand
    # that address to a new tensor of this same forward, which the ledger would then take for it.
    held_sources: list[torch.UntypedStorage] = []
    spec = None if codec is Codec.NONE else codec_spec(codec)

    def pack(tensor: torch.Tensor) -> object:
        if tensor.device != device:
            return _kept(tensor)
        if param_view is not None and (ref := param_view(tensor)) is not None:
            return ref
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in skip_ptrs:
            return _kept(tensor)
        nbytes = storage.nbytes()
        # An empty storage has nothing to move (and no values to quantize), whatever min_swap_bytes says.
        if not swap or not nbytes or (not swap_all and nbytes < min_swap_bytes):
            kept = _kept(tensor)
            if nbytes and ptr not in ledger:
                ledger[ptr] = None
                if shared is None:
                    on_kept(block, nbytes, what, tensor.dtype)
                elif not shared.counted_before(ptr, block):
                    on_kept(block, nbytes, what, tensor.dtype)
                    shared.count(ptr, block, kept)
            return kept
        record = ledger.get(ptr)
        if record is None:
            if spec is not None and spec.compresses(nbytes, tensor.dtype):
                record = CompressedStorage(ctx, block, tensor, what, codec)
                held_sources.append(storage)
            else:
                counted = shared is None or not shared.counted_before(ptr, block)
                record = SwappedStorage(ctx, block, tensor, what, counted=counted)
            ledger[ptr] = record
            on_swapped(record)
        return SwappedView(record, tensor)

    return pack
