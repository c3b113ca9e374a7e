"""Branching through the real vLLM server: what the tree samples, and how much of what it sends again the server's
prefix cache serves, from the server's own counters (GET /metrics), against independent episodes.

    .venv/bin/python bench/branching_server.py [--steps 3] [--out DIR] [--server-url URL] [--set key=value ...]

Both runs train hf_recipes/toy/toy-chain--mt-grpo.yaml in run.sh's server layout (`MTGRPO_LAYOUT=server`: vLLM's CPU
build and one training rank) from the same warm-started model, 4 prompts a step: 8 independent episodes a prompt
(`reward_to_go`), and a tree of 32 leaves from 4 roots (`tree`, b 2, depth 3), both with each lookup turn's own reward
(`hop_reward`). Per run: the tokens sampled and trained a step, the prefix-cache hit rate (the share of prompt tokens
whose KV the server found cached: a turn's history, and a sibling's shared prefix), and the rollout time. Runs go to
--out (bench/runs/branching-server/). With --server-url both runs join a server that already runs (run.sh's
`--server-url`) instead of starting their own; --set adds overrides to both runs.
"""

import argparse
import json
import os
import statistics
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from async_overlap import started  # noqa: E402

RECIPE = "hf_recipes/toy/toy-chain--mt-grpo.yaml"
HOP = "turn_reward_funcs=[rewards/toy_chain_reward.py:hop_reward]"  # each lookup turn its own reward
CHAIN_TREE = ["advantage_mode=tree", HOP, "branch_width=2", "branch_depth=3", "num_generations=32"]
RUNS = {
    "independent (8 episodes a prompt)": ["advantage_mode=reward_to_go", HOP],
    "tree (b 2, depth 3, 32 leaves)": CHAIN_TREE,
}


def run(name: str, overrides: list[str], a) -> list[dict]:
    out = os.path.join(a.out, name.split()[0])
    env = {"MTGRPO_LAYOUT": "server", "MTGRPO_VLLM_LOG": f"{out}.vllm.log"}
    args = [f"max_steps={a.steps}", f"output_dir={out}", "log_episodes_steps=0", "eval_steps=0", "save_steps=0"]
    server = []
    if a.server_url:
        server = ["--server-url", a.server_url]
    print(f"[bench] {name} ...", flush=True)
    cmd = ["bash", "run.sh", RECIPE, *server, *args, *overrides, *a.set]
    with started(cmd, env) as p:  # its process groups stop however it ends
        if p.wait():
            sys.exit(f"run {out} failed (exit {p.returncode}); its vLLM log: {out}.vllm.log")
    with open(os.path.join(out, "config.yaml")) as f:  # the run's resolved config: --set may change the prompts
        prompts = yaml.safe_load(f)["prompts_per_step"]
    return [{**json.loads(line), "prompts": prompts} for line in open(os.path.join(out, "metrics.jsonl"))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "runs", "branching-server"))
    ap.add_argument("--server-url", default="", help="a vLLM server that runs already (it is synced to each run)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of both runs")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2: the hit rate and the rollout time are read from step 2 on")
    args.out = os.path.abspath(args.out)
    rows = []
    for name, overrides in RUNS.items():
        ms = run(name, overrides, args)
        episodes = [m["prompts"] * m["rollout/paths_per_prompt"] for m in ms]
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
