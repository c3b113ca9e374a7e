"""The weight-sync check's margin on the real vLLM CPU build: the statistic it judges and its threshold, after correct
syncs, correct syncs read through Gaussian noise (what a GPU server that is not batch-invariant gives), reloads that
did nothing and partial reloads, on the warm-started toy model, at learning rates whose one-step change on the probe
runs from several times the bf16 gap down to a small fraction of it.

    .venv/bin/python bench/sync_check.py                                  # lr 1e-4 1e-5 1e-6, 8 steps each
    .venv/bin/python bench/sync_check.py --lrs 1e-5 --steps 20 --staleness 1
    .venv/bin/python bench/sync_check.py --lora 8 --lrs 1e-3 1e-4 1e-5     # LoRA: each sync loads an adapter
    .venv/bin/python bench/sync_check.py --server-url URL --model DIR        # a server that runs already, serving DIR

One `bash run.sh serve`; each run trains in this process with rewards 0, 1, 0, 1 in every group (so every step moves
the weights). Per learning rate and max_staleness, one run per kind of reload:
- `correct`: every reload takes;
- `noise S`: every reload takes, and Gaussian noise of standard deviation S is added to every probe logprob on its way
  back (the check's false alarms);
- `skipped`: every reload after the first does nothing;
- `partial`: every reload after the first leaves the last layer's MLP (of 2 layers) at the first sync's weights;
- `skipped, noise S` and `partial, noise S`: both faults (the check's misses under noise).
The statistic is the slope of the server's per-token logprob change on the trainer's, over two spans: since the last
judged sync (`sync/probe_follow`, judged once its standard error is <= 0.1, passes at 0.5 or more) and since the
server's first sync (`sync/probe_follow_run`, judged at <= 0.02, passes at 0.9 or more). A run that stops gives
the step, the span, the slope and its standard error.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import mt_grpo_trainer as M  # noqa: E402
from async_overlap import RECIPE, served  # noqa: E402

STOPPED = re.compile(
    r"after step (\d+) on \S+: since step \d+ .* moved (-?[\d.]+) times .*error ([\d.]+); .* 1 \+- ([\d.]+) "
)


def noisy_probe(sigma, real):
    """probe_logprobs with Gaussian noise of standard deviation `sigma` on every logprob."""
    rng = np.random.default_rng(0)

    def probe(self, ids):
        return {url: list(lps + rng.normal(0, sigma, len(lps))) for url, lps in real(self, ids).items()}

    return probe


def faulty_reload(kind, real):
    """sync_weights whose reloads after the first do nothing (`skipped`) or keep the last layer's MLP (`partial`)."""
    first = {}

    def sync_weights(self, model, state_dict, version):
        if kind == "skipped" and first:
            return None
        last = max(int(k.split("layers.")[1].split(".")[0]) for k in state_dict if "layers." in k)
        stale = {k: v.clone() for k, v in state_dict.items() if f"layers.{last}.mlp." in k}
        first.update({k: v for k, v in stale.items() if k not in first})
        if kind == "partial":
            state_dict = {**state_dict, **first}
        return real(self, model, state_dict, version)

    return sync_weights


def run(a, model, url, lr, staleness, kind):
    name = f"lr{lr}-k{staleness}-{kind.replace(' ', '').replace(',', '-')}"
    shutil.rmtree(os.path.join(a.out, name), ignore_errors=True)  # a fresh run, whose metrics are its own
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
    real_probe = M.VLLMServerClient.probe_logprobs
    real_sync = M.VLLMServerClient.sync_weights
    if "noise" in kind:
        M.VLLMServerClient.probe_logprobs = noisy_probe(float(kind.split("noise ")[1]), real_probe)
    fault = kind.split(",")[0]
    if fault in ("skipped", "partial"):
        M.VLLMServerClient.sync_weights = faulty_reload(fault, real_sync)
    said = ""
    try:
        M.train(M.load_config(RECIPE, overrides))
    except M.SyncCheckError as e:
        said = str(e)
    finally:
        M.VLLMServerClient.probe_logprobs = real_probe
        M.VLLMServerClient.sync_weights = real_sync
    hist = []
    if os.path.exists(os.path.join(a.out, name, "metrics.jsonl")):  # the syncs before a stop too
        with open(os.path.join(a.out, name, "metrics.jsonl")) as f:
            hist = [m for m in map(json.loads, f) if m["step"] > 0]  # trained steps
    if not said and len(hist) < a.steps:  # SIGTERM or Ctrl-C: the trainer saved and returned early; the bench stops
        sys.exit(143)
    return hist, said


def span(xs, f="{:.2f}"):
    if not xs:
        return "-"
    return f"{f.format(min(xs))} to {f.format(max(xs))}"


def row(lr, k, kind, hist, said):
    recent = [m["sync/probe_follow"] for m in hist if "sync/probe_follow" in m]
    recent_se = [m["sync/probe_follow_se"] for m in hist if "sync/probe_follow" in m]
    whole = [m["sync/probe_follow_run"] for m in hist if "sync/probe_follow_run" in m]
    whole_se = [m["sync/probe_follow_run_se"] for m in hist if "sync/probe_follow_run" in m]
    gap = [m["sync/probe_logprob_diff"] for m in hist]
    found = STOPPED.search(said)
    stopped = "no"
    if found:
        which = "the first sync" if found[4] == "0.1" else "the last judged"
        stopped = f"step {found[1]}: since {which}, slope {float(found[2]):.2f} (se {float(found[3]):.2f})"
    elif said:
        stopped = said[:80]
    return (
        f"| {lr:g} | {k} | {kind} | {len(recent)}/{len(hist)} | {span(recent)} | {span(recent_se, '{:.3f}')} "
        f"| {len(whole)}/{len(hist)} | {span(whole)} | {span(whole_se, '{:.3f}')} | {span(gap, '{:.4f}')} | {stopped} |"
    )


@contextlib.contextmanager
def server(a, model):
    """The server's URL for the block: --server-url's, or that of one `bash run.sh serve` started for the block."""
    if a.server_url:
        yield a.server_url
        return
    port = M.free_port()
    url = f"http://127.0.0.1:{port}"
    env = ["env", "MTGRPO_LAYOUT=server", f"MTGRPO_VLLM_PORT={port}"]  # run.sh finds the vLLM CPU build's venv
    t = time.time()
    serve = [*env, "bash", "run.sh", "serve", RECIPE, f"model_name_or_path={model}", f"lora_rank={a.lora}"]
    with served([*serve, f"max_staleness={max(a.staleness)}"], url, 1200):  # LoRA: room for the adapters in flight
        print(f"vLLM CPU build healthy after {time.time() - t:.0f} s", flush=True)
        yield url


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 1e-5, 1e-6])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0])
    ap.add_argument("--kinds", nargs="+", default=["correct", "noise 1e-3", "noise 2e-3", "skipped", "partial"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lora", type=int, default=0, help="lora_rank (0: full fine-tuning)")
    ap.add_argument("--out", default="bench/runs/sync_check")
    ap.add_argument("--model", default="", help="the model folder (default: the toy recipe's, built if missing)")
    ap.add_argument("--server-url", default="", help="a vLLM server that runs already, serving --model (LoRA: enabled)")
    a = ap.parse_args()
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "alternating.py"), "w") as f:
        f.write("def alternating(completions, **_):\n    return [float(i % 2) for i in range(len(completions))]\n")
    model = os.path.abspath(a.model)
    if not a.model:
        cfg = M.load_config(RECIPE, [f"output_dir={a.out}/build"])
        M.build_model_if_missing(cfg, print)
        model = os.path.abspath(cfg.model_name_or_path)
    rows = []
    with server(a, model) as url:
        for lr in a.lrs:
            for k in a.staleness:
                for kind in a.kinds:
                    rows.append(row(lr, k, kind, *run(a, model, url, lr, k, kind)))
                    print(rows[-1], flush=True)
    how = f"LoRA rank {a.lora}" if a.lora else "full fine-tuning"
    print(f"\nsync check, real vLLM CPU build, warm-started toy model, {how}, {a.steps} syncs per run after set-up's\n")
    print(
        "| lr | max_staleness | reloads | judged since last | slope since last judged (passes >= 0.5) | its se "
        "(judged <= 0.1) | judged since first | slope since first (passes >= 0.9) | its se (judged <= 0.02) "
        "| gap (probe_logprob_diff) | stopped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
