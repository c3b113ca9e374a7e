"""Does the credit mode change what an agent learns? GRPO-OR, MT-GRPO, per-turn rewards and branching, paired by seed,
on the multi-hop task where credit decides (tasks/toy_hops.py).

    .venv/bin/python bench/turn_credit.py --seeds 100 101 102 103 104 105 106 107          # the comparison
    .venv/bin/python bench/turn_credit.py --seeds 100 ... 107 --hops 4                     # the longer variant

Pre-registered: everything below was written and committed before any training run on this task was seen.

Design
- Task: hf_recipes/toy/toy-hops--mt-grpo.yaml (64 training chains of 3 hops, 32 held out, 8 colours, exact match the
  only weighted outcome, 5 tool calls allowed). `--hops 4`: the 4-hop variant, its own warm start, 6 calls allowed.
- Every run starts from the same warm-started model (built once, `build_model`), trains 30 steps of 4 prompts,
  learning rate 5e-4, and differs from the others of its seed only in the credit:
  - GRPO-OR: `advantage_mode: grpo_outcome`, 8 independent episodes a prompt;
  - MT-GRPO: `mt_grpo` with `first_hop_reward` (the paper's one split), 8 episodes a prompt;
  - per-turn: `reward_to_go` with `hop_reward` (each lookup turn its own reward, the prompt's leave-one-out
    baseline), 8 episodes a prompt;
  - tree: `tree` with `hop_reward`, `branch_width: 2`, `branch_depth: 2`: 16 leaves a prompt from 4 roots, a
    sibling baseline for the decisions after the first and the second tool result. (At the warm start's call rate a
    tree samples about as many turns as 8 independent episodes; as the chain is learned, up to 1.4x. Reported.)
- Evaluation: the 64 held-out prompts (32 chains x 2 question forms), 2 episodes each at temperature 1, seeded (the
  trainer's `eval_temperature`, `eval_samples`), at steps 0, 10, 20 and 30; greedy, one episode a prompt, beside it.
- Seeds: 100-107, paired (seed s of every method shares its training prompts, and its eval stream but the tree's,
  whose eval batches hold 64 episodes, not 32: its step-0 eval is another sample of the same model). The pilot,
  for timing only, ran seed 900 (`--seeds 900 --max-steps 2 --eval-every 1`); none of its numbers enter the
  comparison, and none changed its design.
- Runs: two trainers at once, one thread each (`--jobs 2`). A crashed run is started again on the same seed; a run
  that collapses (stops calling, unlearns) counts as it falls.

Metric and test
- Primary, per run: the held-out chain-completion rate (`chain_completed_reward`: every hop taken in order and the
  right colour; a guess cannot reach it), sampled, averaged over the evaluations at steps 10, 20 and 30 (an area
  under the learning curve: how soon and how far the chain was learned).
- Planned comparisons, paired per seed on the primary metric: per-turn > MT-GRPO, tree > MT-GRPO,
  MT-GRPO > GRPO-OR. Each: one-sided exact Wilcoxon signed-rank test (zero differences dropped), Holm-corrected over
  the three; a 95% percentile bootstrap CI of the mean difference over seeds (10,000 resamples).
- Decision rule: a comparison is shown when its Holm-adjusted p < 0.05; otherwise it is not shown, and the docs say
  whether the methods tie or the order is reversed, with the CI.
- Reported beside, not tested: the completion rate at each eval point, greedy exact match, how far held-out episodes
  got (the share that took hop k in order), sampled and trained tokens, and where each run's time went.

Prediction (tasks/toy_hops.py): per-turn > MT-GRPO > GRPO-OR; tree >= MT-GRPO, near per-turn.

Amended before any result of the comparison was read (2026-11-27): the per-turn modes' default became centring only
(`scale_returns: false`, chosen from bench/credit_snr.py's exact figures, docs/turn-credit.md), and these runs take
that default. The 8 runs made under the earlier default (divided by the group's return std) were discarded unread.

Output: tables, then the three comparison lines last (`per-turn > MT-GRPO: 7 of 8 seeds, p = 0.008 (Holm), CI [0.04,
0.19]`); per-seed figures in RUNS_DIR/results.json, runs in bench/runs/turn-credit/H-hops-N-steps/ (--out for
another folder than bench/runs/turn-credit/; --set adds overrides to every run, after the method's).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired_stats import compare, comparison_line  # noqa: E402
from seed_runs import ROOT, eval_points, read_jsonl, time_split, train_all, trained_steps  # noqa: E402

sys.path.insert(0, ROOT)
from rewards.toy_hops_reward import hops  # noqa: E402
from tasks.toy_hops import make_eval_dataset  # noqa: E402

RECIPE = "hf_recipes/toy/toy-hops--mt-grpo.yaml"
HOP = "turn_reward_funcs=[rewards/toy_hops_reward.py:hop_reward]"
METHODS = {
    "grpo_or": ("GRPO-OR", ["advantage_mode=grpo_outcome"]),
    "mt_grpo": ("MT-GRPO", ["advantage_mode=mt_grpo"]),
    "per_turn": ("per-turn", ["advantage_mode=reward_to_go", HOP]),
    "tree": ("tree", ["advantage_mode=tree", HOP, "branch_width=2", "branch_depth=2", "num_generations=16"]),
}
PLANNED = [("per_turn", "mt_grpo"), ("tree", "mt_grpo"), ("mt_grpo", "grpo_or")]
PRIMARY = "eval/chain_completed_reward"
VARIANTS = {  # hops -> the recipe overrides of that variant
    3: [],
    4: [
        "dataset=tasks/toy_hops.py:make_dataset_4hops",
        "eval_dataset=tasks/toy_hops.py:make_eval_dataset_4hops",
        "model_builder=tasks/toy_hops.py:build_model_4hops",
        "model_name_or_path=.cache/toy-hops4-model",
        "max_env_steps=6",
    ],
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(100, 108)), help="paired training seeds")
    ap.add_argument("--max-steps", type=int, default=30, help="training steps per run (4 prompts each)")
    ap.add_argument("--eval-every", type=int, default=10, help="evaluate at step 0 and every N steps")
    ap.add_argument("--hops", type=int, choices=sorted(VARIANTS), default=3, help="the task variant")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--jobs", type=int, default=2, help="trainers at once, one thread each")
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "runs", "turn-credit"), help="the runs and results.json"
    )
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of every run (last)")
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    return args


def hop_reach(run_dir: str, step: int, hops_n: int, eval_rows: list[dict]) -> list[float]:
    """Per hop k, the share of the sampled held-out episodes at `step` that took the chain's first k hops in order."""
    records = read_jsonl(os.path.join(run_dir, "eval", f"step-{step}.jsonl"))
    taken = [sum(hops(r["messages"], eval_rows[r["row"]]["chain"])) for r in records]
    return [statistics.mean(t > k for t in taken) for k in range(hops_n)]


def run_figures(run_dir: str, wall: dict, hops_n: int, eval_rows: list[dict]) -> dict:
    points = eval_points(run_dir)
    steps = trained_steps(run_dir)
    later = [s for s in points if s > 0]
    paths = [m.get("rollout/paths_per_prompt", 8) * 4 for m in steps]  # episodes (paths) a step
    return {
        "primary": statistics.mean(points[s][PRIMARY] for s in later),
        "completion": {s: p[PRIMARY] for s, p in points.items()},
        "greedy_exact": {s: p["eval/greedy_exact_answer_reward"] for s, p in points.items()},
        "sampled_exact": {s: p["eval/exact_answer_reward"] for s, p in points.items()},
        "hop_reach": {s: hop_reach(run_dir, s, hops_n, eval_rows) for s in points},
        "call_rate_turn0": [m.get("rollout/tool_rate_turn0", 0.0) for m in steps],
        "sampled_tokens": sum(m["rollout/sampled_tokens"] * n for m, n in zip(steps, paths)),
        "trained_tokens": sum(m["rollout/tokens_trained"] * n for m, n in zip(steps, paths)),
        "time": time_split(run_dir, wall),
    }


def tables(fig: dict, seeds: list[int], methods: list[str], labels: dict | None = None) -> str:
    """The figures' tables, each method under its label (default: METHODS' names)."""
    labels = labels or {m: METHODS[m][0] for m in methods}
    mean = statistics.mean
    points = sorted(fig[(methods[0], seeds[0])]["completion"])
    out = ["Primary: held-out chain-completion rate (sampled, mean of the evals after step 0), per seed:", ""]
    out += ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "|---" * (len(seeds) + 2) + "|"]
    for m in methods:
        xs = [fig[(m, s)]["primary"] for s in seeds]
        out.append(f"| {labels[m]} | " + " | ".join(f"{x:.3f}" for x in xs) + f" | {mean(xs):.3f} |")
    out += [
        "",
        "Means over seeds at each eval point (step: completion / greedy exact match / sampled exact match):",
        "",
    ]
    out += ["| method | " + " | ".join(f"step {p}" for p in points) + " |", "|---" * (len(points) + 1) + "|"]
    for m in methods:
        cells = []
        for p in points:
            trio = [mean(fig[(m, s)][k][p] for s in seeds) for k in ("completion", "greedy_exact", "sampled_exact")]
            cells.append(" / ".join(f"{x:.3f}" for x in trio))
        out.append(f"| {labels[m]} | " + " | ".join(cells) + " |")
    last = points[-1]
    hops_n = len(fig[(methods[0], seeds[0])]["hop_reach"][last])
    out += ["", f"How far the held-out episodes got (share that took hop k in order; step 0 -> step {last}), cost,", ""]
    head = " | ".join(f"hop {k + 1}" for k in range(hops_n))
    out += [f"| method | {head} | sampled tokens | trained tokens | wall s | training s | eval s | other s |"]
    out += ["|---" * (hops_n + 7) + "|"]
    for m in methods:
        reach = [f"{mean(fig[(m, s)]['hop_reach'][0][k] for s in seeds):.2f} -> " for k in range(hops_n)]
        reach = [r + f"{mean(fig[(m, s)]['hop_reach'][last][k] for s in seeds):.2f}" for k, r in enumerate(reach)]
        cost = [mean(fig[(m, s)][k] for s in seeds) for k in ("sampled_tokens", "trained_tokens")]
        t = [mean(fig[(m, s)]["time"][k] for s in seeds) for k in ("wall", "training", "evaluation", "other")]
        out.append(f"| {labels[m]} | " + " | ".join(reach) + f" | {cost[0]:.0f} | {cost[1]:.0f} | ")
        out[-1] += " | ".join(f"{x:.0f}" for x in t) + " |"
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    methods = args.methods
    runs_dir = os.path.join(args.out, f"{args.hops}-hops-{args.max_steps}-steps")
    common = [f"max_steps={args.max_steps}", f"eval_steps={args.eval_every}", *VARIANTS[args.hops]]
    runs = {(m, s): [f"seed={s}", *common, *METHODS[m][1], *args.set] for s in args.seeds for m in methods}
    t0 = time.time()
    walls = train_all(RECIPE, runs, runs_dir, args.jobs)
    print(f"[bench] {len(runs)} runs, {args.jobs} at once: {time.time() - t0:.0f} s wall this invocation", flush=True)
    eval_rows = make_eval_dataset(args.hops)
    fig = {
        k: run_figures(os.path.join(runs_dir, f"{k[0]}-seed{k[1]}"), w, args.hops, eval_rows) for k, w in walls.items()
    }
    labels = {m: METHODS[m][0] for m in methods}
    report(args, runs_dir, fig, methods, labels, PLANNED, [tables(fig, args.seeds, methods, labels)])


def report(args, runs_dir: str, fig: dict, methods: list[str], labels: dict, planned: list, printed: list[str]):
    """The planned comparisons that both methods ran (paired by seed on the primary metric), RUNS_DIR/results.json,
    then the tables in `printed` and the comparison lines last (bench/credit_at_equal_tokens.py's too)."""
    diffs = {}
    for a, b in planned:
        if a in methods and b in methods:
            diffs[f"{labels[a]} > {labels[b]}"] = [fig[(a, s)]["primary"] - fig[(b, s)]["primary"] for s in args.seeds]
    results = compare(diffs)
    with open(os.path.join(runs_dir, "results.json"), "w") as f:
        per_seed = {f"{m}-seed{s}": v for (m, s), v in fig.items()}
        json.dump({"args": vars(args), "runs": per_seed, "comparisons": results}, f, indent=1)
    for table in printed:
        print("\n" + table)
    print(f"\nPer-seed figures: {os.path.join(runs_dir, 'results.json')}\n")
    for name, c in results.items():
        print(comparison_line(name, c))


if __name__ == "__main__":
    main()
