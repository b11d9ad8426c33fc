"""Storages that several blocks hold: each is counted once, by the first block that keeps it on the device.

NOTE [storages shared between blocks]
Blocks of a chain often hold the same storage: a ResNet block saves the ReLU output it returns and
the next block's convolution saves the same tensor as its input; every decoder block of T5 saves the
encoder's output for its cross-attention. Counted once per block, a keep-all ResNet chain looked 16%
larger than it is. The runtime and the schedule follow one rule instead:

- In the forward, a block that *keeps* a storage on the device (KEEP, a storage below
  ``min_swap_bytes`` in a SWAP block, the input of a RECOMPUTE block) which an earlier block of the
  same pass already keeps does not count it: it is on the device anyway, counted by that earlier
  block until the earlier block's backward ends, which is after this block's.
- A block that *swaps* such a storage still copies it out and back (the plan said so), but the
  bytes it would free at its release stay on the device, held by the earlier block, so it neither
  counts them at its pack nor frees them at its release (a compressed swap counts its codes, which
  are new bytes). The copy back is new memory and is counted as always.
- A re-run (RECOMPUTE's backward) counts what it re-saves, as before.

The profile lists each block's shared storages (``BlockProfile.shared``, measured by
``ooc.storage_sharing``); :func:`shared_adjustments` replays the rule over a plan for the schedule.
The planners' additive models count shared storages per block, so they over-estimate a plan's peak
by at most the shared bytes: their plans fit, and the schedule gives the exact peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from ooc.scheduler.codecs import codec_spec
from ooc.scheduler.plan import Codec, Plan, Policy
from ooc.scheduler.profile import Profile


@dataclass(frozen=True)
class SharedAdjustment:
    """Bytes of one block that an earlier block already counts on the device."""

    kept: int = 0
    """Kept storages not counted again (the block's forward allocates that much less)."""
    swapped: int = 0
    """Swapped storages whose device bytes stay with the earlier block (not counted at the pack, not
    freed at the release; still moved both ways)."""


def shared_adjustments(plan: Plan, profile: Profile) -> list[SharedAdjustment]:
    """Per block, the bytes the rule of NOTE [storages shared between blocks] leaves uncounted."""
    counted: set[int] = set()
    out = []
    for decision, block in zip(plan.blocks, profile.blocks):
        kept = swapped = 0
        role_saved = decision.policy is not Policy.RECOMPUTE
        swaps = decision.policy is Policy.SWAP or decision.swap_input  # what holds the block's saved tensors or input
        spec = None if decision.codec is Codec.NONE else codec_spec(decision.codec)
        for entry in block.shared:
            if not (entry.saved if role_saved else entry.input):
                continue
            if not swaps or entry.nbytes < plan.min_swap_bytes:
                if entry.id in counted:
                    kept += entry.nbytes
                else:
                    counted.add(entry.id)
            elif entry.id in counted and not (spec is not None and spec.compresses(entry.nbytes, entry.dtype)):
                swapped += entry.nbytes
        out.append(SharedAdjustment(kept, swapped))
    return out
