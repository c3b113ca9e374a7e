"""LocalSampler: sampled ids, logprobs under the sampling distribution, finish reasons, stop strings."""

import pytest
import torch

import mt_grpo_trainer as M


def teacher_forced(model, prompt, ids, temperature):
    full = torch.tensor([prompt + ids])
    with torch.no_grad():
        lp = M.token_logprobs(model, full, torch.ones_like(full), temperature)[0]
    return lp[len(prompt) :].tolist()


def test_logprobs_match_a_teacher_forced_pass_at_the_sampling_temperature(tiny):
    model, tok = tiny
    s = M.LocalSampler(model, tok)
    prompts = [
        tok.encode("<|im_start|>user\nhi<|im_end|>\n"),
        tok.encode("<|im_start|>user\nWhat is the value of golf?"),
    ]
    for temp in (1.0, 0.7):
        outs = s.generate(prompts, [12, 12], temperature=temp, generator=torch.Generator().manual_seed(0))
        for p, c in zip(prompts, outs):  # prompts of different lengths: left padding must not leak
            assert len(c.ids) == len(c.logprobs) >= 1
            torch.testing.assert_close(c.logprobs, teacher_forced(model, p, c.ids, temp), rtol=0, atol=1e-4)


def test_left_padding_with_learned_absolute_positions(tok):
    """GPT-2 has learned position embeddings, so wrong position ids under left padding change the logits
    (RoPE models hide such a bug: only relative positions matter to them)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tok),
            n_embd=32,
            n_layer=1,
            n_head=2,
            n_positions=128,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    ).eval()
    s = M.LocalSampler(model, tok)
    prompts = [[5, 6], [7, 8, 9, 10, 11, 12, 13]]
    for p, c in zip(prompts, s.generate(prompts, [8, 8], generator=torch.Generator().manual_seed(0))):
        torch.testing.assert_close(c.logprobs, teacher_forced(model, p, c.ids, 1.0), rtol=0, atol=1e-4)


def test_per_prompt_max_tokens_and_length_finish(tiny):
    model, tok = tiny
    s = M.LocalSampler(model, tok)
    s.eos_ids = set()  # a random model may sample EOS; here only length can stop it
    outs = s.generate([[5, 6], [7, 8, 9]], [3, 5], generator=torch.Generator().manual_seed(0))
    assert [len(c.ids) for c in outs] == [3, 5] and all(c.finish_reason == "length" for c in outs)
    assert s.generate([[5, 6]], [0])[0].ids == []


def test_stop_strings_and_eos_stop_right_after_the_completing_token(tiny):
    model, tok = tiny
    s = M.LocalSampler(model, tok)
    s.eos_ids = set()
    free = s.generate([[5, 6]], [40], generator=torch.Generator().manual_seed(3))[0]
    text = tok.decode(free.ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a string the model does produce mid-way
    c = s.generate([[5, 6]], [40], stop=(stop,), generator=torch.Generator().manual_seed(3))[0]
    assert c.finish_reason == "stop" and c.ids == free.ids[: len(c.ids)]
    assert stop in tok.decode(c.ids) and stop not in tok.decode(c.ids[:-1])
    s.eos_ids = {free.ids[2]}
    c = s.generate([[5, 6]], [40], generator=torch.Generator().manual_seed(3))[0]
    assert c.finish_reason == "stop" and c.ids == free.ids[:3]  # EOS is kept: it was sampled


def test_greedy_and_top_p(tiny):
    model, tok = tiny
    s = M.LocalSampler(model, tok)
    s.eos_ids = set()
    g = s.generate([[5, 6]], [6], temperature=0.0)[0]
    full = [5, 6]
    for t in g.ids:  # greedy = argmax at every step
        with torch.no_grad():
            assert t == model(input_ids=torch.tensor([full])).logits[0, -1].argmax().item()
        full.append(t)
    lp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0]]), -1)
    kept = M.top_p_filter(lp, 0.7)
    assert torch.isinf(kept[0, 2:]).all() and torch.isfinite(kept[0, :2]).all()
    assert abs(kept.exp().sum().item() - 1) < 1e-6
    c = s.generate([[5, 6]], [8], temperature=1.0, top_p=0.5, generator=torch.Generator().manual_seed(0))[0]
    full = torch.tensor([[5, 6] + c.ids])
    with torch.no_grad():
        logits = model(input_ids=full).logits[0, 1:-1]
    nucleus = M.top_p_filter(torch.log_softmax(logits, -1), 0.5)
    want = nucleus.gather(-1, torch.tensor(c.ids)[:, None]).squeeze(-1)
    assert torch.isfinite(want).all()  # every sampled token was inside the nucleus
    torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-4)


def test_the_in_process_sampler_shares_the_weights_so_a_sync_copies_and_checks_nothing(tiny, tmp_path, monkeypatch):
    """The loop syncs every sampler alike; the in-process one has no version (it samples from the weights being
    trained), so a sync is free: no state copy, no probe, no metric."""
    from tests.conftest import recipe_cfg

    model, tok = tiny
    run = M.Run(recipe_cfg(tmp_path), 0, 1, torch.device("cpu"))
    run.sampler, run.model = M.LocalSampler(model, tok), model
    monkeypatch.setattr(M, "full_state", lambda *a, **k: pytest.fail("a state copy"))
    assert run.sync(1) == {} and run.sampler.policy_version is None
    run.sampler.close()
