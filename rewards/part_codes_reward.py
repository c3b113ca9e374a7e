"""Rewards of the parts-catalogue task (tasks/part_codes.py), beside the key-value task's two it shares.

`copied_result_reward` is a diagnostic, given weight 0 in the recipe: it separates a model that cannot copy (it looked
a part up and answered something else) from one that has not learned to look the right part up.
"""

from rewards.toy_kv_reward import final_answer, first_result


def copied_result_reward(completions, **_):
    """Outcome level: 1.0 if the final <answer> equals the first tool result, whichever part was looked up."""
    out = []
    for c in completions:
        result = first_result(c)
        out.append(1.0 if result is not None and final_answer(c) == result.strip() else 0.0)
    return out
