"""Measured (or analytic) per-block costs of a model: what the planner and the simulator consume."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from ooc.scheduler import checks
from ooc.scheduler.codecs import FLOAT_ITEMSIZE, nominal_ratio
from ooc.scheduler.errors import ProfileError
from ooc.scheduler.plan import DEFAULT_MIN_SWAP_BYTES, op_signature

PROFILE_FORMAT_VERSION = 3
_FIX = "profile the model again (ooc profile) or correct the profile JSON"


@dataclass(frozen=True)
class OpProfile:
    """One operator of a block's forward, in dispatch order (NOTE [op-level profile]).

    NOTE [op-level profile]
    A block's forward is the sequence of aten operators it dispatches, counted in order from 0 by a
    ``TorchDispatchMode`` (views and in-place ops included): the ``k``-th op of the profile is the
    ``k``-th op the runtime sees when it runs the block again on inputs of the same shapes. A
    RECOMPUTE block with ``BlockPlan.cached_ops`` keeps the outputs of those ops from its forward and
    its re-run takes them from that cache instead of running the ops again (selective recompute), so
    any subset of the cacheable ops is a valid plan.

    - ``forward_s``: the op's time in the forward (what caching it saves in the re-run).
    - ``output_bytes``: bytes of the storages the op creates (0 for views and in-place ops), what
      caching it holds on the device from the forward to the block's backward.
    - ``saved_bytes``: the part of ``output_bytes`` that autograd saves for the block's backward (the
      re-run re-saves those storages anyway, so caching them adds nothing at backward).
    - ``cacheable``: ``False`` for ops whose output cannot be taken from a cache without changing the
      re-run (random ops, which advance a generator; in-place ops; ops without tensor outputs).
    - ``returned``: the block returns this op's output (or a view of it): the next block's input,
      which stays on the device, so a plan may cache it but not swap it (``BlockPlan.swapped_ops``).
      A measured profile marks it; where no op is marked, planners take the block's last op as the
      one returned.
    - ``reads``: the earlier ops of the block whose storages this op reads (increasing indices; the
      block's inputs and parameters are not ops; an op that only makes views reads none: what reads
      through its view reads the storage itself), what tells a re-run which uncached ops it may leave
      out (NOTE [ops a re-run skips] in ``ooc.scheduler.oplevel``); ``None``: not recorded (a profile
      from before this field), and then a re-run is priced as running every uncached op.
    - ``outlives_forward``: a storage the op creates is still alive after the block's forward
      though autograd does not save it and the block does not return it (autocast's cache holds its
      cast of a weight; the block keeps it in an attribute or a custom Function's context): a re-run
      never leaves the op out, since what holds the forward's output would hold the re-run's.
    - ``replayed``: a re-run of the block reaches this op; ``False`` for the ops after the block's
      last saved tensor, where every re-run stops (NOTE [a re-run stops at the last save]): caching
      such an op saves nothing, and a plain re-run does not spend its time either. The ``False`` ops
      are the block's last ones. A profile from before this field replays every op.

    NOTE [a re-run stops at the last save]
    A re-run (plain or selective) exists to give autograd the tensors the block's backward needs, so
    the runtime stops it once autograd has saved the last of them (``ooc.recompute``, as
    ``torch.utils.checkpoint`` stops early). Autograd saves an op's inputs before the op runs and its
    outputs after, so the re-run ends before the op whose input is the last saved tensor, or after
    the op whose output is: a transformer block without dropout never runs its MLP's second matmul
    and residual add again (its last save is that matmul's input), a CNN block its last convolution.
    The measured profile records where the forward's last save came (``ooc.op_profile.measure_ops``);
    the analytic profiles take the op after the last one with saved bytes. The cost model prices a
    plain re-run at the block's ``forward_s`` less these ops' share of it (``BlockProfile.replayed_s``,
    read by ``ooc.scheduler.schedule.selective_rerun_s``).
    """

    name: str
    forward_s: float
    output_bytes: int
    saved_bytes: int = 0
    cacheable: bool = True
    returned: bool = False
    reads: tuple[int, ...] | None = None
    outlives_forward: bool = False
    replayed: bool = True

    def __post_init__(self) -> None:
        checks.text(self.name, "an op's name", ProfileError, hint=_FIX)
        if self.reads is not None:
            if not isinstance(self.reads, (tuple, list)):
                raise ProfileError(f"op {self.name!r}: reads must be a list of op indices, got {self.reads!r:.80}; {_FIX}")
            reads = tuple(checks.count(k, "an index in reads", ProfileError, where=f"op {self.name!r}: ", hint=_FIX)
                          for k in self.reads)
            if list(reads) != sorted(set(reads)):
                raise ProfileError(f"op {self.name!r}: reads must be increasing op indices, got {list(reads)}; {_FIX}")
            object.__setattr__(self, "reads", reads)
        where = f"op {self.name!r}: "
        object.__setattr__(self, "forward_s", checks.number(self.forward_s, "forward_s", ProfileError, where=where, hint=_FIX))
        for name in ("output_bytes", "saved_bytes"):
            object.__setattr__(self, name, checks.count(getattr(self, name), name, ProfileError, where=where, hint=_FIX))
        checks.flag(self.cacheable, "cacheable", ProfileError, hint=_FIX)
        checks.flag(self.returned, "returned", ProfileError, hint=_FIX)
        checks.flag(self.outlives_forward, "outlives_forward", ProfileError, hint=_FIX)
        checks.flag(self.replayed, "replayed", ProfileError, hint=_FIX)
        if self.saved_bytes > self.output_bytes:
            raise ProfileError(f"{where}saved_bytes exceeds output_bytes; {_FIX}")


@dataclass(frozen=True)
class SharedStorage:
    """A storage that more than one block holds for its backward (NOTE [storages shared between blocks]).

    ``id`` names the storage within one profile (every block that holds it lists the same ``id``);
    ``saved``: the block's forward saves it; ``input``: it is one of the block's tensor arguments
    (what a RECOMPUTE block keeps); ``dtype``: as the block sees it (which codecs compress it).
    """

    id: int
    nbytes: int
    dtype: str
    saved: bool
    input: bool

    def __post_init__(self) -> None:
        for name in ("id", "nbytes"):
            object.__setattr__(self, name, checks.count(getattr(self, name), name, ProfileError, where="shared storage: ", hint=_FIX))
        checks.text(self.dtype, "dtype", ProfileError, where="shared storage: ", hint=_FIX)
        for name in ("saved", "input"):
            checks.flag(getattr(self, name), name, ProfileError, where="shared storage: ", hint=_FIX)


@dataclass(frozen=True)
class SharedParameter:
    """A parameter that more than one block holds, or a block and a module outside the chain (NOTE
    [parameters shared between blocks] in ``ooc.streaming``): it is never streamed, and its bytes
    count once among the resident parameters. ``id`` names it within one profile (every block that
    holds it lists the same ``id``)."""

    id: int
    nbytes: int

    def __post_init__(self) -> None:
        for name in ("id", "nbytes"):
            object.__setattr__(self, name, checks.count(getattr(self, name), name, ProfileError, where="shared parameter: ", hint=_FIX))


_Record = TypeVar("_Record", OpProfile, SharedStorage, SharedParameter)


@dataclass(frozen=True)
class BlockProfile:
    """Costs of one block for one input shape.

    Byte counts follow the runtime's accounting (NOTE [accounting by storage] in ``ooc/saved.py``):
    saved tensors are counted once per storage within the block, parameters and their views are not
    counted.

    - ``saved_bytes``: activations the block saves for backward (what ``KEEP`` holds).
    - ``swappable_bytes``: the part of ``saved_bytes`` in tensors of at least ``min_swap_bytes``
      (what ``SWAP`` moves to the host; the rest stays on the device).
    - ``input_bytes`` / ``input_swappable_bytes``: the same for the tensors passed to the block
      (what ``RECOMPUTE`` keeps, and what ``swap_input`` moves).
    """

    name: str
    forward_s: float
    backward_s: float
    saved_bytes: int
    swappable_bytes: int
    input_bytes: int
    input_swappable_bytes: int
    output_bytes: int
    param_bytes: int
    grad_bytes: int
    swappable_storages: int = 0
    """How many storages ``SWAP`` copies (each copy costs ``Hardware.copy_issue_s`` of compute)."""
    input_swappable_storages: int = 0
    compressed: tuple[tuple[str, int, int, int, int], ...] = ()
    """Per codec: (codec, bytes of the swappable saved storages once compressed, of the swappable
    inputs, the largest single saved storage's codes, the largest input's); a codec missing here is
    counted at its nominal ratio on :attr:`activation_dtype`."""
    codec_error: tuple[tuple[str, float], ...] = ()
    """Per codec: the relative L2 error of the block's gradients (of its inputs and parameters) when
    its saved tensors go through the codec, measured by the profiler (NOTE [codec error] in
    ``ooc.codec_error``), and under ``<codec>:recompute`` when the block runs again from its inputs
    put through the codec (``ooc.scheduler.codecs.codec_error_name``); a codec missing here was not
    measured."""
    ops: tuple[OpProfile, ...] = ()
    """The block's forward op by op (NOTE [op-level profile]); empty when not profiled at that level."""
    shared: tuple[SharedStorage, ...] = ()
    """The storages this block holds that other blocks hold too (NOTE [storages shared between
    blocks]); each is also counted in ``saved_bytes`` / ``input_bytes`` above."""
    shared_params: tuple[SharedParameter, ...] = ()
    """The parameters among ``param_bytes`` that another block, or a module outside the chain, holds too."""
    rerun_s: float | None = None
    """Seconds a plain re-run of the block took, measured (it stops at the block's last saved
    tensor: NOTE [a re-run stops at the last save]); ``None``: not measured (analytic and older
    profiles), and :attr:`replayed_s` estimates it from the ops."""
    activation_dtype: str | None = None
    """The dtype of the block's floating-point activations (``"float32"``, ``"float16"`` or
    ``"bfloat16"``): a codec missing from :attr:`compressed` is charged its ratio on values of this
    dtype (``ooc.scheduler.codecs.nominal_ratio``; int8 keeps 0.266 of fp32's bytes, 0.531 of
    bf16's). That charge is approximate: it takes every swappable byte for this dtype (a bool mask
    as if it compressed) and counts no decoding at backward; ``compressed`` is exact. ``None``: not
    recorded (a profile from before this field), charged the codec's largest ratio, that of 2-byte
    values, which no floating-point activation's codes exceed; an fp32 profile without the field is
    then over-charged (``ooc profile`` again, or add ``"activation_dtype": "float32"`` to its blocks)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared", tuple(self._nested(SharedStorage, e, "shared storage") for e in self.shared))
        object.__setattr__(self, "ops", tuple(self._nested(OpProfile, op, "op") for op in self.ops))
        object.__setattr__(self, "shared_params", tuple(self._nested(SharedParameter, e, "shared parameter")
                                                        for e in self.shared_params))
        for k, op in enumerate(self.ops):
            if op.reads and op.reads[-1] >= k:
                raise ProfileError(f"block {self.name!r}: op {k} ({op.name}) reads op {op.reads[-1]}, which is not an "
                                   f"earlier op of the block; {_FIX}")
            if op.replayed and k and not self.ops[k - 1].replayed:
                raise ProfileError(f"block {self.name!r}: op {k} ({op.name}) is replayed but op {k - 1} before it is not: "
                                   f"a re-run stops once, so only the block's last ops may be unreplayed; {_FIX}")
        object.__setattr__(self, "compressed", tuple((str(e[0]), *(int(v) for v in e[1:])) for e in self.compressed))
        object.__setattr__(self, "codec_error", tuple(self._codec_error_entry(e) for e in self.codec_error))
        checks.text(self.name, "a block's name", ProfileError, hint=_FIX)
        where = f"block {self.name!r}: "
        for f in fields(self):
            if f.type == "float":
                value = checks.number(getattr(self, f.name), f.name, ProfileError, where=where, hint=_FIX)
            elif f.type == "int":
                value = checks.count(getattr(self, f.name), f.name, ProfileError, where=where, hint=_FIX)
            else:
                continue
            object.__setattr__(self, f.name, value)
        if self.rerun_s is not None:
            object.__setattr__(self, "rerun_s", checks.number(self.rerun_s, "rerun_s", ProfileError, where=where, hint=_FIX))
        if self.activation_dtype is not None and checks.text(self.activation_dtype, "activation_dtype", ProfileError, where=where,
                                                             hint=_FIX) not in FLOAT_ITEMSIZE:
            raise ProfileError(f"{where}activation_dtype must be one of {sorted(FLOAT_ITEMSIZE)} or null (not recorded), "
                               f"got {self.activation_dtype!r:.80}; {_FIX}")
        if self.swappable_bytes > self.saved_bytes:
            raise ProfileError(f"block {self.name!r}: swappable_bytes exceeds saved_bytes")
        if self.input_swappable_bytes > self.input_bytes:
            raise ProfileError(f"block {self.name!r}: input_swappable_bytes exceeds input_bytes")
        if self.streamed_param_bytes < 0:
            raise ProfileError(f"block {self.name!r}: its shared parameters' bytes exceed param_bytes; {_FIX}")

    def _nested(self, kind: type[_Record], entry: object, what: str) -> _Record:
        """``entry`` as a ``kind``: a record nested in a block of the profile JSON (an op, a shared storage)."""
        if isinstance(entry, kind):
            return entry
        if not isinstance(entry, dict):
            raise ProfileError(f"block {self.name!r}: each {what} must be an object, got {entry!r:.80}; {_FIX}")
        try:
            return kind(**entry)
        except TypeError as exc:  # a missing or unknown field
            raise ProfileError(f"block {self.name!r}: corrupt {what} {entry!r:.80}: {exc}; {_FIX}") from exc

    def _codec_error_entry(self, entry: object) -> tuple[str, float]:
        where = f"block {self.name!r}: "
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ProfileError(f"{where}each codec_error entry must be [codec, error], got {entry!r}; {_FIX}")
        name = checks.text(entry[0], "a codec_error's codec", ProfileError, where=where, hint=_FIX)
        return name, checks.number(entry[1], f"codec_error of {name}", ProfileError, where=where, hint=_FIX)

    @property
    def streamed_param_bytes(self) -> int:
        """Bytes of the parameters that streaming this block moves: those no other holder shares."""
        return self.param_bytes - sum(p.nbytes for p in self.shared_params)

    @property
    def op_signature(self) -> str | None:
        """:func:`~ooc.scheduler.plan.op_signature` of the block's ops (what a selective
        ``BlockPlan``'s op indices refer to, ``BlockPlan.op_signature``); ``None`` without op-level detail."""
        return op_signature(op.name for op in self.ops) if self.ops else None

    @property
    def replayed_s(self) -> float:
        """Seconds a plain re-run takes (NOTE [a re-run stops at the last save]): :attr:`rerun_s`
        where measured, else ``forward_s`` times the replayed ops' share of the ops' time (shares of
        one measurement: a measured profile times its ops one by one, apart from the block's
        forward, and their sum differs from it), else ``forward_s``."""
        if self.rerun_s is not None:
            return self.rerun_s
        total = sum(op.forward_s for op in self.ops)
        if total <= 0:
            return self.forward_s
        return self.forward_s * sum(op.forward_s for op in self.ops if op.replayed) / total

    def codec_error_of(self, codec: str) -> float | None:
        """The measured gradient error of ``codec`` on this block, or ``None`` if not measured."""
        for name, error in self.codec_error:
            if name == codec:
                return error
        return None

    def compressed_bytes(self, codec: str, *, inputs: bool) -> tuple[int, int]:
        """Swappable bytes of the saved tensors (or inputs) once compressed with ``codec``, and the
        codes of the largest single storage among them."""
        for name, saved, inp, saved_max, inp_max in self.compressed:
            if name == codec:
                return (inp, inp_max) if inputs else (saved, saved_max)
        raw = self.input_swappable_bytes if inputs else self.swappable_bytes
        return int(raw * nominal_ratio(codec, self.activation_dtype)), 0


def machine_header() -> dict[str, str]:
    """Where a profile or benchmark was measured (no CUDA initialisation)."""
    # Imported here, not at the top: the scheduler's modules plan over plain numbers and import no torch;
    # only this function, called by the runtime when it records a measurement, needs torch's version.
    import torch

    return {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


@dataclass(frozen=True)
class Profile:
    """Per-block costs of a chain plus the time spent outside the chain (embeddings, head, loss)."""

    blocks: tuple[BlockProfile, ...]
    min_swap_bytes: int = DEFAULT_MIN_SWAP_BYTES
    outside_forward_s: float = 0.0
    outside_backward_s: float = 0.0
    outside_param_bytes: int = 0
    """Parameters outside the chain (embeddings, head): always resident on the device."""
    model: str = "model"
    source: str = "measured"
    machine: dict[str, str] = field(default_factory=dict, compare=False)
    notes: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.blocks:
            raise ProfileError("a profile needs at least one block")
        for block in self.blocks:
            if not isinstance(block, BlockProfile):
                raise ProfileError(f"a profile's blocks must be BlockProfile objects, got {type(block).__name__}")
        for name in ("min_swap_bytes", "outside_param_bytes"):
            object.__setattr__(self, name, checks.count(getattr(self, name), name, ProfileError, hint=_FIX))
        for name in ("outside_forward_s", "outside_backward_s"):
            object.__setattr__(self, name, checks.number(getattr(self, name), name, ProfileError, hint=_FIX))
        for name in ("model", "source", "notes"):
            checks.text(getattr(self, name), name, ProfileError, hint=_FIX)
        if not isinstance(self.machine, dict):
            raise ProfileError(f"machine must be a dict, got {type(self.machine).__name__}; {_FIX}")
        sizes: dict[int, int] = {}
        for block in self.blocks:
            for p in block.shared_params:
                if sizes.setdefault(p.id, p.nbytes) != p.nbytes:
                    raise ProfileError(f"shared parameter {p.id} has {sizes[p.id]} bytes in one block and {p.nbytes} "
                                       f"in block {block.name!r}; {_FIX}")

    @property
    def shared_param_bytes(self) -> int:
        """Bytes of the shared parameters (``BlockProfile.shared_params``), each counted once: always resident."""
        return sum({p.id: p.nbytes for block in self.blocks for p in block.shared_params}.values())

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    def check_matches(self, block_names: list[str], param_bytes: list[int] | None = None) -> None:
        """Raise :class:`ProfileError` unless this profile describes exactly these blocks: their names
        and, if given, each block's parameter bytes (blocks.0 ... blocks.5 name a GPT's chain and a
        ResNet's alike, so names alone took one model's profile for the other)."""
        again = "profile this model again (ooc profile, or ooc.profile(model, sample))"
        if list(self.names) != list(block_names):
            raise ProfileError(
                f"the profile describes {len(self)} blocks {list(self.names)[:4]}..., the model has "
                f"{len(block_names)} blocks {list(block_names)[:4]}...; {again}"
            )
        for block, actual in zip(self.blocks, param_bytes or ()):
            if block.param_bytes != actual:
                raise ProfileError(
                    f"the profile is of another model (or dtype): its block {block.name} holds {block.param_bytes} "
                    f"bytes of parameters, the model's {actual}; {again}"
                )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "ooc.profile",
            "version": PROFILE_FORMAT_VERSION,
            "model": self.model,
            "source": self.source,
            "machine": dict(self.machine),
            "notes": self.notes,
            "min_swap_bytes": self.min_swap_bytes,
            "outside_forward_s": self.outside_forward_s,
            "outside_backward_s": self.outside_backward_s,
            "outside_param_bytes": self.outside_param_bytes,
            "blocks": [asdict(b) for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Profile":
        checks.file_format(data, "ooc.profile", ProfileError)
        version = data.get("version")
        if not isinstance(version, int) or version > PROFILE_FORMAT_VERSION:
            raise ProfileError(
                f"profile format version {version!r} is newer than this ooc understands "
                f"({PROFILE_FORMAT_VERSION}); upgrade ooc or profile the model again"
            )
        blocks = data.get("blocks")
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise ProfileError(f"corrupt profile JSON: \"blocks\" must be a list of objects, got {blocks!r:.80}; {_FIX}")
        try:
            return cls(
                blocks=tuple(BlockProfile(**b) for b in blocks),
                min_swap_bytes=data.get("min_swap_bytes", 4096),
                outside_forward_s=data.get("outside_forward_s", 0.0),
                outside_backward_s=data.get("outside_backward_s", 0.0),
                outside_param_bytes=data.get("outside_param_bytes", 0),
                model=data.get("model", "model"),
                source=data.get("source", "measured"),
                machine=data.get("machine", {}),
                notes=data.get("notes", ""),
            )
        except ProfileError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:  # a missing or unknown field, a bad codec entry
            raise ProfileError(f"corrupt profile JSON: {exc}; {_FIX}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"corrupt profile JSON: {exc}") from exc
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves half a profile behind."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        if not path.is_file():
            raise ProfileError(f"no profile at {path}; make one with `ooc profile --out {path}`")
        return cls.from_json(path.read_text())
