"""Hugging Face models under ooc: no key/value cache in training forwards, no second checkpointing.

NOTE [caches and recompute]
An HF decoder called as ``model(input_ids, labels=...)`` builds a ``DynamicCache`` (``use_cache``
defaults to the config's ``True``) and each layer appends its keys and values to it. A recomputed
layer runs again in the backward and appends them a second time, so the re-run attends over twice
the keys: with sdpa and no mask the gradients were silently wrong. HF's own gradient checkpointing
turns the cache off in training for this reason; ooc does the same in every forward of the model for
as long as it is wrapped, and says so once (``caches_off_in_forwards``): the outermost forward of a
module holding a ``config`` with ``use_cache=True`` (outside the chain's blocks) sets every such config
of the model to False and puts them back at its end, an error's too (a KeyboardInterrupt skips the
forward hooks: the model's next forward or ``unwrap`` puts them back then; a call of an inner model such as
``model.model(...)`` is covered as well). Between forwards the configs hold the user's values: ooc used
to set them to False from ``wrap`` until ``unwrap``, so ``save_pretrained`` while wrapped (``Trainer``'s
checkpoints and ``save_model``) wrote ``"use_cache": false`` into ``config.json``, and the model loaded
back without ooc, or a deep copy for EMA, ran without its cache by default. The layers inside a block
take the cache as an argument from the forward that calls the block, so the re-run in the backward
(which calls the block's forward directly) gets the same ``None``; a block that itself reads
``use_cache`` from its config would build a fresh cache in its re-run, filled once, so nothing doubles.
A call that asks for ``use_cache=True`` explicitly hands each layer the cache: a recomputed layer that
receives one is refused at its forward (``cache_argument``), before anything is appended (the re-run
used to attend over the doubled keys and fail on a shape, or double the cache the call returned).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

from ooc.errors import WrapError


def _checkpointing_flag(module: nn.Module) -> object:
    """HF's ``is_activation_checkpointing`` (transformers >= 5.23), else ``is_gradient_checkpointing``
    (asked only where the new name is missing: reading it warns of its deprecation)."""
    if hasattr(type(module), "is_activation_checkpointing"):
        return module.is_activation_checkpointing
    return getattr(module, "is_gradient_checkpointing", False)


LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
"""HF config fields of LayerDrop: in training each layer is skipped at random with that probability
(Wav2Vec2 and HuBERT default to 0.1), so a forward need not run every block of the chain."""


def layerdrop(model: nn.Module) -> str | None:
    """The first LayerDrop setting above 0 on a config of ``model`` (``"encoder_layerdrop=0.1"``), or None."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for name in LAYERDROP if config is not None else ():
            value = getattr(config, name, None)
            if isinstance(value, (int, float)) and value > 0:
                return f"{name}={value}"
    return None


def check_no_hf_checkpointing(model: nn.Module) -> None:
    """Raise :class:`WrapError` if HF's gradient checkpointing is on: ooc would then see only the
    layers' inputs, and a recompute plan would run each layer three times."""
    for name, m in model.named_modules():
        if getattr(m, "gradient_checkpointing", False) is True or _checkpointing_flag(m) is True:
            raise hf_checkpointing_error(model, name or type(m).__name__, m)


def check_block_not_checkpointed(model: nn.Module, block: nn.Module, name: str) -> None:
    """Raise :class:`WrapError` if HF's gradient checkpointing was turned on for a block of a wrapped
    ``model`` (``Trainer`` with ``gradient_checkpointing=True`` does so after ``ooc.wrap``): the block
    would run under torch's checkpoint, outside ooc's plan, and be run once more in the backward."""
    if block.training and getattr(block, "gradient_checkpointing", False) is True:
        raise hf_checkpointing_error(model, name, block)


_DISABLE = ("activation_checkpointing_disable", "gradient_checkpointing_disable", "disable_gradient_checkpointing")
"""The methods that turn a model's gradient checkpointing off: transformers' (>= 5.23, then older), diffusers'."""


def hf_checkpointing_error(model: nn.Module, name: str, module: nn.Module) -> WrapError:
    """The refusal for ``module`` (``name`` in ``model``) with gradient checkpointing on: what was found
    (the module's class and the flag) and how to turn it off; Hugging Face is named only for a class
    defined in transformers (diffusers' models and users' own use the same attribute)."""
    cls = type(module)
    flag = "gradient_checkpointing" if getattr(module, "gradient_checkpointing", False) is True else (
        "is_activation_checkpointing" if hasattr(cls, "is_activation_checkpointing") else "is_gradient_checkpointing")
    found = f"{name}.{flag} is True" if module is model else f"{name} ({cls.__name__}).{flag} is True"
    if cls.__module__.split(".")[0] == "transformers":
        return WrapError(
            f"Hugging Face gradient checkpointing is on ({found}); ooc's plan replaces it. Call "
            "model.gradient_checkpointing_disable() (activation_checkpointing_disable() in newer transformers) "
            "before ooc.wrap, and leave gradient_checkpointing=False in TrainingArguments"
        )
    disable = next((m for m in _DISABLE if callable(getattr(model, m, None))), None)
    if disable is not None:
        off = f"call model.{disable}()"
    elif flag != "gradient_checkpointing":
        off = f"turn it off where {cls.__name__} sets {flag}"
    elif module is model:
        off = "set model.gradient_checkpointing = False"
    else:
        off = f"set model.get_submodule({name!r}).gradient_checkpointing = False"
    return WrapError(
        f"gradient checkpointing is on ({found}, in {cls.__module__}.{cls.__qualname__}): ooc reads it as the "
        "switch that runs layers under torch.utils.checkpoint (the convention of Hugging Face transformers, "
        "diffusers and others), and ooc's plan replaces it (a second checkpoint under it runs layers again, "
        f"outside the plan). Before ooc.wrap, {off}, and leave it off while the model is wrapped; if {flag} "
        "means something else in this class, rename it"
    )


def disable_caches(model: nn.Module) -> Callable[[], None]:
    """Set ``use_cache=False`` on every config of ``model`` that has it on; return the undo. For a
    profile, which runs the model under its own hooks and leaves it as it found it (a wrapped model
    turns the cache off in its forwards instead: ``caches_off_in_forwards``)."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False

    def restore() -> None:
        for config in configs.values():
            config.use_cache = True

    return restore


class _CachesOffInForwards:
    """The forward hooks of ``caches_off_in_forwards``: the outermost hooked forward turns off
    ``use_cache`` on every config that has it on, and the end of that forward (normal or not) puts
    the values back."""

    def __init__(self, configs: list[Any]) -> None:
        self.configs = configs
        self.depth = 0
        self.outer: nn.Module | None = None
        """The module whose forward is the outermost one running."""
        self.turned_off: list[Any] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        if self.depth and module is self.outer:
            # The outermost forward cannot run inside itself: its last call ended by a BaseException
            # that is no error (KeyboardInterrupt), which skips the forward hooks, so its end never ran.
            self.depth = 0
        if self.depth == 0:
            self.outer = module
            # Kept from such a call: the configs it turned off, which are off now.
            self.turned_off += [c for c in self.configs if getattr(c, "use_cache", None) is True]
            for config in self.turned_off:
                config.use_cache = False
        self.depth += 1

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0:
            for config in self.turned_off:
                config.use_cache = True
            self.turned_off = []


def caches_off_in_forwards(model: nn.Module, blocks: Iterable[nn.Module]) -> Callable[[], None]:
    """Turn ``use_cache`` off in every forward of a module of ``model`` that holds a config with it
    on, leaving the configs as they are between forwards (NOTE [caches and recompute]); return the
    undo (removes the hooks). ``blocks``: the chain's blocks; modules inside them get no hooks (a
    re-run stopped early leaves by a ``BaseException``, past the forward hooks that would lower the
    count, and what a block's layers cache comes in their arguments from the forward that calls
    the block). Says so once."""
    configured = [m for m in model.modules() if getattr(getattr(m, "config", None), "use_cache", None) is True]
    if not configured:
        return lambda: None
    inside = {id(m) for block in blocks for m in block.modules() if m is not block}
    hooks = _CachesOffInForwards(list({id(m.config): m.config for m in configured}.values()))
    handles = []
    for module in (m for m in configured if id(m) not in inside):
        # First among the pre-hooks, so that no other pre-hook's error comes before the count is raised
        # (the forward hook, called on errors too, lowers it).
        handles.append(module.register_forward_pre_hook(hooks.enter, prepend=True))
        handles.append(module.register_forward_hook(hooks.exit, always_call=True))
    warnings.warn(
        f"ooc turned off use_cache in {type(model).__name__}'s forwards while it is wrapped: a recomputed layer "
        "would append to the key/value cache twice (NOTE [caches and recompute] in ooc.hf). Its config keeps "
        "use_cache as it was (save_pretrained writes it so); for generation, unwrap first or pass "
        "use_cache=True under torch.no_grad().",
        stacklevel=4,
    )

    def remove() -> None:
        for handle in handles:
            handle.remove()
        # A forward left by a BaseException other than an error (KeyboardInterrupt) skipped its end.
        hooks.depth = 0
        hooks.exit(model, (), None)

    return remove


def cache_argument(values: Iterable[Any]) -> str | None:
    """The class name of the first Hugging Face key/value cache (``transformers.cache_utils.Cache``)
    among ``values``, else None. Looks only if transformers is already imported (no import here)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None)
    if cache is None:
        return None
    return next((type(v).__name__ for v in values if isinstance(v, cache)), None)


def is_config_class(kind: type) -> bool:
    """``kind`` is a Hugging Face model config (``PreTrainedConfig``; a dataclass in transformers 5,
    with some forty fields and never a generator among them). Looks only if transformers is already
    imported (no import here)."""
    configuration_utils = sys.modules.get("transformers.configuration_utils")
    base = getattr(configuration_utils, "PreTrainedConfig", None) or getattr(configuration_utils, "PretrainedConfig", None)
    return base is not None and issubclass(kind, base)
