"""One benchmark system in its own worker process, spoken to in JSON lines.

The benchmark scripts (scripts/bench_engine.py, scripts/bench_serving.py) start each
system as ``python -m <worker module> SPEC_JSON``; the worker answers one JSON line when
it is warmed up, then one line per command read from its stdin, until ``{"op": "quit"}``.
Separate processes keep one system's compile caches, threads and memory out of another's
timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


class WorkerError(RuntimeError):
    """A worker process exited before answering (its stderr went to this one's)."""


class WorkerProcess:
    """A started worker: ``ready`` is its first answer; ``request`` sends one command.

    Subclasses set ``module``, the worker's module run with ``python -m``.
    """

    module: str = ""

    def __init__(self, spec: dict, label: str):
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"{self.label} worker exited with {self.proc.wait()}")
        return json.loads(line)

    def request(self, op: str, **cmd: Any) -> dict:
        """Sends one command; the answer's summary gets the 1-minute load at its start."""
        load = os.getloadavg()[0]
        self.proc.stdin.write(json.dumps({"op": op, **cmd}) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        result["summary"]["loadavg_1min_at_start"] = round(load, 2)
        return result

    def close(self) -> None:
        """Asks the worker to quit; kills it if it does not within a minute."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
