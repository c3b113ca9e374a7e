"""Packed training (issue 36): samples packed into rows, shared prefixes merged into one trie, against each sample run
alone and unpadded. What is compared: every trained token's logprob and the gradient of a weighted sum of them
(float32: within 1e-5; bf16 autocast: within 0.05 in logprob, the rounding of bf16 activations, whose kernels differ
with the batch's shape), and whole train_on_samples updates (metrics and weights) against the same update with every
sample in a micro-batch of its own."""

import contextlib
import os
import random

import numpy as np
import pytest
import torch

import mt_grpo_trainer as M
import check_template as CT
from conftest import recipe_cfg
from test_env import make_env, tool_call
from test_templates import qwen3 as qwen3  # noqa: F401  (a fixture)
from test_turn_credit import ByTurn

CPU = torch.device("cpu")


def small_qwen3(vocab: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        attn_implementation=M.packed_attention(CPU),
    )
    return Qwen3ForCausalLM(config)


def with_losses(samples: list[M.Sample], seed: int = 0) -> list[M.Sample]:
    """Random advantages and weights on the trained tokens, as assign_advantages would leave them."""
    rng = random.Random(seed)
    for s in samples:
        s.advantages = [rng.uniform(-2, 2) * m for m in s.loss_mask]
        s.weights = [rng.choice([1.0, 0.5, 2.0]) * m for m in s.loss_mask]
    return samples


def compact(samples: list[M.Sample]) -> tuple[list[M.Sample], int]:
    """The same samples over a vocabulary of only the ids they use (a one-to-one map keeps every shared prefix)."""
    used = sorted({t for s in samples for t in s.input_ids})
    new_id = {t: i for i, t in enumerate(used)}
    for s in samples:
        s.input_ids = [new_id[t] for t in s.input_ids]
    return samples, len(used)


def toy_group(tok, tmp_path) -> list[M.Sample]:
    """A toy group: 4 episodes of one prompt, one tool call or none (the toy's XML protocol)."""
    from test_env import ScriptedSampler

    env = make_env(tok, tmp_path, "num_generations=4")
    answer = "<reasoning>done</reasoning>\n<answer>v</answer>"
    sampler = ScriptedSampler(tok, [tool_call("golf"), answer, answer, tool_call("kilo"), answer, answer])
    eps = env.rollout([{"prompt": "What is the value of golf?", "answer": "v"}] * 4, sampler)
    return with_losses([s for ep in eps for s in ep.samples])


def toy_tree(tok, tmp_path) -> list[M.Sample]:
    """A branching tree (b 2, depth 2, 2 roots): branch copies hold their parent's tokens as context (mask 0)."""
    env = make_env(tok, tmp_path, "num_generations=8", "branch_width=2", "branch_depth=2", "advantage_mode=tree")
    script = [tool_call("k1"), tool_call("k2"), "<reasoning>r</reasoning>\n<answer>v</answer>"]
    sampler = ByTurn(tok, [tok.encode(t, add_special_tokens=False) for t in script], "<|im_start|>assistant")
    eps = env.rollout([{"prompt": "What is k1?", "key": "k1", "answer": "v"}] * 2, sampler)
    return with_losses([s for ep in eps for s in ep.samples])


def qwen3_tree(qwen3, boundary: str) -> list[M.Sample]:
    """Forks (Qwen3 without thinking rewrites past turns) or REALIGNs inside the branches of a tree, as
    tests/test_turn_credit.py builds them, over the real Qwen3 tokenizer."""
    eos = [qwen3.convert_tokens_to_ids("<|endoftext|>")] if boundary == "realign" else [qwen3.eos_token_id]
    call = '<tool_call>\n{"name": "_sim_search", "arguments": {"query": "q%d"}}\n</tool_call>'
    think = "" if boundary == "fork" else "<think>\nx\n</think>\n\n"
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if boundary == "fork" else {}
    cfg = M.Config(system_prompt="", tool_format="native", max_env_steps=10, **kwargs)
    cfg.num_generations, cfg.branch_width, cfg.branch_depth, cfg.advantage_mode = 8, 2, 2, "tree"
    env = M.MultiTurnToolEnv(qwen3, [CT._sim_search], cfg)
    script = [qwen3.encode(think + t, add_special_tokens=False) + eos for t in (call % 0, call % 1, "Done.")]
    eps = env.rollout([{"prompt": "q"}] * 2, ByTurn(qwen3, script, "<|im_start|>assistant"))
    assert all((ep.forks if boundary == "fork" else ep.realigns) == 2 for ep in eps)
    return with_losses([s for ep in eps for s in ep.samples])


def random_group(vocab: int, lengths, shared: int, seed: int = 0) -> list[M.Sample]:
    """Samples of the given lengths: a common prefix of `shared` tokens (0: each starts with its own token), then
    random tokens, every third one context."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(shared)]
    samples = []
    for j, n in enumerate(lengths):
        s = M.Sample()
        own = [j % vocab] if not shared else []
        s.append(prompt + own, mask=0)
        for k in range(n - len(prompt) - len(own)):
            s.append([rng.randrange(vocab)], mask=int(k % 3 != 0), logprobs=[-1.0], turn=0)
        samples.append(s)
    return with_losses(samples, seed)


def rows_for(model, samples) -> tuple[list[dict], bool]:
    """The rows the trainer would train `model` on: packed if its family packs (`M.layout`), else padded."""
    packs, _ = M.layout(model.config)
    if packs:
        return M.pack_rows(samples, 10**9), True
    return M.padded_rows(samples), False


def packed(model, samples, autocast=False):
    """Each sample's token logprobs [T], from one micro-batch of all of them, in the rows its family trains on (on the
    model's device)."""
    device = model.device
    rows, packs = rows_for(model, samples)
    mb = M.collate(rows, samples, 0, device, packs)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        lp = M.packed_logprobs(model, mb, 0.7)
    order = [i for row in rows for i, _, _ in row["members"]]
    return [lp[order.index(i), : len(s.input_ids)] for i, s in enumerate(samples)]


def alone(model, samples, autocast=False):
    """Each sample's token logprobs [T], from a forward of that sample alone, unpadded (trained tokens only)."""
    device = model.device
    out = []
    for s in samples:
        ids = torch.tensor([s.input_ids], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            lp = M.token_logprobs(model, ids, torch.ones_like(ids), 0.7)[0]
        out.append(lp * (torch.tensor(s.weights, device=device) != 0))
    return out


def packed_and_alone(model, samples, autocast=False) -> list[tuple]:
    """(each sample's logprobs, the gradient of their weighted sum), from the packed rows, then from each sample
    alone."""
    results = []
    for fn in (packed, alone):
        model.zero_grad()
        lps = fn(model, samples, autocast)
        sum(lp @ torch.tensor(s.weights, device=model.device) for lp, s in zip(lps, samples)).backward()
        results.append((lps, torch.cat([p.grad.flatten() for p in model.parameters()])))
    return results


def assert_exact(model, samples, autocast=False):
    """Packed logprobs and their gradient against each sample alone; returns the tokens the trie saved."""
    tol = {"rtol": 0, "atol": 0.05} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    (got, got_grad), (want, want_grad) = packed_and_alone(model, samples, autocast)
    for lp, ref in zip(got, want):
        torch.testing.assert_close(lp, ref, **tol)
    assert want_grad.abs().max() > 0
    scale = float(want_grad.abs().max())  # float32: summed in another order; bf16: rounded activations
    grad_tol = {"rtol": 0.05, "atol": 0.05 * scale} if autocast else {"rtol": 1e-4, "atol": 1e-5 * scale}
    torch.testing.assert_close(got_grad, want_grad, **grad_tol)
    rows, _ = rows_for(model, samples)
    return sum(len(s.input_ids) for s in samples) - sum(len(row["ids"]) for row in rows)


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16"])
def test_the_toy_group_and_tree_give_each_samples_own_logprobs_and_gradient(tok, tmp_path, autocast):
    model = small_qwen3(len(tok))
    assert assert_exact(model, toy_group(tok, tmp_path), autocast) > 0, "the group's prompt is held once"
    assert assert_exact(model, toy_tree(tok, tmp_path), autocast) > 0, "a branch's context is held once"


@pytest.mark.parametrize("boundary", ["fork", "realign"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16"])
def test_forks_and_realigns_inside_branches_are_exact(qwen3, boundary, autocast):
    samples, vocab = compact(qwen3_tree(qwen3, boundary))
    saved = assert_exact(small_qwen3(vocab), samples, autocast)
    assert saved > sum(len(s.input_ids) for s in samples) / 2, "most of a tree's tokens are shared"


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16"])
def test_very_different_lengths_and_a_group_that_shares_nothing_are_exact(autocast):
    model = small_qwen3(97)
    assert assert_exact(model, random_group(97, [3, 250, 7, 120, 40], shared=20), autocast) > 0
    assert assert_exact(model, random_group(97, [30, 9, 64, 2], shared=0), autocast) == 0


def test_the_gpu_block_mask_gives_each_samples_own_logprobs(monkeypatch):
    """A GPU trains packed rows through FlexAttention's block mask, not trie_attention. Its forward runs on the CPU
    too (compiled; its backward does not), so the mask and transformers' handling of it are checked here: the
    packed logprobs of a tree-like group against each sample alone through SDPA."""
    samples = random_group(97, [3, 250, 7, 120, 40], shared=20)
    reference = small_qwen3(97)
    monkeypatch.setattr(M, "FLEX_DEVICES", {"cpu", "cuda"})
    model = small_qwen3(97)
    assert model.config._attn_implementation == "mtgrpo_flex"
    model.load_state_dict(reference.state_dict())
    assert not hasattr(M.collate(M.pack_rows(samples, 10**9), samples, 0, CPU)["attn"], "trie_segments")
    with torch.no_grad():
        got = packed(model, samples)
        want = alone(reference, samples)
    for lp, ref, s in zip(got, want, samples):
        torch.testing.assert_close(lp * (torch.tensor(s.weights) != 0), ref, rtol=1e-5, atol=1e-5)


def test_a_trie_holds_each_shared_prefix_once_and_a_token_sees_exactly_its_ancestors():
    """Identical samples, a sample that is a prefix of another, siblings whose next tokens differ: each token of a
    row stands for a prefix of token ids; its position is that prefix's depth, and it sees the tokens of that prefix."""
    seqs = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8], [5, 6, 7], [1, 2], [5, 6, 7, 8, 3], [4]]
    samples = [M.Sample(ids, [1] * len(ids), [0.0] * len(ids), [0] * len(ids), [0.0] * len(ids)) for ids in seqs]
    [row] = M.pack_rows(samples, 100)
    prefixes = {}
    for i, path, _ in row["members"]:
        assert [row["ids"][p] for p in path] == seqs[i], "a member's path spells its token ids"
        assert [row["pos"][p] for p in path] == list(range(len(seqs[i]))), "positions restart at 0 per sample"
        for d, p in enumerate(path):
            assert prefixes.setdefault(p, tuple(seqs[i][: d + 1])) == tuple(seqs[i][: d + 1])
    assert len(row["ids"]) == len({tuple(s[: d + 1]) for s in seqs for d in range(len(s))}), "each prefix once"
    segments = M.collate([row], samples, 0, CPU)["attn"].trie_segments
    assert sum(stop - start for _, start, stop, _ in segments) == len(row["ids"]), "each token computed once"
    for _, start, stop, keys in segments:  # query q, the j-th of its span, sees the keys of its path up to itself
        for j, q in enumerate(range(start, stop)):
            seen = set(keys[: len(keys) - (stop - start) + j + 1].tolist())
            assert seen == {k for k, other in prefixes.items() if prefixes[q][: len(other)] == other}, f"token {q}"


def test_merging_is_by_token_ids_and_rows_keep_to_their_capacity():
    a, b = [1, 2, 3, 4], [1, 2, 30, 4]  # the same text or not: only the ids decide
    samples = [M.Sample(ids, [1] * 4, [0.0] * 4, [0] * 4, [0.0] * 4) for ids in (a, b, a, [9] * 9)]
    rows = M.pack_rows(samples, 6)
    assert [row["ids"] for row in rows] == [[1, 2, 3, 4, 30, 4], [9] * 9], "a longer sample takes a row of its own"
    assert [len(mb) for mb in M.make_microbatches(rows, 12)] == [1, 1]
    assert [len(mb) for mb in M.make_microbatches(rows, 18)] == [2]


def one_per_microbatch(monkeypatch):
    """The reference: every sample alone in a row and a micro-batch of its own (a plain unpadded forward)."""

    def alone_rows(samples, capacity):
        return [
            {"ids": s.input_ids, "pos": list(range(len(s.input_ids))), "members": [(i, np.arange(len(s.input_ids)), 0)]}
            for i, s in enumerate(samples)
        ]

    monkeypatch.setattr(M, "pack_rows", alone_rows)
    monkeypatch.setattr(M, "make_microbatches", lambda rows, budget: [[row] for row in rows])


LORA = ["lora_rank=4", "lora_alpha=8", "lora_target_modules=[q_proj,v_proj,up_proj]"]
VARIANTS = {
    "full, two iterations": ["num_iterations=2"],
    "full, beta > 0 (reference model), checkpointing": ["beta=0.5", "num_iterations=2", "gradient_checkpointing=true"],
    "lora": LORA,
    "lora, beta > 0 (adapters off), two iterations, checkpointing": [
        *LORA,
        "beta=0.5",
        "num_iterations=2",
        "gradient_checkpointing=true",
    ],
    "sequence_mean, bf16": ["loss_aggregation=sequence_mean", "mixed_precision=bf16"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_packed_update_is_the_update_of_each_sample_alone(tiny_model_dir, tmp_path, monkeypatch, variant):
    """train_on_samples on a tree and a long-prompt group, packed and merged, against every sample in a micro-batch
    of its own: the same metrics and the same weights after two SGD updates."""
    from dist_worker import fixed_batch

    overrides = [f"model_name_or_path={tiny_model_dir}", "learning_rate=1.0", "max_grad_norm=0", *VARIANTS[variant]]
    cfg = recipe_cfg(tmp_path, *overrides)
    out = []
    for reference in (False, True):
        with monkeypatch.context() as patch:
            if reference:
                one_per_microbatch(patch)
            _, model, ref_model, policy, _, _ = M.load_models(cfg, tiny_model_dir, CPU)
            vocab = model.config.vocab_size
            eps = [ep for g in fixed_batch(vocab) for ep in g]
            samples, _ = M.trainable_samples(eps, cfg)
            samples += random_group(vocab, [60, 25, 90], shared=20, seed=1)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
            for _ in range(2):
                metrics = M.train_on_samples(policy, ref_model, opt, sched, samples, cfg, 0)
            out.append((metrics, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (got, got_w), (want, want_w) = out
    tol = 2e-2 if "bf16" in variant else 1e-5
    for k in ("loss/policy", "loss/kl", "loss/ratio", "loss/clip_frac", "loss/grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=tol, abs=tol / 100), k
    assert got["train/shared_prefix_tokens_saved"] > 0 and want["train/shared_prefix_tokens_saved"] == 0
    assert got["train/processed_tokens"] < want["train/processed_tokens"]
    torch.testing.assert_close(got_w, want_w, rtol=tol, atol=tol / 10)


def test_the_benches_padded_baseline_makes_the_packed_update_and_reports_what_they_read(tiny_model_dir, tmp_path):
    """bench/packing.py and bench/gpu_step.py compare packed steps against `padded()`, the trainer's padded rows:
    both must train the same samples to the same update, and report the metrics the benches print."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from packing import padded

    cfg = recipe_cfg(tmp_path, f"model_name_or_path={tiny_model_dir}", "learning_rate=1.0", "max_grad_norm=0")
    out = []
    for baseline in (contextlib.nullcontext, padded):
        with baseline():
            _, model, ref_model, policy, _, _ = M.load_models(cfg, tiny_model_dir, CPU)
            samples = random_group(model.config.vocab_size, [60, 25, 90], shared=20, seed=1)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
            metrics = M.train_on_samples(policy, ref_model, opt, sched, samples, cfg, 0)
            out.append((metrics, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (packed_m, packed_w), (padded_m, padded_w) = out
    for k in ("loss/policy", "loss/grad_norm"):
        assert packed_m[k] == pytest.approx(padded_m[k], rel=1e-5), k
    torch.testing.assert_close(packed_w, padded_w, rtol=1e-5, atol=1e-6)
    assert padded_m["train/processed_tokens"] == 3 * 90, "one padded row per sample, each the longest's length"
    assert packed_m["train/processed_tokens"] == 20 + 40 + 5 + 70, "the shared 20 tokens once"
    assert padded_m["train/micro_batches"] >= 1 and packed_m["train/micro_batches"] >= 1
