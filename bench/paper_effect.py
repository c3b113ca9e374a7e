"""The paper's effect on the CPU: MT-GRPO vs GRPO-OR vs GRPO-MR on the paper-effect task (tasks/toy_flags.py),
paired by seed, with a sampled evaluation that can see the effect.

    .venv/bin/python bench/paper_effect.py --seeds 100 101 102 103 104 105 106 107

Pre-registered (written before any run of this design; the 5-seed greedy runs of docs/paper-effect.md, seeds 0-4,
had been seen, and they inform the prediction):
- Every (mode, seed) trains hf_recipes/toy/toy-flags--mt-grpo.yaml (20 steps of 4 prompts x 8 episodes) from the
  same warm-started model; the modes differ only in `advantage_mode`. Seeds 100-107, paired. Two trainers at once,
  one thread each. A crashed run is started again on the same seed; a collapsed run counts as it falls.
- Evaluation: the 24 held-out prompts (8 countries the RL never trains on, 3 question forms; the task has no more),
  6 episodes each at temperature 1, seeded (144 episodes), at steps 0, 10 and 20; greedy beside it.
- Primary metric, per run: the held-out share of episodes that called the tool right AND answered right
  (`answer_in_result_reward` and `exact_answer_reward` both 1): a guess (right 1 time in 4) cannot reach it.
  Averaged over the evaluations at steps 10 and 20.
- Planned comparisons on it: MT-GRPO > GRPO-OR, MT-GRPO > GRPO-MR; one-sided exact Wilcoxon signed-rank,
  Holm-corrected over the two; 95% bootstrap CI of the mean paired difference. Shown when the Holm p < 0.05.
- Prediction: MT-GRPO > GRPO-OR is shown (outcome-only credit collapses or delays tool use on some seeds);
  MT-GRPO > GRPO-MR is not (the merged scalar already ranks a right call above a guess; they were close on 0-4).
- Also printed: the paper's columns (tool execution, answer in search results, format, exact match; sampled, at
  the last step), the first-turn tool-call rate, and "steps to" the --target training exact match.
The comparison lines come last; per-seed figures go to RUNS_DIR/results.json, runs to bench/runs/paper-effect/ (--out
for another folder; --set adds overrides to every run, after the mode's).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired_stats import compare, comparison_line  # noqa: E402
from seed_runs import eval_points, read_jsonl, time_split, train_all, trained_steps  # noqa: E402
from toy_modes import MODES, ROOT, steps_to  # noqa: E402

RECIPE = "hf_recipes/toy/toy-flags--mt-grpo.yaml"
COLUMNS = {
    "tool_execution_reward": "tool execution",
    "answer_in_result_reward": "answer in search results",
    "format_reward": "format",
    "exact_answer_reward": "exact match",
}
EXACT = "exact_answer_reward"
PLANNED = [("mt_grpo", "grpo_outcome"), ("mt_grpo", "grpo_merged")]
EVAL = ["eval_temperature=1.0", "eval_samples=6"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=list(range(100, 108)),
        help="paired training seeds, one run per mode each",
    )
    ap.add_argument("--max-steps", type=int, default=20, help="training steps per run (32 episodes each)")
    ap.add_argument("--target", type=float, default=0.5, help="exact-match threshold for 'steps to'")
    ap.add_argument("--eval-every", type=int, default=10, help="evaluate at step 0 and every N steps")
    ap.add_argument("--jobs", type=int, default=2, help="trainers at once, one thread each")
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "runs", "paper-effect"), help="the runs and results.json"
    )
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of every run (last)")
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    return args


def mean(xs):
    return sum(xs) / len(xs)


def final_eval(metrics):
    """The eval/ figures of the last step that has them."""
    return next(
        {k.removeprefix("eval/"): v for k, v in m.items() if k.startswith("eval/")}
        for m in reversed(metrics)
        if any(k.startswith("eval/") for k in m)
    )


def tables(runs, seeds, target, warm=None, window=10):
    """Markdown tables from {(mode, seed): metrics rows} (and the warm-started model's eval figures)."""
    out = [
        f"Held-out eval (24 prompts x 6 episodes, temperature 1) after {len(next(iter(runs.values())))} steps, "
        f"mean over seeds "
        f"{', '.join(map(str, seeds))}; tool-call rate = rollout/tool_rate_turn0 (first vs last {window} steps); "
        f"steps to = first step whose trailing-{window}-step training exact match is >= {target}:",
        "",
        "| Method | " + " | ".join(COLUMNS.values()) + " | tool-call rate, training | steps to (per seed) |",
        "|---" * (len(COLUMNS) + 3) + "|",
    ]
    if warm:
        out.append("| warm-start (step 0) | " + " | ".join(f"{warm[c]:.3f}" for c in COLUMNS) + " | | |")
    for mode, name in MODES.items():
        ms = [runs[(mode, s)] for s in seeds]
        evals = [final_eval(m) for m in ms]
        rate = [[r.get("rollout/tool_rate_turn0", 0.0) for r in m] for m in ms]
        first, last = mean([mean(r[:window]) for r in rate]), mean([mean(r[-window:]) for r in rate])
        steps = [steps_to(m, target, window, key=f"reward/{EXACT}") for m in ms]
        out.append(
            f"| {name} | "
            + " | ".join(f"{mean([e[c] for e in evals]):.3f}" for c in COLUMNS)
            + f" | {first:.2f} -> {last:.2f} | "
            + " ".join("-" if s is None else str(s) for s in steps)
            + " |"
        )
    out += [
        "",
        "Exact match per seed (held out, sampled, at the last step):",
        "",
        "| Method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---" * (len(seeds) + 1) + "|",
    ]
    em = {mode: [final_eval(runs[(mode, s)])[EXACT] for s in seeds] for mode in MODES}
    out += [f"| {name} | " + " | ".join(f"{x:.3f}" for x in em[mode]) + " |" for mode, name in MODES.items()]
    wins = sum(a > b for a, b in zip(em["mt_grpo"], em["grpo_outcome"]))
    out += ["", f"MT-GRPO's exact match is above GRPO-OR's on {wins} of {len(seeds)} seeds."]
    return "\n".join(out)


def right_call_and_answer(run_dir: str, step: int) -> float:
    """The share of the sampled held-out episodes at `step` that called the tool right and answered right."""
    records = read_jsonl(os.path.join(run_dir, "eval", f"step-{step}.jsonl"))
    both = [r["rewards"]["answer_in_result_reward"] == 1.0 and r["rewards"][EXACT] == 1.0 for r in records]
    return statistics.mean(both)


def primary_table(fig: dict, seeds: list[int]) -> str:
    points = sorted(fig[("mt_grpo", seeds[0])]["series"])
    out = ["Primary: held-out right call and right answer (sampled, mean of the evals after step 0), per seed:", ""]
    out += ["| Method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "|---" * (len(seeds) + 2) + "|"]
    for mode, name in MODES.items():
        xs = [fig[(mode, s)]["primary"] for s in seeds]
        out.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in xs) + f" | {statistics.mean(xs):.3f} |")
    out += ["", "Means over seeds at each eval point (step: right call and answer / greedy exact match):", ""]
    out += ["| Method | " + " | ".join(f"step {p}" for p in points) + " | wall s | training s | eval s | other s |"]
    out += ["|---" * (len(points) + 5) + "|"]
    for mode, name in MODES.items():
        cells = []
        for p in points:
            both = statistics.mean(fig[(mode, s)]["series"][p] for s in seeds)
            greedy = statistics.mean(fig[(mode, s)]["greedy_exact"][p] for s in seeds)
            cells.append(f"{both:.3f} / {greedy:.3f}")
        t = [
            statistics.mean(fig[(mode, s)]["time"][k] for s in seeds)
            for k in ("wall", "training", "evaluation", "other")
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.0f}" for x in t) + " |")
    return "\n".join(out)


def main(argv=None):
    args = parse_args(argv)
    runs_dir = os.path.join(args.out, f"{args.max_steps}-steps-sampled-eval")
    common = [f"max_steps={args.max_steps}", f"eval_steps={args.eval_every}", "save_steps=0", *EVAL]
    runs = {(m, s): [f"seed={s}", f"advantage_mode={m}", *common, *args.set] for s in args.seeds for m in MODES}
    t0 = time.time()
    walls = train_all(RECIPE, runs, runs_dir, args.jobs)
    print(f"[bench] {len(runs)} runs, {args.jobs} at once: {time.time() - t0:.0f} s wall this invocation", flush=True)
    fig = {}
    metrics = {}
    for (mode, seed), wall in walls.items():
        run_dir = os.path.join(runs_dir, f"{mode}-seed{seed}")
        points = eval_points(run_dir)
        series = {p: right_call_and_answer(run_dir, p) for p in points}
        metrics[(mode, seed)] = trained_steps(run_dir)
        fig[(mode, seed)] = {
            "primary": statistics.mean(v for p, v in series.items() if p > 0),
            "series": series,
            "greedy_exact": {p: m[f"eval/greedy_{EXACT}"] for p, m in points.items()},
            "time": time_split(run_dir, wall),
        }
    step0 = [eval_points(os.path.join(runs_dir, f"{m}-seed{s}"))[0] for m, s in walls]
    warm = {c: statistics.mean(p[f"eval/{c}"] for p in step0) for c in COLUMNS}  # every run's step 0, each seeded
    planned = {}
    for a, b in PLANNED:
        planned[f"{MODES[a]} > {MODES[b]}"] = [fig[(a, s)]["primary"] - fig[(b, s)]["primary"] for s in args.seeds]
    results = compare(planned)
    with open(os.path.join(runs_dir, "results.json"), "w") as f:
        per_seed = {f"{m}-seed{s}": v for (m, s), v in fig.items()}
        json.dump({"args": vars(args), "runs": per_seed, "comparisons": results}, f, indent=1)
    print("\n" + tables(metrics, args.seeds, args.target, warm))
    print("\n" + primary_table(fig, args.seeds))
    print(f"\nPer-seed figures: {os.path.join(runs_dir, 'results.json')}\n")
    for name, c in results.items():
        print(comparison_line(name, c))


if __name__ == "__main__":
    main()
