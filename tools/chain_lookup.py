"""The multi-hop task's tool (tasks/toy_chain.py): a table of made-up keys, each naming the next one.

20 chains of 3 keys end in a colour: looking up a chain's first key returns `"first" -> "second"`,
the second returns `"second" -> "third"`, the third `"third" -> "COLOUR"`. A result names the key just
looked up and the next one, so copying the wrong one of the two (the first) looks the same key up
again. A query that is no key raises (the model sees `Error: ...`).

The table is built from a fixed seed, so the dataset, the tool and the rewards agree without sharing state.
"""

import random

HEADS = ["ba", "de", "fi", "go", "hu", "ja"]
TAILS = ["bi", "da", "fe", "ko", "la", "mu", "ne", "pi", "su", "to"]
KEYS = [a + b for a in HEADS for b in TAILS]  # 60 keys: "babi", "bada", ...
COLOURS = ["red", "blue", "green", "gold"]  # the small answer set: a guess is right 1 time in 4
HOPS = 3  # lookups per chain
_order = random.Random(2505).sample(KEYS, len(KEYS))
CHAINS = [_order[i : i + HOPS] for i in range(0, len(KEYS), HOPS)]  # 20 chains, no key in two of them
# Each colour ends 5 chains, so no colour is a better guess than another.
ANSWERS = {chain[0]: COLOURS[i % len(COLOURS)] for i, chain in enumerate(CHAINS)}
NEXT = {chain[j]: chain[j + 1] for chain in CHAINS for j in range(HOPS - 1)}
END = {chain[-1]: ANSWERS[chain[0]] for chain in CHAINS}


def record(key: str, following: str) -> str:
    """A result: the key looked up and what follows it, the next key or the colour."""
    return f'"{key}" -> "{following}"'


def follow(key: str, following: dict[str, str], colour: dict[str, str]) -> str:
    """The result of looking `key` up in a table: the next key of its chain, or the chain's colour after its last
    key (shared with tools/hop_lookup.py's tables)."""
    if key not in following and key not in colour:
        raise KeyError(f"no key {key!r}")
    return record(key, following.get(key) or colour[key])


def chain_lookup(key: str) -> str:
    """Look a key up: returns the next key of its chain, or the chain's colour after its last key."""
    return follow(key, NEXT, END)
