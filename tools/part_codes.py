"""A parts catalogue: 9,000 part numbers (P-1000 to P-9999), each with a six-digit code.

The codes are drawn from a fixed seed, so the dataset, the tool and the rewards agree without sharing state. A model
cannot answer from the question: the code is only in the tool's result (a guess is right one time in 900,000), and
the held-out rows ask about parts that no training row names, so memorising codes does not score either.
"""

import random

PARTS = [f"P-{n}" for n in range(1000, 10_000)]
CODES = dict(zip(PARTS, (f"{c:06d}" for c in random.Random(4321).sample(range(100_000, 1_000_000), len(PARTS)))))


def lookup(part: str) -> str:
    """Return the six-digit code of a part number such as P-1234."""
    if part not in CODES:
        raise KeyError(f"unknown part {part!r}: part numbers run from P-1000 to P-9999")
    return CODES[part]
