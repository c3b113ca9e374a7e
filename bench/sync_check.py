"""The weight-sync check's margin on the real vLLM CPU build: what it measures after correct syncs and after a reload
that did nothing, on the warm-started toy model, at learning rates whose one-step change on the probe runs from
several times the bf16 gap down to a small fraction of it.

    .venv/bin/python bench/sync_check.py                                  # lr 1e-4 3e-5 1e-5 1e-6, 8 steps each
    .venv/bin/python bench/sync_check.py --lrs 1e-5 --steps 20 --staleness 1
    .venv/bin/python bench/sync_check.py --lora 8 --lrs 1e-3 1e-4 1e-5     # LoRA: each sync loads an adapter

One `bash run.sh serve`; each run trains in this process with rewards 0, 1, 0, 1 in every group (so every step moves
the weights). Per learning rate and max_staleness: a synced run, whose every sync logs the trainer's change on the
probe since the last judged sync (`sync/probe_change`), the bf16 gap (`sync/probe_logprob_diff`), the server's noise
(`sync/probe_repeat`, two probes of one sync) and, when judged, the share of probe tokens the server's logprobs moved
on (`sync/probe_follow`, >= 0.5 passes); then a run whose reloads after the first do nothing: the step it stopped
at and the share it measured there.
"""

import argparse
import os
import re
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import mt_grpo_trainer as M  # noqa: E402
from async_overlap import RECIPE, served  # noqa: E402


def run(a, model, url, lr, staleness, name, skip=False):
    overrides = [
        f"lora_rank={a.lora}",
        f"output_dir={os.path.join(a.out, name)}",
        f"model_name_or_path={model}",
        "model_builder=",
        f"vllm_server_url={url}",
        f"weight_sync_dir={os.path.join(a.out, 'shm')}",
        f"turn_reward_funcs=[{os.path.join(a.out, 'alternating.py')}:alternating]",
        "prompts_per_step=4",  # a step whose every group sampled 4 equal episodes would not move the weights
        "num_generations=4",
        f"learning_rate={lr}",
        f"max_staleness={staleness}",
        f"max_steps={a.steps}",
        "save_steps=0",
        "log_episodes_steps=0",
    ]
    real = M.VLLMServerClient.sync_weights
    if skip:  # the reload after every step does nothing; the first sync (before step 1) takes
        M.VLLMServerClient.sync_weights = lambda self, m, sd, v: v == 0 and real(self, m, sd, v)
    try:
        hist = M.train(M.load_config(RECIPE, overrides))
    except M.SyncCheckError as e:
        return str(e)
    finally:
        M.VLLMServerClient.sync_weights = real
    if len(hist) < a.steps:  # SIGTERM or Ctrl-C: the trainer saved and returned early; the bench (and its server) stop
        sys.exit(143)
    return hist


def span(xs, f="{:.4f}"):
    return f"{f.format(min(xs))}–{f.format(max(xs))}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-5, 1e-5, 1e-6])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lora", type=int, default=0, help="lora_rank (0: full fine-tuning)")
    ap.add_argument("--out", default="bench/runs/sync_check")
    a = ap.parse_args()
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "alternating.py"), "w") as f:
        f.write("def alternating(completions, **_):\n    return [float(i % 2) for i in range(len(completions))]\n")
    cfg = M.load_config(RECIPE, [f"output_dir={a.out}/build"])
    M.build_model_if_missing(cfg, print)
    model = os.path.abspath(cfg.model_name_or_path)
    port = M.free_port()
    url = f"http://127.0.0.1:{port}"
    env = ["env", "MTGRPO_LAYOUT=server", f"MTGRPO_VLLM_PORT={port}"]  # run.sh finds the vLLM CPU build's venv
    rows, t = [], time.time()
    serve = [*env, "bash", "run.sh", "serve", RECIPE, f"model_name_or_path={model}", f"lora_rank={a.lora}"]
    with served([*serve, f"max_staleness={max(a.staleness)}"], url, 1200):  # LoRA: room for the adapters in flight
        print(f"vLLM CPU build healthy after {time.time() - t:.0f} s", flush=True)
        for lr in a.lrs:
            for k in a.staleness:
                hist = run(a, model, url, lr, k, f"lr{lr}-k{k}")
                if isinstance(hist, str):  # a false alarm: the finding, not the bench's error
                    print(f"  lr {lr} max_staleness {k}: a correct run stopped: {hist}", flush=True)
                    continue
                stopped = run(a, model, url, lr, k, f"lr{lr}-k{k}-skipped", skip=True)
                rows.append((lr, k, hist, stopped))
                print(f"  lr {lr} max_staleness {k}: done", flush=True)
    how = f"LoRA rank {a.lora}" if a.lora else "full fine-tuning"
    print(f"\nsync check, real vLLM CPU build, warm-started toy model, {how}, {a.steps} syncs per run\n")
    print(
        "| lr | max_staleness | gap (probe_logprob_diff) | change (probe_change) | change / gap | judged "
        "| tokens moved, correct syncs (probe_follow) | server noise (probe_repeat) | reloads skipped: stopped at, moved |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for lr, k, hist, stopped in rows:
        judged = [m for m in hist if "sync/probe_follow" in m]
        ch, gap = [m["sync/probe_change"] for m in hist], [m["sync/probe_logprob_diff"] for m in hist]
        said = stopped if isinstance(stopped, str) else ""  # a run that did not stop returns its metrics
        found = re.search(r"after step (\d+) on \S+: .* the server's on (\d+%) of its tokens", said)
        print(
            f"| {lr:g} | {k} | {span(gap)} | {span(ch)} | {span(np.divide(ch, gap), '{:.2f}')} | "
            f"{len(judged)}/{len(hist)} | {span([m['sync/probe_follow'] for m in judged], '{:.2f}') if judged else '-'} | "
            f"{max(m['sync/probe_repeat'] for m in hist):.4f} | "
            + (f"step {found[1]}, {found[2]} |" if found else "never |")
        )


if __name__ == "__main__":
    main()
