"""One recipe, both layouts, side by side in one run: the in-process sampler (MTGRPO_LAYOUT=local) against the
real vLLM server beside torchrun (MTGRPO_LAYOUT=server; vLLM's CPU build where there is no GPU).

    .venv/bin/python bench/server_vs_local.py hf_recipes/HuggingFaceTB/SmolLM2-135M-Instruct--triviaqa-cpu.yaml --steps 2
    .venv/bin/python bench/server_vs_local.py hf_recipes/toy/toy-kv--mt-grpo.yaml --steps 100
    .venv/bin/python bench/server_vs_local.py RECIPE --server-url URL [key=value ...]   # the server layout joins URL

Prints the mean per-step times of each layout, the server's start-up, the learning curve (outcome reward:
step 1, first and last 10-step means, the first step whose trailing 10-step mean reaches 0.8) and the
sampler/trainer agreement figures. Both runs go through `bash run.sh`, as a user runs them.
"""

import argparse
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="bench/runs/server_vs_local")
    ap.add_argument("--server-url", default="", help="the server layout joins this running server (run.sh's own)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()  # key=value overrides before or after the options
    rows = {}
    for layout in ("local", "server"):
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
    ratio = np.mean([m["time/step"] for m in rows["server"][0]]) / np.mean([m["time/step"] for m in rows["local"][0]])
    print(f"\nserver step time / local step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
