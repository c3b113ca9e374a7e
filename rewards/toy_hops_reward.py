"""Rewards of the multi-hop task where credit decides (tasks/toy_hops.py). Dataset columns: `chain` (its keys),
`answer`.

A reward function returns one entry per episode: a number, or, for a per-turn function, a list with one number per
assistant message of the episode's completion (a message's tool results are the messages after it, up to the next
assistant message).

Turn level:
- `hop_reward` (per turn): 1.0 for each lookup turn whose result is the record of the chain's next key (the start
  key first, then the key the last right result named). A stray call (another chain's key, a key looked up again,
  no key) earns 0 and does not move the chain on; the next right lookup still counts.
- `first_hop_reward` (episode level, the turn reward of MT-GRPO's one split): 1.0 if the first tool result is the
  start key's record (or starts with it: tools/hop_lookup_noisy.py's results add noise after it).
Outcome: `exact_answer_reward` (the final answer equals the gold colour; the recipe's only weighted outcome).
Diagnostics, logged with weight 0: `format_reward` (every assistant turn follows the XML protocol), `hops_reward`
(hops taken in order), `chain_completed_reward` (every hop taken and the right colour: a guess cannot earn it).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.toy_chain_reward import hops as chain_hops  # noqa: E402
from rewards.toy_flags_reward import format_reward  # noqa: E402,F401  (the recipe names it from here)
from rewards.toy_kv_reward import exact_answer_reward, first_result  # noqa: E402,F401
from tools.hop_lookup import hop_lookup  # noqa: E402


def hops(messages, chain) -> list[float]:
    """1.0 for each assistant message whose lookup took the chain one hop further, else 0.0."""
    return chain_hops(messages, chain, lookup=hop_lookup)


def hop_reward(completions, chain, **_):
    """Per turn: 1.0 on each turn whose lookup result is the record of the chain's next key, else 0.0."""
    return [hops(c, k) for c, k in zip(completions, chain)]


def first_hop_reward(completions, chain, **_):
    """Episode level: 1.0 if the first tool result is the start key's record (the first hop was taken)."""
    return [1.0 if (first_result(c) or "").startswith(hop_lookup(k[0])) else 0.0 for c, k in zip(completions, chain)]


def hops_reward(completions, chain, **_):
    """Episode level (a diagnostic): how many hops of the chain the episode took in order."""
    return [sum(hops(c, k)) for c, k in zip(completions, chain)]


def chain_completed_reward(completions, chain, answer, **_):
    """Episode level (the primary metric): 1.0 if the episode took every hop in order and answered the right colour."""
    took_all = [sum(hops(c, k)) == len(k) for c, k in zip(completions, chain)]
    right = exact_answer_reward(completions, answer)
    return [1.0 if t and r == 1.0 else 0.0 for t, r in zip(took_all, right)]
