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
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = "hf_recipes/toy/toy-chain--mt-grpo.yaml"
HOP = "turn_reward_funcs=[rewards/toy_chain_reward.py:hop_reward]"
RUNS = {
    "independent (8 episodes a prompt)": ["advantage_mode=reward_to_go", HOP],
    "tree (b 2, depth 3, 32 leaves)": [
        "advantage_mode=tree",
        HOP,
        "branch_width=2",
        "branch_depth=3",
        "num_generations=32",
    ],
}


def run(name: str, overrides: list[str], steps: int) -> list[dict]:
    out = os.path.join(ROOT, "bench", "runs", "branching-server", name.split()[0])
    env = {**os.environ, "MTGRPO_LAYOUT": "server", "MTGRPO_VLLM_LOG": f"{out}.vllm.log"}
    args = [f"max_steps={steps}", f"output_dir={out}", "log_episodes_steps=0", "eval_steps=0", "save_steps=0"]
    print(f"[bench] {name} ...", flush=True)
    subprocess.run(["bash", "run.sh", RECIPE, *args, *overrides], cwd=ROOT, env=env, check=True)
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
