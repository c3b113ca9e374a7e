"""The multi-hop task's tool (tasks/toy_hops.py): a table of made-up keys, each naming the next one.

Two tables, one per variant, on disjoint keys: 96 chains of 3 keys and 96 chains of 4 keys. Each chain ends in one
of 8 colours, 12 chains per colour. Looking up a chain's key returns `"key" -> "next"`, and its last key returns
`"key" -> "COLOUR"`. A query that is no key raises (the model sees `Error: ...`). Every key is one made-up word of
four letters, which the task's tokenizer holds as one token.

The tables are built from a fixed seed, so the dataset, the tool and the rewards agree without sharing state.
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.chain_lookup import follow, record  # noqa: E402,F401  (tasks/toy_hops.py takes record from here)

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
COLOURS = ["red", "blue", "green", "gold", "pink", "grey", "teal", "plum"]  # a guess is right 1 time in 8
CHAINS_PER_VARIANT = 96
VARIANTS = (3, 4)  # hops per chain
_words = [a + b + c + d for a in CONSONANTS for b in VOWELS for c in CONSONANTS for d in VOWELS]
_order = random.Random(3404).sample(_words, CHAINS_PER_VARIANT * sum(VARIANTS))
CHAINS = {}  # hops -> list of chains (lists of keys)
for _hops in VARIANTS:
    CHAINS[_hops] = [_order[i : i + _hops] for i in range(0, CHAINS_PER_VARIANT * _hops, _hops)]
    _order = _order[CHAINS_PER_VARIANT * _hops :]
KEYS = [k for chains in CHAINS.values() for chain in chains for k in chain]
# Each colour ends 12 chains of a variant, so no colour is a better guess than another.
ANSWERS = {chain[0]: COLOURS[i % len(COLOURS)] for chains in CHAINS.values() for i, chain in enumerate(chains)}
NEXT = {chain[j]: chain[j + 1] for chains in CHAINS.values() for chain in chains for j in range(len(chain) - 1)}
END = {chain[-1]: ANSWERS[chain[0]] for chains in CHAINS.values() for chain in chains}


def hop_lookup(key: str) -> str:
    """Look a key up: returns the next key of its chain, or the chain's colour after its last key."""
    return follow(key, NEXT, END)
