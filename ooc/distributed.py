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
import math
import os
import time
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


def check_timeout(value: float, *, name: str = "timeout_s") -> float:
    """``value`` if it is a finite number of seconds > 0, else ``ValueError``. NOTE: an infinite one
    (meant as "no timeout") passed the check and failed later, out of ``datetime.timedelta`` when the
    process groups were made ("OverflowError: cannot convert float infinity to integer"), and NaN
    (which is not <= 0) likewise: a hung rank must fail the others at some point."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0 (how long a collective waits for a peer "
                         f"before failing), got {value!r}")
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
    - ``broadcast_buffers``: the model's buffers (BatchNorm's running statistics) are rank 0's at the
      start of each step's first forward in training mode with grad enabled, as
      ``DistributedDataParallel(broadcast_buffers=True)`` makes them, and when the optimizer is built
      (NOTE [buffers follow rank 0] in ooc.optim.host_adamw); ``False``: each rank keeps its own.
    """

    shard: bool = False
    reduce_on: str = "auto"
    check: bool = True
    timeout_s: float = 300.0
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        check_reduce_on(self.reduce_on)
        check_timeout(self.timeout_s)

    def resolved_reduce_on(self) -> str:
        if self.reduce_on != "auto":
            return self.reduce_on
        return "device" if dist.get_backend() == "nccl" else "host"


def backend_for(tensor: torch.Tensor, default: str) -> str:
    """The process-group backend a collective on ``tensor`` needs: a host tensor goes over gloo
    (NCCL carries device memory only; a host tensor there fails as if a peer were lost), a device
    tensor over the default group's backend (``default``, NCCL on GPUs)."""
    return "gloo" if tensor.device.type == "cpu" else default


class GroupCommunicator:
    """Collectives on process groups of all ranks: the exchange thread's (sums), the update
    thread's (broadcasts of updated shards, the clipping norms) and the training thread's (the
    start-up handshake, the gradients of parameters kept on the device). Each collective goes to its
    thread's group of the backend its tensor needs (:func:`backend_for`): the update thread carries
    host tensors only (staging and flat buffers, the norms), so its group is gloo; the exchange
    thread's is gloo for ``reduce_on="host"``, else the default backend (NCCL: device buffers); the
    training thread's is the default backend's.

    NOTE [every collective times out]
    Every group is made with ``timeout_s``, so that a rank that hangs fails the others within it.
    The training thread's collectives ran on the default group, whose timeout is the one
    ``init_process_group`` got (30 minutes by default): a hung peer held a rank in a step with
    parameters kept on the device (``device_params_below``) until the peer went away."""

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
        self.default_backend = str(dist.get_backend())
        ranks = list(range(self.world))
        timeout = datetime.timedelta(seconds=config.timeout_s)
        exchange_backend = "gloo" if self.reduce_on == "host" else self.default_backend
        self._groups: dict[tuple[str, str], Any] = {}
        # new_group is collective: every rank creates the same groups in the same order.
        for key in (("exchange", exchange_backend), ("update", "gloo"), ("training", self.default_backend)):
            try:
                self._groups[key] = dist.new_group(ranks, backend=key[1], timeout=timeout)
            except RuntimeError as exc:
                self.close()
                raise _not_joined(self.rank, config.timeout_s, exc) from exc

    def group_for(self, thread: str, tensor: torch.Tensor) -> Any:
        """The process group of ``thread`` (``"exchange"`` or ``"update"``) for a collective on ``tensor``."""
        backend = backend_for(tensor, self.default_backend)
        try:
            return self._groups[(thread, backend)]
        except KeyError:
            raise WorldError(
                f"internal error: the {thread} thread has no {backend} process group for a tensor on {tensor.device} "
                f"(it has {sorted(b for t, b in self._groups if t == thread)}); please report this"
            ) from None

    def all_reduce(self, tensor: torch.Tensor, *, thread: str = "exchange") -> None:
        with peer_failures():
            dist.all_reduce(tensor, group=self.group_for(thread, tensor))

    def reduce(self, tensor: torch.Tensor, dst: int) -> None:
        with peer_failures():
            dist.reduce(tensor, dst=dst, group=self.group_for("exchange", tensor))

    def training_group(self) -> Any:
        """The training thread's group (the default backend's)."""
        return next(group for (thread, _), group in self._groups.items() if thread == "training")

    def broadcast(self, tensor: torch.Tensor, src: int, *, thread: str = "update") -> None:
        with peer_failures():
            dist.broadcast(tensor, src=src, group=self.group_for(thread, tensor))

    def sum_vector(self, tensor: torch.Tensor) -> None:
        with peer_failures():
            dist.all_reduce(tensor, group=self.group_for("update", tensor))

    def close(self) -> None:
        for group in self._groups.values():
            dist.destroy_process_group(group)


def _not_joined(rank: int, timeout_s: float, exc: BaseException) -> WorldError:
    """The error of a rank whose peers did not make the data-parallel process groups with it.

    NOTE [a rank that never joins]
    Making a process group waits for every rank to make it too. A rank that built its HostAdamW
    without ``data_parallel=`` (a condition on the rank or the world size that differs by rank), or
    not at all, or later than ``timeout_s`` (it died, or was still loading data), left the others
    with torch's own error out of ``new_group`` after the timeout ("DistStoreError: wait timeout
    after 8000ms, keys: /default_pg/0//1//cpu//0/1"), which names neither the optimizer nor the cause."""
    return WorldError(
        f"rank {rank} waited {timeout_s:g} s (DataParallel.timeout_s) for the other ranks to build their HostAdamW "
        f"with data_parallel=, and not every rank did ({exc}). Every rank of the process group must build one, with "
        "data_parallel= and at the same point of its script: a rank that builds it without data_parallel= (or not at "
        "all), or that died or was still busy when this one timed out, leaves the others waiting; see its log."
    )


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """Turn a failed collective into a :class:`WorldError` that says a peer is gone.

    NOTE [why a collective times out]
    A peer that is alive but never joins the collective fails it by the timeout as a hung one does:
    a rank that ran out of batches first (it finished its loop, or evaluates, while this one runs one
    more step), or one that ran a training-mode forward with grad enabled that this one did not (each
    rank's first such forward after ``step()`` broadcasts the model's buffers, NOTE [buffers follow
    rank 0] in ooc.optim.host_adamw). The message
    said only that a rank died or hung, and so sent the user to look for a crash that never was."""
    try:
        yield
    except RuntimeError as exc:
        raise WorldError(
            f"rank {dist.get_rank()} lost the other ranks: a gradient exchange failed ({exc}). Another rank died, "
            "or hung past the process group's timeout; see its log. A rank still running fails so too when the "
            "ranks went out of step: one ran fewer backward passes and step() calls than the others (its data ran "
            "out first: give every rank as many batches), or a training-mode forward with grad enabled that the "
            "others did not (each such forward first after step() takes rank 0's buffers: evaluate on some ranks "
            "only after model.eval() or under torch.no_grad())."
        ) from exc


_ARRIVAL_POLL_S = 0.05
"""How often :func:`ranks_not_arrived` reads the other ranks' counts (a few store reads each time)."""


def ranks_not_arrived(name: str, timeout_s: float) -> list[int]:
    """This rank's next call ``name`` (e.g. a Checkpointer's ``restore`` of a directory); waits up to
    ``timeout_s`` for every rank of the default process group to make the same call as often, and
    returns the ranks that did not (``[]``: all did).

    On the group's key-value store, not a collective: a barrier would hang a rank whose peers never
    call (``if rank == 0: ckpt.restore()``) until the group's timeout (30 minutes by default), and
    say nothing of why. Each rank counts its own calls (``ooc/arrived/<name>/<rank>``), so calls
    made through another object on the same ``name`` go on counting, and the n-th calls meet."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = store.add(f"ooc/arrived/{name}/{rank}", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(world) if r != rank and store.add(f"ooc/arrived/{name}/{r}", 0) < mine]
        if missing and time.monotonic() >= deadline:
            return missing
        if not missing:
            break
        time.sleep(_ARRIVAL_POLL_S)
    # Rank 0's process serves the store (env:// and torchrun): a rank 0 that went on and ended took it
    # with it while another rank still read the counts ("Failed to recv ... Did the remote server
    # shutdown"). So the others say when they are done reading, and rank 0 leaves last.
    done = f"ooc/arrived/{name}/done/{mine}"
    if rank != 0:
        store.add(done, 1)
        return []
    deadline = time.monotonic() + timeout_s
    while store.add(done, 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(_ARRIVAL_POLL_S)
    return []


def announce(name: str) -> int | None:
    """Count, on the default process group's store, that this rank has reached ``name`` once more
    (e.g. a Checkpointer that saved is closing); return how often it has, or None if the store
    cannot be reached (rank 0's process serves it and may have ended). Other ranks read it with
    :func:`ranks_announced`: the n-th announcements meet, as the n-th calls of
    :func:`ranks_not_arrived` do."""
    try:
        return dist.distributed_c10d._get_default_store().add(f"ooc/announced/{name}/{dist.get_rank()}", 1)
    except (RuntimeError, OSError):  # DistStoreError ("Did the remote server shutdown") is a RuntimeError
        return None


def ranks_announced(name: str, ranks: Sequence[int], count: int) -> list[int] | None:
    """Those of ``ranks`` that have announced ``name`` (:func:`announce`) at least ``count`` times;
    None if the store cannot be read: rank 0's process serves it (env:// and torchrun), and it may
    have ended already."""
    store = dist.distributed_c10d._get_default_store()
    try:
        return [r for r in ranks if store.add(f"ooc/announced/{name}/{r}", 0) >= count]
    except (RuntimeError, OSError):  # DistStoreError ("Did the remote server shutdown") is a RuntimeError
        return None


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
                plan_json: str | None, groups: Sequence[dict[str, Any]] = (), *, buffers: bool = False) -> dict[str, str]:
    """What every rank must agree on, hashed per topic so a mismatch names the topic. ``groups``: the
    optimizer's parameter groups (``params`` is their concatenation), whose sizes and AdamW settings count.
    ``buffers``: the model's buffers are broadcast from rank 0 (``DataParallel.broadcast_buffers``), so
    their names, shapes and dtypes count too."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    layout = [(names.get(id(p), f"#{i}"), tuple(p.shape), str(p.dtype)) for i, p in enumerate(params)]

    def digest(value: object) -> str:
        return hashlib.sha256(json.dumps(value, default=str, sort_keys=True).encode()).hexdigest()[:16]

    return {
        "parameter names and shapes": digest([(n, s) for n, s, _ in layout]),
        "parameter dtypes": digest([d for _, _, d in layout]),
        # A weight frozen on one rank only would take the others' gradients there (NOTE [gradients
        # missing on some ranks] in ooc.optim.stages): trained on one rank, frozen on another.
        "trainable parameters": digest([p.requires_grad for p in params]),
        "plan": digest(plan_json),
        "optimizer options": digest(options),
        # NOTE [parameter groups are compared]: a group's lr or weight_decay differing by rank (the
        # no-decay group of norms and biases built under a condition, a per-rank config) was not
        # compared: unsharded each rank updated with its own settings and the weights parted without a
        # word (sharded, each owner's settings made a mix). So each group's size and settings count.
        "parameter groups": digest([{"parameters": len(g["params"]), **{k: g[k] for k in _GROUP_SETTINGS if k in g}}
                                    for g in groups]),
        # NOTE [buffers are compared]: rank 0's buffers are broadcast into every rank's as they lie
        # (NOTE [buffers follow rank 0] in ooc.optim.host_adamw). A buffer of another size on one rank
        # (a positional table sized by a per-rank setting) aborted the smaller rank's process inside
        # gloo without a message, or filled only the start of the larger one and the ranks parted
        # without a word: the parameters were compared, the buffers not.
        "buffer names, shapes and dtypes": digest([(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
                                                  if buffers and model is not None else None),
        "torch version": torch.__version__,
    }


_GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")
"""The settings of a parameter group that its update reads (:class:`~ooc.optim.stages.Hyper`)."""


def check_world(mine: dict[str, str], group: Any = None) -> None:
    """Raise :class:`WorldError` on every rank if any rank's fingerprint differs from rank 0's
    (``group``: the process group to compare over, default the default group)."""
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    with peer_failures():
        dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    problems = [
        f"rank {rank} differs from rank 0 in: {', '.join(k for k in reference if other.get(k) != reference[k])}"
        for rank, other in enumerate(everyone)
        if other != reference
    ]
    if problems:
        plans = any(other is not None and other.get("plan") != reference["plan"] for other in everyone)
        raise WorldError(
            "; ".join(problems) + ". Every rank must build the same model (same sizes and dtypes), the same "
            "ooc plan and the same optimizer options and parameter groups; check the command line of each rank."
            + (PLANS_DIFFER if plans else "")
        )


PLANS_DIFFER = (
    " A plan chosen from a budget (ooc.wrap(model, budget=..., sample=...)) is measured on each rank, and timing "
    "noise can choose another on two ranks: choose it on one rank and give every rank that one, as ooc train does "
    "(chosen = [ooc.plan(model, sample, budget=...).to_json() if rank == 0 else None]; "
    "torch.distributed.broadcast_object_list(chosen, src=0); ooc.wrap(model, ooc.Plan.from_json(chosen[0])))."
)
"""What :func:`check_world` adds when the ranks' plans differ."""


def join_world(config: DataParallel, *, model: nn.Module | None, params: Sequence[torch.Tensor],
               host_params: Sequence[torch.Tensor], options: dict[str, Any],
               plan_json: str | None, groups: Sequence[dict[str, Any]] = ()) -> tuple[GroupCommunicator, dict[int, int]]:
    """The data-parallel handshake of a host optimizer, on every rank: make its process groups, check
    (``config.check``) that every rank built the same model, plan and ``options``, start every rank
    from rank 0's weights, and give each of ``host_params`` its owner rank (all rank 0's unless
    sharded). ``groups``: the optimizer's parameter groups, compared too. Returns the communicator and the owners (by ``id``); closes the groups on failure."""
    comm = GroupCommunicator(config)
    try:
        if config.check:
            check_world(fingerprint(model, params, options_of(config, **options), plan_json, groups,
                                    buffers=config.broadcast_buffers), comm.training_group())
        broadcast_parameters(params, comm)
        owner = assign_owners(host_params, comm.world) if config.shard else {id(p): 0 for p in host_params}
    except BaseException:
        comm.close()
        raise
    return comm, owner


def broadcast_parameters(params: Sequence[torch.Tensor], comm: GroupCommunicator) -> None:
    """Every rank starts from rank 0's weights (as DistributedDataParallel does): device parameters
    over the training thread's group, host ones (streamed parameters) over ``comm``'s gloo group."""
    with torch.no_grad(), peer_failures():
        for p in params:
            if backend_for(p.data, comm.default_backend) == comm.default_backend:
                dist.broadcast(p.data, src=0, group=comm.training_group())
            else:
                # Not yet running: the update thread's group is free for the start-up broadcast.
                dist.broadcast(p.data, src=0, group=comm.group_for("update", p.data))


def options_of(config: DataParallel, **options: Any) -> dict[str, Any]:
    return {**asdict(config), **options}


def init_from_env(timeout_s: float, backend: str | None = None, *, device: torch.device | None = None) -> bool:
    """Join the process group that ``torchrun`` (or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) describes.

    Returns ``False`` (and does nothing) for a single process without those variables. ``timeout_s``
    bounds every collective: a rank that dies or hangs makes the others fail within it. ``device``:
    where this rank trains; a CUDA device becomes the current one before the group is made (NCCL
    binds each rank to the current device) and picks NCCL, the CPU picks gloo (``None``: NCCL
    whenever CUDA exists).
    """
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return False
    if dist.is_initialized():
        return True
    on_gpu = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    if backend is None:
        backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True
