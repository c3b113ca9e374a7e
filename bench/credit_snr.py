"""What each credit mode's gradient is worth, through the trainer's own code, against exact policy gradients.

    .venv/bin/python bench/credit_snr.py [--draws 4000] [--seed 0]

Three small decision processes with a tabular softmax policy (two actions in each decision state), whose exact policy
gradient of the expected return (turn rewards plus outcome) is computed by autograd on their value recursion:
- `stop`: search or answer. A search finds the answer half the time (turn reward 0.3, less 0.1 a search); the outcome
  is 0.9 once found, 0.3 otherwise (a guess); after two searches the episode must answer. The policy decides when to
  stop (the decision process of tests/test_turn_credit.py before issue 32).
- `hops`: a chain of 3 lookups. A lookup takes the chain one hop further 80% of the time (turn reward 0.2), else it
  is a stray call; answering at the chain's end is right (1), earlier a guess (0.25); room for one stray call.
- `leaves`: search, search again, then a real decision at the leaves: answer (0.9) or abstain (0.6); deterministic,
  so 2 roots of a b = 2, depth 2 tree have 676 possible trees (tests/test_turn_credit.py enumerates them).

Every decision is one sampled token. For each advantage mode a group (one prompt's G episodes, or its tree of G
leaves) goes the trainer's way: `assign_advantages` -> `trainable_samples` -> `collate` -> `grpo_loss` (token_mean,
ratio 1), each group with its own copy of the parameters, so one backward gives every group's gradient
g = sum over trained tokens of weight x advantage x grad log pi, over G. token_mean's denominator is the batch's
weighted token count, which over many prompts is a constant: it is taken as G here. Groups are enumerated exactly
where there are at most `--exact` of them (every group with its probability), else drawn (`--draws`).

Reported, against the exact gradient g* of the expected return of one episode:
- cos: the cosine of E[g] with g*;
- bias: |E[g] - g*| / |g*| (scale_rewards changes the length too, so read it with cos);
- snr/1k: (E[g] . g*/|g*|) / sqrt(E|g - E[g]|^2), the signal along g* over the noise of one group, scaled to a budget
  of 1,000 sampled tokens (x sqrt(1000 / tokens a group samples)); the tokens a group samples are its decisions, a
  shared node's once;
- tok: tokens a group samples;
- E[g] / g* per decision: on each decision state's first logit (`stop`: start, found, miss; `hops`: hop 0-3;
  `leaves`: start, mid, last); 1.00 everywhere is unbiased, and unequal ratios are a change of direction.
"scale" is scale_rewards for the paper's modes and scale_returns for reward_to_go and tree.
mt_grpo, grpo_outcome and grpo_merged are the paper's; they are not estimators of g* (GRPO-OR ignores turn rewards,
MT-GRPO adds the turn advantage to the first turns' outcome one), and are shown for what their direction is worth.
"""

import argparse
import itertools
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mt_grpo_trainer as M  # noqa: E402

# --- decision processes: state -> (policy row or None if forced, [moves of action 0, moves of action 1])
# a move: (probability, turn reward, next state after a tool result, or None: the episode ends with this outcome)


def answer(p_right: float) -> list:
    """An answer's moves: right (outcome 1) with probability p_right, else wrong (0)."""
    return [(p_right, 0.0, None, 1.0), (1 - p_right, 0.0, None, 0.0)]


def stop_process() -> dict:
    p_found, guess, known, r_found, r_search = 0.5, 0.3, 0.9, 0.3, -0.1
    search = [(p_found, r_search + r_found, "found1", 0), (1 - p_found, r_search, "miss1", 0)]
    search_again = [(p_found, r_search + r_found, "found2", 0), (1 - p_found, r_search, "miss2", 0)]
    states = {
        "start": ("start", [answer(guess), search]),
        "found1": ("found", [answer(known), [(1, r_search, "found2", 0)]]),
        "miss1": ("miss", [answer(guess), search_again]),
        "found2": (None, [answer(known)]),  # after two searches it must answer
        "miss2": (None, [answer(guess)]),
    }
    return {"name": "stop", "rows": ["start", "found", "miss"], "states": states, "start": "start"}


def hops_process(hops: int = 3, p_hop: float = 0.8) -> dict:
    states = {}
    for calls in range(hops + 2):
        for h in range(min(calls, hops) + 1):
            done = answer(1.0 if h == hops else 0.25)
            further = [(p_hop, 0.2, f"h{h + 1}c{calls + 1}", 0), (1 - p_hop, 0, f"h{h}c{calls + 1}", 0)]
            if h == hops:  # the chain is done: a lookup is a stray call
                further = [(1, 0, f"h{h}c{calls + 1}", 0)]
            if calls == hops + 1:  # no call left: it must answer
                states[f"h{h}c{calls}"] = (None, [done])
            else:
                states[f"h{h}c{calls}"] = (f"hop{h}", [done, further])
    return {"name": "hops", "rows": [f"hop{h}" for h in range(hops + 1)], "states": states, "start": "h0c0"}


def leaves_process() -> dict:
    """Deterministic (an outcome is its expected value), so that every tree can be enumerated."""
    states = {
        "start": ("start", [[(1, 0, None, 0.3)], [(1, 0.2, "mid", 0)]]),
        "mid": ("mid", [[(1, 0, None, 0.5)], [(1, -0.1, "last", 0)]]),
        "last": ("last", [[(1, 0, None, 0.9)], [(1, 0, None, 0.6)]]),  # answer or abstain: both end the episode
    }
    return {"name": "leaves", "rows": ["start", "mid", "last"], "states": states, "start": "start"}


PROCESSES = {"stop": stop_process, "hops": hops_process, "leaves": leaves_process}
THETA = {  # the logits the gradients are taken at: (action 0, action 1) per row
    "stop": [[0.2, 0.3], [0.5, -0.2], [-0.3, 0.4]],
    "hops": [[0.0, 0.4], [0.2, 0.3], [0.1, 0.2], [0.3, -0.3]],
    "leaves": [[0.1, 0.3], [0.2, 0.1], [0.4, -0.1]],
}


def policy(theta) -> np.ndarray:
    t = np.asarray(theta, dtype=np.float64)
    return np.exp(t) / np.exp(t).sum(-1, keepdims=True)


def exact_gradient(proc: dict, theta) -> np.ndarray:
    """d/dtheta of one episode's expected return (turn rewards and outcome), by autograd on the value recursion."""
    th = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    pi = torch.softmax(th, -1)

    def value(state):
        row, actions = proc["states"][state]
        probs = [1.0] if row is None else pi[proc["rows"].index(row)]
        total = 0.0
        for pa, moves in zip(probs, actions):
            for p, r, nxt, outcome in moves:
                total = total + pa * p * (r + (outcome if nxt is None else value(nxt)))
        return total

    value(proc["start"]).backward()
    return th.grad.numpy().ravel()


# --- trees: every way one prompt's rollouts can go, or one drawn


def choose(options: list, rng):
    """All (probability, option) pairs, or with an rng one drawn, with probability 1."""
    if rng is None:
        return [o for o in options if o[0] > 0]
    i = rng.choice(len(options), p=[o[0] for o in options])
    return [(1.0, options[i][1])]


def paths(proc: dict, pi: np.ndarray, state: str, node: tuple, turns: list, b: int, depth: int, rng=None) -> list:
    """The ways the rest of a path goes from `state`, each (probability, leaves): with b > 1 a path goes on b ways
    after each of its first `depth` tool results. A leaf: (its node, its turns, its outcome); a turn: (node, state,
    action, reward)."""
    row, actions = proc["states"][state]
    probs = [1.0] if row is None else pi[proc["rows"].index(row)]
    moves = [(pa * p, (a, r, nxt, o)) for a, pa in enumerate(probs) for p, r, nxt, o in actions[a]]
    out = []
    for p, (a, r, nxt, outcome) in choose(moves, rng):
        path = turns + [(node, state, a, r)]
        if nxt is None:
            out.append((p, [(node, path, outcome)]))
        elif b > 1 and len(node) <= depth:
            children = [paths(proc, pi, nxt, node + (j,), path, b, depth, rng) for j in range(b)]
            out += [
                (p * math.prod(q for q, _ in c), [leaf for _, ls in c for leaf in ls])
                for c in itertools.product(*children)
            ]
        else:
            out += [(p * q, ls) for q, ls in paths(proc, pi, nxt, node, path, b, depth, rng)]
    return out


def groups(proc: dict, theta, roots: int, b: int, depth: int, rng=None) -> list:
    """One prompt's trees, each (probability, leaves): with an rng one drawn; else every multiset of its roots' ways
    (the roots are exchangeable, and every mode's gradient is the same in any order of them), with its probability."""
    pi = policy(theta)
    if rng is not None:
        return [
            (
                1.0,
                [
                    leaf
                    for i in range(roots)
                    for leaf in relabel(paths(proc, pi, proc["start"], (0,), [], b, depth, rng)[0][1], i)
                ],
            )
        ]
    ways = paths(proc, pi, proc["start"], (0,), [], b, depth)
    out = []
    for picked in itertools.combinations_with_replacement(range(len(ways)), roots):
        counts = np.bincount(picked, minlength=len(ways))
        orders = math.factorial(roots) / math.prod(math.factorial(c) for c in counts)
        p = orders * math.prod(ways[i][0] for i in picked)
        out.append((p, [leaf for slot, i in enumerate(picked) for leaf in relabel(ways[i][1], slot)]))
    return out


def relabel(leaves: list, root: int) -> list:
    """A root's leaves, as the root-th root's: its nodes' first index set to `root`."""
    out = []
    for node, turns, outcome in leaves:
        out.append(((root,) + node[1:], [((root,) + n[1:], s, a, r) for n, s, a, r in turns], outcome))
    return out


def count_groups(proc: dict, roots: int, b: int, depth: int) -> int:
    """How many multisets of its roots' ways one prompt's trees have (counted, not listed)."""

    def ways(state, branchings):
        row, actions = proc["states"][state]
        total = 0
        for moves in actions[: 1 if row is None else 2]:
            for p, _, nxt, _ in moves:
                if p == 0:
                    continue
                if nxt is None:
                    total += 1
                elif b > 1 and branchings < depth:
                    total += ways(nxt, branchings + 1) ** b
                else:
                    total += ways(nxt, branchings)
        return total

    return math.comb(ways(proc["start"], 0) + roots - 1, roots)


# --- the trainer's side: episodes as the environment builds them, one token a decision


def vocabulary(proc: dict) -> dict:
    """Token ids: one per decision state's policy row, one for forced states, then the two actions."""
    ids = {row: i for i, row in enumerate(proc["rows"])}
    ids[None] = len(proc["rows"])
    return ids


def episodes_of(proc: dict, theta, leaves: list, group: int) -> tuple[list, list, list]:
    """A tree's paths as the environment leaves them: each turn is a state token (context) and an action token; a
    node's turns are trained (mask 1, the policy's logprob as the sampler's) by the first path through it, which the
    others hold as context (mask 0)."""
    ids, held, logpi = vocabulary(proc), set(), np.log(policy(theta))
    action0 = len(ids)
    eps, turn_R, outcome_R = [], [], []
    for node, turns, outcome in sorted(leaves, key=lambda leaf: leaf[0]):
        trained = [(turn_node, k) not in held for k, (turn_node, *_) in enumerate(turns)]
        held.update((turn_node, k) for k, (turn_node, *_) in enumerate(turns))
        s = M.Sample()
        s.input_ids = [x for _, state, a, _ in turns for x in (ids[proc["states"][state][0]], action0 + a)]
        s.loss_mask = [x for t in trained for x in (0, int(t))]
        s.sampler_logprobs = [x for _, state, a, _ in turns for x in (0.0, sampler_logprob(proc, logpi, state, a))]
        s.turn_idx = [x for k, t in enumerate(trained) for x in (-1, k if t else -1)]
        s.versions = [-1] * len(s.input_ids)
        ep_turns = [M.Turn(2 * k + 1, 1, M.state_key(s.input_ids[: 2 * k + 1])) for k in range(len(turns))]
        ep = M.Episode(row={}, messages=[], n_prompt_messages=0, turns=ep_turns, samples=[s])
        ep.node, ep.group, ep.end_reason = node, group, "answer"
        ep.turn_nodes = [t[0] for t in turns]
        ep.first_result_turn = 1 if len(turns) > 1 else None
        eps.append(ep)
        turn_R.append([float(t[3]) for t in turns])
        outcome_R.append(float(outcome))
    return eps, turn_R, outcome_R


def sampler_logprob(proc: dict, logpi: np.ndarray, state: str, action: int) -> float:
    row = proc["states"][state][0]
    if row is None:  # a forced answer
        return 0.0
    return float(logpi[proc["rows"].index(row), action])


def config(mode: str, G: int, b: int, depth: int, scale: bool) -> M.Config:
    cfg = M.Config(advantage_mode=mode, num_generations=G, scale_rewards=scale, scale_returns=scale, is_ratio_cap=0.0)
    cfg.branch_width, cfg.branch_depth = b, depth
    return cfg


def estimates(proc: dict, theta, cfg: M.Config, trees: list) -> tuple[np.ndarray, np.ndarray]:
    """Each tree's gradient through assign_advantages -> trainable_samples -> collate -> grpo_loss, and the tokens it
    sampled. A tree's samples get its own copy of theta, so one backward gives every tree's gradient."""
    episodes, turn_R, outcome_R = [], [], []
    for i, (_, leaves) in enumerate(trees):
        eps, tr, o = episodes_of(proc, theta, leaves, i)
        episodes += eps
        turn_R += tr
        outcome_R += o
    M.assign_advantages(episodes, turn_R, outcome_R, cfg)
    samples, _ = M.trainable_samples(episodes, cfg)
    group_of = {id(s): ep.group for ep in episodes for s in ep.samples}
    rows = M.pack_rows(samples, sum(len(s.input_ids) for s in samples))
    batch = M.collate(rows, samples, 0, "cpu")  # the loss's [B, T] tensors, one row per sample in the rows' order
    in_batch = [samples[i] for row in rows for i, _, _ in row["members"]]
    owner = torch.tensor([group_of[id(s)] for s in in_batch])
    width = batch["mask"].shape[1]
    ids = torch.tensor([s.input_ids + [0] * (width - len(s.input_ids)) for s in in_batch])
    theta_copies = torch.tensor(np.array(theta), dtype=torch.float64).repeat(len(trees), 1, 1).requires_grad_()
    logp = tabular_logprobs(theta_copies, owner, ids, len(proc["rows"]))
    loss, _ = M.grpo_loss(logp, logp.detach(), logp.detach(), batch["adv"], batch["mask"], cfg, cfg.num_generations, 1)
    (-loss).backward()
    tokens = np.zeros(len(trees))
    np.add.at(tokens, owner.numpy(), [sum(s.loss_mask) for s in in_batch])
    return theta_copies.grad.reshape(len(trees), -1).numpy(), tokens


def tabular_logprobs(theta_copies, owner, ids, n_rows: int):
    """log pi(token_t | token_t-1) for [B, T] ids: a state token's next token is an action drawn from its row's
    softmax (a forced state's is action 0, with probability 1); every other position gets 0 (mask 0 there)."""
    forced = torch.tensor([[0.0, -math.inf]], dtype=torch.float64).expand(len(theta_copies), 1, 2)
    table = torch.log_softmax(torch.cat([theta_copies, forced], 1), -1)  # [trees, rows + 1, 2]
    prev, action = ids[:, :-1], ids[:, 1:] - (n_rows + 1)
    is_action = (prev <= n_rows) & (action >= 0)
    rows = table[owner[:, None], prev.clamp(max=n_rows), action.clamp(0, 1)]
    return torch.nn.functional.pad(torch.where(is_action, rows, torch.zeros_like(rows)), (1, 0))


# --- the figures


def one_prompt(proc: dict, roots: int, b: int, depth: int, draws: int, exact: int, seed: int) -> tuple[list, bool]:
    """Every tree of one prompt with its probability, where there are at most `exact`; else `draws` drawn, each 1/draws.
    Every mode sees the same trees (paired)."""
    theta = THETA[proc["name"]]
    if count_groups(proc, roots, b, depth) <= exact:
        return groups(proc, theta, roots, b, depth), True
    rng = np.random.default_rng(seed)
    drawn = [groups(proc, theta, roots, b, depth, rng)[0][1] for _ in range(draws)]
    return [(1.0 / draws, leaves) for leaves in drawn], False


def measure(proc: dict, trees: list, cfg: M.Config) -> dict:
    """cos, bias, snr/1k and tok (see the docstring) of one mode on one prompt's trees; se: the bias's sampling error
    (0 when every tree is enumerated); ratio: E[g] / g* per component."""
    theta = THETA[proc["name"]]
    g, tokens = estimates(proc, theta, cfg, trees)
    p = np.array([q for q, _ in trees])
    mean = p @ g
    star = exact_gradient(proc, theta)
    unit = star / np.linalg.norm(star)
    noise = math.sqrt(p @ ((g - mean) ** 2).sum(-1))
    drawn = len({q for q, _ in trees}) == 1 and len(trees) > 1
    return {
        "cos": float(mean @ unit / np.linalg.norm(mean)),
        "bias": float(np.linalg.norm(mean - star) / np.linalg.norm(star)),
        "se": noise / math.sqrt(len(trees)) / np.linalg.norm(star) if drawn else 0.0,
        "snr": float(mean @ unit / noise * math.sqrt(1000 / (p @ tokens))),
        "tok": float(p @ tokens),
        "ratio": np.divide(mean, star, out=np.full_like(mean, np.nan), where=np.abs(star) > 1e-9),
    }


CASES = [  # (process, roots, b, depth): G = roots x b^depth
    ("stop", 4, 1, 1),
    ("stop", 2, 2, 1),
    ("stop", 8, 1, 1),
    ("stop", 2, 2, 2),
    ("hops", 8, 1, 1),
    ("hops", 2, 2, 2),
    ("hops", 2, 2, 3),
    ("leaves", 8, 1, 1),
    ("leaves", 2, 2, 2),
]
MODES = ["grpo_outcome", "grpo_merged", "mt_grpo", "reward_to_go", "state_matched", "tree"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=1000, help="groups drawn where they are not enumerated")
    ap.add_argument("--exact", type=int, default=2000, help="enumerate every group where there are at most this many")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    cpu0 = time.process_time()
    for name, roots, b, depth in CASES:
        proc = PROCESSES[name]()
        G = roots * b**depth
        trees, exact = one_prompt(proc, roots, b, depth, args.draws, args.exact, args.seed)
        shape = f"G {G} independent episodes"
        if b > 1:
            shape = f"G {G}: {roots} roots, b {b}, depth {depth}"
        how = f"{len(trees)} trees drawn"
        if exact:
            how = f"every tree: {len(trees)} multisets of the roots"
        print(f"\n{name}, {shape} ({how})\n", flush=True)
        print("| mode | scale | cos | bias | snr/1k | tok | E[g] / g* per decision |")
        print("|---|---|---|---|---|---|---|")
        modes = MODES
        if b > 1:
            modes = ["tree"]
        for mode, scale in itertools.product(modes, [False, True]):
            r = measure(proc, trees, config(mode, G, b, depth, scale))
            bias = f"{r['bias']:.3f}"
            if r["se"]:
                bias += f" ± {r['se']:.3f}"
            ratios = " ".join(f"{x:.2f}" for x in r["ratio"][::2] if np.isfinite(x))
            on = "on" if scale else "off"
            print(
                f"| {mode} | {on} | {r['cos']:.4f} | {bias} | {r['snr']:.1f} | {r['tok']:.1f} | {ratios} |", flush=True
            )
    print(f"\n{time.time() - t0:.0f} s wall, {time.process_time() - cpu0:.0f} s of CPU")


if __name__ == "__main__":
    main()
