"""Data parallelism for the host optimizer, over torch.distributed (NCCL on GPUs, gloo on CPUs).

``HostAdamW(..., data_parallel=DataParallel())`` on every rank of an initialized process group:
each bucket's gradients are summed across ranks as soon as its backward ends, then averaged and
applied on the host. ``shard=True`` gives each parameter one owner rank: gradients are reduced to
the owner only, the owner alone holds that parameter's master weights and moments and updates it,
then broadcasts the new weights (a reduce-scatter and all-gather at parameter granularity), so host
memory and host work per rank fall by about the world size.

At start-up every rank checks that the others built the same parameters (names, shapes, dtypes),
the same plan and the same optimizer options, and takes rank 0's initial weights.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ooc.errors import OocError

REDUCE_ON = ("auto", "device", "host")
"""Where data-parallel gradients are summed (:attr:`DataParallel.reduce_on`)."""


def check_reduce_on(value: str, *, extra: tuple[str, ...] = ()) -> str:
    """``value`` if it is one of :data:`REDUCE_ON` or of ``extra`` (choices a caller adds on top,
    such as ``ooc train``'s ``"model"``), else ``ValueError``."""
    choices = (*REDUCE_ON, *extra)
    if value not in choices:
        raise ValueError(f"reduce_on must be one of {', '.join(choices)}, got {value!r}")
    return value


class WorldError(OocError, RuntimeError):
    """The ranks disagree (model, plan, dtypes, options), or the process group is unusable."""


@dataclass(frozen=True)
class DataParallel:
    """How :class:`~ooc.optim.HostAdamW` trains data-parallel.

    - ``shard``: each rank keeps and updates only its share of the optimizer state.
    - ``reduce_on``: ``"device"`` sums gradients on the device before they go to the host (NCCL, the
      GPU's links); ``"host"`` copies them to the host first and sums the host copies over gloo,
      leaving the GPU's links to the activation swaps. ``"auto"``: ``"device"`` when the default
      process group is NCCL, else ``"host"``.
    - ``check``: compare every rank's model, plan and options at start-up.
    - ``timeout_s``: how long a gradient exchange waits for a peer before failing (a rank that died
      fails it at once; one that hangs, after this).
    """

    shard: bool = False
    reduce_on: str = "auto"
    check: bool = True
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_reduce_on(self.reduce_on)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    def resolved_reduce_on(self) -> str:
        if self.reduce_on != "auto":
            return self.reduce_on
        return "device" if dist.get_backend() == "nccl" else "host"


class GroupCommunicator:
    """Collectives on two process groups of all ranks: one for the exchange thread (sums), one for
    the update thread (broadcasts of updated shards, the clipping norms)."""

    def __init__(self, config: DataParallel) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise WorldError(
                "data_parallel needs an initialized torch.distributed process group: launch with torchrun "
                "and call torch.distributed.init_process_group() before building HostAdamW"
            )
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.sharded = config.shard
        self.reduce_on = config.resolved_reduce_on()
        ranks = list(range(self.world))
        # new_group is collective: every rank creates the same groups in the same order.
        exchange_backend = "gloo" if self.reduce_on == "host" else None
        timeout = datetime.timedelta(seconds=config.timeout_s)
        self._exchange = dist.new_group(ranks, backend=exchange_backend, timeout=timeout)
        self._update = dist.new_group(ranks, backend=exchange_backend, timeout=timeout)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        with peer_failures():
            dist.all_reduce(tensor, group=self._exchange)

    def reduce(self, tensor: torch.Tensor, dst: int) -> None:
        with peer_failures():
            dist.reduce(tensor, dst=dst, group=self._exchange)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        with peer_failures():
            dist.broadcast(tensor, src=src, group=self._update)

    def sum_vector(self, tensor: torch.Tensor) -> None:
        with peer_failures():
            dist.all_reduce(tensor, group=self._update)

    def close(self) -> None:
        for group in (self._exchange, self._update):
            dist.destroy_process_group(group)


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """Turn a failed collective into a :class:`WorldError` that says a peer is gone."""
    try:
        yield
    except RuntimeError as exc:
        raise WorldError(
            f"rank {dist.get_rank()} lost the other ranks: a gradient exchange failed ({exc}). Another rank died, "
            "or hung past the process group's timeout; see its log."
        ) from exc


def assign_owners(params: Sequence[torch.Tensor], world: int) -> dict[int, int]:
    """Owner rank of each parameter (by ``id``): the largest first, each to the least-loaded rank,
    so every rank updates about ``1/world`` of the elements. Deterministic on every rank."""
    load = [0] * world
    owner: dict[int, int] = {}
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    for i in order:
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[id(params[i])] = rank
        load[rank] += params[i].numel()
    return owner


def fingerprint(model: nn.Module | None, params: Sequence[torch.Tensor], options: dict[str, Any],
                plan_json: str | None) -> dict[str, str]:
    """What every rank must agree on, hashed per topic so a mismatch names the topic."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    layout = [(names.get(id(p), f"#{i}"), tuple(p.shape), str(p.dtype)) for i, p in enumerate(params)]

    def digest(value: object) -> str:
        return hashlib.sha256(json.dumps(value, default=str, sort_keys=True).encode()).hexdigest()[:16]

    return {
        "parameter names and shapes": digest([(n, s) for n, s, _ in layout]),
        "parameter dtypes": digest([d for _, _, d in layout]),
        "plan": digest(plan_json),
        "optimizer options": digest(options),
        "torch version": torch.__version__,
    }


def check_world(mine: dict[str, str]) -> None:
    """Raise :class:`WorldError` on every rank if any rank's fingerprint differs from rank 0's."""
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    problems = [
        f"rank {rank} differs from rank 0 in: {', '.join(k for k in reference if other.get(k) != reference[k])}"
        for rank, other in enumerate(everyone)
        if other != reference
    ]
    if problems:
        raise WorldError(
            "; ".join(problems) + ". Every rank must build the same model (same sizes and dtypes), the same "
            "ooc plan and the same optimizer options; check the command line of each rank."
        )


def join_world(config: DataParallel, *, model: nn.Module | None, params: Sequence[torch.Tensor],
               host_params: Sequence[torch.Tensor], options: dict[str, Any],
               plan_json: str | None) -> tuple[GroupCommunicator, dict[int, int]]:
    """The data-parallel handshake of a host optimizer, on every rank: make its process groups, check
    (``config.check``) that every rank built the same model, plan and ``options``, start every rank
    from rank 0's weights, and give each of ``host_params`` its owner rank (all rank 0's unless
    sharded). Returns the communicator and the owners (by ``id``); closes the groups on failure."""
    comm = GroupCommunicator(config)
    try:
        if config.check:
            check_world(fingerprint(model, params, options_of(config, **options), plan_json))
        broadcast_parameters(params)
        owner = assign_owners(host_params, comm.world) if config.shard else {id(p): 0 for p in host_params}
    except BaseException:
        comm.close()
        raise
    return comm, owner


def broadcast_parameters(params: Sequence[torch.Tensor]) -> None:
    """Every rank starts from rank 0's weights (as DistributedDataParallel does)."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def options_of(config: DataParallel, **options: Any) -> dict[str, Any]:
    return {**asdict(config), **options}


def init_from_env(timeout_s: float, backend: str | None = None) -> bool:
    """Join the process group that ``torchrun`` (or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) describes.

    Returns ``False`` (and does nothing) for a single process without those variables. ``timeout_s``
    bounds every collective: a rank that dies or hangs makes the others fail within it.
    """
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return False
    if dist.is_initialized():
        return True
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True
