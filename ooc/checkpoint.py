"""Versioned, never-torn training checkpoints written in the background.

A checkpoint directory holds one folder per version, ``step-000000012/``::

    model.safetensors        the model's weights (rank 0), loadable without ooc
    optimizer-rank{r}.pt     rank r's optimizer state (torch.save; loaded with weights_only)
    state-rank{r}.pt         rank r's LR scheduler, RNG states (CPU and every CUDA device) and user dict
    manifest-rank{r}.json    rank r's commit record: step, metadata, layout, size and sha256 of each file

A version exists once every rank's commit record is in place. Each record is written last, after
every file it names is complete and fsynced: to a temporary name in the same folder, fsynced,
renamed into place, and the folder fsynced. So a crash, ``kill -9``, a full disk or an exception at
any moment leaves at most an incomplete folder, which :meth:`Checkpointer.versions` ignores and the
next :class:`Checkpointer` on the directory removes. Retention (``keep``) deletes older versions only
after a newer one is committed, and never the newest complete one.

In a loop of your own::

    ckpt = Checkpointer("ckpt", model, opt, keep=3)
    start = ckpt.restore().step + 1 if ckpt.latest() else 0   # resume where the last run stopped
    for step in range(start, steps):
        ...  # forward, backward, opt.step()
        ckpt.save(step, loss=loss.item())   # returns once the state is copied; written in the background
    ckpt.wait()

``save`` takes a snapshot of the state (after ``optimizer.synchronize()``) and returns; a thread
serializes and writes it. A second ``save`` waits until the previous version is committed (one write
in flight at most, so at most one extra copy of the state in host memory). An error of the writer is
raised by the next ``save`` or ``wait``.

NOTE [lazy snapshots]
With a :class:`~ooc.optim.HostAdamW` (without ``delayed_update``) the snapshot is lazy, after
DataStates: ``save`` copies only what no bucket holds (buffers, parameters kept on their device,
scheduler, RNG) and keeps references to each bucket's live parameters, masters and moments. A
bucket's host state does not change between the end of its update and its next UPDATE (NOTE [stage
listeners] in ooc.optim.stages), and its EXCHANGE ends, on the thread that then runs the UPDATE,
before that UPDATE starts. So the writer thread copies the buckets aside one by one, and a stage
listener on EXCHANGE copies a bucket itself, before its next update may change it, only if the
writer has not reached it yet. The training thread never waits for the copy of the buckets.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ooc.errors import OocError
from ooc.optim.stages import Stage

FORMAT = 1
_VERSION_RE = re.compile(r"^step-(\d{9,})$")
MODEL_FILE = "model.safetensors"


class CheckpointError(OocError, RuntimeError):
    """A checkpoint could not be written or read; the message says which version and file."""


class CorruptCheckpointError(CheckpointError):
    """A file of a committed version does not match its commit record (size or sha256), or cannot
    be parsed. ``restore(fallback=True)`` loads the newest version that is intact instead."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        super().__init__(f"checkpoint file {path} is corrupt: {reason}. Restore an older version "
                         "(restore(version=...) or restore(fallback=True)) or delete this version's folder")


@dataclass(frozen=True)
class Version:
    """One committed version: its folder, step, the metadata given to ``save`` and its commit records."""

    step: int
    path: Path
    metadata: dict[str, Any]
    created: float
    layout: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(repr=False)
    """File name -> {"bytes": size, "sha256": hex digest}, over every rank's record."""


def _name(step: int) -> str:
    return f"step-{step:09d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (tests replace this to simulate a full disk)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _clone(obj: Any) -> Any:
    """A deep copy of a state dict whose tensors are detached CPU copies (what the writer thread
    serializes while training goes on)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
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
        torch.cuda.set_rng_state_all(state["cuda"])


class _Snapshot:
    """Slots (container, key) holding live tensors, per bucket, copied aside at most once: by the
    writer thread, or by the optimizer's thread before the bucket's next update (NOTE [lazy snapshots])."""

    def __init__(self, slots: dict[int, list[tuple[Any, Any]]]) -> None:
        self._slots = slots
        self._lock = threading.Lock()
        self.copied_by_listener = 0

    def materialize(self, bucket: int, *, by_listener: bool = False) -> None:
        with self._lock:
            slots = self._slots.pop(bucket, None)
            if slots is None:
                return
            for container, key in slots:
                container[key] = container[key].detach().to("cpu", copy=True)
            self.copied_by_listener += by_listener

    def materialize_all(self) -> None:
        for bucket in list(self._slots):
            self.materialize(bucket)

    def pending(self) -> list[int]:
        with self._lock:
            return list(self._slots)


class Checkpointer:
    """Saves and restores ``model``, ``optimizer``, ``scheduler``, the RNG states and ``extra`` (a
    dict of your own, e.g. the data position: saved with torch.save, so tensors, numbers, strings,
    lists and dicts; :meth:`restore` updates it in place) under ``directory``, keeping the newest
    ``keep`` versions.

    Data-parallel: every rank makes a Checkpointer on the same (shared) directory and calls ``save``
    at the same steps; pass ``rank`` and ``world`` (default: from torch.distributed). ``layout``
    (JSON-able) says how the optimizer state is split; :meth:`restore` refuses a version saved with
    another layout.
    """

    def __init__(self, directory: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, scheduler: Any = None, extra: dict[str, Any] | None = None, keep: int | None = 3,
                 rank: int | None = None, world: int | None = None, layout: dict[str, Any] | None = None,
                 lazy: bool = True) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 (or None to keep every version), got {keep}")
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = rank if rank is not None else (torch.distributed.get_rank() if distributed else 0)
        self.world = world if world is not None else (torch.distributed.get_world_size() if distributed else 1)
        self.directory = Path(directory)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra = extra
        self.keep = keep
        self.layout = {"world": self.world, **(layout or {})}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._hook: Callable[[str], None] = lambda point: None
        """Test hook: called with the name of each point of the commit sequence."""
        self._snapshot: _Snapshot | None = None
        self.lazy = lazy and optimizer is not None and hasattr(optimizer, "stage_listeners") \
            and hasattr(optimizer, "buckets") and not getattr(optimizer, "delayed_update", True)
        """Lazy snapshots (NOTE [lazy snapshots]): HostAdamW without delayed_update only."""
        self.copied_by_listener = 0
        """Buckets the optimizer's thread had to copy aside because their next update came before the
        writer reached them (over every save so far)."""
        if self.lazy:
            optimizer.stage_listeners.append(self._on_stage)
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self._clean()

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, **metadata: Any) -> None:
        """Start writing version ``step`` (``metadata``: JSON-able values, returned by
        :meth:`versions` and :meth:`restore`). Waits for the previous save's write first; returns
        once the state is copied. The version exists once :meth:`wait` returns."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        try:
            json.dumps(metadata)
        except TypeError as exc:
            raise ValueError(f"save metadata must be JSON-able: {exc}") from None
        self.wait()
        if self.rank == 0 and self.world > 1:
            # Rank 0's retention after its commit sees only the versions every rank had committed
            # by then; by now the others have finished more (they save at the same steps).
            self._retain()
        if self.optimizer is not None and hasattr(self.optimizer, "synchronize"):
            self.optimizer.synchronize()  # every issued host update in the parameters and the state
        files: dict[str, Any] = {}
        if self.lazy:
            files.update(self._lazy_payloads())
        else:
            if self.rank == 0:
                files[MODEL_FILE] = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.model.state_dict().items()}
            if self.optimizer is not None:
                files[f"optimizer-rank{self.rank}.pt"] = {"optimizer": _clone(self.optimizer.state_dict())}
        files[f"state-rank{self.rank}.pt"] = {
            "scheduler": _clone(self.scheduler.state_dict()) if self.scheduler is not None else None,
            "rng": _clone(rng_state()),
            "extra": _clone(self.extra) if self.extra is not None else None,
        }
        self._thread = threading.Thread(target=self._write, args=(step, files, metadata), name=f"ooc-checkpoint-{step}",
                                        daemon=True)
        self._thread.start()

    def _lazy_payloads(self) -> dict[str, Any]:
        """The model and optimizer payloads with each bucket's tensors left live (registered in a
        :class:`_Snapshot`) and everything else copied now (NOTE [lazy snapshots])."""
        opt = self.optimizer
        bucket_of = {id(p): b.index for b in opt.buckets for p in b.params}
        slots: dict[int, list[tuple[Any, Any]]] = {}

        def place(container: Any, key: Any, value: torch.Tensor, owner: torch.Tensor | None) -> None:
            bucket = bucket_of.get(id(owner)) if owner is not None else None
            if bucket is None:
                container[key] = value.detach().to("cpu", copy=True)
            else:
                container[key] = value.detach()
                slots.setdefault(bucket, []).append((container, key))

        files: dict[str, Any] = {}
        if self.rank == 0:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            weights: dict[str, torch.Tensor] = {}
            for name, value in self.model.state_dict(keep_vars=True).items():
                place(weights, name, value, params.get(name))
            files[MODEL_FILE] = weights
        saved = opt.state_dict()
        order = [p for group in opt.param_groups for p in group["params"]]
        state: dict[Any, dict[str, Any]] = {}
        for index, entry in saved["state"].items():
            owner = order[index] if isinstance(index, int) and index < len(order) else None
            state[index] = {}  # a new dict: the optimizer's own (which state_dict returns) stays untouched
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    place(state[index], name, value, owner)
                else:
                    state[index][name] = _clone(value)
        files[f"optimizer-rank{self.rank}.pt"] = {"optimizer": {"state": state,
                                                                "param_groups": _clone(saved["param_groups"])}}
        self._snapshot = _Snapshot(slots)
        return files

    def _on_stage(self, bucket: int, stage: Stage) -> None:
        """Stage listener: the bucket's UPDATE comes next, on this thread; copy it aside first if
        the writer has not yet (NOTE [lazy snapshots])."""
        snapshot = self._snapshot
        if stage is Stage.EXCHANGE and snapshot is not None:
            before = snapshot.copied_by_listener
            snapshot.materialize(bucket, by_listener=True)
            self.copied_by_listener += snapshot.copied_by_listener - before

    def wait(self) -> None:
        """Block until the last save is committed; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, step: int, files: dict[str, Any], metadata: dict[str, Any]) -> None:
        folder = self.directory / _name(step)
        try:
            snapshot = self._snapshot
            if snapshot is not None:
                self._hook("snapshot")
                snapshot.materialize_all()
                self._snapshot = None  # every bucket copied: the listener has nothing more to do
            self._write_version(folder, step, files, metadata)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._snapshot = None
            self._remove_partial(folder, files)
            if isinstance(exc, CheckpointError):
                self._error = exc
            else:
                error = CheckpointError(f"could not write checkpoint {folder}: {exc}")
                error.__cause__ = exc
                self._error = error

    def _write_version(self, folder: Path, step: int, files: dict[str, Any], metadata: dict[str, Any]) -> None:
        record_name = f"manifest-rank{self.rank}.json"
        if (folder / record_name).exists():
            raise CheckpointError(f"version {folder} is already committed; restore an earlier one only to "
                                  "continue from it with later steps, or save to another directory")
        folder.mkdir(exist_ok=True)
        records: dict[str, dict[str, Any]] = {}
        for name, payload in files.items():
            data = safetensors.torch.save({k: v.contiguous() for k, v in payload.items()}) if name == MODEL_FILE \
                else _torch_bytes(payload)
            self._hook(f"write:{name}")
            _write_file(folder / name, data)
            records[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self._hook("files-written")
        manifest = {"format": FORMAT, "step": step, "rank": self.rank, "created": time.time(), "metadata": metadata,
                    "layout": self.layout, "files": records}
        tmp = folder / f".{record_name}.tmp"
        _write_file(tmp, json.dumps(manifest, indent=1).encode())
        self._hook("manifest-written")
        os.replace(tmp, folder / record_name)  # the commit
        self._hook("renamed")
        _fsync_dir(folder)
        _fsync_dir(self.directory)
        self._hook("committed")
        if self.rank == 0:
            self._retain()

    def _remove_partial(self, folder: Path, files: dict[str, Any]) -> None:
        """After a failed write: remove this rank's files of the uncommitted version (the folder
        too when nothing else is in it)."""
        if (folder / f"manifest-rank{self.rank}.json").exists():
            return  # committed; the failure came later (retention)
        for name in [*files, f".manifest-rank{self.rank}.json.tmp"]:
            (folder / name).unlink(missing_ok=True)
        try:
            folder.rmdir()
        except OSError:
            pass

    def _retain(self) -> None:
        """Delete all but the newest ``keep`` complete versions, and incomplete folders older than
        the newest complete one (left by a crash). With several ranks, one version more than
        ``keep`` may remain until the next save (rank 0 deletes only behind a version every rank
        has committed)."""
        complete = self.versions()
        if not complete:
            return
        keep = {v.step for v in complete[-self.keep:]} if self.keep is not None else {v.step for v in complete}
        newest = complete[-1].step
        for step, path in self._folders():
            if step not in keep and step < newest:
                shutil.rmtree(path, ignore_errors=True)

    def _clean(self) -> None:
        """Remove temporary files and incomplete versions a crashed writer left (rank 0, before
        any save: nothing is being written then)."""
        complete = {v.step for v in self.versions()}
        for step, path in self._folders():
            if step not in complete:
                shutil.rmtree(path, ignore_errors=True)
            else:
                for tmp in path.glob(".*.tmp"):
                    tmp.unlink(missing_ok=True)

    # -- reading -----------------------------------------------------------------------------

    def _folders(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.directory.iterdir() if self.directory.is_dir() else ():
            m = _VERSION_RE.match(path.name)
            if m and path.is_dir():
                found.append((int(m.group(1)), path))
        return sorted(found)

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
        :class:`CorruptCheckpointError` naming the file, and nothing is loaded); with
        ``fallback=True`` the newest intact version at or before the one asked for is loaded instead."""
        self.wait()
        found = self.versions()
        if not found:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if version is None:
            candidates = found
        else:
            step = version.step if isinstance(version, Version) else int(version)
            candidates = [v for v in found if v.step <= step]
            if not candidates or candidates[-1].step != step:
                raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory}; "
                                      f"there are {[v.step for v in found]}")
        errors = []
        for v in reversed(candidates):
            try:
                payloads = self._read(v)
            except CorruptCheckpointError as exc:
                if not fallback:
                    raise
                errors.append(exc)
                continue
            self._load(v, payloads)
            return v
        raise CheckpointError(f"every checkpoint in {self.directory} is corrupt: " + "; ".join(map(str, errors)))

    def _read(self, v: Version) -> dict[str, Any]:
        if v.layout != self.layout:
            raise CheckpointError(f"checkpoint {v.path} was saved with layout {v.layout}, restored as {self.layout}; "
                                  "the optimizer state is split by rank, so restore with the same number of ranks "
                                  "and sharding")
        wanted = [f"state-rank{self.rank}.pt"]
        if self.optimizer is not None:
            wanted.append(f"optimizer-rank{self.rank}.pt")
        wanted.append(MODEL_FILE)
        payloads = {}
        for name in wanted:
            if name not in v.files:
                raise CheckpointError(f"checkpoint {v.path} has no {name}")
            payloads[name] = _load_file(v.path / name, v.files[name])
        return payloads

    def _load(self, v: Version, payloads: dict[str, Any]) -> None:
        missing, unexpected = self.model.load_state_dict(payloads[MODEL_FILE], strict=False)
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {v.path} does not fit the model: missing {missing}, unexpected {unexpected}")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(payloads[f"optimizer-rank{self.rank}.pt"]["optimizer"])
            _params_from_masters(self.optimizer)
        state = payloads[f"state-rank{self.rank}.pt"]
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.extra is not None and state["extra"] is not None:
            self.extra.clear()
            self.extra.update(state["extra"])
        set_rng_state(state["rng"])

    def export(self, version: int | Version | None, path: str | os.PathLike[str]) -> Path:
        """Write one version's model weights (checked) to ``path`` as a safetensors file, loadable
        with ``safetensors.torch.load_file`` into a plain PyTorch model."""
        found = {v.step: v for v in self.versions()}
        step = (max(found) if found else None) if version is None else (version.step if isinstance(version, Version) else version)
        if step not in found:
            raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory}")
        v = found[step]
        data = _checked_bytes(v.path / MODEL_FILE, v.files[MODEL_FILE])
        out = Path(path)
        tmp = out.with_name(f".{out.name}.tmp")
        _write_file(tmp, data)
        os.replace(tmp, out)
        return out

    def close(self) -> None:
        """Wait for the last save (raising its error) and remove the stage listener."""
        try:
            self.wait()
        finally:
            if self.lazy and self._on_stage in self.optimizer.stage_listeners:
                self.optimizer.stage_listeners.remove(self._on_stage)


def list_versions(directory: str | os.PathLike[str]) -> list[Version]:
    """The committed versions under ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        m = _VERSION_RE.match(path.name)
        if not (m and path.is_dir()):
            continue
        version = _committed(path, int(m.group(1)))
        if version is not None:
            found.append(version)
    return sorted(found, key=lambda v: v.step)


def _committed(path: Path, step: int) -> Version | None:
    """The version in ``path`` if every rank's commit record is there and agrees, else None."""
    try:
        first = json.loads((path / "manifest-rank0.json").read_text())
        world = int(first["layout"]["world"])
        records = [first] + [json.loads((path / f"manifest-rank{r}.json").read_text()) for r in range(1, world)]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(r.get("step") != step or r.get("layout") != first["layout"] for r in records):
        return None
    files: dict[str, dict[str, Any]] = {}
    for r in records:
        files.update(r["files"])
    return Version(step=step, path=path, metadata=first.get("metadata", {}), created=first.get("created", 0.0),
                   layout=first["layout"], files=files)


def _checked_bytes(path: Path, record: dict[str, Any]) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpointError(path, f"cannot be read ({exc})") from None
    if len(data) != record["bytes"]:
        raise CorruptCheckpointError(path, f"{len(data)} bytes, the commit record says {record['bytes']}"
                                     + (" (empty)" if not data else " (truncated)" if len(data) < record["bytes"] else ""))
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise CorruptCheckpointError(path, "sha256 differs from the commit record")
    return data


def _load_file(path: Path, record: dict[str, Any]) -> Any:
    data = _checked_bytes(path, record)
    try:
        if path.name == MODEL_FILE:
            return safetensors.torch.load(data)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # host state: never staged on a GPU
    except Exception as exc:  # noqa: BLE001 - any parse failure of a checked file is corruption
        raise CorruptCheckpointError(path, f"cannot be parsed ({exc})") from None


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


__all__ = ["Checkpointer", "CheckpointError", "CorruptCheckpointError", "Version", "list_versions"]
