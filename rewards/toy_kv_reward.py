"""Rewards of the embedded key-value task.

A reward function is `fn(completions, **dataset_columns) -> list[float]`: `completions[i]` is
episode i's generated messages (assistant turns and environment replies, after the prompt), and
each dataset column arrives as a list aligned with `completions`.
"""

import re

RESULT = re.compile(r"<result>\s*(.*?)\s*</result>", re.S)
ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)


def first_result(messages):
    """Text of the first tool result in an episode, or None."""
    for m in messages:
        if m["role"] != "assistant" and (hit := RESULT.search(m["content"])):
            return hit.group(1)
    return None


def final_answer(messages):
    """Text inside the last assistant message's <answer> tag, or None."""
    last = [m for m in messages if m["role"] == "assistant"][-1:]
    hit = ANSWER.search(last[0]["content"]) if last else None
    return hit.group(1) if hit else None


def lookup_hit_reward(completions, answer, **_):
    """Turn level: 1.0 if the first tool result holds the gold value (the right key was looked up)."""
    return [1.0 if (r := first_result(c)) is not None and r.strip() == a else 0.0 for c, a in zip(completions, answer)]


def exact_answer_reward(completions, answer, **_):
    """Outcome level: 1.0 if the final <answer> equals the gold value."""
    return [1.0 if final_answer(c) == a else 0.0 for c, a in zip(completions, answer)]
