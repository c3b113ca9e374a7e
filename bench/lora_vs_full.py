"""LoRA against full fine-tuning on the same model, side by side in one run, through the real vLLM server
(MTGRPO_LAYOUT=server: vLLM's CPU build where there is no GPU).

    .venv/bin/python bench/lora_vs_full.py hf_recipes/toy/toy-kv--mt-grpo.yaml --steps 60 --lora lora_rank=8 learning_rate=5e-3
    .venv/bin/python bench/lora_vs_full.py RECIPE --server-url URL [--set key=value ...]   # both join a running server

Two runs of the recipe through `bash run.sh`: LoRA (the recipe with the `--lora` overrides; give LoRA its own learning
rate, as is usual: its update is scaled by lora_alpha / rank), then full fine-tuning (the recipe as it is). LoRA goes
first: it syncs only its adapter, so it needs the server's base weights as built, which full fine-tuning changes.
Prints, per run: the mean weight-sync time and the bytes each sync writes (the full model in bf16, or the
adapter in float32, from the last checkpoint's tensors), the step times, and the learning curve (outcome reward:
step 1, first and last 10-step means, the first step whose trailing 10-step mean reaches 0.8).
With --server-url both runs join that server (started with LoRA enabled: `bash run.sh serve RECIPE lora_rank=R`)
instead of starting their own; --set adds overrides to both runs.
"""

import argparse
import os
import sys

import numpy as np
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_vs_local import curve, run  # noqa: E402


def synced_bytes(out: str) -> int:
    """What one sync writes: the adapter's float32 tensors (LoRA), or every tensor of the model as bf16 (full)."""
    ckpt = max((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))
    lora = os.path.isfile(os.path.join(out, ckpt, "adapter_model.safetensors"))
    with safe_open(os.path.join(out, ckpt, "adapter_model.safetensors" if lora else "model.safetensors"), "pt") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()) * (4 if lora else 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="bench/runs/lora_vs_full")
    ap.add_argument("--lora", nargs="+", default=["lora_rank=8", "learning_rate=5e-3"])
    ap.add_argument("--server-url", default="", help="a running server for both runs (run.sh's own --server-url)")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of both runs")
    a = ap.parse_args()
    server = []
    if a.server_url:
        server = ["--server-url", a.server_url]
    rows = {}
    os.makedirs(a.out, exist_ok=True)  # run.sh writes the server's log beside each run's folder
    for name, extra in (("LoRA " + " ".join(a.lora), a.lora), ("full", [])):
        out = os.path.join(a.out, name.split()[0].lower())
        overrides = [*server, *extra, f"save_steps={a.steps}", "eval_steps=0", *a.set]
        h, wall, start = run("server", a.recipe, a.steps, out, overrides)
        rows[name] = (h, wall, synced_bytes(out))
    print(f"\n{a.recipe}, {a.steps} steps through the vLLM server, per-step means:\n")
    print("| run | weight sync (s) | bytes per sync | rollout (s) | train (s) | step (s) | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, (h, wall, nbytes) in rows.items():
        t = {k: np.mean([m[f"time/{k}"] for m in h]) for k in ("weight_sync", "rollout", "train", "step")}
        print(
            f"| {name} | {t['weight_sync']:.3f} | {nbytes / 1e6:.2f} MB | {t['rollout']:.2f} | {t['train']:.2f} | "
            f"{t['step']:.2f} | {wall:.0f} |"
        )
    print("\n| run | outcome step 1 | first 10 | last 10 | trailing-10 >= 0.8 at step | probe_logprob_diff (max) |")
    print("|---|---|---|---|---|---|")
    for name, (h, _, _) in rows.items():
        first, early, late, reached = curve(h)
        probe = max(m["sync/probe_logprob_diff"] for m in h)
        print(f"| {name} | {first:.3f} | {early:.3f} | {late:.3f} | {reached or 'not reached'} | {probe:.4f} |")


if __name__ == "__main__":
    main()
