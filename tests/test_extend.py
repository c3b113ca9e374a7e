"""Extension points are one place each: an advantage mode, a loss aggregation and a tool format are
registered from outside the file, accepted by the config, and used by a real training step."""
import json

import numpy as np
import pytest

import mt_grpo_trainer as M
from test_env import ScriptedSampler
from test_train import run_cfg


def positive_only(episodes, turn_R, outcome_R, cfg):
    """A made-up mode: reinforce only episodes better than their group, on every turn."""
    a = np.clip(M.group_normalize(np.add(turn_R, outcome_R), cfg.scale_rewards), 0.0, None)
    return [[x] * len(ep.turns) for ep, x in zip(episodes, a)]


def sum_over_tokens(per_token, mask, seq_tokens, num_tokens, num_seqs):
    """A made-up aggregation: the plain sum over trained tokens, divided by the batch's samples."""
    return (per_token * mask).sum() / max(num_seqs, 1)


def test_a_registered_advantage_mode_and_loss_aggregation_train_a_step(tmp_path, tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setitem(M.ADVANTAGE_MODES, "positive_only", lambda *a: calls.append(a) or positive_only(*a))
    monkeypatch.setitem(M.LOSS_AGGREGATIONS, "sum_over_tokens", sum_over_tokens)
    with pytest.raises(M.ConfigError, match="one of mt_grpo, grpo_outcome, grpo_merged, positive_only"):
        run_cfg(tmp_path, tiny_model_dir, "x", "advantage_mode=nope")
    hist = M.train(run_cfg(tmp_path, tiny_model_dir, "ext", "max_steps=1", "log_episodes_steps=1",
                           "advantage_mode=positive_only", "loss_aggregation=sum_over_tokens"))
    assert len(calls) == 2, "called once per GRPO group (prompts_per_step=2)"
    assert hist[0]["loss/grad_norm"] > 0
    recs = [json.loads(x) for x in open(tmp_path / "ext" / "episodes.jsonl")]
    want = [adv for c in calls for adv in positive_only(*c)]
    assert [r["advantages"] for r in recs] == want and any(map(any, want))
    assert all(a >= 0 for r in recs for s in r["samples"] for a in s["advantages"])


class BracketTools(M.XMLTools):
    """A made-up protocol: [call] name arg [/call] and [answer] ... [/answer]; results as role 'tool'."""
    stop = ("[/call]", "[/answer]")

    def parse(self, text):
        if "[call]" not in text:
            return {"role": "assistant", "content": text}, []
        name, _, arg = text.split("[call]", 1)[1].split("[/call]")[0].strip().partition(" ")
        return {"role": "assistant", "content": text}, [{"name": name, "args": {"key": arg}}]

    def result(self, text):
        return {"role": "user", "content": f"<result>\n{text}\n</result>"}

    def is_answer(self, text):
        return "[answer]" in text


def test_a_registered_tool_format_drives_the_environment(tok, tmp_path, monkeypatch):
    from tools.kv_lookup import TABLE, lookup
    monkeypatch.setitem(M.TOOL_FORMATS, "bracket", BracketTools)
    cfg = M.load_config("hf_recipes/toy/toy-kv--mt-grpo.yaml", [f"output_dir={tmp_path}", "tool_format=bracket"])
    env = M.MultiTurnToolEnv(tok, [lookup], cfg)
    sampler = ScriptedSampler(tok, ["[call] lookup golf [/call]", f"[answer]{TABLE['golf']}[/answer]"])
    [ep] = env.rollout([{"prompt": "q"}], sampler)
    assert env.stop == ("[/call]", "[/answer]") and ep.tool_calls == 1 and ep.tool_errors == 0
    assert ep.completion[1]["content"] == f"<result>\n{TABLE['golf']}\n</result>" and ep.end_reason == "answer"
    assert len(ep.samples) == 1 and ep.first_result_turn == 1
