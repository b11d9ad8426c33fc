"""The CPU backend's stream-order checker: raises on any device access that no event orders.

NOTE [stream-order checker]
The CPU backend runs copies on threads, but "device" memory is host memory: there is no caching
allocator handing a freed block to the next allocation, and no kernel runs later than the host
issued it. So a missing event cannot corrupt data on the CPU the way it does on a GPU. This module
checks the CUDA rules instead of waiting for them to bite.

The model:
- Virtual streams, each with a logical clock that ticks once per access it issues: ``compute[T]``
  for every host thread ``T`` that runs torch ops (queued kernels: they run in issue order, but
  behind the host), ``h2d#k`` and ``d2h#k`` for backend ``k``'s copy engines, and one ``host``.
  ``host`` stands for all host threads: what one thread learned by waiting, ooc's hand-offs between
  its threads (queues, ``threading.Event``) pass on to the others. The checker cannot see those
  hand-offs and assumes they order every host thread (a limit: a race between two host threads is
  not caught).
- Every stream knows, per other stream, the latest clock it is ordered after. An event carries its
  stream's clock and knowledge at record time. Waiting on it is an edge: ``wait_compute`` teaches
  the thread's compute stream, a copy's ``after`` tuple teaches the copy engine, and a host
  ``Event.synchronize()`` / ``query() -> True`` / ``Backend.synchronize()`` teaches the host. Work
  issued by the host (a kernel, a copy) is ordered after everything the host knows and did.
- Each storage (keyed by its address) keeps its allocation point, last writer and readers since.
  An access from stream ``S`` must be ordered after the last write (and, for a write, after the
  reads) made by any other stream; an allocation counts as a write, which gives rule (1): a copy
  into a buffer allocated on compute waits on a compute event recorded after the allocation.
- Compute accesses come from a ``TorchDispatchMode`` pushed on a thread the first time it calls the
  checking backend or waits on one of its events: each op ticks ``compute[T]`` and stamps the
  storages it reads and writes (from the op's schema); an op output with a fresh storage is an
  allocation. Accesses to host buffers (``Backend.host_buffer``) are stamped on ``host`` instead, so
  a host read of a D2H destination before its event is synchronized fails (rule 3), and so does a
  copy into a pooled host buffer whose last copy is not known to be done (rule 4). ``.item()``
  (``_local_scalar_dense``) waits for the thread's compute stream, as on CUDA, and so does a torch
  ``copy_`` between a host buffer and a device one without ``non_blocking`` (NOTE [a blocking torch
  copy waits for compute]). A backend copy
  between two host buffers (staging into a streamed parameter's host copy) is stamped on ``host``
  too, ordered by what the host knows, not by its ``after``: CUDA runs it on the calling thread at
  once, on no stream.
- Frees (rule 2): the caching allocator hands a block freed on a stream to that stream's next
  allocation at once, so an allocation at an address whose previous storage another stream still
  used, unordered, is a use after free -- unless that stream's use was covered by
  ``record_stream``. Every backend copy records both buffers (``CudaBackend._copy``; the CPU copy job
  holds them until it ran, its stand-in), so copy engines are exempt; accesses from other threads'
  compute streams are not. The CPU allocator also hands a block freed by one thread to another
  thread's allocation, which the caching allocator never does across streams (each stream has its
  pool): only an allocation on the stream that allocated the previous storage can be a use after
  free. (Host tensors made by ``.to("cpu")`` on a thread count as that thread's device allocations
  here: on a GPU they come from no pool at all.)

- Arena slices (NOTE [host arena] in ``ooc.backend.arena``): the host arena carves many DMA
  buffers out of one chunk, i.e. one storage. Each carved slice is a host buffer of its own
  (``carved``): an access to the chunk is stamped on the slice its first byte lies in. Carving a
  slice over memory that a copy engine used, where the host has not seen that copy complete, is a
  reuse of a pinned buffer in flight (rule 4), reported at the carve.

Limits: accesses are tracked per storage (per arena slice), not per byte range (two copies into
halves of one buffer are one buffer); compute streams of two threads are not checked against each other (ooc orders
them by host hand-offs, e.g. own-master weights written by the update thread); a thread whose
dispatch stack already holds another mode is not watched; host-to-host copies by torch (``.to``
on the CPU) are invisible. The checker costs a Python call per torch op on watched threads.
"""

from __future__ import annotations

import bisect
import sys
import threading
import weakref
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _push_mode

from ooc.errors import OocError


class StreamOrderError(OocError, RuntimeError):
    """Two accesses to one buffer that no event orders: on a GPU, a race. The message names the
    buffer and both accesses; order them with an event (``after=``, ``wait_compute`` or a host
    ``synchronize``)."""


class _Access(NamedTuple):
    stream: int
    clock: int
    what: str


class _Buf:
    __slots__ = ("ptr", "nbytes", "kind", "alloc", "writer", "readers", "ref")

    def __init__(self, ptr: int, nbytes: int, kind: str, alloc: _Access, storage: torch.UntypedStorage) -> None:
        self.ref = weakref.ref(storage)
        """The storage this entry is about; dead or another object: the memory was freed (and maybe
        reallocated where the checker did not see it)."""
        self.ptr = ptr
        self.nbytes = nbytes
        self.kind = kind
        self.alloc = alloc
        self.writer: _Access = alloc
        self.readers: dict[int, _Access] = {}


_UNTRACKED_OPS = frozenset({"aten::set_", "aten::detach", "aten::alias", "aten::lift_fresh"})
_HOST_SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::equal"})
_COPY_OP = "aten::copy_"


def _non_blocking(args: tuple, kwargs: dict) -> bool:
    """``aten::copy_(self, src, non_blocking=False)``'s flag."""
    return bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))


class _OpInfo:
    __slots__ = ("name", "written_pos", "written_names", "fresh_outputs", "tracked", "host_sync", "collective",
                 "bumps_versions")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.name = schema.name
        args = schema.arguments
        written = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
        self.collective = self.name.startswith("c10d::")
        if self.collective and self.name.endswith("_") and args:
            written = [0]  # in-place collectives (allreduce_, broadcast_, ...) write their tensors unannotated
        self.written_pos = frozenset(written)
        self.written_names = frozenset(args[i].name for i in written)
        self.fresh_outputs = tuple(r.alias_info is None for r in schema.returns)
        # A view (every output aliases an input, nothing written) moves no data: not an access.
        is_view = bool(schema.returns) and not written and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        self.tracked = self.name not in _UNTRACKED_OPS and not is_view
        self.host_sync = self.name in _HOST_SYNC_OPS
        self.bumps_versions = self.name.startswith("aten::_foreach_") and bool(written)
        """An in-place foreach op: outside a dispatch mode it bumps its tensors' version counters, under
        one it does not (NOTE [foreach writes under the checker])."""

    def written(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors the op writes (those in lists too)."""
        tensors: list[torch.Tensor] = []
        chosen = [a for i, a in enumerate(args) if i in self.written_pos]
        chosen += [a for name, a in kwargs.items() if name in self.written_names]
        for arg in chosen:
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(t, torch.Tensor) and not t.is_inference():
                    tensors.append(t)
        return tensors


_Key = tuple[int, int, torch.UntypedStorage]


def _storage_key(t: torch.Tensor) -> _Key | None:
    if t.device.type != "cpu" or t.layout is not torch.strided:
        return None
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage, or no data (a FakeTensor a compiler left)
        return None
    return (ptr, storage.nbytes(), storage) if ptr else None


def _caller() -> str:
    """The innermost frame outside this package's backend modules, as ``file:line``."""
    frame = sys._getframe(2)
    while frame is not None and "/ooc/backend/" in frame.f_code.co_filename.replace("\\", "/"):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"


class CheckedEvent:
    """A CPU event with the knowledge it carries: waiting on it orders the waiter after its stream."""

    __slots__ = ("inner", "vec", "checker")

    def __init__(self, inner: Any, vec: dict[int, int], checker: OrderChecker) -> None:
        self.inner = inner
        self.vec = vec
        self.checker = checker

    def query(self) -> bool:
        done = self.inner.query()
        if done:
            self.checker.host_learns(self.vec)
        return done

    def synchronize(self) -> None:
        self.inner.synchronize()
        self.checker.host_learns(self.vec)


class OrderChecker:
    """The clocks, knowledge and buffer stamps of NOTE [stream-order checker] (one per process:
    the dispatch mode on a thread serves every checking backend)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._names: list[str] = []
        self._clock: list[int] = []
        self._knows: list[dict[int, int]] = []
        self._exempt: list[bool] = []
        """Streams whose uses are covered by record_stream (the copy engines)."""
        self.host = self._new_stream("host", exempt=False)
        self._bufs: dict[int, _Buf] = {}
        self._ops: dict[Any, _OpInfo] = {}
        self._slices: dict[int, tuple[weakref.ref, tuple[int, ...], tuple[int, ...]]] = {}
        """Per arena chunk (its storage's address): the chunk's storage, and the (starts, ends) of
        the slices carved from it, sorted; replaced whole on each carve, so readers need no lock."""
        self._tls = threading.local()
        """Per thread: ``watched`` (its dispatch mode, once watched: :class:`_Watched`) and ``compute`` (its compute stream,
        once it issues device work: records or waits on compute, allocates a device buffer, runs a
        collective; until then its ops are host work). Thread-local, so a new thread that reuses a
        dead one's id starts afresh."""

    def _key(self, t: torch.Tensor) -> _Key | None:
        """The buffer ``t`` accesses: its storage, or the arena slice its first byte lies in."""
        key = _storage_key(t)
        if key is None:
            return None
        slices = self._slices.get(key[0])
        if slices is None or slices[0]() is not key[2]:
            return key  # not a chunk (any more: its memory went to another storage)
        _, starts, ends = slices
        address = t.data_ptr()
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < ends[i]:
            return (starts[i], ends[i] - starts[i], key[2])
        return (address, t.numel() * t.element_size(), key[2])

    # streams and events --------------------------------------------------------------------

    def _new_stream(self, name: str, *, exempt: bool) -> int:
        self._names.append(name)
        self._clock.append(0)
        self._knows.append({})
        self._exempt.append(exempt)
        return len(self._names) - 1

    def copy_stream(self, name: str) -> int:
        with self._lock:
            return self._new_stream(name, exempt=True)

    def _compute_stream(self) -> int:
        stream = getattr(self._tls, "compute", None)
        if stream is None:
            stream = self._tls.compute = self._new_stream(f"compute[{threading.current_thread().name}]", exempt=False)
        return stream

    def _join(self, into: dict[int, int], vec: dict[int, int]) -> None:
        for s, c in vec.items():
            if into.get(s, 0) < c:
                into[s] = c

    def _issued_by_host(self, stream: int) -> None:
        # Work the host issues now runs after everything the host knows and has done.
        knows = self._knows[stream]
        self._join(knows, self._knows[self.host])
        if knows.get(self.host, 0) < self._clock[self.host]:
            knows[self.host] = self._clock[self.host]

    def _snapshot(self, stream: int) -> dict[int, int]:
        vec = dict(self._knows[stream])
        vec[stream] = self._clock[stream]
        return vec

    def record_compute(self) -> dict[int, int]:
        """The knowledge an event recorded now on the calling thread's compute stream carries."""
        self.watch()
        with self._lock:
            stream = self._compute_stream()
            self._issued_by_host(stream)
            return self._snapshot(stream)

    def compute_stream(self) -> int:
        """The calling thread's compute stream."""
        self.watch()
        with self._lock:
            return self._compute_stream()

    def record_on(self, stream: int) -> dict[int, int]:
        """The knowledge an event recorded now on ``stream`` (another thread's compute) carries."""
        with self._lock:
            return self._snapshot(stream)

    def compute_waits(self, event: object) -> None:
        """``wait_compute``: the calling thread's compute stream is ordered after ``event``."""
        self.watch()
        if isinstance(event, CheckedEvent):
            with self._lock:
                self._join(self._knows[self._compute_stream()], event.vec)

    def host_learns(self, vec: dict[int, int]) -> None:
        self.watch()
        with self._lock:
            self._join(self._knows[self.host], vec)

    def host_syncs_streams(self, streams: tuple[int, ...]) -> None:
        """The host waited for everything issued on ``streams``."""
        with self._lock:
            for stream in streams:
                self._join(self._knows[self.host], self._snapshot(stream))

    # accesses --------------------------------------------------------------------------------

    def _covered(self, stream: int, access: _Access) -> bool:
        if access.stream == stream:
            return True
        if self._knows[stream].get(access.stream, 0) >= access.clock:
            return True
        if stream != self.host and not self._exempt[stream]:
            # A compute stream's kernels are issued by the host: what the host knows, they know.
            return access.stream == self.host or self._knows[self.host].get(access.stream, 0) >= access.clock
        return False

    def _describe(self, buf: _Buf) -> str:
        return (f"{buf.kind} buffer 0x{buf.ptr:x} ({buf.nbytes} bytes, allocated by {buf.alloc.what} on "
                f"{self._names[buf.alloc.stream]})")

    def _conflict(self, buf: _Buf, first: _Access, stream: int, what: str, rule: str) -> StreamOrderError:
        known = self._knows[stream].get(first.stream, 0)
        return StreamOrderError(
            f"stream order violated on {self._describe(buf)}: {first.what} on {self._names[first.stream]} "
            f"(tick {first.clock}) is not ordered before {what} on {self._names[stream]}, which is ordered after "
            f"tick {known} of {self._names[first.stream]} only. {rule}"
        )

    def _check(self, buf: _Buf, stream: int, what: str, *, write: bool, checked: tuple[int, ...] | None) -> None:
        """``checked``: the streams whose accesses are checked (``None``: all)."""
        writer = buf.writer
        if (checked is None or writer.stream in checked or self._exempt[writer.stream]) and not self._covered(stream, writer):
            if writer is buf.alloc and buf.kind == "device" and write:
                rule = ("A copy into a buffer allocated on the compute stream must wait on a compute event recorded "
                        "after the allocation (pass it in `after`): the caching allocator may hand over memory "
                        "that kernels still queued on compute use.")
            elif not self._exempt[writer.stream] and self._exempt[stream]:
                rule = ("The copy's source was written after the events in its `after`: record the compute event "
                        "after the op that produces it (e.g. after `.contiguous()`, a gather or a collective).")
            elif self._exempt[writer.stream]:
                rule = ("Wait on the copy's event first: `Backend.wait_compute(event)` before compute reads it, "
                        "`event.synchronize()` before the host does, or pass it in `after` of the next copy.")
            else:
                rule = ("Record an event after that access and wait on it (`after=` of the copy, `wait_compute`, "
                        "or `synchronize()` on the host).")
            raise self._conflict(buf, writer, stream, what, rule)
        if write:
            for reader in buf.readers.values():
                if (checked is None or reader.stream in checked or self._exempt[reader.stream]) \
                        and not self._covered(stream, reader):
                    raise self._conflict(buf, reader, stream, what,
                                         "A buffer must not be overwritten before its last reader is done: wait on "
                                         "an event recorded after that read (a pooled host buffer: the event its "
                                         "last copy returned).")

    def _allocated(self, key: _Key, stream: int, access: _Access, kind: str) -> _Buf:
        ptr, nbytes, storage = key
        old = self._bufs.get(ptr)
        if old is not None and old.kind == "device" and kind == "device" and stream != self.host \
                and old.alloc.stream == stream and old.ref() is not storage:
            for prev in (old.writer, *old.readers.values()):
                if prev.stream != stream and not self._exempt[prev.stream] and not self._covered(stream, prev):
                    raise StreamOrderError(
                        f"use after free: {access.what} on {self._names[stream]} was handed the memory of "
                        f"{self._describe(old)}, which {prev.what} on {self._names[prev.stream]} (tick {prev.clock}) "
                        "may still use: the caching allocator reuses a block freed on a stream at once. Keep the "
                        "buffer alive until an event after that use completes, or call record_stream on it for "
                        "the other stream."
                    )
        buf = self._bufs[ptr] = _Buf(ptr, nbytes, kind, access, storage)
        return buf

    def _buf(self, key: _Key) -> _Buf:
        buf = self._bufs.get(key[0])
        if buf is None or buf.ref() is not key[2]:
            # Never seen, or allocated where the checker did not look: no constraint known.
            buf = self._bufs[key[0]] = _Buf(key[0], key[1], "device", _Access(self.host, 0, "an unknown allocation"),
                                            key[2])
        return buf

    def allocated(self, tensor: torch.Tensor, what: str, *, host: bool) -> None:
        """``tensor`` was just allocated: on the calling thread's compute stream, or (``host``) as a
        host buffer, synchronously by the host."""
        self.watch()
        key = _storage_key(tensor)
        if key is None:
            return
        with self._lock:
            stream = self.host if host else self._compute_stream()
            self._clock[stream] += 1
            self._allocated(key, stream, _Access(stream, self._clock[stream], f"{what} at {_caller()}"),
                            "host" if host else "device")

    def carved(self, piece: torch.Tensor, what: str) -> None:
        """The host arena carved ``piece`` out of a chunk: from now on a buffer of its own. Raises
        :class:`StreamOrderError` if a copy used any of its bytes and the host has not seen that
        copy complete."""
        self.watch()
        key = _storage_key(piece)
        if key is None:
            return
        start, end = piece.data_ptr(), piece.data_ptr() + piece.numel()
        label = f"{what} at {_caller()}"
        with self._lock:
            known = self._slices.get(key[0])
            starts, ends = known[1:] if known is not None and known[0]() is key[2] else ((), ())
            kept, covered = [], []
            for s, e in zip(starts, ends):
                (kept if e <= start or s >= end else covered).append((s, e))
            for s, _ in covered:
                old = self._bufs.pop(s, None)
                if old is None or old.ref() is not key[2]:
                    continue
                for prev in (old.writer, *old.readers.values()):
                    if prev.stream != self.host and not self._covered(self.host, prev):
                        raise StreamOrderError(
                            f"reuse of a pinned buffer in flight: {label} handed out bytes of {self._describe(old)}, "
                            f"which {prev.what} on {self._names[prev.stream]} (tick {prev.clock}) may still use. "
                            "Free an arena slice with the events of its last copies (HostArena.free(piece, ready))."
                        )
            kept.append((start, end))
            kept.sort()
            self._slices[key[0]] = (weakref.ref(key[2]), tuple(s for s, _ in kept), tuple(e for _, e in kept))
            self._clock[self.host] += 1
            self._bufs[start] = _Buf(start, end - start, "host", _Access(self.host, self._clock[self.host], label), key[2])

    def copy(self, stream: int, dst: torch.Tensor, src: torch.Tensor, after: tuple[object, ...], what: str) -> dict[int, int]:
        """A copy issued now on ``stream`` after ``after``: checked, stamped; returns its event's knowledge."""
        self.watch()
        label = f"{what} issued at {_caller()}"
        with self._lock:
            src_key, dst_key = self._key(src), self._key(dst)
            src_buf = self._buf(src_key) if src_key else None
            dst_buf = self._buf(dst_key) if dst_key else None
            if self._between_host_buffers(src_buf, dst_buf):
                # CUDA copies it on the calling thread at once, on no stream: ``after`` orders nothing.
                stream, label = self.host, f"{what} between host buffers (a memcpy by the host) issued at {_caller()}"
            else:
                self._issued_by_host(stream)
                for event in after:
                    if isinstance(event, CheckedEvent):
                        self._join(self._knows[stream], event.vec)
            if src_buf is not None:
                self._check(src_buf, stream, f"the {label} reading it", write=False, checked=None)
            if dst_buf is not None:
                self._check(dst_buf, stream, f"the {label} writing it", write=True, checked=None)
            self._clock[stream] += 1
            access = _Access(stream, self._clock[stream], label)
            if src_buf is not None:
                src_buf.readers[stream] = access
            if dst_buf is not None:
                dst_buf.writer = access
                dst_buf.readers = {}
            return self._snapshot(stream)

    @staticmethod
    def _between_host_buffers(src: _Buf | None, dst: _Buf | None) -> bool:
        return src is not None and dst is not None and src.kind == dst.kind == "host"

    def between_host_buffers(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Both are host buffers (``host_buffer``, arena slices): a copy between them is the host's."""
        with self._lock:
            keys = self._key(src), self._key(dst)
            return all(keys) and self._between_host_buffers(*(self._buf(k) for k in keys))

    def op_info(self, func: Any) -> _OpInfo:
        info = self._ops.get(func)
        if info is None:
            info = self._ops[func] = _OpInfo(func)
        return info

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        info = self.op_info(func)
        if not info.tracked:
            return
        reads: list[_Key] = []
        writes: list[_Key] = []
        for i, arg in enumerate(args):
            self._collect(arg, writes if i in info.written_pos else reads)
        for name, arg in kwargs.items():
            self._collect(arg, writes if name in info.written_names else reads)
        fresh: list[_Key] = []
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for is_fresh, o in zip(info.fresh_outputs, outs):
            if is_fresh:
                self._collect(o, fresh)
        if fresh and (reads or writes):
            # Some ops return their (in-place) inputs without saying so in the schema (c10d's).
            inputs = {key[0] for key in (*reads, *writes)}
            fresh = [key for key in fresh if key[0] not in inputs]
        with self._lock:
            compute = self._compute_stream() if info.collective else getattr(self._tls, "compute", None)
            host_ticked = False
            if compute is not None:
                self._clock[compute] += 1
            for keys, write in ((reads, False), (writes, True)):
                for key in keys:
                    buf = self._buf(key)
                    if buf.kind == "host" or compute is None:
                        stream = self.host
                        if not host_ticked:
                            self._clock[self.host] += 1
                            host_ticked = True
                        checked = None
                    else:
                        stream = compute
                        # Compute streams of two threads are ordered by host hand-offs (NOTE's limits).
                        checked = (self.host,)
                    self._check(buf, stream, f"{info.name} ({'write' if write else 'read'})", write=write, checked=checked)
                    access = _Access(stream, self._clock[stream], info.name)
                    if write:
                        buf.writer = access
                        buf.readers = {}
                    else:
                        buf.readers[stream] = access
            for key in fresh:
                if compute is None:
                    self._allocated(key, self.host, _Access(self.host, self._clock[self.host], info.name), "device")
                else:
                    self._allocated(key, compute, _Access(compute, self._clock[compute], info.name), "device")
            if compute is not None and (info.host_sync or (
                    info.name == _COPY_OP and not _non_blocking(args, kwargs) and self._crosses(reads, writes))):
                # The host waits for the value (a blocking copy: NOTE [a blocking torch copy waits for
                # compute]): it knows everything this compute stream did.
                self._issued_by_host(compute)
                self._join(self._knows[self.host], self._snapshot(compute))

    def _crosses(self, reads: list[_Key], writes: list[_Key]) -> bool:
        """NOTE [a blocking torch copy waits for compute]
        ``dst.copy_(src)`` between host and device memory without ``non_blocking`` returns on CUDA only
        once the copy is done: torch synchronizes the issuing thread's current stream after it. So the
        host then knows that stream's work, the copy's read of a device buffer included, and may free
        the buffer (on the CPU backend the copy ran before the op returned, as everything there does).
        The case: the exchange thread of a data-parallel HostAdamW on the plain CPU backend gathers the
        gradients of own-master parameters (compute-allocated) into a host arena buffer, on its own
        compute stream (its collectives gave it one); the job that held the gradients lets go after
        that, and the training thread's next allocation at one of their addresses was taken for a use
        after free of that read, which no event ordered."""
        kinds = {self._buf(key).kind for key in (*reads, *writes)}
        return kinds == {"host", "device"}

    def _collect(self, arg: object, into: list[_Key]) -> None:
        if isinstance(arg, torch.Tensor):
            key = self._key(arg)
            if key is not None:
                into.append(key)
        elif isinstance(arg, (list, tuple)):
            for a in arg:
                if isinstance(a, torch.Tensor):
                    key = self._key(a)
                    if key is not None:
                        into.append(key)

    # threads -----------------------------------------------------------------------------------

    def watch(self) -> None:
        """Watch the calling thread's torch ops from now on (NOTE [stream-order checker]).

        A mode pushed while autograd runs a backward node is gone when the node returns: the engine
        puts back the thread-local state it found (the dispatch stack included). So a thread whose
        first call came inside a backward (a hook of an unwrapped model's HostAdamW) was taken for
        watched for the rest of the run and never checked again; the mode is looked for, and pushed
        again where it is gone. The mode is popped again when the thread ends (NOTE [a watched thread
        ends unwatched])."""
        watched = getattr(self._tls, "watched", None)
        stack_len = torch._C._len_torch_dispatch_stack()
        if watched is not None and any(torch._C._get_dispatch_stack_at(i) is watched.mode for i in range(stack_len)):
            return
        if stack_len != 0:
            return  # another mode is active: pushing under it would break its exit
        mode = _Watch(self)
        _push_mode(mode)
        self._tls.watched = _Watched(mode)

    def unwatch(self) -> None:
        """Stop watching the calling thread (if its dispatch stack has our mode on top)."""
        watched = getattr(self._tls, "watched", None)
        if watched is None:
            return
        self._tls.watched = None
        watched.end()


class _Watched:
    """A watched thread's dispatch mode, held in the checker's thread-local state: :meth:`end` pops it,
    and so does the thread's end.

    NOTE [a watched thread ends unwatched]
    A mode pushed on a thread lives in torch's C++ thread-local dispatch stack, which drops it only
    as the OS thread exits, after Python is done with the thread (``join()`` may have returned): its
    destructor takes the GIL to let go of the mode. A watched thread that ended at exit (a HostAdamW's
    host threads and the copy engines, stopped by their finalizers: NOTE [threads stop at exit] in
    ooc.optim.pipeline) then asked for the GIL while the interpreter finalized, and CPython ended it
    with ``pthread_exit`` inside that C++ destructor: the process died with SIGABRT ("terminate called
    without an active exception") after the tests had passed (a pytest run of eight of the tests/ooc
    files, now and then; 8 exits in 15 of a script whose watched threads end right before it exits).
    So the mode is popped while the thread still runs Python: CPython frees a thread's
    ``threading.local`` values on that thread as it ends, before ``join()`` returns, and this object's
    ``__del__`` pops the mode there. (Freed on another thread, as the interpreter clears a daemon
    thread's state at exit, it does nothing: that thread's stack is not the caller's.)"""

    __slots__ = ("mode", "_thread")
    # Bound now, not looked up in the module when the object goes: the main thread's goes as the
    # interpreter clears its last state, after the module's globals.
    _get_ident = staticmethod(threading.get_ident)
    _stack_len = staticmethod(torch._C._len_torch_dispatch_stack)
    _stack_at = staticmethod(torch._C._get_dispatch_stack_at)
    _pop = staticmethod(torch._C._pop_torch_dispatch_stack)

    def __init__(self, mode: _Watch) -> None:
        self.mode = mode
        self._thread = threading.get_ident()

    def end(self) -> None:
        """Pop the mode, if this is its thread and the mode is on top of its dispatch stack."""
        if self._get_ident() != self._thread:
            return
        stack_len = self._stack_len()
        if stack_len and self._stack_at(stack_len - 1) is self.mode:
            self._pop(None)

    def __del__(self) -> None:
        self.end()


class _Watch(TorchDispatchMode):
    """Stamps every torch op of a watched thread (NOTE [stream-order checker])."""

    def __init__(self, checker: OrderChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run the op, as it would run unwatched, and stamp its accesses.

        NOTE [foreach writes under the checker]
        Under any ``TorchDispatchMode`` (torch 2.13) the in-place foreach ops (``_foreach_mul_``,
        which ``clip_grad_norm_`` scales the gradients with, ``_foreach_zero_``, ...) leave the version
        counters of the tensors they write alone, which they bump when no mode runs. HostAdamW's check
        of gradients changed between the backward and ``step()`` (NOTE [gradients read in the
        backward] in ooc.optim.pipeline) starts from those counters, so on a watched thread a real
        ``clip_grad_norm_`` went through unrefused, where on a GPU (no mode) it is refused: the
        checker bumps them itself, where the op did not."""
        kwargs = kwargs or {}
        info = self.checker.op_info(func)
        written = info.written(args, kwargs) if info.bumps_versions else []
        versions = [t._version for t in written]
        out = func(*args, **kwargs)
        for t, version in zip(written, versions):
            if t._version == version:
                torch.autograd.graph.increment_version(t)
        self.checker.on_op(func, args, kwargs, out)
        return out


_CHECKER: OrderChecker | None = None
_CHECKER_LOCK = threading.Lock()


def checker() -> OrderChecker:
    """The process's checker, made on first use (no import-time state)."""
    global _CHECKER
    with _CHECKER_LOCK:
        if _CHECKER is None:
            _CHECKER = OrderChecker()
        return _CHECKER


def unwatch_thread() -> None:
    """Stop watching the calling thread's ops."""
    if _CHECKER is not None:
        _CHECKER.unwatch()


def reset() -> None:
    """Stop watching the calling thread and forget every stream and buffer seen so far (tests call it
    after each test: a thread that ended with unordered work must not make the next test's
    allocations at the same address look like a use after free)."""
    global _CHECKER
    with _CHECKER_LOCK:
        if _CHECKER is not None:
            _CHECKER.unwatch()
        _CHECKER = None
