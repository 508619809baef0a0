"""Fixtures shared by the engine tests on SumModel (tests/engine/test_engine_fake.py's helpers)."""

from __future__ import annotations

import pytest

from paged_jax.engine import Engine
from tests.engine.test_engine_fake import assert_pool_drained, make_engine


@pytest.fixture(scope="module")
def _shared_default_engine() -> Engine:
    return make_engine()


@pytest.fixture
def default_engine(_shared_default_engine) -> Engine:
    """make_engine() with its defaults, built once per module: drained, prefix cache empty.

    The tests using it need nothing but the default settings; sharing saves an engine build
    (about 3 CPU s with the test compilation cache warm) each. Each starts from an idle
    engine with no cached prefix, so none depends on the tests before it. get_stats()
    counters are cumulative: read them as differences.
    """
    engine = _shared_default_engine
    assert_pool_drained(engine)
    assert engine.kv_cache_manager.reset_prefix_cache(), "blocks still held by a request"
    return engine
