"""The multi-hop task: follow a chain of three lookups to a colour, or stop early and guess.

Built for credit over more than two turns (issue 25, item 5), the way tasks/toy_flags.py was built: the design
and the prediction below were written before any RL run.

Design:
- 20 chains of 3 made-up keys (tools/chain_lookup.py), each ending in one of 4 colours, 5 chains per colour.
  Looking a key up returns `"key" -> "next"`, and the last key of a chain returns `"key" -> "colour"`. A
  question names the start key, quoted. An episode is up to 3 lookups, then the answer (max_env_steps 3, the
  chain exactly).
- A guess sometimes pays: answering without the whole chain is right 1 time in 4. Three decisions come before
  the answer, one per lookup turn: look the next key up (and name the right one), or stop and guess.
- Held out: RL trains on 12 chains (3 per colour). `make_eval_dataset` holds the other 8 (2 per colour) in 3
  question forms, 24 prompts; only lookups beat a guess there.
- Rewards (rewards/toy_chain_reward.py). Outcome: exact match and format. Turn: `hop_reward`, per turn (1 for a
  lookup that took the chain one hop further); `first_hop_reward`, the episode-level turn reward of MT-GRPO's one
  split (the first lookup was the start key).
- `build_model`: tasks/toy_kv.py's tokenizer builder and 2-layer model, with a reported warm-start on all 20
  chains. First 275 steps (batch 16) on demonstrations that follow the whole chain, so the model can reproduce a
  key from the question or a result in the next query. Then 75 steps on a mix: at lookup turn k it looks the
  next key up with probability p_call[k] = 0.45, 0.45, 0.7, else it stops and guesses a random colour. Every
  demonstration writes the colour it answers in its reasoning first (`A guess:blue.`, `The chain ends at
  "red".`), so the <answer> tag always repeats the colour just before it. The build took 147 s (102 s of CPU,
  one thread) on the shared 2-core machine under other jobs' load; the keys are reproduced only after about 175-250
  steps of the first phase (a sudden change in the loss), which sets its length.

The warm-started policy (measured on the build alone, before any RL, with OMP_NUM_THREADS=1 as the bench runs):
- P(look up) at the first token of each lookup turn, after a right prefix: 0.43, 0.48, 0.58. So the greedy
  policy stops and guesses at the first two lookup turns and looks up at the third.
- It names the right key with probability 0.80, 0.85, 0.76 at the three hops (the argmax is right at every
  hop); the other calls name another key, which leads off the chain. After the last result it answers that
  colour with probability 0.98.
- Sampled (256 training episodes, temperature 1), per lookup turn reached, right / other key / stop:
  0.29 / 0.14 / 0.57, then 0.37 / 0.04 / 0.58, then 0.27 / 0.08 / 0.65. 4% of episodes take all three hops
  (9 of 10 of those answer right). Exact match 0.25 on training prompts, 0.23 on held-out prompts (sampled),
  0.25 greedy on held-out (it guesses at once).
- 8% of sampled episodes end malformed (no_action) and 4% run out of tokens (truncated): format has something
  to learn too.

Revised five times before any RL run, after checks of the build alone (teacher-forced probabilities and sampled
rollouts):
1. The first build had 24 chains, the last result unquoted (`-> red`), 200 steps at batch 32, and two
   demonstrated mistakes: stopping, and looking the key just looked up again (a loop). It took 576 s on the
   loaded shared machine and named the right first key in 2% of first lookups.
2. 250 steps on the always-right demonstrations at batch 16: the first key came right (p 0.63), but later keys
   did not (p 0.15): 45% demonstrated loops competed with naming the next key. Loops are no longer demonstrated;
   the wrong keys the policy names now come from its imperfect reproduction of the key.
3. The mix's random guesses erased the colour after the last result (p 0.95 after the first phase, 0.28 after
   the second; the quoted `"red"` in the result did not help). The answered colour is now written in the
   reasoning first, so <answer> repeats what just came before, in a guess too.
4. 20 chains instead of 24: fewer keys to reproduce, at 275 + 75 steps.
5. p_call 0.45 at every hop made 2% of episodes take all three hops. The last hop's 0.7 lets an outcome-only
   method see a whole chain in about 1 episode in 25, while the greedy policy still stops at the first two hops.
The warm-start reproduces the keys of the chains it was shown, whether by copying or by recalling the table;
it covers the held-out chains' keys as toy_flags covers every country. No demonstration answers a colour the
episode did not read in a result, so none ties a start key to its colour.

Prediction (before measuring). The outcome value of each decision at the warm start, from the sampled rates
above (an off-chain key is worth about a guess or less):
- after two right hops: look up (about 0.9) vs stop (0.25): a large gap;
- after one: about 0.42 vs 0.25;
- at the first turn: about 0.31 vs 0.25, and a call that names another key about 0.2, so calling at all is
  worth about 0.27: the outcome alone barely tells the first lookup from a guess.
So outcome-only credit learns back to front (the last hop first) and slowly. The greedy policy follows the
chain only once P(look up) passes 0.5 at both of the first two turns: greedy held-out exact match stays at 0.25
until then, and jumps toward 1 after.
- GRPO-OR: the first lookup gets no push at first and may fall, as toy_flags's call rate did. Expect held-out
  exact match near 0.25 after 30 steps on most seeds, the last hop learned first in the training metrics.
- MT-GRPO (one split, `first_hop_reward`): the first lookup rises within about 10 steps, as in toy_flags. The
  second lookup has only the outcome (about 0.42 vs 0.25 through the noise of the third hop and the answer):
  it passes 0.5 on some seeds within 30 steps. Held-out exact match between 0.25 and about 0.9 by seed, above
  GRPO-OR on most seeds.
- Per-turn rewards without branching (`hop_reward` per turn, plus the outcome): each lookup gets its own
  credit, so the first two hops pass 0.5 within about 10-15 steps; held-out exact match near 1 on most seeds.
  On this task more lookups are always better until the chain ends, so a per-turn baseline that favours longer
  episodes (the per-turn-index construction's bias) would help here rather than show.
- Branching after each tool result with sibling baselines: the decisions at hops 1 and 2 get advantages from
  siblings in the same state, free of the other hops' noise, so they learn at least as fast as with per-turn
  rewards. The first lookup has no tool result before it to branch at: it learns as its own turn's credit
  allows (as GRPO-OR with the outcome alone, as per-turn with `hop_reward`). Expect branching at or above
  MT-GRPO, and the clearest gap in per-hop accuracy at hops 1 and 2.
The risk: chains complete in about 4% of warm-start episodes (1 or 2 of 32 a step), so outcome-only methods
may not move the second hop past 0.5 in 30 steps on any seed; then MT-GRPO and GRPO-OR tie at 0.25 on the greedy
held-out eval, and their difference shows only in the training metrics (first-turn call rate, per-hop right
rate). And RL reinforces lucky guesses: on training chains a guess may come to recall a start key's colour, which
raises training exact match without tool use and does not carry to the held-out chains.

Run before the measurement, after the prediction above was written, only to check that the task trains (seed 0,
the recipe's settings, 5 steps each, OMP_NUM_THREADS=1; about 2 s a step on the shared machine), and not used to
change anything:
- `advantage_mode=grpo_outcome`: the first-turn call rate (`rollout/tool_rate_turn0`) went 0.34 -> 0.28; greedy
  held-out exact match 0.25 at step 5.
- `advantage_mode=mt_grpo` (`first_hop_reward`): the call rates at turns 0, 1, 2 went from 0.34, 0.16, 0.03 to
  0.81, 0.59, 0.44 at step 5, so the first turn's credit raised the same decision at the later turns too; 9% of
  episodes then called a fourth time (after the colour) and ended at max_env_steps unanswered, and training exact
  match fell to 0.06. Greedy held-out exact match 0.667 at step 5 (first lookup right on 0.875).
"""

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.toy_kv import build_tokenizer, warm_start  # noqa: E402
from tools.chain_lookup import ANSWERS, CHAINS, COLOURS, HOPS, chain_lookup, record  # noqa: E402

# The start key is quoted, as in the query and in a result: after a quote it is the same token in all three.
QUESTIONS = [
    'Follow the chain from "{k}" to its colour.',
    'Which colour does the chain from "{k}" end in?',
    'Start at "{k}" and find the colour.',
]
EVAL_CHAINS = sorted(
    c[0] for col in COLOURS for c in random.Random(25).sample([c for c in CHAINS if ANSWERS[c[0]] == col], 2)
)
TRAIN_CHAINS = [c[0] for c in CHAINS if c[0] not in EVAL_CHAINS]
CHAIN_OF = {c[0]: c for c in CHAINS}
WARMSTART = dict(
    demonstrations=1024,
    steps=350,
    lookup_only_steps=275,
    batch_size=16,
    lr=3e-3,
    seed=0,
    p_call=(0.45, 0.45, 0.7),  # per lookup turn
)


def row(start: str, question: str) -> dict:
    return {"prompt": question.format(k=start), "start": start, "chain": CHAIN_OF[start], "answer": ANSWERS[start]}


def make_dataset(n: int = 512, seed: int = 0):
    """Rows `{prompt, start, chain, answer}` about the 12 training chains."""
    rng = random.Random(seed)
    return [row(k, rng.choice(QUESTIONS)) for k in (rng.choice(TRAIN_CHAINS) for _ in range(n))]


def make_eval_dataset():
    """The 8 held-out chains, in every question form (24 prompts), for greedy evaluation."""
    return [row(k, q) for k in EVAL_CHAINS for q in QUESTIONS]


def tool_reply(key: str) -> str:
    """The tool's reply as the environment shows it (a raised error becomes `Error: Type: message`)."""
    try:
        return chain_lookup(key)
    except Exception as err:
        return f"Error: {type(err).__name__}: {err}"


def call(key: str) -> dict:
    query = json.dumps({"name": "chain_lookup", "args": {"key": key}})
    return {"role": "assistant", "content": f"<reasoning>Look it up.</reasoning>\n<tool>{query}</tool>"}


def answer(text: str, why: str) -> dict:
    return {"role": "assistant", "content": f"<reasoning>{why}</reasoning>\n<answer>{text}</answer>"}


def demonstration(row, system_prompt, rng, p_call=None):
    """A protocol-correct episode: at each lookup turn, with probability p_call look the chain's next key up (the
    start key, then the key the last result names), else stop and guess a random colour; after the last result,
    answer its colour."""
    p_call = WARMSTART["p_call"] if p_call is None else p_call
    p_call = p_call if isinstance(p_call, tuple) else (p_call,) * HOPS
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": row["prompt"]})
    steps = row["chain"] + [row["answer"]]
    for key, following, p in zip(steps, steps[1:], p_call):
        if rng.random() >= p:
            colour = rng.choice(COLOURS)
            return msgs + [answer(colour, f"A guess:{colour}.")]
        msgs += [call(key), {"role": "user", "content": f"<result>\n{record(key, following)}\n</result>"}]
    return msgs + [answer(row["answer"], f'The chain ends at "{row["answer"]}".')]


def build_model(path: str, system_prompt: str = ""):
    """Create tokenizer + tiny model under `path` (tasks/toy_kv.py's architecture), warm-started; returns a report."""
    t0 = time.time()
    rng = random.Random(WARMSTART["seed"])
    # Every chain, held-out ones too, so the model can reproduce any key; no demonstration answers a colour it did not
    # read in a result (a guess is random), so none ties a held-out start key to its colour.
    rng_rows = random.Random(WARMSTART["seed"] + 1)
    rows = [
        row(rng_rows.choice(list(CHAIN_OF)), rng_rows.choice(QUESTIONS)) for _ in range(WARMSTART["demonstrations"])
    ]
    mix = [demonstration(r, system_prompt, rng) for r in rows]
    right = [demonstration(r, system_prompt, rng, p_call=1.0) for r in rows]
    corpus = (
        [f"{m['role']}\n{m['content']}" for d in right[:256] + mix[:256] for m in d]
        + COLOURS
        + [q.format(k=c[0]) for c in CHAINS for q in QUESTIONS]
        + [tool_reply(k) for c in CHAINS for k in c]
        + [json.dumps({"key": k}) for c in CHAINS for k in c]
    )
    return warm_start(path, build_tokenizer(corpus), right, mix, WARMSTART, rng, "tasks/toy_chain.py", t0)
