"""Versioned, never-torn training checkpoints written in the background, restorable on any number of ranks.

A checkpoint directory holds one folder per version, ``step-000000012/``::

    model.safetensors               the model's weights (rank 0), loadable without ooc
    model.safetensors.index.json    their index (Hugging Face's sharded-checkpoint format)
    optimizer-rank{r}.safetensors   the optimizer state tensors rank r holds (its share when sharded;
                                    unsharded replicas are equal, so only rank 0 writes them)
    state-rank{r}.pt                rank r's LR scheduler, RNG states (CPU and every CUDA device), user
                                    dict, the optimizer's other state and (rank 0) the modules' extra state
                                    (``get_extra_state``) (torch.save; loaded with weights_only)
    manifest-rank{r}.json           rank r's commit record: step, metadata, layout, size and XXH3-64 of
                                    each file, and the index of its optimizer tensors
    .writing.lock                   while the version is written: the file its writers lock (NOTE [folder
                                    locks]); deleted once every rank has committed
    .writing-{token}.owner          while a rank writes the version: its owner record (NOTE [owner records])

and, beside the versions, ``.writer-rank{r}.lock``: while a job writes into the directory, the file
its rank ``r`` locks, so that a second job is refused (NOTE [one job per directory]), and
``.writer-rank{r}.owner``, its owner record, which refuses a job on a host that flock does not reach
(NOTE [owner records]).

NOTE [checksums]
A version's files are checked against their commit record's sizes and checksums before anything is
loaded. The checksum catches a flipped byte, a torn or truncated page, a file from another version:
accidents, not an adversary. So it is XXH3-64 (xxhash's, about 30 GB/s on one core here, computed by
the writer thread over each bounce buffer just filled, or over a tensor's bytes written straight from
its memory, with the GIL released: NOTE [direct writes], NOTE [writes straight from the tensors]),
not a cryptographic hash: sha256 ran at about 1 GB/s on the cores training runs on and was the
writer's largest cost, and zlib's CRC-32 (format 3) at 7 GB/s still cost 0.23 s of CPU per version
of gpt2's 1.53 GiB, which on a machine whose cores the training keeps busy comes out of the steps.
XXH3 passes SMHasher's tests, so a random corruption goes unseen with probability about 2^-64.
Format 3 versions (records with "crc32") are still read and checked with CRC-32, format 2 versions
("sha256") with sha256.

NOTE [resharding]
Optimizer state tensors are named ``{parameter name}.{field}`` (``blocks.0.attn.qkv.weight.exp_avg``),
not by rank: each commit record lists the tensors its rank wrote with their file, dtype, global shape
and the slice the rank held (offsets and shape; ooc's sharded HostAdamW gives each parameter whole to
one rank, so a slice is the whole tensor). A rank restoring from a version saved by any number of
ranks reads the model file, every rank's small state file, and only the optimizer files holding a
slice of a parameter it updates (with a sharded HostAdamW: the parameters it owns now), and
assembles each tensor from its slices. The RNG states are restored on the ranks that existed when
the version was saved; the scheduler and the user dict of a new rank are rank 0's.

A version exists once every rank's commit record is in place. Each record is written last, after
every file it names is complete and fsynced (once, after its last byte) and the folder and its
directory are fsynced (together: the files' names durable too): to a temporary name in the same
folder, fsynced, renamed into place, and the folder fsynced again (the commit durable). So a crash,
``kill -9``, a full disk or an exception at any moment leaves at most an incomplete folder, which
:meth:`Checkpointer.versions` ignores and the next :class:`Checkpointer` on the directory removes;
an incomplete folder another Checkpointer (in this process or another) is still writing is left
alone: its writers hold a lock on it, which dies with their process (NOTE [folder locks]).
Retention (``keep``) deletes older versions only after a newer one is committed, and never the
newest complete one.

In a loop of your own::

    ckpt = Checkpointer("ckpt", model, opt, keep=3)
    start = ckpt.restore().step + 1 if ckpt.latest() else 0   # resume where the last run stopped
    for step in range(start, steps):
        ...  # forward, backward, opt.step()
        ckpt.save(step, loss=loss.item())   # returns once the state is copied; written in the background
    ckpt.close()   # waits for the last version (with several ranks, for every rank's record of it)

``save`` takes a snapshot of the state (after ``optimizer.synchronize()``) and returns; a thread
serializes and writes it. A second ``save`` waits until the previous version is committed (one write
in flight at most, so at most one extra copy of the state in host memory), or with
``if_busy="skip"`` writes nothing (NOTE [skipped saves]). An error of the writer is raised by the
next ``save`` or ``wait``.

NOTE [skipped saves]
A version takes at least its bytes over the disk's bandwidth to write (37 MiB at ~1 GB/s: ~40 ms on
the quick benchmark, whose step takes ~35 ms). A loop saving more often than that waits for the
disk in ``save`` (and, with ``lazy``, its updates copy aside what is not written yet). ``save(step,
if_busy="skip")`` does not wait: while the previous version is being written it writes nothing
for ``step`` and returns False, so a loop that asks for a version every step gets one as
often as the disk allows and can tell which steps have one. Nothing is written later in a skipped
step's place (its state is gone by then); the last save of a run should wait (the default).

NOTE [writer thread]
One writer thread per Checkpointer writes the versions, started by the first ``save`` and waiting
for the next one; it ends after ``_IDLE_SECONDS`` without a save (the next ``save`` starts another)
or at :meth:`Checkpointer.close`. Starting a thread per save cost the training loop up to a GIL
switch interval (5 ms) per save: ``Thread.start`` waits until the new thread runs, and that thread
then holds the GIL while it sets up the write. Handing a job to a waiting thread does not wait.
Saves more than ``_IDLE_SECONDS`` apart pay that start again, a thousandth of the interval at most.
The thread holds its Checkpointer only while it writes a version (a version in flight is written):
a Checkpointer dropped without ``close`` is collected once its last version is written, and its
waiting thread then ends (NOTE [a newer Checkpointer takes over]). The thread is a
daemon, so a process that ends while it writes would lose that version (a script whose last line is
``save``), or abort in the torch code it runs ("terminate called without an active exception": the
interpreter stops daemon threads as they take the GIL back); so at exit each live writer is handed
its stop after the jobs queued and joined (``Checkpointer._finish_at_exit``; a writer holds its
Checkpointer, so every one still writing is alive then). That runs where ``concurrent.futures``
shuts its executors down (``threading._register_atexit``, before plain ``atexit`` callbacks): after
that the write's own I/O pool refuses work, and the version failed ("cannot schedule new futures
after interpreter shutdown").

NOTE [lazy snapshots]
With a :class:`~ooc.optim.HostAdamW` (without ``delayed_update``) the snapshot is lazy, after
DataStates: ``save`` copies only what no bucket holds (buffers, parameters kept on their device,
scheduler, RNG) and keeps references to each bucket's live parameters, masters and moments. A
bucket's host state does not change between the end of its update and its next UPDATE (NOTE [stage
listeners] in ooc.optim.stages), and its EXCHANGE ends, on the thread that then runs the UPDATE,
before that UPDATE starts. So the writer thread writes (and checksums) each tensor straight from the
live one, a slice of ``_SLICE_BYTES`` at a time, and a stage listener on EXCHANGE, before the
bucket's next update may change it, waits for the slice of the bucket being read, if any (copied
into a bounce buffer, or written straight from it until that write returns: NOTE [writes straight
from the tensors]), and copies aside the bucket's tensors not read to their end (the writer reads
on from the copy). With
``max_grad_norm`` a save between a backward and ``step()`` finds buckets past their EXCHANGE whose
UPDATE waits for ``step()`` (``HostAdamW.held_buckets``): no listener call comes before it, so
``save`` copies those buckets' tensors at once. The training thread never waits for a copy of
state no update is about to change, and host memory holds a second copy only of the buckets updated
while their write was pending. Weights loaded into the model (``model.load_state_dict``) change the
live parameters in place outside any update: a hook on the model copies aside every bucket's
unread tensors first, so the version still holds the state at ``save``.

NOTE [live device tensors after the gate]
``save``'s ``optimizer.synchronize()`` waits on the host for the updates, but for their H2D copies
into the parameters it only makes the compute stream wait (the gate): they may still be in flight
when ``save`` returns. The writer thread reads a live device parameter with ``.to("cpu")`` on its own
current stream, the device's default one, which is the training thread's compute stream only when
the training runs there: under ``with torch.cuda.stream(s)`` nothing ordered the read after those
copies, and the version held some weights from before the last update under valid checksums (unless
a device tensor outside the buckets, a persistent buffer, was copied: its event in ``pending``,
recorded after the gate, ordered the writer by chance). So ``save`` records a compute event after
the gate and the writer waits for it on the host before it reads anything (with the copies of
``pending``); the training thread waits for nothing. (A ``save`` outside that ``with`` block gates on
the default stream; the next forward's gate on ``s`` waits for the same copies again: NOTE [a gate
waits on every stream] in ooc.optim.pipeline.) Later stream-ins are another matter: weight
streaming points a streamed parameter's ``.data`` at a fresh device copy for each forward of its
block, ordered after its H2D copy on the training's stream only; the writer read the Parameter
object, so it could read such a copy. So a slot holds the parameter's tensor as it is at ``save``
(``detach()``: a streamed weight's host copy, which only an update changes, after the listener).

NOTE [reused copies aside]
A copy aside into freshly allocated memory ran at 1.8 GiB/s here against 19 GiB/s into memory
touched before: a large allocation is new pages from the kernel, each faulted in and zeroed on first
write, and freed back at once. On gpt2 a version saved every 10 steps had 0.75 GiB copied aside by
the optimizer's thread, 0.4 s of it in page faults. So a version's copies aside are kept, when it is
written, for the next version's updates to copy into (:class:`_AsideBuffers`, matched by dtype and
shape: the same slots come round each version); those the next version does not use are freed when
it is written. The host memory of the copies aside, which a version held only while it was written,
stays held between versions (at most the last version's copies: a version that copies nothing aside
frees them all; :meth:`Checkpointer.close` frees them).

NOTE [recycled files]
On a local file system a new file costs the disk its allocation, and deleting one (mounted with
``discard``) a trim: here a 1.5 GiB version took 0.64 s written into new files against 0.40 s
written over existing ones, and deleting a version 0.22 s more. So retention does not delete the
newest version it retires: it removes the version's commit records and fsyncs the folder (from then
on it is no version, whatever happens next), then renames the folder to ``.spare-<step>``, which
:meth:`Checkpointer.versions` never reads. The next version renames each file it writes out of the
spare and writes over it in place (opened without ``O_TRUNC``, truncated to its size at the end);
its own commit record names only the new bytes and their checksums. Only a file nothing else shares
is taken (:func:`_unshared`): a reader that mapped a retired version's file (safetensors'
``load_file`` does: its tensors are the file's pages), or holds it open, or a hard link to it (a
backup made with ``cp -al``) would see its bytes change under it, where a delete leaves them be;
such a file stays in the spare to be deleted, and its name is written into a new file. A lease
answers for this machine's readers only, so files are reused only on a local file system
(``_LOCAL_FILE_SYSTEMS``: not NFS, Lustre, GPFS or FUSE, where a reader on another host would see the
bytes change; there versions are written into new files as before). A crash while a file is written over leaves it in
the new, uncommitted folder, and the committed versions are untouched. What a spare holds that the
next version did not take is deleted at the next retirement; the first Checkpointer on a directory
and :meth:`Checkpointer.close` delete spares, so between runs the directory holds its versions only
(during a run, one retired version's space more).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import heapq
import io
import json
import mmap
import operator
import os
import queue
import random
import re
import shutil
import signal
import struct
import sys
import threading
import time
import warnings
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import xxhash
from torch import nn

from ooc.distributed import announce, ranks_announced, ranks_not_arrived
from ooc.errors import OocError
from ooc.optim.stages import Stage

FORMAT = 4
READABLE_FORMATS = (2, 3, 4)
"""Format 2: sha256 checksums; format 3: CRC-32; format 4: XXH3-64 (NOTE [checksums])."""
_IDLE_SECONDS = 5.0
"""The writer thread ends after this long without a save (NOTE [writer thread])."""
_VERSION_RE = re.compile(r"^step-(\d{9,})$")
_OTHERS_LAG = 3
"""Versions a rank commits after one still incomplete before it says the other ranks do not save
(NOTE [every rank saves])."""
_CLOSED_GRACE_S = 2.0
"""How long ``close`` still looks for the record of a rank that closed without it in this rank's
folder, before it says so (NOTE [every rank commits where this rank does])."""
_RECORD_POLL_S = 0.05
"""How often ``close`` looks for the other ranks' records and reads the store while it waits."""
_MOVED_ASIDE_RE = re.compile(r"^step-\d{9,}\.damaged-\d+(-\d+)?$")
_SPARE_RE = re.compile(r"^\.spare-(\d{9,})$")
"""A retired version's folder whose files the next version is written over (NOTE [recycled files])."""
MODEL_FILE = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
           torch.complex64: "C64", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
           torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ"}
"""torch dtype -> safetensors dtype name: those of safetensors 0.8 (NOTE [safetensors dtypes])."""


@functools.cache
def _saves_in_safetensors(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` goes into a safetensors file and reads back as itself here.

    NOTE [safetensors dtypes]
    The model and optimizer files are safetensors, which names fewer dtypes than torch has (no
    complex128, complex32 or float8_e8m0fnu; complex64, the unsigned ints and the fnuz float8s only
    from some release on: ooc asks for >= 0.4). A tensor of a dtype it has not failed the write on
    the writer thread, raised by the next ``save`` or ``wait`` after the loop had gone on; ``save``
    refuses it now, before anything is written (:func:`_refuse_dtype`). Whether the installed
    safetensors reads a dtype back is tried once per dtype on a one-element file in the format the
    writer streams (:class:`_TensorFile`)."""
    if dtype not in _DTYPES:
        return False
    probe = torch.zeros(1, dtype=dtype)
    try:
        file = _TensorFile({"t": probe})
        data = file.header() + b"".join(_read_piece(file, name, start) for _, name, start in file.pieces())
        return safetensors.torch.load(data)["t"].dtype == dtype
    except Exception:  # noqa: BLE001 - any refusal of an older safetensors: the dtype is not saved
        return False


def _read_piece(file: _TensorFile, name: str, start: int) -> bytes:
    with file.read(name, start) as piece:
        return bytes(piece)


def _refuse_unsavable(what: str, value: torch.Tensor, file: str) -> None:
    """Raise unless ``value`` can go into the safetensors file ``file`` and, if a model tensor, be
    loaded back by ``load_state_dict``: checked by ``save``, not on the writer thread."""
    if value.layout != torch.strided:
        raise CheckpointError(f"cannot save {what}: it is a {value.layout} tensor, and {file} is a safetensors file, "
                              "which holds dense tensors. Keep it dense in the model (.to_dense()), or keep it out of "
                              "the model's state_dict and the optimizer's state, e.g. in the extra dict (saved with "
                              "torch.save)")
    _refuse_dtype(what, value, file)
    if file == MODEL_FILE:
        _refuse_overlap(what, value)


def _refuse_overlap(what: str, value: torch.Tensor) -> None:
    """Raise if elements of ``value``, a model tensor, share memory (a dimension of stride 0, as
    ``expand`` makes): ``load_state_dict`` cannot copy into it, so no restore could load the version,
    and it would fail having loaded the other weights."""
    if any(stride == 0 and size > 1 for size, stride in zip(value.shape, value.stride())):
        raise CheckpointError(f"cannot save {what}: elements of it share memory (stride {tuple(value.stride())}, an "
                              "expand()ed tensor), and load_state_dict cannot copy into such a tensor, so no restore "
                              "could load the version. Register it with persistent=False if it is derived, or store "
                              "it materialized (.contiguous())")


def _refuse_dtype(what: str, value: torch.Tensor, file: str) -> None:
    """Raise unless ``value`` can go into the safetensors file ``file`` (NOTE [safetensors dtypes])."""
    if _saves_in_safetensors(value.dtype):
        return
    names = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES if _saves_in_safetensors(d))
    raise CheckpointError(
        f"cannot save {what} of dtype {value.dtype}: {file} is a safetensors file, which has no such dtype "
        f"(it holds {names}). Convert it before saving (a complex128 tensor as float64 pairs with "
        "torch.view_as_real, a complex32 one as complex64), or keep it out of the model's state_dict and the "
        "optimizer's state, e.g. in the extra dict (saved with torch.save)")


def _optimizer_file(rank: int) -> str:
    return f"optimizer-rank{rank}.safetensors"


def _state_file(rank: int) -> str:
    return f"state-rank{rank}.pt"


class CheckpointError(OocError, RuntimeError):
    """A checkpoint could not be written or read; the message says which version and file."""


class CorruptCheckpointError(CheckpointError):
    """A file of a committed version does not match its commit record (size or checksum), or cannot
    be parsed. ``restore(fallback=True)`` loads the newest version that is intact instead."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"checkpoint file {path} is corrupt: {reason}. Restore an older version "
                         "(restore(version=...) or restore(fallback=True)) or delete this version's folder")


class UnreadableCheckpointError(CorruptCheckpointError):
    """A file of a committed version could not be read: the file system failed (an I/O error, a
    permission, too many open files), which does not say the version is damaged. It is skipped as a
    damaged one is (``restore(fallback=True)``, listings) but never moved aside or deleted: a
    transient failure must not cost an intact version."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        self.reason = f"cannot be read ({error})"
        CheckpointError.__init__(self, f"checkpoint file {path} cannot be read ({error}): the file system failed, "
                                 "which does not say the version is damaged, and it is kept as it is. Check the "
                                 "disk or the file's permissions and retry, or restore(fallback=True) to load the "
                                 "newest version that can be read")


class NoIntactVersionError(CheckpointError):
    """``restore(fallback=True)`` found every version at or below the one asked for damaged (or
    unreadable); ``errors`` holds each one's :class:`CorruptCheckpointError`, newest first."""

    def __init__(self, directory: Path, errors: list[CorruptCheckpointError]) -> None:
        self.errors = errors
        super().__init__(f"every checkpoint in {directory} is corrupt: " + "; ".join(map(str, errors)))


@dataclass(frozen=True)
class Version:
    """One committed version: its folder, step, the metadata given to ``save`` and its commit records."""

    step: int
    path: Path
    metadata: dict[str, Any]
    created: float
    layout: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(repr=False)
    """File name -> {"bytes": size, "xxh3": 16 hex digits} (format 3: "crc32", format 2: "sha256"), over
    every rank's record (NOTE [checksums])."""
    tensors: dict[str, list[dict[str, Any]]] = field(default_factory=dict, repr=False)
    """Optimizer state tensor name -> its slices over every rank's record: {"file", "param", "field",
    "dtype", "global_shape", "offsets", "shape"} (NOTE [resharding])."""
    format: int = FORMAT

    @property
    def world(self) -> int:
        """The number of ranks that saved this version."""
        return int(self.layout["world"])


def _name(step: int) -> str:
    return f"step-{step:09d}"


def _refusal(directory: Path, step: int, newest: int, *, again: bool = False) -> CheckpointError:
    """The error of a save at ``step`` into ``directory``, whose newest intact version is ``newest``
    (>= ``step``); ``again``: the refusing Checkpointer itself saved that version, its last.

    NOTE [saves go forward]
    Retention keeps the newest versions by step and a resume loads the newest one: a version saved
    below the newest was retired by its own commit's retention, though ``save`` had returned True,
    or if kept was never resumed from. So ``save`` refuses a step at or below the newest intact
    version before anything is written (at an intact version's own step the writer used to refuse
    it, raised by the next ``save``). Versions known to be damaged do not count, and the save moves
    them aside (NOTE [damaged versions moved aside]): those whose commit record is damaged, and
    those whose files a ``restore(fallback=True)`` found damaged (listings read only the records).
    The check is a comparison: the Checkpointer reads the directory when it takes the directory's
    lock (its first save: NOTE [one job per directory]; rank 0 also at its cleanup, and each
    restore) and takes each of its own commits as the newest since: no other job writes there
    while it holds the lock. (Where the file system has no flock, another job's commits go unseen;
    at the same step the writer still refuses to replace a commit.)"""
    # A framework's hook can run more than once at one step, and the advice to branch misled there:
    # Lightning calls on_save_checkpoint once per file its ModelCheckpoint callbacks write (two at a
    # step with save_last=True), and on_train_batch_end once per micro-batch under accumulate_grad_batches.
    if again and step == newest:
        return CheckpointError(
            f"version {directory / _name(step)} is already committed: save({step}) was called again at the step of "
            "this Checkpointer's last version; save once per optimizer step. A framework's hook can run several "
            "times at one step (Lightning's on_save_checkpoint once per file its ModelCheckpoint callbacks write, two with save_last=True; its "
            "on_train_batch_end once per micro-batch under accumulate_grad_batches, trainer.global_step unchanged): "
            "skip a save at the step you saved last (`if step != last: ckpt.save(step); last = step`)")
    advice = ("to branch from an older version, restore it and save into a new directory (Checkpointer(new_dir, "
              f"...), ooc train --save NEW_DIR), or remove the versions from step {step} on from {directory}")
    if step == newest:
        return CheckpointError(f"version {directory / _name(step)} is already committed; {advice}. A damaged "
                               "version is moved aside by the next save once restore(fallback=True) has skipped it")
    return CheckpointError(f"step {step} is below the newest version (step {newest}) in {directory}: retention keeps "
                           f"the newest versions by step and a resume loads the newest, so it would be lost; {advice}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(*paths: Path) -> None:
    """fsync the folders ``paths`` at once: one after another, each waits for a journal commit of its
    own (~4 ms here); issued together, the file system commits them together."""
    errors: list[BaseException] = []

    def sync(path: Path) -> None:
        try:
            _fsync_dir(path)
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=sync, args=(path,), name="ooc-checkpoint-fsync") for path in paths[1:]]
    for thread in threads:
        thread.start()
    sync(paths[0])
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


_WRITEBACK_BYTES = 4 << 20
"""Without direct I/O: start the disk writing every this many bytes written (see _write_file)."""
_BOUNCE_BYTES = 4 << 20
"""The bounce buffer's size: bytes per direct write (a multiple of _ALIGN; NOTE [direct writes])."""
_ALIGN = 4096
"""Direct I/O's alignment of memory, file offsets and lengths: the logical block size of any disk
(512 or 4096 bytes) divides it, and an anonymous mmap is page-aligned."""
_bounce = threading.local()
"""Each writer thread's free bounce buffers (mmaps; freed with the thread): two per file being written."""


def _take_bounce_buffers() -> list[np.ndarray]:
    """Two bounce buffers of _BOUNCE_BYTES for one file, kept from an earlier file if there are."""
    free = [b for b in getattr(_bounce, "free", []) if len(b) == _BOUNCE_BYTES]
    _bounce.free = free[2:]
    return free[:2] + [np.frombuffer(mmap.mmap(-1, _BOUNCE_BYTES), np.uint8) for _ in range(2 - len(free[:2]))]


def _give_back_bounce_buffers(buffers: list[np.ndarray]) -> None:
    _bounce.free = [*getattr(_bounce, "free", []), *buffers]


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path``: a write or fsync on a file descriptor fails naming no file."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return type(exc)(exc.errno, exc.strerror, str(path))


class _Sink:
    """A file opened for writing from aligned buffers: with ``O_DIRECT`` unless the file system
    refuses it (NOTE [direct writes])."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.direct = hasattr(os, "O_DIRECT")
        try:
            # Not O_TRUNC: a recycled file is written over in its blocks (NOTE [recycled files]);
            # _write_file truncates it to what it wrote.
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            self.direct = False
        self.written = self.advised = 0
        self.failed: OSError | None = None
        """The error of a write: the writes queued after it write nothing (the file is doomed)."""

    def write(self, data: memoryview) -> None:
        """Append ``data`` (a multiple of the direct writes' alignment, or the file's end)."""
        if self.failed is not None:
            raise self.failed
        try:
            self._write(data)
        except OSError as exc:
            self.failed = _naming(exc, self.path)
            raise self.failed from None

    def _write(self, data: memoryview) -> None:
        view = data
        while view:
            try:
                done = os.write(self.fd, view)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # the file system refuses direct writes: write through the page cache
                continue
            view = view[done:]
            self.written += done
            if view and self.direct and done % _ALIGN:
                self._buffered()  # a short write (a full disk) left the rest unaligned; its error comes next
        if not self.direct and self.written - self.advised >= _WRITEBACK_BYTES and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.advised, self.written - self.advised, os.POSIX_FADV_DONTNEED)
            self.advised = self.written

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False


_DIRECT_MIN_BYTES = 256 << 10
"""A piece's run of bytes written straight from its memory must be at least this long: shorter
runs go through the bounce buffer (a syscall of its own for a few bytes costs more than their copy)."""
_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000


@functools.cache
def _statx() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # not glibc >= 2.28, or not Linux
        return None


def _dio_alignment(fd: int) -> tuple[int, int]:
    """The (memory, file offset) alignment that direct I/O on ``fd``'s file needs: Linux's ``statx``
    with ``STATX_DIOALIGN`` (6.1 on: ext4, xfs, f2fs, btrfs; here 512 and 512, the virtio disk's DMA
    alignment and logical block), else ``_ALIGN`` for both, which every disk's divides."""
    statx = _statx()
    out = ctypes.create_string_buffer(256)  # struct statx
    if statx is None or statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, out) != 0:
        return _ALIGN, _ALIGN
    (mask,) = struct.unpack_from("<I", out, 0)
    memory, offset = struct.unpack_from("<II", out, 0x98)  # stx_dio_mem_align, stx_dio_offset_align
    if not mask & _STATX_DIOALIGN or not memory or not offset or offset > _ALIGN:
        return _ALIGN, _ALIGN
    return memory, offset


def _direct_span(address: int, position: int, size: int, alignment: tuple[int, int]) -> tuple[int, int]:
    """The bytes ``[head, stop)`` of ``size`` bytes at memory ``address``, written at file offset
    ``position``, that a direct write can take straight from memory (NOTE [writes straight from
    the tensors]); ``(size, size)`` if none are worth it. ``head`` is the first byte at which both
    the memory and the file offset are aligned, and ``stop - head`` a multiple of the offset's
    alignment; the memory and the file offset advance together, so they can both be aligned only
    if they agree modulo the smaller alignment."""
    memory, offset = alignment
    if (address - position) % min(memory, offset):
        return size, size
    head = -(address if memory >= offset else position) % max(memory, offset)
    stop = head + max(size - head, 0) // offset * offset
    return (head, stop) if stop - head >= _DIRECT_MIN_BYTES else (size, size)


def _write_then(sink: _Sink, data: memoryview, release: Callable[[], None]) -> None:
    """On the I/O thread: write ``data``, read straight from a piece's memory, then let go of the piece."""
    try:
        sink.write(data)
    finally:
        release()


class _FileWriter:
    """A file being written: its chunks, fed one after another, go to the disk through two
    page-aligned bounce buffers, or straight from their memory where direct I/O can take it;
    :meth:`finish` fsyncs it and returns its size and XXH3-64 (NOTE [checksums]).

    NOTE [direct writes]
    The chunks are copied into one of two page-aligned bounce buffers (numpy's copy, without the
    GIL), checksummed there while it is in the cache, and each full buffer is written with
    ``O_DIRECT`` by an I/O thread while this one fills the other: from the buffer to the disk,
    without the kernel's copy into the page cache and its writeback later (what cost the writer most
    of its CPU time per version: 2.3 s for gpt2's 1.53 GiB, 0.5 s without; a version's bytes are
    read again only by a restore), and the disk busy while the next buffer is copied. The last buffer
    is padded to ``_ALIGN`` and the file truncated to its size. The fsync at the end still makes the
    file's size and blocks durable (and flushes the disk's cache). Where the file system refuses
    direct I/O (tmpfs, some network file systems: at open or at a write), the same buffers are
    written through the page cache, and every ``_WRITEBACK_BYTES`` the bytes written since are handed
    to the disk at once (``POSIX_FADV_DONTNEED`` starts their writeback without waiting) so that the
    fsync waits for the tail only. Everything is the same after the fsync either way.

    NOTE [writes straight from the tensors]
    The copy into the bounce buffer was the writer's largest CPU cost left (55 of 94 ms of its
    thread per version of a 100M-parameter state, 1.2 GB). Direct I/O can read a chunk's own
    memory where its address and its file offset are aligned as the file's disk needs
    (:func:`_dio_alignment`) and agree (:func:`_direct_span`): then the bytes up to the first such
    point are copied into the bounce buffer, which is written up to there, and the aligned run
    goes to the disk from the chunk itself, checksummed in place (from memory, not the cache: 2.3x
    the checksum's time, still 40% of the copy's). The chunk is a piece of a live tensor the
    snapshot holds immutable (NOTE [lazy snapshots]) from before its checksum until that write has
    returned (``release``, called by the I/O thread), so the disk gets the bytes checksummed. A
    bucket's next update that finds the piece held waits for that write (a few ms) where it waited
    for a copy (NOTE [write order] makes that rare). Live tensors are where the allocator put them
    (glibc: 64 bytes past a page for large ones), so each safetensors header is padded with spaces,
    as the format allows, to put the data where most bytes agree (:meth:`_TensorFile.header`)."""

    def __init__(self, path: Path, io: ThreadPoolExecutor) -> None:
        self._sink = _Sink(path)
        self._io = io
        """The I/O thread: writes one buffer (or a chunk's run) while this thread fills the other."""
        self.alignment = _dio_alignment(self._sink.fd) if self._sink.direct else (1, 1)
        """(memory, file offset) alignment of direct writes to this file; (1, 1): buffered writes,
        which take any memory (the kernel's copy into the page cache is the bounce copy's stead)."""
        self._buffers: list[np.ndarray] = []
        self._buffer_writes: list[Future[None] | None] = [None, None]
        """The write of each bounce buffer in flight, if any: waited for before it is filled again."""
        self._writes: deque[Future[None]] = deque()
        """The writes handed to the I/O thread and not yet seen done, in order."""
        self._digest = xxhash.xxh3_64()
        self._size = self._filled = self._current = 0
        """Bytes checksummed and handed to the I/O thread; bytes in the current bounce buffer; which one."""

    def feed(self, chunk: bytes | memoryview, release: Callable[[], None] | None = None) -> None:
        """Append ``chunk``. ``release`` (called once, from any thread) lets go of it: once it has
        been copied, or written straight from its memory (NOTE [writes straight from the tensors]);
        without one, it is copied before this returns."""
        source = np.frombuffer(chunk, np.uint8)
        try:
            head = stop = len(source)
            if release is not None:
                head, stop = _direct_span(source.ctypes.data if len(source) else 0, self._size + self._filled,
                                          len(source), self.alignment)
            self._copy(source[:head])
            if stop > head:
                self._flush()  # the bytes before the run, up to an aligned offset
                run = source[head:stop]
                self._digest.update(run)  # releases the GIL
                self._size += len(run)
                self._copy(source[stop:])  # less than one block: the buffer holds it, nothing is written
                self._submit(_write_then, self._sink, memoryview(run), release)
                release = None  # the I/O thread's now
        finally:
            if release is not None:
                release()

    def _copy(self, source: np.ndarray) -> None:
        at = 0
        while at < len(source):
            buffer = self._buffer()
            n = min(len(source) - at, _BOUNCE_BYTES - self._filled)
            buffer[self._filled:self._filled + n] = source[at:at + n]
            self._filled += n
            at += n
            if self._filled == _BOUNCE_BYTES:
                self._flush()

    def _buffer(self) -> np.ndarray:
        """The current bounce buffer, its previous write done if it is empty."""
        if not self._buffers:
            self._buffers = _take_bounce_buffers()
        pending = self._buffer_writes[self._current]
        if not self._filled and pending is not None:
            self._buffer_writes[self._current] = None
            pending.result()  # raises its error
        return self._buffers[self._current]

    def _flush(self, padding: int = 0) -> None:
        """Checksum the current buffer's bytes, hand them (and ``padding`` zeros) to the I/O thread
        and go on in the other buffer."""
        if not self._filled:
            return
        buffer = self._buffers[self._current]
        self._digest.update(buffer[:self._filled])  # in the cache still; releases the GIL
        self._size += self._filled
        buffer[self._filled:self._filled + padding] = 0
        self._buffer_writes[self._current] = self._submit(self._sink.write, memoryview(buffer[:self._filled + padding]))
        self._current, self._filled = 1 - self._current, 0

    def _submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        """Hand a write to the I/O thread, once at most one other is queued (the writes are few:
        their buffers and held pieces too)."""
        while len(self._writes) > 1:
            self._writes.popleft().result()  # raises its error
        future = self._io.submit(fn, *args)
        self._writes.append(future)
        return future

    def finish(self) -> tuple[int, str]:
        """Write the last buffer, fsync the file; return its size and XXH3-64 as 16 hex digits."""
        if self._filled:
            # Direct I/O writes whole blocks: the last one padded with zeros, cut off below.
            self._flush(padding=-self._filled % _ALIGN if self._sink.direct else 0)
        while self._writes:
            self._writes.popleft().result()  # raises its error
        fd = self._sink.fd
        try:
            if os.fstat(fd).st_size != self._size:
                os.ftruncate(fd, self._size)  # the padding of the last block, or a longer recycled file's tail
            os.fsync(fd)  # a full disk may say so only here (delayed allocation)
        except OSError as exc:
            raise _naming(exc, self._sink.path) from None
        return self._size, self._digest.hexdigest()

    def close(self) -> None:
        """Close the file (finished or not) once no write of it is in flight, and give the buffers
        back for the next file."""
        try:
            concurrent.futures.wait(self._writes)  # their errors, if any, were raised or are moot now
        finally:
            self._writes.clear()
            os.close(self._sink.fd)
            _give_back_bounce_buffers(self._buffers)
            self._buffers = []


def _write_file(path: Path, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
    """Write ``chunks`` one after another to ``path`` and fsync it; return its size and XXH3-64 as
    16 hex digits (NOTE [direct writes]; tests replace this to simulate a full disk)."""
    with ThreadPoolExecutor(1, thread_name_prefix="ooc-checkpoint-io") as io:
        writer = _FileWriter(path, io)
        try:
            for chunk in chunks:
                writer.feed(chunk)
            return writer.finish()
        finally:
            writer.close()


_LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "zfs", "jfs", "bcachefs"})
"""File systems whose readers are all on this host, so a lease sees every one (NOTE [recycled files])."""


def _file_system(directory: Path) -> str | None:
    """The type of the file system ``directory`` is on (Linux's mount table), or None if unknown."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = str(directory.resolve()), -1, None
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best:
            best, kind = len(mount), fields[fields.index("-") + 1]
    return kind


def _unshared(path: Path) -> bool:
    """Whether ``path`` (a spare's file) may be written over in place (NOTE [recycled files]): this
    process may write it, it is no symbolic link and has no other link, and no process holds it open or mapped. Linux grants a
    write lease only then; where leases are not to be had (another OS, a network file system), no."""
    if not hasattr(fcntl, "F_SETLEASE"):
        return False
    try:
        # O_NOFOLLOW: a symbolic link (into a data-versioning tool's cache) would be written through.
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone (another rank's cleanup), a symbolic link, or not ours to write
    try:
        if os.fstat(fd).st_nlink != 1:
            return False
        # A process opening the file while the lease is held would have it broken, which signals
        # the holder (SIGIO by default, which ends a process): SIGURG's default is to do nothing.
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False  # EAGAIN: open or mapped elsewhere; EINVAL: no leases here
    finally:
        os.close(fd)


_LOCK_FILE = ".writing.lock"
"""The file in a version's folder its writers hold a lock on (NOTE [folder locks])."""
_REMOVING_RE = re.compile(r"^\.removing-step-\d{9,}-[0-9a-f]+$")
"""An incomplete folder a cleanup moved out of the way to delete it (NOTE [folder locks])."""
_NO_FLOCK = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP})
"""flock's errors where the file system has no locks (Lustre without ``-o flock``, some FUSE)."""
_LOCK_TRIES = 100
"""Times a writer makes its folder again after a cleanup moved it away (NOTE [folder locks])."""


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


_HEARTBEAT_SECONDS = 5.0
"""How often this process refreshes the heartbeat of the owner records it holds (NOTE [owner records])."""
_STALE_SECONDS = 60.0
"""How long after its last heartbeat an owner record of another host counts as a dead holder's (NOTE
[owner records]): many heartbeats, and more than the few seconds NTP lets clocks disagree."""
_OWNER_RE = re.compile(r"^\.writer-rank\d+\.owner$")
"""The owner record beside a rank's directory lock file (NOTE [owner records])."""
_OWNER_LEFTOVER_RE = re.compile(r"^\.writer-rank\d+\.owner\.[0-9a-f]+\.(tmp|dead)$")
"""A record being made, or a dead holder's being dropped: left by a crash right then (NOTE [owner records])."""
_WRITING_OWNER = ".writing-{token}.owner"
"""A writing rank's owner record in a version's folder (NOTE [owner records])."""


def _kernel() -> tuple[str, str]:
    """This machine's host name and boot id (new at each boot): whose processes and flocks this
    process sees (NOTE [owner records])."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return os.uname().nodename, boot


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot), which tells it from a later process
    given its pid; None if there is no such process here, or it is a zombie (killed, not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # from the third field on: state, ..., starttime (22nd)
    return None if fields[0] in ("Z", "X") else fields[19]


@dataclass(frozen=True)
class _Holder:
    """What an owner record says of its holder, and how long ago its heartbeat came (NOTE [owner records])."""

    host: str
    boot: str
    pid: int
    started: str | None
    token: str | None
    age: float
    identity: tuple[int, int]

    def __str__(self) -> str:
        if self.token is None and self.pid == 0:  # _read_holder's damaged record
            # It said "pid 0 on an unknown host", which reads as a job to go and stop.
            return ("a job that its damaged owner record does not name (the record is empty or garbled, as a crash "
                    "of its host can leave it: if no job writes here, delete the record)")
        return f"pid {self.pid} on {self.host}"

    def live(self, *, flocked: bool = False) -> bool:
        """Whether the holder may still write: a process of this kernel while it runs; another
        host's until its heartbeat is ``_STALE_SECONDS`` old. ``flocked``: the caller holds the
        flock that every writer of this kernel would hold too, so a record of this kernel is a dead
        holder's (one whose release failed: a file system gone read-only)."""
        if (self.host, self.boot) == _kernel():
            if flocked:
                return False
            if self.started is None:  # no /proc where it was made: by the pid alone
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    return False
                except PermissionError:
                    pass
                return True
            return _process_start(self.pid) == self.started
        return self.age < _STALE_SECONDS


def _read_holder(path: Path) -> _Holder | None:
    """The holder of the owner record at ``path``; None if there is none. A damaged record's holder
    is known by its heartbeat only."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)  # after an open: a network file system's attributes as its server has them
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        fields = json.loads(raw)
        holder = (str(fields["host"]), str(fields["boot"]), int(fields["pid"]), fields["started"], str(fields["token"]))
    except (ValueError, KeyError, TypeError):
        holder = ("an unknown host", "", 0, None, None)
    return _Holder(*holder, age=time.time() - st.st_mtime, identity=(st.st_dev, st.st_ino))


class _OwnerRecord:
    """An owner record this process holds, and refreshes the heartbeat of, until :meth:`release`.

    NOTE [owner records]
    flock excludes writers only as far as the file system carries it: NFS mounted with
    ``local_lock=flock`` or ``all``, Lustre with ``-o localflock`` and some FUSE and GPFS set-ups
    keep flocks on the host that took them. A job on another host then took ``.writer-rank{r}.lock``
    too and wrote the same versions, and its first cleanup moved away the folder of the version the
    first job was writing (its ``.writing.lock`` was free, as far as that host could see). So
    beside each flock a writer holds a second guard that needs no lock: an owner record, a small
    JSON file naming its host, boot id, pid, the pid's start time and a random token, made with
    ``link()`` from a temporary file (whole when it appears; ``link`` fails if the name is taken,
    on NFS too, where ``O_EXCL`` did not always hold; without hard links, with ``O_EXCL``:
    :func:`_made_whole`), and its mtime the heartbeat: a daemon thread of this process touches
    every record it holds each ``_HEARTBEAT_SECONDS`` (``utime`` of the open file: the kernel's
    time, or on NFS the server's, so that readers compare with one clock; so clocks must agree
    within seconds, as NTP keeps them, and an mtime ahead of the reader's clock is fresh).
    ``.writer-rank{r}.owner`` beside the directory lock (NOTE [one job per directory]) and
    ``.writing-{token}.owner`` per rank in the folder of the version it writes (NOTE [folder locks]).

    A reader of a record judges its holder (:meth:`_Holder.live`): another host's by its heartbeat,
    live until it is ``_STALE_SECONDS`` old (its process killed, its host crashed, or the process
    stopped that long); a process of this kernel (host name and boot id alike) by the flock where
    the reader holds it (every writer of this kernel would hold it too: a record of this kernel is
    then a dead holder's, one whose release failed on a file system gone read-only), else by its
    pid and start time (dead at once after a ``kill -9``, whatever the heartbeat; containers of one
    host name and kernel are taken to share their pids). The flock stays the first guard; the
    record is checked once the flock is taken (or where there is no flock at all). A directory
    whose record's holder is live is refused, naming its host and pid; a dead holder's record is
    taken over (:func:`_drop_dead_record`: renamed away, checked to be the record judged dead,
    else put back, as another taker may have replaced it meanwhile), and rank 0 then cleans the
    directory again: the dead job's incomplete folders, left by its cleanup at construction while
    the job looked live. A cleanup leaves an incomplete folder that holds a live writer's record,
    and a rank's lock file whose record is live; it deletes a dead holder's record, and a record's
    temporary file once it is ``_STALE_SECONDS`` old (a crash while one was made or dropped).

    A holder checks, before each version it writes and before retention deletes, that the record at
    its path is still its own (:meth:`ours`); if a job on another host took it over (this process
    stopped past ``_STALE_SECONDS``: suspended, or its heartbeat thread starved), the save fails
    saying so, and nothing is deleted. The remaining window, a version begun just before the check
    while another host takes over, ends at worst in a failed write, as another job's cleanup moves
    its folder away before the commit: the versions before it stay loadable."""

    def __init__(self, path: Path, fd: int, token: str) -> None:
        self.path = path
        self._fd: int | None = fd
        self.token = token
        self._pid = os.getpid()
        self.took_over = False
        """Whether :meth:`claim` took it over from a dead holder."""

    @classmethod
    def make(cls, path: Path) -> _OwnerRecord | None:
        """Make the record at ``path`` and keep its heartbeat, or return None if one is there."""
        token = os.urandom(8).hex()
        host, boot = _kernel()
        fd = _made_whole(path, json.dumps({"host": host, "boot": boot, "pid": os.getpid(), "token": token,
                                           "started": _process_start(os.getpid())}).encode())
        if fd is None:
            return None
        record = cls(path, fd, token)
        _beat(record)
        return record

    @classmethod
    def claim(cls, path: Path, refusal: Callable[[_Holder], BaseException], *, flocked: bool) -> _OwnerRecord:
        """Make the record at ``path``, taking over a dead holder's; raise ``refusal(holder)`` if a
        live one holds it (``flocked``: as :meth:`_Holder.live`)."""
        took_over = False
        for _ in range(_LOCK_TRIES):
            record = cls.make(path)
            if record is not None:
                record.took_over = took_over
                return record
            holder = _read_holder(path)
            if holder is None:
                continue  # released meanwhile
            if holder.live(flocked=flocked):
                raise refusal(holder)
            _drop_dead_record(path, holder)
            took_over = True
        raise CheckpointError(f"could not make {path}: others kept making it {_LOCK_TRIES} times; is another "
                              "program writing the checkpoint directory's files?")

    def ours(self) -> bool:
        """Whether the record at the path is still this one (not taken over by another host)."""
        for _ in range(2):  # a taker that renamed it away to check it puts it back at once
            if self._fd is not None and _same_file(self._fd, self.path):
                return True
            time.sleep(0.05)
        return False

    def beat(self) -> None:
        """Refresh the heartbeat (under ``_BEATING_LOCK``, which :meth:`release` takes to close the
        file: a number reused by another file is never touched)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):  # a network file system's error: the next beat
                os.utime(self._fd)

    def release(self) -> None:
        """Stop the heartbeat and delete the record, if it is still this one (again: nothing; in a
        forked child, only close it: the record is the parent's)."""
        if _LOCK_OWNER[0] == threading.get_ident():
            # A finalizer (a dropped Checkpointer's lock) that the garbage collector ran on a thread
            # holding the lock, inside the heartbeat's beats or _beat: waiting for it would wait for
            # itself (NOTE [a release while the lock is held]).
            _RELEASE_LATER.append(self)
            _BEAT.set()
            return
        with _holding_beating_lock():
            _BEATING.discard(self)
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.getpid() == self._pid and _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a file system gone read-only: the record of a dead holder from now on, for a cleanup
        finally:
            os.close(fd)


_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS})
"""link()'s errors where the file system has no hard links (vfat, exFAT, FUSE file systems such as s3fs)."""


def _made_whole(path: Path, data: bytes) -> int | None:
    """Make the file ``path`` holding ``data`` and return it open, or None if the name is taken: with
    ``link()`` from a temporary file, so that it is whole when it appears; where the file system has
    no hard links, with ``O_EXCL`` (a reader may find it empty a moment: a damaged record, judged by
    its heartbeat, fresh)."""
    tmp = path.with_name(f".{path.name.lstrip('.')}.{os.urandom(8).hex()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.link(tmp, path)
        return fd
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, FileExistsError):
            return None
        if exc.errno not in _NO_LINKS:
            raise
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):  # a file system gone read-only: the caller's error is the one
            tmp.unlink(missing_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return None
    os.write(fd, data)
    return fd


def _drop_dead_record(path: Path, holder: _Holder) -> None:
    """Remove the record at ``path`` judged to be ``holder``'s, a dead one, unless another taker has
    replaced it since it was read (NOTE [owner records])."""
    aside = path.with_name(f".{path.name.lstrip('.')}.{os.urandom(4).hex()}.dead")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another taker's doing
    moved = _read_holder(aside)
    if moved is not None and (moved.identity, moved.token) != (holder.identity, holder.token):
        # A live taker's record, made since: put back. (Where that fails, a third taker's record is
        # there, or the file system has no hard links: the taker finds its record gone and its next
        # save fails, saying so, rather than two jobs writing.)
        with contextlib.suppress(OSError):
            os.link(aside, path)
    aside.unlink(missing_ok=True)


def _live_holder(path: Path, *, flocked: bool) -> _Holder | None:
    """The holder of the record at ``path`` if it is live (``flocked``: as :meth:`_Holder.live`), else None."""
    holder = _read_holder(path)
    return holder if holder is not None and holder.live(flocked=flocked) else None


def _written_elsewhere(folder: Path, *, flocked: bool) -> _Holder | None:
    """A live writer of ``folder`` by its owner records (NOTE [owner records]), or None."""
    for path in folder.glob(_WRITING_OWNER.format(token="*")):
        holder = _live_holder(path, flocked=flocked)
        if holder is not None:
            return holder
    return None


_BEATING: set[_OwnerRecord] = set()
"""The owner records this process holds, whose heartbeat its thread refreshes."""
_BEATING_LOCK = threading.Lock()
_LOCK_OWNER: list[int | None] = [None]
"""The thread holding ``_BEATING_LOCK`` (``_holding_beating_lock``), else None."""
_RELEASE_LATER: deque[_OwnerRecord] = deque()
"""Records released where the releasing thread held ``_BEATING_LOCK``: the heartbeat thread releases
them after its beats (NOTE [a release while the lock is held])."""
_BEAT = threading.Event()
"""Set to refresh at once (a record added; a test's shorter ``_HEARTBEAT_SECONDS``)."""
_beating_thread: threading.Thread | None = None


@contextlib.contextmanager
def _holding_beating_lock() -> Iterator[None]:
    """``_BEATING_LOCK``, with the holder's thread noted in ``_LOCK_OWNER``.

    NOTE [a release while the lock is held]
    A Checkpointer dropped without ``close`` lets go of its locks from a ``weakref.finalize``, which
    the garbage collector runs on whatever thread allocates next: once, inside the heartbeat thread's
    beats, which hold this lock, so that the record's ``release`` waited for the lock its own thread
    held. The heartbeat thread hung, and with it every thread that next took the lock: the writer
    committing a version, and ``wait()`` behind it (a test's whole worker, in CI). A plain lock cannot
    be taken again by its holder, and a reentrant one would let the release close a file the beat is
    touching, or change the set the beats iterate over. So a release on the thread that holds the
    lock does nothing but hand the record to the heartbeat thread, which releases it after its beats,
    at once (the event wakes it); a dropped holder's record lasts that much longer."""
    with _BEATING_LOCK:
        _LOCK_OWNER[0] = threading.get_ident()
        try:
            yield
        finally:
            _LOCK_OWNER[0] = None


def _beat(record: _OwnerRecord) -> None:
    """Keep ``record``'s heartbeat until it is released, starting the heartbeat thread if need be."""
    global _beating_thread
    with _holding_beating_lock():
        _BEATING.add(record)
        if _beating_thread is None or not _beating_thread.is_alive():
            _beating_thread = threading.Thread(target=_heartbeats, name="ooc-checkpoint-heartbeat", daemon=True)
            _beating_thread.start()
    _BEAT.set()


def _heartbeats() -> None:
    """The heartbeat thread: touch every record held, each ``_HEARTBEAT_SECONDS``, for the process's life."""
    while True:
        _BEAT.wait(_HEARTBEAT_SECONDS)
        _BEAT.clear()
        with _holding_beating_lock():
            for record in _BEATING:
                record.beat()
        while _RELEASE_LATER:  # NOTE [a release while the lock is held]
            _RELEASE_LATER.popleft().release()


def _forget_heartbeats_in_child() -> None:
    """A forked child holds no records (its parent's heartbeat is the parent's) and no thread; its
    lock may have been held by the parent's thread when it forked."""
    global _beating_thread, _BEATING_LOCK, _BEAT
    _BEATING.clear()
    _RELEASE_LATER.clear()
    _BEATING_LOCK, _BEAT = threading.Lock(), threading.Event()
    _LOCK_OWNER[0] = None
    _beating_thread = None


os.register_at_fork(after_in_child=_forget_heartbeats_in_child)


class _FolderLock:
    """A rank's shared lock on the version folder it writes into (NOTE [folder locks]).

    NOTE [folder locks]
    A new Checkpointer (rank 0) removes the incomplete folders a crash left, and retention those
    older than the newest version; but another Checkpointer on the directory, in another process
    (``ooc train --resume DIR`` pointed at a live run's directory) or in this one, may be writing
    such a folder right then. So each rank writing a version holds ``flock(LOCK_SH)`` on the
    folder's ``.writing.lock`` (shared: the ranks write one folder), from before its first file
    until its commit, and with several ranks until it sees the version complete (its next write or
    :meth:`Checkpointer.close` looks): so a slower rank's folder is never unlocked between a faster
    one's commit and its own first lock. A newer version complete also ends the hold: each rank
    finishes a version before its next save, so no rank writes the older one any more (one that
    failed on a rank is retention's to remove). A cleanup removes an incomplete folder only if it takes
    ``LOCK_EX | LOCK_NB`` on that file; one whose lock it cannot take is being written and stays.
    The kernel drops a flock with the last descriptor of its open file description: a writer killed
    (``kill -9``) holds none, and the next Checkpointer removes its folder. The lock belongs to the
    open file description, not to the process (as POSIX ``fcntl`` locks would): two Checkpointers in
    one process each open the file, and exclude each other as two processes do.

    The race: a writer makes the folder, then opens and locks the file; a cleanup may take the lock
    in between (or make the file itself, for a crash's folder that has none). So the cleanup,
    holding the lock exclusively, checks that the file it holds is still the folder's and the folder
    still incomplete (its writers may have committed it since it was listed), renames the folder to ``.removing-<name>-<random>`` (atomic: the name is free
    from then on), lets go of the lock and deletes the renamed folder. The writer, once it holds its
    lock (it waits out a cleanup's, a rename long), checks that the file it locked is still the
    folder's ``.writing.lock`` (the same inode); if not, the folder was moved away before or while
    it waited, and it makes the folder again. Deleting in place instead of renaming would leave a
    window: once the cleanup had unlinked the lock file, a writer could make a new one in the
    folder being deleted, lock it, pass its check and lose its files to the rest of the deletion.

    Readers never see the lock file: versions, restores, ``export`` and ``ooc checkpoints list`` go
    by the commit records. The rank whose commit completes the version deletes it, still holding its
    lock; a crash between the commit and that, or a rank that does not see the others' records yet
    (a network file system's cache), leaves it in a committed version, where the next cleanup
    deletes it (and a retired version's goes with its spare). A process forked while a version is
    written (a DataLoader's workers) shares the open file description, so the folder stays locked
    until the child exits too. Ranks on other hosts see each other's locks where flock reaches
    across hosts (NFS emulates it with byte-range locks; Lustre with ``-o flock``). Where it does
    not (flock local to each host), or the file system has no flock (``_NO_FLOCK``: versions are
    written unlocked), each writing rank's owner record in the folder, made once it holds the lock,
    keeps a cleanup from removing the folder while its heartbeat is fresh (NOTE [owner records])."""

    def __init__(self, folder: Path, fd: int | None, record: _OwnerRecord) -> None:
        self.folder = folder
        self._fd = fd
        self._record = record

    def __del__(self) -> None:
        self._record.release()  # a Checkpointer dropped without close() while holding it
        if self._fd is not None:
            os.close(self._fd)

    @classmethod
    def writing(cls, folder: Path) -> _FolderLock:
        """Make ``folder`` if need be and hold its lock shared, to write into it."""
        for _ in range(_LOCK_TRIES):
            folder.mkdir(exist_ok=True)
            try:
                fd = os.open(folder / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                continue  # a cleanup moved the folder away since the mkdir: make it again
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a cleanup holding it exclusively
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _NO_FLOCK:
                    raise
                fd = None
            try:
                record = _OwnerRecord.make(folder / _WRITING_OWNER.format(token=os.urandom(8).hex()))
            except FileNotFoundError:
                record = None  # the folder was moved away meanwhile
            if record is not None and (fd is None or _same_file(fd, folder / _LOCK_FILE)):
                return cls(folder, fd, record)
            if record is not None:
                record.release()
            if fd is not None:
                os.close(fd)  # the folder was moved away before the lock was ours: make it again
        raise CheckpointError(f"could not lock {folder} to write it: a cleanup moved it away {_LOCK_TRIES} times; "
                              "is another program deleting the checkpoint directory's folders?")

    def release(self, *, complete: bool) -> None:
        """Let go of the lock (again: nothing); ``complete``: the version is committed by every
        rank, so delete the lock file (if it is still the one held)."""
        self._record.release()
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if complete and _same_file(fd, self.folder / _LOCK_FILE):
                (self.folder / _LOCK_FILE).unlink(missing_ok=True)
        finally:
            os.close(fd)


_WRITER_LOCK_RE = re.compile(r"^\.writer-rank\d+\.lock$")
"""The file in the checkpoint directory the writing Checkpointer of a rank locks (NOTE [one job per
directory])."""
_CONTENDED_SECONDS = 1.0
"""How long taking the directory's lock waits out another holder before it says another job holds it:
a cleanup holds a stale lock file a moment to delete it; a writing job holds it until it closes."""


def _writer_lock_file(directory: Path, rank: int) -> Path:
    return directory / f".writer-rank{rank}.lock"


class _DirectoryLock:
    """The lock a writing Checkpointer holds on its directory, for its rank (NOTE [one job per directory]).

    NOTE [one job per directory]
    Two jobs saving into one directory (a run started twice, ``ooc train --save DIR`` beside a live
    run on DIR, or two Checkpointers in one process) wrote the same version's files in place over
    each other, which a restore caught only as a checksum error; each one's retention deleted the
    other's versions, and each refused the steps the other had committed. So the Checkpointer of
    rank ``r`` holds ``flock(LOCK_EX)`` on ``.writer-rank{r}.lock`` in the directory from its first
    ``save`` (or :meth:`Checkpointer.check_step`) until :meth:`Checkpointer.close`; another job's
    Checkpointer of the same rank that would write there gets a :class:`CheckpointError` saying another
    job holds the directory (with the holder's pid and host, which the holder writes into the file).
    A newer Checkpointer in the same process takes the directory over instead (NOTE [a newer
    Checkpointer takes over]). Every job has
    a rank 0, so of two jobs the second always fails (on every rank the two share; its ranks beyond
    the first job's world fail with it at their first collective). The ranks of one job lock files
    of their own and never exclude each other. Readers (:meth:`Checkpointer.restore`, ``versions``,
    ``latest``, ``export``, ``ooc checkpoints list``) take no lock: they go by the commit records, so
    they work while a job writes.

    The lock belongs to the open file description, so two Checkpointers in one process would exclude
    each other as two processes do (they never meet at the lock: the newer one first closes the
    older one), and the kernel drops it when its process dies (``kill -9`` included),
    so a crash leaves at most the file, which the next holder reuses and rank 0's next cleanup
    deletes. A process forked meanwhile (a DataLoader's workers) shares the description: ``close``
    unlocks it (``LOCK_UN``, for the children too) before closing it; a job killed while such a
    child lives holds the directory until the child exits. A child that ends as Python programs do
    (``sys.exit``: its atexit handlers run the finalizer of the Checkpointer it copied) only closes
    its copies: unlocking the shared description and deleting the file let another job in beside
    the live parent. The holder deletes the file at
    ``close``; a taker that locked a file deleted meanwhile finds the path names another file (or
    none) and takes it again, as with the folder locks (NOTE [folder locks]).

    Where flock reaches across hosts (NFS emulates it with byte-range locks; Lustre with ``-o
    flock``), jobs on other hosts are excluded too (byte-range locks of one process never conflict,
    but two Checkpointers in one process are told apart without a lock); where it is local to a
    host (NFS mounted with ``local_lock=flock`` or ``all``, Lustre with ``-o localflock``) a job on
    another host takes the lock too. Where the file system has no flock at all (``_NO_FLOCK``:
    Lustre without ``-o flock``, some FUSE file systems, NFS without a lock manager) the directory is
    written without the lock. In both, the rank's owner record ``.writer-rank{r}.owner``, claimed
    once the lock is taken (or not there), refuses a second job while its holder is live, and is
    taken over from a dead one (NOTE [owner records]); a cleanup leaves alone a lock file whose
    record is live (deleting it would let a second job of the holder's own host lock a new file).

    NOTE [a newer Checkpointer takes over]
    In a notebook, running again the cell ``ck = Checkpointer(d, model, opt)`` while the earlier
    Checkpointer is unclosed and still alive (writing a version, referenced by a traceback or
    ``Out``, in a reference cycle not collected yet) made the new one's first save fail: "another
    job holds ... (this process)". Within one process the newest Checkpointer of a rank on a
    directory wins, and never while another writes there: at its first ``save`` (or
    ``check_step``) it looks up the Checkpointer of this process that holds the directory for its
    rank (``_HOLDERS``, by the directory's device and inode), waits for that one's version in flight
    to be committed and closes it (:meth:`Checkpointer._supersede`, under the older one's save lock:
    between two of its saves, whatever thread makes them), and only then takes the lock, warning
    once (:func:`_warn_taken_over`: which version was in flight, and its error if its write failed,
    which no ``wait`` of the older one would report now). The older one's later ``save`` and
    ``check_step`` raise a :class:`CheckpointError` saying it was superseded; it still reads. A
    Checkpointer dropped unclosed does not wait to be taken over: the optimizer's stage listener and
    the model's load hook hold it weakly (:func:`_weakly`), its idle writer thread not at all (NOTE
    [writer thread]), and a ``weakref.finalize`` lets go of its lock when it is collected. Another
    process is still refused: only a Checkpointer of this process can be known to be done with."""

    def __init__(self, path: Path, fd: int | None, record: _OwnerRecord) -> None:
        self.path = path
        self._fd = fd
        self._record = record
        self._pid = os.getpid()

    def __del__(self) -> None:
        self._record.release()  # a Checkpointer dropped without close(): the lock goes with it
        if self._fd is not None:
            os.close(self._fd)

    @classmethod
    def take(cls, directory: Path, rank: int) -> _DirectoryLock:
        """Lock rank ``rank``'s file in ``directory``, or raise :class:`CheckpointError` if another
        Checkpointer holds it."""
        path = _writer_lock_file(directory, rank)
        for _ in range(_LOCK_TRIES):
            fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if not _flock_within(fd, _CONTENDED_SECONDS):
                    raise _held_error(directory, path)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in _NO_FLOCK:
                    raise
                fd = None
            except BaseException:
                os.close(fd)
                raise
            if fd is not None and not _same_file(fd, path):
                os.close(fd)  # deleted by its holder's close (or a cleanup) before it was ours: take it again
                continue
            try:  # a job on a host whose flocks this one does not see (NOTE [owner records])
                record = _OwnerRecord.claim(path.with_suffix(".owner"), functools.partial(_held_error, directory, path),
                                            flocked=fd is not None)
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
            if fd is not None:
                holder = f"pid {os.getpid()} on {os.uname().nodename}".encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, holder, 0)
            return cls(path, fd, record)
        raise CheckpointError(f"could not lock {path}: it was deleted under this Checkpointer {_LOCK_TRIES} times; "
                              "is another program deleting the checkpoint directory's files?")

    @property
    def took_over(self) -> bool:
        """Whether it was taken over from a dead holder's record (NOTE [owner records])."""
        return self._record.took_over

    def taken_over(self) -> str | None:
        """Who took the directory over from this holder, another host's job that judged it dead
        (NOTE [owner records]); None while it holds it."""
        if self._record.ours():
            return None
        holder = _read_holder(self._record.path)
        return "no one (its record was deleted)" if holder is None else str(holder)

    def release(self) -> None:
        """Delete the file and its owner record and unlock it (again: nothing). In a forked child
        (its exit runs the finalizer of the Checkpointer it copied) only close them: the lock, the
        file and the record are the parent's, which still writes."""
        self._record.release()
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.getpid() != self._pid:
                return
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
            fcntl.flock(fd, fcntl.LOCK_UN)  # for a forked child sharing the open file description too
        finally:
            os.close(fd)


_HOLDERS: dict[tuple[int, int, int], weakref.ref[Checkpointer]] = {}
"""(device, inode) of a checkpoint directory and a rank -> the Checkpointer of this process that holds
the directory for that rank, or held it (a dead reference) (NOTE [a newer Checkpointer takes over])."""
_HOLDERS_LOCK = threading.RLock()
"""Reentrant: a collection under it (an allocation while it is held) may run a collected holder's
finalizer (:func:`_let_go`) on this thread, which takes it too."""


def _holder_key(directory: Path, rank: int) -> tuple[int, int, int]:
    """The directory as a file (a path through a symbolic link or another spelling is the same one)
    and the rank: the key of :data:`_HOLDERS`."""
    st = os.stat(directory)
    return st.st_dev, st.st_ino, rank


def _forget_holder(key: tuple[int, int, int], ckpt: Checkpointer | None) -> None:
    """Drop ``key`` from :data:`_HOLDERS` if ``ckpt`` (None: a collected one) is its holder."""
    with _HOLDERS_LOCK:
        ref = _HOLDERS.get(key)
        if ref is not None and ref() is ckpt:
            del _HOLDERS[key]


def _let_go(lock: _DirectoryLock, key: tuple[int, int, int], ckpt: Checkpointer | None = None) -> None:
    """Release the directory lock of ``ckpt``: at its close, or when it is collected unclosed (then
    as a ``weakref.finalize``, whose reference to it is dead by now: ``ckpt`` None)."""
    lock.release()
    _forget_holder(key, ckpt)


def _warn_taken_over(ckpt: Checkpointer, in_flight: int | None, error: BaseException | None) -> None:
    """Say, once per takeover, that ``ckpt`` took its directory over from an earlier Checkpointer of
    this process (NOTE [a newer Checkpointer takes over])."""
    if in_flight is None:
        written = "It had no version in flight"
    elif error is None:
        written = f"Its version of step {in_flight}, in flight, was written first"
    else:
        written = f"Its version of step {in_flight}, in flight, failed ({error})"
    warnings.warn(f"a new Checkpointer of rank {ckpt.rank} on {ckpt.directory} took the directory over from an earlier "
                  "Checkpointer of this process that was not closed (a notebook cell that makes one run again, or one "
                  f"dropped while still referenced). {written}, and the earlier one is closed now: its save() raises. "
                  "close() a Checkpointer you are done with to end it yourself; to save two models (an EMA copy beside "
                  "the model), give each Checkpointer a directory of its own", UserWarning, stacklevel=6)  # save()'s caller


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, a bound method, as a callable that holds its object weakly and does nothing once
    the object is gone: a listener or hook that does not keep a dropped Checkpointer alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def _flock_within(fd: int, seconds: float) -> bool:
    """Take ``flock(LOCK_EX)`` on ``fd``, trying for up to ``seconds``; return whether it was taken
    (raises the OSError of a file system without flock)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _held_error(directory: Path, path: Path, record: _Holder | None = None) -> CheckpointError:
    """The refusal of a directory whose lock file ``path`` another Checkpointer holds, or whose owner
    record ``record``'s live holder holds (NOTE [owner records])."""
    if record is None:
        try:
            holder = path.read_text(errors="replace").strip() or "a process"
        except OSError:
            holder = "a process"
        how, gone = f"has the lock on {path.name}", ""
    else:
        holder = str(record)
        how = (f"holds its owner record {path.with_suffix('.owner').name} (last heartbeat {record.age:.0f} s ago; "
               "a lock taken on another host is not seen on this file system)")
        gone = (f". If that job is gone (its host crashed or was cut off), its record counts as stale "
                f"{_STALE_SECONDS:.0f} s after its last heartbeat: try again then")
    if holder == f"pid {os.getpid()} on {os.uname().nodename}":
        holder += " (this process: a Checkpointer being collected; try again)"
    return CheckpointError(
        f"another job holds the checkpoint directory {directory}: {holder} {how}, taken by a "
        "Checkpointer of this rank that saved there and is not closed (in this process or another). Two jobs saving "
        "into one directory would write over each other's files and delete each other's versions. Stop that job or "
        "close() its Checkpointer, or save into another directory (ooc train --save NEW_DIR); its versions can be "
        f"read meanwhile (restore, versions, ooc checkpoints list){gone}")


def _remove_stale_writer_lock(path: Path) -> None:
    """Delete ``path``, a rank's directory lock file, unless a Checkpointer holds it (NOTE [one job
    per directory]): by its lock, or on another host by its owner record (NOTE [owner records])."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return  # gone already, or not ours to change
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _same_file(fd, path) and _live_holder(path.with_suffix(".owner"), flocked=True) is None:
            path.unlink(missing_ok=True)
    except OSError:
        pass  # held (a writing job's), or no flock here: left be
    finally:
        os.close(fd)


def _remove_dead_record(path: Path) -> None:
    """Delete the owner record ``path`` if its holder is dead (NOTE [owner records])."""
    holder = _read_holder(path)
    if holder is not None and not holder.live():
        _drop_dead_record(path, holder)


def _remove_leftover(path: Path) -> None:
    """Delete ``path``, the temporary file of a record made or dropped, once it is older than any
    record still being made or dropped can be (``_STALE_SECONDS``; NOTE [owner records])."""
    with contextlib.suppress(OSError):  # gone meanwhile
        if time.time() - path.stat().st_mtime > _STALE_SECONDS:
            path.unlink()


def _remove_unless_written(folder: Path, step: int) -> bool:
    """Remove ``folder``, version ``step``'s and incomplete when listed, unless a writer holds its
    lock or its live owner record (a writer on another host: NOTE [owner records]) or it is
    committed meanwhile (then only a lock file and owner records left in it go); return whether it
    was removed (NOTE [folder locks])."""
    try:
        fd = os.open(folder / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # a crash's folder may have none
    except OSError:
        return False  # gone already (another cleanup), or not ours to change
    try:
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                return False  # EWOULDBLOCK: a writer holds it
            flocked = False
        if not _same_file(fd, folder / _LOCK_FILE):
            return False  # moved away or made anew since it was opened: another cleanup's, or a writer's
        if _committed(folder, step) is not None:
            (folder / _LOCK_FILE).unlink(missing_ok=True)
            for record in folder.glob(_WRITING_OWNER.format(token="*")):
                record.unlink(missing_ok=True)  # every rank has committed: none writes here
            return False
        if _written_elsewhere(folder, flocked=flocked) is not None:
            return False  # a writer on a host whose flocks this one does not see (NOTE [owner records])
        removing = folder.with_name(f".removing-{folder.name}-{os.urandom(4).hex()}")
        try:
            os.rename(folder, removing)
        except OSError:
            return False
    finally:
        os.close(fd)
    shutil.rmtree(removing, ignore_errors=True)
    return True


def _identity(path: Path) -> tuple[int, int] | None:
    """The (device, inode) of ``path``, which a rename keeps and a new folder of its name has not;
    None if there is nothing there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _move_aside(folder: Path, identity: tuple[int, int]) -> Path | None:
    """Rename ``folder``, a damaged version's whose :func:`_identity` was ``identity``, to
    ``<name>.damaged-<unix time>``, which no listing reads; return the new path, or None if the
    folder there is no longer that one (another rank moved it, and maybe began the new version).

    NOTE [damaged versions moved aside]
    A damaged version newer than the newest intact one blocks a run that fell back past it: a save
    at its step was refused ("already committed"), and one below it would look older than it. So
    a save moves such folders aside first, keeping them for inspection. With several ranks every
    rank knows the same damaged folders (NOTE [every rank falls back alike]) and tries; the one
    that takes the folder's lock exclusively (as a cleanup does, NOTE [folder locks]) while the
    folder at the name is still the damaged one renames it. A writer of the new version (another
    rank, already past its own try) makes its folder only once the name is free, and holds the new
    folder's lock, which a try then cannot take and a look at the identity tells apart. The rename
    is made durable by the new version's commit (its directory fsync comes before the record). A
    version that could not be read (:class:`UnreadableCheckpointError`: the file system failed) is
    not known to be damaged and is never moved aside; a fallback skips it as it skips a damaged one."""
    for _ in range(_LOCK_TRIES):
        if _identity(folder) != identity:
            return None
        try:
            fd = os.open(folder / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            return None  # moved away since the look
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    time.sleep(0.01)  # another rank renaming it, or the new version's writer: look again
                    continue
            if not _same_file(fd, folder / _LOCK_FILE) or _identity(folder) != identity:
                return None
            stamp, k = int(time.time()), 0
            target = folder.with_name(f"{folder.name}.damaged-{stamp}")
            while target.exists():  # moved aside at this step before, this second
                k += 1
                target = folder.with_name(f"{folder.name}.damaged-{stamp}-{k}")
            os.rename(folder, target)
        finally:
            os.close(fd)
        (target / _LOCK_FILE).unlink(missing_ok=True)
        return target
    raise CheckpointError(f"could not move the damaged version {folder} aside: another process holds its "
                          f"{_LOCK_FILE}; stop it, or move the folder away yourself")


def _tensor_bytes(t: torch.Tensor, start: int = 0, stop: int | None = None) -> memoryview:
    """Bytes ``start:stop`` of ``t`` (any shape and strides), row-major; without a copy for a
    contiguous host tensor (``start`` and ``stop`` multiples of its element size, or ``stop`` past
    its end). A device tensor (a bucket's working copy on the GPU) has those bytes copied to the host."""
    t = t.detach()
    size = t.element_size()
    stop = t.numel() * size if stop is None else min(stop, t.numel() * size)
    flat = _row_major(t, start // size, max(stop, start) // size).view(torch.uint8)
    # A device tensor's copy is synchronous on this thread's current stream (the default one), after
    # the writer waited for save()'s compute event (NOTE [live device tensors after the gate]): it
    # reads what save()'s optimizer.synchronize() left there, which no copy changes before the
    # bucket's next update, and the listener holds that update back until this copy has returned.
    return memoryview(flat.to("cpu").numpy())


def _row_major(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Elements ``lo:hi`` of ``t`` in row-major order, contiguous.

    The writer reads a tensor a slice at a time (``_SLICE_BYTES``); ``t.contiguous()`` of a
    non-contiguous one (a transposed weight, a strided view) copied the whole tensor for every
    slice: a 128 MiB transposed parameter took 5.7 s to save against 0.24 s contiguous, and a
    bucket's next update waited for each whole copy. So only the rows holding the slice are copied:
    about ``hi - lo`` elements, plus the ends of two rows split further the same way."""
    if t.is_contiguous():
        return t.reshape(-1)[lo:hi]
    if lo >= hi:
        return t.new_empty(0)
    row = t[0].numel()  # a non-contiguous tensor has a dimension and elements
    first, last = lo // row, (hi - 1) // row
    if first == last:
        return _row_major(t[first], lo - first * row, hi - first * row)
    parts = [_row_major(t[first], lo - first * row, row)]
    if last > first + 1:
        parts.append(t[first + 1:last].contiguous().reshape(-1))
    parts.append(_row_major(t[last], 0, hi - last * row))
    return torch.cat(parts)


_SLICE_BYTES = 4 << 20
"""Bytes of a live tensor the writer reads at a time: the longest a bucket's next update may wait
for the writer (NOTE [lazy snapshots]) is one slice's checksum and its copy or direct write (and the
write queued before it: NOTE [writes straight from the tensors]), not a whole tensor's."""


class _TensorFile:
    """``tensors`` in the safetensors format (an 8-byte header length, a JSON header padded to 8
    bytes, then each tensor's bytes in order), as its header and pieces of at most ``_SLICE_BYTES``:
    the file is never whole in memory (``safetensors.torch.save`` builds it as one ``bytes``). A
    tensor that is a live slot of ``snapshot`` is held immutable while each of its pieces is read
    (:meth:`read`: written and hashed)."""

    def __init__(self, tensors: dict[str, torch.Tensor], snapshot: _Snapshot | None = None,
                 on_tensor: Callable[[str], None] = lambda name: None) -> None:
        self._tensors = tensors
        self._snapshot = snapshot
        self._on_tensor = on_tensor
        self._whole: dict[str, tuple[torch.Tensor, memoryview]] = {}
        """Name -> a contiguous host tensor and its bytes, read a piece at a time without the torch
        calls of :func:`_tensor_bytes` per piece (17 of the writer thread's 73 ms per version of a
        100M-parameter state); made again if the slot holds another tensor (a copy aside)."""
        for name, t in tensors.items():
            if t.dtype not in _DTYPES:
                raise CheckpointError(f"cannot save tensor {name!r} of dtype {t.dtype} in safetensors")

    def header(self, alignment: tuple[int, int] | None = None) -> bytes:
        """The 8-byte length and the JSON header, padded with spaces to a multiple of 8 bytes and, given
        the direct writes' ``alignment``, to where most bytes can be written straight from the
        tensors (NOTE [writes straight from the tensors])."""
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, t in self._tensors.items():
            nbytes = t.numel() * t.element_size()
            header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        start = 8 + len(encoded)
        encoded += b" " * (-start % 8 if alignment is None else self._padding(start, alignment))
        return struct.pack("<Q", len(encoded)) + encoded

    def _padding(self, start: int, alignment: tuple[int, int]) -> int:
        """Spaces after a header ending at ``start`` that put the data at the offset (a multiple of 8,
        as safetensors writes it) where the most bytes of the tensors' memory agree with their file
        offsets modulo the direct writes' alignment (:func:`_direct_span`)."""
        modulus = min(alignment)
        votes: dict[int, int] = {}
        offset = 0
        for t in self._tensors.values():
            nbytes = t.numel() * t.element_size()
            if t.device.type == "cpu" and t.is_contiguous() and nbytes >= _DIRECT_MIN_BYTES:
                residue = (t.data_ptr() - offset) % modulus
                votes[residue] = votes.get(residue, 0) + nbytes
            offset += nbytes
        fits = [r for r in votes if r % min(8, modulus) == 0]  # a data start that is a multiple of 8 reaches
        if modulus <= 8 or not fits:
            return -start % 8
        return (max(fits, key=votes.__getitem__) - start) % modulus

    def pieces(self) -> list[tuple[int, str, int]]:
        """(deadline, tensor, first byte) of each piece, in the file's order; the deadline is the
        snapshot's for the tensor (NOTE [write order]), 0 without one."""
        out = []
        for name, t in self._tensors.items():
            nbytes = t.numel() * t.element_size()
            deadline = self._snapshot.deadline(self._tensors, name) if self._snapshot is not None else 0
            out += [(deadline, name, start) for start in (range(0, nbytes, _SLICE_BYTES) if nbytes else range(1))]
        return out

    @contextlib.contextmanager
    def read(self, name: str, start: int) -> Iterator[memoryview]:
        """The piece of ``name`` from byte ``start``, held immutable until the block ends."""
        piece, release = self.take(name, start)
        try:
            yield piece
        finally:
            release()

    def _piece(self, name: str, t: torch.Tensor, start: int) -> memoryview:
        """Bytes ``start:start + _SLICE_BYTES`` of ``t``, the tensor named ``name`` now."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return _tensor_bytes(t, start, start + _SLICE_BYTES)
        whole = self._whole.get(name)
        if whole is None or whole[0] is not t:
            whole = self._whole[name] = (t, memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
        return whole[1][start:start + _SLICE_BYTES]

    def take(self, name: str, start: int) -> tuple[memoryview, Callable[[], None]]:
        """The piece of ``name`` from byte ``start``, held immutable until the function returned with
        it is called (from any thread; again: nothing)."""
        snapshot = self._snapshot
        t, token = snapshot.acquire(self._tensors, name) if snapshot is not None else (self._tensors[name], None)
        finished = start + _SLICE_BYTES >= t.numel() * t.element_size()
        held = [token]

        def release() -> None:
            try:
                token = held.pop()  # atomic: released once, whichever thread comes first
            except IndexError:
                return
            if snapshot is not None:
                snapshot.release(token, finished=finished)

        try:
            if start == 0:
                self._on_tensor(name)
            return self._piece(name, t, start), release
        except BaseException:
            release()
            raise


def _write_tensor_files(files: list[tuple[Path, _TensorFile]]) -> list[tuple[int, str]]:
    """Write the safetensors ``files`` together, their pieces in order of deadline (each file's in
    its own order; ties go to the earlier file), and fsync each after its last piece; return each
    one's size and XXH3-64 as :func:`_write_file` does (NOTE [write order]). Each piece is read
    (held immutable) only while it is copied into its file's bounce buffer."""
    pieces = [file.pieces() for _, file in files]
    left = [len(p) for p in pieces]
    results: list[tuple[int, str]] = [(0, "")] * len(files)
    with ThreadPoolExecutor(1, thread_name_prefix="ooc-checkpoint-io") as io:
        writers: list[_FileWriter] = []
        try:
            for k, (path, file) in enumerate(files):
                writers.append(_FileWriter(path, io))
                writers[-1].feed(file.header(writers[-1].alignment))
                if not left[k]:
                    results[k] = writers[k].finish()  # no tensors
            merged = heapq.merge(*([(deadline, k, name, start) for deadline, name, start in p]
                                   for k, p in enumerate(pieces)))
            for _, k, name, start in merged:
                piece, release = files[k][1].take(name, start)
                try:
                    writers[k].feed(piece, release)  # lets go of it once copied, or written from it
                except BaseException:
                    release()  # (a failed feed wrote nothing from it)
                    raise
                left[k] -= 1
                if not left[k]:
                    results[k] = writers[k].finish()
            return results
        finally:
            for writer in writers:
                writer.close()


def _host_copy(value: torch.Tensor, pending: list[Any]) -> torch.Tensor:
    """A host copy of ``value`` for the writer; a CUDA tensor's is issued without waiting, its
    event appended to ``pending``.

    NOTE [device state copied asynchronously]
    What no bucket holds (buffers such as BatchNorm's statistics, frozen parameters, a kept
    block's weights outside HostAdamW) may be on the device. ``save`` copies it into pinned host
    memory on the tensor's device's current stream, after the work queued there that produced it,
    and returns without waiting; the writer thread waits for the copies' event before it reads
    them. A later update of the tensor is queued after the copy on that stream (or, on another
    stream, after the training code's own sync), so the copy reads the state at ``save``. The weights
    a HostAdamW's buckets hold, copied so when the snapshot is not lazy, are updated by its copies in,
    which the training code's sync does not order: ``save`` hands it an event after the copies, which
    the next copies in wait for (NOTE [weights read on another stream] in ooc.optim.pipeline)."""
    value = value.detach()
    if value.device.type != "cuda":
        return value.to("cpu", copy=True)
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(value.device)
    with torch.cuda.stream(stream):
        host.copy_(value, non_blocking=True)
        # Nothing of ooc holds ``value`` until the copy has run, and the caller may drop it at once
        # (a buffer the next forward reassigns): the caching allocator would then hand its block to
        # the next allocation on the stream it was allocated on (the default one, for a model built
        # there) while this stream, if another, has not read it yet.
        value.record_stream(stream)
        # Blocking: the writer thread waits for it while the GPU may be a step behind; a default
        # event spin-waits there, burning the core the host optimizer needs (as in ooc.backend.cuda).
        event = torch.cuda.Event(blocking=True)
        event.record(stream)  # the writer waits for this before reading ``host``
    pending.append(event)
    return host


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _state_bytes(name: str, state: dict[str, Any]) -> bytes:
    """A state file's bytes, checked to load as :meth:`Checkpointer.restore` loads them.

    NOTE [state files load with weights_only]
    ``restore`` reads a state file with ``torch.load(weights_only=True)``: it may come from anywhere,
    and unpickling it otherwise can run any code. That loader refuses what torch.save pickles
    happily, such as numpy scalars and arrays (``extra={"pos": np.int64(3)}``, a position read
    from a numpy index), slices or objects of your own. Such a version committed, then failed every
    restore as "corrupt" though its checksum matched. So the writer loads the bytes back first (a
    state file is small: scheduler, RNG, ``extra``) and fails the save naming the entry instead."""
    data = _torch_bytes(state)
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal: the restore would fail the same way
        reason = str(exc).partition("WeightsUnpickler error: ")[2].partition(". ")[0] or str(exc)
        entries = [key for key, value in state.items() if not _loads_with_weights_only(value)]
        raise CheckpointError(
            f"{name} would not load with torch.load(weights_only=True), as restore() reads it: {reason} "
            f"(in {' and '.join(entries) or 'it'}). Keep the extra dict and the scheduler's state to tensors, "
            "numbers, strings, bools, None, lists, tuples and dicts (int(x), float(x) or torch.from_numpy(a) "
            "for numpy values), or allow the type with torch.serialization.add_safe_globals") from None
    return data


def _loads_with_weights_only(value: Any) -> bool:
    try:
        torch.load(io.BytesIO(_torch_bytes(value)), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - which entry is refused, for the message
        return False
    return True


def _clone(obj: Any) -> Any:
    """A deep copy of a state dict whose tensors are detached CPU copies (what the writer thread
    serializes while training goes on)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments
        return type(obj)(*(_clone(v) for v in obj))
    if isinstance(obj, (list, tuple, set)):  # a set too: the loop may change it before the writer reads it
        return type(obj)(_clone(v) for v in obj)
    return obj


def rng_state() -> dict[str, Any]:
    """The RNG states of this process: Python's, torch's CPU generator and every CUDA device's
    (if CUDA is initialized; never initializes it)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # Saved where more devices were visible (every rank sees every GPU of a bigger node): those
        # this process lacks have no generator to set (device_count does not initialize CUDA).
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])


class _AsideBuffers:
    """Host buffers for the copies aside, kept from one version for the next (NOTE [reused copies
    aside]); the optimizer's thread takes them, the writer thread hands a written version's back."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]], list[torch.Tensor]] = {}
        """(dtype, shape, strides) -> kept buffers: the writer reads a non-contiguous buffer through a
        copy of each slice's rows (_row_major), so a buffer goes only to a tensor laid out as it is."""
        self._lock = threading.Lock()
        self.reused = 0
        """Copies aside made into a buffer kept from an earlier version (over every save so far)."""

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``: into a kept buffer of its dtype and shape if there is one."""
        with self._lock:
            free = self._free.get((tensor.dtype, tuple(tensor.shape), tensor.stride()))
            buffer = free.pop() if free else None
        if buffer is None:
            return tensor.detach().to("cpu", copy=True)
        # A device tensor's copy into pageable host memory returns once the bytes are there, as
        # ``.to("cpu")`` does; the listener then waits for the read (NOTE [lazy snapshots]).
        buffer.copy_(tensor.detach())
        self.reused += 1
        return buffer

    def keep(self, buffers: list[torch.Tensor]) -> None:
        """``buffers`` (a written version's copies aside) for the next version; free the rest."""
        with self._lock:
            self._free = {}
            for b in buffers:
                self._free.setdefault((b.dtype, tuple(b.shape), b.stride()), []).append(b)


class _Snapshot:
    """Slots (container, key) holding live tensors, per bucket (NOTE [lazy snapshots]). The writer
    reads a slot's live tensor a slice at a time, each between :meth:`acquire` and :meth:`release`;
    before a bucket's next update, :meth:`before_update` waits for a slice of the bucket being read,
    then copies aside the bucket's slots the writer has not read to their end. A slot copied aside
    midway is read on from the copy, which holds the same bytes."""

    def __init__(self, slots: dict[int, list[tuple[Any, Any]]], aside: _AsideBuffers, order: Iterable[int] = ()) -> None:
        self._aside = aside
        self._rank = {bucket: k for k, bucket in enumerate(order)}
        """Bucket -> its place in the order the next step is expected to update them (NOTE [write order])."""
        self.copies: list[torch.Tensor] = []
        """The copies aside made so far, handed back to ``aside`` when the version is written."""
        self._refs = {(id(c), k): (c, k) for bucket in slots.values() for c, k in bucket}
        self._bucket_of = {(id(c), k): b for b, bucket in slots.items() for c, k in bucket}
        self._unread = {b: {(id(c), k) for c, k in bucket} for b, bucket in slots.items()}
        """Bucket -> its live slots not read to their end yet."""
        self._reading: dict[int, int] = {}
        """Bucket -> slices of its slots the writer is reading now."""
        self._updating: set[int] = set()
        """Buckets whose update waits for the slices being read, to copy aside the rest: the writer
        starts no other slice of theirs meanwhile (else the update would wait for every one)."""
        self._versions = {slot: _version_of(c[k]) for slot, (c, k) in self._refs.items()}
        """Slot -> its live tensor's version counter once the copies in flight at save have landed
        (:meth:`landed`; NOTE [changes the snapshot does not see])."""
        self.changed: list[Any] = []
        """Keys of the slots whose live tensor changed between save and the end of its read."""
        self._cond = threading.Condition()

    def landed(self) -> None:
        """The copies in flight at save (the last update's, into the live weights) have landed: take
        the version counters of the slots not copied aside again, as those copies changed them."""
        with self._cond:
            for slots in self._unread.values():
                for slot in slots:
                    container, key = self._refs[slot]
                    self._versions[slot] = _version_of(container[key])

    def deadline(self, container: Any, key: Any) -> int:
        """The place of the slot's bucket in the expected order of the next updates; after every
        bucket for a slot no bucket holds, or whose bucket the last step did not update."""
        return self._rank.get(self._bucket_of.get((id(container), key)), len(self._rank))

    def acquire(self, container: Any, key: Any) -> tuple[torch.Tensor, tuple[int, tuple[int, Any]] | None]:
        """``container[key]`` for the writer to read a slice of, and the token to :meth:`release` after."""
        slot = (id(container), key)
        with self._cond:
            bucket = self._bucket_of.get(slot)
            while bucket in self._updating:
                self._cond.wait()  # the update copies the slot aside (if unread): read on from the copy
            if bucket is None or slot not in self._unread.get(bucket, ()):
                return container[key], None  # no bucket's, or copied aside already
            self._reading[bucket] = self._reading.get(bucket, 0) + 1
            return container[key], (bucket, slot)

    def release(self, token: tuple[int, tuple[int, Any]] | None, *, finished: bool) -> None:
        """The slice read; ``finished``: it was the slot's last, the live tensor is no longer needed."""
        if token is None:
            return
        bucket, slot = token
        with self._cond:
            if finished and slot in self._unread.get(bucket, ()):
                container, key = self._refs[slot]
                if _version_of(container[key]) != self._versions[slot]:  # NOTE [changes the snapshot does not see]
                    self.changed.append(key)
                self._unread[bucket].discard(slot)
            self._reading[bucket] -= 1
            if not self._reading[bucket]:
                del self._reading[bucket]
                self._cond.notify_all()

    def before_update(self, bucket: int) -> bool:
        """Make the bucket's slots safe from its next update: wait while the writer reads a slice of
        one, copy aside those it has not read to their end. Returns whether anything was copied."""
        with self._cond:
            self._updating.add(bucket)
            try:
                while self._reading.get(bucket):
                    self._cond.wait()
                unread = self._unread.pop(bucket, set())
                for slot in unread:
                    container, key = self._refs[slot]
                    container[key] = self._aside.copy(container[key])
                    self.copies.append(container[key])
            finally:
                self._updating.discard(bucket)
                self._cond.notify_all()
            return bool(unread)


def _version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter, bumped by every in-place change; None for an inference tensor (none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _first_few(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 21 more``: a model of another size differs in every tensor, a line each was a wall."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class Checkpointer:
    """Saves and restores ``model``, ``optimizer``, ``scheduler``, the RNG states and ``extra`` (a
    dict of your own, e.g. the data position: saved with torch.save, so tensors, numbers, strings,
    lists and dicts; :meth:`restore` updates it in place) under ``directory``, keeping the newest
    ``keep`` versions.

    Data-parallel: every rank makes a Checkpointer on the same (shared) directory and calls ``save``
    at the same steps; pass ``rank`` and ``world`` (default: from torch.distributed). A version
    saved by any number of ranks, sharded or not, restores on any number (NOTE [resharding]).
    ``layout`` (JSON-able) is recorded with the version for your information (``ooc train``: the
    ``--shard`` setting). ``lazy``: lazy snapshots with a HostAdamW (NOTE [lazy snapshots]).
    ``timeout_s``: how long :meth:`restore` waits for every rank to call it (NOTE [every rank restores]),
    and :meth:`close` for the other ranks' records of its last version (NOTE [every rank commits
    where this rank does]).

    One job writes into a directory at a time: from its first ``save`` until :meth:`close`, another
    job's Checkpointer saving there is refused (NOTE [one job per directory]). Within one process
    the newest Checkpointer on a directory wins (a notebook cell making one, run again): its first
    ``save`` waits for the version an older, unclosed one is writing, closes that one and warns
    once; the older one's ``save`` then raises, saying it was superseded. A Checkpointer dropped
    unclosed lets go of the directory when it is collected (NOTE [a newer Checkpointer takes over]).
    """

    def __init__(self, directory: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, scheduler: Any = None, extra: dict[str, Any] | None = None, keep: int | None = 3,
                 rank: int | None = None, world: int | None = None, layout: dict[str, Any] | None = None,
                 lazy: bool = True, timeout_s: float = 300.0) -> None:
        _check_arguments(directory, model, optimizer, scheduler, extra)
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            # Checked here: retention runs on the writer thread, after a version is committed.
            raise ValueError(f"keep must be an int >= 1 (or None to keep every version), got {keep!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        """How long ``restore`` waits for every rank to call it (NOTE [every rank restores]), and
        ``close`` for the other ranks' records (NOTE [every rank commits where this rank does])."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = rank if rank is not None else (torch.distributed.get_rank() if distributed else 0)
        self.world = world if world is not None else (torch.distributed.get_world_size() if distributed else 1)
        # Made absolute once, here: a relative directory stays where it was when the Checkpointer
        # was made, for every later save, restore and the writer thread, whatever os.chdir comes
        # later (a process changing directory midway wrote later versions, or half of one, elsewhere).
        self.directory = Path(os.path.abspath(directory))
        model = _compiled_module(model)
        optimizer = _unwrapped_optimizer(optimizer)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra = extra
        self.keep = keep
        self.layout = {"world": self.world, **(layout or {})}
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        """The writer thread, while it waits for saves (NOTE [writer thread])."""
        weakref.finalize(self, self._jobs.put, None)  # a Checkpointer dropped: its idle writer ends now
        self._save_lock = threading.RLock()
        """Held by ``save``, ``check_step`` and ``close``: a newer Checkpointer taking over the directory
        closes this one between two saves, never within one (NOTE [a newer Checkpointer takes over])."""
        self._superseded = False
        """Set when a newer Checkpointer in this process took over the directory: ``save`` refuses."""
        self._lock_finalizer: weakref.finalize | None = None
        self._directory_key: tuple[int, int, int] | None = None
        """The directory's key in ``_HOLDERS`` while this Checkpointer holds it."""
        """Lets go of the directory's lock if this Checkpointer is collected unclosed."""
        self._last_saved: int | None = None
        """The step of the last save handed to the writer (named at exit: NOTE [writer thread])."""
        self._committed_step: int | None = None
        """The step of the last version this rank committed (NOTE [every rank commits where this rank does])."""
        self._recycles = _file_system(self.directory) in _LOCAL_FILE_SYSTEMS
        """Whether a version may be written over a retired one's files: only on a local file system,
        where a lease sees every reader (NOTE [recycled files])."""
        self._writer_lock = threading.Lock()
        self._written = threading.Event()
        """Set while no save is being written."""
        self._written.set()
        self._error: BaseException | None = None
        self._hook: Callable[[str], None] = lambda point: None
        """Test hook: called with the name of each point of the commit sequence."""
        self._snapshot: _Snapshot | None = None
        self._aside = _AsideBuffers()
        """Buffers of the last version's copies aside (NOTE [reused copies aside])."""
        self._closed = False
        """Set by :meth:`close`: ``save`` refuses."""
        self._held: list[_FolderLock] = []
        """Locks on versions this rank committed that other ranks had not yet (NOTE [folder locks])."""
        self._directory_lock: _DirectoryLock | None = None
        """This rank's lock on the directory, from the first save until close (NOTE [one job per directory])."""
        self.lazy = lazy and optimizer is not None and hasattr(optimizer, "stage_listeners") \
            and hasattr(optimizer, "buckets") and hasattr(optimizer, "held_buckets") and not getattr(optimizer, "delayed_update", True)
        """Lazy snapshots (NOTE [lazy snapshots]): HostAdamW without delayed_update only."""
        self.copied_by_listener = 0
        """Buckets the optimizer's thread had to copy aside because their next update came before the
        writer reached them (over every save so far)."""
        self._updating: list[int] = []
        """Buckets in the order the current step updates them (NOTE [write order])."""
        self._update_order: list[int] = []
        """... and the last complete step's order."""
        self._newest: int | None = None
        """The newest committed step taken as intact, -1 if none (None: not read yet): a save at or
        below it is refused (NOTE [saves go forward])."""
        self._damaged: dict[int, tuple[tuple[int, int], CorruptCheckpointError]] = {}
        """Step -> the (device, inode) of its folder and the error, of the versions found damaged
        (NOTE [damaged versions moved aside])."""
        self._load_hook = None
        self._told_outside = False
        """Whether the warning of NOTE [parameters outside the model] was given."""
        # Weakly: the optimizer and the model outlive a Checkpointer dropped without close() (a
        # notebook cell run again), and must not keep it, and its lock on the directory, alive.
        self._listener = _weakly(self._on_stage)
        if self.lazy:
            optimizer.stage_listeners.append(self._listener)
            self._load_hook = model.register_load_state_dict_pre_hook(_weakly(self._before_model_load))
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self._clean()

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, *, if_busy: str = "wait", **metadata: Any) -> bool:
        """Start writing version ``step`` (``metadata``: JSON-able values, returned by
        :meth:`versions` and :meth:`restore`); return whether it is being written. Returns once the
        state is snapshotted; the version exists once :meth:`wait` returns.

        ``if_busy``: when the previous version is still being written, ``"wait"`` for it (every
        save is written), or ``"skip"`` this one: nothing is written for ``step`` and ``save``
        returns False at once (NOTE [skipped saves]; one rank only)."""
        with self._save_lock:
            return self._save(step, if_busy, metadata)

    def _save(self, step: int, if_busy: str, metadata: dict[str, Any]) -> bool:
        self._check_open()
        try:
            step = operator.index(step)  # np.int64 or a 0-d integer tensor: an int for the record's JSON
        except TypeError:
            raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})") from None
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {if_busy!r}")
        if if_busy == "skip" and self.world > 1:
            raise ValueError("if_busy='skip' needs one rank: ranks would skip different steps and no version "
                             "would be complete; use if_busy='wait' with several ranks")
        try:
            json.dumps(metadata)
        except TypeError as exc:
            raise ValueError(f"save metadata must be JSON-able: {exc}") from None
        self._check_no_open_step()
        if if_busy == "skip" and not self._written.is_set():
            return False
        self.wait()
        self._check_every_rank_saves()
        self.check_step(step)
        self._move_damaged_aside()
        if self.rank == 0 and self.world > 1:
            # Rank 0's retention after its commit sees only the versions every rank had committed
            # by then; by now the others have finished more (they save at the same steps).
            self._retain()
        self._warn_params_outside(stacklevel=4)  # from the caller of save (through _save)
        if self.optimizer is not None and hasattr(self.optimizer, "synchronize"):
            self.optimizer.synchronize()  # every issued host update in the parameters and the state
        files, tensors, slots, pending = self._payloads()
        if self.lazy:
            self._snapshot = _Snapshot(slots, self._aside, self._update_order or self._updating)
        else:
            self._snapshot = None
        files = self._in_write_order(files, self._snapshot)
        self._written.clear()
        with self._writer_lock:
            self._last_saved = step
            self._jobs.put((self, step, files, tensors, metadata, pending))
            if self._writer is None:
                self._writer = threading.Thread(target=_serve, args=(self._jobs, weakref.ref(self)),
                                                name="ooc-checkpoint-writer", daemon=True)
                self._writer.start()
                # The version in flight is written before the interpreter ends (NOTE [writer thread]).
                _WRITING.add(self)
                _finish_writes_at_exit()
        return True

    def _warn_params_outside(self, stacklevel: int) -> None:
        """Warn, once, of the optimizer's parameters that the model does not hold.

        NOTE [parameters outside the model]
        A version saves the model's tensors and the optimizer's state. A parameter the optimizer
        updates that the model does not hold (a learnable temperature or loss weight kept beside the
        model, or an optimizer built on a copy of it) had its moments saved (as ``param{i}``) but
        not its value: a restore loaded its state, at the saved step, and left its value as built,
        and the run went on from a state it never had, without a word. Such parameters are allowed
        (a loop may save their values in ``extra`` and set them back itself), so this warns, naming
        them and what to do, at the first save or restore."""
        if self._told_outside or self.optimizer is None:
            return
        self._told_outside = True
        held = _names_of_params(self.model)
        outside = [f"param{i} of shape {list(p.shape)}" for i, p in
                   enumerate(p for group in self.optimizer.param_groups for p in group["params"]) if id(p) not in held]
        if outside:
            warnings.warn(f"the optimizer updates {len(outside)} parameter(s) that the model given to the Checkpointer "
                          f"does not hold ({_first_few(outside)}): a version saves their optimizer state but not their "
                          "values, and a restore leaves their values as they are. Register them in the model (as an "
                          "nn.Parameter attribute of a module), or give the Checkpointer the module that holds every "
                          "parameter the optimizer updates", stacklevel=stacklevel)

    def _check_every_rank_saves(self) -> None:
        """Raise if this rank committed versions that the other ranks do not save (the writer is idle).

        NOTE [every rank saves]
        ``if rank == 0: ckpt.save(step)``, the habit of ``torch.save`` checkpoints, saved nothing
        restorable under data parallelism: a version is complete only with every rank's record, so
        each save returned, none was ever complete, and the run learnt it when it resumed ("no
        complete checkpoint"). Ranks that exchange gradients every step lag each other by a step or
        two: a rank saves each version before the next step's exchange, and its next save waits for
        that version's write. So a version this rank committed that is still incomplete after this
        rank committed ``_OTHERS_LAG`` newer ones was not saved by some rank (or its write failed,
        which that rank's next save reports): the next save raises, naming the ranks whose records
        are missing. Every held folder lock is such a version (NOTE [folder locks]): a complete newer
        version releases the older ones."""
        if self.world == 1:
            return
        steps = sorted(int(_VERSION_RE.match(lock.folder.name).group(1)) for lock in self._held)
        behind = [s for i, s in enumerate(steps) if len(steps) - 1 - i >= _OTHERS_LAG
                  and _committed(self.directory / _name(s), s) is None]
        if not behind:
            return
        folder = self.directory / _name(behind[0])
        missing = [r for r in range(self.world) if not (folder / f"manifest-rank{r}.json").exists()]
        raise CheckpointError(
            f"the versions of steps {', '.join(map(str, behind))} in {self.directory} have no commit record of "
            f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))}, and rank {self.rank} has "
            f"committed {_OTHERS_LAG} newer ones since: with "
            f"{self.world} ranks every rank must make a Checkpointer on this directory and call save() at the same "
            "steps (not only rank 0): a version is complete, and restores, only with every rank's record"
        )

    def _check_every_rank_committed(self) -> None:
        """Raise unless every rank commits its record of the last version this rank committed.

        NOTE [every rank commits where this rank does]
        Ranks saving into directories of their own (``Checkpointer(f"{root}/r{rank}", ...)``, or
        one path on hosts that share no file system) each wrote their records into a folder no
        other rank wrote into: no version was ever complete, and every save, wait and close
        returned. NOTE [every rank saves] caught it only ``_OTHERS_LAG`` saves later, so a run that
        saved at its end alone, or a few times, lost its checkpoint without a word. So ``close``,
        with a process group of ``world`` ranks, waits up to ``timeout_s`` for the other ranks'
        records of the last version this rank committed (a rank that shares the folder and saves
        the same steps writes its own soon: only a rank slower by a version's write is waited for),
        and raises naming the ranks whose records did not come. It need not wait that long: every
        rank closing a Checkpointer that committed a version announces it on the group's store
        (``announce``: counted per rank, so that the n-th such closes of the ranks meet, whatever
        each found), after its own write is committed; so by then a rank that shares the folder
        has its record there. Once every missing rank has announced, the records still missing
        are looked for during ``_CLOSED_GRACE_S`` more (for a file system that caches a folder's
        names a short while), and then the error is raised: on ranks in directories of their own,
        within about that grace after the last one closes. A store that cannot be reached (rank 0's
        process serves it, and may have ended after its own close) is no error: a rank whose
        version is complete returns, one whose version is not waits up to ``timeout_s`` on the
        files alone. So does one without a process group of ``world`` ranks (``world=`` given, as
        ranks launched without torch.distributed do, or as one process alone did: it closed without a
        word, no version complete, and the next Checkpointer's cleanup deleted them all), warning
        after ``_CLOSED_GRACE_S`` that it waits. Not in ``wait``, which every ``save`` calls: its
        fast path must not wait for the other ranks."""
        step = self._committed_step
        if self.world == 1 or step is None:
            return
        folder = self.directory / _name(step)

        def missing() -> list[int]:
            return [r for r in range(self.world) if not (folder / f"manifest-rank{r}.json").exists()]

        grouped = (torch.distributed.is_available() and torch.distributed.is_initialized()
                   and torch.distributed.get_world_size() == self.world)
        # Without a process group of ``world`` ranks (``world=`` given, ranks launched without
        # torch.distributed, or one process alone) there is no store: the files alone are waited
        # for. A Checkpointer(..., world=2) in one process closed without a word, every version
        # incomplete, and the next Checkpointer's cleanup deleted them all.
        count = announce("checkpoint-closed") if grouped else None  # on every rank: the n-th closes meet
        absent = missing()
        if not absent:
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        closed: dict[int, float] = {}  # rank -> when it was seen to have closed (without its record here)
        told = grouped
        while absent:
            now = time.monotonic()
            if not told and now - start >= _CLOSED_GRACE_S:  # a long wait, with no store to end it: say why
                told = True
                warnings.warn(f"close() of rank {self.rank} waits up to {self.timeout_s:g} s (timeout_s) for the "
                              f"commit records of {'rank' if len(absent) == 1 else 'ranks'} {', '.join(map(str, absent))} "
                              f"of the version of step {step} in {folder} (world={self.world}, given without a process "
                              "group of that many ranks)", stacklevel=4)
            unseen = [r for r in absent if r not in closed]
            seen = ranks_announced("checkpoint-closed", unseen, count) if unseen and count is not None else None
            closed.update((r, now) for r in seen or [])
            if now >= deadline or all(r in closed and now - closed[r] >= _CLOSED_GRACE_S for r in absent):
                break
            time.sleep(_RECORD_POLL_S)
            absent = missing()
        if not absent:
            return
        ranks = f"{'rank' if len(absent) == 1 else 'ranks'} {', '.join(map(str, absent))}"
        why = (f"{ranks} closed without writing {'its' if len(absent) == 1 else 'their'} record here"
               if all(r in closed for r in absent) else f"rank {self.rank} waited {self.timeout_s:g} s (timeout_s) for it"
               + ("" if grouped else "; there is no process group to tell whether the other ranks run: if this "
                  "process is the only one, give world=1, the default"))
        raise CheckpointError(
            f"the version of step {step} in {folder} has no commit record of {ranks} ({why}), so it is not complete "
            f"and will not restore: with {self.world} ranks every rank must make its Checkpointer on one shared "
            "directory (the same folder, on a file system every rank's host mounts; not one directory per rank) and "
            "call save() at the same steps: a version is complete only with every rank's record in its folder")

    def _stop_writer(self) -> None:
        """Hand the writer thread its stop after the saves queued, and wait for it to end."""
        with self._writer_lock:
            writer, self._writer = self._writer, None
            if writer is not None:
                self._jobs.put(None)
        if writer is not None:
            writer.join()

    def _finish_at_exit(self) -> None:
        """At exit: write the saves queued, saying so, then end the writer (NOTE [writer thread])."""
        if not self._written.is_set():
            print(f"ooc.checkpoint: writing the version of step {self._last_saved} before the interpreter exits (call "
                  "Checkpointer.close() to wait for it yourself)", file=sys.stderr, flush=True)
        self._stop_writer()

    def _check_open(self) -> None:
        if self._superseded:
            raise CheckpointError(
                f"this Checkpointer was superseded: a newer Checkpointer of rank {self.rank} on {self.directory} in "
                "this process took over the directory at its first save (as when a notebook cell that makes one runs "
                "again), after this one's last version was written, and closed this one. Save with the newer one; "
                "this one still reads (restore, versions). Two Checkpointers of one process saving two models (an EMA "
                "copy beside the model) take the directory from each other: give each a directory of its own")
        if self._closed:
            raise CheckpointError("this Checkpointer is closed (its stage listener is gone, so a lazy snapshot would "
                                  "be written unprotected from the next updates); make a new Checkpointer on the "
                                  "directory to save again")

    def _check_no_open_step(self) -> None:
        """Refuse a save between a backward and ``step()`` whose updates started in the backward.

        NOTE [a version holds committed steps]
        A version holds the state as of the last ``step()``: with ``pipeline=False`` or clipping
        (whose updates wait for ``step()``: NOTE [lazy snapshots]) a save between a backward and
        ``step()`` holds the state from before that backward. A pipelined HostAdamW has started the
        step's updates in the backward, and the state from before them is gone (``rollback`` keeps
        it aside only to undo them): such a version held a step no ``step()`` had committed, without
        the scheduler's step that follows it, and with ``rollback`` the update the next
        ``zero_grad()`` undoes, so a resume went on from a state the run never continued from. The
        save is refused instead, before anything is written."""
        uncommitted = getattr(self.optimizer, "uncommitted_buckets", None)
        started = uncommitted() if uncommitted is not None else []
        if started:
            names = ", ".join(self.optimizer.buckets[i].name for i in started)
            raise CheckpointError(f"save() between a backward and step(): the host updates of {names} started in the "
                                  "backward (pipeline=True) and no step() has committed them, so the version would "
                                  "hold half a step. Save after step(), or call zero_grad() first to reset the step "
                                  "(with rollback=True it undoes them)")

    def check_step(self, step: int) -> None:
        """Raise the :class:`CheckpointError` that ``save(step)`` would for its step, one at or below
        the newest intact version (NOTE [saves go forward]), or for a directory another job holds
        (NOTE [one job per directory]); write nothing. From a check that passes on, the
        Checkpointer holds the directory for its rank, as its first save would. A run can check its
        first save's step before it trains."""
        with self._save_lock:
            self._check_open()
            claimed = self._directory_lock is None
            if claimed:
                self._take_directory()
                # Read again now that no other job writes here: one that held the directory until now
                # may have committed versions since this Checkpointer last read it (NOTE [saves go forward]).
                self._newest = None
            if self._newest is None:
                self._learn(*_scan(self.directory))
            if step <= self._newest:
                if claimed:  # a refused check leaves the directory as it found it
                    self._let_go_of_directory()
                raise _refusal(self.directory, step, self._newest, again=step == self._last_saved)

    def _take_directory(self) -> None:
        """Hold the directory for this rank (NOTE [one job per directory]), taking it over from an
        earlier Checkpointer of this process that holds it (NOTE [a newer Checkpointer takes over])."""
        key = _holder_key(self.directory, self.rank)
        while True:
            with _HOLDERS_LOCK:
                ref = _HOLDERS.get(key)
                holder = ref() if ref is not None else None
                if holder is None or holder._closed:  # (closed: it let go of the directory)
                    _HOLDERS[key] = weakref.ref(self)
                    break
            superseded = holder._supersede()  # outside the registry's lock: it waits for a write
            if superseded is not None:
                _warn_taken_over(self, *superseded)
            del holder
        try:
            lock = _DirectoryLock.take(self.directory, self.rank)
        except BaseException:
            _forget_holder(key, self)
            raise
        self._directory_lock, self._directory_key = lock, key
        self._lock_finalizer = weakref.finalize(self, _let_go, lock, key)
        if lock.took_over and self.rank == 0:
            self._clean()  # a dead job's folders, left by the cleanup at construction while it looked live

    def _check_still_held(self) -> None:
        """Raise :class:`CheckpointError` if a job on another host took the directory over from this
        Checkpointer, judging it dead (NOTE [owner records]): it writes and deletes nothing more."""
        lock = self._directory_lock
        taker = lock.taken_over() if lock is not None else None
        if taker is not None:
            raise CheckpointError(
                f"this Checkpointer no longer holds the checkpoint directory {self.directory}: {taker} took it over, "
                f"as this process's heartbeat on {lock.path.with_suffix('.owner').name} had stopped for "
                f"{_STALE_SECONDS:.0f} s (the process stopped or suspended that long?). Its versions are that job's "
                "now; stop one of the two jobs, and save into another directory")

    def _let_go_of_directory(self) -> None:
        """Let go of the directory's lock, for another Checkpointer or job to take."""
        if self._directory_lock is not None:
            self._lock_finalizer.detach()
            _let_go(self._directory_lock, self._directory_key, self)
            self._directory_lock = None

    def _supersede(self) -> tuple[int | None, BaseException | None] | None:
        """Close this Checkpointer for a newer one of this process taking over its directory: wait
        for the version in flight, then close; ``save`` refuses from then on. Returns the step of the
        version that was in flight (None if none) and its error, or None if it was closed already
        (NOTE [a newer Checkpointer takes over])."""
        with self._save_lock:  # between two saves of another thread, never within one
            if self._closed:
                return None
            in_flight = None if self._written.is_set() else self._last_saved
            self._superseded = True
            error = None
            try:
                self.close()
            except BaseException as exc:  # noqa: BLE001 - the write's error: the warning tells it, no wait() will
                error = exc
            return in_flight, error

    def _learn(self, found: list[Version], damaged: dict[int, CorruptCheckpointError]) -> None:
        """Take the directory as read (``_scan``): the folders of its damaged records, and the
        newest version not known to be damaged (NOTE [saves go forward])."""
        for step, exc in damaged.items():
            self._note_damaged(step, self.directory / _name(step), exc)
        self._newest = max((v.step for v in found if v.step not in self._damaged), default=-1)

    def _note_damaged(self, step: int, folder: Path, exc: CorruptCheckpointError) -> None:
        if isinstance(exc, UnreadableCheckpointError):
            return  # maybe intact: never moved aside
        identity = _identity(folder)
        if identity is not None:
            self._damaged[step] = (identity, exc)

    def _move_damaged_aside(self) -> None:
        """Move aside the folders of the versions found damaged that are newer than the newest
        intact one, each with a warning naming it (NOTE [damaged versions moved aside])."""
        for step in sorted(s for s in self._damaged if s > self._newest):
            identity, exc = self._damaged[step]
            folder = self.directory / _name(step)
            try:
                moved = _move_aside(folder, identity)
            except OSError as error:
                raise CheckpointError(f"could not move the damaged version {folder} aside ({error}); move it "
                                      "away yourself") from error
            del self._damaged[step]
            if moved is not None:  # else another rank did
                warnings.warn(f"checkpoint version {folder} is damaged ({exc.path.name}: {exc.reason}); moved it "
                              f"aside to {moved.name}, kept for you to inspect or delete", stacklevel=3)

    def _payloads(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[int, list[tuple[Any, Any]]], list[Any]]:
        """This rank's files (name -> tensors dict for ``.safetensors``, JSON-able object for
        ``.json``, else a torch.save payload), the index of its optimizer tensors (NOTE
        [resharding]), the slots of live tensors per bucket, and the events of the device-to-host
        copies still in flight. When lazy, each bucket's tensors are left live (registered in the
        slots) and everything else is copied now (NOTE [lazy snapshots]); else everything is copied
        now (device tensors asynchronously: NOTE [device state copied asynchronously])."""
        opt = self.optimizer
        # A bucket whose update is held for step() (clipping) changes with no EXCHANGE to come: copied now.
        held = set(opt.held_buckets()) if self.lazy else set()
        bucket_of = {id(p): b.index for b in opt.buckets for p in b.params if b.index not in held} if self.lazy else {}
        slots: dict[int, list[tuple[Any, Any]]] = {}
        pending: list[Any] = []
        updated = {id(p) for b in opt.buckets for p in b.params} if hasattr(opt, "copies_in_after") else set()
        weights_copied = False

        def place(container: Any, key: Any, value: torch.Tensor, owner: torch.Tensor | None, what: str, file: str) -> None:
            nonlocal weights_copied
            _refuse_unsavable(what, value, file)  # here, not on the writer thread (NOTE [safetensors dtypes])
            bucket = bucket_of.get(id(owner)) if owner is not None else None
            if bucket is None:
                container[key] = _host_copy(value, pending)
                weights_copied |= owner is not None and id(owner) in updated and value is owner
            else:
                # Live, as its storage is now, not the Parameter: weight streaming points a streamed
                # parameter's .data at a fresh device copy for each block's forward, which the writer's
                # read is not ordered after (NOTE [live device tensors after the gate]).
                container[key] = value.detach()
                slots.setdefault(bucket, []).append((container, key))

        files: dict[str, Any] = {}
        model_extra: dict[str, Any] = {}  # modules' get_extra_state values: no tensors, so in the state file
        if self.rank == 0:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            weights: dict[str, torch.Tensor] = {}
            for name, value in self.model.state_dict(keep_vars=True).items():
                if isinstance(value, torch.Tensor):
                    place(weights, name, value, params.get(name), f"model tensor {name!r}", MODEL_FILE)
                else:
                    model_extra[name] = _clone(value)
            files[MODEL_FILE] = weights
            files[MODEL_INDEX] = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                                  "weight_map": {name: MODEL_FILE for name in weights}}
        index: dict[str, dict[str, Any]] = {}
        optimizer_meta = None
        if opt is not None:
            saved = opt.state_dict()
            order = [p for group in opt.param_groups for p in group["params"]]
            names = _param_names(self.model, order)
            info = saved.get("ooc")
            # Unsharded replicas hold equal state (every rank applies the same averaged gradients):
            # rank 0 writes it for all.
            writes = self.rank == 0 or bool(isinstance(info, dict) and info.get("sharded"))
            tensors: dict[str, torch.Tensor] = {}
            other: dict[str, dict[str, Any]] = {}
            for i, entry in saved["state"].items() if writes else ():
                owner = order[i] if isinstance(i, int) and i < len(order) else None
                pname = names[i] if isinstance(i, int) and i < len(names) else f"state{i}"
                for fname, value in entry.items():
                    if isinstance(value, torch.Tensor):
                        key = f"{pname}.{fname}"
                        place(tensors, key, value, owner, f"optimizer state {key!r}", _optimizer_file(self.rank))
                        index[key] = {"file": _optimizer_file(self.rank), "param": pname, "field": fname,
                                      "dtype": str(value.dtype), "global_shape": list(value.shape),
                                      "offsets": [0] * value.dim(), "shape": list(value.shape)}
                    else:
                        other.setdefault(pname, {})[fname] = _clone(value)
            if tensors:
                files[_optimizer_file(self.rank)] = tensors
            optimizer_meta = {"names": names, "param_groups": _clone(saved["param_groups"]), "other": other,
                              "ooc": _clone(info), "type": type(opt).__name__}
        if held:
            # The copies of the held buckets read their state and device weights on this thread's
            # compute stream; step() has them updated by the optimizer's thread, ordered by nothing
            # else: wait for the reads here, as the stage listener does for its copies aside (a
            # save between a backward and a clipped step() is rare; NOTE [lazy snapshots]).
            opt.backend.record_compute().synchronize()
        if weights_copied:
            # NOTE [weights read on another stream] in ooc.optim.pipeline: the copies above read the
            # live weights on this thread's current stream without waiting; the next update's copies
            # into them wait for this event (the training's stream may be another, which waits for
            # nothing of this one).
            opt.copies_in_after(opt.backend.record_compute())
        if slots:
            # NOTE [live device tensors after the gate]: the writer waits for this before its first read.
            pending.append(opt.backend.record_compute())
        files[_state_file(self.rank)] = {
            "scheduler": _clone(self.scheduler.state_dict()) if self.scheduler is not None else None,
            "rng": rng_state(),  # fresh tensors and tuples: no clone needed
            "extra": _clone(self.extra) if self.extra is not None else None,
            "optimizer": optimizer_meta,
            "model_extra": model_extra,
        }
        return files, index, slots, pending

    def _in_write_order(self, files: dict[str, Any], snapshot: _Snapshot | None) -> dict[str, Any]:
        """``files`` reordered: in each safetensors file the tensors under ``_DIRECT_MIN_BYTES`` first,
        then, for a lazy snapshot, the tensors of the buckets the last step updated first, first; the
        optimizer file first (NOTE [write order]).

        NOTE [write order]
        A bucket whose next update comes before the writer has read it is copied aside (NOTE [lazy
        snapshots]): host memory and CPU time on the update's thread, which the next forward waits
        for. The next step updates the buckets in the order the backward finishes them (the last
        block's first), as the last step did (recorded by the stage listener), a fraction of a step
        after ``save``; so the writer goes by those deadlines, earliest first (``_Snapshot.deadline``).
        A bucket's update changes its moments and masters (the optimizer file) and its weights (the
        model file) at once, so the two files are written together (:func:`_write_tensor_files`),
        each bucket's tensors in both before the next bucket's: written one file after the other,
        every bucket updated while the first file was written had its weights copied aside. On gpt2
        the first bucket the backward updates was complete after 971 MiB written (the optimizer file
        first), now after 81 MiB, the k-th after 81k MiB; saved every 10 steps while training, 3.7 to
        11 buckets and 81 to 348 MiB were copied aside per version, now 0 to 0.3 and 0 to 98 MiB
        (the embedding's bucket, 442 MiB written last, in a version whose write it outran; busy
        machine, 3 versions a run). A safetensors file may list its tensors in any order (readers go
        by each one's offsets); tensors no bucket holds were copied in ``save`` and go last.

        Small tensors (under ``_DIRECT_MIN_BYTES``) go first, in that order too. They are never
        written straight from memory (NOTE [writes straight from the tensors]), and there they shift
        no large tensor's file offset: each parameter's 4-byte ``step`` between its moments moved the
        offsets of all the next ones by 4 bytes against their memory, so that only the first few
        agreed with it modulo the disk's alignment (a third of the bytes of a 100M-parameter state
        went straight from memory, all of them with small tensors first). Written first, they are
        never copied aside."""

        def reordered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            """``tensors`` itself, its entries reinserted in write order: the snapshot's slots are
            (this dict, key), so the dict must stay the one they name."""
            def order(item: tuple[str, torch.Tensor]) -> tuple[bool, int]:
                deadline = snapshot.deadline(tensors, item[0]) if snapshot is not None else 0
                return item[1].numel() * item[1].element_size() >= _DIRECT_MIN_BYTES, deadline

            items = sorted(tensors.items(), key=order)  # stable
            tensors.clear()
            tensors.update(items)
            return tensors

        optimizer = _optimizer_file(self.rank)
        out = {optimizer: reordered(files[optimizer])} if optimizer in files else {}
        for name, payload in files.items():
            if name != optimizer:
                out[name] = reordered(payload) if name.endswith(".safetensors") else payload
        return out

    def _on_stage(self, bucket: int, stage: Stage) -> None:
        """Stage listener: the bucket's UPDATE comes next, on this thread; wait for the writer's read
        of the bucket, if one is in progress, and copy aside what it has not read yet (NOTE [lazy
        snapshots])."""
        if stage is Stage.EXCHANGE:
            if bucket in self._updating:  # a bucket updated again: the previous step's order is complete
                self._update_order, self._updating = self._updating, []
            self._updating.append(bucket)
        snapshot = self._snapshot
        if stage is Stage.EXCHANGE and snapshot is not None and snapshot.before_update(bucket):
            self.copied_by_listener += 1
            backend = getattr(self.optimizer, "backend", None)
            if backend is not None:
                # The copy aside read the bucket's device parameters on this thread's compute stream;
                # the update's copy in, issued next, waits only for the event recorded after the
                # bucket's backward. Wait for the read before that copy may overwrite them (on CUDA
                # ``.to("cpu")`` has returned after its copy; the event says so to every backend).
                backend.record_compute().synchronize()

    def _before_model_load(self, *_: Any) -> None:
        """A load into the model is about to write the live parameters: the write in flight first
        copies aside what it has not read (NOTE [lazy snapshots])."""
        snapshot = self._snapshot
        if snapshot is not None:
            for bucket in range(len(self.optimizer.buckets)):
                snapshot.before_update(bucket)

    def wait(self) -> None:
        """Block until the last save is committed; raise its error, if it failed."""
        self._written.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, step: int, files: dict[str, Any], tensors: dict[str, dict[str, Any]],
               metadata: dict[str, Any], pending: list[Any]) -> None:
        folder = self.directory / _name(step)
        lock = None
        try:
            for event in pending:
                event.synchronize()  # save()'s copies of device state have landed in host memory
            if self._snapshot is not None:
                self._snapshot.landed()  # and the updates' copies into the live weights
            if self._snapshot is not None:
                self._hook("snapshot")
            self._release_held(everything=False)
            self._check_still_held()
            lock = _FolderLock.writing(folder)
            self._write_version(folder, step, files, tensors, metadata, lock)
            self._end_snapshot()  # every live slot written: the listener has nothing more to do
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._end_snapshot()
            self._remove_partial(folder, step, files, lock)
            if isinstance(exc, CheckpointError):
                self._error = exc
            else:
                error = CheckpointError(f"could not write checkpoint {folder}: {exc}{self._what_to_do(exc, step)}")
                error.__cause__ = exc
                self._error = error

    def _what_to_do(self, exc: BaseException, step: int) -> str:
        """For the error of a file system (``OSError``: "[Errno 28] No space left on device", which
        named neither the file nor what became of the version): whether version ``step`` was
        committed, the newest version there is, and, for a full disk or a file size limit, what
        to do."""
        if not isinstance(exc, OSError):
            return ""
        if self._newest == step:
            return ". The version was committed (latest()); the error came after, in the retention of older versions"
        newest = f"step {self._newest}" if self._newest is not None and self._newest >= 0 else "none"
        left = f". The version was not committed; the newest version is still {newest} (latest())"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"{left}. Free space (or quota) on the file system of {self.directory}, or keep fewer versions "
                    "(keep=), and save again")
        if exc.errno == errno.EFBIG:
            return (f"{left}. A file of the version is larger than this process may write (`ulimit -f`, "
                    "RLIMIT_FSIZE) or than the file system takes: raise the limit, or save elsewhere, and save again")
        return f"{left}; save again once the cause is fixed"

    def _check_unchanged(self, step: int) -> None:
        """Raise if a live tensor of the lazy snapshot changed in place before the writer read it all.

        NOTE [changes the snapshot does not see]
        A lazy snapshot (NOTE [lazy snapshots]) leaves the buckets' tensors live, safe from the
        optimizer's updates (the stage listener) and from loads into the model (a pre-hook), which
        copy aside what the writer has not read. A change of the loop's own, between ``save`` and the
        end of the write (``p.clamp_()`` of WGAN weights, a max-norm projection, an EMA written into
        the model), reached the file: the version held a state that never was, its checksums those
        of the bytes written, so it restored without a word. Each live tensor's version counter
        (bumped by every in-place change) is taken at ``save``, and again once the copies in flight then
        have landed (the writer waits for them: they are part of the state at ``save``, and a backend
        whose copy engine runs ``copy_`` late bumps the counter then); a tensor whose counter differs when
        its last slice has been read (and was not copied aside first) fails the write, which commits
        nothing, naming it and what to do."""
        snapshot = self._snapshot
        if snapshot is None or not snapshot.changed:
            return
        raise CheckpointError(
            f"tensors {_first_few(sorted(map(str, snapshot.changed)))} were changed in place after save({step}) returned "
            "and before its version was written, not by the optimizer's step (whose updates the write is ordered "
            "with), so the version would hold a state that never was: nothing of it was committed. Call ckpt.wait() "
            "before changing parameters outside optimizer.step() (clamping, a norm projection, an EMA written into "
            "the model), or make the Checkpointer with lazy=False to copy the state in save()")

    def _end_snapshot(self) -> None:
        """The version is written (or failed): the listener has nothing more to do, and its copies
        aside are the next version's buffers (NOTE [reused copies aside])."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is not None:
            with snapshot._cond:  # the optimizer's thread copies aside under this lock
                # A listener that took the snapshot before it ended copies nothing more (after a
                # failed write some slots were never read; their version is gone).
                snapshot._unread.clear()
                copies = list(snapshot.copies)
            self._aside.keep(copies)

    def _write_version(self, folder: Path, step: int, files: dict[str, Any], tensors: dict[str, dict[str, Any]],
                       metadata: dict[str, Any], lock: _FolderLock) -> None:
        """Write and commit this rank's files of version ``step`` into ``folder``, whose ``lock`` it
        holds (NOTE [folder locks]); then let go of it and apply retention."""
        record_name = f"manifest-rank{self.rank}.json"
        if (folder / record_name).exists():  # committed since save() looked (another process's Checkpointer)
            raise _refusal(self.directory, step, step)
        tensor_files = [name for name in files if name.endswith(".safetensors")]
        for name in tensor_files:
            self._hook(f"write:{name}")
            self._recycle(folder / name)
        written = _write_tensor_files([(folder / name, _TensorFile(
            files[name], self._snapshot, lambda key, name=name: self._hook(f"tensor:{name}:{key}")))
            for name in tensor_files])  # together, by the snapshot's deadlines (NOTE [write order])
        self._check_unchanged(step)
        records = {name: {"bytes": size, "xxh3": digest} for name, (size, digest) in zip(tensor_files, written)}
        for name, payload in files.items():
            if name in records:
                continue
            self._hook(f"write:{name}")
            self._recycle(folder / name)
            chunks = [json.dumps(payload).encode()] if name.endswith(".json") else [_state_bytes(name, payload)]
            size, digest = _write_file(folder / name, chunks)  # json: no indent, json's C encoder
            records[name] = {"bytes": size, "xxh3": digest}
        # Every file's bytes are durable (_write_file fsyncs each once, after its last byte); now its
        # name in the folder and the folder's in the directory, before the commit names them.
        _fsync_dirs(folder, self.directory)
        self._hook("files-written")
        manifest = {"format": FORMAT, "step": step, "rank": self.rank, "created": time.time(), "metadata": metadata,
                    "layout": self.layout, "files": records, "tensors": tensors}
        # As a reader parses it (JSON makes keys strings, tuples lists), so that its digest holds there.
        manifest = json.loads(json.dumps(manifest))
        manifest[_RECORD_DIGEST] = _record_digest(manifest)  # NOTE [damaged records]
        tmp = folder / f".{record_name}.tmp"
        _write_file(tmp, [json.dumps(manifest).encode()])
        self._hook("manifest-written")
        os.replace(tmp, folder / record_name)  # the commit
        self._newest = step  # save() refused any step not above it (NOTE [saves go forward])
        self._committed_step = step
        self._hook("renamed")
        _fsync_dir(folder)  # the commit durable before wait() returns and retention deletes older versions
        self._hook("committed")
        self._committed_lock(lock, step)
        if self.rank == 0:
            self._retain()

    def _committed_lock(self, lock: _FolderLock, step: int) -> None:
        """This rank committed ``lock``'s version: let go of the lock if every rank has, else hold
        it until they have (NOTE [folder locks])."""
        if _committed(lock.folder, step) is not None:
            lock.release(complete=True)
        elif lock not in self._held:
            self._held.append(lock)

    def _release_held(self, *, everything: bool) -> None:
        """Let go of the held locks of versions every rank has committed since, or older than one
        they have (each rank finishes a version's write before its next save, so no rank writes
        them any more; one that failed on a rank is then retention's to remove); ``everything``: of
        all, at close."""
        if not self._held:
            return
        newest = max((v.step for v in self.versions()), default=-1)
        for lock in list(self._held):
            step = int(_VERSION_RE.match(lock.folder.name).group(1))
            complete = _committed(lock.folder, step) is not None
            if complete or step < newest or everything:
                lock.release(complete=complete)
                self._held.remove(lock)

    def _remove_partial(self, folder: Path, step: int, files: dict[str, Any], lock: _FolderLock | None) -> None:
        """After a failed write: remove this rank's files of the uncommitted version, and the folder
        unless another rank still writes into it (NOTE [folder locks])."""
        if (folder / f"manifest-rank{self.rank}.json").exists():
            if lock is not None:
                self._committed_lock(lock, step)  # committed; the failure came later (retention)
            return
        for name in [*files, f".manifest-rank{self.rank}.json.tmp"]:
            try:
                (folder / name).unlink(missing_ok=True)
            except OSError:
                # A file system gone read-only (ext4 on a disk error): the write's error is the one to
                # raise, and the folder, let go of, is the next cleanup's to remove.
                pass
        if lock is not None:
            lock.release(complete=False)
        _remove_unless_written(folder, step)

    def _retain(self) -> None:
        """Delete all but the newest ``keep`` complete versions, and incomplete folders older than
        the newest complete one (left by a crash). With several ranks, one version more than
        ``keep`` may remain until the next save (rank 0 deletes only behind a version every rank
        has committed)."""
        self._check_still_held()
        complete, damaged = _scan(self.directory)
        if not complete:
            return
        keep = {v.step for v in complete[-self.keep:]} if self.keep is not None else {v.step for v in complete}
        newest = complete[-1].step
        # A damaged version is kept and reported, never taken for a crash's leftover (NOTE [damaged records]).
        doomed = [(step, path) for step, path in self._folders() if step not in keep and step < newest and step not in damaged]
        if doomed:
            for spare in self._spares():  # what the version just written did not take (NOTE [recycled files])
                shutil.rmtree(spare, ignore_errors=True)
        committed = {v.step for v in complete}
        for k, (step, path) in enumerate(doomed):
            if step not in committed:
                _remove_unless_written(path, step)  # a crash's, unless another Checkpointer writes it
                continue
            if k == len(doomed) - 1:
                try:
                    self._retire(step, path)
                    continue
                except OSError:
                    pass  # e.g. another Checkpointer's cleanup took the folder meanwhile: delete what is left
            shutil.rmtree(path, ignore_errors=True)

    def _retire(self, step: int, path: Path) -> None:
        """Make a complete version that retention deletes the next version's spare (NOTE [recycled
        files]): its commit records go first, durably, then the folder is renamed out of sight."""
        for record in path.glob("manifest-rank*.json"):
            record.unlink()
        _fsync_dir(path)
        self._hook("retired")
        os.replace(path, self.directory / f".spare-{step:09d}")

    def _spares(self) -> list[Path]:
        return sorted(p for p in self.directory.iterdir() if _SPARE_RE.match(p.name)) if self.directory.is_dir() else []

    def _recycle(self, path: Path) -> None:
        """Move a spare's file of ``path``'s name to ``path``, to be written over (NOTE [recycled
        files]); without one (or if another rank's cleanup removed it meanwhile), ``path`` is new."""
        if path.exists() or not self._recycles:
            return
        for spare in self._spares():
            if not _unshared(spare / path.name):
                continue
            try:
                os.rename(spare / path.name, path)
                return
            except OSError:
                continue

    def _clean(self) -> None:
        """Remove temporary files, lock files and incomplete versions a crashed writer left (rank
        0, before any save): an incomplete folder another Checkpointer on the directory is writing
        stays (NOTE [folder locks])."""
        found, damaged = _scan(self.directory)  # damaged: kept and reported, no crash's leftovers (NOTE [damaged records])
        self._learn(found, damaged)
        complete = {v.step for v in found}
        for step, path in self._folders():
            if step not in damaged and (step not in complete or (path / _LOCK_FILE).exists()):
                _remove_unless_written(path, step)  # a committed version keeps all but its lock file
            if step in complete or step in damaged:
                for tmp in path.glob(".*.tmp"):
                    tmp.unlink(missing_ok=True)
        for leftover in self._spares() + self._removing():
            shutil.rmtree(leftover, ignore_errors=True)
        for path in self.directory.iterdir():
            if _WRITER_LOCK_RE.match(path.name):
                _remove_stale_writer_lock(path)  # a killed job's (NOTE [one job per directory])
            elif _OWNER_RE.match(path.name):
                _remove_dead_record(path)  # a killed job's (NOTE [owner records])
            elif _OWNER_LEFTOVER_RE.match(path.name):
                _remove_leftover(path)

    def _removing(self) -> list[Path]:
        """Folders a cleanup moved away to delete, left by a crash meanwhile (NOTE [folder locks])."""
        return [p for p in self.directory.iterdir() if _REMOVING_RE.match(p.name)] if self.directory.is_dir() else []

    # -- reading -----------------------------------------------------------------------------

    def _folders(self) -> list[tuple[int, Path]]:
        return _version_folders(self.directory)

    def versions(self) -> list[Version]:
        """The committed versions, oldest first (an incomplete or unreadable one is left out)."""
        return list_versions(self.directory)

    def latest(self) -> Version | None:
        """The newest committed version, or None."""
        found = self.versions()
        return found[-1] if found else None

    def restore(self, version: int | Version | None = None, *, fallback: bool = False) -> Version:
        """Load version ``version`` (a step or a :class:`Version`; default the newest) into the
        model, optimizer, scheduler, RNG states and ``extra``; return it. Waits for a pending save.
        Every file is checked against its commit record first (a mismatch raises
        :class:`CorruptCheckpointError` naming the file, and nothing is loaded; so does a damaged
        commit record, NOTE [damaged records]); with
        ``fallback=True`` the newest intact version at or before the one asked for is loaded instead.

        NOTE [every rank restores]
        In a data-parallel run every rank must call ``restore`` (each loads the weights and its share of
        the optimizer's state). ``if rank == 0: ckpt.restore()``, the habit of torch.save checkpoints,
        loaded the version on rank 0 alone: the other ranks went on from their own weights and the
        ranks parted without a word. So, with a process group of ``world`` ranks, ``restore`` first
        waits up to ``timeout_s`` for every rank to call it (``ranks_not_arrived``: on the group's
        store, not a collective that would hang), and raises naming the ranks that did not."""
        step = self._asked_step(version)  # refused before any wait
        if self.world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() == self.world:
            missing = ranks_not_arrived(f"restore:{self.directory}", self.timeout_s)
            if missing:
                raise CheckpointError(
                    f"restore() on rank {self.rank} waited {self.timeout_s:g} s for rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))}, which did not call it: every rank of a data-parallel run must call "
                    "restore() (each loads the weights and its share of the optimizer state; on one rank alone the "
                    "ranks part). Call ckpt.restore() on every rank, not under `if rank == 0`, and restart the ranks"
                )
        self.wait()
        found, damaged = _scan(self.directory)  # NOTE [damaged records]
        if not found and not damaged:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is None:
            step = max([v.step for v in found] + list(damaged))
        elif step not in damaged and step not in {v.step for v in found}:
            raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory}; "
                                  f"there are {[v.step for v in found]}")
        candidates = [v for v in found if v.step <= step]
        errors = []
        if step in damaged:
            if not fallback:
                raise damaged[step]
            errors.append(damaged[step])
        for v in reversed(candidates):
            try:
                payloads = self._read(v)
                if fallback and self.optimizer is not None:
                    self._check_others_files(v, payloads["files"])  # NOTE [every rank falls back alike]
            except CorruptCheckpointError as exc:
                if not fallback:
                    raise
                errors.append(exc)
                self._note_damaged(v.step, v.path, exc)  # judged alike on every rank: NOTE [every rank falls back alike]
                continue
            self._load(v, payloads)
            self._learn(found, damaged)
            self._warn_params_outside(stacklevel=3)  # from the caller of restore
            return v
        self._learn(found, damaged)
        raise NoIntactVersionError(self.directory, errors)

    def _asked_step(self, version: int | Version | None) -> int | None:
        """The step ``version`` names (None: the newest), for :meth:`restore` and :meth:`export`.
        ``int(version)`` took ``2.7`` for step 2 and ``True`` for step 1, and a :class:`Version` of
        another directory for this directory's version of its step: each is refused, as ``save``
        refuses a step that is no integer."""
        if version is None:
            return None
        if isinstance(version, Version):
            if os.path.abspath(version.path.parent) != os.fspath(self.directory):
                raise ValueError(f"version {version.path} is not in this Checkpointer's directory {self.directory}: "
                                 f"restore or export it with a Checkpointer on {version.path.parent}, or pass its "
                                 "step to restore this directory's version of that step")
            return version.step
        if isinstance(version, bool):
            raise TypeError(f"version must be a step (an int), a Version or None, got {version!r}")
        try:
            return operator.index(version)  # np.int64 or a 0-d integer tensor: an int
        except TypeError:
            raise TypeError(f"version must be a step (an int), a Version or None, got {version!r} "
                            f"({type(version).__name__}): int({version!r}) if you mean that step") from None

    def _read(self, v: Version) -> dict[str, Any]:
        """Read and check every file this rank needs from ``v`` (saved by any number of ranks, NOTE
        [resharding]); nothing is loaded yet."""
        if v.format not in READABLE_FORMATS:
            raise CheckpointError(f"checkpoint {v.path} has format {v.format}; this ooc reads formats "
                                  f"{', '.join(map(str, READABLE_FORMATS))}. "
                                  "Restore it with the ooc that wrote it and save it again")
        weights = self._file(v, MODEL_FILE)
        if MODEL_INDEX in v.files:  # not loaded here, but HF loaders read it: intact only if it is too
            _checked_bytes(v.path / MODEL_INDEX, v.files[MODEL_INDEX])
        states = [self._file(v, _state_file(r)) for r in range(v.world)]
        weights.update(states[0].get("model_extra") or {})
        cast = self._check_fits(v, weights)
        state = states[self.rank] if self.rank < v.world else {**states[0], "rng": None}
        optimizer, read = self._optimizer_state(v, states) if self.optimizer is not None else (None, set())
        return {"weights": weights, "state": state, "optimizer": optimizer, "cast": cast,
                "files": {MODEL_FILE, *map(_state_file, range(v.world)), *read}}

    @staticmethod
    def _check_others_files(v: Version, read: set[str]) -> None:
        """Check the optimizer files of ``v`` this rank did not read.

        NOTE [every rank falls back alike]
        A rank reads only the optimizer files holding state it updates (NOTE [resharding]). With
        ``restore(fallback=True)``, a version whose damaged file only other ranks read was loaded
        here and skipped there: the ranks went on from different versions, without a word. So a
        fallback judges a version by every optimizer file any rank may read; each rank reads the
        same commit records and bytes, so each decides alike, with no collective."""
        for name in sorted({sl["file"] for slices in v.tensors.values() for sl in slices} - read):
            _checked_bytes(v.path / name, v.files[name])

    def _check_fits(self, v: Version, weights: dict[str, torch.Tensor]) -> list[str]:
        """Raise unless ``weights`` have the model's names and shapes: checked before anything is
        loaded, as ``load_state_dict`` copies every tensor that fits before it reports the others.
        Return the tensors ``load_state_dict`` will cast to another dtype (NOTE [a resume into other
        dtypes])."""
        own = self.model.state_dict()
        missing = [k for k in own if k not in weights]
        unexpected = sorted(k for k in weights if k not in own)
        shapes = [f"{k}: saved {list(weights[k].shape)}, now {list(t.shape)}" for k, t in own.items()
                  if isinstance(weights.get(k), torch.Tensor) and isinstance(t, torch.Tensor) and weights[k].shape != t.shape]
        if missing or unexpected or shapes:
            differences = ", ".join(f"{len(names)} {what} ({_first_few(names)})" for what, names in
                                    (("missing", missing), ("unexpected", unexpected), ("of other shapes", shapes)) if names)
            raise CheckpointError(f"checkpoint {v.path} does not fit the model: tensors {differences}; build the model "
                                  "as it was saved")
        return [f"{k}: saved {weights[k].dtype}, now {t.dtype}" for k, t in own.items()
                if isinstance(weights.get(k), torch.Tensor) and isinstance(t, torch.Tensor) and weights[k].dtype != t.dtype]

    @staticmethod
    def _file(v: Version, name: str) -> Any:
        if name not in v.files:
            raise CheckpointError(f"checkpoint {v.path} has no {name}")
        return _load_file(v.path / name, v.files[name])

    def _optimizer_state(self, v: Version, states: list[dict[str, Any]]) -> tuple[dict[str, Any], set[str]]:
        """The optimizer's ``state_dict`` for this rank: the state of the parameters it updates,
        each tensor assembled from its slices in whichever rank's file they are (NOTE [resharding]);
        and the names of the files read."""
        opt = self.optimizer
        metas = [s.get("optimizer") for s in states]
        if metas[0] is None:
            raise CheckpointError(f"checkpoint {v.path} holds no optimizer state; restore it without an optimizer")
        order = [p for group in opt.param_groups for p in group["params"]]
        names = _param_names(self.model, order)
        if names != metas[0]["names"]:
            saved = metas[0]["names"]
            first = next((f"{a!r} saved, {b!r} now" for a, b in zip(saved, names) if a != b),
                         f"{len(saved)} saved, {len(names)} now")
            raise CheckpointError(f"checkpoint {v.path} holds the state of other parameters than this optimizer's "
                                  f"({first}); build the model and optimizer as they were saved")
        saved_groups = [len(g["params"]) for g in metas[0]["param_groups"]]
        groups = [len(g["params"]) for g in opt.param_groups]
        if saved_groups != groups:  # else load_state_dict refuses, after the model is loaded
            raise CheckpointError(f"checkpoint {v.path} holds an optimizer of {len(saved_groups)} parameter group(s) of "
                                  f"{saved_groups} parameters, this one has {len(groups)} of {groups}; build the "
                                  "optimizer's groups as they were saved")
        self._check_hyperparameters(v, metas[0])
        other: dict[str, dict[str, Any]] = {}
        for meta in metas:
            other.update(meta["other"] if meta is not None else {})
        by_param: dict[str, list[str]] = {}
        for key, slices in v.tensors.items():
            by_param.setdefault(slices[0]["param"], []).append(key)
        host = hasattr(opt, "buckets")  # HostAdamW: the parameters it updates have state now, the others none
        wanted = [i for i, p in enumerate(order) if not host or p in opt.state]
        needed = {sl["file"] for i in wanted for key in by_param.get(names[i], ()) for sl in _distinct(v.tensors[key])}
        loaded = {name: self._file(v, name) for name in sorted(needed)}
        state: dict[int, dict[str, Any]] = {}
        for i in wanted:
            entry = dict(other.get(names[i], {}))
            for key in by_param.get(names[i], ()):
                entry[v.tensors[key][0]["field"]] = _assemble(v, key, loaded)
            if entry:  # none: never updated (NOTE [a fresh state is not saved] in ooc.optim.host_adamw)
                state[i] = entry
        result = {"state": state, "param_groups": metas[0]["param_groups"]}
        info = metas[0]["ooc"]
        if isinstance(info, dict):
            # Who holds which share is what restoring on other ranks changes; the rest must match.
            result["ooc"] = {k: val for k, val in info.items() if k not in ("world", "sharded", "rank")}
        return result, set(loaded)

    def _check_hyperparameters(self, v: Version, meta: dict[str, Any]) -> None:
        """Raise unless the saved parameter groups hold every hyperparameter this optimizer reads.

        NOTE [an optimizer of another kind]
        ``Optimizer.load_state_dict`` takes the saved groups whole, whatever optimizer saved them: a
        version of an SGD restored into an AdamW loaded the model, then failed with ``KeyError:
        'step'`` (or, AdamW's into SGD, ``KeyError: 'momentum'`` at the next step), the run's
        optimizer left with another's hyperparameters. A group lacking a key of this optimizer's
        ``defaults`` is of another kind: refused before anything is loaded. Kinds that share their
        hyperparameters (Adam, AdamW, HostAdamW) load each other's state, as before. A version of
        the same class is never refused: saved by an older torch, its groups lack the hyperparameters
        the class gained since (Adam's ``decoupled_weight_decay``, SGD's ``fused``), which the class's
        ``load_state_dict`` fills in with their defaults (``__setstate__``)."""
        defaults = getattr(self.optimizer, "defaults", None)
        if not isinstance(defaults, dict) or meta.get("type") == type(self.optimizer).__name__:
            return
        lacking = sorted({key for group in meta["param_groups"] for key in defaults if key not in group})
        if lacking:
            saver = f" (saved by {meta['type']})" if "type" in meta else ""
            raise CheckpointError(f"checkpoint {v.path} holds the state of another kind of optimizer{saver}: its "
                                  f"parameter groups lack {', '.join(map(repr, lacking))}, which this "
                                  f"{type(self.optimizer).__name__} reads; build the optimizer as it was saved, or "
                                  "restore the weights alone (a Checkpointer without an optimizer)")

    def _load(self, v: Version, payloads: dict[str, Any]) -> None:
        check = getattr(self.optimizer, "check_loadable", None)  # HostAdamW: options checked before any load
        if check is not None:
            check(payloads["optimizer"])
        state = payloads["state"]
        if self.scheduler is not None and state["scheduler"] is not None:
            # First: a scheduler of another type refuses the state with nothing else loaded yet.
            try:
                self.scheduler.load_state_dict(state["scheduler"])
            except Exception as exc:  # noqa: BLE001 - any refusal, named with the scheduler
                raise CheckpointError(f"checkpoint {v.path} holds an LR scheduler's state that this "
                                      f"{type(self.scheduler).__name__} does not load ({exc!r}); build the scheduler "
                                      "as it was saved") from exc
        self.model.load_state_dict(payloads["weights"])  # names and shapes checked in _read
        if self.optimizer is not None:
            self.optimizer.load_state_dict(payloads["optimizer"])
            _params_from_masters(self.optimizer)
        if self.extra is not None and state["extra"] is not None:
            self.extra.clear()
            self.extra.update(state["extra"])
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        self._warn_left_out(v, state)
        if payloads["cast"] and self.optimizer is not None:
            # NOTE [a resume into other dtypes]
            # load_state_dict casts each weight (and torch's optimizers their state) to the model's
            # dtype: fp32 weights and moments restored into a bf16 model were rounded, and the run
            # went on, no longer the one saved, without a word (HostAdamW refuses such a state).
            # Weights alone (no optimizer: evaluation, export) are cast as asked.
            warnings.warn(f"checkpoint {v.path} was restored into a model of other dtypes, {len(payloads['cast'])} "
                          f"tensor(s) cast ({_first_few(payloads['cast'])}): the run does not continue as the one "
                          "saved. Build the model in the dtypes it was saved in (model.to(dtype)) to resume it",
                          stacklevel=3)

    def _warn_left_out(self, v: Version, state: dict[str, Any]) -> None:
        """Warn when a restore to train on (with an optimizer) leaves out a scheduler's state or
        ``extra`` that the version holds, for want of a place to load it.

        NOTE [state a restore leaves out]
        A resume whose Checkpointer was made without the ``scheduler=`` (or ``extra=``) that saved
        the version restored the rest and returned: the LR schedule started over (or the data
        position stayed at its start) and the run went on, no longer the one that was stopped, without
        a word. A restore without an optimizer (weights for evaluation or export) is told nothing."""
        if self.optimizer is None:
            return
        left_out = [(what, argument) for what, argument, ours, saved in (
            ("an LR scheduler's state", "scheduler=", self.scheduler, state["scheduler"]),
            ("an extra dict", "extra=", self.extra, state["extra"])) if ours is None and saved is not None]
        if left_out:
            arguments = " and ".join(argument for _, argument in left_out)
            warnings.warn(f"checkpoint {v.path} holds {' and '.join(what for what, _ in left_out)}, which this "
                          f"Checkpointer, made without {arguments}, did not restore: the run does not continue as "
                          f"the one saved. Make the Checkpointer with the {arguments} it was saved with",
                          stacklevel=4)

    def export(self, version: int | Version | None, path: str | os.PathLike[str]) -> Path:
        """Write one version's model weights (checked) to ``path`` as a safetensors file, loadable
        with ``safetensors.torch.load_file`` into a plain PyTorch model (a directory: to its
        ``model.safetensors``, the file HF's ``from_pretrained`` reads; a path that ends with a slash is
        a directory, made if need be); return the file's path."""
        step = self._asked_step(version)
        versions, damaged = _scan(self.directory)
        found = {v.step: v for v in versions}
        if step is None:
            if not found and not damaged:  # (it said "no complete checkpoint for step None")
                raise CheckpointError(f"no complete checkpoint in {self.directory}")
            step = max([*found, *damaged])
        if step in damaged:  # as restore() names it (it said there was no version of that step)
            raise damaged[step]
        if step not in found:
            raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory}; there are {sorted(found)}")
        v = found[step]
        data = _checked_bytes(v.path / MODEL_FILE, v.files[MODEL_FILE])
        newest = self._newest_weights(v)
        if newest:  # NOTE [a delayed version's newest weights]
            weights = _load_file(v.path / MODEL_FILE, v.files[MODEL_FILE])
            for name, master in newest.items():
                if name in weights:  # a copy per name: safetensors refuses tensors that share memory
                    weights[name] = master.to(dtype=weights[name].dtype, copy=True)
            data = safetensors.torch.save(weights, metadata={"format": "pt"})
        out = Path(path)
        if os.fspath(path).endswith(os.sep):  # "weights/": a directory, made if need be (Path drops the slash)
            out.mkdir(parents=True, exist_ok=True)
        if out.is_dir():
            out = out / MODEL_FILE
        if not out.parent.is_dir():  # else the error would name the temporary file below
            raise CheckpointError(f"no directory {out.parent} to export {out.name} into; make it first, or end the "
                                  "path with a slash to export into a directory of that name")
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            _write_file(tmp, [data])
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a copy of every weight: not left beside the path
            raise
        return out

    def _newest_weights(self, v: Version) -> dict[str, torch.Tensor]:
        """The fp32 masters of ``v`` that are newer than its model file's weights (HostAdamW with
        ``delayed_update``: every parameter's that has one), under every name of their parameter in
        the model (tied weights); {} for any other version.

        NOTE [a delayed version's newest weights]
        With ``delayed_update`` the parameters lag their masters by one update on purpose, and a
        version saves both as they are: a restore puts the masters in at the next step's launch, as
        the run would have. So the model file lacks the last update, and ``export()``, which copied
        it, shipped weights one update behind the optimizer. An export is the end of training (no
        next step), so it writes the masters instead, each cast to its parameter's dtype as a
        ``step()`` does; the version's own files stay as saved."""
        meta = self._file(v, _state_file(0)).get("optimizer")
        info = meta.get("ooc") if isinstance(meta, dict) else None
        if not (isinstance(info, dict) and info.get("delayed_update")):
            return {}
        masters = {slices[0]["param"]: key for key, slices in v.tensors.items() if slices[0]["field"] == "master"}
        loaded = {name: self._file(v, name)
                  for name in sorted({sl["file"] for key in masters.values() for sl in _distinct(v.tensors[key])})}
        by_first = {names[0]: names for names in _names_of_params(self.model).values()}
        newest = {}
        for param, key in masters.items():
            master = _assemble(v, key, loaded)
            newest.update((name, master) for name in by_first.get(param, [param]))
        return newest

    def close(self, *, check_ranks: bool = True) -> None:
        """Wait for the last save (raising its error), end the writer thread, remove the stage
        listener and free the kept copies aside; a later :meth:`save` raises (restoring still works).
        Closing again does nothing.

        With several ranks, first wait up to ``timeout_s`` for the other ranks' records of the last
        version this rank committed, and raise :class:`CheckpointError` naming the ranks whose
        records never came (NOTE [every rank commits where this rank does]); ``check_ranks=False``
        (closing after an error, when a rank may be gone) does not wait."""
        with self._save_lock:
            if not self._closed:
                self._close(check_ranks and not self._superseded)

    def _close(self, check_ranks: bool = False) -> None:
        try:
            self.wait()
            if check_ranks:
                self._check_every_rank_committed()
        finally:
            self._stop_writer()
            if self.lazy and self._listener in self.optimizer.stage_listeners:
                self.optimizer.stage_listeners.remove(self._listener)
            if self._load_hook is not None:
                self._load_hook.remove()
                self._load_hook = None
            self._aside.keep([])  # NOTE [reused copies aside]
            self._release_held(everything=True)
            if self.rank == 0:
                for spare in self._spares():  # the directory holds its versions only (NOTE [recycled files])
                    shutil.rmtree(spare, ignore_errors=True)
            self._let_go_of_directory()  # another job may write here now (NOTE [one job per directory])
            self._closed = True


def _serve(jobs: queue.SimpleQueue[tuple[Any, ...] | None], ref: weakref.ref[Checkpointer]) -> None:
    """The writer thread of the Checkpointer ``ref``: write each save handed over, until none came
    for ``_IDLE_SECONDS``, or :meth:`Checkpointer.close`, or the Checkpointer is collected (NOTE
    [writer thread]). A job holds its Checkpointer (a version in flight is written); the waiting
    thread does not."""
    while True:
        try:
            job = jobs.get(timeout=_IDLE_SECONDS)
        except queue.Empty:
            ckpt = ref()
            if ckpt is None:
                return
            with ckpt._writer_lock:
                if jobs.empty():  # save() puts its job and looks for this thread under the lock
                    ckpt._writer = None
                    return
            del ckpt
            continue
        if job is None:
            return
        ckpt, *args = job
        del job
        try:
            ckpt._write(*args)  # hands its errors to wait()
        except BaseException as exc:  # noqa: BLE001 - this thread must go on serving
            ckpt._error = ckpt._error or exc
        finally:
            ckpt._written.set()
        del ckpt, args  # waiting for the next save, this thread holds no Checkpointer


_WRITING: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
"""Checkpointers that started a writer thread (NOTE [writer thread])."""


@functools.cache
def _finish_writes_at_exit() -> None:
    """Once per process: at exit, before ``concurrent.futures`` stops its executors, let every
    writer thread write the saves queued (NOTE [writer thread])."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:  # (else the daemon writers are stopped at exit, and a version in flight is lost)
        register(lambda: [c._finish_at_exit() for c in list(_WRITING)])


def _check_arguments(directory: object, model: object, optimizer: object, scheduler: object, extra: object) -> None:
    """Refuse what ``Checkpointer`` cannot save, where it is made: arguments in another order
    (``Checkpointer(d, opt, model)``) were taken, and the first ``save``, a training step later, raised
    an AttributeError from deep inside."""
    order = "the order is Checkpointer(directory, model, optimizer=None, *, scheduler=None, ...)"
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}: {order}")
    if optimizer is not None and not all(hasattr(optimizer, a) for a in ("param_groups", "state_dict", "load_state_dict")):
        raise TypeError(f"optimizer must be a torch optimizer (param_groups, state_dict, load_state_dict) or None, "
                        f"got {type(optimizer).__name__}: {order}")
    if isinstance(scheduler, (list, tuple)):  # the argument order was blamed for a list of schedulers
        raise TypeError(f"scheduler must be one LR scheduler, got a {type(scheduler).__name__} of {len(scheduler)}: chain "
                        "them into one (torch.optim.lr_scheduler.SequentialLR or ChainedScheduler), or pass one and "
                        "keep the others' state_dict() in extra")
    if scheduler is not None and (hasattr(scheduler, "param_groups")
                                  or not all(hasattr(scheduler, a) for a in ("state_dict", "load_state_dict"))):
        raise TypeError(f"scheduler must be an LR scheduler (state_dict, load_state_dict) or None, got "
                        f"{type(scheduler).__name__}: {order}")
    if extra is not None and not isinstance(extra, MutableMapping):
        # restore() updates it in place: a list or a number was saved, and every restore failed after
        # loading the model (AttributeError: 'list' object has no attribute 'update').
        raise TypeError(f"extra must be a dict (restore() updates it in place), got {type(extra).__name__}: put "
                        "the values in one, e.g. extra={'position': ...}, and read them back from it after restore()")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{directory} is a file, not a directory: give Checkpointer the directory its versions go in")
    _refuse_version_folder(Path(directory))


def _refuse_version_folder(directory: Path) -> None:
    """Raise ValueError if ``directory`` is one version's folder (``ckpt/step-000000005``), not a
    checkpoint directory: a restore from it said "no complete checkpoint" with the version right
    there, and a save nested versions inside it, which the retention of its own directory deletes."""
    m = _VERSION_RE.match(directory.name)
    if m and any((directory / name).exists() for name in ("manifest-rank0.json", MODEL_FILE)):
        raise ValueError(f"{directory} is the folder of one version (step {int(m.group(1))}) of the checkpoint directory "
                         f"{directory.parent}: give that directory, and the step to restore "
                         f"(Checkpointer({str(directory.parent)!r}, ...).restore({int(m.group(1))}); `ooc train "
                         "--resume` and `ooc checkpoints list` take the directory too)")


def _compiled_module(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``model`` itself: the wrapper names every tensor
    ``_orig_mod.<name>``, the module has the names a plain model (or HF) loads the weights by."""
    dynamo = sys.modules.get("torch._dynamo")  # a compiled model has imported it; never import it here
    if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    return model


def _unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer accelerate's ``AcceleratedOptimizer`` wraps (``transformers.Trainer`` hands its
    callbacks that wrapper), or ``optimizer`` itself. The wrapper forwards ``state_dict`` and ``step`` but
    no other attribute, so a Checkpointer given it saw no HostAdamW: it lost the lazy snapshots and
    ``synchronize()``, and a save between the backward and ``step()`` (a callback's
    ``on_pre_optimizer_step``) was not refused (NOTE [a version holds committed steps]) and held half a
    step. (Lightning's ``LightningOptimizer`` forwards every attribute.)"""
    accelerated = sys.modules.get("accelerate.optimizer")  # a wrapper made has imported it; never import it here
    if accelerated is not None and isinstance(optimizer, accelerated.AcceleratedOptimizer):
        return optimizer.optimizer
    return optimizer


def scan_versions(directory: str | os.PathLike[str]) -> tuple[list[Version], dict[int, CorruptCheckpointError]]:
    """:func:`list_versions` and :func:`damaged_versions` of ``directory`` from one read of its commit
    records."""
    _refuse_version_folder(Path(directory))
    return _scan(Path(directory))


def list_versions(directory: str | os.PathLike[str]) -> list[Version]:
    """The committed versions under ``directory``, oldest first."""
    _refuse_version_folder(Path(directory))
    return _scan(Path(directory))[0]


def damaged_versions(directory: str | os.PathLike[str]) -> dict[int, CorruptCheckpointError]:
    """The versions under ``directory`` whose commit records are damaged, by step (NOTE [damaged
    records])."""
    return _scan(Path(directory))[1]


def moved_aside(directory: str | os.PathLike[str]) -> list[Path]:
    """The folders of damaged versions a save moved aside under ``directory`` (``step-N.damaged-<time>``,
    NOTE [damaged versions moved aside]), kept until their owner deletes them; by name."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and _MOVED_ASIDE_RE.match(p.name))


def _version_folders(directory: Path) -> list[tuple[int, Path]]:
    """Every version folder (``step-N``) under ``directory``, committed or not, by step."""
    found = []
    for path in directory.iterdir() if directory.is_dir() else ():
        m = _VERSION_RE.match(path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def _scan(directory: Path) -> tuple[list[Version], dict[int, CorruptCheckpointError]]:
    """The committed versions under ``directory``, oldest first, and those whose commit records are
    damaged, by step (NOTE [damaged records]): each record read once."""
    versions, damaged = [], {}
    for step, path in _version_folders(directory):
        try:
            records = _records(path, step)
        except CorruptCheckpointError as exc:
            damaged[step] = exc
            continue
        if records is not None:
            versions.append(_version(path, step, records))
    return versions, damaged


def _committed(path: Path, step: int) -> Version | None:
    """The version in ``path`` if every rank's commit record is there and agrees, else None."""
    try:
        records = _records(path, step)
    except CorruptCheckpointError:
        return None
    return None if records is None else _version(path, step, records)


def _version(path: Path, step: int, records: list[dict[str, Any]]) -> Version:
    """Version ``step`` in ``path``, from every rank's commit record (``_records``)."""
    first = records[0]
    files: dict[str, dict[str, Any]] = {}
    tensors: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        files.update(r["files"])
        for key, entry in r.get("tensors", {}).items():
            tensors.setdefault(key, []).append(entry)
    return Version(step=step, path=path, metadata=first.get("metadata", {}), created=first.get("created", 0.0),
                   layout=first["layout"], files=files, tensors=tensors, format=int(first.get("format", 1)))


def _records(path: Path, step: int) -> list[dict[str, Any]] | None:
    """Every rank's commit record in ``path``; None while one is missing (a version not committed
    yet, or left by a crash); raises :class:`CorruptCheckpointError` for a record that is there
    but damaged.

    NOTE [damaged records]
    A record is written to a temporary name, fsynced and renamed into place whole: a crash leaves
    no record, never part of one. So a record that is there but does not parse, or names another
    step or layout than its version, or whose JSON (without it) does not match the XXH3-64 it holds
    (``record_xxh3``: a flipped digit or letter leaves valid JSON, and a changed value, file name or
    shape restored silently or failed other than as damage; a record of an earlier format, without
    it, is not checked), was damaged after its commit (a flipped byte, a truncation, a
    folder renamed by hand), as any other file of the version can be. It is reported as such, not
    taken for a crash's leftover: :meth:`Checkpointer.restore` raises naming it (``fallback=True``
    skips it) and neither the cleanup of incomplete folders nor retention deletes it, with its
    intact files (``ooc checkpoints list`` shows it; a save moves it aside if it is newer than the
    newest intact version, NOTE [damaged versions moved aside])."""
    name = "manifest-rank0.json"
    try:
        # Each record checked before anything in it is used: a changed world size would look like
        # records missing, a version not committed yet, which a cleanup deletes.
        first = _intact_record(path / name)
        world = int(first["layout"]["world"])
        records = [first]
        for r in range(1, world):
            name = f"manifest-rank{r}.json"
            records.append(_intact_record(path / name))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UnreadableCheckpointError(path / name, exc) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(path / name, f"the commit record cannot be read ({exc!r})") from None
    for r, record in enumerate(records):
        if not isinstance(record, dict) or record.get("step") != step or record.get("layout") != first["layout"] \
                or not isinstance(record.get("files"), dict):
            raise CorruptCheckpointError(path / f"manifest-rank{r}.json",
                                         f"the commit record does not agree with its version {path.name}")
    return records


_RECORD_DIGEST = "record_xxh3"
"""The commit record's key of its own XXH3-64 (NOTE [damaged records])."""


def _record_digest(record: dict[str, Any]) -> str:
    """The XXH3-64 of ``record``'s JSON without its own digest: what the writer wrote before adding it
    (``json.loads`` then ``json.dumps`` gives back the same text, keys in order)."""
    return xxhash.xxh3_64_hexdigest(json.dumps({k: v for k, v in record.items() if k != _RECORD_DIGEST}).encode())


def _intact_record(path: Path) -> Any:
    """The parsed commit record at ``path``; raises :class:`CorruptCheckpointError` if it holds an
    XXH3-64 of itself that its contents do not match (NOTE [damaged records])."""
    record = json.loads(path.read_text())
    # Whatever its format says: the digest covers the format too, and a flipped bit there ("format":
    # 5, or 0) was taken for a version of another ooc, which restore(fallback=True) did not skip.
    if isinstance(record, dict) and _RECORD_DIGEST in record and record[_RECORD_DIGEST] != _record_digest(record):
        raise CorruptCheckpointError(path, "the commit record's XXH3-64 differs from the one it holds")
    return record


def _checked_bytes(path: Path, record: dict[str, Any]) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(path, f"cannot be read ({exc})") from None
    except OSError as exc:
        raise UnreadableCheckpointError(path, exc) from None
    if len(data) != record["bytes"]:
        raise CorruptCheckpointError(path, f"{len(data)} bytes, the commit record says {record['bytes']}"
                                     + (" (empty)" if not data else " (truncated)" if len(data) < record["bytes"] else ""))
    if "xxh3" in record:  # NOTE [checksums]
        if xxhash.xxh3_64_hexdigest(data) != record["xxh3"]:
            raise CorruptCheckpointError(path, "XXH3-64 differs from the commit record")
    elif "crc32" in record:  # format 3
        if f"{zlib.crc32(data):08x}" != record["crc32"]:
            raise CorruptCheckpointError(path, "CRC-32 differs from the commit record")
    elif "sha256" in record:  # format 2
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise CorruptCheckpointError(path, "sha256 differs from the commit record")
    else:
        raise CorruptCheckpointError(path, "its commit record holds no checksum")
    return data


def _load_file(path: Path, record: dict[str, Any]) -> Any:
    data = _checked_bytes(path, record)
    try:
        if path.suffix == ".safetensors":
            return safetensors.torch.load(data)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # host state: never staged on a GPU
    except Exception as exc:  # noqa: BLE001 - any parse failure of a checked file is corruption
        raise CorruptCheckpointError(path, f"cannot be parsed ({exc})") from None


def _names_of_params(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``model``, by the parameter's id, first name first (a tied
    parameter has several)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _param_names(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    """Each parameter's name in ``model`` (a tied one's first name), or ``param{i}`` (its place in
    the optimizer) for one the model does not hold."""
    names = _names_of_params(model)
    return [names[id(p)][0] if id(p) in names else f"param{i}" for i, p in enumerate(params)]


def _distinct(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One of each slice several ranks held alike (state replicated on every rank, as of the
    parameters a sharded HostAdamW keeps on their device); a whole-tensor slice alone if there is one."""
    whole = [sl for sl in slices if sl["shape"] == sl["global_shape"]]
    if whole:
        return whole[:1]
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[str, Any]] = {}
    for sl in slices:
        seen.setdefault((tuple(sl["offsets"]), tuple(sl["shape"])), sl)
    return list(seen.values())


def _assemble(v: Version, key: str, loaded: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """Optimizer state tensor ``key`` of ``v``, from its slices in the ``loaded`` files."""
    slices = _distinct(v.tensors[key])
    try:
        parts = [loaded[sl["file"]][key] for sl in slices]
    except KeyError:
        raise CorruptCheckpointError(v.path / slices[0]["file"], f"holds no tensor {key}, which its record lists") from None
    first = slices[0]
    if len(slices) == 1 and first["shape"] == first["global_shape"]:
        return parts[0]
    out = torch.empty(first["global_shape"], dtype=parts[0].dtype)
    covered = 0
    for sl, part in zip(slices, parts):
        out[tuple(slice(o, o + n) for o, n in zip(sl["offsets"], sl["shape"]))] = part
        covered += part.numel()
    if covered != out.numel():
        raise CheckpointError(f"checkpoint {v.path}: the slices of {key} cover {covered} of its {out.numel()} elements")
    return out


def _params_from_masters(optimizer: torch.optim.Optimizer) -> None:
    """HostAdamW keeps fp32 masters of low-precision (or device) parameters: after loading, set each
    working copy from its master, as after a step (with ``delayed_update`` the parameters stay one
    update behind, as saved)."""
    if getattr(optimizer, "delayed_update", True):
        return
    with torch.no_grad():
        for p, state in optimizer.state.items():
            if isinstance(p, torch.Tensor) and "master" in state:
                p.copy_(state["master"])


__all__ = ["Checkpointer", "CheckpointError", "CorruptCheckpointError", "NoIntactVersionError", "UnreadableCheckpointError", "Version", "damaged_versions", "list_versions"]
