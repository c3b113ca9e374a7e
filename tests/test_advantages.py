"""Advantages: group normalisation, the zero-spread guard, the three modes, and the per-token split."""
import numpy as np
import pytest

import mt_grpo_trainer as M


def test_group_normalize_is_centred_and_scaled():
    a = M.group_normalize([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    assert abs(a.mean()) < 1e-12 and abs(a.std(ddof=1) - 1) < 1e-3
    np.testing.assert_allclose(M.group_normalize([1.0, 3.0], scale=False), [-1.0, 1.0])


def test_zero_spread_gives_zero_never_nan():
    assert np.all(M.group_normalize([0.5] * 8) == 0)
    assert np.all(M.group_normalize([0.0] * 8) == 0)
    # float32 residue: the same 0.35 reached two ways differs by ~1e-8; that is not a signal.
    residue = [float(np.float32(0.1) + np.float32(0.25))] * 4 + [0.35] * 4
    assert np.ptp(residue) > 0
    assert np.all(M.group_normalize(residue) == 0)


def test_one_outlier_gives_bounded_values():
    a = M.group_normalize(list(np.float32([0.35] * 7 + [0.95])))
    assert np.all(np.isfinite(a)) and np.abs(a).max() < 3       # at most sqrt(G-1) ~ 2.65 for G=8
    assert np.allclose(a[:7], a[0]) and a[0] < 0 < a[7]


def test_modes():
    turn, out = [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]
    b, a = M.episode_advantages(turn, out, "mt_grpo", 0.5)
    np.testing.assert_allclose(a, M.group_normalize(out))
    np.testing.assert_allclose(b, M.group_normalize(out) + 0.5 * M.group_normalize(turn))
    b, a = M.episode_advantages(turn, out, "grpo_outcome", 0.5)
    np.testing.assert_allclose(b, a)
    np.testing.assert_allclose(a, M.group_normalize(out))
    b, a = M.episode_advantages(turn, out, "grpo_merged", 0.5)
    np.testing.assert_allclose(b, a)
    np.testing.assert_allclose(a, M.group_normalize(np.add(turn, out)))
    with pytest.raises(ValueError):
        M.episode_advantages(turn, out, "nope", 1.0)


def test_token_split_at_first_tool_result():
    turn_idx = [-1, -1, 0, 0, -1, -1, 1, 1, -1, 2]
    mask = [0, 0, 1, 1, 0, 0, 1, 1, 0, 1]
    assert M.token_advantages(turn_idx, mask, 2.0, 0.5, split_turn=1) == [0, 0, 2, 2, 0, 0, .5, .5, 0, .5]
    # no tool result: the whole episode is its first turn (paper Eq. 5 applies A_O + lambda*A_T throughout)
    assert M.token_advantages(turn_idx, mask, 2.0, 0.5, split_turn=None) == [0, 0, 2, 2, 0, 0, 2, 2, 0, 2]
