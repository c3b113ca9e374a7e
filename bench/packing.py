"""Packed micro-batches (each row a prefix trie of samples) against the padded micro-batches they replaced (one row per
sample), in one run, on the same samples and the same model: tokens processed per trained token, peak memory and
train-step time (issue 36).

    .venv/bin/python bench/packing.py [--repeats 3] [--cases toy tree prompt turns] [--out DIR] [--set key=value ...]
    .venv/bin/python bench/packing.py --cases --recipe RECIPE.yaml [key=value ...]   # one step of any recipe

Cases:
- toy: one step's samples of hf_recipes/toy/toy-kv--mt-grpo.yaml (8 prompts x 8 episodes), rolled out by the trainer's
  own in-process sampler from the warm-started toy model;
- tree: one step of the chain's tree (hf_recipes/toy/toy-chain--mt-grpo.yaml with bench/branching_server.py's
  CHAIN_TREE: b 2, depth 3, 4 roots, 32 leaves, each lookup turn's own reward), rolled out the same way;
- prompt: a group of G = 8 with a 1,000-token system prompt: the toy's first group, each sample led by the same
  1,000 tokens of the toy's own vocabulary (the toy model was not trained with a system prompt, so the rollout
  cannot make one);
- turns: 8 episodes of 128 turns sharing a 100-token prompt (a sampled turn of 4-12 tokens, mask 1, then a tool
  result of 8-24, mask 0), random ids over the toy's vocabulary, one sample each (REALIGN keeps an episode in one).
- recipe (`--recipe`): one rollout step of any recipe with its overrides, rolled out the same way, on its own model;
  for a case this bench does not include.
Every case runs on the toy-kv model (2 layers, hidden 128) but the tree, on the toy-chain model. One step is
train_on_samples (one iteration, beta 0, SGD with learning rate 0 so that every step sees the same weights) with the
recipe's micro-batching (micro_batch_size 64; the last two cases max_tokens_per_microbatch 16,384). The padded
baseline is the trainer's own padded rows (`padded_rows`: one sample a row, the model's own mask), the path a family
that does not pack trains on (issue 46), forced here by an empty PACKED_MODEL_TYPES. Time: the median of --repeats
steps of each, alternating, after a warm-up step of each. Peak memory: the most tensor memory live at once during a
step (bench/logprob_memory.py's peak_mb: from the profiler's allocation events; torch.cuda.max_memory_allocated on
a GPU). Both paths' loss/policy are printed: they must agree to float rounding. "distinct (trie)" counts the tokens
the packed rows hold, each distinct prefix once: processed/trained can go no lower than distinct/trained, since
prompt and tool-result tokens are read but never trained (and below 1 where episodes repeat each other exactly).
The rollouts' runs go to --out (bench/runs/packing/); --set adds overrides to every case's recipe (after its own).
"""

import argparse
import contextlib
import dataclasses
import io
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # bench/logprob_memory.py imports its baseline from the tests
os.chdir(ROOT)  # recipes name their plug-ins from the project folder
import mt_grpo_trainer as M  # noqa: E402
from logprob_memory import peak_mb  # noqa: E402
from branching_server import CHAIN_TREE  # noqa: E402

TOY = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
CHAIN = "hf_recipes/toy/toy-chain--mt-grpo.yaml"
NAMES = {
    "toy": "toy default",
    "tree": "tree (b 2, depth 3)",
    "prompt": "G=8, 1,000-token system prompt",
    "turns": "128-turn episodes",
}


# --- the padded baseline: the trainer's padded rows (one sample a row), which any model not checked exact packed takes ---


@contextlib.contextmanager
def padded():
    """train_on_samples on padded rows, one sample a row, as the trainer runs a family that does not pack."""
    saved = M.PACKED_MODEL_TYPES
    M.PACKED_MODEL_TYPES = ()
    try:
        yield
    finally:
        M.PACKED_MODEL_TYPES = saved


# --- the cases ------------------------------------------------------------------------------------------------


def rollout(recipe: str, name: str, overrides: list[str], a):
    """One step's trainable samples, rolled out by the trainer's own set-up and `collect`, and the run."""
    out = os.path.join(a.out, name)
    args = [f"output_dir={out}", "resume_from_checkpoint=", "log_episodes_steps=0", "eval_steps=0", *overrides, *a.set]
    cfg = M.load_config(recipe, args)
    run = M.setup(cfg)
    episodes, _ = M.collect(run, 0)
    samples, _ = M.trainable_samples(episodes, cfg)
    return run, samples


def long_prompt(samples, vocab: int, n: int = 1000) -> list:
    """The first group's samples (8 episodes of the toy), each led by the same n-token system prompt."""
    prompt = [random.Random(1).randrange(vocab) for _ in range(n)]
    group = samples[:8]
    for s in group:
        s.input_ids = prompt + s.input_ids
        for key in ("loss_mask", "turn_idx", "versions"):
            setattr(s, key, [0 if key == "loss_mask" else -1] * n + getattr(s, key))
        for key in ("sampler_logprobs", "advantages", "weights"):
            setattr(s, key, [0.0] * n + getattr(s, key) if getattr(s, key) else [])
    return group


def long_episodes(vocab: int, episodes: int = 8, turns: int = 128) -> list:
    rng = random.Random(2)
    prompt = [rng.randrange(vocab) for _ in range(100)]
    samples = []
    for _ in range(episodes):
        s = M.Sample()
        s.append(prompt, mask=0)
        adv = rng.uniform(-1, 1)
        for k in range(turns):
            n = rng.randint(4, 12)
            s.append([rng.randrange(vocab) for _ in range(n)], mask=1, logprobs=[-1.0] * n, turn=k)
            s.append([rng.randrange(vocab) for _ in range(rng.randint(8, 24))], mask=0)
        s.advantages = [adv * m for m in s.loss_mask]
        samples.append(s)
    return samples


# --- the measurement ------------------------------------------------------------------------------------------


def step(run, samples, cfg) -> dict:
    opt = torch.optim.SGD([p for p in run.model.parameters() if p.requires_grad], lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return M.train_on_samples(run.policy, run.ref_model, opt, sched, samples, cfg, run.pad_id)


def measure(run, samples, cfg, repeats: int) -> dict:
    """Both paths on the same samples: processed tokens, the median step time, the peak memory, loss/policy."""
    paths = {"packed": contextlib.nullcontext, "padded": padded}
    out = {name: {"times": []} for name in paths}
    for name, path in paths.items():
        with path():
            m = step(run, samples, cfg)  # warm-up
            out[name]["processed"] = m["train/processed_tokens"]
            out[name]["held"] = out[name]["processed"] * m.get("train/row_fill", 1.0)
            out[name]["loss"] = m["loss/policy"]
            out[name]["peak_mb"] = peak_mb(lambda: step(run, samples, cfg), run.device)
    for _ in range(repeats):
        for name, path in paths.items():
            with path():
                t0 = time.perf_counter()
                step(run, samples, cfg)
                out[name]["times"].append(time.perf_counter() - t0)
    for name in paths:
        out[name]["time"] = statistics.median(out[name]["times"])
    out["trained"] = sum(sum(s.loss_mask) for s in samples)
    out["tokens"] = sum(len(s.input_ids) for s in samples)
    return out


def close(run):
    """The run's sampler and folder lock go; its summary of a history it never had is not printed."""
    with contextlib.redirect_stdout(io.StringIO()):
        run.close([])


def cases(a):
    """(its name, run, samples, cfg) for each case asked for; the toy's run serves the prompt and turns cases."""
    which = a.cases
    recipe = a.recipe
    if recipe:
        run, samples = rollout(recipe[0], "recipe", recipe[1:], a)
        print(f"[bench] recipe case: {' '.join(recipe)}")
        yield f"{os.path.basename(recipe[0])} with {len(recipe) - 1} overrides", run, samples, run.cfg
        close(run)
    if not which:
        return
    toy_run, toy_samples = rollout(TOY, "toy", [], a)
    vocab = toy_run.model.config.vocab_size
    budget = dataclasses.replace(toy_run.cfg, max_tokens_per_microbatch=16384)
    if "toy" in which:
        yield NAMES["toy"], toy_run, toy_samples, toy_run.cfg
    if "prompt" in which:
        yield NAMES["prompt"], toy_run, long_prompt(toy_samples, vocab), budget
    if "turns" in which:
        yield NAMES["turns"], toy_run, long_episodes(vocab), budget
    close(toy_run)
    if "tree" in which:
        tree_run, tree_samples = rollout(CHAIN, "tree", CHAIN_TREE, a)
        yield NAMES["tree"], tree_run, tree_samples, tree_run.cfg
        close(tree_run)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", nargs="*", choices=list(NAMES), default=list(NAMES), help="none: only --recipe")
    ap.add_argument("--recipe", nargs="+", default=[], metavar="RECIPE [key=value]", help="one step of this recipe")
    ap.add_argument(
        "--out",
        default=os.path.join(ROOT, "bench", "runs", "packing"),
        help="the rollouts' runs (relative: to the project folder)",
    )
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides of every case's recipe")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out)
    torch.manual_seed(0)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores (shared)"
    results = {}
    for case, run, samples, cfg in cases(args):
        print(f"[bench] {case}: {len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens")
        results[case] = measure(run, samples, cfg, args.repeats)
    print(f"\n{device}; median of {args.repeats} train steps each, alternating\n")
    print(
        "| case | samples' tokens | trained | distinct (trie) | processed packed | processed padded | step packed (s) |"
        " step padded (s) | peak packed (MB) | peak padded (MB) | loss/policy packed - padded |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, r in results.items():
        pk, pd = r["packed"], r["padded"]
        print(
            f"| {case} | {r['tokens']} | {r['trained']} | {pk['held']:.0f} | "
            f"{pk['processed']:.0f} | {pd['processed']:.0f} | "
            f"{pk['time']:.3f} | {pd['time']:.3f} | {pk['peak_mb']:.1f} | {pd['peak_mb']:.1f} | "
            f"{pk['loss'] - pd['loss']:.1e} |"
        )
    print()
    for case, r in results.items():
        pk, pd = r["packed"], r["padded"]
        print(
            f"{case}: processed/trained {pk['processed'] / r['trained']:.2f} packed vs "
            f"{pd['processed'] / r['trained']:.2f} padded; step time {pk['time'] / pd['time']:.2f}x; "
            f"peak memory {pk['peak_mb'] / pd['peak_mb']:.2f}x; floor (distinct/trained) {pk['held'] / r['trained']:.2f}"
        )


if __name__ == "__main__":
    main()
