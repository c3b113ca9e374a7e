"""The parts-catalogue task for a real pretrained model: look a part's code up with a tool, then answer with it.

    dataset: tasks/part_codes.py:train_rows
    eval_dataset: tasks/part_codes.py:eval_rows
    tools: [tools/part_codes.py:lookup]

Each prompt is a question after two worked examples, given as earlier turns of the conversation (question, <tool>
call, <result>, <answer>): a 135M instruct model ignores a protocol described only in the system prompt
(tasks/triviaqa_sample.py). The examples are part of the prompt, so no reward sees them. They ask in the tool's own
form ("What is the code of part P-1234?"); the rows ask in one of five others ("Code for item 1234?", "I need the
code of part p1234.", ...), chosen by the part, so a model must write the part number as the tool wants it.

The 9,000 parts are shuffled once with a fixed seed and split: the first 2 are the worked examples, the next 128 the
held-out rows (`eval_rows`), the rest the training rows (`train_rows`). No part is in two splits, so a held-out
answer is right only if the model called the tool with the part it was asked about and copied the code back.
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.part_codes import CODES, PARTS  # noqa: E402

EXAMPLES = 2
HELD_OUT = 128
ORDER = random.Random(7).sample(PARTS, len(PARTS))


PHRASINGS = [  # a held-out or training question: one of these, chosen by the part (the worked examples: the first)
    "What is the code of part {part}?",
    "What is the code of part number {n}?",
    "Code for item {n}?",
    "I need the code of part p{n}.",
    "Which code does part {n} have?",
    "What's the code for P{n}?",
]


def question(part: str, phrasing: int = 0) -> str:
    return PHRASINGS[phrasing].format(part=part, n=part.removeprefix("P-"))


def call(part: str) -> str:
    return f"<tool>{json.dumps({'name': 'lookup', 'args': {'part': part}})}</tool>"


def fewshot_messages() -> list[dict]:
    """The worked examples, as conversation turns in the XML protocol (results as the environment formats them)."""
    msgs = []
    for part in ORDER[:EXAMPLES]:
        msgs += [
            {"role": "user", "content": question(part)},
            {"role": "assistant", "content": call(part)},
            {"role": "user", "content": f"<result>\n{CODES[part]}\n</result>"},
            {"role": "assistant", "content": f"<answer>{CODES[part]}</answer>"},
        ]
    return msgs


def row(part: str) -> dict:
    phrasing = random.Random(part).randrange(1, len(PHRASINGS))
    ask = question(part, phrasing)
    return {
        "prompt": fewshot_messages() + [{"role": "user", "content": ask}],
        "answer": CODES[part],
        "phrasing": phrasing,
    }


def eval_rows() -> list[dict]:
    """The 128 held-out questions, about parts no training row names."""
    return [row(p) for p in ORDER[EXAMPLES : EXAMPLES + HELD_OUT]]


def train_rows() -> list[dict]:
    """The 8,870 training questions."""
    return [row(p) for p in ORDER[EXAMPLES + HELD_OUT :]]
