"""The paper-effect task: guess a flag's colour, or look it up with a tool that is easy to call wrong.

Built from the mechanism behind the MT-GRPO paper's TriviaQA table (Zeng et al. 2025), where
outcome-only GRPO stops calling its search tool and the turn-level split keeps it.

Design (written before any measurement):
- A question asks the flag colour of one of 32 made-up countries (tools/flag_registry.py). The
  answer set is small (red, blue, green, gold), so answering at once, without the tool, earns the
  outcome reward one time in four, as a model sometimes knows a TriviaQA answer.
- The tool is easy to get wrong: the query must read `flag:NAME`. A query in another form or naming
  no known country comes back as `Error: ...`, and the warm-started policy then answers "unknown",
  so a wrong call loses the outcome.
- Turn rewards score the tool turn itself, as the paper's do: the call executed without error, and
  its result holds the answer. Outcome rewards: exact match and format. Those four are the paper's
  table columns, and the greedy eval reports each.
- Each colour is the answer for 8 countries. Train prompts name 24 of them; `make_eval_dataset`
  holds out the other 8, 2 per colour (3 question forms each), so neither an answer remembered from
  training nor the warm-start helps on eval: only a right call beats a guess there.
- `build_model` builds the tokenizer and 2-layer model with tasks/toy_kv.py's builder, and a
  reported warm-start on all 32 countries: 400 steps on demonstrations that always call right (so the
  model can copy the country into a well-formed query and the record into its answer), then 100 steps on a mix
  where half the demonstrations call the tool, only a fifth of those in the right form (the rest
  pass the bare name, get an error and answer "unknown"), and the other half guess a random colour.
  When to call, and how, is left to RL.

Revised twice before the measurement (an aborted first bench had run 10 MT-GRPO steps on seed 0: its
calls executed but named the wrong country), after checks of the build alone: with 64 countries, the name
unquoted in the question and the warm-start on the 48 training countries only, a forced "flag:" prefix
was followed by the right name for 9 of 48 training prompts and 0 of 48 held-out ones (" kalo" in a
question and "kalo" in a query are different tokens, and a held-out name's token was never trained).
Quoting the name and warm-starting on all 64 countries gave 2/48 and 0/48: 200 steps did not build the
copy for 64 names (the toy's 16 keys get 400 demonstrations each in those steps). So: 32 countries,
quoted, all in the warm-start, and 400 always-right steps (each name again about 400 demonstrations).

Prediction (before measuring): the warm-started policy calls about half the time, a call is right
about 1 time in 5, so a call earns an exact match about 0.2 of the time and a guess 0.25. Under
GRPO-OR the call decision's mean advantage is proportional to (1 - p)(c - 0.25) < 0 (p: call rate,
c: right-call rate), so its tool-call rate (rollout/tool_rate_turn0) falls and it settles on guessing,
exact match near 0.25 on the held-out eval. MT-GRPO adds a turn advantage proportional to
(1 - p) c > 0 on the tokens up to the tool result, which outweighs it, so its tool-call rate and its
right-form rate rise and its held-out exact match ends well above GRPO-OR's (the goal: on at least
4 of 5 seeds). GRPO-MR's merged reward also favours a right call, so it keeps the tool too, but its
signal reaches the call and the answer alike. The risk to this prediction: GRPO-OR's right calls
still get a positive advantage, so if it learns the query form before its call rate collapses it
recovers, and the gap closes.
"""

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.toy_kv import build_tokenizer, warm_start  # noqa: E402
from tools.flag_registry import COLOURS, FLAGS, NAMES, PREFIX, flag_registry  # noqa: E402

# The name is quoted, as the toy's key is: after a quote it is the same token as in the query after "flag:".
QUESTIONS = [
    'What colour is the flag of "{n}"?',
    'Name the colour of the flag of "{n}".',
    'Which colour is the flag of "{n}"?',
]
EVAL_NAMES = sorted(c for col in COLOURS for c in random.Random(15).sample([n for n in NAMES if FLAGS[n] == col], 2))
TRAIN_NAMES = [n for n in NAMES if n not in EVAL_NAMES]
WARMSTART = dict(
    demonstrations=2048, steps=500, lookup_only_steps=400, batch_size=32, lr=3e-3, seed=0, p_tool=0.5, p_right_form=0.2
)


def row(country: str, question: str) -> dict:
    return {"prompt": question.format(n=country), "name": country, "answer": FLAGS[country]}


def make_dataset(n: int = 512, seed: int = 0):
    """Rows `{prompt, name, answer}` about the 24 training countries."""
    rng = random.Random(seed)
    return [row(c, rng.choice(QUESTIONS)) for c in (rng.choice(TRAIN_NAMES) for _ in range(n))]


def make_eval_dataset():
    """The 8 held-out countries, in every question form (24 prompts), for greedy evaluation."""
    return [row(c, q) for c in EVAL_NAMES for q in QUESTIONS]


def tool_reply(query: str) -> str:
    """The registry's reply as the environment shows it (a raised error becomes `Error: Type: message`)."""
    try:
        return flag_registry(query)
    except Exception as err:
        return f"Error: {type(err).__name__}: {err}"


def demonstration(row, system_prompt, rng, p_tool=None, p_right_form=None):
    """A protocol-correct episode: with probability p_tool a call (in the right form with probability
    p_right_form, else the bare name), then an answer from the record or "unknown" after an error; otherwise
    an immediate guess of a random colour."""
    p_tool = WARMSTART["p_tool"] if p_tool is None else p_tool
    p_right = WARMSTART["p_right_form"] if p_right_form is None else p_right_form
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": row["prompt"]})
    if rng.random() >= p_tool:
        return msgs + [
            {
                "role": "assistant",
                "content": f"<reasoning>Let me think.</reasoning>\n<answer>{rng.choice(COLOURS)}</answer>",
            }
        ]
    query = (PREFIX if rng.random() < p_right else "") + row["name"]
    reply = tool_reply(query)
    answer = row["answer"] if reply == f"{row['name']}: {row['answer']}" else "unknown"
    call = json.dumps({"name": "flag_registry", "args": {"query": query}})
    return msgs + [
        {"role": "assistant", "content": f"<reasoning>Let me think.</reasoning>\n<tool>{call}</tool>"},
        {"role": "user", "content": f"<result>\n{reply}\n</result>"},
        {"role": "assistant", "content": f"<reasoning>The result settles it.</reasoning>\n<answer>{answer}</answer>"},
    ]


def build_model(path: str, system_prompt: str = ""):
    """Create tokenizer + tiny model under `path` (tasks/toy_kv.py's architecture), warm-started; returns a report."""
    t0 = time.time()
    rng = random.Random(WARMSTART["seed"])
    # Every country, held-out ones too, so the model can copy any name into a query; no demonstration
    # states a colour except as a tool result, so none teaches a held-out answer.
    rng_rows = random.Random(WARMSTART["seed"] + 1)
    rows = [row(rng_rows.choice(NAMES), rng_rows.choice(QUESTIONS)) for _ in range(WARMSTART["demonstrations"])]
    mix = [demonstration(r, system_prompt, rng) for r in rows]
    right = [demonstration(r, system_prompt, rng, p_tool=1.0, p_right_form=1.0) for r in rows]
    # Every country name and query form enters the tokenizer's corpus (no colours with them), so a held-out
    # country splits into tokens the way a training one does.
    corpus = (
        [f"{m['role']}\n{m['content']}" for d in mix[:512] for m in d]
        + COLOURS
        + [q.format(n=c) for c in NAMES for q in QUESTIONS]
        + [json.dumps({"query": PREFIX + c}) for c in NAMES]
    )
    return warm_start(path, build_tokenizer(corpus), right, mix, WARMSTART, rng, "tasks/toy_flags.py", t0)
