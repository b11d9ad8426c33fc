"""A plan: one decision per block of the chain (keep, swap or recompute its saved activations)."""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ooc.scheduler import checks
from ooc.scheduler.errors import PlanError
from ooc.scheduler.units import format_bytes

PLAN_FORMAT_VERSION = 1
DEFAULT_MIN_SWAP_BYTES = 256 * 1024
"""Saved storages smaller than this stay on the device even in a swapped block, unless a plan (and
the profile it is made from) says otherwise: the one default :class:`Plan`, ``Profile`` and
``ooc.profile`` share, so predicted and measured bytes follow the same threshold. Each swapped
storage costs a fixed ~10 us (one copy issued, two events recorded and waited for: measured on the
CPU backend for issue 11, similar for a CUDA launch plus event), and PCIe moves ~25 GB/s pinned
(Gen4; ~50 on Gen5): 10 us is the time to move ~250 KB. Below 256 KiB the fixed cost is more than
the transfer itself, for bytes that free little device memory:
a transformer's layer-norm statistics stay, its hidden states (MBs each) still go. Plans and profiles
saved before this default record the threshold they were made with (JSON without the field: 4096).
Tests of the swap machinery on tiny models pass ``min_swap_bytes`` explicitly."""

_FIX = "make the plan again (ooc plan) or correct the plan JSON"


def op_signature(names: Iterable[str]) -> str:
    """A short digest (16 hex digits) of a block forward's ops, in order (``names``: each op's
    overload, e.g. ``"aten.addmm.default"``): what a selective plan's op indices refer to
    (``BlockPlan.op_signature``; NOTE [a forward the plan does not fit] in ``ooc.op_profile``)."""
    return hashlib.blake2b("\n".join(names).encode(), digest_size=8).hexdigest()


class Policy(str, enum.Enum):
    """What happens to a block's saved activations between its forward and its backward."""

    KEEP = "keep"
    """Stay on the device (what plain PyTorch does)."""
    SWAP = "swap"
    """Copied to host memory after the forward, prefetched back before the backward."""
    RECOMPUTE = "recompute"
    """Dropped; only the block's input is saved and the forward is re-run in the backward."""


class Codec(str, enum.Enum):
    """How swapped activations are encoded on the host."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    FP8 = "fp8"


class Residency(str, enum.Enum):
    """Where a block's parameters live between their uses."""

    RESIDENT = "resident"
    """On the device for the whole run (what plain PyTorch does)."""
    STREAMED = "streamed"
    """On the host; copied to the device before the block's forward and again before its backward,
    and freed after each."""


@dataclass(frozen=True)
class BlockPlan:
    """The decision for one block.

    ``swap_input`` applies to ``RECOMPUTE`` blocks: the one tensor such a block keeps (its input)
    is swapped to the host as well. ``cached_ops`` also applies to ``RECOMPUTE`` blocks (selective
    recompute): the indices, into the block's op-level profile, of the ops whose outputs the forward
    keeps and the re-run reuses instead of running them again (NOTE [op-level profile] in
    ``ooc.scheduler.profile``); empty re-runs the whole forward. ``swapped_ops``, a subset of
    ``cached_ops``: the cached outputs that go to the host after the block's forward and come back
    before its re-run instead of staying on the device (per-tensor swap, NOTE [swapped cached ops] in
    ``ooc.scheduler.schedule``); they move uncompressed. ``params``: :class:`Residency` of the block's parameters. ``saved_bytes`` / ``device_bytes`` are what the planner expected
    from its profile (``None`` for a hand-written plan); they are shown in the plan table.
    ``op_signature``: :func:`op_signature` of the profiled forward that ``cached_ops`` and
    ``swapped_ops`` index (``BlockProfile.op_signature``; ``annotate`` fills it in a planner's plan),
    so that a forward running other ops (a batch of one row, a validation forward) is told from a
    plan error; ``None``: not known (a hand-written plan without it).
    """

    policy: Policy = Policy.KEEP
    codec: Codec = Codec.NONE
    swap_input: bool = False
    saved_bytes: int | None = None
    device_bytes: int | None = None
    params: Residency = Residency.RESIDENT
    cached_ops: tuple[int, ...] = ()
    swapped_ops: tuple[int, ...] = ()
    op_signature: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cached_ops, (str, bytes)) or not hasattr(self.cached_ops, "__iter__"):
            raise PlanError(f"cached_ops must be a sequence of op indices, got {self.cached_ops!r:.80}; {_FIX}")
        object.__setattr__(self, "cached_ops", tuple(checks.count(i, "a cached op index", PlanError, hint=_FIX)
                                                     for i in self.cached_ops))
        if list(self.cached_ops) != sorted(set(self.cached_ops)):
            raise PlanError(f"cached_ops must be increasing op indices without repeats, got {list(self.cached_ops)[:8]}; {_FIX}")
        if isinstance(self.swapped_ops, (str, bytes)) or not hasattr(self.swapped_ops, "__iter__"):
            raise PlanError(f"swapped_ops must be a sequence of op indices, got {self.swapped_ops!r:.80}; {_FIX}")
        object.__setattr__(self, "swapped_ops", tuple(checks.count(i, "a swapped op index", PlanError, hint=_FIX)
                                                      for i in self.swapped_ops))
        if list(self.swapped_ops) != sorted(set(self.swapped_ops)):
            raise PlanError(f"swapped_ops must be increasing op indices without repeats, got {list(self.swapped_ops)[:8]}; {_FIX}")
        if not set(self.swapped_ops) <= set(self.cached_ops):
            extra = sorted(set(self.swapped_ops) - set(self.cached_ops))[:8]
            raise PlanError(f"swapped_ops must be among cached_ops (only a cached output can be swapped), got {extra} "
                            f"outside them; {_FIX}")
        object.__setattr__(self, "policy", _member(Policy, self.policy, "policy"))
        object.__setattr__(self, "codec", _member(Codec, self.codec, "codec"))
        object.__setattr__(self, "params", _member(Residency, self.params, "params"))
        checks.flag(self.swap_input, "swap_input", PlanError, hint=_FIX)
        for name in ("saved_bytes", "device_bytes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, checks.count(getattr(self, name), name, PlanError, hint=f"leave it out or {_FIX}"))
        if self.op_signature is not None and not _is_signature(self.op_signature):
            raise PlanError(f"op_signature must be 16 hex digits (ooc.scheduler.plan.op_signature of the profiled "
                            f"block's op names), got {self.op_signature!r:.80}; leave it out or {_FIX}")
        if self.swap_input and self.policy is not Policy.RECOMPUTE:
            raise PlanError("swap_input=True only applies to RECOMPUTE blocks")
        if self.cached_ops and self.policy is not Policy.RECOMPUTE:
            raise PlanError("cached_ops (selective recompute) only applies to RECOMPUTE blocks")
        if self.swapped_ops and self.codec is not Codec.NONE:
            raise PlanError(f"codec {self.codec.value} with swapped_ops: swapped cached outputs move uncompressed; "
                            "use codec none for this block, or leave swapped_ops empty")
        if self.codec is not Codec.NONE and not self.swaps_anything:
            raise PlanError(f"codec {self.codec.value} needs a block that swaps (SWAP, or RECOMPUTE with swap_input)")

    @property
    def swaps_anything(self) -> bool:
        return self.policy is Policy.SWAP or self.swap_input or bool(self.swapped_ops)

    def label(self) -> str:
        text = self.policy.value
        if self.cached_ops:
            swapped = f", swap {len(self.swapped_ops)}" if self.swapped_ops else ""
            text += f"(cache {len(self.cached_ops)} ops{swapped})"
        if self.swap_input:
            text += "+swap_input"
        if self.codec is not Codec.NONE:
            text += f"[{self.codec.value}]"
        if self.params is Residency.STREAMED:
            text += ", params streamed"
        return text

    @property
    def streamed(self) -> bool:
        return self.params is Residency.STREAMED


_Choice = TypeVar("_Choice", Policy, Codec, Residency)

_BLOCK_FIELDS = frozenset({"policy", "codec", "swap_input", "saved_bytes", "device_bytes", "params", "cached_ops",
                           "swapped_ops", "op_signature"})
"""The fields of a block in a plan's JSON (``Plan.to_dict``)."""


def _is_signature(value: object) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _member(kind: type[_Choice], value: object, field: str) -> _Choice:
    try:
        return kind(value)
    except ValueError:
        raise PlanError(f"{field} must be one of {[m.value for m in kind]}, got {value!r}; {_FIX}") from None


def _as_block_plan(item: BlockPlan | Policy | str) -> BlockPlan:
    if isinstance(item, BlockPlan):
        return item
    return BlockPlan(policy=_member(Policy, item, "policy"))


@dataclass(frozen=True)
class Plan:
    """One :class:`BlockPlan` per block of the chain, in forward order.

    ``prefetch``: when block ``i+1`` starts its backward, the swapped tensors of blocks
    ``i … i-prefetch+1`` are copied back to the device. ``min_swap_bytes``: saved tensors smaller
    than this stay on the device even in a swapped block (a copy that small costs more in latency
    than it frees).
    """

    blocks: tuple[BlockPlan, ...]
    prefetch: int = 2
    min_swap_bytes: int = DEFAULT_MIN_SWAP_BYTES
    name: str = "custom"
    meta: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(_as_block_plan(b) for b in self.blocks))
        if not self.blocks:
            raise PlanError("a plan needs at least one block")
        object.__setattr__(self, "prefetch", checks.count(self.prefetch, "prefetch", PlanError, hint=_FIX))
        object.__setattr__(self, "min_swap_bytes", checks.count(self.min_swap_bytes, "min_swap_bytes", PlanError, hint=_FIX))
        checks.text(self.name, "name", PlanError, hint=_FIX)

    def streaming(self, blocks: Iterable[int]) -> "Plan":
        """This plan with the parameters of ``blocks`` streamed from the host."""
        chosen = set(blocks)
        if not chosen <= set(range(len(self))):
            raise PlanError(f"blocks {sorted(chosen - set(range(len(self))))} are not in a plan of {len(self)} blocks")
        return replace(self, blocks=tuple(
            replace(b, params=Residency.STREAMED if i in chosen else b.params) for i, b in enumerate(self.blocks)))

    @classmethod
    def uniform(cls, policy: Policy | str, num_blocks: int, **kwargs: Any) -> "Plan":
        """The same policy for every block: ``Plan.uniform("swap", 12)``."""
        policy = Policy(policy)
        kwargs.setdefault("name", f"{policy.value}-all")
        return cls(blocks=tuple(BlockPlan(policy) for _ in range(num_blocks)), **kwargs)

    @classmethod
    def of(cls, policies: Iterable[Policy | str | BlockPlan], **kwargs: Any) -> "Plan":
        """``Plan.of(["keep", "swap", "recompute"])``."""
        return cls(blocks=tuple(_as_block_plan(p) for p in policies), **kwargs)

    def __len__(self) -> int:
        return len(self.blocks)

    def with_(self, **changes: Any) -> "Plan":
        return replace(self, **changes)

    @property
    def policies(self) -> tuple[Policy, ...]:
        return tuple(b.policy for b in self.blocks)

    def table(self, block_names: Iterable[str] | None = None) -> str:
        """The plan as a text table: block, policy, saved bytes, device bytes."""
        names = list(block_names) if block_names is not None else [str(i) for i in range(len(self))]
        if len(names) != len(self):
            raise PlanError(f"{len(names)} block names for a plan of {len(self)} blocks")
        rows = [("block", "policy", "saved", "on device")]
        for name, block in zip(names, self.blocks):
            saved = "-" if block.saved_bytes is None else format_bytes(block.saved_bytes)
            device = "-" if block.device_bytes is None else format_bytes(block.device_bytes)
            rows.append((name, block.label(), saved, device))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = [
            "  ".join(cell.ljust(widths[c]) if c < 2 else cell.rjust(widths[c]) for c, cell in enumerate(row))
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        header = f"plan {self.name!r}: {len(self)} blocks, prefetch {self.prefetch}"
        return "\n".join([header, *lines])

    def __str__(self) -> str:
        return self.table()

    # JSON -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "ooc.plan",
            "version": PLAN_FORMAT_VERSION,
            "name": self.name,
            "prefetch": self.prefetch,
            "min_swap_bytes": self.min_swap_bytes,
            "meta": dict(self.meta),
            "blocks": [
                {
                    "policy": b.policy.value,
                    "codec": b.codec.value,
                    "swap_input": b.swap_input,
                    "saved_bytes": b.saved_bytes,
                    "device_bytes": b.device_bytes,
                    "params": b.params.value,
                    "cached_ops": list(b.cached_ops),
                    "swapped_ops": list(b.swapped_ops),
                    **({"op_signature": b.op_signature} if b.op_signature is not None else {}),
                }
                for b in self.blocks
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        checks.file_format(data, "ooc.plan", PlanError)
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PlanError(f"corrupt plan JSON: \"version\" must be a whole number >= 1, got {version!r:.80}; {_FIX}")
        if version > PLAN_FORMAT_VERSION:
            raise PlanError(
                f"plan format version {version!r} is newer than this ooc understands "
                f"({PLAN_FORMAT_VERSION}); upgrade ooc or re-create the plan"
            )
        blocks, meta = data.get("blocks"), data.get("meta", {})
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise PlanError(f"corrupt plan JSON: \"blocks\" must be a list of objects, got {blocks!r:.80}; {_FIX}")
        if not isinstance(meta, dict):
            raise PlanError(f"corrupt plan JSON: \"meta\" must be an object, got {meta!r:.80}; {_FIX}")
        for i, b in enumerate(blocks):
            # A misspelt key ("swap_inputs", "codecs") would otherwise be dropped without a word.
            if unknown := sorted(set(b) - _BLOCK_FIELDS):
                raise PlanError(f"corrupt plan JSON: block {i} has unknown fields {unknown}; the fields are "
                                f"{sorted(_BLOCK_FIELDS)}; {_FIX}")
        try:
            return cls(
                blocks=tuple(
                    BlockPlan(
                        policy=b["policy"],
                        codec=b.get("codec", "none"),
                        swap_input=b.get("swap_input", False),
                        saved_bytes=b.get("saved_bytes"),
                        device_bytes=b.get("device_bytes"),
                        params=b.get("params", "resident"),
                        cached_ops=b.get("cached_ops", ()),
                        swapped_ops=b.get("swapped_ops", ()),
                        op_signature=b.get("op_signature"),
                    )
                    for b in blocks
                ),
                prefetch=data.get("prefetch", 2),
                min_swap_bytes=data.get("min_swap_bytes", 4096),
                name=data.get("name", "custom"),
                meta=tuple(sorted(meta.items())),
            )
        except KeyError as exc:
            raise PlanError(f"corrupt plan JSON: a block has no {exc} field; {_FIX}") from exc
        except PlanError as exc:
            raise PlanError(f"corrupt plan JSON: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"corrupt plan JSON: {exc}") from exc
        return cls.from_dict(data)
