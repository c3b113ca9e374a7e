"""The paper-effect task's tool: a registry of made-up countries' flag colours.

A query must name the right country in the right form, `"flag:NAME"`. A query in any other form, or
naming no known country, raises (the model sees `Error: ...`); a query naming another known country
returns that country's record, which does not hold the answer.
"""

import random

SYLLABLES = ["ka", "lo", "mi", "nu", "pe", "ri", "so", "tu"]
NAMES = [a + b for a in SYLLABLES for b in SYLLABLES[:4]]  # 32 countries: "kaka", "kalo", ...
COLOURS = ["red", "blue", "green", "gold"]  # the small answer set: a guess is right 1 time in 4
# Each colour flies over 8 countries, so no colour is a better guess than another.
FLAGS = {n: COLOURS[i % len(COLOURS)] for i, n in enumerate(random.Random(4321).sample(NAMES, len(NAMES)))}
PREFIX = "flag:"


def flag_registry(query: str) -> str:
    """Return the record of one country's flag; `query` must read "flag:NAME"."""
    if not query.startswith(PREFIX):
        raise ValueError(f'a query reads "{PREFIX}NAME", got {query!r}')
    name = query[len(PREFIX) :]
    if name not in FLAGS:
        raise KeyError(f"no country named {name!r}")
    return f"{name}: {FLAGS[name]}"
