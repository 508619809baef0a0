"""Request fields and status, and ValueErrors for bad input across the host stack."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax import KVCacheManager, Request, RequestStatus
from paged_jax.core.hashing import BlockHasher


def test_request_counts_and_outputs():
    r = Request("r", [1, 2, 3], sampling_params={"max_tokens": 4}, priority=2, arrival_time=5.0)
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    assert r.status is RequestStatus.WAITING and r.num_preemptions == 0
    assert r.sampling_params == {"max_tokens": 4} and (r.priority, r.arrival_time) == (2, 5.0)
    r.append_output_token_ids(7)
    r.append_output_token_ids([8, np.int64(9)])
    assert r.output_token_ids == [7, 8, 9]
    assert r.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert (r.num_tokens, r.num_output_tokens) == (6, 3)
    r.num_computed_tokens = 5
    assert r.num_computed_tokens == 5
    assert r.block_hashes == []  # no hasher yet


def test_prompt_accepts_numpy_ints_and_tuples():
    r = Request("r", np.array([4, 5], dtype=np.int32))
    assert r.prompt_token_ids == [4, 5] and type(r.prompt_token_ids[0]) is int
    assert Request("t", (1,)).all_token_ids == [1]


def test_status_is_finished():
    finished = {s for s in RequestStatus if s.is_finished()}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
    assert RequestStatus.is_finished(RequestStatus.PREEMPTED) is False
    r = Request("r", [1])
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_token_ids": []}, r"prompt_token_ids=\[\] must not be empty"),
        ({"prompt_token_ids": [1, -2]}, r"prompt_token_ids\[i\]=-2 must be a non-negative int"),
        ({"prompt_token_ids": [1, 2.0]}, r"prompt_token_ids\[i\]=2.0 must be a non-negative int"),
        ({"prompt_token_ids": [True]}, r"prompt_token_ids\[i\]=True must be .* not a bool"),
        ({"prompt_token_ids": "abc"}, r"prompt_token_ids='abc' must be a sequence of int"),
        ({"prompt_token_ids": 5}, r"prompt_token_ids=5 must be a sequence of int"),
        ({"request_id": 3}, r"request_id=3 must be a str"),
        ({"cache_salt": ""}, r"cache_salt='' must be a non-empty str or None"),
        ({"adapter_id": 1.5}, r"adapter_id=1.5 must be an int, a str or None"),
    ],
)
def test_request_rejects_bad_input(kwargs, match):
    args = {"request_id": "r", "prompt_token_ids": [1, 2]} | kwargs
    with pytest.raises(ValueError, match=match):
        Request(args.pop("request_id"), args.pop("prompt_token_ids"), **args)


def test_append_rejects_bad_tokens_without_appending():
    r = Request("r", [1])
    with pytest.raises(ValueError, match=r"token_ids\[i\]=-1 must be a non-negative int"):
        r.append_output_token_ids([2, -1])
    with pytest.raises(ValueError, match=r"token_ids='x' must be a non-negative int"):
        r.append_output_token_ids("x")
    assert r.all_token_ids == [1] and r.output_token_ids == []


def test_block_hasher_is_set_once():
    r = Request("r", [1, 2, 3, 4], block_hasher=BlockHasher(2))
    assert len(r.block_hashes) == 2
    with pytest.raises(ValueError, match=r"must not replace the request's existing hasher"):
        r.block_hasher = BlockHasher(2)


def test_manager_attaches_its_hasher_on_first_contact_and_rejects_a_mismatch():
    m = KVCacheManager(8, 2, max_model_len=32)
    r = Request("r", [1, 2, 3, 4, 5])
    m.get_computed_blocks(r)
    assert r.block_hasher is m.block_hasher and len(r.block_hashes) == 2
    other = Request("o", [1, 2, 3], block_hasher=BlockHasher(4))
    with pytest.raises(ValueError, match=r"request.block_hasher=.* must hash 2-token blocks"):
        m.get_computed_blocks(other)
    r2 = Request("r2", [1, 2, 3])
    m.allocate_slots(r2, 3)
    assert r2.block_hasher is m.block_hasher


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 1}, r"num_blocks=1 must be an int >= 2"),
        ({"block_size": 0}, r"block_size=0 must be a positive int"),
        ({"max_model_len": -1}, r"max_model_len=-1 must be a positive int"),
        ({"hash_algo": "md5"}, r"hash_algo='md5' must be one of \('sha256', 'xxhash'\)"),
    ],
)
def test_manager_rejects_bad_config(kwargs, match):
    args = {"num_blocks": 8, "block_size": 4, "max_model_len": 32} | kwargs
    with pytest.raises(ValueError, match=match):
        KVCacheManager(args.pop("num_blocks"), args.pop("block_size"), **args)


def test_allocate_slots_rejects_bad_counts():
    m = KVCacheManager(8, 4, max_model_len=16)
    r = Request("r", list(range(10)))
    with pytest.raises(ValueError, match=r"must all be >= 0"):
        m.allocate_slots(r, -1)
    with pytest.raises(ValueError, match=r"num_new_tokens=0 must be > 0 with no prefix hit"):
        m.allocate_slots(r, 0)
    with pytest.raises(ValueError, match=r"num_new_computed_tokens=4 must equal 0 hit blocks"):
        m.allocate_slots(r, 4, 4)
    with pytest.raises(ValueError, match=r"num_new_tokens=17 must keep the request within "):
        m.allocate_slots(r, 17)
    assert m.allocate_slots(r, 10) is not None
    r.num_computed_tokens = 10
    with pytest.raises(ValueError, match=r"max_model_len=16 .*10 computed tokens"):
        m.allocate_slots(r, 7)
    m.check_invariants()


def test_lookahead_is_clamped_to_max_model_len():
    m = KVCacheManager(8, 4, max_model_len=16)
    r = Request("r", list(range(14)))
    # 14 tokens + 8 lookahead would need 6 blocks; capped at 16 slots -> 4 blocks.
    assert m.allocate_slots(r, 14, num_lookahead_tokens=8).get_block_ids() == ([1, 2, 3, 4],)


def test_hit_blocks_are_only_for_requests_without_blocks():
    m = KVCacheManager(12, 4, max_model_len=64)
    a = Request("a", list(range(8)))
    m.allocate_slots(a, 8)
    b = Request("b", list(range(9)))
    m.allocate_slots(b, 1)
    b.num_computed_tokens = 1
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    with pytest.raises(ValueError, match=r"new_computed_blocks=.* must only be given to a request"):
        m.allocate_slots(b, 1, num_hit, hits)
    m.check_invariants()


def test_hit_blocks_rejected_when_caching_is_disabled():
    cached = KVCacheManager(8, 4, max_model_len=64)
    a = Request("a", list(range(8)))
    cached.allocate_slots(a, 8)
    hits, num_hit = cached.get_computed_blocks(Request("b", list(range(9))))
    plain = KVCacheManager(8, 4, max_model_len=64, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"must be empty with prefix caching disabled"):
        plain.allocate_slots(Request("c", list(range(9))), 1, num_hit, hits)
