"""Peak memory of one train step: token logprobs through one full [B, T, vocab] float32 log-softmax (before, the
direct computation, kept here only as the baseline) against token_logprobs' float32 chunks (after), side by side.

    .venv/bin/python bench/logprob_memory.py [--lengths 256 1024 2048] [--batch 4] [--layers 4] [--precision fp32 bf16]

The model is random-initialised with SmolLM2-135M's architecture (Llama, hidden 576, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49152, tied embeddings); --layers sets how many of its 30 layers it has (all 30 on a
GPU, 4 on a CPU by default, for time). The layers' activations are the same before and after, so the saving in MB
does not depend on the layer count; the ratio does.
One step is what train_on_samples runs per micro-batch: forward, token logprobs at temperature 1, grpo_loss
(token_mean) and backward, with float32 weights under the trainer's mixed precision (fp32, or bf16 autocast, the
default on a GPU). Each case runs in a fresh process. Measured: the most memory allocated at once during the step,
over what was allocated before it: torch.cuda.max_memory_allocated on CUDA, the profiler's allocation and free
events on a CPU. Both include the parameter gradients, not the optimizer state.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/test_logprobs.py imports its conftest, as pytest runs it
import mt_grpo_trainer as M  # noqa: E402
from tests.test_logprobs import direct_logprobs  # noqa: E402   the baseline: the direct computation

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)


def cpu_peak_mb(step):
    """The most tensor memory live at once during step(): the running sum of the profiler's allocation (+) and
    free (-) events. Unlike the peak resident memory, it does not depend on how malloc reuses freed memory."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0)) / 2**20


def peak_mb(step, device: torch.device) -> float:
    """The most memory step() holds at once beyond what was allocated before it: cpu_peak_mb on the CPU, the CUDA
    allocator's peak on a GPU."""
    if device.type != "cuda":
        return cpu_peak_mb(step)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def loss_step(model, fn, batch: dict, cfg, device):
    """What train_on_samples runs per micro-batch, with `fn` computing the token logprobs: forward under the
    trainer's mixed precision, grpo_loss (token_mean, on-policy) and backward. Returns the logprobs."""
    with M.autocast(cfg, device):
        logp = fn(model, batch["ids"], batch["attn"], cfg.temperature)
    mask, n = batch["mask"], batch["mask"].sum()
    loss, _ = M.grpo_loss(logp, logp.detach(), logp.detach(), batch["adv"], mask, cfg, n, len(mask), mask.sum(1))
    loss.backward()
    return logp.detach()


def one_case(variant, T, B, layers, precision):
    """One train step in this process; returns the most memory it had allocated at once, in MB."""
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SMOLLM2_135M)).to(device).train()
    cfg = M.load_config(
        None,
        ["mixed_precision=" + {"fp32": "no", "bf16": "bf16"}[precision], f"output_dir={ROOT}/outputs/bench-unused"],
    )
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (B, T), device=device)
    batch = dict(
        ids=ids, attn=torch.ones_like(ids), mask=torch.ones(B, T, device=device), adv=torch.randn(B, T, device=device)
    )
    fn = direct_logprobs if variant == "before" else M.token_logprobs

    return peak_mb(lambda: loss_step(model, fn, batch, cfg, device), device)


def run_case(*args):
    out = subprocess.run(
        [sys.executable, __file__, "--case", *map(str, args)], capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode != 0:
        sys.exit(f"case {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--layers",
        type=int,
        default=30 if torch.cuda.is_available() else 4,
        help="SmolLM2-135M has 30; on a CPU 4 by default, which keeps the run to a few minutes",
    )
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--case", nargs=5, help=argparse.SUPPRESS)  # variant T B layers precision: one child process
    args = ap.parse_args()
    if args.case:
        v, T, B, layers, precision = args.case
        print(json.dumps({"peak_mb": one_case(v, int(T), int(B), int(layers), precision)}))
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(
        f"{device}; SmolLM2-135M shape, {args.layers} of its 30 layers, batch {args.batch}, LOGPROB_CHUNK "
        f"{M.LOGPROB_CHUNK} logits elements; peak memory allocated during one train step\n"
    )
    print("| precision | seq len | tokens | before (MB) | after (MB) | after / before | saved (MB) | time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for precision in args.precision:
        for T in args.lengths:
            t0 = time.time()
            before, after = (run_case(v, T, args.batch, args.layers, precision) for v in ("before", "after"))
            print(
                f"| {precision} | {T} | {T * args.batch} | {before:.0f} | {after:.0f} | {after / before:.2f} | "
                f"{before - after:.0f} | {time.time() - t0:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
