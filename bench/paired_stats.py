"""Paired comparisons over seeds for the learning benches (bench/turn_credit.py, bench/paper_effect.py; its bootstrap
also serves bench/real_model.py, over prompts).

- `wilcoxon_greater(d)`: the one-sided exact Wilcoxon signed-rank test that the paired differences d are above 0.
  Zero differences are dropped (Wilcoxon's own convention), tied magnitudes get their mean rank, and the p-value is
  the share of the 2^n equally likely sign assignments whose positive-rank sum reaches the observed one: exact, with
  ties, for the few seeds a bench has (n <= 20).
- `holm(ps)`: Holm's step-down adjustment of a family of p-values.
- `bootstrap_ci(d)`: a percentile bootstrap interval of the mean difference, resampling seeds, from a fixed seed.
- `comparison_line(...)`: the bench's last lines, `per-turn > MT-GRPO: 7 of 8 seeds, p = 0.008 (Holm), CI [0.04, 0.19]`.
"""

import itertools

import numpy as np


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def wilcoxon_greater(diffs: list[float]) -> float:
    """One-sided exact p-value that the differences are above 0 (1.0 when every difference is 0)."""
    nonzero = [d for d in diffs if d != 0]
    if not nonzero:
        return 1.0
    if len(nonzero) > 20:
        raise ValueError(f"exact enumeration of 2^{len(nonzero)} sign assignments: use at most 20 nonzero pairs")
    r = ranks([abs(d) for d in nonzero])
    observed = sum(rank for rank, d in zip(r, nonzero) if d > 0)
    sums = [sum(rank for rank, s in zip(r, signs) if s) for signs in itertools.product((0, 1), repeat=len(r))]
    return sum(s >= observed - 1e-9 for s in sums) / len(sums)


def holm(ps: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the order given."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted = [0.0] * len(ps)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - k) * ps[i]))
        adjusted[i] = running
    return adjusted


def bootstrap_ci(diffs: list[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> tuple:
    """Percentile bootstrap interval of the mean of `diffs`, resampling them (the seeds) with replacement."""
    rng = np.random.default_rng(seed)
    d = np.asarray(diffs, dtype=float)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def compare(named_diffs: dict[str, list[float]]) -> dict[str, dict]:
    """For each planned comparison ("A > B": per-seed differences A - B): wins, exact one-sided Wilcoxon p, its Holm
    adjustment over the family, and the bootstrap CI of the mean difference."""
    names = list(named_diffs)
    # rates averaged over eval points: equal ones can differ by float noise (5.6e-17), which is a tie, not a loss
    rounded = {n: [round(x, 12) for x in named_diffs[n]] for n in names}
    raw = [wilcoxon_greater(rounded[n]) for n in names]
    out = {}
    for name, p, p_holm in zip(names, raw, holm(raw)):
        d = rounded[name]
        out[name] = {
            "diffs": d,
            "wins": sum(x > 0 for x in d),
            "n": len(d),
            "mean": float(np.mean(d)),
            "p": p,
            "p_holm": p_holm,
            "ci": bootstrap_ci(d),
        }
    return out


def comparison_line(name: str, c: dict) -> str:
    return (
        f"{name}: {c['wins']} of {c['n']} seeds, p = {c['p_holm']:.3f} (Holm), CI [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}]"
    )
