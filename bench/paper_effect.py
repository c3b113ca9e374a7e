"""The paper's effect on the CPU: MT-GRPO vs GRPO-OR vs GRPO-MR on the paper-effect task (tasks/toy_flags.py).

    .venv/bin/python bench/paper_effect.py [--seeds 0 1 2 3 4] [--max-steps 20] [--target 0.5]

Every (mode, seed) trains hf_recipes/toy/toy-flags--mt-grpo.yaml from the same warm-started model and is
evaluated greedily on the 8 held-out countries (24 prompts) at its last step; the warm-started model itself
is evaluated once. The first table has the paper's columns (tool execution, answer in search results,
format, exact match: the recipe's reward functions), as means over seeds; then the first-turn tool-call
rate during training (rollout/tool_rate_turn0, first vs last 10 steps) and the first step at which the
trailing-10-step exact match on training rollouts reaches --target (a guess alone scores 0.25). Runs go to
bench/runs/paper-effect/N-steps/; a finished run is reused.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_modes import MODES, ROOT, steps_to, train_modes  # noqa: E402

RECIPE = "hf_recipes/toy/toy-flags--mt-grpo.yaml"
COLUMNS = {
    "tool_execution_reward": "tool execution",
    "answer_in_result_reward": "answer in search results",
    "format_reward": "format",
    "exact_answer_reward": "exact match",
}
EXACT = "exact_answer_reward"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="training seeds, one run per mode each"
    )
    ap.add_argument("--max-steps", type=int, default=20, help="training steps per run (32 episodes each)")
    ap.add_argument("--target", type=float, default=0.5, help="exact-match threshold for 'steps to'")
    return ap.parse_args(argv)


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
        f"Greedy eval on 24 held-out prompts after {len(next(iter(runs.values())))} steps, mean over seeds "
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
        "Exact match per seed (greedy, held out):",
        "",
        "| Method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---" * (len(seeds) + 1) + "|",
    ]
    em = {mode: [final_eval(runs[(mode, s)])[EXACT] for s in seeds] for mode in MODES}
    out += [f"| {name} | " + " | ".join(f"{x:.3f}" for x in em[mode]) + " |" for mode, name in MODES.items()]
    wins = sum(a > b for a, b in zip(em["mt_grpo"], em["grpo_outcome"]))
    out += ["", f"MT-GRPO's exact match is above GRPO-OR's on {wins} of {len(seeds)} seeds."]
    return "\n".join(out)


def main():
    args = parse_args()
    # One thread per trainer: on a shared 2-core machine torch's default threads oversubscribe the cores,
    # and a step took 15-30 s instead of under 1 s.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs_dir = os.path.join(ROOT, "bench", "runs", "paper-effect")
    warm_dir = os.path.join(runs_dir, "warmstart")
    if not os.path.isfile(os.path.join(warm_dir, "eval", "metrics.jsonl")):
        print("[bench] warm-started model, eval ...", flush=True)  # also builds the model on first use
        subprocess.run(
            [sys.executable, "mt_grpo_trainer.py", "eval", RECIPE, f"output_dir={warm_dir}"],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    with open(os.path.join(warm_dir, "eval", "metrics.jsonl")) as f:
        warm = final_eval([json.loads(line) for line in f])
    runs = train_modes(
        RECIPE,
        args.seeds,
        args.max_steps,
        os.path.join(runs_dir, f"{args.max_steps}-steps"),
        overrides=[f"eval_steps={args.max_steps}", f"save_steps={args.max_steps}"],
    )
    print("\n" + tables(runs, args.seeds, args.target, warm))


if __name__ == "__main__":
    main()
