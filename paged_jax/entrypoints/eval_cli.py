"""`paged-jax-eval`: lm-evaluation-harness's own CLI with the model `paged-jax` registered.

paged-jax-eval run --model paged-jax --model_args pretrained=DIR,max_model_len=2048 \
    --tasks hellaswag --batch_size auto

Every argument goes to lm-eval unchanged (docs/evaluation.md). The installed lm-eval
(0.4.13) reads no model plugins from other packages, so this command is how its CLI
finds `paged-jax`; from Python, `import paged_jax.lm_eval` registers it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

INSTALL_HINT = "paged-jax-eval needs lm-eval: pip install 'paged-jax[eval]'"


def main(argv: Sequence[str] | None = None) -> None:
    """Registers `paged-jax` with lm-eval, then runs lm-eval's CLI on argv (default
    sys.argv[1:])."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise SystemExit(f"{INSTALL_HINT} ({e})") from None
    import paged_jax.lm_eval  # noqa: F401  (registers the model name)

    if argv is not None:  # lm-eval's CLI parses sys.argv itself
        sys.argv = [sys.argv[0] if sys.argv else "paged-jax-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
