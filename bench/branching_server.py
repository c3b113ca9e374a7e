"""Branching through the real vLLM server: what the tree samples, and how much of what it sends again the server's
prefix cache serves, from the server's own counters (GET /metrics), against independent episodes.

    .venv/bin/python bench/branching_server.py [--steps 3]

Both runs train hf_recipes/toy/toy-chain--mt-grpo.yaml in run.sh's server layout (`MTGRPO_LAYOUT=server`: vLLM's CPU
build and one training rank) from the same warm-started model, 4 prompts a step: 8 independent episodes a prompt
(`reward_to_go`), and a tree of 32 leaves from 4 roots (`tree`, b 2, depth 3), as bench/turn_credit.py compares them.
Per run: the tokens sampled and trained a step, the prefix-cache hit rate (the share of prompt tokens whose KV the
server found cached: a turn's history, and a sibling's shared prefix), and the rollout time. Runs go to
bench/runs/branching-server/.
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from async_overlap import started  # noqa: E402
from turn_credit import METHODS, RECIPE  # noqa: E402

RUNS = {  # the two runs as bench/turn_credit.py defines them
    "independent (8 episodes a prompt)": METHODS["reward_to_go"][1],
    "tree (b 2, depth 3, 32 leaves)": METHODS["tree"][1],
}


def run(name: str, overrides: list[str], steps: int) -> list[dict]:
    out = os.path.join(ROOT, "bench", "runs", "branching-server", name.split()[0])
    env = {"MTGRPO_LAYOUT": "server", "MTGRPO_VLLM_LOG": f"{out}.vllm.log"}
    args = [f"max_steps={steps}", f"output_dir={out}", "log_episodes_steps=0", "eval_steps=0", "save_steps=0"]
    print(f"[bench] {name} ...", flush=True)
    with started(["bash", "run.sh", RECIPE, *args, *overrides], env) as p:  # its process groups stop however it ends
        if p.wait():
            sys.exit(f"run {out} failed (exit {p.returncode}); its vLLM log: {out}.vllm.log")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, overrides in RUNS.items():
        ms = run(name, overrides, args.steps)
        episodes = [4 * m["rollout/paths_per_prompt"] for m in ms]
        rows.append(
            (
                name,
                statistics.mean(m["rollout/sampled_tokens"] * n for m, n in zip(ms, episodes)),
                statistics.mean(m["rollout/tokens_trained"] * n for m, n in zip(ms, episodes)),
                statistics.mean(m["rollout/paths_per_prompt"] for m in ms),
                statistics.mean(m.get("rollout/prefix_cache_hit_rate", float("nan")) for m in ms[1:]),
                statistics.mean(m["time/rollout"] for m in ms[1:]),
            )
        )
    print(f"\nMeans per step over {args.steps} steps (hit rate and rollout time: steps 2 on, after set-up):\n")
    print("| rollouts | sampled tokens | trained tokens | paths a prompt | prefix-cache hit rate | rollout s |")
    print("|---|---|---|---|---|---|")
    for name, sampled, trained, paths, hits, seconds in rows:
        print(f"| {name} | {sampled:.0f} | {trained:.0f} | {paths:.1f} | {hits:.3f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
