"""Host side of paged-jax: requests, prefix-cache hashing, block pool, KV-cache managers, scheduler.

Pure Python (numpy at most). Nothing in this folder imports jax; a test imports every
module here in a fresh interpreter and checks. Mirrors vLLM V1's ``v1/core``.
"""
