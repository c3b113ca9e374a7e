"""Turn-level credit over more than two turns, side by side: GRPO-OR, MT-GRPO (one split), per-turn rewards without
branching, and branching with sibling baselines, on the multi-hop task (tasks/toy_chain.py).

    .venv/bin/python bench/turn_credit.py [--seeds 0 1 2 3 4] [--max-steps 30] [--target 0.5]

Decided before any run (the task's docstring has the design and the prediction):
- every method trains hf_recipes/toy/toy-chain--mt-grpo.yaml from the same warm-started model, 4 prompts a step;
- GRPO-OR: `advantage_mode: grpo_outcome`; MT-GRPO: `mt_grpo` with the first hop's reward (an episode-level turn
  reward, on the turns before the first tool result); per-turn rewards: `reward_to_go` with `hop_reward` (one reward
  per turn, the prompt's leave-one-out baseline); branching: `tree` with `hop_reward`, `branch_width: 2`,
  `branch_depth: 3`, 32 leaves from 4 roots;
- equal sampled tokens: the three others run 8 independent episodes a prompt. The design first had 16 leaves from 2
  roots (a full chain is 4 turns, 32 turns a prompt, and 2 + 4 + 8 + 16 = 30 for the tree), but most paths stop
  before the third lookup, and in a 2-step smoke run (seed 0, all four methods: held-out exact match 0.25 GRPO-OR,
  0.75 MT-GRPO, 0.875 per-turn, 0.25 branching) the tree sampled 0.54x MT-GRPO's tokens. So 4 roots, decided then
  and not changed after. The table reports what each really sampled;
- the reading: held-out exact match (greedy, 24 prompts) at the last step, per seed, paired against MT-GRPO and
  MT-GRPO against GRPO-OR; the goal is branching above MT-GRPO and MT-GRPO above GRPO-OR on at least 4 of 5 seeds.
Also reported: steps until the trailing-5-step training exact match reaches --target, how far the held-out episodes
got (the share that took hops 1, 2 and 3 of the chain in order), sampled and trained tokens, and wall time.
Runs go to bench/runs/turn-credit/N-steps/; a finished run is reused.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from rewards.toy_chain_reward import hops  # noqa: E402

RECIPE = "hf_recipes/toy/toy-chain--mt-grpo.yaml"
HOP = "turn_reward_funcs=[rewards/toy_chain_reward.py:hop_reward]"
SCALED = "scale_returns=true"  # the per-turn modes' default when these runs were measured
METHODS = {
    "grpo_or": ("GRPO-OR", ["advantage_mode=grpo_outcome"]),
    "mt_grpo": ("MT-GRPO (one split)", ["advantage_mode=mt_grpo"]),
    "reward_to_go": ("per-turn rewards, no branching", ["advantage_mode=reward_to_go", HOP, SCALED]),
    "tree": (
        "branching (b 2, depth 3, 32 leaves)",
        ["advantage_mode=tree", HOP, SCALED, "branch_width=2", "branch_depth=3", "num_generations=32"],
    ),
}


def train(method: str, seed: int, steps: int, runs_dir: str) -> list[dict]:
    out = os.path.join(runs_dir, f"{method}-seed{seed}")
    path = os.path.join(out, "metrics.jsonl")
    if not (os.path.isfile(path) and sum(1 for _ in open(path)) == steps):
        print(f"[bench] {method} seed {seed} ...", flush=True)
        args = [f"seed={seed}", f"max_steps={steps}", f"eval_steps={steps}", f"save_steps={steps}"]
        args += [f"output_dir={out}", "log_episodes_steps=0", "resume_from_checkpoint=", *METHODS[method][1]]
        cmd = [sys.executable, "mt_grpo_trainer.py", RECIPE, *args]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in open(path)]


def hop_accuracy(run_dir: str, steps: int) -> list[float]:
    """Per hop k, the share of the held-out episodes that took the chain's first k hops in order."""
    eps = [json.loads(line) for line in open(os.path.join(run_dir, "eval", f"step-{steps}.jsonl"))]
    rows = {r["row"]: r for r in eps}
    from tasks.toy_chain import make_eval_dataset

    per_hop = [hops(rows[i]["messages"], row["chain"]) for i, row in enumerate(make_eval_dataset())]
    return [statistics.mean(sum(h) > k for h in per_hop) for k in range(3)]


def steps_to(metrics: list[dict], target: float, window: int = 5):
    r = [m["reward/exact_answer_reward"] for m in metrics]
    return next((i for i in range(window, len(r) + 1) if sum(r[i - window : i]) / window >= target), None)


def summary(metrics: list[dict], prompts: int) -> dict:
    episodes = [prompts * m.get("rollout/paths_per_prompt", 8) for m in metrics]
    return {
        "exact": metrics[-1]["eval/exact_answer_reward"],
        "sampled": sum(m["rollout/sampled_tokens"] * n for m, n in zip(metrics, episodes)),
        "trained": sum(m["rollout/tokens_trained"] * n for m, n in zip(metrics, episodes)),
        "seconds": sum(m["time/step"] for m in metrics),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--target", type=float, default=0.5, help="training exact match for 'steps to' (a guess: 0.25)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="which to run")
    args = ap.parse_args()
    for m in set(METHODS) - set(args.methods):
        del METHODS[m]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per trainer: 2 shared cores oversubscribe otherwise
    runs_dir = os.path.join(ROOT, "bench", "runs", "turn-credit", f"{args.max_steps}-steps")
    runs = {(m, s): train(m, s, args.max_steps, runs_dir) for s in args.seeds for m in METHODS}
    res = {k: summary(v, 4) for k, v in runs.items()}
    acc = {(m, s): hop_accuracy(os.path.join(runs_dir, f"{m}-seed{s}"), args.max_steps) for m, s in runs}
    mean = statistics.mean
    print(f"\nHeld-out exact match (greedy, 24 prompts) after {args.max_steps} steps, per seed and mean:\n")
    print("| method | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("|---" * (len(args.seeds) + 2) + "|")
    for m, (name, _) in METHODS.items():
        em = [res[(m, s)]["exact"] for s in args.seeds]
        print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in em) + f" | {mean(em):.3f} |")
    print("\nPaired per seed (held-out exact match, difference per seed, then wins, mean and spread):\n")
    pairs = ("tree", "mt_grpo"), ("mt_grpo", "grpo_or"), ("reward_to_go", "mt_grpo"), ("tree", "reward_to_go")
    for a, b in [(a, b) for a, b in pairs if a in METHODS and b in METHODS]:
        d = [res[(a, s)]["exact"] - res[(b, s)]["exact"] for s in args.seeds]
        sd = statistics.stdev(d) if len(d) > 1 else 0.0
        print(
            f"- {METHODS[a][0]} - {METHODS[b][0]}: {' '.join(f'{x:+.3f}' for x in d)}; above on "
            f"{sum(x > 0 for x in d)} of {len(d)} seeds; mean {mean(d):+.3f}, sd {sd:.3f}"
        )
    print(
        f"\nMeans over seeds; steps to = first step whose trailing-5-step training exact match is >= {args.target}:\n"
    )
    print("| method | hop 1 | hop 2 | hop 3 | steps to (per seed) | sampled tokens | trained tokens | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for m, (name, _) in METHODS.items():
        hop = [mean(acc[(m, s)][k] for s in args.seeds) for k in range(3)]
        to = " ".join(str(steps_to(runs[(m, s)], args.target) or "-") for s in args.seeds)
        r = {k: mean(res[(m, s)][k] for s in args.seeds) for k in ("sampled", "trained", "seconds")}
        print(
            f"| {name} | {hop[0]:.3f} | {hop[1]:.3f} | {hop[2]:.3f} | {to} | {r['sampled']:.0f} | "
            f"{r['trained']:.0f} | {r['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
