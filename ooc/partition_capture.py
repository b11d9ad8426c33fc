"""Capture a training step's joint forward+backward op graph for ``ooc.scheduler.partition``.

``make_fx`` traces a function that runs the model functionally and calls ``torch.autograd.grad``:
the trace holds every aten op of the forward and of the backward (the joint graph AOT autograd
partitions), with the parameters, buffers and inputs as placeholders. Each op is then run alone
on the real values, ``repeats`` times, and its median time and its output's bytes become the node;
an edge carries its producer's output bytes.

# NOTE [views hold no bytes]
An op whose output shares storage with one of its inputs (a view, ``t``, ``getitem`` of a tuple
...) holds no new memory: its node holds 0 bytes, though an edge out of it still carries the
tensor's bytes when it crosses devices.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ooc.errors import WrapError
from ooc.profiler import default_loss
from ooc.scheduler.partition.graph import OpGraph


def trace_step(model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.fx.GraphModule:
    """The joint forward+backward aten graph of one step of ``model`` on ``sample``: placeholders
    (parameters, buffers, the sample's tensors), then the forward, the loss and the backward ops;
    outputs the loss and one gradient per parameter that needs one."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise WrapError("the model has no parameter that requires a gradient; there is no backward to capture")
    # Tracing runs the step for real: clones keep a BatchNorm's running statistics as they were.
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    leaves, rebuild = _tensors(sample)
    loss_of = loss_fn or default_loss

    def step(p: dict, b: dict, *xs: torch.Tensor):
        out = _call(model, {**p, **b}, rebuild(xs))
        loss = loss_of(out)
        grads = torch.autograd.grad(loss, list(p.values()))
        return (loss, *grads)

    return make_fx(step)(params, buffers, *leaves)


def _call(model: nn.Module, state: dict, sample: Any) -> Any:
    """``ooc.profiler.call_model`` with the parameters and buffers in ``state``."""
    if isinstance(sample, dict):
        return torch.func.functional_call(model, state, (), sample)
    if isinstance(sample, (tuple, list)):
        return torch.func.functional_call(model, state, tuple(sample))
    return torch.func.functional_call(model, state, (sample,))


def _tensors(sample: Any) -> tuple[list[torch.Tensor], Callable[[tuple], Any]]:
    """The tensors in ``sample``, and how to rebuild ``sample`` with others in their place."""
    flat, spec = tree_flatten(sample)
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]

    def rebuild(xs: tuple) -> Any:
        out = list(flat)
        for i, x in zip(where, xs):
            out[i] = x
        return tree_unflatten(out, spec)

    return [flat[i] for i in where], rebuild


def capture(model: nn.Module, sample: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
            repeats: int = 3) -> OpGraph:
    """The op graph of one training step (see module docstring). ``loss_fn`` maps the model's
    output to a scalar (default: :func:`ooc.profiler.default_loss`). Times are each op's median over
    ``repeats`` runs after the run that gives the values (an in-place op is re-run on its own
    output: its time stands, its values are not used again); the model is left as it was."""
    gm = trace_step(model, sample, loss_fn)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    leaves, _ = _tensors(sample)
    # Buffers are cloned: a BatchNorm's running statistics are updated in place by the step, and
    # each op runs 1 + repeats times here.
    values = [p.detach() for _, p in params] + [b.clone() for _, b in model.named_buffers()] + leaves
    labels = ([f"param.{n}" for n, _ in params] + [f"buffer.{n}" for n, _ in model.named_buffers()]
              + [f"input.{i}" for i in range(len(leaves))])
    return graph_of(gm, values, repeats=repeats, labels=labels)


def graph_of(gm: torch.fx.GraphModule, args: list[torch.Tensor], *, repeats: int = 3,
             labels: list[str] | None = None) -> OpGraph:
    """Run ``gm`` on ``args`` op by op, timing each, and return its :class:`OpGraph`: one node per
    placeholder (named by ``labels`` when given) and per op, named as in the fx graph."""
    value: dict[torch.fx.Node, Any] = {}
    names, times, held, edges, carried = [], [], [], [], []
    index: dict[torch.fx.Node, int] = {}
    nbytes: dict[torch.fx.Node, int] = {}
    placeholders = iter(args)
    label = iter(labels or [])
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
        size = sum(t.nbytes for t in tree_leaves(out)
                   if isinstance(t, torch.Tensor))
        inputs = node.all_input_nodes
        storages = {t.untyped_storage().data_ptr() for i in inputs for t in tree_leaves(value[i])
                    if isinstance(t, torch.Tensor)}
        aliases = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages
                      for t in tree_leaves(out))
        index[node] = len(names)
        nbytes[node] = size
        names.append(next(label, node.name) if node.op == "placeholder" else node.name)
        times.append(seconds)
        held.append(0 if aliases else size)   # NOTE [views hold no bytes]
        for i in dict.fromkeys(inputs):
            edges.append((index[i], index[node]))
            carried.append(nbytes[i])
    return OpGraph.build(names, times, held, edges, carried)
