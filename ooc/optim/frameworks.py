"""Signs that hooks read the weights right after a HostAdamW's ``step()`` (a training framework drives it:
Lightning, transformers.Trainer through accelerate's optimizer wrapper; or torch's step post-hooks), and
that a framework saves or evaluates the model after its training.

None of these imports a framework: a framework not imported yet cannot be on the stack.

NOTE [a framework's hooks after step()]
A pipelined ``step()`` returns before the updates of the buckets launched last have landed: the first
blocks' and those outside the chain (embeddings), whose gradients come last in the backward. A plain
loop's next read of the weights is its forward, which waits for each bucket at its gate. A framework
runs hooks in between that read or write ``model.parameters()`` themselves: an EMA in Lightning's
``on_train_batch_end`` or in a Trainer callback's ``on_optimizer_step`` / ``on_step_end``, Lightning's
``StochasticWeightAveraging`` averaging at an epoch's end and writing the average into the model at the
end of training. They read about a fifth of a nano GPT's weights before their update, and a write
there was overwritten by the update landing after it, without a word. So ``step()`` waits for its
updates (``synchronize()``) where a framework calls it or hooks follow it:

- given a closure: Lightning passes one on every step (its precision plugin wraps the training step,
  or a no-op closure under manual optimization); torch's closure form is the one whose callers expect
  a finished step, as with LBFGS;
- called through accelerate's ``AcceleratedOptimizer.step`` (``transformers.Trainer``, which wraps
  every optimizer in it, and accelerate loops), whose frame is among the callers;
- with step post-hooks registered (``register_step_post_hook``, or torch's global
  ``register_optimizer_step_post_hook``): ``Optimizer``'s wrapper calls them as ``step()`` returns.

What that costs: the next forward's first gates wait for these same buckets (its first modules, the
embeddings and the first block, are the ones they hold), and the update thread takes buckets in the
order they launched (data-parallel: in canonical order, the order a backward usually completes them in),
so waiting for them is waiting for every update: the wait only moves from those gates to the end of
``step()``.
What is lost is the overlap of those last updates with the framework's own host work between ``step()``
and the next forward (its hooks and logging, the scheduler step, ``zero_grad()``, fetching the next
batch): at most that gap, once a step. The overlap with the backward, where every other bucket's update
runs, stays; with ``max_grad_norm`` or ``loss_scale`` every update runs after ``step()``, and the gate
would have waited for all of them too. On a GPU the host now waits at ``step()`` for the backward's
last copies out, as it waited at the gate. With ``delayed_update`` the gates wait for the step's
updates as well (the lag is in the copies in, issued in the next backward): the wait also orders the
copies in that this backward issued before the hooks' reads. Weighed against it: a callback placed
first on the framework's list would wait a few statements later, for the same overlap, while editing the
user's trainer and naming hooks that differ by framework and version (and Lightning calls the module's
own hooks after every callback's); an option on HostAdamW leaves the user to know, as before; waiting in
every ``step()`` costs a plain loop the overlap with whatever it does before its next forward. Not
caught: a wrapper of one's own that passes no closure and is not accelerate's (call ``synchronize()``
in its hooks), and a hook between the backward and ``step()`` (Lightning's ``on_after_backward`` and
``on_before_optimizer_step``, a Trainer callback's ``on_pre_optimizer_step``) that reads the weights:
the updates began in the backward, so it reads some buckets' new weights where ``torch.optim.AdamW``'s
run reads the old (``pipeline=False`` updates in ``step()``; NOTE [a step is a transaction] in
ooc.optim.pipeline). A hook's write through ``.data`` is not seen by the next update (NOTE [weights
written outside the optimizer] in ooc.optim.pipeline).
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

_CALLERS_TO_SEARCH = 16
"""Frames above ``step()`` searched for a framework's: ``Optimizer``'s step hooks and decorators, and the
framework's wrappers (accelerate's, GradScaler's: NOTE [a GradScaler behind a wrapper] in ooc.optim.host_adamw)."""

_SAVE_CALLERS_TO_SEARCH = 40
"""Frames above a ``state_dict()`` hook searched for a framework's save: its saving helpers, and
``Module.state_dict``'s own recursion into the submodule the optimizer trains; above a forward hook, for
a framework's evaluation: its loops, the user's step and ``generate``'s decoding loop."""


def caller_running(code: CodeType, depth: int = _CALLERS_TO_SEARCH) -> FrameType | None:
    """The nearest frame among the ``depth`` above this function's caller that runs ``code``, or None."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def hooks_follow_step(optimizer: torch.optim.Optimizer, closure: Any) -> bool:
    """Hooks may read ``optimizer``'s weights after this ``step(closure)`` and before the next forward
    (NOTE [a framework's hooks after step()]): a closure was passed, step post-hooks are registered, or
    accelerate's optimizer wrapper called it."""
    # Private to torch (2.0 to 2.13 at least): read where they are, so that a torch that renames them
    # loses this sign only, not the import of ooc.
    global_hooks = getattr(torch_optimizer, "_global_optimizer_post_hooks", None)
    if closure is not None or getattr(optimizer, "_optimizer_step_post_hooks", None) or global_hooks:
        return True
    accelerated = sys.modules.get("accelerate.optimizer")
    return accelerated is not None and caller_running(accelerated.AcceleratedOptimizer.step.__code__) is not None


def _trainer_running(hf_method: str, lightning_method: str) -> tuple[str, Any] | None:
    """The framework ``Trainer`` whose method runs above the caller (``_SAVE_CALLERS_TO_SEARCH`` frames
    up): ``("hf", trainer)`` for ``transformers.Trainer.<hf_method>``, ``("lightning", trainer)`` for
    Lightning's ``Trainer.<lightning_method>``; None for neither. Looks only at the frameworks imported."""
    hf = sys.modules.get("transformers.trainer")
    # +1: the frames above the caller, as its own caller_running would search them.
    if hf is not None and (frame := caller_running(getattr(hf.Trainer, hf_method).__code__, _SAVE_CALLERS_TO_SEARCH + 1)):
        return "hf", frame.f_locals.get("self")
    for name in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        lightning = sys.modules.get(name)
        if lightning is not None and (frame := caller_running(getattr(lightning.Trainer, lightning_method).__code__,
                                                              _SAVE_CALLERS_TO_SEARCH + 1)):
            return "lightning", frame.f_locals.get("self")
    return None


def saving_after_training() -> bool:
    """A ``state_dict()`` hook runs inside a framework's save of the model once its training has ended:
    ``transformers.Trainer.save_model`` outside ``train()``, or Lightning's ``Trainer.save_checkpoint``
    after ``fit()`` (NOTE [the last delayed update at a framework's final save] in ooc.optim.host_adamw)."""
    running = _trainer_running("save_model", "save_checkpoint")
    if running is None:
        return False
    framework, trainer = running
    if framework == "hf":
        return not getattr(trainer, "is_in_train", True)
    state = getattr(trainer, "state", None)
    return state is not None and state.finished


def evaluating_after_training() -> bool:
    """A forward runs inside a framework's evaluation or prediction once its training has ended:
    ``transformers.Trainer``'s ``evaluate()`` or ``predict()`` (its ``evaluation_loop``) outside ``train()``,
    or Lightning's ``validate()``, ``test()`` or ``predict()`` (a stage other than ``fit``; the validation
    inside ``fit()`` is not) (NOTE [the last delayed update at a framework's final save] in ooc.optim.host_adamw)."""
    running = _trainer_running("evaluation_loop", "_run_stage")
    if running is None:
        return False
    framework, trainer = running
    if framework == "hf":
        return not getattr(trainer, "is_in_train", True)
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return fn is not None and getattr(fn, "value", fn) != "fit"
