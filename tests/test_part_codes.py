"""The parts-catalogue task of bench/real_model.py (tasks/part_codes.py): a held-out answer needs the tool."""

import pytest

from rewards.part_codes_reward import copied_result_reward
from rewards.toy_kv_reward import exact_answer_reward, lookup_hit_reward
from tasks import part_codes as T
from tools.part_codes import CODES, lookup


def asked(row: dict) -> str:
    return row["prompt"][-1]["content"]


def test_no_part_is_in_two_splits_and_no_question_names_a_part_as_the_tool_takes_it():
    examples = set(T.ORDER[: T.EXAMPLES])
    held_out = [r["answer"] for r in T.eval_rows()]
    trained = [r["answer"] for r in T.train_rows()]
    assert len(held_out) == 128 and len(trained) + len(held_out) + len(examples) == len(CODES)
    assert not set(held_out) & set(trained) and not {CODES[p] for p in examples} & set(held_out + trained)
    rows = T.eval_rows() + T.train_rows()
    assert all("P-" not in asked(r) for r in rows), "the worked examples alone show the tool's form"
    assert {r["phrasing"] for r in rows} == set(range(1, len(T.PHRASINGS)))
    assert all(r["prompt"][:-1] == T.fewshot_messages() for r in rows[:50])


def test_the_tool_takes_only_its_own_form_and_says_which_it_is():
    part = T.ORDER[T.EXAMPLES]
    assert lookup(part) == CODES[part] and len(CODES[part]) == 6
    with pytest.raises(KeyError, match="part numbers run from P-1000 to P-9999"):
        lookup(part.removeprefix("P-"))


def test_copying_the_result_is_told_apart_from_looking_the_right_part_up():
    row = T.eval_rows()[0]
    other = T.ORDER[-1]

    def episode(part: str, answer: str) -> list[dict]:
        return [
            {"role": "assistant", "content": T.call(part)},
            {"role": "user", "content": f"<result>\n{CODES[part]}\n</result>"},
            {"role": "assistant", "content": f"<answer>{answer}</answer>"},
        ]

    right = episode(T.ORDER[T.EXAMPLES], row["answer"])
    wrong_part = episode(other, CODES[other])
    miscopied = episode(T.ORDER[T.EXAMPLES], "123456")
    guessed = [{"role": "assistant", "content": f"<answer>{row['answer']}</answer>"}]
    completions = [right, wrong_part, miscopied, guessed]
    answers = [row["answer"]] * 4
    assert exact_answer_reward(completions, answers) == [1.0, 0.0, 0.0, 1.0]
    assert lookup_hit_reward(completions, answers) == [1.0, 0.0, 1.0, 0.0]
    assert copied_result_reward(completions) == [1.0, 1.0, 0.0, 0.0]
