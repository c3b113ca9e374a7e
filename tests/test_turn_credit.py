"""Turn-level credit for any number of turns: per-turn rewards, the advantage modes on hand-built groups, branching
rollouts (each sampled token trained once, by one path, and kept when a path below it is cut), and unbiasedness: the
expected update through the trainer's own path (assign_advantages -> trainable_samples -> grpo_loss, and
train_on_samples for the node weights) against the exact policy gradient of small decision processes
(bench/credit_snr.py), every tree enumerated, with the per-turn-index construction as the counterexample."""

import collections
import json
import math
import types

import numpy as np
import pytest
import torch

import bench.credit_snr as CS
import mt_grpo_trainer as M
import check_template as CT
from test_env import TABLE, ScriptedSampler, make_env, tool_call
from test_templates import qwen3 as qwen3  # noqa: F401  (a fixture)
from test_train import run_cfg
from vllm_standin import StandinServer


def episode(turns: int, first_result=None, node=(), turn_nodes=(), assistant=None):
    """An episode with `turns` assistant turns (its completion alternates assistant and tool result messages)."""
    msgs = [{"role": "user", "content": "q"}]
    for k in range(turns):
        msgs.append({"role": "assistant", "content": f"turn {k}"})
        msgs += [{"role": "user", "content": "<result>\nr\n</result>"}] if k < turns - 1 else []
    ep = M.Episode(row={"prompt": "q"}, messages=msgs, n_prompt_messages=1, turns=[M.Turn(0, 1)] * turns)
    ep.first_result_turn, ep.node, ep.turn_nodes = first_result, node, list(turn_nodes)
    return ep


# --- per-turn rewards


def half_a_turn(completions, **_):
    """A per-turn reward: 0.5 for each assistant turn."""
    return [[0.5] * sum(m["role"] == "assistant" for m in c) for c in completions]


def by_episode(completions, **_):
    """An episode-level turn reward, as every one written before per-turn rewards."""
    return [1.0, 2.0, 3.0]


def test_a_turn_reward_scores_every_turn_or_the_turns_before_the_first_result():
    eps = [episode(3, first_result=1), episode(1), episode(2, first_result=1)]
    totals = M.score(eps, [half_a_turn, by_episode], [2.0, 1.0], 60, per_turn=True)
    # a list adds turn by turn; a number sits on the turn that called the first tool (the last turn if none did)
    assert totals == [[2.0, 1.0, 1.0], [3.0], [4.0, 1.0]]
    assert eps[0].rewards == {"half_a_turn": 1.5, "by_episode": 1.0}, "the reward/* metrics: an episode's sum"
    with pytest.raises(M.RewardError, match=r"returned 2 values for episode 0, which has 3 assistant turns"):
        M.score(eps, [lambda completions, **_: [[1.0, 1.0]] * 3], [1.0], 60, per_turn=True)
    with pytest.raises(M.RewardError, match=r"not a number but a list"):  # outcome rewards are one number an episode
        M.score(eps, [lambda completions, **_: [[1.0]] * 3], [1.0], 60)


def test_episode_level_turn_rewards_give_todays_advantages_exactly():
    """A number per episode, as every turn reward function written so far returns, gives the three modes today's
    numbers: the sum of an episode's per-turn rewards is that number, bit for bit."""
    eps = [episode(2, 1), episode(3, 1), episode(1), episode(1, 1)]
    values = [0.1, 0.25, 0.35, 0.0]
    turn_R = M.score(eps, [lambda completions, **_: values], [0.7], 60, per_turn=True)
    assert [sum(r) for r in turn_R] == [0.7 * v for v in values]
    cfg = M.Config(turn_advantage_coef=0.5)
    out = [1.0, 0.0, 1.0, 0.0]
    a_o, a_t = M.group_normalize(out), 0.5 * M.group_normalize([0.7 * v for v in values])
    want = [[a_o[0] + a_t[0], a_o[0]], [a_o[1] + a_t[1], a_o[1], a_o[1]], [a_o[2] + a_t[2]], [a_o[3] + a_t[3]]]
    assert M.ADVANTAGE_MODES["mt_grpo"](eps, turn_R, out, cfg) == want


# --- the modes, on hand-built groups


def test_the_released_codes_fallback_gives_episodes_without_a_tool_result_the_merged_advantage():
    eps = [episode(2, 1), episode(1), episode(3, 1), episode(1)]
    turn_R, out, cfg = [[1.0, 0.0], [0.0], [0.5, 0.0, 0.0], [0.0]], [1.0, 1.0, 0.0, 0.0], M.Config()
    split = M.ADVANTAGE_MODES["mt_grpo"](eps, turn_R, out, cfg)
    merged = M.ADVANTAGE_MODES["grpo_merged"](eps, turn_R, out, cfg)
    got = M.ADVANTAGE_MODES["mt_grpo_merged_fallback"](eps, turn_R, out, cfg)
    assert got == [split[0], merged[1], split[2], merged[3]] and got[1] != split[1]


def test_reward_to_go_credits_a_turn_with_what_comes_after_it_against_the_other_episodes_returns():
    eps = [episode(3), episode(1), episode(2)]
    turn_R, out = [[0.3, -0.1, 0.0], [0.0], [0.3, 0.0]], [1.0, 0.0, 1.0]
    returns = [1.2, 0.0, 1.3]
    others = [(sum(returns) - r) / 2 for r in returns]
    want = [[1.2 - others[0], 0.9 - others[0], 1.0 - others[0]], [0.0 - others[1]], [1.3 - others[2], 1.0 - others[2]]]
    got = M.ADVANTAGE_MODES["reward_to_go"](eps, turn_R, out, M.Config(scale_returns=False))
    assert np.allclose([a for e in got for a in e], [a for e in want for a in e])
    scaled = M.ADVANTAGE_MODES["reward_to_go"](eps, turn_R, out, M.Config(scale_returns=True))  # by the returns' std
    assert M.ADVANTAGE_MODES["reward_to_go"](eps, turn_R, out, M.Config()) == got, "centred only by default"
    assert np.allclose([a for e in scaled for a in e], [a / (np.std(returns, ddof=1) + 1e-4) for e in want for a in e])


@pytest.mark.parametrize("mode", ["tree", "reward_to_go"])
def test_returns_that_differ_by_a_float_residue_have_no_spread(mode):
    """0.1 + 0.2 against 0.3 differ by 5.6e-17: leave-one-out gives exactly zero, as group_normalize does, so
    filter_zero_spread_groups drops the group instead of training on a residue."""
    eps = [episode(1, node=(0,), turn_nodes=[(0,)]), episode(1, node=(1,), turn_nodes=[(1,)])]
    got = M.ADVANTAGE_MODES[mode](eps, [[0.1], [0.0]], [0.2, 0.3], M.Config())
    assert got == [[0.0], [0.0]]
    assert list(M.leave_one_out([0.1 + 0.2, 0.3, 0.3])) == [0.0, 0.0, 0.0]
    assert list(M.leave_one_out([1.0, 0.0, 0.5])) == [0.75, -0.75, 0.0]


def test_state_matched_baselines_a_turn_on_the_episodes_sampled_after_exactly_its_token_ids(tok, tmp_path):
    """Three episodes of one prompt, rolled out by the environment: two look `golf` up and get the same result, so
    their second turns were sampled after the same token ids; the third looks `alpha` up, then `golf`, then answers.
    Each turn's baseline: the others in its state (every first turn: they share the prompt), else the others at its
    turn index (the third's second turn), else the others' returns (its third turn: no other has one)."""
    env = make_env(tok, tmp_path, "num_generations=3", "advantage_mode=state_matched")
    answer = f"<reasoning>done</reasoning>\n<answer>{TABLE['golf']}</answer>"
    script = [tool_call("golf"), tool_call("golf"), tool_call("alpha"), answer, answer, tool_call("golf"), answer]
    sampler = ScriptedSampler(tok, script)
    eps = env.rollout([{"prompt": "What is the value of golf?", "answer": TABLE["golf"]}] * 3, sampler)
    assert (
        [len(ep.turns) for ep in eps] == [2, 2, 3]
        and [ep.group for ep in eps] == [0, 0, 0]
        and len(sampler.prompts) == 7
    )
    assert [ep.turns[0].state for ep in eps] == [M.state_key(p) for p in sampler.prompts[:3]], "the sampler's prompt"
    assert [ep.turns[1].state for ep in eps] == [M.state_key(p) for p in sampler.prompts[3:6]]
    assert eps[0].turns[1].state == eps[1].turns[1].state != eps[2].turns[1].state
    turn_R, out = [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0, 0.0]], [1.0, 0.0, 0.0]
    # to go: [2, 1], [1, 0], [0, 0, 0]; returns 2, 1, 0
    want = [[2 - (1 + 0) / 2, 1 - 0], [1 - (2 + 0) / 2, 0 - 1], [0 - (2 + 1) / 2, 0 - (1 + 0) / 2, 0 - (2 + 1) / 2]]
    got = M.ADVANTAGE_MODES["state_matched"](eps, turn_R, out, env.cfg)
    assert got == want
    M.assign_advantages(eps, turn_R, out, env.cfg)
    m = M.episode_metrics(eps)
    assert m["adv/state_match_turn0"] == 1.0 and m["adv/state_match_turn1"] == 2 / 3 and m["adv/state_match_turn2"] == 0
    assert m["adv/state_match_rate"] == 5 / 7
    eps[1].group = 1  # another prompt's episode shares no state
    assert M.episode_metrics(eps)["adv/state_match_rate"] == 2 / 7


def test_tree_advantages_are_node_values_against_their_siblings():
    """Two roots; root 0 branched after its tool turn into children (0, 0) and (0, 1); root 1 answered at once.
    Q(child) = its own turn rewards + its outcome; Q(root 0) = its turn's reward + the mean of its children's Q."""
    eps = [
        episode(2, 1, node=(0, 0), turn_nodes=[(0,), (0, 0)]),
        episode(2, 1, node=(0, 1), turn_nodes=[(0,), (0, 1)]),
        episode(1, None, node=(1,), turn_nodes=[(1,)]),
    ]
    turn_R, out = [[0.3, 0.1], [0.3, 0.0], [0.0]], [1.0, 0.0, 1.0]
    q00, q01, q1 = 0.1 + 1.0, 0.0 + 0.0, 1.0
    q0 = 0.3 + (q00 + q01) / 2
    got = M.ADVANTAGE_MODES["tree"](eps, turn_R, out, M.Config(scale_returns=False))
    want = [[q0 - q1, q00 - q01], [q0 - q1, q01 - q00], [q1 - q0]]
    assert np.allclose([a for e in got for a in e], [a for e in want for a in e])
    scaled = M.ADVANTAGE_MODES["tree"](eps, turn_R, out, M.Config(scale_returns=True))  # one scale: the returns' std
    assert M.ADVANTAGE_MODES["tree"](eps, turn_R, out, M.Config()) == got, "centred only by default"
    std = np.std([0.3 + 0.1 + 1.0, 0.3, 1.0], ddof=1) + 1e-4
    assert np.allclose([a for e in scaled for a in e], [a / std for e in want for a in e])
    # the node weights: a root stands for b^depth leaves, a child of depth 1 for b^(depth - 1)
    cfg = M.Config(num_generations=8, branch_width=2, branch_depth=2)
    assert [M.node_weight(n, cfg) for n in [(0,), (0, 1), (0, 1, 1)]] == [4.0, 2.0, 1.0]
    assert M.roots_per_prompt(cfg) == 2 and M.roots_per_prompt(M.Config(num_generations=8)) == 8


# --- branching rollouts


def test_a_branching_rollout_samples_the_shared_prefix_once_and_trains_each_sampled_token_once(tok, tmp_path):
    """G = 8 leaves from 2 roots of a prompt, b = 2 at the first two tool results. Siblings continue from the same
    token ids; every token the sampler returned is trained (mask 1) in exactly one episode, at one place."""
    env = make_env(tok, tmp_path, "num_generations=8", "branch_width=2", "branch_depth=2", "advantage_mode=tree")
    script = [tool_call("k1"), tool_call("k2"), "<reasoning>r</reasoning>\n<answer>v</answer>"]
    sampler = ByTurn(tok, [tok.encode(t, add_special_tokens=False) for t in script], "<|im_start|>assistant")
    eps = env.rollout([{"prompt": "What is k1?", "key": "k1", "answer": "v"}] * 2, sampler)
    assert [ep.node for ep in eps] == sorted((i, j, k) for i in range(2) for j in range(2) for k in range(2))
    assert all(ep.group == 0 and len(ep.turns) == 3 for ep in eps)
    assert len(sampler.prompts) == 2 + 4 + 8, "turn 0 sampled per root, turn 1 per child, turn 2 per leaf"
    sent = sum(len(ids) for ids in sampler.sent)
    trained = [(ep.node, k) for ep in eps for s in ep.samples for k, m in enumerate(s.loss_mask) if m]
    assert len(trained) == sent, "each sampled token is trained once"
    for ep in eps:  # siblings share their tokens up to the branch point, as context in all but the first path
        s = ep.samples[-1]
        assert s.text == env.chat.dec(s.input_ids)
        for k, m in enumerate(s.loss_mask):
            assert (s.turn_idx[k] >= 0) == bool(m), "a shared token is context: no turn, no logprob"
    first, second = eps[0].samples[-1], eps[1].samples[-1]
    cut = len(first.input_ids) - eps[0].turns[-1].sampled_len
    assert first.input_ids[:cut] == second.input_ids[:cut], "siblings go on from the same token ids"
    assert sum(first.loss_mask) > sum(second.loss_mask) and eps[1].shared_tokens == sum(first.loss_mask[:cut])
    m = M.rollout_metrics(eps)
    assert m["rollout/paths_per_prompt"] == 8 and m["rollout/branch_points_per_prompt"] == 2 + 4


@pytest.mark.parametrize("fault", ["truncated", "context", "non-finite"])
def test_a_path_cut_below_a_shared_node_leaves_that_node_trained(tok, tmp_path, fault):
    """The first child's path holds its ancestors' tokens trained; the copies hold them as context. When that path is
    cut (mask_truncated_completions) or its leaf sampled a non-finite logprob, only the node it ended in is left out:
    the root and the child above it were sampled whole, and their siblings' paths answered."""
    flags = ["num_generations=8", "branch_width=2", "branch_depth=2", "advantage_mode=tree"]
    env = make_env(tok, tmp_path, *flags, "mask_truncated_completions=true")
    script = [tool_call("k1"), tool_call("k2"), "<reasoning>r</reasoning>\n<answer>v</answer>"]
    sampler = ByTurn(tok, [tok.encode(t, add_special_tokens=False) for t in script], "<|im_start|>assistant")
    eps = env.rollout([{"prompt": "What is k1?", "key": "k1", "answer": "v"}] * 2, sampler)
    holder = eps[0]
    assert holder.node == (0, 0, 0) and holder.turn_nodes == [(0,), (0, 0), (0, 0, 0)]
    if fault == "non-finite":
        leaf = holder.samples[-1]
        leaf.sampler_logprobs[leaf.turn_idx.index(2)] = float("nan")
    else:
        holder.end_reason = fault
    samples, rejected = M.trainable_samples(eps, env.cfg)
    assert rejected == (fault == "non-finite")
    trained = collections.Counter()
    for s in samples:
        for t, m in zip(s.turn_idx, s.loss_mask):
            trained[t] += m
    sent = [len(ids) for ids in sampler.script]
    # every turn of every node once, but the leaf (0, 0, 0)'s last turn: 2 roots, 4 children, 8 leaves less one
    assert [trained[0], trained[1], trained[2]] == [2 * sent[0], 4 * sent[1], 7 * sent[2]]
    assert all(math.isfinite(x) for s in samples for x in s.sampler_logprobs), "a NaN times mask 0 is still NaN"


class ByTurn(ScriptedSampler):
    """Scripted ids by the assistant turns the prompt already holds (every path follows the script)."""

    def __init__(self, tok, script, header):
        super().__init__(tok, script)
        self.header = header

    def generate(self, prompts, max_tokens, temperature, top_p, stop, generator=None, sessions=None):
        outs = []
        for p in prompts:
            ids = self.script[self.tok.decode(p).count(self.header) - 1]
            self.prompts.append(list(p))
            self.sent.append(ids)
            outs.append(M.Completion(ids, [-0.5] * len(ids), "stop"))
        return outs


@pytest.mark.parametrize("boundary", ["fork", "realign"])
def test_forks_and_realigns_inside_branches_keep_every_sampled_token_trained_once(qwen3, boundary):
    """Qwen3 without thinking rewrites every past turn (each tool boundary forks); a second end-of-turn token makes
    each one REALIGN. Branching over either: the paths pass the strict tokenization check, and every sampled token
    is trained once, but the ones a REALIGN made context."""
    eos = [qwen3.convert_tokens_to_ids("<|endoftext|>")] if boundary == "realign" else [qwen3.eos_token_id]
    call = '<tool_call>\n{"name": "_sim_search", "arguments": {"query": "q%d"}}\n</tool_call>'
    think = "" if boundary == "fork" else "<think>\nx\n</think>\n\n"
    enc = lambda t: qwen3.encode(think + t, add_special_tokens=False) + eos  # noqa: E731
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if boundary == "fork" else {}
    cfg = M.Config(system_prompt="", tool_format="native", max_env_steps=10, tokenization_check="strict", **kwargs)
    cfg.num_generations, cfg.branch_width, cfg.branch_depth, cfg.advantage_mode = 8, 2, 2, "tree"
    env = M.MultiTurnToolEnv(qwen3, [CT._sim_search], cfg)
    sampler = ByTurn(qwen3, [enc(call % 0), enc(call % 1), enc("Done.")], "<|im_start|>assistant")
    eps = env.rollout([{"prompt": "q"}] * 2, sampler)
    assert len(eps) == 8 and all(ep.end_reason == "answer" and ep.tokenization_mismatches == 0 for ep in eps)
    assert all((ep.forks if boundary == "fork" else ep.realigns) == 2 for ep in eps)
    trained = sum(sum(s.loss_mask) for ep in eps for s in ep.samples)
    # a REALIGN makes the sampled end marker context: once per node that held it (2 roots, 4 children), by its path
    assert trained == sum(map(len, sampler.sent)) - (0 if boundary == "fork" else 2 + 4)


BRANCHING = ["num_generations=4", "branch_width=2", "branch_depth=1", "advantage_mode=tree", "log_episodes_steps=1"]
BRANCHING += ["max_tokens=48", "prompts_per_step=4"]  # room for a tool call, and prompts enough that some call it


@pytest.mark.parametrize("lora", [[], ["lora_rank=4", "lora_alpha=8", "learning_rate=0.05"]], ids=["full", "lora"])
def test_a_branching_run_trains_its_tree_resumes_exactly_and_evaluates_greedy_paths(tmp_path, toy_model_dir, lora):
    """The warm toy model calls its tool, so its episodes branch; a run resumed from step 2 gives step 3 as the
    unbroken run did; evaluation runs one greedy path per prompt."""
    evals = ["eval_dataset=tasks/toy_kv.py:make_eval_dataset", "eval_max_examples=4", "eval_steps=3"]
    full = M.train(run_cfg(tmp_path, toy_model_dir, "full", "max_steps=3", "save_steps=2", *BRANCHING, *evals, *lora))
    full = full[1:]  # the trained steps (the first row: the evaluation at step 0)
    recs = [json.loads(x) for x in open(tmp_path / "full" / "episodes.jsonl")]
    assert any(len(r["node"]) == 2 for r in recs) and all(m["rollout/paths_per_prompt"] >= 2 for m in full)
    for r in recs:
        assert len(r["turn_nodes"]) == len(r["advantages"]) == len(r["turn_rewards"])
        for s in r["samples"]:
            assert all((w > 0) == bool(m) for w, m in zip(s["weights"], s["loss_mask"]))
    root = [w for r in recs if len(r["node"]) == 2 for s in r["samples"] for w, t in zip(s["weights"], s["turn_idx"])]
    assert 2.0 in root, "a root's tokens stand for its two leaves"
    resume = f"resume_from_checkpoint={tmp_path}/full/checkpoint-2"
    resumed = M.train(run_cfg(tmp_path, toy_model_dir, "resumed", "max_steps=3", resume, *BRANCHING, *evals, *lora))
    for k in ("reward/turn", "loss/policy", "loss/grad_norm", "rollout/sampled_tokens", "rollout/paths_per_prompt"):
        assert resumed[0].get(k) == pytest.approx(full[2].get(k), rel=1e-5, abs=1e-7), k
    evaluated = [json.loads(x) for x in open(tmp_path / "full" / "eval" / "step-3.jsonl")]
    assert len(evaluated) == 4 and "eval/exact_answer_reward" in full[2]


def test_branching_with_rollouts_one_step_ahead_through_the_server(tmp_path, toy_model_dir):
    """max_staleness 1 against the stand-in server: siblings' identical prompts go as one request with n = b."""
    with StandinServer(toy_model_dir) as srv:
        server = [f"vllm_server_url={srv.url}", f"weight_sync_dir={tmp_path}/shm", "max_staleness=1"]
        hist = M.train(run_cfg(tmp_path, toy_model_dir, "srv", "max_steps=3", *server, *BRANCHING))
        requests = [r for r in srv.requests if r["path"] == "/v1/completions" and "prompt_logprobs" not in r["body"]]
    assert all(m["rollout/staleness_max"] <= 1 for m in hist)
    recs = [json.loads(x) for x in open(tmp_path / "srv" / "episodes.jsonl")]
    assert any(len(r["node"]) == 2 for r in recs)
    assert any(r["body"]["n"] == 2 and r["body"]["prompt"] for r in requests), "siblings sampled in one request"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["num_generations=6", "branch_width=2", "branch_depth=2"], "must be a multiple of branch_width"),
        (["num_generations=4", "branch_width=2", "branch_depth=2"], "at least twice"),
        (["num_generations=8", "branch_width=2", "advantage_mode=mt_grpo"], "needs advantage_mode: tree"),
        (["branch_width=2", "advantage_mode=tree", "loss_aggregation=sequence_mean"], "needs loss_aggregation"),
    ],
)
def test_branching_settings_that_cannot_work_are_one_line(overrides, message):
    with pytest.raises(M.ConfigError, match=message):
        M.load_config(None, overrides)


# --- unbiasedness: exact expected gradients of small decision processes (bench/credit_snr.py), every tree enumerated,
# through the trainer's own path. Each decision is one token of a tabular softmax policy.


def expected_gradient(name: str, mode: str, roots: int, b: int, depth: int, scale: bool = False):
    """E[g] over every tree of one prompt (its roots' multisets, with their probabilities), each tree's g through
    assign_advantages -> trainable_samples -> collate -> grpo_loss; and the exact gradient of the expected return."""
    proc, theta = CS.PROCESSES[name](), CS.THETA[name]
    trees = CS.groups(proc, theta, roots, b, depth)
    g, _ = CS.estimates(proc, theta, CS.config(mode, roots * b**depth, b, depth, scale), trees)
    return np.array([p for p, _ in trees]) @ g, CS.exact_gradient(proc, theta)


@pytest.mark.parametrize(
    "name, mode, roots, b, depth",
    [
        ("leaves", "tree", 2, 2, 2),  # a real decision at the leaves (answer or abstain) and at depth 0 and 1
        ("leaves", "tree", 8, 1, 1),
        ("leaves", "reward_to_go", 8, 1, 1),
        ("stop", "tree", 2, 2, 1),  # the policy decides when to stop; random search results and outcomes
        ("stop", "reward_to_go", 4, 1, 1),
        ("leaves", "state_matched", 8, 1, 1),
        ("stop", "state_matched", 4, 1, 1),
    ],
)
def test_the_expected_gradient_through_the_trainer_is_the_exact_gradient(name, mode, roots, b, depth):
    """Exact enumeration, so the tolerance is float32's: any bias, a 10% one by far, fails."""
    mean, exact = expected_gradient(name, mode, roots, b, depth)
    assert np.abs(mean - exact).max() < 1e-5 * np.abs(exact).max(), (mean / exact).round(4)


def per_turn_index(episodes, turn_R, outcome_R, cfg):
    """verl RFC 7244's construction: each turn's reward (the outcome added to the last turn's) centred across the
    group's episodes that have that turn, then summed from turn t on. Its baseline for turn t has as many terms as the
    episode has turns left, so it depends on when the episode itself stopped."""
    rewards = [list(r[: len(ep.turns)]) for ep, r in zip(episodes, turn_R)]
    for r, o in zip(rewards, outcome_R):
        r[-1] += o
    means = [np.mean([r[k] for r in rewards if len(r) > k]) for k in range(max(map(len, rewards)))]
    return [[sum(r[k] - means[k] for k in range(t, len(r))) for t in range(len(r))] for r in rewards]


def test_the_per_turn_index_construction_is_biased(monkeypatch):
    """The documented counterexample: normalising per turn index shifts the gradient when the policy decides when to
    stop."""
    monkeypatch.setitem(M.ADVANTAGE_MODES, "per_turn_index", per_turn_index)
    mean, exact = expected_gradient("stop", "per_turn_index", 4, 1, 1)
    assert np.linalg.norm(mean - exact) > 0.2 * np.linalg.norm(exact)


def gigpo(episodes, turn_R, outcome_R, cfg):
    """GiGPO's form (verl-agent): an episode term (here leave-one-out, unbiased alone) plus a step term, the turn's
    reward-to-go against the others in its exact state, where there are any (else 0)."""
    returns = [sum(r) + o for r, o in zip(turn_R, outcome_R)]
    episode_term = M.leave_one_out(returns)
    to_go = [[sum(r[k:]) + o for k in range(len(ep.turns))] for ep, r, o in zip(episodes, turn_R, outcome_R)]
    out = []
    for i, ep in enumerate(episodes):
        row = []
        for k, turn in enumerate(ep.turns):
            same = [
                to_go[j][t]
                for j, e in enumerate(episodes)
                if j != i
                for t, u in enumerate(e.turns)
                if u.state == turn.state
            ]
            step = to_go[i][k] - np.mean(same) if same else 0.0
            row.append(float(episode_term[i] + step))
        out.append(row)
    return out


@pytest.mark.parametrize("name, G", [("stop", 4), ("leaves", 8)])
def test_adding_a_matched_step_term_to_an_episode_term_reweighs_the_states(monkeypatch, name, G):
    """Why state_matched substitutes its baseline instead of adding two terms: the sum counts a state's gradient
    twice where it is matched and once where not, so states are weighed by how often they recur (E[g] / g* from 1.6
    to 2.0 here), where state_matched's E[g] is g* exactly."""
    monkeypatch.setitem(M.ADVANTAGE_MODES, "gigpo", gigpo)
    mean, exact = expected_gradient(name, "gigpo", G, 1, 1)
    ratios = mean / exact
    assert ratios.max() - ratios.min() > 0.1, ratios
    mean, exact = expected_gradient(name, "state_matched", G, 1, 1)
    assert np.abs(mean / exact - 1).max() < 1e-5


class Tabular(torch.nn.Module):
    """A language model that is a table: after a state token, the two action tokens' logits are that state's row of
    theta (a forced state's: action 0 surely); every other logit is -1e9."""

    def __init__(self, proc: dict, theta):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(theta, dtype=torch.float64))
        self.rows = len(proc["rows"])
        self.config = types.SimpleNamespace(model_type="llama")  # a table reads one token: packed rows as any family

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        forced = torch.tensor([[0.0, -1e9]], dtype=torch.float64)
        after_action = torch.zeros(2, 2, dtype=torch.float64)  # what follows an action token is never trained
        actions = torch.cat([self.theta, forced, after_action])  # [vocab, 2]
        logits = torch.cat([torch.full((len(actions), self.rows + 1), -1e9, dtype=torch.float64), actions], 1)
        return types.SimpleNamespace(logits=logits[input_ids])


def expected_update(monkeypatch, scale: bool = False, leaf_weight: float = 1.0, per_tree=lambda leaves: 1.0):
    """E[g] of `tree` (2 roots, b = 2, depth 2: 8 leaves) on `leaves`, through train_on_samples, and the exact gradient.
    Every tree of one prompt (676, as 351 multisets of its two roots) goes in one batch, its advantages multiplied by
    its probability (at ratio 1 the loss is linear in them) and by per_tree(its leaves). train_on_samples divides by
    the batch's weighted token count; the update is multiplied back by the test's own count: the tokens of each tree's
    G root-to-leaf paths, a path that stopped early standing for the b^(depth + 1 - its branchings) leaves it would
    have had. leaf_weight multiplies the leaves' node weight, as a broken trainer would."""
    proc, theta = CS.leaves_process(), CS.THETA["leaves"]
    cfg = CS.config("tree", 8, 2, 2, scale)
    cfg.max_grad_norm, cfg.micro_batch_size = 0.0, 10**6
    weight = M.node_weight
    monkeypatch.setattr(M, "node_weight", lambda node, c: weight(node, c) * (leaf_weight if len(node) == 3 else 1.0))
    samples, path_tokens = [], 0
    for p, leaves in CS.groups(proc, theta, 2, 2, 2):
        eps, turn_R, outcome_R = CS.episodes_of(proc, theta, leaves, 0)
        M.assign_advantages(eps, turn_R, outcome_R, cfg)
        for s in (s for ep in eps for s in ep.samples):
            s.advantages = [a * p * per_tree(leaves) for a in s.advantages]
        samples += M.trainable_samples(eps, cfg)[0]
        path_tokens += sum(len(turns) * 2 ** (3 - len(node)) for node, turns, _ in leaves)
    monkeypatch.setattr(M, "node_weight", weight)
    model = Tabular(proc, theta)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    M.train_on_samples(model, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1), samples, cfg, 0)
    return -model.theta.grad.numpy().ravel() * path_tokens / 8, CS.exact_gradient(proc, theta)


def test_node_weights_reach_the_update_through_train_on_samples(monkeypatch):
    """Branching trains a shared node's tokens once, weighted by the leaves it stands for, in the loss's mask and in
    its token count. Through train_on_samples E[g] is the exact gradient; leaf weights of 0 or x7 are biased by far
    more than 10%."""
    mean, exact = expected_update(monkeypatch)
    assert np.abs(mean - exact).max() < 1e-4 * np.abs(exact).max(), (mean / exact).round(4)
    for broken in (0.0, 7.0):
        mean, _ = expected_update(monkeypatch, leaf_weight=broken)
        assert np.linalg.norm(mean - exact) > 0.1 * np.linalg.norm(exact), broken


def path_returns_scale(leaves: list) -> float:
    """The std of a tree's G path returns (turn rewards and outcome), which scale_rewards divides its update by."""
    returns = [sum(t[3] for t in turns) + outcome for _, turns, outcome in leaves]
    return float(np.std(returns, ddof=1)) + 1e-4 if np.ptp(returns) > 1e-9 else 1.0


def test_scale_returns_divides_each_tree_by_its_returns_std_which_is_not_unbiased(monkeypatch):
    """With scale_returns each tree's update is the unscaled one over the std of its G path returns: that, exactly,
    is what it gives in expectation, and it is not the policy gradient (docs/turn-credit.md sizes the distortion with
    bench/credit_snr.py)."""
    on, exact = expected_update(monkeypatch, scale=True)
    want, _ = expected_update(monkeypatch, per_tree=lambda leaves: 1 / path_returns_scale(leaves))
    np.testing.assert_allclose(on, want, rtol=1e-5)
    assert np.linalg.norm(on - exact) > 0.1 * np.linalg.norm(exact)
