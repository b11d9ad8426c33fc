"""The README's first example runs as written on a Hugging Face decoder (issue 13, item 7): only the
line that loads the checkpoint is replaced (by a tiny Qwen2 from a config, on the CPU); every other
line, the user's loop included, runs verbatim."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from tests.zoo.models import MODELS, VOCAB

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[2] / "README.md"
LOAD = 'model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B").cuda()'


def _first_example() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_the_first_example_trains_a_tiny_decoder() -> None:
    code = _first_example()
    assert LOAD in code, "the README's first example changed: update LOAD here"
    code = code.replace(LOAD, "model = _tiny()")
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        x = torch.randint(1, VOCAB, (2, 12), generator=g)
        batches.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x})
    torch.manual_seed(0)
    namespace = {"_tiny": MODELS["qwen2-sdpa"].build, "batches": batches}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*use_cache.*")
        exec(compile(code, str(README), "exec"), namespace)
    model = namespace["model"]
    assert namespace["loss"].isfinite()
    import ooc

    assert ooc.is_wrapped(model) and ooc.memory_report(model).peak_bytes > 0
    ooc.unwrap(model)


def _resolve(dotted: str) -> object:
    """``ooc.a.b.C`` -> the object: the longest importable module prefix, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def test_every_dotted_ooc_name_in_the_docs_exists() -> None:
    """A reader types what the README, CONTRIBUTING.md and docs/ name (``ooc.scheduler.codecs.CODEC_ERROR_BOUND``,
    ``ooc.partition_capture.capture``): each must import."""
    root = README.parent
    text = "".join(p.read_text() for p in (README, root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))))
    names = sorted(set(re.findall(r"\booc(?:\.[A-Za-z_]\w*)+", text)))
    assert len(names) > 30
    broken = []
    for name in names:
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            broken.append(f"{name}: {exc}")
    assert not broken, broken


def _documented_commands() -> list[str]:
    """Every ``ooc ...`` command line in the docs' shell blocks (``python -m ooc``, ``torchrun ... -m ooc`` too)."""
    import shlex

    root = README.parent
    commands, fence = [], None
    for path in (README, root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))):
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                fence = None if fence is not None else line[3:].strip() or "text"
                continue
            if fence not in ("bash", "text") or "ooc" not in line.split():  # "text": a block without a language
                continue
            words = shlex.split(line, comments=True)
            for start in range(len(words)):
                if words[start] == "ooc" and (start == 0 or words[start - 1] == "-m"):
                    commands.append(shlex.join(words[start + 1:]))
                    break
    return commands


def test_every_documented_command_line_parses() -> None:
    """Each ``ooc`` command the docs show names a subcommand and options that exist (nothing runs)."""
    from ooc.apps.cli import build_parser

    commands = _documented_commands()
    assert {c.split()[0] for c in commands} >= {"demo", "profile", "plan", "simulate", "calibrate", "partition", "train",
                                                  "doctor"}, commands
    parser = build_parser()
    for command in commands:
        try:
            parser.parse_args(command.split())
        except SystemExit:
            pytest.fail(f"the docs' `ooc {command}` does not parse")
