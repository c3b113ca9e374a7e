"""MT-GRPO vs GRPO-OR vs GRPO-MR on the embedded toy task, same seeds, same warm-started model.

    .venv/bin/python bench/toy_modes.py [--seeds 0 1 2] [--max-steps 100] [--target 0.8] [--out DIR] [--set key=value ...]

For each (mode, seed) it trains the default recipe with `advantage_mode` set and reports the first
step at which the outcome reward, averaged over the trailing 10 steps, reaches the target ("not
reached" within the step budget otherwise). Steps, not seconds, so the table does not depend on the
machine. Runs go to --out (bench/runs/); a finished run is reused. --set adds overrides to every run.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
MODES = {"mt_grpo": "MT-GRPO", "grpo_outcome": "GRPO-OR", "grpo_merged": "GRPO-MR"}


def steps_to(metrics, target, window=10, key="reward/outcome"):
    """The first step at which `key`, averaged over the trailing `window` steps, reaches `target` (None: never)."""
    r = [m[key] for m in metrics]
    for i in range(window, len(r) + 1):
        if sum(r[i - window : i]) / window >= target:
            return i
    return None


def train_modes(recipe, seeds, max_steps, runs_dir, overrides=()):
    """Train `recipe` once per (advantage mode, seed) into runs_dir/MODE-seedS, reusing a finished run;
    returns {(mode, seed): the run's metrics.jsonl rows}."""
    runs = {}
    for mode in MODES:
        for seed in seeds:
            out = os.path.join(runs_dir, f"{mode}-seed{seed}")
            path = os.path.join(out, "metrics.jsonl")
            done = os.path.isfile(path) and max(json.loads(line)["step"] for line in open(path)) == max_steps
            if not done:
                if os.path.isfile(path):
                    os.remove(path)
                print(f"[bench] {mode} seed {seed} ...", flush=True)
                subprocess.run(
                    [
                        sys.executable,
                        "mt_grpo_trainer.py",
                        recipe,
                        f"advantage_mode={mode}",
                        f"seed={seed}",
                        f"max_steps={max_steps}",
                        f"output_dir={out}",
                        "log_episodes_steps=0",
                        *overrides,
                    ],
                    cwd=ROOT,
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            runs[(mode, seed)] = [m for m in map(json.loads, open(path)) if m["step"] > 0]  # trained steps
    return runs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "runs"))
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of every run")
    args = ap.parse_args()
    results = {}
    runs = train_modes(RECIPE, args.seeds, args.max_steps, os.path.abspath(args.out), args.set)
    for (mode, seed), metrics in runs.items():
        last = sum(m["reward/outcome"] for m in metrics[-10:]) / 10
        results[(mode, seed)] = (steps_to(metrics, args.target), metrics[0]["reward/outcome"], last)
    print(
        f"\nSteps until the trailing-10-step outcome reward reaches {args.target} "
        f"(budget {args.max_steps} steps, 64 episodes per step):\n"
    )
    print("| Method | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | last-10 outcome (mean) |")
    print("|---|" + "---|" * (len(args.seeds) + 2))
    for mode, name in MODES.items():
        steps = [results[(mode, s)][0] for s in args.seeds]
        reached = [s for s in steps if s is not None]
        mean = (
            f"{sum(reached) / len(reached):.0f}"
            + ("" if len(reached) == len(steps) else f" ({len(reached)}/{len(steps)} reached)")
            if reached
            else "not reached"
        )
        lasts = sum(results[(mode, s)][2] for s in args.seeds) / len(args.seeds)
        print(
            f"| {name} (`{mode}`) | "
            + " | ".join(str(s) if s is not None else "not reached" for s in steps)
            + f" | {mean} | {lasts:.3f} |"
        )


if __name__ == "__main__":
    main()
