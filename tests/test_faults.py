"""Fault injection for the guarantees not covered next to their feature (README, "Guarantees"): each
fault gives a defined, counted outcome, never invented training tokens, a hang or a lost checkpoint."""
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import mt_grpo_trainer as M
from conftest import recipe_cfg
from test_env import ScriptedSampler, make_env, tool_call


def test_truncated_episodes_are_left_out_of_the_loss_when_asked(tok, tmp_path):
    rows = [{"prompt": "q"}] * 2
    for flag, expected in (("false", 2), ("true", 1)):
        env = make_env(tok, tmp_path, f"mask_truncated_completions={flag}")
        eps = env.rollout(rows, ScriptedSampler(tok, [tool_call("golf"), "<answer>x</answer>"], finish={0: "length"}))
        assert [e.end_reason for e in eps] == ["truncated", "answer"] and eps[0].tool_calls == 0
        samples, rejected = M.trainable_samples(eps, env.cfg)
        assert len(samples) == expected and rejected == 0


def test_a_tool_that_raises_becomes_a_counted_error_result(tok, tmp_path):
    def broken(key: str) -> str:
        """Always fails."""
        raise ConnectionError("index server down")
    env = M.MultiTurnToolEnv(tok, [broken], recipe_cfg(tmp_path, "max_env_steps=1"))
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, ['<tool>{"name": "broken", "args": {"key": "a"}}</tool>',
                                                                "<answer>a</answer>"]))
    assert ep.tool_errors == 1 and "Error: ConnectionError: index server down" in ep.completion[1]["content"]


def test_a_huge_tool_output_is_cut_before_tokenization(tok, tmp_path):
    def flood(key: str) -> str:
        """Returns a megabyte."""
        return "x" * 1_000_000
    env = M.MultiTurnToolEnv(tok, [flood], recipe_cfg(tmp_path, "max_env_steps=1", "tool_output_max_chars=200",
                                                      "max_seq_len=4096"))
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, ['<tool>{"name": "flood", "args": {"key": "a"}}</tool>',
                                                                "<answer>a</answer>"]))
    result = ep.completion[1]["content"]
    assert "[cut: 999800 more characters]" in result and len(result) < 300
    assert ep.end_reason == "answer" and len(ep.samples[-1].input_ids) < 1000


def test_an_empty_generation_ends_the_episode_with_a_flag(tok, tmp_path):
    env = make_env(tok, tmp_path)
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, [""]))
    assert ep.end_reason == "empty" and ep.done and len(ep.turns) == 1
    assert M.rollout_metrics([ep])["rollout/empty"] == 1.0


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
    m = M.train_on_samples(model, None, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1), [s],
                           recipe_cfg(tmp_path, "is_ratio_cap=2.0", "max_grad_norm=0", "temperature=1.0"), 0)
    assert m["loss/is_weight"] == pytest.approx(weight.sum().item() / 3, rel=1e-4)
    assert math.isfinite(m["loss/policy"])
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp = M.token_logprobs(model, ids, torch.ones_like(ids), 1.0)
    mask = torch.tensor([s.loss_mask])
    M.grpo_loss(logp, logp.detach(), torch.tensor([s.advantages]), mask, epsilon=0.2, epsilon_high=0.2,
                aggregation="token_mean", num_tokens=3, num_seqs=1, is_weight=weight)[0].backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def test_a_crash_mid_save_leaves_the_previous_checkpoint_usable(tiny_model_dir, tmp_path, monkeypatch):
    cfg = recipe_cfg(tmp_path, f"model_name_or_path={tiny_model_dir}", "model_builder=", "max_steps=1",
                     "prompts_per_step=2", "num_generations=2", "max_tokens=8")
    M.train(cfg)
    real_save = torch.save

    def crash(obj, path, *a, **k):   # the model and tokenizer are written, the trainer state is not
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(OSError, match="disk full"):
        M.save_checkpoint(cfg, 2, model, AutoTokenizer.from_pretrained(tiny_model_dir), opt,
                          torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1))
    monkeypatch.setattr(torch, "save", real_save)
    assert (tmp_path / "run" / "checkpoint-2.tmp").is_dir() and not (tmp_path / "run" / "checkpoint-2").exists()
    resumed = M.load_config(None, [f"output_dir={tmp_path}/run", "resume_from_checkpoint=auto"])
    assert M.find_checkpoint(resumed) == os.path.join(f"{tmp_path}/run", "checkpoint-1")


def test_resume_after_a_hard_kill_continues_from_the_last_checkpoint(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = ["hf_recipes/toy/toy-kv--mt-grpo.yaml", f"model_name_or_path={tiny_model_dir}", "model_builder=",
            f"output_dir={run}", "prompts_per_step=2", "num_generations=2", "max_tokens=8", "save_steps=2"]
    p = subprocess.Popen([sys.executable, "mt_grpo_trainer.py", *args, "max_steps=500"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoint-4").is_dir():
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)   # no handler runs: a crash
    p.wait(timeout=30)
    done = sorted(int(d.name.split("-")[1]) for d in run.iterdir() if d.name.startswith("checkpoint-") and d.name[11:].isdigit())
    last = done[-1]
    hist = M.train(M.load_config(args[0], args[1:] + [f"max_steps={last + 1}", "resume_from_checkpoint=auto"]))
    assert [h["step"] for h in hist] == [last + 1]
    steps = [__import__("json").loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, last + 2)), "steps logged after the checkpoint are dropped, then redone once"


@pytest.fixture(scope="module")
def three_checkpoints(tiny_model_dir, tmp_path_factory):
    """A 3-step run that saved after every step and dumped every step's episodes, copied fresh by each test."""
    base = tmp_path_factory.mktemp("three")
    M.train(recipe_cfg(base, f"model_name_or_path={tiny_model_dir}", "model_builder=", "max_steps=3", "save_steps=1",
                       "prompts_per_step=2", "num_generations=2", "max_tokens=8", "log_episodes_steps=1"))
    return base / "run"


def copied_run(three_checkpoints, tmp_path):
    import shutil
    shutil.copytree(three_checkpoints, tmp_path / "run")
    return tmp_path / "run"


def resume_cfg(tmp_path, tiny_model_dir, ckpt="auto", *extra):
    return recipe_cfg(tmp_path, f"model_name_or_path={tiny_model_dir}", "model_builder=", "prompts_per_step=2",
                      "num_generations=2", "max_tokens=8", "log_episodes_steps=1", f"resume_from_checkpoint={ckpt}", *extra)


def cut(path, n=100):
    os.truncate(path, os.path.getsize(path) - n)


def test_auto_resume_falls_back_past_a_truncated_or_incomplete_checkpoint_and_says_why(three_checkpoints, tmp_path,
                                                                                      tiny_model_dir, capsys):
    run = copied_run(three_checkpoints, tmp_path)
    cut(run / "checkpoint-3" / "model.safetensors")            # corrupt weights
    cut(run / "checkpoint-2" / "trainer_state.pt")             # a truncated trainer state
    assert M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir)) == str(run / "checkpoint-1")
    out = capsys.readouterr().out
    assert f"skipping {run}/checkpoint-3: model.safetensors" in out and f"skipping {run}/checkpoint-2: trainer_state.pt" in out
    hist = M.train(resume_cfg(tmp_path, tiny_model_dir, "auto", "max_steps=2"))
    assert [h["step"] for h in hist] == [2] and "resumed from" in capsys.readouterr().out
    (run / "checkpoint-1" / "tokenizer.json").unlink()         # a missing file: now none is usable
    (run / "checkpoint-2" / "tokenizer.json").unlink()
    with pytest.raises(M.ConfigError, match=r"no checkpoint in .* can be resumed.*checkpoint-2: tokenizer.json is missing"):
        M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir))


def test_resuming_a_named_checkpoint_that_fails_verification_is_one_line_naming_the_file(three_checkpoints, tmp_path,
                                                                                       tiny_model_dir):
    run = copied_run(three_checkpoints, tmp_path)
    cut(run / "checkpoint-3" / "model.safetensors")
    (run / "checkpoint-2" / "tokenizer.json").unlink()
    for ckpt, what in ((3, "model.safetensors has"), (2, "tokenizer.json is missing")):
        with pytest.raises(M.ConfigError, match=f"checkpoint-{ckpt}.*{what}") as e:
            M.train(resume_cfg(tmp_path, tiny_model_dir, run / f"checkpoint-{ckpt}", "max_steps=4"))
        assert "\n" not in str(e.value)


def test_a_checkpoint_without_a_manifest_still_resumes_and_is_still_checked(three_checkpoints, tmp_path, tiny_model_dir,
                                                                           capsys):
    """Checkpoints saved before the manifest: what can be checked without it (the weights and the trainer state open)."""
    run = copied_run(three_checkpoints, tmp_path)
    for d in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        (run / d / "manifest.json").unlink(missing_ok=True)
    assert M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir)) == str(run / "checkpoint-3")
    cut(run / "checkpoint-3" / "model.safetensors")
    cut(run / "checkpoint-2" / "trainer_state.pt")
    assert M.find_checkpoint(resume_cfg(tmp_path, tiny_model_dir)) == str(run / "checkpoint-1")
    out = capsys.readouterr().out
    assert "checkpoint-3: model.safetensors does not load" in out and "checkpoint-2: trainer_state.pt does not load" in out
    hist = M.train(resume_cfg(tmp_path, tiny_model_dir, "auto", "max_steps=2"))
    assert [h["step"] for h in hist] == [2]


def test_a_torn_last_log_line_is_dropped_on_resume_and_said(three_checkpoints, tmp_path, tiny_model_dir, capsys):
    """A crash while step 4's lines were written: resuming from checkpoint-3 drops the torn lines and redoes step 4."""
    run = copied_run(three_checkpoints, tmp_path)
    for name in ("metrics.jsonl", "episodes.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"step": 4, "reward/outc')
    hist = M.train(resume_cfg(tmp_path, tiny_model_dir, "auto", "max_steps=4"))
    assert [h["step"] for h in hist] == [4]
    out = capsys.readouterr().out
    assert "metrics.jsonl ends in a torn line" in out and "episodes.jsonl ends in a torn line" in out
    import json
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert {json.loads(x)["step"] for x in (run / "episodes.jsonl").read_text().splitlines()} == {1, 2, 3, 4}
