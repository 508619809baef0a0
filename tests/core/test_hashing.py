"""Chained block hashing: determinism across processes, algorithms, extra keys."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import xxhash

from paged_jax import Request
from paged_jax.core.hashing import (
    NONE_HASH,
    BlockHasher,
    encode_block_key,
    encode_extra_keys,
    hash_block_tokens,
    none_hash,
    pack_token_ids,
)

_HASH_SCRIPT = """
import json
from paged_jax import Request
from paged_jax.core.hashing import BlockHasher
out = {}
for algo in ("sha256", "xxhash"):
    r = Request("r", list(range(1000, 1037)), cache_salt="salt", adapter_id=5,
                block_hasher=BlockHasher(16, algo))
    out[algo] = [h.hex() for h in r.block_hashes]
print(json.dumps(out))
"""


def _hashes_in_subprocess(pythonhashseed: str) -> dict[str, list[str]]:
    env = dict(os.environ, PYTHONHASHSEED=pythonhashseed)
    proc = subprocess.run(
        [sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout)


def test_hashes_are_identical_across_processes_and_pythonhashseeds():
    here = {}
    for algo in ("sha256", "xxhash"):
        r = Request(
            "r",
            list(range(1000, 1037)),
            cache_salt="salt",
            adapter_id=5,
            block_hasher=BlockHasher(16, algo),
        )
        here[algo] = [h.hex() for h in r.block_hashes]
    assert len(here["sha256"]) == 2  # 37 tokens -> 2 full blocks of 16
    # xxhash is seeded per process (tests/core/test_hash_seed.py); sha256 never is.
    assert _hashes_in_subprocess("0")["sha256"] == here["sha256"]
    assert _hashes_in_subprocess("12345")["sha256"] == here["sha256"]


def test_sha256_matches_the_documented_byte_layout():
    token_ids = [1, 2, 3, 2**40]
    expected_input = (
        hashlib.sha256(b"paged-jax/none-hash/v1").digest()
        + (4).to_bytes(4, "little")
        + b"".join(t.to_bytes(8, "little") for t in token_ids)
    )
    assert hashlib.sha256(b"paged-jax/none-hash/v1").digest() == NONE_HASH
    assert hash_block_tokens(None, token_ids) == hashlib.sha256(expected_input).digest()
    assert pack_token_ids([1, 256]) == (1).to_bytes(8, "little") + (256).to_bytes(8, "little")


def test_xxhash_option_is_xxh3_128_over_the_same_bytes():
    token_ids = [5, 6]
    parent = none_hash("xxhash")  # this process's seed (tests/core/test_hash_seed.py)
    assert len(parent) == 16
    data = parent + (2).to_bytes(4, "little") + pack_token_ids(token_ids)
    digest = hash_block_tokens(None, token_ids, hash_algo="xxhash")
    assert digest == xxhash.xxh3_128_digest(data) and len(digest) == 16
    assert digest != hash_block_tokens(None, token_ids)


def test_block_hasher_chains_block_by_block():
    r = Request("r", list(range(10)), block_hasher=BlockHasher(4))
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert r.block_hashes == [h0, h1]


def test_only_full_blocks_are_hashed_and_appends_extend_incrementally():
    r = Request("r", [9, 9, 9], block_hasher=BlockHasher(4))
    assert r.block_hashes == []
    r.append_output_token_ids(9)
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([1, 2, 3])
    assert len(r.block_hashes) == 1
    r.append_output_token_ids([4, 5, 6, 7, 8])  # 12 tokens: 3 full blocks
    assert len(r.block_hashes) == 3
    whole = Request("w", r.all_token_ids, block_hasher=BlockHasher(4))
    assert whole.block_hashes == r.block_hashes


def test_cache_salt_goes_into_the_first_block_only_and_adapter_into_every_block():
    tokens = list(range(8))
    salted = Request("s", tokens, cache_salt="x", block_hasher=BlockHasher(4)).block_hashes
    salt_key = encode_extra_keys(adapter_id=None, cache_salt="x")
    h0 = hash_block_tokens(None, tokens[:4], salt_key)
    assert salted == [h0, hash_block_tokens(h0, tokens[4:])]

    adapted = Request("a", tokens, adapter_id="lora-a", block_hasher=BlockHasher(4)).block_hashes
    key = encode_extra_keys(adapter_id="lora-a", cache_salt=None)
    a0 = hash_block_tokens(None, tokens[:4], key)
    assert adapted == [a0, hash_block_tokens(a0, tokens[4:], key)]
    # Int and str adapter ids with the same text do not collide.
    assert encode_extra_keys(adapter_id=1, cache_salt=None) != encode_extra_keys(
        adapter_id="1", cache_salt=None
    )


def test_block_extra_keys_enter_their_own_block_and_chain_on():
    """Block i's own key (prompt embeddings' rows digest) joins block i's hash only;
    blocks past the keys hash their tokens alone, and the chain carries every key."""
    tokens = list(range(12))
    keyed = Request("k", tokens, block_extra_keys=[b"r0", b"r1"], block_hasher=BlockHasher(4))
    h0 = hash_block_tokens(None, tokens[:4], encode_block_key(b"r0"))
    h1 = hash_block_tokens(h0, tokens[4:8], encode_block_key(b"r1"))
    assert keyed.block_hashes == [h0, h1, hash_block_tokens(h1, tokens[8:])]
    other = Request("o", tokens, block_extra_keys=[b"r0", b"x1"], block_hasher=BlockHasher(4))
    assert other.block_hashes[0] == h0 and other.block_hashes[1:] != keyed.block_hashes[1:]
    plain = Request("p", tokens, block_hasher=BlockHasher(4)).block_hashes
    assert plain[0] != h0  # a keyed block never meets the token-only block
    assert keyed.fork("c").block_extra_keys == (b"r0", b"r1")
    with pytest.raises(ValueError, match=r"block_extra_keys=\('r0',\) must be a sequence of bytes"):
        Request("bad", tokens, block_extra_keys=["r0"])


def test_unknown_algorithm_and_bad_block_size_raise():
    with pytest.raises(ValueError, match=r"hash_algo='md5' must be one of"):
        BlockHasher(4, "md5")
    with pytest.raises(ValueError, match=r"block_size=0 must be a positive int"):
        BlockHasher(0)
