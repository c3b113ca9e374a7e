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


def test_one_outlier_gives_bounded_values():
    a = M.group_normalize(list(np.float32([0.35] * 7 + [0.95])))
    assert np.all(np.isfinite(a)) and np.abs(a).max() < 3  # at most sqrt(G-1) ~ 2.65 for G=8
    assert np.allclose(a[:7], a[0]) and a[0] < 0 < a[7]


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
    a_o, a_t = M.group_normalize(out), M.group_normalize([1.0, 0.0, 1.0, 0.0])
    eps = group(*GROUP)
    before = a_o + 0.5 * a_t
    want = [[before[0], a_o[0]], [before[1], a_o[1], a_o[1]], [before[2]], [before[3]]]
    assert M.ADVANTAGE_MODES["mt_grpo"](eps, turn, out, cfg) == want  # exact: today's numbers
    assert M.ADVANTAGE_MODES["grpo_outcome"](eps, turn, out, cfg) == [[a] * n for a, (n, _) in zip(a_o, GROUP)]
    merged = M.group_normalize(np.add([1.0, 0.0, 1.0, 0.0], out))
    assert M.ADVANTAGE_MODES["grpo_merged"](eps, turn, out, cfg) == [[a] * n for a, (n, _) in zip(merged, GROUP)]
    cfg.scale_rewards = False
    assert M.ADVANTAGE_MODES["grpo_outcome"](eps, turn, out, cfg)[0] == [0.5, 0.5]


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
