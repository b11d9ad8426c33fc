"""Weight streaming: the parameters of ``STREAMED`` blocks live on the host between their uses.

NOTE [streamed parameters]
At wrap each streamed parameter's data moves to a host buffer (pinned on CUDA), and ``p.data``
points there: optimizers, ``state_dict`` and ``.grad`` see a host tensor. Before the block's forward
(and again before its backward) the schedule's STREAM_IN copies bring it to a fresh device buffer,
and ``p.data`` points to that while the block runs. Saved tensors that are views of a streamed
parameter are packed as references (:class:`StreamedView`), not as the device buffer, so the buffer
is freed when the forward ends and the reference is resolved against the buffer of the backward.
After the backward the gradient follows the parameter to the host.

NOTE [parameters shared between blocks]
A parameter that two blocks hold (a weight tied across layers, ALBERT's shared layers), or a block
and a module outside the chain (a tied embedding), is never streamed: it stays on the device, where
every holder reads it whenever it runs. Streaming it with one holder would leave it on the host
while another, resident or streamed later, runs (on a GPU: a device mismatch). Its bytes count once
among the resident parameters (``BlockProfile.shared_params``, ``ooc.blocks.shared_parameter_ids``).

NOTE [streamed layouts]
The host and device buffers of a parameter, and of its gradient on the way between them, keep its
memory layout (the strides ``torch.empty_like`` keeps: a ``channels_last`` convolution weight stays
``channels_last``). A buffer viewed as a contiguous tensor turned such weights contiguous while
wrapped and after ``ooc.unwrap``, and the convolutions then ran other kernels, whose gradients
differed from plain PyTorch's in the last bits. The copies move the bytes as they lie (``_flat``).

NOTE [data replaced outside ooc]
Between its uses a streamed parameter's ``.data`` is ooc's host copy. Code that replaces it
(``p.data = p.data.clamp(-1, 1)``, ``p.data = pretrained``, ``model.half()``/``model.double()``/
``model.to(...)``, which assign ``.data`` too) used to be ignored: the next stream-in copied the old
host copy in and pointed ``p.data`` back at it, so training went on from the old weights without a
word (or failed on mixed dtypes), and ``ooc.unwrap`` put the old weights back. Now the stream-in
(and unwrap) takes a replacement of the same shape and dtype as the new value of the host copy; one
of another shape or dtype cannot go into it, so the stream-in raises ``WrapError`` (unwrap, change
the model, wrap again) and unwrap leaves it as the caller set it.

NOTE [weights changed around a stream-in]
Code outside ooc may change a streamed parameter in place while ooc moves it: an optimizer step in
a gradient hook (PyTorch's "optimizer step in backward": ``register_post_accumulate_grad_hook``)
changes the device copy during the block's backward, and a forward pre-hook that clamps the
block's weights changes the host copy after the stream-in one block ahead has started reading it.
Both used to be lost without a word: the device copy was dropped at release, and the block ran on
the copy made before the change. The parameter's version counter (bumped by every in-place op on
it, not by one through ``.data``) tells: ``release`` copies a device copy whose version moved since
``attach`` back into the host copy. A block's weights are attached by a forward pre-hook that runs
before the caller's, so a pre-hook changes the device copy (and ``release`` keeps it); where the
host copy still changes after ``issue`` (code between two blocks), ``attach`` waits for the copy in
flight and copies the host copy in again.

NOTE [a forward that raises]
A block's weights go to the device in its pre-hook and come back at the end of its forward, and the
blocks after it are issued during its forward (prefetch). A forward that raises before or after
(in a caller's pre-hook or hook of the block, or in the block itself) skipped both: the block's
weights, or the next block's, stayed on the device until that block's next forward, and the next
step ran with a block more than its plan holds. So the wrapped model's forward ends, also when it
raises, by sending every streamed block back (``release_all``; a hook with ``always_call``). After
a forward that returns nothing is on the device either: each block's forward released its own,
and the blocks it issued ran and released theirs; the backward streams its blocks in itself.

NOTE [the host copy is released last]
``release`` points ``p.data`` back at the host copy, which code outside ooc may then write at once
(an in-place op on a host tensor runs on the host, ordered by no stream: a clamp or an EMA after a
forward, ``load_state_dict``). On a GPU the block's stream-in copy, queued behind the host, may not
have read it yet, and the block's kernels then ran on half-new weights (a forward without grad has
no later sync: no gradient comes back to wait for). So ``release`` waits on the host for the
stream-in first. It costs little: the block's kernels are queued after that copy already, so the GPU
stays busy; the host only cannot run more than a block ahead of the H2D stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ooc.backend import Backend, Event
from ooc.blocks import Chain
from ooc.errors import WrapError
from ooc.scheduler.plan import Plan
from ooc.tracker import MemoryTracker


@dataclass
class _Streamed:
    param: nn.Parameter
    host: torch.Tensor
    name: str
    """The parameter's name in the model (``blocks.1.attn.qkv.weight``), for error messages."""
    device: torch.Tensor | None = None
    ready: Event | None = None
    issued_version: int = 0
    """``param._version`` when the copy in was issued (NOTE [weights changed around a stream-in])."""
    attached_version: int = 0
    """``param._version`` when ``param.data`` became the device copy."""

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def replaced(self) -> bool:
        """``param.data`` is neither the host copy nor the device copy: code outside ooc assigned it
        (NOTE [data replaced outside ooc])."""
        ptr = self.param.data_ptr()
        return ptr != self.host.data_ptr() and (self.device is None or ptr != self.device.data_ptr())

    def fits_host(self) -> bool:
        """The replacement can become the host copy's value (same shape and dtype)."""
        data = self.param.data
        return data.shape == self.host.shape and data.dtype == self.host.dtype


def _laid_out_like(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``buffer`` (``uint8``, ``like``'s byte size) as a tensor of ``like``'s dtype, shape and layout:
    ``like``'s strides where it is dense (``channels_last`` included), else contiguous
    (NOTE [streamed layouts])."""
    stride = torch.empty_like(like, device="meta").stride()
    return buffer.view(like.dtype).as_strided(like.shape, stride)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its elements fill one span of its storage (what ``_flat`` copies), else a
    contiguous copy."""
    return t if torch.empty_like(t, device="meta").stride() == t.stride() else t.contiguous()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The elements of a dense ``t`` (``_laid_out_like``, ``_dense``) as they lie in memory, 1-D."""
    return t.as_strided((t.numel(),), (1,))


class StreamedView:
    """A saved tensor that is a view of a streamed parameter: rebuilt from the parameter's data
    at unpack time (the device buffer of the backward)."""

    __slots__ = ("entry", "offset", "size", "stride")

    def __init__(self, entry: _Streamed, tensor: torch.Tensor) -> None:
        self.entry = entry
        self.offset = tensor.storage_offset()
        self.size = tensor.size()
        self.stride = tensor.stride()

    @property
    def parameter(self) -> nn.Parameter:
        """The parameter this view was taken of; the view shared its version counter, so an in-place
        change of the parameter after the save shows in its ``_version``."""
        return self.entry.param

    def unpack(self) -> torch.Tensor:
        entry = self.entry
        if entry.device is None or entry.param.data_ptr() != entry.device.data_ptr():
            raise RuntimeError(
                "a streamed parameter was read by a backward while it was on the host; ooc streams it in "
                "when its block's backward starts, so this backward did not go through ooc's hooks"
            )
        return entry.param.detach().as_strided(self.size, self.stride, self.offset)


class ParamStreamer:
    """Moves the parameters of a plan's streamed blocks between host and device."""

    def __init__(self, chain: Chain, plan: Plan, backend: Backend, tracker: MemoryTracker,
                 shared: frozenset[int] = frozenset()) -> None:
        """``shared``: ``id`` of the parameters that stay on the device (NOTE [parameters shared between blocks])."""
        self.backend = backend
        self.tracker = tracker
        self.blocks: dict[int, list[_Streamed]] = {}
        self.before_stream_in: list[Callable[[int], None]] = []
        """Called with a block before its parameters are read from the host (the host optimizer
        waits there for that block's update)."""
        self.grad_moved: list[Callable[[torch.Tensor, torch.Tensor], None]] = []
        """Called with (parameter, its new gradient) when the gradient moves between device and host
        (the same values in a new tensor; the host optimizer follows it, NOTE [gradients read in
        the backward] in ooc.optim.pipeline)."""
        self._by_ptr: dict[int, _Streamed] = {}
        self._grads_pending: dict[int, int] = {}
        self._release_when_done: set[int] = set()
        self._handles = []
        for i, block in enumerate(plan.blocks):
            if not block.streamed:
                continue
            entries = []
            for name, p in chain.modules[i].named_parameters():
                if id(p) in shared:
                    continue
                host = _laid_out_like(backend.host_buffer(p.numel() * p.element_size()), p)
                with torch.no_grad():
                    host.copy_(p.detach())
                entries.append(_Streamed(p, host, f"{chain.names[i]}.{name}"))
            self.blocks[i] = entries
        self._host_of = {id(e.param): e.host for entries in self.blocks.values() for e in entries}
        for i, entries in self.blocks.items():
            for e in entries:
                e.param.data = e.host  # the device copy is freed with its last reference
                if e.param.requires_grad:
                    self._handles.append(e.param.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i)))

    @property
    def streamed_param_ids(self) -> set[int]:
        return set(self._host_of)

    def host_copy(self, p: torch.Tensor) -> torch.Tensor | None:
        return self._host_of.get(id(p))

    def issue(self, block: int) -> None:
        """Start copying the block's parameters to the device (no-op if there or on the way)."""
        entries = self.blocks.get(block)
        if not entries or entries[0].device is not None:
            return
        for callback in self.before_stream_in:
            callback(block)
        for e in entries:
            self._adopt(e)
        for e in entries:
            e.device = _laid_out_like(self.backend.device_buffer(e.nbytes), e.host)
        # The buffers were allocated in compute order: the allocator may have handed over memory that
        # kernels still queued on compute use (the block released just before). The copies wait for
        # compute to reach the allocation.
        allocated = self.backend.record_compute()
        for e in entries:
            e.ready = self.backend.copy_h2d(_flat(e.device), _flat(e.host), (allocated,))
            e.issued_version = e.param._version
        self.tracker.alloc_params(sum(e.nbytes for e in entries))

    def _copy_in_again(self, e: _Streamed) -> None:
        """The host copy changed (or ``.data`` was assigned) after its copy in was issued: copy it
        again (NOTE [weights changed around a stream-in])."""
        # The copy in flight reads the host copy, which _adopt may write: wait for it.
        e.ready.synchronize()
        self._adopt(e)
        # The same H2D stream, after the first copy: nothing else writes or reads the buffer yet.
        e.ready = self.backend.copy_h2d(_flat(e.device), _flat(e.host), (e.ready,))
        e.issued_version = e.param._version

    def _adopt(self, e: _Streamed) -> None:
        """A ``.data`` assigned outside ooc becomes the host copy's value (NOTE [data replaced outside ooc])."""
        if not e.replaced():
            return
        data = e.param.data
        if not e.fits_host():
            raise WrapError(
                f"the data of streamed parameter {e.name} was replaced after ooc.wrap by a tensor of another shape or "
                f"dtype ({tuple(data.shape)} {data.dtype}, was {tuple(e.host.shape)} {e.host.dtype}: model.half(), "
                f".double(), .to(dtype) or p.data = ...); ooc streams it from a host copy of the old one. Call "
                f"ooc.unwrap(model), change the model, then wrap it again"
            )
        with torch.no_grad():
            e.host.copy_(data)  # from the device too (a model moved after wrap): a synchronous copy
        e.param.data = e.host

    def attach(self, block: int) -> None:
        """The block is about to run: its parameters point at their device copies."""
        entries = self.blocks.get(block)
        if not entries:
            return
        self.issue(block)
        for e in entries:
            attached = e.param.data_ptr() == e.device.data_ptr()
            if not attached and (e.replaced() or e.param._version != e.issued_version):
                self._copy_in_again(e)
            # The block reads its weights next: compute must not pass their copy in.
            self.backend.wait_compute(e.ready)
            if not attached:
                grad = e.param.grad
                e.param.grad = None
                e.param.data = e.device
                e.attached_version = e.param._version
                if grad is not None:
                    e.param.grad = self._grad_to_device(grad)  # accumulation continues on the device
                    self._moved(e.param)
            self._by_ptr[e.device.untyped_storage().data_ptr()] = e
        self._grads_pending[block] = sum(1 for e in entries if e.param.requires_grad)

    def release(self, block: int) -> None:
        """The block is done with its parameters: back to the host copies; the device copies go."""
        entries = self.blocks.get(block)
        if not entries or entries[0].device is None:
            return
        for e in entries:
            # NOTE [the host copy is released last]: the stream-in may still be reading it.
            e.ready.synchronize()
            self._by_ptr.pop(e.device.untyped_storage().data_ptr(), None)
            if e.param.data_ptr() == e.device.data_ptr() and e.param._version != e.attached_version:
                self._copy_back(e)
            grad = e.param.grad
            e.param.grad = None
            if not e.replaced():  # else the caller's .data stays, for the next issue to adopt
                e.param.data = e.host
            if grad is not None:
                e.param.grad = self._grad_to_host(grad)
                self._moved(e.param)
            e.device = None
            e.ready = None
        self._release_when_done.discard(block)
        self.tracker.free_params(sum(e.nbytes for e in entries))

    def _copy_back(self, e: _Streamed) -> None:
        """The device copy changed in place while attached (an optimizer step in a gradient hook): its
        bytes become the host copy's (NOTE [weights changed around a stream-in])."""
        # The copy waits for compute to have made the change (queued kernels on CUDA) ...
        changed = self.backend.record_compute()
        done = self.backend.copy_d2h(_flat(e.host), _flat(e.device), (changed,))
        # ... and the host copy is read next (an optimizer, the next stream-in): wait for it.
        done.synchronize()

    def _moved(self, param: torch.Tensor) -> None:
        for callback in self.grad_moved:
            callback(param, param.grad)

    def _grad_to_host(self, grad: torch.Tensor) -> torch.Tensor:
        """A device gradient's host copy (pinned on CUDA), complete when this returns."""
        if grad.layout != torch.strided:
            # NOTE [sparse gradients of streamed weights]
            # An ``nn.Embedding(sparse=True)``'s gradient has no span of bytes for the copy engines (``_flat``
            # raised "Could not run 'aten::as_strided' with arguments from the 'SparseCPU' backend" when the
            # block released its weights). torch copies its indices and values instead, on compute (the
            # stream that produced them), and returns once the copy is done, as the dense path waits for
            # its copy (the host reads .grad next); ``_grad_to_device`` likewise, before the accumulation.
            return grad.to("cpu", copy=True)
        src = _dense(grad)  # before the event below: the copy reads what compute wrote up to it
        host = _laid_out_like(self.backend.host_buffer(src.numel() * src.element_size()), src)
        # The copy waits for compute to have produced the gradient (its backward may still be queued).
        produced = self.backend.record_compute()
        done = self.backend.copy_d2h(_flat(host), _flat(src), (produced,))
        # The host (optimizer, user) reads .grad next: wait for the copy.
        done.synchronize()
        return host

    def _grad_to_device(self, grad: torch.Tensor) -> torch.Tensor:
        """A host gradient's device copy, which compute may read once this returns."""
        if grad.layout != torch.strided:
            return grad.to(self.backend.device, copy=True)  # NOTE [sparse gradients of streamed weights]: on compute
        src = _dense(grad)
        device = _laid_out_like(self.backend.device_buffer(src.numel() * src.element_size()), src)
        # The destination was allocated in compute order: the copy waits for compute to reach that point.
        allocated = self.backend.record_compute()
        ready = self.backend.copy_h2d(_flat(device), _flat(src), (allocated,))
        # Backward accumulates into it next: compute waits for the copy.
        self.backend.wait_compute(ready)
        return device

    def release_after_backward(self, block: int) -> None:
        """Release once every gradient of the block has been accumulated (now, or at the last one)."""
        if self._grads_pending.get(block, 0) == 0:
            self.release(block)
        else:
            self._release_when_done.add(block)

    def _on_grad(self, block: int) -> None:
        if block not in self._grads_pending:
            return
        self._grads_pending[block] -= 1
        if self._grads_pending[block] == 0 and block in self._release_when_done:
            self.release(block)

    def view_of(self, tensor: torch.Tensor) -> StreamedView | None:
        """A saved tensor that is a view of a streamed parameter's device copy, as a reference."""
        entry = self._by_ptr.get(tensor.untyped_storage().data_ptr())
        return None if entry is None else StreamedView(entry, tensor)

    def release_all(self) -> None:
        for block in list(self.blocks):
            self.release(block)

    def restore(self) -> None:
        """At unwrap: the parameters go back to the device for good."""
        self.release_all()
        for handle in self._handles:
            handle.remove()
        for entries in self.blocks.values():
            for e in entries:
                if e.replaced() and not e.fits_host():
                    continue  # the caller's tensor stays (NOTE [data replaced outside ooc])
                self._adopt(e)
                device = _laid_out_like(self.backend.device_buffer(e.nbytes), e.host)
                with torch.no_grad():
                    device.copy_(e.host)
                e.param.data = device
        self.blocks.clear()
        self._host_of.clear()
