"""Measured (or analytic) per-block costs of a model: what the planner and the simulator consume."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ooc.scheduler.codecs import nominal_ratio

PROFILE_FORMAT_VERSION = 1


class ProfileError(ValueError):
    """A profile that cannot be read, or one that does not describe the model at hand."""


@dataclass(frozen=True)
class BlockProfile:
    """Costs of one block for one input shape.

    Byte counts follow the runtime's accounting (``ooc.scheduler.accounting``): saved tensors are
    deduplicated within the block, parameters and their views are not counted.

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
    counted at its nominal ratio."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "compressed", tuple((str(e[0]), *(int(v) for v in e[1:])) for e in self.compressed))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "compressed") and value < 0:
                raise ProfileError(f"block {self.name!r}: {f.name} must be >= 0, got {value}")
        if self.swappable_bytes > self.saved_bytes:
            raise ProfileError(f"block {self.name!r}: swappable_bytes exceeds saved_bytes")
        if self.input_swappable_bytes > self.input_bytes:
            raise ProfileError(f"block {self.name!r}: input_swappable_bytes exceeds input_bytes")

    def compressed_bytes(self, codec: str, *, inputs: bool) -> tuple[int, int]:
        """Swappable bytes of the saved tensors (or inputs) once compressed with ``codec``, and the
        codes of the largest single storage among them."""
        for name, saved, inp, saved_max, inp_max in self.compressed:
            if name == codec:
                return (inp, inp_max) if inputs else (saved, saved_max)
        raw = self.input_swappable_bytes if inputs else self.swappable_bytes
        return int(raw * nominal_ratio(codec)), 0


def machine_header() -> dict[str, str]:
    """Where a profile or benchmark was measured (no CUDA initialisation)."""
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
    min_swap_bytes: int = 4096
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

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.blocks)

    def check_matches(self, block_names: list[str]) -> None:
        """Raise :class:`ProfileError` unless this profile describes exactly these blocks."""
        if list(self.names) != list(block_names):
            raise ProfileError(
                f"the profile describes {len(self)} blocks {list(self.names)[:4]}..., the model has "
                f"{len(block_names)} blocks {list(block_names)[:4]}...; profile this model again "
                "(ooc profile, or ooc.profile(model, sample))"
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
        if not isinstance(data, dict) or data.get("format") != "ooc.profile":
            raise ProfileError("not an ooc profile: the JSON has no \"format\": \"ooc.profile\" field")
        version = data.get("version")
        if not isinstance(version, int) or version > PROFILE_FORMAT_VERSION:
            raise ProfileError(
                f"profile format version {version!r} is newer than this ooc understands "
                f"({PROFILE_FORMAT_VERSION}); upgrade ooc or profile the model again"
            )
        try:
            return cls(
                blocks=tuple(BlockProfile(**b) for b in data["blocks"]),
                min_swap_bytes=int(data.get("min_swap_bytes", 4096)),
                outside_forward_s=float(data.get("outside_forward_s", 0.0)),
                outside_backward_s=float(data.get("outside_backward_s", 0.0)),
                outside_param_bytes=int(data.get("outside_param_bytes", 0)),
                model=str(data.get("model", "model")),
                source=str(data.get("source", "measured")),
                machine=dict(data.get("machine", {})),
                notes=str(data.get("notes", "")),
            )
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"corrupt profile JSON: {exc}") from exc

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
