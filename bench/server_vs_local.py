"""One recipe, both layouts, side by side in one run: the in-process sampler (MTGRPO_LAYOUT=local) against the
real vLLM server beside torchrun (MTGRPO_LAYOUT=server; vLLM's CPU build where there is no GPU).

    .venv/bin/python bench/server_vs_local.py hf_recipes/HuggingFaceTB/SmolLM2-135M-Instruct--triviaqa-cpu.yaml --steps 2
    .venv/bin/python bench/server_vs_local.py hf_recipes/toy/toy-kv--mt-grpo.yaml --steps 100
    .venv/bin/python bench/server_vs_local.py RECIPE --server-url URL [key=value ...]   # the server layout joins URL

Prints the mean per-step times of each layout, the server's start-up, the learning curve (outcome reward:
step 1, first and last 10-step means, the first step whose trailing 10-step mean reaches 0.8) and the
sampler/trainer agreement figures. Both runs go through `bash run.sh`, as a user runs them.

    .venv/bin/python bench/server_vs_local.py hf_recipes/toy/toy-kv--mt-grpo.yaml --steps 100 --layouts local \
        --seeds 0 1 2 3 4 5 --jobs 2

`--seeds`: one layout on several seeds (`bash run.sh RECIPE seed=N`), `--jobs` runs at once with `--threads` torch
threads each; the same figures per seed, then each as median [min, max], and how many seeds end (mean outcome of the
last 10 steps) at or above `--floor`. This is the measurement behind README's "The embedded default, measured".

Design of that measurement (issue 44: one `bash run.sh` on another machine ended at 0.672 over steps 91-100 against
the README's 0.875, after 0.87 at step 60). The recipe now decays its learning rate (cosine, peak 1e-3, to 0 at step
100) instead of holding 5e-4 constant. It was chosen on diagnostic seeds 10-13 only (metrics.jsonl, episodes and
checkpoints; docs/benchmarks.md); seeds 0-5 below were not run with it before this measurement. Seeds 0-5 of the
earlier recipe were measured before (docs/benchmarks.md, the agent-harness bench's built-in rows: steps 91-100
0.847-0.908, median 0.870; trailing-10 >= 0.8 at steps 37-60, median 43.5) and serve as the baseline below.
Prediction: steps 91-100 at 0.85 or above on every seed, median about 0.90; trailing-10 >= 0.8 at a median step of
about 40; step 1 as before (no update precedes it) and steps 1-10 within 0.05 of before.
Decision rule, fixed before the run: the recipe change stands if (a) every seed's steps 91-100 outcome is >= 0.8,
(b) their median is >= 0.850 (the earlier median 0.870 less 0.02), and (c) the median step where trailing-10 reaches
0.8 is <= 50. If (a) fails the change did not make the default robust, and the README says what was measured.

A second measurement, a new experiment written here after the first was seen: the first passed its rule, but an
exploratory variant (10 warmup steps to the same 1e-3 peak) collapsed for good on seed 3 at step 13 (every episode
ran to max_tokens), and seed 0 of the measured recipe dipped to 0.00-0.08 at steps 2-6: a 1e-3 peak sits near where
this model breaks, and a user's machine may land on the other side. The same decay from the old constant's 5e-4 keeps
the first steps as the earlier recipe took them (no collapse in any run measured) and still quiets the late ones.
Design: `... RECIPE learning_rate=5.0e-4 --seeds 0 1 2 3 4 5 --jobs 2 --out bench/runs/default-5e-4` (cosine to 0 at step
100, all else as the recipe). Prediction: steps 91-100 >= 0.85 on every seed, median about 0.89; trailing-10 >= 0.8
at a median step of about 45; steps 1-10 near the constant recipe's, no dip. Decision rule, fixed before the run: the
default becomes the 5e-4 peak if (a) every seed's steps 91-100 outcome is >= 0.8, (b) their median is >= 0.850,
(c) the median step where trailing-10 reaches 0.8 is <= 55, and (d) no seed's steps 1-10 mean is below 0.2;
otherwise it stays at the 1e-3 peak, and the README says both were measured.
"""

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(layout, recipe, steps, out, extra):
    env = {**os.environ, "MTGRPO_LAYOUT": layout, "MTGRPO_VLLM_LOG": f"{out}.vllm.log"}
    t = time.time()
    r = subprocess.run(
        ["bash", "run.sh", recipe, f"max_steps={steps}", f"output_dir={out}", "save_steps=0", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.time() - t
    if r.returncode:
        sys.exit(f"{layout} run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    start = re.search(r"vLLM is healthy at \S+ after (\d+) s", r.stdout)
    return (
        [m for m in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if m["step"] > 0],  # trained steps
        wall,
        int(start.group(1)) if start else None,
    )


def curve(h):
    o = [m["reward/outcome"] for m in h]
    k = min(10, len(o))
    trailing = [np.mean(o[max(0, i - 9) : i + 1]) for i in range(len(o))]
    reached = next((i + 1 for i, v in enumerate(trailing) if i >= 9 and v >= 0.8), None)
    return o[0], np.mean(o[:k]), np.mean(o[-k:]), reached


def spread(values, fmt):
    """Median [min, max] of a figure over seeds."""
    return f"{np.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def seed_table(a):
    """--seeds: the recipe in one layout on each seed, `--jobs` runs at once; per seed and as median [range]."""
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # each run's torch threads (a lone `bash run.sh` takes every core)
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        futures = {}
        for seed in a.seeds:
            out = os.path.join(a.out, f"{a.layouts[0]}-seed{seed}")
            futures[seed] = pool.submit(run, a.layouts[0], a.recipe, a.steps, out, [f"seed={seed}", *a.overrides])
        rows = {seed: fut.result() for seed, fut in futures.items()}
    print(
        f"\n{a.recipe}, layout {a.layouts[0]}, {a.steps} steps, {a.jobs} run(s) at once with {a.threads} thread(s) each:\n"
    )
    print(
        "| seed | step 1 | steps 1-10 | last 10 | trailing-10 >= 0.8 at step | per step (rollout + train) | whole run (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    figures = {}
    for seed, (h, wall, _) in rows.items():
        first, early, late, reached = curve(h)
        step = np.mean([m["time/step"] for m in h])
        rollout = np.mean([m["time/rollout"] for m in h])
        train = np.mean([m["time/train"] for m in h])
        figures[seed] = (first, early, late, reached, step, rollout, train, wall)
        print(
            f"| {seed} | {first:.3f} | {early:.3f} | {late:.3f} | {reached or 'not reached'} | "
            f"{step:.2f} s ({rollout:.2f} + {train:.2f}) | {wall:.0f} |"
        )
    cols = list(zip(*figures.values()))
    reached = [r for r in cols[3] if r is not None]
    print(
        f"| median [range] | {spread(cols[0], '.3f')} | {spread(cols[1], '.3f')} | {spread(cols[2], '.3f')} | "
        + (f"{spread(reached, '.0f')} ({len(reached)} of {len(a.seeds)} reached)" if reached else "not reached")
        + f" | {spread(cols[4], '.2f')} s ({np.median(cols[5]):.2f} + {np.median(cols[6]):.2f}) | {spread(cols[7], '.0f')} |"
    )
    low = [seed for seed, f in figures.items() if f[2] < a.floor]
    print(
        f"\nlast-10 outcome >= {a.floor} on {len(a.seeds) - len(low)} of {len(a.seeds)} seeds"
        + (f"; below: {low}" if low else "")
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="bench/runs/server_vs_local")
    ap.add_argument("--seeds", type=int, nargs="+", help="one layout on these seeds: per seed, and median [range]")
    ap.add_argument("--layouts", nargs="+", choices=("local", "server"), default=["local", "server"])
    ap.add_argument("--jobs", type=int, default=1, help="with --seeds: runs at once")
    ap.add_argument("--threads", type=int, default=1, help="with --seeds: OMP_NUM_THREADS of each run")
    ap.add_argument("--floor", type=float, default=0.8, help="with --seeds: the last-10 outcome every seed must reach")
    ap.add_argument("--server-url", default="", help="the server layout joins this running server (run.sh's own)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()  # key=value overrides before or after the options
    if a.seeds:
        if len(a.layouts) != 1:
            sys.exit("--seeds runs one layout: add --layouts local (or server)")
        return seed_table(a)
    rows = {}
    for layout in a.layouts:
        extra = a.overrides
        if layout == "server" and a.server_url:
            extra = ["--server-url", a.server_url, *extra]
        rows[layout] = run(layout, a.recipe, a.steps, os.path.join(a.out, layout), extra)
    keys = ["time/rollout", "time/train", "time/weight_sync", "time/step"]
    print(f"\n{a.recipe}, {a.steps} steps, per-step means (s):\n")
    print("| layout | " + " | ".join(k.split("/")[1] for k in keys) + " | server start (s) | wall (s) |")
    print("|---|" + "---|" * (len(keys) + 2))
    for layout, (h, wall, start) in rows.items():
        cells = [f"{np.mean([m[k] for m in h]):.2f}" if k in h[0] else "-" for k in keys]
        print(f"| {layout} | " + " | ".join(cells) + f" | {start if start is not None else '-'} | {wall:.0f} |")
    print(
        "\n| layout | outcome step 1 | first 10 | last 10 | trailing-10 >= 0.8 at step | sampler_logprob_diff | probe_logprob_diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for layout, (h, _, _) in rows.items():
        first, early, late, reached = curve(h)
        probe = [m["sync/probe_logprob_diff"] for m in h if "sync/probe_logprob_diff" in m]
        print(
            f"| {layout} | {first:.3f} | {early:.3f} | {late:.3f} | {reached or 'not reached'} | "
            f"{np.mean([m['rollout/sampler_logprob_diff'] for m in h]):.5f} | "
            + (f"{np.mean(probe):.4f} (max {max(probe):.4f})" if probe else "-")
            + " |"
        )
    if len(rows) == 2:
        ratio = np.mean([m["time/step"] for m in rows["server"][0]]) / np.mean(
            [m["time/step"] for m in rows["local"][0]]
        )
        print(f"\nserver step time / local step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
