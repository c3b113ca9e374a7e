"""Rewards of the multi-hop task (tasks/toy_chain.py). Dataset columns: `chain` (the chain's 3 keys), `answer`.

A reward function returns one entry per episode. An entry is a number (an episode-level reward), or, for a
per-turn reward function, a list of numbers, one per assistant message of the episode's completion: an
assistant message's tool results are the messages after it, up to the next assistant message.

Turn level:
- `hop_reward` (per turn): 1.0 for each lookup turn whose result is the record of the chain's next key, the
  one the previous right lookup named (the start key first). So a turn that takes the chain one hop further
  earns 1.0; looking the last key up again, a key of another chain, no key, or answering earns 0.
- `first_hop_reward` (episode level, the turn reward of MT-GRPO's one split): 1.0 if the first tool result is
  the start key's record. MT-GRPO credits it to the turns before the first tool result.
Outcome level: `exact_answer_reward` (rewards/toy_kv_reward.py: the final answer equals the gold colour) and
`format_reward` (rewards/toy_flags_reward.py: every assistant turn follows the XML protocol, the last answers).
Diagnostic: `hops_reward` (episode level), the number of hops taken in order, 0 to 3: the sum of `hop_reward`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.toy_flags_reward import format_reward  # noqa: E402,F401  (the recipe names it from here)
from rewards.toy_kv_reward import RESULT, exact_answer_reward, first_result  # noqa: E402,F401
from tools.chain_lookup import chain_lookup  # noqa: E402


def turn_results(messages):
    """Per assistant message of an episode, the text of the tool results that follow it (before the next one)."""
    turns = []
    for m in messages:
        if m["role"] == "assistant":
            turns.append([])
        elif turns and (hit := RESULT.search(m["content"])):
            turns[-1].append(hit.group(1))
    return turns


def hops(messages, chain, lookup=chain_lookup) -> list[float]:
    """1.0 for each assistant message whose lookup took the chain one hop further, else 0.0 (`lookup` gives a key's
    record: the tool of the task; a result that starts with it counts, as tools/hop_lookup_noisy.py's do)."""
    out = []
    depth = 0
    for results in turn_results(messages):
        ahead = depth < len(chain) and any(r.startswith(lookup(chain[depth])) for r in results)
        depth += ahead
        out.append(1.0 if ahead else 0.0)
    return out


def hop_reward(completions, chain, **_):
    """Per turn: 1.0 on each turn whose lookup result is the record of the chain's next key, else 0.0."""
    return [hops(c, k) for c, k in zip(completions, chain)]


def first_hop_reward(completions, chain, **_):
    """Episode level: 1.0 if the first tool result is the start key's record (the first hop was taken)."""
    return [1.0 if first_result(c) == chain_lookup(k[0]) else 0.0 for c, k in zip(completions, chain)]


def hops_reward(completions, chain, **_):
    """Episode level (a diagnostic): how many hops of the chain the episode took in order, 0 to 3."""
    return [sum(hops(c, k)) for c, k in zip(completions, chain)]
