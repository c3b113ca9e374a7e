"""The multi-hop task where credit decides: follow a chain of 3 (or 4) lookups to one of 8 colours, or stop and guess.

Built for issue 34, beside tasks/toy_chain.py rather than in its place: toy_chain's measured results
(docs/turn-credit.md) and the server branching bench stay reproducible, and what had to change (the chain count, the
key form, the answer set, the turn budget, the outcome) changes nearly every line of it. The design and the
prediction below were written before any training run on this task.

Why toy_chain could not rank the credit modes, and what is different here:
- **Memory.** toy_chain trains on 12 chains: a start key could be mapped straight to its colour, and outcome-only
  credit took that shortcut. Here RL trains on 64 chains and evaluates on 32 others (disjoint, `TRAIN_CHAINS`,
  `EVAL_CHAINS`), and the primary metric needs the lookups: memory cannot reach it.
- **Luck.** toy_chain's 4 colours made about 94% of exact match's variance a guess's. Here 8 colours (a guess pays
  1 time in 8), and the primary metric is the held-out *chain-completion rate*: the share of episodes that took every
  hop in order and answered the right colour. A guess cannot complete a chain.
- **Format inside the outcome.** The outcome is exact match alone (`outcome_reward_weights: [1, 0]`); format and the
  hop count are logged beside it as diagnostics with weight 0.
- **The turn budget.** `max_env_steps` is hops + 2: a stray call (an off-chain key, a key looked up again) leaves
  room to get back on the chain and still answer. toy_chain's budget was the chain exactly, so one extra lookup cost
  the answer.
- **Keys.** Every key is a made-up four-letter word (tools/hop_lookup.py) that the tokenizer holds as one token
  (`build_tokenizer`): naming the next key is copying one token from the last result, not spelling it.

Design:
- 96 chains per variant (3 hops, and 4 for the longer variant), 12 per colour; 64 train (8 per colour) and 32 held
  out (4 per colour). A question names the start key, quoted. Training draws any of 4 question forms; the eval set
  is each held-out chain in 2 of them: 64 prompts, each sampled twice at temperature 1 (128 episodes).
- Per lookup turn the policy decides: look the next key up (and name the right one), or stop and guess.
- Rewards (rewards/toy_hops_reward.py). Outcome: `exact_answer_reward` (weight 1), `format_reward` (weight 0).
  Turn: `hop_reward` per turn (1 for a lookup that took the chain one hop further), or `first_hop_reward` (episode
  level: MT-GRPO's one split). Diagnostics: `hops_reward` (hops taken in order), `chain_completed_reward` (every hop
  taken and the right colour: the primary metric).
- `build_model`: tasks/toy_kv.py's 2-layer model and warm-start, on all 96 chains of the variant (held out too, so
  the model can copy any key; no demonstration answers a colour it did not read in a result, so none ties a start
  key to its colour). First `lookup_only_steps` on demonstrations that follow the whole chain, then a mix where at
  lookup turn k the demonstration looks the next key up with probability p_call, else stops and guesses a random
  colour; after the last result it answers that colour, written first in its reasoning.

Revised once, after a check of the build alone and before any training result was used: the first build (275 + 75
steps, 444 s on the loaded shared machine) gave the right key only 0.09, 0.06, 0.08 of the probability at the three
hops (teacher-forced, after a right prefix; P(look up) 0.47, 0.45, 0.45), so its sampled held-out episodes took the
first hop in 5 of 128 and completed no chain (greedy: 0.23). Each key is a rare token (one of 288), and copying it
was not yet learned: the first phase is now 800 steps, the mix 100. (This was seen in the timing pilot's step-0
eval, seed 900; the pilot was stopped after 3 training steps, whose numbers were not used.)

Prediction (written before any training run; the warm start's measured per-hop rates go in docs/turn-credit.md):
- The issue's tabular model of this decision process gives gradient signal-to-noise per step at the warm start of
  about 0.7 (GRPO-OR), 3.9 (MT-GRPO), 6.1 (per-turn rewards), 3.6 (tree, b 2), and more hops widen the gaps.
- So the held-out chain-completion rate rises fastest with per-turn rewards (`reward_to_go` with `hop_reward`):
  every lookup gets its own credit. MT-GRPO (`first_hop_reward`) raises the first lookup quickly, and the later ones
  only as the outcome (now rarer to earn by luck) allows: below per-turn. GRPO-OR has the outcome only: a completed
  chain is its signal, a lucky guess (1 in 8) its noise; it learns last, and its first-turn call rate may fall.
- Branching (`tree`, b 2 after the first two tool results) gives hops 2 and 3 baselines from the same state: at or
  above MT-GRPO, and near per-turn rewards (the tabular model puts it slightly below per-turn per token).
- With 4 hops the same order, with wider gaps.
The risk: the budget (bench/turn_credit.py's docstring) is short, so if no method moves the completion rate, the
methods tie near the warm start's rate and the bench says so.
"""

import functools
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.toy_kv import build_tokenizer as bpe_tokenizer, warm_start  # noqa: E402
from tools.hop_lookup import ANSWERS, CHAINS, COLOURS, hop_lookup, record  # noqa: E402

# The start key is quoted, as in the query and in a result: a key is one token wherever it appears.
QUESTIONS = [
    'Follow the chain from "{k}" to its colour.',
    'Which colour does the chain from "{k}" end in?',
    'Start at "{k}" and find the colour.',
    'Where does "{k}" lead? Name the colour.',
]
EVAL_QUESTIONS = QUESTIONS[:2]
EVAL_PER_COLOUR = 4
WARMSTART = dict(
    demonstrations=2048,
    steps=900,
    lookup_only_steps=800,
    batch_size=16,
    lr=3e-3,
    seed=0,
    p_call=0.55,  # per lookup turn
)


def split(hops: int) -> tuple[list[str], list[str]]:
    """The start keys of the training and the held-out chains of a variant: the first EVAL_PER_COLOUR chains of each
    colour are held out."""
    held_out = []
    for colour in COLOURS:
        held_out += [c[0] for c in CHAINS[hops] if ANSWERS[c[0]] == colour][:EVAL_PER_COLOUR]
    train = [c[0] for c in CHAINS[hops] if c[0] not in held_out]
    return train, sorted(held_out)


TRAIN_CHAINS, EVAL_CHAINS = split(3)
CHAIN_OF = {c[0]: c for chains in CHAINS.values() for c in chains}


def row(start: str, question: str) -> dict:
    return {"prompt": question.format(k=start), "start": start, "chain": CHAIN_OF[start], "answer": ANSWERS[start]}


def make_dataset(n: int = 2048, seed: int = 0, hops: int = 3):
    """Rows `{prompt, start, chain, answer}` about the variant's 64 training chains."""
    rng = random.Random(seed)
    train = split(hops)[0]
    return [row(rng.choice(train), rng.choice(QUESTIONS)) for _ in range(n)]


def make_eval_dataset(hops: int = 3):
    """The variant's 32 held-out chains, each in 2 question forms: 64 prompts."""
    return [row(k, q) for k in split(hops)[1] for q in EVAL_QUESTIONS]


def tool_reply(key: str) -> str:
    """The tool's reply as the environment shows it (a raised error becomes `Error: Type: message`)."""
    try:
        return hop_lookup(key)
    except Exception as err:
        return f"Error: {type(err).__name__}: {err}"


def call(key: str) -> dict:
    query = json.dumps({"name": "hop_lookup", "args": {"key": key}})
    return {"role": "assistant", "content": f"<reasoning>Look it up.</reasoning>\n<tool>{query}</tool>"}


def answer(text: str, why: str) -> dict:
    return {"role": "assistant", "content": f"<reasoning>{why}</reasoning>\n<answer>{text}</answer>"}


def demonstration(row, system_prompt, rng, p_call, noisy=False):
    """A protocol-correct episode: at each lookup turn, with probability p_call look the chain's next key up (the
    start key, then the key the last result names), else stop and guess a random colour; after the last result,
    answer its colour. `noisy`: each result ends as tools/hop_lookup_noisy.py's do (a space and 1 to 16 dots)."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": row["prompt"]})
    steps = row["chain"] + [row["answer"]]
    for key, following in zip(steps, steps[1:]):
        if rng.random() >= p_call:
            colour = rng.choice(COLOURS)
            return msgs + [answer(colour, f"A guess: {colour}.")]
        result = record(key, following)
        if noisy:
            result += " " + "." * rng.randint(1, 16)
        msgs += [call(key), {"role": "user", "content": f"<result>\n{result}\n</result>"}]
    return msgs + [answer(row["answer"], f'The chain ends at "{row["answer"]}".')]


def build_tokenizer(corpus, keys):
    """tasks/toy_kv.py's byte-level BPE, with every key added as one whole-word token."""
    from tokenizers import AddedToken

    tok = bpe_tokenizer(corpus)
    tok.add_tokens([AddedToken(k, single_word=True) for k in keys])
    return tok


def build_model(path: str, system_prompt: str = "", hops: int = 3, noisy: bool = False):
    """Create tokenizer + tiny model under `path` (tasks/toy_kv.py's architecture), warm-started on the variant's
    96 chains (`noisy`: with tools/hop_lookup_noisy.py's results); returns a report."""
    t0 = time.time()
    rng = random.Random(WARMSTART["seed"])
    starts = [c[0] for c in CHAINS[hops]]
    rng_rows = random.Random(WARMSTART["seed"] + 1)
    rows = [row(rng_rows.choice(starts), rng_rows.choice(QUESTIONS)) for _ in range(WARMSTART["demonstrations"])]
    mix = [demonstration(r, system_prompt, rng, WARMSTART["p_call"], noisy) for r in rows]
    right = [demonstration(r, system_prompt, rng, 1.0, noisy) for r in rows]
    keys = [k for c in CHAINS[hops] for k in c]
    corpus = [f"{m['role']}\n{m['content']}" for d in right[:256] + mix[:256] for m in d] + COLOURS
    tok = build_tokenizer(corpus, keys)
    settings = {**WARMSTART, "hops": hops, "noisy": noisy}
    return warm_start(path, tok, right, mix, settings, rng, "tasks/toy_hops.py", t0)


# The longer variant, for recipes: dataset: tasks/toy_hops.py:make_dataset_4hops, and so on.
make_dataset_4hops = functools.partial(make_dataset, hops=4)
make_eval_dataset_4hops = functools.partial(make_eval_dataset, hops=4)
build_model_4hops = functools.partial(build_model, hops=4)
build_model_4hops_noisy = functools.partial(build_model, hops=4, noisy=True)  # bench/credit_at_equal_tokens.py --noisy


def warm_start_rates(path: str, hops: int = 3, n: int = 32) -> dict:
    """Teacher-forced, on the first `n` held-out prompts after a right prefix: per hop, P(look up) (the first token
    of the reasoning is `Look`, not a guess's) and P(the right key) once the query reaches the key."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    look = tok.encode("Look", add_special_tokens=False)[0]
    rates = {"p_look_up": [[] for _ in range(hops)], "p_right_key": [[] for _ in range(hops)]}
    for r in make_eval_dataset(hops)[:n]:
        demo = demonstration(r, "", random.Random(0), 1.0)
        for k in range(hops):
            prefix = tok.apply_chat_template(demo[: 1 + 2 * k], tokenize=False, add_generation_prompt=True)
            query = demo[1 + 2 * k]["content"]
            upto_key = query[: query.index('"key": "') + len('"key": "')]
            for name, text, target in (("p_look_up", "<reasoning>", look), ("p_right_key", upto_key, None)):
                ids = tok.encode(prefix + text, add_special_tokens=False)
                with torch.no_grad():
                    logp = model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
                token = target if target is not None else tok.convert_tokens_to_ids(r["chain"][k])
                rates[name][k].append(logp[token].exp().item())
    return {name: [round(sum(x) / len(x), 3) for x in per_hop] for name, per_hop in rates.items()}


if __name__ == "__main__":  # python tasks/toy_hops.py .cache/toy-hops3-model [hops]
    print(warm_start_rates(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3))
