"""Advantages: group normalisation, the zero-spread guard, the three modes (one advantage per assistant turn), and
a token's advantage being its turn's."""

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


def test_one_outlier_gets_the_largest_value_a_z_scored_group_of_8_allows():
    """By hand: the outlier lies 7d/8 above the mean and the 7 others d/8 below; the sample std (ddof=1) is d/sqrt(8).
    So the outlier gets 7/sqrt(8) ~ 2.47, the most any member of a z-scored group of 8 can get ((G-1)/sqrt(G)), and
    the others -1/sqrt(8). (rtol: the 1e-4 added to the std, about 5e-4 of it here.)"""
    a = M.group_normalize(list(np.float32([0.35] * 7 + [0.95])))
    np.testing.assert_allclose(a, [-1 / np.sqrt(8)] * 7 + [7 / np.sqrt(8)], rtol=1e-3)


def group(*turns_and_splits):
    """Episodes of one group: (assistant turns, first_result_turn) each, one sample whose every turn has two tokens
    trained after one untrained token."""
    eps = []
    for n, split in turns_and_splits:
        idx = [i for t in range(n) for i in (-1, t, t)]
        sample = M.Sample(input_ids=[0] * len(idx), loss_mask=[int(t >= 0) for t in idx], turn_idx=idx)
        eps.append(
            M.Episode(
                row={},
                messages=[],
                n_prompt_messages=0,
                turns=[M.Turn(0, 0)] * n,
                samples=[sample],
                first_result_turn=split,
            )
        )
    return eps


# a tool user that answers after one result, one that calls twice, an answer without a tool, and one whose call used
# up the context (its first result turn never came)
GROUP = [(2, 1), (3, 1), (1, None), (1, 1)]


def test_modes_give_one_advantage_per_turn_split_at_the_first_tool_result():
    turn, out, cfg = (
        [[1.0, 0.0], [0.0, 0.0, 0.0], [1.0], [0.0]],
        [1.0, 1.0, 0.0, 0.0],
        M.Config(turn_advantage_coef=0.5),
    )
    # by hand, not by group_normalize: two 1s and two 0s z-score to +-0.5 / std, std (ddof=1) = sqrt(1/3); the
    # merged returns [2, 1, 1, 0] to [1, 0, 0, -1] / sqrt(2/3) (each std plus group_normalize's 1e-4)
    z = 0.5 / (np.sqrt(1 / 3) + 1e-4)
    m = 1.0 / (np.sqrt(2 / 3) + 1e-4)
    eps = group(*GROUP)
    # outcome [z, z, -z, -z]; first-turn rewards [1, 0, 1, 0] -> [z, -z, z, -z], at coef 0.5 before the first result
    want = [[1.5 * z, z], [0.5 * z, z, z], [-0.5 * z], [-1.5 * z]]
    assert_advantages(M.ADVANTAGE_MODES["mt_grpo"](eps, turn, out, cfg), want)
    assert_advantages(M.ADVANTAGE_MODES["grpo_outcome"](eps, turn, out, cfg), [[z] * 2, [z] * 3, [-z], [-z]])
    assert_advantages(M.ADVANTAGE_MODES["grpo_merged"](eps, turn, out, cfg), [[m] * 2, [0.0] * 3, [0.0], [-m]])
    cfg.scale_rewards = False
    assert M.ADVANTAGE_MODES["grpo_outcome"](eps, turn, out, cfg)[0] == [0.5, 0.5]


def assert_advantages(got, want):
    assert [len(a) for a in got] == [len(a) for a in want], got
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=1e-12, atol=1e-12)


def test_a_tokens_advantage_is_its_turns():
    turn_idx = [-1, -1, 0, 0, -1, -1, 1, 1, -1, 2]
    mask = [0, 0, 1, 1, 0, 0, 1, 1, 0, 1]
    assert M.token_values(turn_idx, mask, [2.0, 0.5, -1.0]) == [0, 0, 2, 2, 0, 0, 0.5, 0.5, 0, -1]
    eps = group(*GROUP)
    cfg = M.Config(num_generations=4, turn_advantage_coef=0.5)
    M.assign_advantages(eps, [[1.0, 0.0], [0.0] * 3, [1.0], [0.0]], [1.0, 1.0, 0.0, 0.0], cfg)
    for ep in eps:
        [s] = ep.samples
        assert len(ep.advantages) == len(ep.turns) and any(ep.advantages)
        assert s.advantages == [ep.advantages[t] if t >= 0 else 0.0 for t in s.turn_idx]


def test_a_mode_that_does_not_give_one_advantage_per_turn_is_one_line(monkeypatch):
    monkeypatch.setitem(M.ADVANTAGE_MODES, "per_episode", lambda eps, turn_R, outcome_R, cfg: [[1.0] for _ in eps])
    with pytest.raises(
        M.ConfigError,
        match=r"'per_episode' must return one advantage per assistant turn: it gave "
        r"\[1, 1, 1, 1\] for episodes of \[2, 3, 1, 1\] turns",
    ):
        M.assign_advantages(group(*GROUP), [[0.0]] * 4, [1.0, 0.0, 0.0, 0.0], M.Config(advantage_mode="per_episode"))
