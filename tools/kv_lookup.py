"""The embedded default's only tool: a fixed key-value store.

The table is built from a fixed seed, so the dataset, the tool and the rewards agree without
sharing state. A model cannot answer from the question alone: it has to call `lookup` with the
key the question names and copy the value from the result.
"""

import random

KEYS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
]
VALUES = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "ocean",
    "ember",
    "frost",
    "lemon",
    "coral",
    "amber",
    "cedar",
    "plum",
    "raven",
    "sage",
    "willow",
    "copper",
    "dune",
    "harbor",
    "meadow",
    "pepper",
]
TABLE = dict(zip(KEYS, random.Random(1234).sample(VALUES, len(KEYS))))


def lookup(key: str) -> str:
    """Return the value stored under `key`."""
    if key not in TABLE:
        raise KeyError(f"unknown key {key!r}; known keys: {', '.join(KEYS)}")
    return TABLE[key]
