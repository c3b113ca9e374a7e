"""The learning benches' paired statistics (bench/paired_stats.py): the exact one-sided Wilcoxon signed-rank test,
Holm's adjustment, the bootstrap interval and the comparison line."""

import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from paired_stats import bootstrap_ci, compare, comparison_line, holm, ranks, wilcoxon_greater  # noqa: E402


def test_wilcoxon_exact_p_values_by_hand():
    assert wilcoxon_greater([0.1] * 8) == 1 / 256  # every sign positive: only 1 of the 2^8 assignments reaches it
    assert wilcoxon_greater([-0.1] * 8) == 1.0
    # 7 positive, the smallest magnitude negative: W+ = 36 - 1 = 35; sums >= 35 are 36 and 35, 2 of 256
    assert wilcoxon_greater([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, -0.05]) == 2 / 256
    assert wilcoxon_greater([0.0, 0.0, 0.3]) == 1 / 2  # zeros dropped: one pair left
    assert wilcoxon_greater([0.0, 0.0]) == 1.0


def test_wilcoxon_with_ties_matches_brute_force_enumeration():
    d = [0.2, 0.2, -0.2, 0.1, 0.5, 0.5, -0.1, 0.3]
    r = ranks([abs(x) for x in d])
    assert r[:3] == [4.0, 4.0, 4.0] and r[3] == r[6] == 1.5 and r[4] == r[5] == 7.5  # ties share their mean rank
    observed = sum(rank for rank, x in zip(r, d) if x > 0)
    sums = [sum(rank for rank, s in zip(r, signs) if s > 0) for signs in itertools.product((-1, 1), repeat=len(d))]
    assert wilcoxon_greater(d) == sum(s >= observed for s in sums) / len(sums)


def test_holm_multiplies_by_the_number_left_and_keeps_the_order():
    assert holm([0.01, 0.04, 0.03]) == [0.03, 0.06, 0.06]
    assert holm([0.5, 0.6]) == [1.0, 1.0]


def test_bootstrap_interval_holds_the_mean_and_is_reproducible():
    d = [0.1, 0.2, -0.05, 0.15, 0.3, 0.0, 0.12, 0.08]
    lo, hi = bootstrap_ci(d)
    assert lo < sum(d) / len(d) < hi and (lo, hi) == bootstrap_ci(d)
    assert bootstrap_ci([0.2] * 8) == (0.2, 0.2)


def test_the_comparison_line_has_the_planned_form():
    c = compare({"per-turn > MT-GRPO": [0.1, 0.2, 0.05, 0.3, 0.1, 0.2, 0.15, -0.02], "x > y": [0.0] * 8})
    line = comparison_line("per-turn > MT-GRPO", c["per-turn > MT-GRPO"])
    assert line.startswith("per-turn > MT-GRPO: 7 of 8 seeds, p = 0.016 (Holm), CI [")  # 2 x 2/256
    assert c["x > y"]["p_holm"] == 1.0 and c["x > y"]["wins"] == 0


def test_float_noise_is_a_tie_not_a_loss():
    # (0.3958 + 0.2569) / 2 - (0.3611 + 0.2917) / 2: the same 94 of 288 episodes, 5.6e-17 apart in floats
    noise = (57 / 144 + 37 / 144) / 2 - (52 / 144 + 42 / 144) / 2
    assert noise != 0
    c = compare({"a > b": [0.1, 0.2, noise]})["a > b"]
    assert c["diffs"][2] == 0 and c["p"] == 1 / 4  # two pairs left, both above
