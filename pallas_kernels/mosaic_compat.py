"""What the Mosaic GPU kernels need from jax that differs between the jax versions they run
on (names.MOSAIC_MIN_JAX_VERSION, 0.11.2, up to 0.12), kept in this one place.

- Races in GPU interpret mode. With ``InterpretGPUParams(detect_races=True)`` jax 0.12's
  interpreter fails the kernel on a race; jax 0.11.2's prints "RACE DETECTED" and only sets
  a flag (``races_found`` on the interpreter's race state), so a racy kernel would still
  return. ``raise_on_races`` threads a kernel's outputs through a host callback that raises
  when the flag is set, so a race fails the call on both.

Everything else the kernels use (``plgpu.kernel(out_type=, scratch_types=)``, TMA copies,
barriers, wgmma, ``InterpretGPUParams``) has the same API on 0.11.2 and 0.12.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import io_callback


def _gpu_callbacks():
    """The GPU interpreter's module of host callbacks (private to jax), or None."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    except ImportError:
        return None
    return gpu_callbacks


class KernelRaceError(RuntimeError):
    """GPU interpret mode's race detector found a data race in a Mosaic kernel."""


def _check_races(kernel_name: str, *outputs):
    callbacks = _gpu_callbacks()
    # The race state of the kernel interpreted last (where this jax keeps none, its
    # detector reports races by itself).
    state = getattr(callbacks, "_races", None)
    if state is not None and getattr(state, "races_found", False):
        # Raising here can skip the interpreter's own clean-up callback, which would
        # leave its shared memory to the next kernel: reset it first.
        callbacks.reset_gpu_interpret_mode_state()
        raise KernelRaceError(
            f"RACE DETECTED in {kernel_name} (GPU interpret mode, detect_races=True; "
            "the accesses are printed above)"
        )
    return tuple(np.asarray(o) for o in outputs)


def raise_on_races(outputs: tuple, params: Any, kernel_name: str) -> tuple:
    """`outputs` of one interpreted kernel call, unchanged, failing when a race was found.

    A no-op unless ``params`` is an ``InterpretGPUParams`` with ``detect_races=True``.
    The callback depends on the outputs, so it runs once the kernel's interpretation has
    finished, and reads that kernel's race state.
    """
    if params is None or not getattr(params, "detect_races", False):
        return outputs
    shapes = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outputs)
    return io_callback(lambda *o: _check_races(kernel_name, *o), shapes, *outputs)


__all__ = ["KernelRaceError", "raise_on_races"]
