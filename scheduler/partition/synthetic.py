"""Analytic training graphs of the benchmark's shapes, made without torch: an unrolled stacked LSTM
(like ParDNN's Word-RNN), a transformer with per-head attention branches, and a 3D CNN with grouped
residual blocks, at about a requested number of nodes.

Each is written as a forward op list and differentiated by :func:`training_graph`: a gradient op per
forward op (twice its time), fed by the gradients of the op's consumers, by the op's output and its
inputs (the saved activations), and by its weights; a weight is a zero-time node that holds its
bytes from the start of the step to its last use. Times are napkin math for one H100-class device:
``flops / 400 TFLOP/s + bytes moved / 2.5 TB/s + 4 us`` launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ooc.scheduler.errors import PlanError
from ooc.scheduler.partition.graph import OpGraph
from ooc.scheduler.profile import Profile

FLOPS = 400e12
MEMORY_BPS = 2.5e12
LAUNCH_S = 4e-6
F32 = 4


@dataclass
class Forward:
    """A forward op list under construction: ``add`` returns the new op's index."""

    names: list[str] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    out: list[float] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    weights: list[list[int]] = field(default_factory=list)
    weight_names: list[str] = field(default_factory=list)
    weight_bytes: list[float] = field(default_factory=list)
    grad_time: list[float] = field(default_factory=list)
    """Each op's gradient time, when known (a measured or analytic profile); else twice its time."""

    def weight(self, name: str, nbytes: float) -> int:
        self.weight_names.append(name)
        self.weight_bytes.append(float(nbytes))
        return len(self.weight_names) - 1

    def add(self, name: str, inputs: list[int], out_bytes: float, *, flops: float = 0.0,
            weights: tuple[int, ...] = ()) -> int:
        moved = out_bytes + sum(self.out[i] for i in inputs) + sum(self.weight_bytes[w] for w in weights)
        self.names.append(name)
        self.time.append(flops / FLOPS + moved / MEMORY_BPS + LAUNCH_S)
        self.out.append(float(out_bytes))
        self.inputs.append(list(inputs))
        self.weights.append(list(weights))
        return len(self.names) - 1


def training_graph(fwd: Forward, loss_inputs: list[int]) -> OpGraph:
    """The forward ops, a loss fed by ``loss_inputs``, and the backward ops (see module docstring),
    in program order: weights, forward, loss, backward in reverse."""
    nw, nf = len(fwd.weight_names), len(fwd.names)
    names = [f"w.{x}" for x in fwd.weight_names] + fwd.names + ["loss"] + [f"grad.{x}" for x in reversed(fwd.names)]
    backward = fwd.grad_time if fwd.grad_time else [2 * t for t in fwd.time]
    time = [0.0] * nw + fwd.time + [LAUNCH_S] + list(reversed(backward))
    loss = nw + nf
    grad_bytes = [fwd.out[i] + sum(fwd.weight_bytes[w] for w in fwd.weights[i]) for i in range(nf)]
    held = fwd.weight_bytes + fwd.out + [F32] + list(reversed(grad_bytes))

    def f(i: int) -> int:
        return nw + i

    def g(i: int) -> int:
        return loss + nf - i

    edges, carried = [], []
    consumers: list[list[int]] = [[] for _ in range(nf)]
    for i in range(nf):
        for w in fwd.weights[i]:
            edges += [(w, f(i)), (w, g(i))]
            carried += [fwd.weight_bytes[w]] * 2
        for j in fwd.inputs[i]:
            edges += [(f(j), f(i)), (f(j), g(i))]
            carried += [fwd.out[j]] * 2
            consumers[j].append(i)
        edges.append((f(i), g(i)))
        carried.append(fwd.out[i])
    for i in loss_inputs:
        edges += [(f(i), loss), (loss, g(i))]
        carried += [fwd.out[i], fwd.out[i]]
    for i in range(nf):
        for c in consumers[i]:
            edges.append((g(c), g(i)))
            carried.append(fwd.out[i])
    return OpGraph.build(names, time, held, edges, carried)


def lstm(layers: int, steps: int, *, batch: int = 64, hidden: int = 1024, vocab: int = 8192) -> OpGraph:
    """A stacked LSTM unrolled over ``steps`` (Word-RNN): per layer and step an input matmul, a
    recurrent matmul, the gates, the cell state and the output; a projection and loss per step."""
    fw = Forward()
    h = batch * hidden * F32
    wx = [fw.weight(f"l{layer}.wx", 4 * hidden * hidden * F32) for layer in range(layers)]
    wh = [fw.weight(f"l{layer}.wh", 4 * hidden * hidden * F32) for layer in range(layers)]
    emb = fw.weight("embed", vocab * hidden * F32)
    proj = fw.weight("proj", vocab * hidden * F32)
    mm = 2 * batch * hidden * 4 * hidden
    prev_h: list[int | None] = [None] * layers
    prev_c: list[int | None] = [None] * layers
    outs = []
    for t in range(steps):
        x = fw.add(f"t{t}.embed", [], h, weights=(emb,))
        for layer in range(layers):
            p = f"t{t}.l{layer}"
            mx = fw.add(f"{p}.mx", [x], 4 * h, flops=mm, weights=(wx[layer],))
            gate_in = [mx] + ([fw.add(f"{p}.mh", [prev_h[layer]], 4 * h, flops=mm, weights=(wh[layer],))]
                              if prev_h[layer] is not None else [])
            gates = fw.add(f"{p}.gates", gate_in, 4 * h)
            c = fw.add(f"{p}.c", [gates] + ([prev_c[layer]] if prev_c[layer] is not None else []), h)
            x = fw.add(f"{p}.h", [gates, c], h)
            prev_h[layer], prev_c[layer] = x, c
        outs.append(fw.add(f"t{t}.logits", [x], batch * vocab * F32, flops=2 * batch * hidden * vocab,
                           weights=(proj,)))
    return training_graph(fw, outs)


def transformer(layers: int, *, heads: int = 8, batch: int = 8, seq: int = 1024, width: int = 2048) -> OpGraph:
    """A pre-norm transformer; attention is split per head (score, softmax, mix), so each layer has
    ``heads`` parallel branches."""
    fw = Forward()
    act = batch * seq * width * F32
    per_head = act // heads
    scores = batch * seq * seq * F32
    x = fw.add("embed", [], act, weights=(fw.weight("embed", 32000 * width * F32),))
    for layer in range(layers):
        p = f"l{layer}"
        ln1 = fw.add(f"{p}.ln1", [x], act)
        qkv = fw.add(f"{p}.qkv", [ln1], 3 * act, flops=2 * batch * seq * width * 3 * width,
                     weights=(fw.weight(f"{p}.qkv", 3 * width * width * F32),))
        mixed = []
        for hd in range(heads):
            s = fw.add(f"{p}.h{hd}.score", [qkv], scores, flops=2 * batch * seq * seq * width / heads)
            sm = fw.add(f"{p}.h{hd}.softmax", [s], scores)
            mixed.append(fw.add(f"{p}.h{hd}.mix", [sm, qkv], per_head, flops=2 * batch * seq * seq * width / heads))
        o = fw.add(f"{p}.proj", mixed, act, flops=2 * batch * seq * width * width,
                   weights=(fw.weight(f"{p}.proj", width * width * F32),))
        x = fw.add(f"{p}.add1", [x, o], act)
        ln2 = fw.add(f"{p}.ln2", [x], act)
        fc1 = fw.add(f"{p}.fc1", [ln2], 4 * act, flops=8 * batch * seq * width * width,
                     weights=(fw.weight(f"{p}.fc1", 4 * width * width * F32),))
        gelu = fw.add(f"{p}.gelu", [fc1], 4 * act)
        fc2 = fw.add(f"{p}.fc2", [gelu], act, flops=8 * batch * seq * width * width,
                     weights=(fw.weight(f"{p}.fc2", 4 * width * width * F32),))
        x = fw.add(f"{p}.add2", [x, fc2], act)
    return training_graph(fw, [fw.add("head", [x], act)])


def cnn3d(blocks: int, *, groups: int = 4, batch: int = 4, channels: int = 128, frames: int = 16,
          side: int = 56) -> OpGraph:
    """A 3D CNN of residual blocks, each split into ``groups`` parallel branches (conv, norm, relu,
    conv) joined by a concat and the residual add."""
    fw = Forward()
    act = batch * channels * frames * side * side * F32
    branch = act // groups
    conv_flops = 2 * batch * frames * side * side * (channels // groups) ** 2 * 27
    w_bytes = (channels // groups) ** 2 * 27 * F32
    x = fw.add("stem", [], act, flops=2 * batch * frames * side * side * 3 * channels * 27,
               weights=(fw.weight("stem", 3 * channels * 27 * F32),))
    for b in range(blocks):
        p = f"b{b}"
        outs = []
        for g in range(groups):
            q = f"{p}.g{g}"
            c1 = fw.add(f"{q}.conv1", [x], branch, flops=conv_flops, weights=(fw.weight(f"{q}.conv1", w_bytes),))
            n1 = fw.add(f"{q}.norm", [c1], branch)
            r1 = fw.add(f"{q}.relu", [n1], branch)
            outs.append(fw.add(f"{q}.conv2", [r1], branch, flops=conv_flops,
                               weights=(fw.weight(f"{q}.conv2", w_bytes),)))
        cat = fw.add(f"{p}.concat", outs, act)
        x = fw.add(f"{p}.add", [x, cat], act)
    return training_graph(fw, [fw.add("pool", [x], batch * channels * F32)])


def profile_graph(profile: Profile) -> OpGraph:
    """The training graph of a profiled chain (``ooc profile``, or the analytic presets in ``profiles/``).

    A block with an op-level profile (``BlockProfile.ops``) becomes its ops in sequence, each with its
    time and output bytes, the gradient ops sharing the block's ``backward_s`` in proportion to their
    forward time; a block without one becomes one op (its ``forward_s``, holding its ``saved_bytes``).
    Each block's parameters are one weight node read by its slowest op (its largest matmul). Blocks
    follow each other; the time and parameters outside the chain are left out.
    """
    fwd = Forward()
    previous: list[int] = []
    for block in profile.blocks:
        ops = [(op.name, op.forward_s, op.output_bytes) for op in block.ops] or [
            (block.name, block.forward_s, block.saved_bytes)]
        total = sum(t for _, t, _ in ops)
        scale = block.backward_s / total if total > 0 else 0.0
        heaviest = max(range(len(ops)), key=lambda k: ops[k][1])
        weight = (fwd.weight(block.name, block.param_bytes),) if block.param_bytes else ()
        for k, (name, seconds, out_bytes) in enumerate(ops):
            index = fwd.add(f"{block.name}.{k}.{name}", previous, out_bytes, weights=weight if k == heaviest else ())
            fwd.time[index] = seconds
            fwd.grad_time.append(seconds * scale if total > 0 else block.backward_s / len(ops))
            previous = [index]
    return training_graph(fwd, previous)


SHAPES = ("lstm", "transformer", "cnn3d")


def synthetic(shape: str, nodes: int) -> OpGraph:
    """A graph of ``shape`` (one of :data:`SHAPES`) with about ``nodes`` nodes."""
    if nodes < 50:
        raise PlanError(f"ask for at least 50 nodes, not {nodes}")
    if shape == "lstm":
        layers = 4
        return lstm(layers, max(1, round(nodes / (layers * 10 + 4))))
    if shape == "transformer":
        heads = 8
        return transformer(max(1, round(nodes / (2 * (8 + 3 * heads) + 4))), heads=heads)
    if shape == "cnn3d":
        groups = 4
        return cnn3d(max(1, round(nodes / (2 * (2 + 4 * groups) + 2 * groups))), groups=groups)
    raise PlanError(f"no synthetic graph {shape!r}; choose one of {SHAPES}")
