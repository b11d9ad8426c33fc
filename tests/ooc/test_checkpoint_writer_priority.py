"""NOTE [the writer runs below the training]: the checkpoint writer's threads (the writer, and the
I/O thread each version starts from it) run ``writer_nice`` steps below the thread that trains; the
training's own threads keep their priority; ``writer_nice=None`` leaves the writer at the caller's."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import ooc.checkpoint as ckpt_mod
from ooc.checkpoint import Checkpointer
from ooc.optim import HostAdamW

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are Linux's")


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _save_and_watch(tmp_path: Path, monkeypatch, **kwargs) -> dict[str, int]:  # noqa: ANN001, ANN003
    """The priority of each thread that wrote part of a version, by role, and the caller's."""
    seen: dict[str, int] = {}
    write, sink_write = Checkpointer._write, ckpt_mod._Sink.write

    def watched_write(self, *job):  # noqa: ANN001, ANN002, ANN202
        seen["writer"] = _priority()
        return write(self, *job)

    def watched_sink_write(self, data):  # noqa: ANN001, ANN202
        seen["io"] = _priority()
        return sink_write(self, data)

    monkeypatch.setattr(Checkpointer, "_write", watched_write)
    monkeypatch.setattr(ckpt_mod._Sink, "write", watched_sink_write)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = HostAdamW(model.parameters(), lr=1e-3, model=model)
    model(torch.randn(2, 512)).square().sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, model, opt, **kwargs)
    ckpt.save(1)
    ckpt.close()
    opt.close()
    seen["caller"] = _priority()
    return seen


def test_the_writer_and_its_io_thread_run_below_the_caller(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    before = _priority()
    seen = _save_and_watch(tmp_path, monkeypatch, writer_nice=7)
    assert seen["caller"] == before  # the training's thread keeps its priority
    assert seen["writer"] == seen["io"] == min(19, before + 7), seen


def test_writer_nice_none_leaves_the_writer_at_the_callers_priority(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    before = _priority()
    seen = _save_and_watch(tmp_path, monkeypatch, writer_nice=None)
    assert seen["writer"] == seen["io"] == seen["caller"] == before, seen


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True, "10"])
def test_a_writer_nice_out_of_range_is_refused_where_the_checkpointer_is_made(tmp_path: Path, bad: object) -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="writer_nice must be an int from 0 to 19"):
        Checkpointer(tmp_path, model, writer_nice=bad)
    assert list(tmp_path.iterdir()) == []  # nothing written
