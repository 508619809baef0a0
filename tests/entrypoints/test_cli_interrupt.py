"""Ctrl-C ends the generate CLI with exit status 130 at every phase, without a crash.

Each case runs the CLI as a program (a fresh process) on the demo model, whose step
programs take seconds to compile, and sends SIGINT once its progress output shows the
phase. A compile interrupted mid-way keeps running on XLA's threads; an interpreter
shutting down under it used to segfault (exit -11).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from paged_jax.entrypoints.demo import write_demo_model
from paged_jax.entrypoints.generate_cli import main as generate_main

# A hang guard, not a speed limit: the marker shows after the model loads (and, for the
# warm-up cases, after the first programs compile), minutes on a loaded 2-core machine.
DEADLINE_S = 600
# The variables by which tests/conftest.py hands its shared XLA cache to subprocesses.
SUITE_XLA_CACHE = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


def _default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal gives it. A child inherits an
    ignored or blocked SIGINT, and a Python started so never raises KeyboardInterrupt;
    something earlier in a full test run can leave the runner's SIGINT that way."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _interrupt(cmd: list[str], marker: str, delay_s: float) -> tuple[int, str]:
    """Runs `cmd`, sends SIGINT `delay_s` after `marker` shows on stderr; (status, stderr)."""
    # Without the suite's shared XLA cache (tests/conftest.py): a warm one would load the
    # step programs at once and leave no compile in progress to interrupt.
    env = {k: v for k, v in os.environ.items() if not k.startswith(SUITE_XLA_CACHE)}
    env["PYTHONFAULTHANDLER"] = "1"
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=env,
        preexec_fn=_default_sigint,
    )
    err = b""
    deadline = time.monotonic() + DEADLINE_S
    try:
        while marker.encode() not in err:
            left = deadline - time.monotonic()
            assert left > 0, f"{marker!r} never showed: {err.decode()[-2000:]}"
            ready, _, _ = select.select([proc.stderr], [], [], left)
            chunk = os.read(proc.stderr.fileno(), 65536) if ready else b""
            assert chunk, f"exited ({proc.poll()}) before {marker!r}: {err.decode()[-2000:]}"
            err += chunk
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        return proc.returncode, (err + rest).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("phase", "marker", "delay_s", "extra"),
    [
        ("load", "loading ", 0.0, ["--no-compile-cache"]),
        # Mid-compile of the first step program (seconds for the demo model).
        ("warm-up", "compiling step tokens=16", 1.0, ["--no-compile-cache"]),
        ("warm-up with the compile cache", "compiling step tokens=16", 1.0, []),
        # One token bucket (16) keeps this case's warm-up short.
        (
            "generation",
            "warm-up done",
            1.0,
            ["--max-num-batched-tokens", "16", "--max-tokens", "1500", "--ignore-eos"],
        ),
    ],
)
def test_ctrl_c_exits_130_cleanly(demo_dir, tmp_path, phase, marker, delay_s, extra):
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(8)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "paged_jax.entrypoints.generate_cli", "--model", str(demo_dir)]
    cmd += ["--prompts", str(prompts), "--output", str(out), "--max-num-seqs", "8"]
    cmd += ["--max-num-batched-tokens", "64", "--compile-cache-dir", str(tmp_path / "cc")]
    cmd += ["--max-tokens", "4", *extra]
    code, err = _interrupt(cmd, marker, delay_s)
    assert code == 130, f"{phase}: exit {code}\n{err[-3000:]}"
    assert "Fatal Python error" not in err and "Traceback" not in err, err[-3000:]
    assert not out.exists()  # an interrupted run never replaces the output
    if phase != "load":
        assert "the run stopped (KeyboardInterrupt)" in err, err[-2000:]


def test_a_ctrl_c_that_python_swallowed_still_stops_the_run(model_dir, tmp_path, monkeypatch):
    """An interrupt landing in jax's gc callback is printed and dropped by Python; the
    CLI remembers it and stops at its next check (here: right after loading)."""
    from paged_jax.llm import LLM

    real_init = LLM.__init__

    def init(self, *args, **kwargs):
        # Python drops an exception raised in a gc callback the same way.
        with contextlib.suppress(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "__init__", init)
    # The CLI only replaces Python's own handler; start from it whatever ran before.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _swallowed_run(model_dir, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _swallowed_run(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\n")
    args = ["--model", str(model_dir), "--prompts", str(prompts), "--max-tokens", "2"]
    args += ["--max-model-len", "64", "--no-compile-cache", "--no-tqdm"]
    args += ["--output", str(tmp_path / "out.jsonl")]
    assert generate_main(args) == 130
    assert not (tmp_path / "out.jsonl").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
