"""Extension points are one place each: an advantage mode, a loss aggregation and a tool format are
registered from outside the file, accepted by the config, and used by a real training step; a sampler is one class
behind the written interface (section C) and the line in setup() that picks it."""

import copy
import json

import numpy as np
import pytest
import torch

import mt_grpo_trainer as M
from test_env import ScriptedSampler
from test_train import run_cfg


def positive_only(episodes, turn_R, outcome_R, cfg):
    """A made-up mode: reinforce only episodes better than their group, on every turn."""
    a = np.clip(M.group_normalize(np.add([sum(r) for r in turn_R], outcome_R), cfg.scale_rewards), 0.0, None)
    return [[x] * len(ep.turns) for ep, x in zip(episodes, a)]


def sum_over_tokens(per_token, mask, seq_tokens, num_tokens, num_seqs):
    """A made-up aggregation: the plain sum over trained tokens, divided by the batch's samples."""
    return (per_token * mask).sum() / max(num_seqs, 1)


class CopySampler(M.LocalSampler):
    """A made-up sampler with weights of its own, as a server has: the in-process decode loop on a copy of the policy,
    which sync_weights loads the trainer's weights into and probe_logprobs scores the probe with."""

    policy_version = 0

    def __init__(self, model, tok):
        super().__init__(copy.deepcopy(model).eval(), tok)
        self.synced, self.closed = [], False

    def sync_weights(self, model, state_dict, version):
        self.model.load_state_dict(state_dict)
        self.policy_version = version
        self.synced.append(version)

    def probe_logprobs(self, ids):
        x = torch.tensor([ids])
        with torch.no_grad():
            return {"copy": M.token_logprobs(self.model, x, torch.ones_like(x), 1.0)[0, 1:].tolist()}

    def close(self):
        self.closed = True


def test_a_new_sampler_is_a_class_and_the_line_that_picks_it(tmp_path, tiny_model_dir, monkeypatch):
    """The class stands where setup()'s line builds the in-process sampler: the loop syncs it at set-up and after every
    update, checks it on the probe and closes it, as it does a server, without asking which sampler it has."""
    made = []
    monkeypatch.setattr(M, "LocalSampler", lambda model, tok: made.append(CopySampler(model, tok)) or made[-1])
    hist = M.train(run_cfg(tmp_path, tiny_model_dir, "copy", "max_steps=2"))
    [sampler] = made
    assert sampler.synced == [0, 1, 2] and sampler.policy_version == 2 and sampler.closed
    assert all(m["sync/probe_change"] > 0 for m in hist), "the weights moved"
    assert all(m["sync/probe_logprob_diff"] < 1e-6 for m in hist), "and the copy followed them"
    M.train(run_cfg(tmp_path, tiny_model_dir, "copy-eval", "eval_max_examples=2"), eval_only=True)
    assert made[-1].synced == [0] and made[-1].closed, "evaluation syncs its sampler and closes it too"


def test_a_registered_advantage_mode_and_loss_aggregation_train_a_step(tmp_path, tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setitem(M.ADVANTAGE_MODES, "positive_only", lambda *a: calls.append(a) or positive_only(*a))
    monkeypatch.setitem(M.LOSS_AGGREGATIONS, "sum_over_tokens", sum_over_tokens)
    with pytest.raises(M.ConfigError, match="one of mt_grpo, .*, state_matched, positive_only"):
        run_cfg(tmp_path, tiny_model_dir, "x", "advantage_mode=nope")
    hist = M.train(
        run_cfg(
            tmp_path,
            tiny_model_dir,
            "ext",
            "max_steps=1",
            "log_episodes_steps=1",
            "advantage_mode=positive_only",
            "loss_aggregation=sum_over_tokens",
        )
    )
    assert len(calls) == 2, "called once per GRPO group (prompts_per_step=2)"
    assert hist[0]["loss/grad_norm"] > 0
    recs = [json.loads(x) for x in open(tmp_path / "ext" / "episodes.jsonl")]
    want = [adv for c in calls for adv in positive_only(*c)]
    assert [r["advantages"] for r in recs] == want and any(map(any, want))
    assert all(a >= 0 for r in recs for s in r["samples"] for a in s["advantages"])


class BracketTools:
    """A made-up protocol, written from the interface above TOOL_FORMATS alone: [call] name key=value [/call] and
    [answer] ... [/answer]; a result comes back as a user message [[result]] ... [[/result]], not XML's <result>."""

    args_key, stop = "args", ("[/call]", "[/answer]")

    def __init__(self, tools):
        self.schemas = None

    def parse(self, text):
        if "[call]" not in text:
            return {"role": "assistant", "content": text}, []
        name, _, arg = text.split("[call]", 1)[1].split("[/call]")[0].strip().partition(" ")
        key, _, value = arg.partition("=")
        return {"role": "assistant", "content": text}, [{"name": name, "args": {key: value}}]

    def result(self, text):
        return {"role": "user", "content": f"[[result]]\n{text}\n[[/result]]"}

    def is_result(self, m):
        return m["role"] == "user" and m["content"].startswith("[[result]]")

    def is_answer(self, text):
        return "[answer]" in text

    def call_text(self, query):  # check-template's scripted turns
        return f"[call] _sim_search query={query} [/call]"

    def answer_text(self, answer):
        return f"[answer]{answer}[/answer]"


CALLS = ["[call] lookup key=golf [/call]", "[call] lookup key=alpha [/call]"]


def test_a_registered_tool_format_owns_what_its_results_look_like(tok, tmp_path, monkeypatch):
    """Its results are user messages in its own wrapper: each tool boundary is labelled 'tool' and extends (one
    sample), the bridge builds those prompts, and thinking_retention=tool_cycle sees the tool cycle."""
    import check_template as CT
    from tools.kv_lookup import TABLE, lookup

    monkeypatch.setitem(M.TOOL_FORMATS, "bracket", BracketTools)
    cfg = M.load_config("hf_recipes/toy/toy-kv--mt-grpo.yaml", [f"output_dir={tmp_path}", "tool_format=bracket"])
    env = M.MultiTurnToolEnv(tok, [lookup], cfg)
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, CALLS + [f"[answer]{TABLE['golf']}[/answer]"]))
    assert env.stop == ("[/call]", "[/answer]") and ep.tool_calls == 2 and ep.tool_errors == 0
    assert ep.completion[1]["content"] == f"[[result]]\n{TABLE['golf']}\n[[/result]]" and ep.end_reason == "answer"
    assert ep.boundaries == [{"turn": t, "kind": "tool", "extends": True, "realigned": 0} for t in (1, 2)]
    assert len(ep.samples) == 1 and ep.first_result_turn == 1
    assert env.chat.bridge_checks == 2, "both tool boundaries' prompts were bridged (and equal to the full rendering)"
    cfg.thinking_retention = "tool_cycle"
    assert env.chat.verbatim_turns(ep.messages, ep.sampled_texts) == set(ep.sampled_texts), (
        "the three turns are one tool cycle"
    )
    assert env.chat.verbatim_turns(ep.messages + [{"role": "user", "content": "And?"}], ep.sampled_texts) == set()
    # check-template scripts the format with its own call_text and answer_text
    r = CT.check_template(tok, "tool_cycle", "bracket")
    assert [b["kind"] for b in r["boundaries"]] == ["tool", "tool", "user", "tool"] * 2 and r["violations"] == []


def test_a_registered_tool_format_trains_a_step(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(M.TOOL_FORMATS, "bracket", BracketTools)
    monkeypatch.setattr(M, "LocalSampler", lambda model, tok: ScriptedSampler(tok, CALLS + ["[answer]v[/answer]"]))
    bridged, bridge = [], M.ChatTemplate.bridge
    monkeypatch.setattr(
        M.ChatTemplate, "bridge", lambda chat, ep, s: bridged.append(bridge(chat, ep, s)) or bridged[-1]
    )
    hist = M.train(
        run_cfg(tmp_path, tiny_model_dir, "fmt", "max_steps=1", "log_episodes_steps=1", "tool_format=bracket")
    )
    assert hist[0]["rollout/tool_calls"] > 0 and hist[0]["rollout/samples_per_episode"] == 1
    recs = [json.loads(x) for x in open(tmp_path / "fmt" / "episodes.jsonl")]
    assert {b["kind"] for r in recs for b in r["boundaries"]} == {"tool"}
    assert bridged and None not in bridged, "every tool boundary's prompt was bridged"
