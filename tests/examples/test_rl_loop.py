"""examples/rl_loop.py (issue 39 item 3): a GRPO-style loop trains the served model.

The example checks itself (exit 1 otherwise); here its printed figures are read back
too: the reward rises over the iterations and the engine compiles nothing after the
first one (update_weights every iteration).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def test_rl_loop_reward_rises_without_compiles():
    # timeout: a hang guard only; no test asserts how long the example ran.
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rewards = [float(r) for r in re.findall(r"iteration +\d+: reward ([0-9.]+)", proc.stdout)]
    assert len(rewards) == 12, proc.stdout
    k = len(rewards) // 4
    assert sum(rewards[-k:]) / k > sum(rewards[:k]) / k, rewards
    assert "engine compiles after the first iteration: 0" in proc.stdout
    gap = float(re.search(r"engine vs dense sequence logprob: max \|diff\| (\S+)", proc.stdout)[1])
    assert gap < 1e-4
