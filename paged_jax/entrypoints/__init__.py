"""Command-line entry points and the built-in demo model (``paged-jax-generate``)."""
