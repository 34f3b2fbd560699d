"""RouteCache on plain arrays: delta splicing equals a full export, and every fallback is counted.

The route oracle stands in for a causal MoE: token i's experts depend on tokens[0..i] and the
weight version only, which is exactly the property delta replay relies on.
"""
import hashlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from neon_hpc.replay import RouteCache, RouteMismatch

LAYERS, TOPK, EXPERTS = 3, 2, 8


def oracle(tokens, version=0):
    """[len(tokens), LAYERS, TOPK] expert ids; row i depends on tokens[:i+1] and version."""
    rows, h = [], hashlib.sha256(str(version).encode())
    for t in tokens:
        h.update(int(t).to_bytes(4, "little"))
        d = h.digest()
        rows.append([[d[l * TOPK + k] % EXPERTS for k in range(TOPK)] for l in range(LAYERS)])
    return np.array(rows, dtype=np.int32).reshape(len(tokens), LAYERS, TOPK)


def engine_response(prompt, output, start, version=0):
    """What the engine returns: rows [start, seqlen-1)."""
    full = oracle(list(prompt) + list(output), version)
    return full[start:len(prompt) + len(output) - 1]


def run_turn(cache, prompt, output, version=0):
    start = cache.start_len(prompt)
    cache.absorb(prompt, output, engine_response(prompt, output, start, version), start, version)
    return start


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 5)), min_size=1, max_size=8),
       st.randoms(use_true_random=False))
def test_delta_routes_equal_one_full_export_row_for_row(turns, rnd):
    cache, tokens, starts = RouteCache("delta"), [], []
    for n_env, n_gen in turns:
        prompt = tokens + [rnd.randrange(200) for _ in range(n_env)]
        output = [rnd.randrange(200) for _ in range(n_gen)]
        starts.append(run_turn(cache, prompt, output))
        tokens = prompt + output
    full = oracle(tokens)
    got = cache.assembled(len(tokens))
    np.testing.assert_array_equal(got[:-1], full[:-1])   # the last row is the placeholder
    np.testing.assert_array_equal(got[-1], got[-2] if len(tokens) > 1 else got[-1])
    assert starts[0] == 0 and all(s > 0 for s in starts[1:])
    assert sum(cache.fallbacks.values()) == 0
    assert cache.stats.delta_requests == len(turns) - 1


def test_delta_asks_from_prev_seqlen_minus_one_and_overwrites_the_placeholder():
    cache = RouteCache("delta")
    run_turn(cache, [1, 2, 3], [4, 5])
    placeholder = cache.routed_experts[-1].copy()
    np.testing.assert_array_equal(placeholder, cache.routed_experts[-2])
    assert cache.start_len([1, 2, 3, 4, 5, 9, 9]) == 4
    run_turn(cache, [1, 2, 3, 4, 5, 9, 9], [7])
    np.testing.assert_array_equal(cache.routed_experts[4], oracle([1, 2, 3, 4, 5])[4])
    assert len(cache.routed_experts) == 8


def test_full_mode_always_asks_everything_and_agrees_with_delta():
    full, delta = RouteCache("full"), RouteCache("delta")
    tokens = []
    for k in range(4):
        prompt, output = tokens + [10 + k, 11 + k], [20 + k, 21 + k, 22 + k]
        assert run_turn(full, prompt, output) == 0
        run_turn(delta, prompt, output)
        tokens = prompt + output
    np.testing.assert_array_equal(full.assembled(), delta.assembled())
    assert full.stats.route_bytes > delta.stats.route_bytes


def test_changed_prefix_falls_back_to_a_full_export_and_is_counted():
    cache = RouteCache("delta")
    run_turn(cache, [1, 2, 3], [4, 5])
    edited = [1, 2, 99, 4, 5, 6]                      # the client rewrote an earlier token
    assert run_turn(cache, edited, [7, 8]) == 0
    assert cache.fallbacks["prefix_mismatch"] == 1
    np.testing.assert_array_equal(cache.assembled()[:-1], oracle(edited + [7, 8])[:-1])
    assert run_turn(cache, edited + [7, 8, 1], [2]) > 0   # back to deltas afterwards


def test_row_count_mismatch_raises_and_leaves_the_cache_untouched():
    cache = RouteCache("delta")
    run_turn(cache, [1, 2, 3], [4, 5])
    before = cache.routed_experts.copy()
    prompt, output = [1, 2, 3, 4, 5, 6], [7]
    start = cache.start_len(prompt)
    bad = engine_response(prompt, output, start)[:-1]
    with pytest.raises(RouteMismatch, match="rows"):
        cache.absorb(prompt, output, bad, start, 0)
    np.testing.assert_array_equal(cache.routed_experts, before)
    with pytest.raises(RouteMismatch, match="no routed_experts"):
        cache.absorb(prompt, output, None, start, 0)


def test_weight_change_mid_conversation_refreshes_on_the_next_turn():
    cache = RouteCache("delta")
    run_turn(cache, [1, 2, 3], [4, 5], version=0)
    p2 = [1, 2, 3, 4, 5, 6]
    assert run_turn(cache, p2, [7, 8], version=1) > 0
    assert cache.fallbacks["version_change"] == 1
    assert cache.version_runs() == [[0, 0], [4, 1]]   # rows keep the version that made them
    p3 = p2 + [7, 8, 9]
    assert run_turn(cache, p3, [10], version=1) == 0  # refresh: full export
    assert cache.version_runs() == [[0, 1]]
    np.testing.assert_array_equal(cache.assembled()[:-1], oracle(p3 + [10], 1)[:-1])


def test_assembled_pads_tokens_appended_after_the_last_response():
    cache = RouteCache("delta")
    run_turn(cache, [1, 2, 3], [4])
    r = cache.assembled(6)
    assert r.shape == (6, LAYERS, TOPK)
    np.testing.assert_array_equal(r[4], r[3])
    np.testing.assert_array_equal(r[5], r[3])
