"""Offline batched generation (the main job); see `python scripts/generate.py --help`.

Same as the installed `paged-jax-generate` command: with no --model it writes and uses
the built-in demo model, with no --prompts the built-in prompt set.
"""

from __future__ import annotations

import sys

from paged_jax.entrypoints.generate_cli import main

if __name__ == "__main__":
    sys.exit(main())
