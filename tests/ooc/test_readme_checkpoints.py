"""The README's Checkpoints example runs as written (issue 14): its loop, stopped after a few steps and
run again on fresh objects, restores the newest version and ends bit for bit where the run that never
stopped ends (weights, optimizer state, LR, the data position, the losses after the stop). Only the
line that stands for the user's step is replaced, by a step with dropout (so the RNG states count)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

import ooc
from ooc.optim import HostAdamW

README = Path(__file__).resolve().parents[2] / "README.md"
STEP_LINE = '    ...  # forward, backward, opt.step(), sched.step(), position["batch"] += 1\n'
STEP = """    x = data[position["batch"]]
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    position["batch"] += 1
    losses[step] = loss.item()
"""


def _example() -> str:
    section = README.read_text().split("## Checkpoints (`ooc.checkpoint`)", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert STEP_LINE in code, "the README's Checkpoints example changed: update STEP_LINE here"
    return code.replace(STEP_LINE, STEP)


def _run(directory: Path, steps: int, losses: dict[int, float]) -> dict[str, object]:
    """The example in ``directory`` on a fresh model and optimizer (same initial weights), ``steps`` steps."""
    torch.manual_seed(0)
    model = ooc.wrap(nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Tanh()) for _ in range(3)]))
    opt = HostAdamW(model.parameters(), lr=1e-2, model=model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(1))
    namespace = {"model": model, "opt": opt, "sched": sched, "steps": steps, "data": data, "losses": losses}
    cwd = Path.cwd()
    try:
        import os

        os.chdir(directory)  # the example writes into "ckpt"
        exec(compile(_example(), str(README), "exec"), namespace)
    finally:
        os.chdir(cwd)
    opt.synchronize()
    result = {"weights": {k: v.clone() for k, v in model.state_dict().items()},
              "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
              "lr": sched.get_last_lr(), "position": dict(namespace["position"]),
              "versions": [v.step for v in namespace["ckpt"].versions()]}
    opt.close()
    ooc.unwrap(model)
    return result


def test_the_checkpoints_example_resumes_bit_for_bit(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole: dict[int, float] = {}
    never_stopped = _run(tmp_path / "a", 7, whole)
    first: dict[int, float] = {}
    stopped = _run(tmp_path / "b", 4, first)
    assert stopped["position"] == {"batch": 4} and stopped["versions"] == [1, 2, 3]  # keep=3
    after: dict[int, float] = {}
    resumed = _run(tmp_path / "b", 7, after)
    assert sorted(after) == [4, 5, 6]  # it started after the newest version
    assert after == {s: whole[s] for s in (4, 5, 6)}
    assert resumed["position"] == never_stopped["position"] == {"batch": 7}
    assert resumed["lr"] == never_stopped["lr"]
    for name, tensor in never_stopped["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name
    for a, b in zip(resumed["exp_avg"], never_stopped["exp_avg"]):
        assert torch.equal(a, b)
