"""examples/linear_probe.py and examples/steering.py (issue 40) run and check themselves.

Each returns 1 when its own check fails (probe accuracy, steering effect, compiles after
warm-up); they run in this process (main()) so the tests share its jax import.
"""

from __future__ import annotations

import pathlib
import re
import runpy
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [name])
    return runpy.run_path(str(EXAMPLES / name), run_name="example")["main"]()


def test_linear_probe_separates_the_classes(monkeypatch, capsys):
    assert run_example("linear_probe.py", monkeypatch) == 0
    out = capsys.readouterr().out
    accs = [float(a) for a in re.findall(r"held-out probe accuracy ([0-9.]+)", out)]
    assert len(accs) == 3 and min(accs) >= 0.9, out
    assert "engine compiles after warm-up: 0" in out


def test_steering_pulls_generation_toward_the_vector(monkeypatch, capsys):
    assert run_example("steering.py", monkeypatch) == 0
    out = capsys.readouterr().out
    before, after = map(float, re.search(r"unsteered ([0-9.]+), steered ([0-9.]+)", out).groups())
    assert after >= before + 0.3, out
    assert "zero vector == unsteered: True" in out
    assert "engine compiles after warm-up: 0" in out
