"""xxhash's first-block parent is seeded per process unless PYTHONHASHSEED is set (vLLM's
rule); sha256's is the same in every process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import xxhash

from paged_jax.core.hashing import NONE_HASH, hash_block_tokens, none_hash, xxhash_none_seed

_SCRIPT = """
import json
from paged_jax.core.hashing import hash_block_tokens, none_hash
print(json.dumps({
    algo: [none_hash(algo).hex(), hash_block_tokens(None, [1, 2, 3], hash_algo=algo).hex()]
    for algo in ("sha256", "xxhash")
}))
"""


def _hashes(pythonhashseed: str | None) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,  # a hang guard only: a bare interpreter start and two hashes
    )
    return json.loads(proc.stdout)


def test_xxhash_is_seeded_per_process_without_pythonhashseed():
    first, second = _hashes(None), _hashes(None)
    assert first["xxhash"][0] != second["xxhash"][0]
    assert first["xxhash"][1] != second["xxhash"][1]
    assert _hashes("random")["xxhash"] != first["xxhash"]
    assert first["sha256"] == second["sha256"]  # sha256 stays reproducible everywhere
    assert first["sha256"][0] == NONE_HASH.hex()


def test_pythonhashseed_makes_xxhash_reproducible_and_picks_the_seed():
    seven = _hashes("7")
    assert _hashes("7") == seven
    assert _hashes("8")["xxhash"] != seven["xxhash"]
    assert _hashes("8")["sha256"] == seven["sha256"]
    expected = xxhash.xxh3_128_digest(b"paged-jax/none-hash/v1/7").hex()
    assert seven["xxhash"][0] == expected


def test_this_process_uses_one_seed_throughout():
    assert xxhash_none_seed() is xxhash_none_seed()
    assert none_hash("xxhash") == xxhash.xxh3_128_digest(xxhash_none_seed())
    assert hash_block_tokens(None, [4], hash_algo="xxhash") == hash_block_tokens(
        None, [4], hash_algo="xxhash"
    )
    assert none_hash() == hashlib.sha256(b"paged-jax/none-hash/v1").digest()
