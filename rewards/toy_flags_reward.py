"""Rewards of the paper-effect task (tasks/toy_flags.py), one per column of the paper's results table.

Turn level, scoring the tool turn itself as the paper's turn rewards do: `tool_execution_reward` (a
tool ran without error) and `answer_in_result_reward` (its result holds the answer). Outcome level:
`exact_answer_reward` (rewards/toy_kv_reward.py, the final answer equals the gold colour) and
`format_reward` (every assistant turn follows the XML protocol).
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.toy_kv_reward import exact_answer_reward, first_result  # noqa: E402,F401  (the recipe names it from here)

TURN = re.compile(r"<reasoning>.*?</reasoning>\s*(<tool>.*?</tool>|<answer>.*?</answer>)", re.S)


def tool_execution_reward(completions, **_):
    """Turn level: 1.0 if the episode called a tool and its first result is not an error."""
    return [1.0 if (r := first_result(c)) is not None and not r.startswith("Error:") else 0.0 for c in completions]


def answer_in_result_reward(completions, name, answer, **_):
    """Turn level: 1.0 if the first tool result is the asked country's record, so it holds the gold colour."""
    return [1.0 if first_result(c) == f"{n}: {a}" else 0.0 for c, n, a in zip(completions, name, answer)]


def format_reward(completions, **_):
    """Outcome level: 1.0 if every assistant turn is <reasoning> then one <tool> or <answer>, and the last answers."""

    def ok(msgs):
        turns = [m["content"].strip() for m in msgs if m["role"] == "assistant"]
        return bool(turns) and all(TURN.fullmatch(t) for t in turns) and "<answer>" in turns[-1]

    return [1.0 if ok(c) else 0.0 for c in completions]
