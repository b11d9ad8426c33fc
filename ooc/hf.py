"""Hugging Face models under ooc: no key/value cache in training forwards, no second checkpointing.

NOTE [caches and recompute]
An HF decoder called as ``model(input_ids, labels=...)`` builds a ``DynamicCache`` (``use_cache``
defaults to the config's ``True``) and each layer appends its keys and values to it. A recomputed
layer runs again in the backward and appends them a second time, so the re-run attends over twice
the keys: with sdpa and no mask the gradients were silently wrong. HF's own gradient checkpointing
turns the cache off in training for this reason; ooc does the same for as long as the model is
wrapped (every ``config`` found on the model's modules, restored by ``ooc.unwrap``), and says so
once. A call that asks for ``use_cache=True`` explicitly hands each layer the cache: a recomputed
layer that receives one is refused at its forward (``cache_argument``), before anything is appended
(the re-run used to attend over the doubled keys and fail on a shape, or double the cache the call
returned).
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


def disable_caches(model: nn.Module, *, warn: bool = True) -> Callable[[], None]:
    """Set ``use_cache=False`` on every config of ``model`` that has it on; return the undo. ``warn``:
    say so (for a model left wrapped; a profile, which leaves the model as it found it, does not)."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None) is True:
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    if configs and warn:
        warnings.warn(
            f"ooc turned off use_cache on {type(model).__name__}'s config while it is wrapped: a recomputed layer "
            "would append to the key/value cache twice (NOTE [caches and recompute] in ooc.hf). ooc.unwrap turns it "
            "back on; for generation, unwrap first or pass use_cache=True under torch.no_grad().",
            stacklevel=4,
        )

    def restore() -> None:
        for config in configs.values():
            config.use_cache = True

    return restore


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
