"""core.request.new_request: a new request checked against the model, as fork_child
checks a fork (host only)."""

from __future__ import annotations

import pytest

from paged_jax.core.request import fork_child, new_request


def test_new_request_checks_vocab_and_room_for_one_token():
    req = new_request("r", [1, 2, 3], None, vocab_size=4, max_model_len=4, priority=2)
    assert (req.prompt_token_ids, req.priority) == ([1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"prompt_token_ids contains 4: .* < vocab_size=4"):
        new_request("r", [1, 4], None, vocab_size=4, max_model_len=8)
    with pytest.raises(ValueError, match=r"len\(prompt_token_ids\)=4 must be < max_model_len=4"):
        new_request("r", [0, 1, 2, 3], None, vocab_size=4, max_model_len=4)
    with pytest.raises(ValueError, match="must not be empty"):  # Request's own checks run too
        new_request("r", [], None, vocab_size=4, max_model_len=4)


def test_fork_child_names_the_child_in_the_same_vocab_check():
    parent = new_request("p", [1, 2, 3], None, vocab_size=4, max_model_len=8)
    parent.num_computed_tokens = 3
    with pytest.raises(ValueError, match=r"child 'c'.* contains 5: token ids must be < vocab"):
        fork_child(parent, "c", [1, 2, 5], None, None, vocab_size=4, max_model_len=8)
    child, common = fork_child(parent, "c", [1, 2, 0], None, None, vocab_size=4, max_model_len=8)
    assert (child.prompt_token_ids, common) == ([1, 2, 0], 2)
