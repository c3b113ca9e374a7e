"""The loss against a direct per-token computation, clipping, KL, micro-batch invariance, samples with non-finite
sampler logprobs rejected before it, and the importance weight's cap."""

import math

import pytest
import torch

import mt_grpo_trainer as M
from conftest import recipe_cfg
from test_env import ScriptedSampler, make_env


def reference_loss(logp, old, adv, mask, eps_lo, eps_hi, agg, beta=0.0, ref=None):
    B, T = len(logp), len(logp[0])
    per_seq, tot, n_tok = [], 0.0, 0
    for b in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if not mask[b][t]:
                continue
            r = math.exp(logp[b][t] - old[b][t])
            v = -min(r * adv[b][t], min(max(r, 1 - eps_lo), 1 + eps_hi) * adv[b][t])
            if beta:
                d = ref[b][t] - logp[b][t]
                v += beta * (math.exp(d) - d - 1)
            s, n = s + v, n + 1
        per_seq.append(s / max(n, 1))
        tot, n_tok = tot + s, n_tok + n
    return tot / n_tok if agg == "token_mean" else sum(per_seq) / B


@pytest.mark.parametrize("agg", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_loss_matches_direct_computation(agg, beta):
    g = torch.Generator().manual_seed(0)
    B, T = 3, 7
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.4 * torch.randn(B, T, generator=g)  # ratios well outside the clip range
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    cfg = M.Config(epsilon=0.2, epsilon_high=0.28, loss_aggregation=agg, beta=beta)
    loss, _ = M.grpo_loss(logp, old, old, adv, mask, cfg, int(mask.sum()), B, ref_logp=ref)  # sampler = old: w = 1
    want = reference_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, agg, beta, ref.tolist())
    assert abs(loss.item() - want) < 1e-5


def test_clipped_tokens_get_no_gradient_and_clip_frac_counts_exactly_those():
    # ratios e^0.5 (A > 0) and e^-0.5 (A < 0) are clipped; e^0.1 is inside; e^-0.7 with A > 0 and e^0.4 with A < 0
    # are outside [1 - eps, 1 + eps] too, but min takes their unclipped term: their gradient flows, so not clipped
    logp = torch.tensor([[0.5, -0.5, 0.1, -0.7, 0.4]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0, -1.0]])
    zeros, cfg = torch.zeros(1, 5), M.Config(epsilon=0.2, epsilon_high=0.2)
    loss, sums = M.grpo_loss(logp, zeros, zeros, adv, torch.ones(1, 5), cfg, 5, 1)
    loss.backward()
    assert (logp.grad[0] == 0).tolist() == [True, True, False, False, False]
    assert sums["loss/clip_frac"].item() == pytest.approx(2)


@pytest.mark.parametrize("agg", ["token_mean", "sequence_mean"])
def test_an_episode_split_into_two_samples_weighs_what_it_weighs_in_one(agg):
    """A sequence is an episode: a fork moves an episode's tokens into two rows without changing its weight."""
    g = torch.Generator().manual_seed(3)
    adv = [torch.randn(n, generator=g) for n in (5, 3, 2)]  # episode A: 5 + 3 tokens, B: 2; loss_t = -A_t

    def loss(rows, seq_tokens):
        pad = [torch.nn.functional.pad(torch.stack([r, torch.ones_like(r)]), (0, 8 - len(r))) for r in rows]
        a, mask = torch.stack(pad).unbind(1)
        zeros, cfg = torch.zeros_like(a), M.Config(loss_aggregation=agg)
        return M.grpo_loss(zeros, zeros, zeros, a, mask, cfg, 10, 2, torch.tensor(seq_tokens))[0].item()

    split, whole = loss(adv, [8.0, 8.0, 2.0]), loss([torch.cat(adv[:2]), adv[2]], [8.0, 2.0])
    want = -(torch.cat(adv[:2]).mean() + adv[2].mean()) / 2 if agg == "sequence_mean" else -torch.cat(adv).mean()
    assert split == pytest.approx(whole, abs=1e-6) and split == pytest.approx(want.item(), abs=1e-6)


def grads_after(model, tok, samples, cfg):
    """Accumulated gradient of one batch (SGD with lr 0 leaves the weights and keeps .grad)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    M.train_on_samples(model, None, opt, sched, samples, cfg, tok.pad_token_id)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def random_samples(tok, n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(5, 20, (1,), generator=g))
        ids = torch.randint(5, len(tok), (L,), generator=g).tolist()
        mask = [0] * 3 + (torch.rand(L - 3, generator=g) > 0.3).long().tolist()
        adv = [m * float(torch.randn(1, generator=g)) for m in mask]
        out.append(M.Sample(ids, mask, [-1.0 * m for m in mask], [0 if m else -1 for m in mask], adv))
    return out


@pytest.mark.parametrize("agg", ["token_mean", "sequence_mean"])
def test_gradient_accumulation_equals_one_big_batch(tiny, tmp_path, agg):
    model, tok = tiny
    samples = random_samples(tok, 7, seed=1)
    grads = []
    for mbs in (7, 3, 1):
        cfg = recipe_cfg(tmp_path, f"micro_batch_size={mbs}", f"loss_aggregation={agg}", "max_grad_norm=0", "beta=0")
        grads.append(grads_after(model, tok, samples, cfg))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("agg", ["token_mean", "sequence_mean"])
def test_the_update_weighs_episodes_however_many_samples_they_forked_into(tiny, tmp_path, agg):
    """trainable_samples -> train_on_samples against the loss written out by hand: with sequence_mean each episode's
    token losses are averaged over all its samples' tokens, then over episodes, also with a fork split over
    micro-batches; with token_mean every token weighs the same."""
    model, tok = tiny
    a1, a2, b, empty = random_samples(tok, 4, seed=4)
    empty.loss_mask = [0] * len(empty.loss_mask)
    eps = [M.Episode(row={}, messages=[], n_prompt_messages=0, samples=ss) for ss in ([a1, a2], [b], [empty])]
    samples, _ = M.trainable_samples(eps, recipe_cfg(tmp_path))
    n_a = sum(a1.loss_mask) + sum(a2.loss_mask)
    assert samples == [a1, a2, b] and [s.episode_tokens for s in samples] == [n_a, n_a, sum(b.loss_mask)]
    want = 0.0  # ratio 1, no IS weight: loss = -sum A_t logp_t / (episode tokens x episodes) or / all tokens
    for s in samples:
        ids = torch.tensor([s.input_ids])
        lp = M.token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]
        want = want - (lp * torch.tensor(s.advantages) * torch.tensor(s.loss_mask)).sum() / (
            s.episode_tokens * 2 if agg == "sequence_mean" else sum(sum(x.loss_mask) for x in samples)
        )
    want.backward()
    want_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    for mbs in (3, 1):
        cfg = recipe_cfg(
            tmp_path,
            f"micro_batch_size={mbs}",
            f"loss_aggregation={agg}",
            "max_grad_norm=0",
            "beta=0",
            "is_ratio_cap=0",
            "temperature=1.0",
        )
        torch.testing.assert_close(grads_after(model, tok, samples, cfg), want_grad, rtol=1e-4, atol=1e-7)


def test_old_logprobs_are_taken_in_train_mode_as_the_loss_is(tiny, tmp_path):
    """With num_iterations > 1 the old logprobs come from their own forward; dropout must act there as in the loss's
    forwards, or the first ratios are off. The model arrives in eval mode, as from_pretrained leaves it."""
    model, tok = tiny
    modes = []
    model.register_forward_hook(lambda m, args, out: modes.append(m.training))
    model.eval()
    cfg = recipe_cfg(tmp_path, "num_iterations=2")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1)
    M.train_on_samples(model, None, opt, sched, random_samples(tok, 2, seed=5), cfg, tok.pad_token_id)
    assert modes == [True] * 3, "one forward for the old logprobs, one per iteration, every one in train mode"


def test_num_iterations_reuses_the_batch_with_fixed_old_logprobs(tiny, tmp_path):
    model, tok = tiny
    samples = random_samples(tok, 4, seed=2)
    cfg = recipe_cfg(tmp_path, "num_iterations=3", "learning_rate=0.05", "is_ratio_cap=0")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, M.lr_lambda(cfg))
    m = M.train_on_samples(model, None, opt, sched, samples, cfg, tok.pad_token_id)
    # Iterations 2 and 3 score a changed policy against the frozen old logprobs: ratios move off 1 and clip.
    assert abs(m["loss/ratio"] - 1.0) > 1e-3 and m["loss/clip_frac"] > 0
    assert opt.state[next(iter(model.parameters()))]["step"] == 3


def test_batch_with_no_trained_token_is_skipped(tiny, tmp_path):
    model, tok = tiny
    s = M.Sample([5, 6, 7], [0, 0, 0], [0.0] * 3, [-1] * 3, [0.0] * 3)
    before = [p.clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    m = M.train_on_samples(
        model,
        None,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1),
        [s],
        recipe_cfg(tmp_path),
        tok.pad_token_id,
    )
    assert m == {"loss/skipped_empty_batch": 1.0}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_non_finite_sampler_logprobs_reject_their_sample(tok, tmp_path, tiny):
    env = make_env(tok, tmp_path)
    eps = env.rollout([{"prompt": "q"}] * 3, ScriptedSampler(tok, ["<answer>a</answer>"]))
    eps[0].samples[0].sampler_logprobs[-1] = float("nan")
    eps[1].samples[0].sampler_logprobs[-2] = float("-inf")
    for ep in eps:
        for s in ep.samples:
            s.advantages = [1.0 * m for m in s.loss_mask]
    samples, rejected = M.trainable_samples(eps, env.cfg)
    assert rejected == 2 and samples == eps[2].samples
    model, _ = tiny
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = M.train_on_samples(model, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1), samples, env.cfg, 0)
    assert all(math.isfinite(v) for v in m.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_importance_weights_are_capped_from_above_and_carry_no_gradient(tiny, tmp_path):
    """w = min(exp(old - sampler), cap), a constant to the gradient: a token the sampler found more likely than the
    trainer weighs < 1 (uncapped), a moderately less likely one > 1, a far less likely one exactly the cap."""
    model, tok = tiny
    s = M.Sample()
    s.append([5, 6, 7], mask=0)
    s.append([8, 9, 10], mask=1, logprobs=[0.0] * 3, turn=0)
    s.advantages = [0.0, 0.0, 0.0, 1.0, -0.5, 1.0]
    ids = torch.tensor([s.input_ids])
    with torch.no_grad():
        trainer = M.token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]
    s.sampler_logprobs[3:] = (trainer[3:] + torch.tensor([1.5, -0.3, -50.0])).tolist()
    weight = torch.tensor([[0, 0, 0, math.exp(-1.5), math.exp(0.3), 2.0]])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m = M.train_on_samples(
        model,
        None,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1),
        [s],
        recipe_cfg(tmp_path, "is_ratio_cap=2.0", "max_grad_norm=0", "temperature=1.0"),
        0,
    )
    assert m["loss/is_weight"] == pytest.approx(weight.sum().item() / 3, rel=1e-4)
    assert math.isfinite(m["loss/policy"])
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp = M.token_logprobs(model, ids, torch.ones_like(ids), 1.0)  # ratio 1, inside the clip range: the loss by hand
    (-(torch.exp(logp - logp.detach()) * torch.tensor([s.advantages]) * weight).sum() / 3).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
