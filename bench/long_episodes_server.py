"""One real training step of 128-turn tool episodes through the vLLM server (MTGRPO_LAYOUT=server: vLLM's CPU
build where there is no GPU), as a user runs it: `bash run.sh` on the toy recipe with a long-episode model.

    .venv/bin/python bench/long_episodes_server.py [--turns 128] [--steps 1] [--out DIR] [key=value ...]
    .venv/bin/python bench/long_episodes_server.py --model DIR --server-url URL   # a model a running server serves

The toy model cannot hold 128 turns: its warm-start saw two-turn episodes of at most ~100 tokens, and a
1,024-position context. So this script first builds a *looping* model with the toy's tokenizer and architecture
and a context of --max-seq-len positions, warm-started on episodes that look the question's key up again and
again (turns + 8 calls, then the answer), so that its sampled episodes run into max_env_steps = turns. Then one
run of the toy recipe with max_env_steps = turns through `bash run.sh`: every turn is a request to the real
server, every boundary goes through the env's extend-or-fork (and its bridge), and the step trains on what came
back. Printed: the build, the step's times, and per episode its turns, tool calls, samples, tokens, forks,
realigns and the episode-end tokenization check; the sampler/trainer logprob agreement; the gradient norm.
--model runs another model folder instead of building the looping one; --server-url joins a server that runs already
(serving that model) instead of starting one.
"""

import argparse
import json
import os
import random
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_vs_local import run  # noqa: E402
from tasks import toy_kv  # noqa: E402


def looping_demonstration(row, calls: int):
    """The toy's always-lookup demonstration with its call and result repeated: the question, `calls` lookups of
    its key (each followed by the result), then the answer."""
    question, call, result, answer = toy_kv.demonstration(row, "", random.Random(0), p_tool=1.0)
    return [question, *[call, result] * calls, answer]


def build_looping_model(path: str, calls: int, max_positions: int, steps: int):
    """Phase 1: the toy's own warm-start on short always-lookup demonstrations (the protocol, copying the key);
    phase 2: `steps` more steps, one at a time, on demonstrations of `calls` lookups that fill the context."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    rng = random.Random(0)
    short = [toy_kv.demonstration(r, "", rng, p_tool=1.0) for r in toy_kv.make_dataset(2048, seed=1)]
    corpus = [f"{m['role']}\n{m['content']}" for d in short[:512] for m in d] + toy_kv.VALUES + toy_kv.KEYS
    tok = toy_kv.build_tokenizer(corpus)
    ws = dict(toy_kv.WARMSTART, steps=200, lookup_only_steps=200, max_positions=max_positions)
    toy_kv.warm_start(path, tok, short, short, ws, rng, "bench/long_episodes_server.py", t0)
    model = AutoModelForCausalLM.from_pretrained(path)
    demos = [toy_kv.assistant_mask(tok, looping_demonstration(r, calls)) for r in toy_kv.make_eval_dataset()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(steps):
        ids, mask = rng.choice(demos)
        loss = model(
            input_ids=torch.tensor([ids]), labels=torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
        ).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    print(
        f"[bench] looping model: 200 short warm-start steps, then {steps} steps on {calls}-call demonstrations of "
        f"{len(demos[0][0])} tokens (final loss {loss.item():.4f}), {time.time() - t0:.0f} s",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--warm-steps", type=int, default=60)
    ap.add_argument("--out", default="bench/runs/long_episodes_server")
    ap.add_argument("--model", default="", help="this model folder instead of the looping model built in --out")
    ap.add_argument("--server-url", default="", help="a running server of that model (run.sh's --server-url)")
    ap.add_argument("overrides", nargs="*", help="more key=value overrides of the toy recipe")
    a = ap.parse_intermixed_args()  # key=value overrides before or after the options
    model = a.model or os.path.join(a.out, "model")
    os.makedirs(a.out, exist_ok=True)
    if not os.path.isfile(os.path.join(model, "build_report.json")):
        build_looping_model(model, a.turns + 8, a.max_seq_len, a.warm_steps)
    server = []
    if a.server_url:
        server = ["--server-url", a.server_url]
    out = os.path.join(a.out, "run")
    h, wall, start = run(
        "server",
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        a.steps,
        out,
        [
            *server,
            f"model_name_or_path={model}",
            "model_builder=",
            f"max_env_steps={a.turns}",
            f"max_seq_len={a.max_seq_len}",
            "prompts_per_step=2",
            "num_generations=4",
            "micro_batch_size=1",
            "eval_steps=0",
            "log_episodes_steps=1",
            "temperature=0.5",
            *a.overrides,
        ],
    )
    print(
        f"\n{a.steps} step(s) of {a.turns}-turn episodes through the vLLM server (start {start} s, wall {wall:.0f} s)\n"
    )
    for m in h:
        print(
            f"step {m['step']}: "
            + ", ".join(
                f"{k} {m[k]:.4g}"
                for k in (
                    "time/rollout",
                    "time/train",
                    "time/weight_sync",
                    "time/step",
                    "rollout/sampler_logprob_diff",
                    "loss/grad_norm",
                    "reward/outcome",
                    "reward/turn",
                )
                if k in m
            )
        )
    print(
        "\n| step | episode | end | turns | tool calls | samples | tokens | trained tokens | forks | realigns "
        "| tokenization mismatches |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    eps = [json.loads(x) for x in open(os.path.join(out, "episodes.jsonl"))]
    tokens = [sum(len(s["input_ids"]) for s in e["samples"]) for e in eps]
    for e, n in zip(eps, tokens):
        trained = sum(sum(s["loss_mask"]) for s in e["samples"])
        turns = sum(m["role"] == "assistant" for m in e["messages"])
        print(
            f"| {e['step']} | {e['episode']} | {e['end_reason']} | {turns} | {e['tool_calls']} | {len(e['samples'])} | "
            f"{n} | {trained} | {e['forks']} | {e['realigns']} | {e['tokenization_mismatches']} |"
        )
    print(
        f"\nmean tokens per episode {np.mean(tokens):.0f}; "
        f"episodes of one sample: {sum(len(e['samples']) == 1 for e in eps)}/{len(eps)}"
    )


if __name__ == "__main__":
    main()
