"""Agent harnesses (appendix H): a harness runs its own loop with the real `openai` client against an endpoint per
episode, and each request is one turn of the same environment. What is checked: the trained tokens are the sampled
ones after exactly the prompt the sampler saw (I1), native tool calls (several in one turn) go out as `tool_calls` and
come back as the same messages (so the sample extends), a harness that edits its history forks, the request fields
the trainer refuses or overrides, and every fault as a counted outcome (I6), with nothing left listening."""

import copy
import json
import re
import os
import shutil
import signal
import socket
import sys
import threading
import time

import openai
import pytest

import mt_grpo_trainer as M
from conftest import recipe_cfg
from test_env import char_ids
from test_templates import qwen3 as qwen3  # noqa: F401  (a fixture)
from tasks import fixtures
from tools.kv_lookup import TABLE

TOY_AGENT = "tasks/toy_kv_agent.py:agent"


class ByPrompt:
    """A sampler that answers each prompt by its text: `reply(text) -> sampled text`, as non-canonical token ids
    (one per character) with made-up logprobs, and an end token where `end` is set. Records prompts and replies."""

    policy_version = None

    def __init__(self, tok, reply, end: int | None = None, finish="stop"):
        self.tok = tok
        self.reply = reply
        self.end = end
        self.finish = finish
        self.turns = []  # (prompt ids, sampled ids, logprobs), in the order sampled
        self.batches = []  # the prompts of each generate call
        self.temperatures = []
        self.lock = threading.Lock()

    def generate(self, prompts, max_tokens, temperature, top_p, stop, generator=None, sessions=None):
        outs = []
        self.temperatures.append(temperature)
        self.batches.append(len(prompts))
        for p in prompts:
            ids = char_ids(self.tok, self.reply(self.tok.decode(p)))
            if self.end is not None:
                ids.append(self.end)
            logprobs = [-0.01 * (j + 1) for j in range(len(ids))]
            with self.lock:
                self.turns.append((list(p), ids, logprobs))
            finish = self.finish(self.tok.decode(p)) if callable(self.finish) else self.finish
            outs.append(M.Completion(ids, logprobs, finish))
        return outs

    def close(self):
        pass


def toy_reply(text: str) -> str:
    """The toy's protocol: look the key up, then answer with the result."""
    if "<result>" not in text:
        key = text.split('"')[1]
        return f"<reasoning>look</reasoning>\n<tool>{json.dumps({'name': 'lookup', 'args': {'key': key}})}</tool>"
    value = text.rsplit("<result>\n", 1)[1].split("\n</result>")[0]
    return f"<reasoning>found</reasoning>\n<answer>{value}</answer>"


def agent_env(tok, tmp_path, agent, *overrides):
    cfg = recipe_cfg(tmp_path, "tools=[]", f"agent={TOY_AGENT}", *overrides)
    return M.AgentEnv(tok, agent, cfg)


def rows(keys):
    return [{"prompt": f'What is the value of "{k}"?', "key": k, "answer": TABLE[k]} for k in keys]


def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def refused(base_url) -> bool:
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def trained_turns(ep):
    """Per sample, its trained runs of ids with the prompt each followed, as (prompt ids, ids, logprobs)."""
    out = []
    for s in ep.samples:
        k = 0
        while k < len(s.input_ids):
            if not s.loss_mask[k]:
                k += 1
                continue
            end = k
            while end < len(s.input_ids) and s.loss_mask[end] and s.turn_idx[end] == s.turn_idx[k]:
                end += 1
            out.append((s.input_ids[:k], s.input_ids[k:end], s.sampler_logprobs[k:end]))
            k = end
    return out


def test_the_toy_harness_trains_exactly_the_sampled_tokens_and_leaves_nothing_listening(tok, tmp_path):
    from tasks.toy_kv_agent import agent as toy_agent

    urls = []

    def agent(row, base_url):
        urls.append(base_url)
        return toy_agent(row, base_url)

    env = agent_env(tok, tmp_path, agent)
    sampler = ByPrompt(tok, toy_reply, end=tok.convert_tokens_to_ids("<|im_end|>"))
    keys = ["golf", "kilo", "alpha", "mike"]
    eps = env.rollout(rows(keys), sampler)
    assert [ep.end_reason for ep in eps] == ["answer"] * 4
    assert max(sampler.batches) > 1, "concurrent episodes share a generate call"
    for ep, k in zip(eps, keys):
        assert len(ep.samples) == 1 and ep.forks == 0 and ep.tokenization_mismatches == 0  # ChatML extends
        assert len(ep.turns) == 2 and ep.tool_calls == 1
        # I1: every trained run is a sampled reply, after exactly the prompt the sampler was given, with its logprobs
        assert trained_turns(ep) == [t for t in sampler.turns if t in trained_turns(ep)]
        assert len(trained_turns(ep)) == 2
        assert ep.completion[1] == {"role": "user", "content": f"<result>\n{TABLE[k]}\n</result>"}  # role tool, XML
        assert ep.row["agent_result"] == f"<reasoning>found</reasoning>\n<answer>{TABLE[k]}</answer>"
        assert ep.n_prompt_messages == 1 and ep.messages[0]["content"] == f'What is the value of "{k}"?'
    from rewards.toy_kv_reward import exact_answer_reward

    assert exact_answer_reward([ep.completion for ep in eps], [ep.row["answer"] for ep in eps]) == [1.0] * 4
    assert all(refused(u) for u in urls), "the endpoint closes with its rollout"


def test_256_harnesses_that_call_at_the_same_moment_are_all_answered(tok, tmp_path):
    """The endpoint holds a rollout's worth of harnesses calling at once (its listen queue, its handler threads): 256
    toy harnesses released together by a barrier, so their client opens 256 connections at once; none refused, none
    reset, no request lost."""
    from tasks.toy_kv_agent import agent as toy_agent

    n = 256
    barrier = threading.Barrier(n)

    def agent(row, base_url):
        barrier.wait(timeout=60)
        return toy_agent(row, base_url)

    env = agent_env(tok, tmp_path, agent)
    sampler = ByPrompt(tok, toy_reply, end=tok.convert_tokens_to_ids("<|im_end|>"))
    keys = [sorted(TABLE)[i % len(TABLE)] for i in range(n)]
    eps = env.rollout(rows(keys), sampler)
    assert env.stats() == {}, "no harness failed"
    assert [ep.end_reason for ep in eps] == ["answer"] * n and sum(len(ep.turns) for ep in eps) == 2 * n
    for ep, k in zip(eps, keys):
        assert ep.row["agent_result"] == f"<reasoning>found</reasoning>\n<answer>{TABLE[k]}</answer>"


def test_native_tool_calls_several_in_one_turn_go_out_as_tool_calls_and_come_back_as_the_same_turn(qwen3, tmp_path):
    schema = {
        "type": "function",
        "function": {"name": "lookup", "description": "d", "parameters": {"type": "object", "properties": {}}},
    }
    calls = [{"name": "lookup", "arguments": {"key": k}} for k in ("golf", "kilo")]
    two_calls = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    seen = {}

    def reply(text):
        return two_calls if "<tool_response>" not in text else "The values are known."

    def agent(row, base_url):
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            r = client(base_url).chat.completions.create(model="policy", messages=messages, tools=[schema])
            message = r.choices[0].message
            seen.setdefault("finish", []).append(r.choices[0].finish_reason)
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content
            seen["calls"] = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
            for c in message.tool_calls:
                value = TABLE[json.loads(c.function.arguments)["key"]]
                messages.append({"role": "tool", "tool_call_id": c.id, "content": value})

    env = agent_env(qwen3, tmp_path, agent, "tool_format=native")
    sampler = ByPrompt(qwen3, reply, end=qwen3.convert_tokens_to_ids("<|im_end|>"))
    [ep] = env.rollout(rows(["golf"]), sampler)
    assert seen["finish"] == ["tool_calls", "stop"]
    assert seen["calls"] == [("lookup", {"key": "golf"}), ("lookup", {"key": "kilo"})]
    assert ep.end_reason == "answer" and ep.tool_calls == 2 and len(ep.turns) == 2
    assert ep.forks == 0 and len(ep.samples) == 1 and ep.tokenization_mismatches == 0, "the reply came back as sent"
    assert [m["role"] for m in ep.completion] == ["assistant", "tool", "tool", "assistant"]
    assert ep.completion[0]["tool_calls"][1]["function"]["arguments"] == {"key": "kilo"}
    text = qwen3.decode(ep.samples[0].input_ids)
    assert '"description": "d"' in text, "the request's tools reach the chat template"
    assert trained_turns(ep) == sampler.turns


def test_a_turn_cut_after_a_whole_tool_call_is_length_with_no_tool_calls_so_no_harness_runs_the_tool(qwen3, tmp_path):
    """The trainer ends a cut turn `truncated`: a reply with tool_calls would have the harness run its tool and meet
    the 410, and its library's error would become the agent_result the reward functions read."""
    call = json.dumps({"name": "lookup", "arguments": {"key": "golf"}})
    seen = {}

    def agent(row, base_url):
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            r = client(base_url).chat.completions.create(model="policy", messages=messages)
            message = r.choices[0].message
            seen.setdefault("finish", []).append(r.choices[0].finish_reason)
            if not message.tool_calls:
                return message.content
            messages.append(message.model_dump(exclude_none=True))
            for c in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": "1"})

    env = agent_env(qwen3, tmp_path, agent, "tool_format=native")
    sampler = ByPrompt(qwen3, lambda text: f"Looking.\n<tool_call>\n{call}\n</tool_call>\nand then", finish="length")
    [ep] = env.rollout(rows(["golf"]), sampler)
    assert seen["finish"] == ["length"], "one request: the harness ran no tool"
    assert ep.end_reason == "truncated" and len(ep.turns) == 1
    assert ep.row["agent_result"].startswith("Looking."), "the reply's text, not an error of the harness"


LOOKUP = {
    "type": "function",
    "function": {"name": "lookup", "description": "d", "parameters": {"type": "object", "properties": {}}},
}


def two_lookups_then_answer(text):
    """Native calls: two lookups in one turn, then an answer once their results are in."""
    if "<tool_response>" in text:
        return "The values are known."
    calls = [{"name": "lookup", "arguments": {"key": k}} for k in ("golf", "kilo")]
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def streamed_message(stream) -> tuple[dict, str, object]:
    """A harness's fold of `chat.completion.chunk`s: the message, the finish reason, the usage (None if none came)."""
    message = {"role": None, "content": ""}
    calls = {}
    finish = None
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            message["role"] = delta.role or message["role"]
            message["content"] += delta.content or ""
            for c in delta.tool_calls or []:
                call = calls.setdefault(
                    c.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] += c.id or ""
                call["function"]["name"] += c.function.name or ""
                call["function"]["arguments"] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message, finish, usage


def test_a_streamed_turn_is_the_whole_turn_as_chunks_and_comes_back_as_the_same_turn(qwen3, tmp_path):
    """The real client's stream, folded as a harness folds it: the same message (text, native tool calls with their ids
    and JSON arguments), finish reason and usage as the whole reply, so the episode is token for token the same."""
    seen = {}

    def agent(row, base_url, stream):
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            kw = dict(model="policy", messages=messages, tools=[LOOKUP])
            if stream:
                usage_asked = len(messages) == 1  # the first turn asks for the usage chunk, the second does not
                kw.update(stream=True, stream_options={"include_usage": True} if usage_asked else None)
                message, finish, usage = streamed_message(client(base_url).chat.completions.create(**kw))
            else:
                r = client(base_url).chat.completions.create(**kw)
                message = r.choices[0].message.model_dump(exclude_none=True)
                finish = r.choices[0].finish_reason
                usage = r.usage
            seen.setdefault(stream, []).append((message, finish, usage and usage.model_dump(exclude_none=True)))
            messages.append(message)
            if not message.get("tool_calls"):
                return message["content"]
            for c in message["tool_calls"]:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": c["id"],
                        "content": TABLE[json.loads(c["function"]["arguments"])["key"]],
                    }
                )

    eps = {}
    for stream in (False, True):
        env = agent_env(qwen3, tmp_path, lambda row, url: agent(row, url, stream), "tool_format=native")
        sampler = ByPrompt(qwen3, two_lookups_then_answer, end=qwen3.convert_tokens_to_ids("<|im_end|>"))
        [eps[stream]] = env.rollout(rows(["golf"]), sampler)
    (first, finish, usage), (second, finish2, usage2) = seen[True]
    assert (finish, finish2) == ("tool_calls", "stop")
    assert [json.loads(c["function"]["arguments"]) for c in first["tool_calls"]] == [{"key": "golf"}, {"key": "kilo"}]
    assert second == {"role": "assistant", "content": "The values are known."}
    assert usage == seen[False][0][2] and usage["completion_tokens"] > 0 and usage2 is None
    assert [m for m, _, _ in seen[True]] == [m for m, _, _ in seen[False]], "the stream carries the whole reply"
    a, b = eps[True], eps[False]
    assert a.end_reason == "answer" and a.forks == 0 and len(a.samples) == 1, "the streamed reply came back as sent"
    assert [(s.input_ids, s.loss_mask, s.sampler_logprobs) for s in a.samples] == [
        (s.input_ids, s.loss_mask, s.sampler_logprobs) for s in b.samples
    ]


def text_then_two_lookups(text):
    if "<tool_response>" in text:
        return "The values are known."
    return "Looking both up.\n" + two_lookups_then_answer(text)


def chat_harness(row, base_url):
    """The Responses harness's conversation, through chat completions."""
    messages = [{"role": "system", "content": "Look keys up."}, {"role": "user", "content": row["prompt"]}]
    while True:
        message = client(base_url).chat.completions.create(model="policy", messages=messages, tools=[LOOKUP])
        message = message.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for c in message.tool_calls:
            value = TABLE[json.loads(c.function.arguments)["key"]]
            messages.append({"role": "tool", "tool_call_id": c.id, "content": value})


def responses_harness(mode, seen):
    """A Responses API harness: instructions, a string input, function tools; each reply's output items go back as
    input (with a reasoning item of its own, left out), each call's result as a function_call_output."""
    tool = {"type": "function", "name": "lookup", "description": "d", "parameters": LOOKUP["function"]["parameters"]}

    def agent(row, base_url):
        items = row["prompt"]
        while True:
            kw = dict(model="policy", instructions="Look keys up.", input=items, tools=[tool])
            if mode == "whole":
                r = client(base_url).responses.create(**kw)
            elif mode == "stream":
                events = list(client(base_url).responses.create(**kw, stream=True))
                seen.append([e.type for e in events])
                assert [e.sequence_number for e in events] == list(range(len(events)))
                r = events[-1].response
                deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
                assert deltas == r.output_text
            else:  # the client's stream helper, which checks each event against the snapshot it builds
                with client(base_url).responses.stream(**kw) as stream:
                    r = stream.get_final_response()
            assert r.status == "completed" and r.usage.output_tokens > 0
            if isinstance(items, str):
                items = [{"role": "user", "content": items}, {"type": "reasoning", "id": "rs_0", "summary": []}]
            items += [item.model_dump(exclude_none=True) for item in r.output]
            calls = [item for item in r.output if item.type == "function_call"]
            if not calls:
                return r.output_text
            for c in calls:
                output = TABLE[json.loads(c.arguments)["key"]]
                items.append({"type": "function_call_output", "call_id": c.call_id, "output": output})

    return agent


@pytest.mark.parametrize("mode", ["whole", "stream", "helper"])
def test_the_responses_api_is_the_same_turn_as_a_chat_completion(qwen3, tmp_path, mode):
    """A harness on the Responses API (whole, streamed, or through the client's stream helper) and one on chat
    completions, with the same sampler: the same episode, token for token; each reply came back as the same turn."""
    eps = {}
    seen = []
    for name, agent in (("chat", chat_harness), ("responses", responses_harness(mode, seen))):
        env = agent_env(qwen3, tmp_path, agent, "tool_format=native")
        sampler = ByPrompt(qwen3, text_then_two_lookups, end=qwen3.convert_tokens_to_ids("<|im_end|>"))
        [eps[name]] = env.rollout(rows(["golf"]), sampler)
    a, b = eps["responses"], eps["chat"]
    assert a.row["agent_result"] == b.row["agent_result"] == "The values are known."
    assert a.end_reason == "answer" and a.tool_calls == 2 and a.forks == 0 and len(a.samples) == 1
    assert a.completion == b.completion and a.messages == b.messages
    assert [(s.input_ids, s.loss_mask, s.sampler_logprobs) for s in a.samples] == [
        (s.input_ids, s.loss_mask, s.sampler_logprobs) for s in b.samples
    ]
    if mode == "stream":
        item = ["response.output_item.added"]
        text = ["response.content_part.added", "response.output_text.delta", "response.output_text.done"]
        text += ["response.content_part.done", "response.output_item.done"]
        call = ["response.function_call_arguments.delta", "response.function_call_arguments.done"]
        call += ["response.output_item.done"]
        head = ["response.created", "response.in_progress"]
        assert seen[0] == head + item + text + (item + call) * 2 + ["response.completed"]
        assert seen[1] == head + item + text + ["response.completed"]


def test_responses_fields_are_refused_by_name_or_ignored_and_a_cut_turn_is_incomplete(tok, tmp_path):
    """Each refused Responses field is a 400 naming it as the Responses API does; what a library sends by default
    (reasoning, text verbosity, store, truncation) is served; max_output_tokens caps the turn, and a turn it cuts is
    `incomplete` (max_output_tokens), whole or streamed. An unknown route names the routes there are."""
    errors = {}
    got = {}

    def agent(row, base_url):
        kw = dict(model="policy", input=row["prompt"])
        asks = {
            "previous_response_id": dict(previous_response_id="resp_1"),
            "conversation": dict(conversation="conv_1"),
            "tools": dict(tools=[{"type": "web_search"}]),
            "input": dict(input=[{"type": "item_reference", "id": "msg_1"}]),
            "tool_choice": dict(tool_choice="required"),
            "text": dict(text={"format": {"type": "json_object"}}),
            "model": dict(model="gpt-5.6-luna"),
            "top_logprobs": dict(top_logprobs=5),
            "include": dict(include=["message.output_text.logprobs"]),
        }
        for name, ask in asks.items():
            try:
                client(base_url).responses.create(**{**kw, **ask})
            except openai.BadRequestError as e:
                errors[name] = (e.status_code, e.param, e.message)
        try:
            client(base_url).embeddings.create(model="policy", input="x")
        except openai.NotFoundError as e:
            got["unknown route"] = e.message
        defaults = dict(reasoning={"effort": "none"}, text={"verbosity": "low"}, store=False, truncation="auto")
        ask = dict(**kw, **defaults, max_output_tokens=5, temperature=0.3)
        if row["key"] == "stream":
            events = list(client(base_url).responses.create(**ask, stream=True))
            got["stream"] = (events[-1].type, events[-1].response)
            return events[-1].response.status
        r = client(base_url).responses.create(**ask)
        got["whole"] = (r.status, r)
        return r.status

    budgets = []

    class Budgets(ByPrompt):
        def generate(self, prompts, max_tokens, *a, **k):
            budgets.extend(max_tokens)
            return super().generate(prompts, max_tokens, *a, **k)

    env = agent_env(tok, tmp_path, agent, "temperature=1.0")
    sampler = Budgets(tok, lambda text: "<reasoning>long", finish="length")
    eps = env.rollout([{"prompt": "q", "key": "whole"}, {"prompt": "q", "key": "stream"}], sampler)
    assert sorted(errors) == sorted(
        ["previous_response_id", "conversation", "tools", "input", "tool_choice", "text", "model", "top_logprobs"]
        + ["include"]
    )
    for name, (status, param, message) in errors.items():
        assert status == 400 and param == name, message
    assert "/v1/embeddings" in got["unknown route"] and "POST responses, GET models" in got["unknown route"]
    assert budgets == [5, 5], "max_output_tokens caps the turn; refused requests sample nothing"
    assert [ep.end_reason for ep in eps] == ["truncated", "truncated"]
    assert got["stream"][0] == "response.incomplete"
    for response in (got["whole"][1], got["stream"][1]):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output_text == "<reasoning>long" and response.output[0].status == "incomplete"
    assert env.stats() == {"agent/overridden_temperature": 2}


def test_a_harness_that_edits_its_history_forks_and_every_sample_holds_what_was_sampled(tok, tmp_path):
    from tasks.toy_kv_agent import run_tool

    def agent(row, base_url):
        messages = [{"role": "system", "content": "turn 0"}, {"role": "user", "content": row["prompt"]}]
        for turn in range(1, 4):
            text = (
                client(base_url).chat.completions.create(model="policy", messages=messages).choices[0].message.content
            )
            messages.append({"role": "assistant", "content": text})
            if "<tool>" not in text:
                return text
            messages.append({"role": "tool", "content": run_tool(text.split("<tool>")[1].split("</tool>")[0])})
            messages[0] = {"role": "system", "content": f"turn {turn}"}  # a new system prompt every turn

    env = agent_env(tok, tmp_path, agent)
    env.chat.bridge_checks = M.BRIDGE_CHECKS  # past the bridge's first checks, as later in a run
    sampler = ByPrompt(tok, toy_reply, end=tok.convert_tokens_to_ids("<|im_end|>"))
    [ep] = env.rollout(rows(["golf"]), sampler)
    assert ep.end_reason == "answer" and len(ep.turns) == 2
    assert ep.forks == 1 and len(ep.samples) == 2, "the edited history forks"
    assert ep.tokenization_mismatches == 0
    assert trained_turns(ep) == sampler.turns
    assert tok.decode(ep.samples[1].input_ids).startswith("<|im_start|>system\nturn 1")
    assert env.stats()["agent/history_edits"] == 1
    metrics = M.rollout_metrics([ep])
    assert (metrics["rollout/forks_harness_edit"], metrics["rollout/forks_template"]) == (1, 0), "the harness's doing"


@pytest.mark.parametrize("retention", ["template", "tool_cycle"])
def test_a_tool_call_the_template_re_renders_in_other_spacing_forks_as_the_templates_doing(qwen3, tmp_path, retention):
    """The policy writes compact JSON; Qwen3's template renders the call back with its own spacing. The harness sends
    the reply back unchanged, so the fork is the template's, not an edit; `tool_cycle` keeps the sampled text in the
    tool cycle, verbatim, and the sample extends."""
    compact = json.dumps({"name": "lookup", "arguments": {"key": "golf"}}, separators=(",", ":"))

    def reply(text):
        return f"<tool_call>\n{compact}\n</tool_call>" if "<tool_response>" not in text else "<answer>1</answer>"

    def agent(row, base_url):
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            message = client(base_url).chat.completions.create(model="policy", messages=messages, tools=[LOOKUP])
            message = message.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # sent back as it came
            if not message.tool_calls:
                return message.content
            messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "1"})

    env = agent_env(qwen3, tmp_path, agent, "tool_format=native", f"thinking_retention={retention}")
    sampler = ByPrompt(qwen3, reply, end=qwen3.convert_tokens_to_ids("<|im_end|>"))
    [ep] = env.rollout(rows(["golf"]), sampler)
    assert ep.end_reason == "answer" and ep.tool_calls == 1 and ep.tokenization_mismatches == 0
    assert "agent/history_edits" not in env.stats()
    assert trained_turns(ep) == sampler.turns
    metrics = M.rollout_metrics([ep])
    forks = {"template": 1, "tool_cycle": 0}[retention]
    assert (metrics["rollout/forks_harness_edit"], metrics["rollout/forks_template"]) == (0, forks)
    assert ep.forks == forks and len(ep.samples) == 1 + forks


def test_request_fields_the_trainer_refuses_name_the_field_and_the_ones_it_overrides_are_counted(tok, tmp_path):
    errors = {}

    def agent(row, base_url):
        messages = [{"role": "user", "content": row["prompt"]}]
        asks = {
            "n": dict(n=2),
            "logprobs": dict(logprobs=True),
            "model": dict(model="gpt-4o"),
            "stop": dict(stop=["x"]),
            "tool_choice": dict(tool_choice="required"),
            "tools": dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
            "messages": dict(messages=[{"role": "critic", "content": "."}]),
        }
        for name, kw in asks.items():
            try:
                client(base_url).chat.completions.create(**{"model": "policy", "messages": messages, **kw})
            except openai.BadRequestError as e:
                errors[name] = (e.status_code, e.param, e.message)
        r = client(base_url).chat.completions.create(model="policy", messages=messages, temperature=0.3, top_p=0.5)
        return r.choices[0].message.content

    env = agent_env(tok, tmp_path, agent, "temperature=1.0")
    sampler = ByPrompt(tok, lambda text: "<answer>x</answer>")
    [ep] = env.rollout(rows(["golf"]), sampler)
    assert sorted(errors) == ["logprobs", "messages", "model", "n", "stop", "tool_choice", "tools"]
    for name, (status, param, message) in errors.items():
        assert status == 400 and param == name, message
    assert "'policy'" in errors["model"][2] and "tool_format" in errors["tools"][2]
    assert ep.end_reason == "answer" and len(ep.turns) == 1, "refused requests sample nothing"
    assert sampler.temperatures == [1.0], "the trainer's temperature, not the request's"
    assert env.stats() == {"agent/overridden_temperature": 1, "agent/overridden_top_p": 1}


def test_faults_are_counted_outcomes_left_out_of_training_and_kept_in_an_eval(tok, tmp_path):
    """A harness that raises (agent_error), one that never returns (agent_timeout; its later requests find nothing
    listening), one that returns without a request, a request after the trainer ended its episode (410) and one to
    an episode that does not exist (404)."""
    release = threading.Event()
    late = {}

    def agent(row, base_url):
        kind = row["key"]
        if kind == "raises":
            client(base_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "raise"}])
            raise RuntimeError("the harness's own bug")
        if kind == "hangs":
            release.wait(30)
            try:
                client(base_url).models.list()
            except openai.APIConnectionError:
                late["hangs"] = "refused"
            return "late"
        if kind == "silent":
            return "nothing asked"
        if kind == "cut, then fails on the 410":
            messages = [{"role": "user", "content": row["prompt"]}]
            client(base_url).chat.completions.create(model="policy", messages=messages)
            client(base_url).chat.completions.create(model="policy", messages=messages + messages)  # raises: 410
        messages = [{"role": "user", "content": row["prompt"]}]
        r = client(base_url).chat.completions.create(model="policy", messages=messages)  # cut: truncated
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        try:
            client(base_url).chat.completions.create(model="policy", messages=messages)
        except openai.APIStatusError as e:
            late["after_end"] = e.status_code
        try:
            client(base_url.replace("/episodes/", "/episodes/x")).chat.completions.create(
                model="policy", messages=messages
            )
        except openai.NotFoundError as e:
            late["unknown"] = e.status_code
        return r.choices[0].finish_reason

    env = agent_env(tok, tmp_path, agent, "agent_timeout=3")
    sampler = ByPrompt(tok, lambda text: "<reasoning>long", finish=lambda text: "stop" if "raise" in text else "length")
    batch = [{"prompt": "q", "key": k} for k in ("raises", "hangs", "silent", "cut", "cut, then fails on the 410")]
    try:
        eps = env.rollout(batch, sampler)
        assert [ep.row["key"] for ep in eps] == ["cut", "cut, then fails on the 410"], "faults are left out"
        assert [ep.end_reason for ep in eps] == ["truncated", "truncated"], "the trainer's end, not the harness's error"
        assert eps[0].row["agent_result"] == "length" and "410" in eps[1].row["agent_result"]
        assert late == {"after_end": 410, "unknown": 404}
        assert env.stats() == {"agent/agent_errors": 2, "agent/agent_timeouts": 1}
        evaluated = env.rollout(batch, sampler, eval_temperature=0.0)
        ends = [ep.end_reason for ep in evaluated]
        assert ends == ["agent_error", "agent_timeout", "agent_error", "truncated", "truncated"]
        assert "the harness's own bug" in evaluated[0].row["agent_result"]
        assert "without sending a request" in evaluated[2].row["agent_result"]
    finally:
        release.set()
    M_until = __import__("conftest").until
    M_until(lambda: late.get("hangs") == "refused", "the abandoned harness's late request to be refused")


def test_a_harness_that_calls_from_several_threads_gets_one_turn_at_a_time(tok, tmp_path):
    def agent(row, base_url):
        messages = [{"role": "user", "content": row["prompt"]}]
        replies = []
        ask = lambda: replies.append(client(base_url).chat.completions.create(model="policy", messages=messages))  # noqa: E731
        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(replies)

    class Slow(ByPrompt):
        def generate(self, *a, **k):
            time.sleep(1.0)  # the other thread's request arrives while this turn holds the episode
            return super().generate(*a, **k)

    env = agent_env(tok, tmp_path, agent)
    sampler = Slow(tok, lambda text: "<answer>x</answer>")
    [ep] = env.rollout(rows(["golf"]), sampler)
    assert ep.row["agent_result"] == 2 and len(ep.turns) == 2
    assert ep.forks == 1, "the second request's history lacks the first's reply: it forks"
    assert trained_turns(ep) == sampler.turns
    assert env.stats().get("agent/concurrent_requests", 0) == 1


def test_a_request_whose_fields_are_of_other_types_is_a_400_and_the_run_goes_on(qwen3, tmp_path):
    """Fields of another type than served, and messages the chat template refuses, are the harness's errors: each a
    400 (naming the field where one is named), nothing sampled, and the episode and the run go on."""
    errors = {}
    user = [{"role": "user", "content": "What is the value of golf?"}]
    asks = {
        "max_tokens": dict(messages=user, max_tokens="abc"),
        "stream_options": dict(messages=user, stream=True, stream_options="yes"),
        "text part": dict(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "tool_calls": dict(messages=[*user, {"role": "assistant", "content": "", "tool_calls": "x"}]),
        "template": dict(messages=[*user, *user]),  # Gemma's template: roles must alternate
    }

    def agent(row, base_url):
        for name, ask in asks.items():
            try:
                client(base_url).chat.completions.create(model="policy", **ask)
            except openai.BadRequestError as e:
                errors[name] = (e.param, e.message)
        for name, ask in {"max_output_tokens": dict(max_output_tokens="abc"), "text": dict(text="x")}.items():
            try:
                client(base_url).responses.create(model="policy", input="What is the value of golf?", **ask)
            except openai.BadRequestError as e:
                errors[name] = (e.param, e.message)
        r = client(base_url).chat.completions.create(model="policy", messages=user)
        return r.choices[0].message.content

    gemma = copy.deepcopy(qwen3)
    with open(fixtures.path("gemma_chat_template.jinja")) as f:
        gemma.chat_template = f.read()
    env = agent_env(gemma, tmp_path, agent)
    sampler = ByPrompt(gemma, lambda text: "<answer>7</answer>")
    [ep] = env.rollout(rows(["golf"]), sampler)
    assert sorted(errors) == sorted([*asks, "max_output_tokens", "text"])
    assert errors["max_tokens"][0] == "max_tokens" and "'abc'" in errors["max_tokens"][1]
    assert errors["max_output_tokens"][0] == "max_output_tokens"
    assert errors["template"][0] == "messages" and "must alternate" in errors["template"][1]
    assert errors["tool_calls"][0] == "messages" and "a tool call must be" in errors["tool_calls"][1]
    for name in ("stream_options", "text part", "text"):
        assert "another type than served" in errors[name][1], errors[name]
    assert ep.end_reason == "answer" and len(ep.turns) == 1, "the refused requests sampled nothing, the last one did"
    assert env.stats() == {}, "a refused request left the episode as it was: the next one is no edit of its history"
    assert len(ep.samples) == 1 and ep.messages[0] == {"role": "user", "content": "What is the value of golf?"}
    assert ep.row["agent_result"] == "<answer>7</answer>"


def test_a_sampler_failure_stops_the_run_and_a_full_context_ends_the_episode(tok, tmp_path):
    class Down(ByPrompt):
        def generate(self, *a, **k):
            raise M.ServerDown("the server went away")

    env = agent_env(tok, tmp_path, lambda row, url: M_call(url))
    with pytest.raises(M.ServerDown, match="went away"):
        env.rollout(rows(["golf"]), Down(tok, str))
    statuses = []

    def agent(row, base_url):
        try:
            M_call(base_url)
        except openai.BadRequestError as e:
            statuses.append(str(e))
        return "done"

    env = agent_env(tok, tmp_path, agent, "max_seq_len=8")
    [ep] = env.rollout(rows(["golf"]), ByPrompt(tok, str))
    assert ep.end_reason == "context" and not ep.turns and not ep.samples
    assert "max_seq_len=8" in statuses[0]


def M_call(base_url):
    return client(base_url).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is the value of golf?"}]
    )


def test_a_recipe_with_an_agent_is_checked_at_load(tmp_path):
    cfg = recipe_cfg(tmp_path, f"agent={TOY_AGENT}")
    with pytest.raises(M.ConfigError, match=r"runs its own tools: set tools: \[\]"):
        M.check_agent(cfg, lambda row, url: None)

    async def agent(row, url):
        pass

    cfg = recipe_cfg(tmp_path, f"agent={TOY_AGENT}", "tools=[]")
    with pytest.raises(M.ConfigError, match="async def"):
        M.check_agent(cfg, agent)
    command = ["tools=[]", "agent_command=python tests/cmd_agent.py"]
    with pytest.raises(M.ConfigError, match="agent and agent_command are both set"):
        M.check_agent(recipe_cfg(tmp_path, f"agent={TOY_AGENT}", *command), None)
    with pytest.raises(M.ConfigError, match="unset agent_processes"):
        M.check_agent(recipe_cfg(tmp_path, *command, "agent_processes=2"), None)
    with pytest.raises(M.ConfigError, match="'no-such-agent' is not a program found on PATH"):
        M.check_agent(recipe_cfg(tmp_path, "tools=[]", "agent_command=no-such-agent --flag"), None)
    M.check_agent(recipe_cfg(tmp_path, "tools=[]", f"agent_command={CMD_AGENT}"), None)


def test_the_harness_recipe_trains_through_the_endpoint(tmp_path, tiny_model_dir):
    """Two steps of the toy recipe as a harness on a random model, in-process: the run's loop, rewards and logs."""
    recipe = os.path.join(M.HERE, "hf_recipes/toy/toy-kv-agent--mt-grpo.yaml")
    cfg = M.load_config(
        recipe,
        [
            f"model_name_or_path={tiny_model_dir}",
            f"output_dir={tmp_path}/run",
            "max_steps=2",
            "eval_steps=0",
            "prompts_per_step=2",
            "num_generations=2",
            "max_tokens=16",
        ],
    )
    history = M.train(cfg)
    assert [m["step"] for m in history] == [1, 2]
    assert all(m["rollout/turns"] >= 1 for m in history)
    with open(f"{tmp_path}/run/episodes.jsonl") as f:
        episodes = [json.loads(line) for line in f]
    assert episodes and all(e["messages"][0]["role"] == "user" for e in episodes)


@pytest.mark.parametrize(
    "branching", [[], ["branch_width=2", "branch_depth=2", "num_generations=8", "advantage_mode=tree"]]
)
def test_the_toy_as_a_harness_makes_the_built_in_environments_episodes(tok, tmp_path, branching):
    """The same sampler, the same rows: the harness's episodes are the built-in environment's, token for token, with
    the same branches (a branch reruns the harness, answered from the record up to its branch point)."""
    from tasks.toy_kv_agent import agent

    def reply(text):  # two lookups, the first of a wrong key, then the answer
        results = text.count("<result>")
        key = text.split('"')[1]
        if results < 2:
            wrong = "nokey" if results == 0 else key
            return f"<tool>{json.dumps({'name': 'lookup', 'args': {'key': wrong}})}</tool>"
        return f"<answer>{text.rsplit('<result>', 1)[1].split('</result>')[0].strip()}</answer>"

    end = tok.convert_tokens_to_ids("<|im_end|>")
    batch = [r for r in rows(["golf", "kilo"]) for _ in range(2)]
    built_in = make_builtin_env(tok, tmp_path, *branching).rollout(batch, ByPrompt(tok, reply, end=end))
    env = agent_env(tok, tmp_path, agent, *branching)
    harness = env.rollout(batch, ByPrompt(tok, reply, end=end))
    assert len(harness) == len(built_in) == (16 if branching else 4)
    for a, b in zip(harness, built_in):
        assert (a.node, a.turn_nodes, a.end_reason, a.tool_calls, a.forks) == (
            b.node,
            b.turn_nodes,
            b.end_reason,
            b.tool_calls,
            b.forks,
        )
        assert [(s.input_ids, s.loss_mask, s.sampler_logprobs, s.turn_idx) for s in a.samples] == [
            (s.input_ids, s.loss_mask, s.sampler_logprobs, s.turn_idx) for s in b.samples
        ]
        assert a.completion == b.completion
    assert "agent/replays_dropped" not in env.stats()


def make_builtin_env(tok, tmp_path, *overrides):
    cfg = recipe_cfg(tmp_path, *overrides)
    return M.MultiTurnToolEnv(tok, [M.load_object(s) for s in cfg.tools], cfg)


def test_a_branch_whose_replayed_requests_differ_is_dropped_and_counted(tok, tmp_path):
    """A tool that is not deterministic: a branch's rerun of the harness gets another result, so its first request of
    its own differs from the one it branched at, and the branch is dropped."""
    draws = iter(range(1000))

    def agent(row, base_url):
        messages = [{"role": "user", "content": row["prompt"]}]
        while True:
            text = (
                client(base_url).chat.completions.create(model="policy", messages=messages).choices[0].message.content
            )
            messages.append({"role": "assistant", "content": text})
            if "<tool>" not in text:
                return text
            messages.append({"role": "tool", "content": f"draw {next(draws)}"})

    branching = ["branch_width=2", "branch_depth=1", "num_generations=4", "advantage_mode=tree"]
    env = agent_env(tok, tmp_path, agent, *branching)
    sampler = ByPrompt(tok, lambda text: "<answer>x</answer>" if "draw" in text else toy_reply(text))
    eps = env.rollout(rows(["golf", "kilo"]), sampler)
    assert [ep.node for ep in eps] == [(0, 0), (1, 0)], "each root's branch was dropped"
    assert env.stats()["agent/replays_dropped"] == 2


def test_a_harness_that_keeps_its_client_open_leaves_no_thread_behind_and_its_own_timeout_is_its_error(tok, tmp_path):
    """Clients kept alive (never closed, never collected) hold a connection each: the endpoint closes them with the
    rollout, so their handler threads end. A TimeoutError the harness raises itself is its error, not agent_timeout."""
    kept = []

    def agent(row, base_url):
        kept.append(client(base_url))
        kept[-1].chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        if row["key"] == "kilo":
            raise TimeoutError("the harness's own deadline")
        return "done"

    env = agent_env(tok, tmp_path, agent)
    before = threading.active_count()
    for _ in range(3):
        eps = env.rollout(rows(["golf"] * 7 + ["kilo"]), ByPrompt(tok, lambda text: "<answer>x</answer>"))
        assert len(eps) == 7 and env.stats() == {"agent/agent_errors": 1}
    M_until = __import__("conftest").until
    M_until(lambda: threading.active_count() <= before + 2, "the endpoint's handler threads to end")
    evaluated = env.rollout(rows(["kilo"]), ByPrompt(tok, lambda text: "<answer>x</answer>"), eval_temperature=0.0)
    assert evaluated[0].end_reason == "agent_error"
    assert evaluated[0].row["agent_result"] == "TimeoutError: the harness's own deadline"


class RightInEveryOtherEpisode(ByPrompt):
    """A group's episodes have consecutive sessions: one of each two answers wrong after its tool result (`result`
    in the prompt), so a group's rewards differ and its advantages are not zero."""

    def __init__(self, tok, reply, result: str, end: int):
        super().__init__(tok, reply, end)
        self.right = reply
        self.result = result

    def generate(self, prompts, max_tokens, temperature, top_p, stop, generator=None, sessions=None):
        outs = []
        for prompt, session in zip(prompts, sessions):
            self.reply = self.right
            if session % 2:
                self.reply = lambda text: "<answer>wrong</answer>" if self.result in text else self.right(text)
            outs += super().generate([prompt], max_tokens, temperature, top_p, stop, generator, [session])
        return outs


def kv_native_reply(text):
    """The toy's protocol in native calls: look the key the question names up, then answer with the result."""
    if "<tool_response>" not in text:
        key = re.search(r'"(\w+)"', text.rsplit("<|im_start|>user", 1)[1]).group(1)  # the question's key
        return f"<tool_call>\n{json.dumps({'name': 'lookup', 'arguments': {'key': key}})}\n</tool_call>"
    value = text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
    return f"<answer>{value}</answer>"


def test_the_openai_agents_sdk_on_its_defaults_runs_episodes_through_the_responses_api(qwen3, tmp_path):
    """The OpenAI Agents SDK's own loop, function tool and Responses API model: each of its requests is one turn, each
    reply comes back as the turn it was (one sample, no fork), and the trained tokens are the sampled ones (I1)."""
    from tasks.toy_kv_agents_sdk import agent

    env = agent_env(qwen3, tmp_path, agent, "tool_format=native", "system_prompt=")
    sampler = ByPrompt(qwen3, kv_native_reply, end=qwen3.convert_tokens_to_ids("<|im_end|>"))
    keys = ["golf", "kilo"]
    eps = env.rollout(rows(keys), sampler)
    for ep, k in zip(eps, keys):
        assert ep.row["agent_result"] == f"<answer>{TABLE[k]}</answer>", ep.row["agent_result"]
        assert ep.end_reason == "answer" and ep.tool_calls == 1 and len(ep.turns) == 2
        assert ep.forks == 0 and len(ep.samples) == 1 and ep.tokenization_mismatches == 0
        assert trained_turns(ep) == [t for t in sampler.turns if t in trained_turns(ep)] and len(trained_turns(ep)) == 2
        assert ep.messages[0]["role"] == "system" and ep.messages[0]["content"].startswith("Look the key up")
    assert "agent/history_edits" not in env.stats()


def test_the_openai_agents_sdk_streamed_run_makes_the_same_episodes(qwen3, tmp_path):
    """`Runner.run_streamed`: the SDK's Responses API model with `stream: true`. Its events are the endpoint's
    (the Responses API's stream, parsed by the SDK into its run items), and the episodes are the unstreamed run's,
    token for token."""
    import asyncio

    from agents import RunConfig, Runner
    from agents.models.openai_provider import OpenAIProvider

    from tasks.toy_kv_agents_sdk import AGENT
    from tasks.toy_kv_agents_sdk import agent as unstreamed

    events = {}

    async def run(row, base_url):
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            provider = OpenAIProvider(openai_client=client)
            config = RunConfig(model="policy", model_provider=provider, tracing_disabled=True)
            result = Runner.run_streamed(AGENT, row["prompt"], run_config=config)
            async for event in result.stream_events():
                kind = getattr(event, "data", None) or getattr(event, "item", None) or event
                events.setdefault(row["key"], []).append(getattr(kind, "type", event.type))
        return result.final_output

    keys = ["golf", "kilo"]
    episodes = {}
    for name, agent in (("streamed", lambda row, url: asyncio.run(run(row, url))), ("whole", unstreamed)):
        env = agent_env(qwen3, tmp_path, agent, "tool_format=native", "system_prompt=")
        sampler = ByPrompt(qwen3, kv_native_reply, end=qwen3.convert_tokens_to_ids("<|im_end|>"))
        episodes[name] = env.rollout(rows(keys), sampler)
        assert "agent/history_edits" not in env.stats()
    for ep, k in zip(episodes["streamed"], keys):
        assert ep.row["agent_result"] == f"<answer>{TABLE[k]}</answer>", ep.row["agent_result"]
        assert ep.end_reason == "answer" and ep.tool_calls == 1 and len(ep.turns) == 2 and ep.forks == 0
        stream = events[k]
        for kind in ("response.function_call_arguments.delta", "tool_call_item", "tool_call_output_item"):
            assert kind in stream, (kind, stream)
        assert stream.count("response.completed") == 2 and "response.output_text.delta" in stream
    for streamed, whole in zip(episodes["streamed"], episodes["whole"]):
        assert [s.input_ids for s in streamed.samples] == [s.input_ids for s in whole.samples]
        assert [s.loss_mask for s in streamed.samples] == [s.loss_mask for s in whole.samples]


def test_the_openai_agents_sdk_trains_two_steps(tmp_path, tiny_model_dir, monkeypatch):
    """Two steps of the toy task run by the Agents SDK, in-process: a random model with the Qwen3 chat template (native
    tools), a scripted sampler that answers right in one episode of each group (so its advantages are not zero)."""
    from test_templates import FIX

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    shutil.copy(os.path.join(FIX, "qwen3_chat_template.jinja"), model_dir / "chat_template.jinja")

    def sampler(model, tok):
        return RightInEveryOtherEpisode(
            tok, kv_native_reply, "<tool_response>", tok.convert_tokens_to_ids("<|im_end|>")
        )

    monkeypatch.setattr(M, "LocalSampler", sampler)
    recipe = os.path.join(M.HERE, "hf_recipes/toy/toy-kv-agent--mt-grpo.yaml")
    overrides = ["agent=tasks/toy_kv_agents_sdk.py:agent", "tool_format=native", "system_prompt=", "model_builder="]
    overrides += [f"model_name_or_path={model_dir}", f"output_dir={tmp_path}/run", "max_steps=2", "eval_steps=0"]
    overrides += ["prompts_per_step=2", "num_generations=2", "max_tokens=128", "max_seq_len=2048"]
    overrides += ["log_episodes_steps=1"]
    history = M.train(M.load_config(recipe, overrides))
    assert [m["step"] for m in history] == [1, 2]
    for m in history:
        assert m["rollout/tool_calls"] == 1 and m["reward/outcome"] == 0.5 and m["loss/grad_norm"] > 0, m
    with open(f"{tmp_path}/run/episodes.jsonl") as f:
        episodes = [json.loads(line) for line in f]
    assert len(episodes) == 8 and {e["end_reason"] for e in episodes} == {"answer"}
    assert all(e["messages"][-1]["content"].startswith("<answer>") for e in episodes)


CMD_AGENT = f"{sys.executable} tests/cmd_agent.py"


def alive(pid: int) -> bool:
    """Running: a process that exists and is not a zombie (one killed is reaped by whoever adopted it, or not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture()
def pidfiles(tmp_path):
    """Where the harnesses write the pids of what they start; whatever of it still runs after the test is ended."""
    yield lambda key: str(tmp_path / f"{key}.pids")
    for path in tmp_path.glob("*.pids"):
        for pid in map(int, path.read_text().split()):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def started(path: str) -> list[int]:
    M_until = __import__("conftest").until
    M_until(lambda: os.path.exists(path) and len(open(path).read().split()) == 2, f"the harness to write {path}")
    return [int(pid) for pid in open(path).read().split()]


def test_a_command_harness_hangs_fails_and_leaves_processes_as_counted_outcomes_and_ends_with_its_group(
    tok, tmp_path, pidfiles
):
    """agent_command: a process per episode, the plain openai client on OPENAI_BASE_URL. A hang (agent_timeout) and a
    non-zero exit are counted faults; what a hung or a finished harness left running ends with its process group."""
    env = agent_env(tok, tmp_path, None, "agent=", f"agent_command={CMD_AGENT}", "agent_timeout=20")
    sampler = ByPrompt(tok, toy_reply, end=tok.convert_tokens_to_ids("<|im_end|>"))
    keys = ["golf", "kilo", "alpha", "mike"]  # each row a key of its own, and a fault by its tag
    batch = [{**row, "key": tag, "pidfile": pidfiles(tag)} for row, tag in zip(rows(keys), ROW_KEYS)]
    eps = env.rollout(batch, sampler)
    assert [ep.row["key"] for ep in eps] == ["golf", "leaves"], "the faults are left out"
    assert [ep.end_reason for ep in eps] == ["answer", "answer"] and [len(ep.turns) for ep in eps] == [2, 2]
    for ep, k in zip(eps, ["golf", "mike"]):
        assert ep.row["agent_result"] == f"<reasoning>found</reasoning>\n<answer>{TABLE[k]}</answer>"
        assert trained_turns(ep) == [t for t in sampler.turns if t in trained_turns(ep)] and len(trained_turns(ep)) == 2
    assert env.stats() == {"agent/agent_errors": 1, "agent/agent_timeouts": 1}
    for key in ("hangs", "leaves"):  # the harness and the process it started
        for pid in started(pidfiles(key)):
            __import__("conftest").until(lambda: not alive(pid), f"{key}'s process {pid} to be ended")
    evaluated = env.rollout(batch[2:3], sampler, eval_temperature=0.0)
    assert evaluated[0].end_reason == "agent_error"
    assert evaluated[0].row["agent_result"] == (
        f"agent_command `{CMD_AGENT}` exited with status 3: the command's own failure"
    )


ROW_KEYS = ["golf", "hangs", "fails", "leaves"]


def test_harness_functions_in_worker_processes_answer_as_in_threads_and_a_hung_one_ends_its_worker(
    tok, tmp_path, pidfiles
):
    """agent_processes: the harness runs in worker processes, not the trainer's; its result travels back as JSON,
    its error as its own; a hung harness's worker ends with its group after the rollout, and a new one serves the next."""
    spec = "tests/cmd_agent.py:agent"
    env = agent_env(tok, tmp_path, None, f"agent={spec}", "agent_processes=2", "agent_timeout=20")
    sampler = ByPrompt(tok, toy_reply, end=tok.convert_tokens_to_ids("<|im_end|>"))
    try:
        batch = [{**row, "say_pid": True} for row in rows(["golf", "kilo"])]
        batch += [{"prompt": "q", "key": "raises"}, {"prompt": "q", "key": "hangs", "pidfile": pidfiles("hangs")}]
        eps = env.rollout(batch, sampler)
        workers = {w.proc.pid for w in env.workers.workers}
        assert len(workers) == 2 and os.getpid() not in workers
        assert [ep.row["key"] for ep in eps] == ["golf", "kilo"] and [ep.end_reason for ep in eps] == ["answer"] * 2
        for ep in eps:
            assert (
                ep.row["agent_result"]["answer"]
                == f"<reasoning>found</reasoning>\n<answer>{TABLE[ep.row['key']]}</answer>"
            )
            assert ep.row["agent_result"]["pid"] in workers
        assert env.stats() == {"agent/agent_errors": 1, "agent/agent_timeouts": 1}
        evaluated = env.rollout(batch[2:3], sampler, eval_temperature=0.0)
        assert evaluated[0].row["agent_result"] == "ValueError: the harness's own bug"
        hung_worker, child = started(pidfiles("hangs"))
        assert hung_worker in workers
        for pid in (hung_worker, child):
            __import__("conftest").until(lambda: not alive(pid), f"the hung harness's process {pid} to be ended")
        [ep] = env.rollout(rows(["mike"]), sampler)
        assert ep.end_reason == "answer" and len(env.workers.workers) == 2, "a new worker beside the one left"
        assert hung_worker not in {w.proc.pid for w in env.workers.workers}
    finally:
        env.close()
    for w in env.workers.workers:
        __import__("conftest").until(lambda: not alive(w.proc.pid), "the workers to end with the environment")


def test_a_worker_process_runs_the_code_the_trainer_imported_though_its_file_changed_since(monkeypatch):
    """A run whose trainer file is edited under it (this file is made to be hacked on) starts its harness workers
    with the worker code it imported, not with lines of the new file at the old line numbers."""
    import linecache

    with open(M.__file__) as f:
        edited = ["# a line added above\n"] * 5 + f.readlines()
    monkeypatch.setitem(linecache.cache, M.__file__, (0, None, edited, M.__file__))  # mtime None: kept as it is
    workers = M.HarnessWorkers("tests/cmd_agent.py:agent", 1)
    assert workers.argv[2].startswith("def agent_worker(spec: str):")
    assert workers.argv[2].rstrip().endswith(f"agent_worker({os.path.abspath('tests/cmd_agent.py') + ':agent'!r})")


def test_a_rollout_whose_every_agent_episode_failed_stops_the_run_in_one_line(tok, tmp_path):
    def agent(row, base_url):
        raise RuntimeError("the harness's own bug")

    env = agent_env(tok, tmp_path, agent)
    with pytest.raises(
        M.HarnessFailed, match=r"all 2 agent episodes .* \(agent_error\): RuntimeError: the harness's own"
    ):
        env.rollout(rows(["golf", "kilo"]), ByPrompt(tok, toy_reply))
    evaluated = env.rollout(rows(["golf", "kilo"]), ByPrompt(tok, toy_reply), eval_temperature=0.0)
    assert [ep.end_reason for ep in evaluated] == ["agent_error", "agent_error"], "an eval keeps them"


def test_a_command_harness_trains_a_step(tmp_path, tiny_model_dir, monkeypatch):
    """The toy recipe with agent_command (tests/cmd_agent.py, the plain openai client on OPENAI_BASE_URL) in place of
    the function: a step in-process, against a scripted sampler that answers right in one episode of each two."""

    def sampler(model, tok):
        return RightInEveryOtherEpisode(tok, toy_reply, "<result>", tok.convert_tokens_to_ids("<|im_end|>"))

    monkeypatch.setattr(M, "LocalSampler", sampler)
    recipe = os.path.join(M.HERE, "hf_recipes/toy/toy-kv-agent--mt-grpo.yaml")
    overrides = ["agent=", f"agent_command={CMD_AGENT}", f"model_name_or_path={tiny_model_dir}", "model_builder="]
    overrides += [f"output_dir={tmp_path}/run", "max_steps=1", "eval_steps=0", "prompts_per_step=2"]
    overrides += ["num_generations=2", "log_episodes_steps=1"]
    [m] = M.train(M.load_config(recipe, overrides))
    assert m["rollout/tool_calls"] == 1 and m["reward/outcome"] == 0.5 and m["loss/grad_norm"] > 0, m
    assert "agent/agent_errors" not in m
    with open(f"{tmp_path}/run/episodes.jsonl") as f:
        episodes = [json.loads(line) for line in f]
    assert len(episodes) == 4 and {e["end_reason"] for e in episodes} == {"answer"}
    assert {e["messages"][-1]["content"].split("<answer>")[1] for e in episodes} > {"wrong</answer>"}
