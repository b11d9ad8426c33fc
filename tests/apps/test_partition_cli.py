"""``ooc partition``: the table, the picture, ParDNN's files, a captured model, clear errors."""

from __future__ import annotations

import re

import pytest

from ooc.apps.cli import main
from ooc.scheduler.partition import read_pardnn


def test_partition_table_picture_and_pardnn_files(tmp_path, capsys) -> None:
    png, folder, place = tmp_path / "g.png", tmp_path / "pardnn", tmp_path / "p.place"
    assert main(["partition", "--graph", "cnn3d:300", "--devices", "3", "--capacity", "64GiB", "--gantt", str(png),
                 "--export-pardnn", str(folder), "--placement", str(place)]) == 0
    out = capsys.readouterr().out
    for method in ("pardnn", "contiguous", "heft", "mincut"):
        assert f"\n{method} " in out
    assert "best: " in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    graph = read_pardnn(folder)
    lines = place.read_text().splitlines()
    assert len(lines) == graph.n and {int(x.split()[1]) for x in lines} <= {0, 1, 2}
    # the exported folder is itself a graph the command reads
    assert main(["partition", "--graph", str(folder), "--method", "pardnn", "--method", "heft"]) == 0
    assert f"{graph.n} ops" in capsys.readouterr().out


@pytest.mark.slow  # ~12 s on 2 cores: make_fx's first trace; tests/ooc/test_partition_capture.py covers capture
def test_captured_reference_model(capsys) -> None:
    assert main(["partition", "--graph", "mlp", "--batch", "4", "--method", "pardnn"]) == 0
    assert "best: pardnn" in capsys.readouterr().out


def test_errors_are_one_line_with_exit_code_2(capsys) -> None:
    assert main(["partition", "--graph", "lstm:300", "--capacity", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "fits with" in err and "--capacity" in err and err.count("\n") == 1
    assert main(["partition", "--graph", "lstm"]) == 2
    assert "lstm:10000" in capsys.readouterr().err
    assert main(["partition", "--graph", "nothing-here"]) == 2
    assert main(["partition", "--graph", "lstm:300", "--method", "metis"]) == 2
    assert "choose from" in capsys.readouterr().err


def test_the_best_line_says_how_many_times_one_devices_work_the_step_takes(capsys) -> None:
    """It printed one device's time over the makespan as "0.29x one device", which reads as 29% of
    one device's time where the step took 3.4 times as long."""
    assert main(["partition", "--graph", "lstm:300", "--devices", "2", "--method", "pardnn"]) == 0
    out = capsys.readouterr().out
    work = float(re.search(r"([0-9.]+) ms of work on one device", out).group(1))
    best = re.search(r"best: pardnn, ([0-9.]+) ms, ([0-9.]+)x the work of one device \(([0-9.]+) ms\)", out)
    assert best, out
    makespan, ratio, one = (float(g) for g in best.groups())
    assert one == pytest.approx(work, abs=1e-3) and ratio == pytest.approx(makespan / work, abs=0.01)


def test_the_pictures_memory_rows_reach_the_simulated_peaks(tmp_path, monkeypatch) -> None:
    """An op of no time whose output nobody reads holds it for an instant: the simulator counts it
    at that instant, the picture freed it before allocating it and drew a lower peak."""
    import matplotlib.axes
    import numpy as np

    from ooc.apps.partition import plot_placement
    from ooc.scheduler.partition import Devices, OpGraph, run_methods

    graph = OpGraph.build(["a", "b", "c"], [1.0, 0.0, 1.0], [5 * 2**20, 7 * 2**20, 3 * 2**20], [("a", "b")],
                          [5 * 2**20])
    drawn = []
    real_step = matplotlib.axes.Axes.step
    monkeypatch.setattr(matplotlib.axes.Axes, "step",
                        lambda self, x, y, *a, **kw: (drawn.append(float(np.max(y))), real_step(self, x, y, *a, **kw))[1])
    outcome = run_methods(graph, Devices.uniform(2, 2**30), ["contiguous"])[0]
    plot_placement(graph, outcome, tmp_path / "g.png", title="t")
    assert drawn == [p / 2**20 for p in outcome.simulation.peak_bytes]


def test_a_graph_of_no_work_or_no_ops(tmp_path, capsys) -> None:
    """Ops of no time, or no ops at all (a ParDNN folder with an empty graph), ended in a
    ZeroDivisionError's traceback (the makespan over one device's work)."""
    from ooc.scheduler.partition import OpGraph, write_pardnn

    write_pardnn(OpGraph.build(["a", "b"], [0.0, 0.0], [8, 8], [("a", "b")], [8]), tmp_path / "idle")
    assert main(["partition", "--graph", str(tmp_path / "idle"), "--method", "pardnn"]) == 0
    assert "best: pardnn, 0.000 ms" in capsys.readouterr().out
    write_pardnn(OpGraph.build([], [], [], []), tmp_path / "empty")
    assert main(["partition", "--graph", str(tmp_path / "empty")]) == 2
    assert "no ops" in capsys.readouterr().err
