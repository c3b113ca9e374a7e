"""token_logprobs in float32 chunks against the direct full log-softmax: values, gradients, the GRPO loss, and
what autograd keeps for backward."""

import copy
import os
import sys

import pytest
import torch

import mt_grpo_trainer as M
from conftest import ROOT


def direct_logprobs(model, ids, attn, temperature):
    """The computation token_logprobs replaces: one [B, T, vocab] float32 log-softmax (bench/logprob_memory.py's
    baseline too)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def direct_chunk(logits, targets, temperature):
    """chunk_logprobs without the chunks: one [N, vocab] float32 log-softmax."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    return torch.log_softmax(scaled, -1).gather(-1, targets[:, None]).squeeze(-1)


def small_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=503,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    ).to(dtype)


def padded_batch(lengths, T, vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=g)
    attn = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(attn == 0, 0), attn


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_chunked_logprobs_and_gradients_equal_the_direct_log_softmax(monkeypatch, temperature):
    monkeypatch.setattr(M, "LOGPROB_CHUNK", 20 * 503)  # 3 x 37 tokens: 6 chunks, across rows, the last one short
    model = small_llama()
    ids, attn = padded_batch([37, 25, 9], 37, 503)
    weights = torch.randn(3, 37, generator=torch.Generator().manual_seed(2)) * attn  # a loss over real tokens only
    got, want = (f(model, ids, attn, temperature) for f in (M.token_logprobs, direct_logprobs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[:, 0] == 0).all()
    grads = []
    for lp in (got, want):
        model.zero_grad()
        (lp * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[1].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_grpo_step_is_unchanged(monkeypatch, tiny, tmp_path):
    """train_on_samples with beta > 0 and two iterations (reference and old logprobs too): same metrics, same update."""
    from conftest import recipe_cfg  # here, so that the bench can import this module's direct_logprobs
    from test_loss import random_samples

    model, tok = tiny
    monkeypatch.setattr(M, "LOGPROB_CHUNK", 1)  # one token per chunk
    samples = random_samples(tok, 5, seed=3)
    cfg = recipe_cfg(
        tmp_path, "micro_batch_size=2", "beta=0.1", "num_iterations=2", "temperature=0.8", "learning_rate=1.0"
    )
    out = []
    for fn in (M.chunk_logprobs, direct_chunk):
        monkeypatch.setattr(M, "chunk_logprobs", fn)
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=cfg.learning_rate)  # Adam would magnify float noise in tiny gradients
        metrics = M.train_on_samples(
            m,
            copy.deepcopy(model),
            opt,
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
            samples,
            cfg,
            tok.pad_token_id,
        )
        out.append((metrics, torch.cat([p.detach().flatten() for p in m.parameters()])))
    (lean, lean_w), (direct, direct_w) = out
    for k in ("loss/policy", "loss/kl", "loss/ratio", "loss/grad_norm"):
        assert lean[k] == pytest.approx(direct[k], rel=1e-4, abs=1e-7), k
    assert direct["loss/kl"] > 0 and abs(direct["loss/ratio"] - 1) > 1e-3  # the second iteration scores a moved policy
    torch.testing.assert_close(lean_w, direct_w, rtol=1e-4, atol=1e-6)


def test_no_full_float32_log_softmax_is_kept_for_backward(monkeypatch):
    """A bf16 model: the largest float32 tensor autograd saves is one chunk's, not [B, T, vocab] (issue 14)."""
    monkeypatch.setattr(M, "LOGPROB_CHUNK", 8 * 503)
    model = small_llama(torch.bfloat16)
    ids, attn = padded_batch([33, 20], 33, 503)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    for fn in (M.token_logprobs, direct_logprobs):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(model, ids, attn, 0.7).sum().backward()
        biggest = max((n for dtype, n in saved if dtype == torch.float32), default=0)
        if fn is direct_logprobs:
            assert biggest >= 2 * 32 * 503  # the check sees the direct version's tensor
        else:
            assert biggest <= 8 * 503


def test_the_memory_benches_run_one_train_step_of_each_computation():
    """bench/logprob_memory.py (and bench/gpu_step.py, through its loss_step) call the trainer's loss as a train step
    does: they keep working as its API changes, and each measured step holds at least the [B, T, vocab] logits."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import logprob_memory

    peaks = [logprob_memory.one_case(variant, 64, 2, 1, "fp32") for variant in ("before", "after")]
    logits_mb = 2 * 64 * logprob_memory.SMOLLM2_135M["vocab_size"] * 4 / 2**20
    assert min(peaks) > logits_mb, peaks
