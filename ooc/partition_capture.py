"""Capture a training step's joint forward+backward op graph for ``ooc.scheduler.partition``.

``make_fx`` traces a function that runs the model functionally and calls ``torch.autograd.grad``:
the trace holds every aten op of the forward and of the backward (the joint graph AOT autograd
partitions), with the parameters, buffers and inputs as placeholders, traced once more through
``functionalize`` (NOTE [a functional step], NOTE [a pure step]). Each op is then run alone
on the real values, ``repeats`` times, and its median time and its output's bytes become the node;
an edge carries its producer's output bytes.

# NOTE [views hold no bytes]
A node holds the bytes of the storages its op creates: an op whose output shares storage with an
input (a view, ``t``, ``getitem`` of a tuple, an in-place op) holds nothing new, though an edge out
of it still carries the tensor's bytes when it crosses devices. The storage stays alive while any
view of it is used, so the node that created a storage gets a 0-byte edge to every op that reads
the storage through a view: the simulator then holds it until that op ends.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ooc.errors import WrapError
from ooc.profiler import default_loss
from ooc.scheduler.partition.graph import OpGraph


def trace_step(model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.fx.GraphModule:
    """The joint forward+backward aten graph of one step of ``model`` on ``sample``: placeholders
    (parameters, buffers, the sample's tensors), then the forward, the loss and the backward ops;
    outputs the loss and one gradient per parameter that needs one (None where the step does not
    use it)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise WrapError("the model has no parameter that requires a gradient; there is no backward to capture")
    # Tracing runs the step for real: clones keep a BatchNorm's running statistics, and an input
    # the model writes in place, as they were.
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    leaves, rebuild = _tensors(sample)
    leaves = [x.clone() for x in leaves]
    loss_of = loss_fn or default_loss

    def step(p: dict, b: dict, *xs: torch.Tensor):
        with _Redraws():
            out = _call(model, {**p, **b}, rebuild(xs))
            loss = loss_of(out)
            # A parameter the step does not use gets None, as eager's backward leaves its .grad.
            grads = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
        return (loss, *grads)

    # NOTE [a step of this sample]: the trace is of one step on this sample, as its shapes are. A
    # value read on the host (``.item()``, a branch on ``(mask == 0).all()`` as Hugging Face's mask
    # code takes) is taken as this sample gives it, a constant of the graph, where make_fx would
    # refuse to read it at all.
    traced = make_fx(step, _error_on_data_dependent_ops=False)(params, buffers, *leaves)
    # NOTE [a functional step]: an in-place op writes a storage that other nodes read through
    # other views, with no edge between them; placed on another device it writes a copy, and the
    # readers do not see it. Traced again through functionalize, every write is an op whose output
    # its readers take.
    functional = make_fx(torch.func.functionalize(traced), _IN_PLACE_DRAWS,
                         _error_on_data_dependent_ops=False)(params, buffers, *leaves)
    return _without_write_backs(functional)


@torch.library.custom_op("ooc_partition::rng_state", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _rng_state(like: torch.Tensor) -> torch.Tensor:
    """The state of the generator ``like``'s device draws from (a CPU byte tensor)."""
    return torch.cuda.get_rng_state(like.device) if like.is_cuda else torch.get_rng_state()


@torch.library.custom_op("ooc_partition::bernoulli_at", mutates_args=())
def _bernoulli_at(like: torch.Tensor, p: float, state: torch.Tensor) -> torch.Tensor:
    """``empty_like(like).bernoulli_(p)`` drawn from the generator in ``state``, which is left as
    it was (as torch.utils.checkpoint's recomputation draws)."""
    with torch.random.fork_rng(devices=[like.device.index or 0] if like.is_cuda else []):
        if like.is_cuda:
            torch.cuda.set_rng_state(state.cpu(), like.device)
        else:
            torch.set_rng_state(state.cpu())
        return torch.empty_like(like).bernoulli_(p)


class _Redraws(TorchDispatchMode):
    """Under make_fx: dropout's draw from a generator in the state of an earlier such draw is
    traced as that draw again, from the generator's state taken before it.

    NOTE [redraws]: torch.utils.checkpoint's recomputation (Hugging Face's gradient checkpointing)
    sets the generator back to its state before the block's forward, draws the block's dropout
    masks again and restores the generator. The trace sees neither state change, only a second
    draw: at run time a fresh mask, and the generator taken on. The trace runs for real, so the
    generator's state tells a redraw: each first draw is traced after a node that takes the state
    (``rng_state``; unused ones are dropped), and a redraw as ``bernoulli_at`` that state, which
    leaves the generator as it was, as eager's recomputation does."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: dict[tuple, torch.Tensor] = {}   # (generator state, layout, p) -> the state's node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is not torch.ops.aten.bernoulli_.float or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        dst, p = args[0], args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        with disable_proxy_modes_tracing():   # read, not traced (it would be a constant of the graph)
            now = torch.cuda.get_rng_state(dst.device) if dst.is_cuda else torch.get_rng_state()
            key = (now.numpy().tobytes(), dst.shape, dst.stride(), dst.dtype, dst.device, p)
        if key in self.drawn:
            out = torch.ops.ooc_partition.bernoulli_at(dst, p, self.drawn[key])
            with disable_proxy_modes_tracing():
                # Untraced: the trace's generator moves on as eager's redraw moves it, so the
                # block's next redraw finds its own first draw's state.
                torch.empty_like(dst).bernoulli_(p)
            return dst.copy_(out)
        self.drawn[key] = torch.ops.ooc_partition.rng_state(dst)
        return func(*args, **kwargs)


def _bernoulli_in_place(x: torch.Tensor, p: float, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.empty_like(x).bernoulli_(p, generator=generator)


# NOTE [draws in eager's layout]: functionalize turns dropout's ``empty_like(x).bernoulli_(p)`` into
# ``bernoulli(x, p)``, whose mask is contiguous: for a transposed ``x`` (after batch-first attention)
# its numbers land in another order than eager's. Drawn in place into ``empty_like(x)`` as eager
# does, the mask is eager's; no other op reads the fresh tensor, so the write is safe to place.
_IN_PLACE_DRAWS = {torch.ops.aten.bernoulli.p: _bernoulli_in_place}


def _without_write_backs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` less the ``copy_`` of a new value into a placeholder that functionalize adds for each
    argument the step writes in place.

    NOTE [a pure step]: the step's outputs are the loss and the gradients; a buffer's update in
    forward (BatchNorm's running statistics, a running mean) is not one of them. Written back, it
    changed the captured arguments at every run (capture's timing runs included), so each run
    started from other values than the model's."""
    for node in list(gm.graph.nodes):
        if (node.target is torch.ops.aten.copy_.default and not node.users
                and node.args[0].op == "placeholder"):
            gm.graph.erase_node(node)
        elif node.target is torch.ops.ooc_partition.rng_state.default and not node.users:
            gm.graph.erase_node(node)   # NOTE [redraws]: a draw nothing draws again
    gm.recompile()
    return gm


def _call(model: nn.Module, state: dict, sample: Any) -> Any:
    """``ooc.profiler.call_model`` with the parameters and buffers in ``state``."""
    if isinstance(sample, Mapping):
        return torch.func.functional_call(model, state, (), dict(sample))
    if isinstance(sample, (tuple, list)):
        return torch.func.functional_call(model, state, tuple(sample))
    return torch.func.functional_call(model, state, (sample,))


def _tensors(sample: Any) -> tuple[list[torch.Tensor], Callable[[tuple], Any]]:
    """The tensors in ``sample`` (each once), and how to rebuild ``sample`` with others in their place (a
    mapping as a dict: a tokenizer's or collator's BatchEncoding is a Mapping, not a dict, and one
    opaque leaf to the pytree, whose tensors would be traced as constants, not the step's inputs)."""
    flat, spec = tree_flatten(dict(sample) if isinstance(sample, Mapping) else sample)
    # One tensor given twice is one input: self-attention called as ``mha(x, x, x)`` takes its
    # packed path only where ``query is key``.
    first: dict[int, int] = {}   # id of a tensor -> its index among the inputs
    slot: dict[int, int] = {}    # position in flat -> index among the inputs
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            slot[i] = first.setdefault(id(x), len(first))
    unique = list({id(flat[i]): flat[i] for i in slot}.values())

    def rebuild(xs: tuple) -> Any:
        out = list(flat)
        for i, j in slot.items():
            out[i] = xs[j]
        return tree_unflatten(out, spec)

    return unique, rebuild


@dataclass(frozen=True, eq=False)
class CapturedStep:
    """A traced step, the values of its placeholders, and its op graph: node ``i`` of ``graph`` is
    the ``i``-th node of ``gm.graph`` (its output node left out)."""

    gm: torch.fx.GraphModule
    args: tuple[torch.Tensor, ...]
    graph: OpGraph


def capture_step(model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                 repeats: int = 3) -> CapturedStep:
    """:func:`capture`, keeping the traced module and its arguments (to run under a placement)."""
    if repeats < 1:
        raise WrapError(f"repeats={repeats}: each op's time is a median of its timed runs; time it at least once "
                        "(repeats >= 1)")
    # Tracing twice and timing each op draw dropout's masks: the generators are left as they were,
    # as ooc.profile leaves them.
    gpus = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    with torch.random.fork_rng(devices=gpus):
        gm = trace_step(model, sample, loss_fn)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        leaves, _ = _tensors(sample)
        # Buffers are cloned: a BatchNorm's running statistics are updated in place by the step, and
        # each op runs 1 + repeats times here.
        values = [p.detach() for _, p in params] + [b.clone() for _, b in model.named_buffers()] + leaves
        labels = ([f"param.{n}" for n, _ in params] + [f"buffer.{n}" for n, _ in model.named_buffers()]
                  + [f"input.{i}" for i in range(len(leaves))])
        return CapturedStep(gm, tuple(values), graph_of(gm, values, repeats=repeats, labels=labels))


def capture(model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
            repeats: int = 3) -> OpGraph:
    """The op graph of one training step (see module docstring). ``loss_fn`` maps the model's
    output to a scalar (default: :func:`ooc.profiler.default_loss`). Times are each op's median over
    ``repeats`` runs after the run that gives the values (an in-place op is re-run on its own
    output: its time stands, its values are not used again); the model, the sample and the random
    number generators are left as they were."""
    return capture_step(model, sample, loss_fn, repeats=repeats).graph


def storages(value: Any) -> dict[int, int]:
    """``{data_ptr: nbytes}`` of the non-empty storages under the tensors in ``value``."""
    out = {}
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.nbytes() > 0:
                out[st.data_ptr()] = st.nbytes()
    return out


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node``'s op draws from the random number generator (dropout's ``bernoulli``)."""
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def graph_of(gm: torch.fx.GraphModule, args: list[torch.Tensor], *, repeats: int = 3,
             labels: list[str] | None = None) -> OpGraph:
    """Run ``gm`` on ``args`` op by op, timing each, and return its :class:`OpGraph`: one node per
    placeholder (named by ``labels`` when given) and per op, named as in the fx graph."""
    value: dict[torch.fx.Node, Any] = {}
    names, times, held, edges, carried = [], [], [], [], []
    index: dict[torch.fx.Node, int] = {}
    nbytes: dict[torch.fx.Node, int] = {}
    owner: dict[int, int] = {}   # storage -> the node that created it
    placeholders = iter(args)
    label = iter(labels or [])
    drew = None   # the last op that drew from the random number generator
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            out = next(placeholders)
            seconds = 0.0
        elif node.op == "get_attr":
            out = getattr(gm, node.target)
            seconds = 0.0
        else:
            a = torch.fx.node.map_arg(node.args, value.__getitem__)
            kw = torch.fx.node.map_arg(node.kwargs, value.__getitem__)
            fn = node.target if node.op == "call_function" else getattr(gm, node.target)
            out = fn(*a, **kw)
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(*a, **kw)
                samples.append(time.perf_counter() - t0)
            seconds = statistics.median(samples)
        value[node] = out
        me = len(names)
        index[node] = me
        nbytes[node] = sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        created = {p: b for p, b in storages(out).items() if p not in owner}
        owner.update(dict.fromkeys(created, me))
        names.append(next(label, node.name) if node.op == "placeholder" else node.name)
        times.append(seconds)
        held.append(sum(created.values()))   # NOTE [views hold no bytes]
        inputs = list(dict.fromkeys(node.all_input_nodes))
        direct = {index[i] for i in inputs}
        for i in inputs:
            edges.append((index[i], me))
            carried.append(nbytes[i])
        read = {owner[p] for i in inputs for p in storages(value[i])}
        for r in sorted(read - direct - {me}):
            edges.append((r, me))
            carried.append(0)
        if _draws(node):
            # NOTE [random ops in program order]: every device draws from one generator (the CPU's,
            # or one GPU's); an op that draws starts after the last one that drew before it (a
            # 0-byte edge), so its masks are eager's whatever the placement.
            if drew is not None and drew not in direct:
                edges.append((drew, me))
                carried.append(0)
            drew = me
    return OpGraph.build(names, times, held, edges, carried)
