"""The multi-hop task's tool with noise in its results (bench/credit_at_equal_tokens.py's `--noisy` variant): the same
tables as tools/hop_lookup.py, each result followed by a space and 1 to 16 dots, drawn at random per call. Two
episodes that made the same calls then rarely hold the same token ids after a result (1 in 16 per result), so exact
state matches become rare while the task stays the same: the rewards find a hop's record inside the result.

The noise is drawn from one generator under a lock, in the order the calls run; the trainer runs a turn's tool calls
in threads, so the draws are not reproducible run to run (everything else of a run is seeded).
"""

import os
import random
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.hop_lookup import hop_lookup as exact_lookup  # noqa: E402

NOISE = random.Random(4848)
LOCK = threading.Lock()


def hop_lookup(key: str) -> str:
    """Look a key up: returns the next key of its chain, or the chain's colour after its last key."""
    result = exact_lookup(key)
    with LOCK:
        dots = NOISE.randint(1, 16)
    return f"{result} {'.' * dots}"
