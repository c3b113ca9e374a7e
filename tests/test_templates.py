"""Token faithfulness across real chat templates (built from pinned PyPI packages by tasks/fixtures.py): extension,
forks, thinking retention, native tool calls, adversarial sampled ids, and the tokenization check."""

import json
import os

import pytest

import check_template as CT
import mt_grpo_trainer as M
from conftest import ROOT
from tasks import fixtures
from test_env import ScriptedSampler, char_ids

FIX = fixtures.ensure()
TEMPLATES = ["qwen3", "qwen2_5", "llama3_1", "smollm2"]


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(FIX, "qwen3_tokenizer"))
    tok.chat_template = open(os.path.join(FIX, "qwen3_chat_template.jinja")).read()
    return tok


def with_template(tok, name):
    t = tok.__class__.from_pretrained(os.path.join(FIX, "qwen3_tokenizer"))
    t.chat_template = open(os.path.join(FIX, f"{name}_chat_template.jinja")).read()
    return t


def kinds(setting):
    return [(b["kind"], b["extends"]) for b in setting["boundaries"]]


def test_qwen3_template_forks_exactly_where_the_template_drops_thinking(qwen3):
    r = CT.check_template(qwen3, "template", "native")
    assert r["violations"] == []
    th, plain = r["settings"]["thinking"], r["settings"]["no_thinking"]
    # Thinking: past <think> blocks survive the tool cycle and are dropped at the new user query.
    assert kinds(th) == [("tool", True), ("tool", True), ("user", False), ("tool", True)]
    assert th["samples_per_episode"] == 2
    # enable_thinking=false: the generation prompt forces an empty <think></think> that the template
    # never shows in history, so every boundary rewrites the previous turn.
    assert kinds(plain) == [("tool", False), ("tool", False), ("user", False), ("tool", False)]


def test_qwen3_drops_thinking_at_the_user_query_and_the_new_sample_is_what_the_sampler_saw(qwen3):
    cfg = M.Config(system_prompt="", tool_format="native", max_env_steps=10)
    env = M.MultiTurnToolEnv(qwen3, [CT._sim_search], cfg)
    call = '<think>\nsecret plan\n</think>\n\n<tool_call>\n{"name": "_sim_search", "arguments": {"query": "x"}}\n</tool_call>'
    ep, seen = CT.simulate_episode(
        env,
        [
            ("assistant", call),
            ("assistant", "<think>\nok\n</think>\n\nDone."),
            ("user", "Again?"),
            ("assistant", "<think>\nsure\n</think>\n\nYes."),
        ],
        qwen3.eos_token_id,
    )
    assert len(ep.samples) == 2 and ep.forks == 1
    first, second = (qwen3.decode(s.input_ids) for s in ep.samples)
    assert "secret plan" in first and "secret plan" not in second  # the template dropped it at the user query
    assert ep.samples[1].input_ids[: len(seen[2][0])] == seen[2][0]  # new sample = exactly the sampler's prompt
    assert (
        second
        == qwen3.apply_chat_template(
            ep.messages[:-1], tools=env.fmt.schemas, tokenize=False, add_generation_prompt=True
        )
        + "<think>\nsure\n</think>\n\nYes.<|im_end|>"
    )


def test_all_retention_keeps_every_thinking_block_in_one_sample(qwen3):
    r = CT.check_template(qwen3, "all", "native")
    assert r["violations"] == [] and r["extension_holds"] and r["samples_per_episode"] == 1


def test_tool_cycle_keeps_thinking_only_inside_the_cycle():
    """A QwQ-style template drops every past thinking block: under `template` each tool turn forks;
    `tool_cycle` keeps the in-flight cycle verbatim (one sample until the next user query)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(FIX, "qwen3_tokenizer"))
    tok.chat_template = (
        open(os.path.join(FIX, "qwen3_chat_template.jinja"))
        .read()
        .replace("{%- if loop.index0 > ns.last_query_index %}", "{%- if loop.last %}")
    )
    t = CT.check_template(tok, "template", "native")["settings"]["thinking"]
    assert kinds(t) == [("tool", False), ("tool", False), ("user", False), ("tool", False)]
    c = CT.check_template(tok, "tool_cycle", "native")
    assert kinds(c["settings"]["thinking"]) == [("tool", True), ("tool", True), ("user", False), ("tool", True)]
    assert c["violations"] == []


def test_compaction_breaks_extension_once_every_n_turns(qwen3):
    cfg = M.Config(
        system_prompt="",
        tool_format="native",
        max_env_steps=100,
        thinking_retention="all",
        thinking_compaction_turns=2,
        tokenization_check="strict",
    )
    env = M.MultiTurnToolEnv(qwen3, [CT._sim_search], cfg)
    call = '<think>\nstep {}\n</think>\n\n<tool_call>\n{{"name": "_sim_search", "arguments": {{"query": "q{}"}}}}\n</tool_call>'
    ep, seen = CT.simulate_episode(env, [("assistant", call.format(i, i)) for i in range(6)], qwen3.eos_token_id)
    assert [b["extends"] for b in ep.boundaries] == [True, False, True, False, True]
    assert len(ep.samples) == 3
    last_prompt = qwen3.decode(seen[5][0])
    assert "step 4" in last_prompt and all(f"step {i}" not in last_prompt for i in range(4))
    assert CT.check_invariants(ep, seen, env) == []


@pytest.mark.parametrize("name", TEMPLATES)
def test_xml_protocol_under_every_template(qwen3, name):
    r = CT.check_template(with_template(qwen3, name), "template", "xml")
    assert r["violations"] == []
    if name == "qwen3":  # an XML <result> is a user message, i.e. a new query to Qwen3: thinking dropped every turn
        assert not any(b["extends"] for b in r["settings"]["thinking"]["boundaries"])
        assert CT.check_template(with_template(qwen3, name), "all", "xml")["samples_per_episode"] == 1
    else:
        assert r["extension_holds"] and r["samples_per_episode"] == 1


@pytest.mark.parametrize("name", TEMPLATES)
def test_native_tool_calls_keep_the_invariants_under_every_template(qwen3, name):
    """Hermes <tool_call> calls: no invariant breaks under any template. Templates that render calls
    in another format (Llama 3.1's JSON) or not at all (SmolLM2's) re-render the turn: the sample forks."""
    r = CT.check_template(with_template(qwen3, name), "template", "native")
    assert r["violations"] == []
    if name == "qwen3":  # Hermes <tool_call> is the Qwen templates' own format: a tool cycle stays one sample
        assert kinds(r["settings"]["thinking"])[:2] == [("tool", True), ("tool", True)]
    if name == "qwen2_5":
        assert r["settings"]["no_thinking"]["samples_per_episode"] == 1
    if name in ("llama3_1", "smollm2"):
        assert not r["settings"]["no_thinking"]["boundaries"][0]["extends"]


def test_tool_cycle_keeps_the_forced_empty_think_block_of_qwen3_without_thinking(qwen3):
    r = CT.check_template(qwen3, "tool_cycle", "native")["settings"]["no_thinking"]
    assert kinds(r) == [("tool", True), ("tool", True), ("user", False), ("tool", True)] and r["violations"] == []


def native_env(qwen3, **kw):
    return M.MultiTurnToolEnv(
        qwen3,
        [CT._sim_search],
        M.Config(
            **{"system_prompt": "", "tool_format": "native", "max_env_steps": 10, "tokenization_check": "strict", **kw}
        ),
    )


class Turns(ScriptedSampler):
    """Each call returns the next scripted list of ids."""

    def generate(self, prompts, max_tokens, *a, **k):
        out = []
        for p in prompts:
            self.prompts.append(p)
            ids = self.script[len(self.sent)]
            self.sent.append(ids)
            out.append(M.Completion(ids, [-0.5] * len(ids), "stop"))
        return out


@pytest.mark.parametrize(
    "call",
    [
        '{"name": "_sim_search", "arguments": {"query": "x"',
        '["_sim_search"]',
        '{"arguments": {"query": "x"}, "name": "_sim_search"}',
    ],
)
def test_native_calls_that_do_not_round_trip_are_errors_or_forks_never_a_crash(qwen3, call):
    enc = lambda t: qwen3.encode(t, add_special_tokens=False) + [qwen3.eos_token_id]  # noqa: E731
    sampler = Turns(
        qwen3, [enc(f"<think>\nx\n</think>\n\n<tool_call>\n{call}\n</tool_call>"), enc("<think>\ny\n</think>\n\nDone.")]
    )
    [ep] = native_env(qwen3).rollout([{"prompt": "q"}], sampler)
    assert ep.end_reason == "answer" and ep.tool_calls == 1 and ep.tokenization_mismatches == 0
    trained = [i for s in ep.samples for i, m in zip(s.input_ids, s.loss_mask) if m]
    assert trained == sampler.sent[0] + sampler.sent[1]
    if call.startswith('{"arguments"'):  # valid but non-canonical key order: run, then re-rendered canonically
        assert ep.tool_errors == 0 and ep.forks == 1
    else:
        assert ep.tool_errors == 1 and ep.messages[-2]["content"].startswith("Error:")


def test_a_second_eos_token_ends_the_turn_without_a_mismatch(qwen3):
    enc = lambda t: qwen3.encode(t, add_special_tokens=False)  # noqa: E731
    other_eos = qwen3.convert_tokens_to_ids("<|endoftext|>")
    sampler = Turns(
        qwen3,
        [
            enc(
                '<think>\nx\n</think>\n\n<tool_call>\n{"name": "_sim_search", "arguments": {"query": "x"}}\n</tool_call>'
            )
            + [other_eos],
            enc("<think>\ny\n</think>\n\nDone.") + [other_eos],
        ],
    )
    [ep] = native_env(qwen3).rollout([{"prompt": "q"}], sampler)
    assert ep.end_reason == "answer" and ep.tool_errors == 0 and ep.tokenization_mismatches == 0
    # the template ends the call turn with its own <|im_end|>: REALIGN turns the sampled end marker into context
    assert len(ep.samples) == 1 and ep.realigns == 1 and ep.realigned_tokens == 1 and ep.forks == 0
    assert [i for s in ep.samples for i, m in zip(s.input_ids, s.loss_mask) if m] == sampler.sent[0][
        :-1
    ] + sampler.sent[1]
    off = native_env(qwen3, realign_max_tokens=0).rollout([{"prompt": "q"}], Turns(qwen3, sampler.script))[0]
    assert len(off.samples) == 2 and off.forks == 1 and off.realigns == 0, "realign_max_tokens=0: always fork"
    assert [i for s in off.samples for i, m in zip(s.input_ids, s.loss_mask) if m] == sampler.sent[0] + sampler.sent[1]


def test_adversarial_sampled_ids_are_trained_verbatim(qwen3):
    """Non-canonical ids ("\\n\\n" as two "\\n", text split per character) and special-token text
    sampled as ordinary characters: the trained ids are the sampled ids, and nothing forks."""
    cfg = M.Config(system_prompt="", tool_format="native", max_env_steps=10, tokenization_check="strict")
    env = M.MultiTurnToolEnv(qwen3, [CT._sim_search], cfg)
    call = '<think>\nuse <|im_end|> literally\n</think>\n\n<tool_call>\n{"name": "_sim_search", "arguments": {"query": "<|im_start|>"}}\n</tool_call>'
    ids = char_ids(qwen3, call) + [qwen3.eos_token_id]
    assert qwen3.convert_tokens_to_ids("<|im_end|>") not in ids[:-1]  # the text, not the control token
    assert qwen3.encode("\n\n", add_special_tokens=False) == [271] and 271 not in ids

    class Sampler(ScriptedSampler):
        def generate(self, prompts, max_tokens, *a, **k):
            self.prompts += prompts
            out = (
                ids
                if len(self.prompts) == 1
                else qwen3.encode("<think>\nok\n</think>\n\nThe answer.", add_special_tokens=False)
                + [qwen3.eos_token_id]
            )
            self.sent.append(out)
            return [M.Completion(out, [-0.5] * len(out), "stop")]

    sampler = Sampler(qwen3, [])
    [ep] = env.rollout([{"prompt": "Find it."}], sampler)
    assert ep.tool_calls == 1 and ep.tool_errors == 0 and ep.end_reason == "answer"
    assert len(ep.samples) == 1 and ep.tokenization_mismatches == 0
    s = ep.samples[0]
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == sampler.sent[0] + sampler.sent[1]
    assert s.input_ids[: len(sampler.prompts[1])] == sampler.prompts[1]
    assert ep.messages[-2] == {"role": "tool", "content": "Results for <|im_start|>: 42 is the answer."}


def test_native_tool_schema_from_signature_and_docstring(qwen3):
    schema = M.tool_schema(CT._sim_search)
    assert schema == {
        "type": "function",
        "function": {
            "name": "_sim_search",
            "description": "Search the web for `query`.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to search for"}},
                "required": ["query"],
            },
        },
    }
    env = M.MultiTurnToolEnv(qwen3, [CT._sim_search], M.Config(system_prompt="", tool_format="native"))
    text = env.chat.render([{"role": "user", "content": "hi"}], {})
    assert json.dumps(schema) in text and "<tool_call>" in text


def test_tokenization_check_modes(tok, tmp_path):
    """A template that shows a value which changed after the sampler's prompt (as one that prints today's date does
    across midnight): the episode-end rendering differs from what the sampler saw. Whitespace only: counted and let
    through under ignore_strippable, an error with a diff under strict, not looked at under off; other text: an
    error under ignore_strippable too."""
    from conftest import recipe_cfg

    old = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
        "{{ (pad | default('')) + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    try:
        env = M.MultiTurnToolEnv(tok, [], recipe_cfg(tmp_path, "tokenization_check=strict"))
        [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, ["<answer>x</answer>"]))
        assert ep.tokenization_mismatches == 0
        for pad, mode, found in (
            (" ", "ignore_strippable", 1),
            (" ", "off", 0),
            ("x", "off", 0),
            (" ", "strict", None),
            ("x", "ignore_strippable", None),
        ):
            env.cfg.chat_template_kwargs, env.cfg.tokenization_check = {"pad": pad}, mode
            if found is None:
                with pytest.raises(
                    M.TokenizationMismatch, match="differs from a fresh rendering(.|\\n)*trained :(.|\\n)*template:"
                ):
                    env.chat.check_tokenization(ep)
            else:
                assert env.chat.check_tokenization(ep) == found
    finally:
        tok.chat_template = old


@pytest.mark.parametrize("retention", ["template", "tool_cycle", "all"])
def test_qwen3_without_thinking_and_a_sampled_think_end_in_the_last_turn_pass_the_check(qwen3, retention):
    """With enable_thinking: false the generation prompt forces an empty <think></think>. A last turn that samples its
    own "</think>" renders as history with that text as its thinking, but the sampler saw exactly the template's
    generation prompt: the check compares with that rendering, so it passes under strict."""
    enc = lambda t: qwen3.encode(t, add_special_tokens=False) + [qwen3.eos_token_id]  # noqa: E731
    call = '<tool_call>\n{"name": "_sim_search", "arguments": {"query": "x"}}\n</tool_call>'
    env = native_env(qwen3, thinking_retention=retention, chat_template_kwargs={"enable_thinking": False})
    sampler = Turns(qwen3, [enc(call), enc("hmm</think>\n\nDone.")])
    [ep] = env.rollout([{"prompt": "q"}], sampler)
    assert ep.end_reason == "answer" and ep.tokenization_mismatches == 0
    assert qwen3.decode(sampler.prompts[-1]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_check_template_cli_json():
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "mt_grpo_trainer.py",
            "check-template",
            "--tokenizer",
            os.path.join(FIX, "qwen3_tokenizer"),
            "--chat-template",
            os.path.join(FIX, "qwen3_chat_template.jinja"),
            "--tool-format",
            "native",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["extension_holds"] is False and out["violations"] == []
    assert out["settings"]["thinking"]["samples_per_episode"] == 2 and out["samples_per_episode"] == 5
    assert {"setting", "turn", "kind", "extends"} <= set(out["boundaries"][0])


def test_realign_under_a_template_that_trims_content_keeps_one_sample_and_a_real_rewrite_still_forks(qwen3):
    """Llama 3.1's template trims every message's content: an answer sampled with a trailing blank line comes back
    without it at the next turn. REALIGN keeps one sample and untrains only the tail that holds no content (the
    blank line and the end marker); realign_max_tokens=0 forks there instead; check-template reports it."""
    llama = with_template(qwen3, "llama3_1")
    script = [("assistant", "It is 42.\n\n"), ("user", "Why?"), ("assistant", "Because six times seven is 42.")]
    env = native_env(llama)
    ep, seen = CT.simulate_episode(env, script, llama.eos_token_id)
    assert len(ep.samples) == 1 and ep.forks == 0 and ep.realigns == 1 and ep.boundaries[0]["realigned"] == 2
    assert ep.realigned_tokens == 2 and CT.check_invariants(ep, seen, env) == []  # "\n\n" and <|im_end|>
    s = ep.samples[0]
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == seen[0][1][:-2] + seen[1][1], "I1: sampled ids only"
    assert s.input_ids[: len(seen[1][0])] == seen[1][0], "the next prompt is the sample as realigned"
    assert env.chat.check_tokenization(ep) == 0
    off_env = native_env(llama, realign_max_tokens=0)
    off, _ = CT.simulate_episode(off_env, script, llama.eos_token_id)
    assert len(off.samples) == 2 and off.forks == 1 and off.realigns == 0
    # a rewrite that changes content is not a wobble: a template that drops the last turn's final word forks
    wobble = with_template(qwen3, "qwen2_5")
    wobble.chat_template = wobble.chat_template.replace("message.content", "(message.content | replace('42.', '42'))")
    ep2, seen2 = CT.simulate_episode(native_env(wobble), script, wobble.eos_token_id)
    assert ep2.forks == 1 and ep2.realigns == 0 and CT.check_invariants(ep2, seen2, native_env(wobble)) == []


def test_check_template_reports_realign_boundaries(tmp_path, capsys):
    """Qwen2.5's template with one change: a past assistant turn ends in <|endoftext|>, not the <|im_end|> sampled
    (a re-rendered end marker, the tail wobble REALIGN keeps in one sample). check-template's own output, text and
    JSON, marks the boundary after each answer REALIGN, not FORK."""
    template = open(os.path.join(FIX, "qwen2_5_chat_template.jinja")).read()
    history = "message.content + '<|im_end|>' + '\\n' }}"
    assert template.count(history) == 1
    marker = "message.content + ('<|endoftext|>' if message.role == 'assistant' else '<|im_end|>') + '\\n' }}"
    (tmp_path / "t.jinja").write_text(template.replace(history, marker))
    argv = ["--tokenizer", os.path.join(FIX, "qwen3_tokenizer"), "--chat-template", str(tmp_path / "t.jinja")]
    argv += ["--tool-format", "native"]
    assert CT.main([*argv, "--json"]) == 0  # native tool format: an answer ends in EOS, not in a stop string
    r = json.loads(capsys.readouterr().out)
    assert r["violations"] == [] and r["samples_per_episode"] == 1
    realigned = [(b["setting"], b["kind"]) for b in r["boundaries"] if b["realigned"]]
    assert realigned == [("no_thinking", "user"), ("thinking", "user")], r["boundaries"]
    assert all(b["extends"] for b in r["boundaries"] if not b["realigned"])
    assert CT.main(argv) == 0
    text = capsys.readouterr().out
    for setting in ("no_thinking", "thinking"):
        [line] = [x for x in text.splitlines() if x.strip().startswith(setting + " ")]
        assert line.endswith("boundaries: tool:extend tool:extend user:REALIGN tool:extend"), line
    assert "FORK" not in text.replace("or FORK", ""), "no boundary is reported as a fork"


def bridge_episode(tok, turns, bridge=True):
    """A `turns`-turn native tool episode (check-template's scripted driver); the env, the episode and the prompts."""
    env = native_env(tok, system_prompt="You search.", max_env_steps=10**6)
    env.chat.bridge_checks = 0 if bridge else -1
    call = '<think>\nstep {t}\n</think>\n\n<tool_call>\n{{"name": "_sim_search", "arguments": {{"query": "q{t}"}}}}\n</tool_call>'
    ep, seen = CT.simulate_episode(env, [("assistant", call.format(t=t)) for t in range(turns)], tok.eos_token_id)
    return env, ep, [prompt for prompt, _ in seen]


def test_the_bridge_gives_the_sampler_exactly_the_full_renderings_prompts(qwen3):
    """At tool boundaries the bridge renders only the new messages: every prompt of a 40-turn episode is the one a
    full rendering gives, the bridge passed its checks and stayed on, and the episode-end check agrees."""
    env, ep, bridged = bridge_episode(qwen3, 40)
    _, ep_full, full = bridge_episode(qwen3, 40, bridge=False)
    assert bridged == full and env.chat.bridge_checks == M.BRIDGE_CHECKS and len(ep.samples) == 1
    assert env.chat.check_tokenization(ep) == 0 and ep.thinking_tokens_kept == ep_full.thinking_tokens_kept > 0
    s = ep.samples[0]
    assert s.text == qwen3.decode(s.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_a_template_the_bridge_cannot_follow_turns_it_off_and_prompts_stay_exact(qwen3):
    """A template that numbers tool results by their place in the whole conversation renders the new messages
    differently after a stub: the bridge's first check finds it, it stays off, and every prompt is the full one."""
    tok = with_template(qwen3, "qwen3")
    tok.chat_template = tok.chat_template.replace(
        "{{- '\\n<tool_response>\\n' }}", "{{- '\\n<tool_response #' ~ loop.index ~ '>\\n' }}"
    )
    assert "<tool_response #' ~ loop.index" in tok.chat_template
    env, ep, bridged = bridge_episode(tok, 6)
    _, _, full = bridge_episode(tok, 6, bridge=False)
    assert env.chat.bridge_checks == -1 and bridged == full and env.chat.check_tokenization(ep) == 0


def test_a_held_text_that_is_not_the_ids_is_caught_by_the_episode_end_check(qwen3):
    env, ep, _ = bridge_episode(qwen3, 3)
    ep.samples[0].text += " "
    with pytest.raises(M.TokenizationMismatch, match="held text is not its ids decoded"):
        env.chat.check_tokenization(ep)


@pytest.mark.parametrize("limit", ["max_seq_len", "server"])
def test_a_realigned_prompt_that_leaves_no_room_is_undone_whole(qwen3, tmp_path, limit):
    """The next prompt REALIGNs (the sampled end marker becomes context) but leaves no room to sample, under max_seq_len
    or under a vLLM server's smaller max_model_len (the stand-in's, through the real client): the episode ends
    'context' and its sample is exactly the first turn as sampled, every sampled token still trained (I1, I2)."""
    from tests.vllm_standin import StandinServer

    enc = lambda t: qwen3.encode(t, add_special_tokens=False)  # noqa: E731
    other_eos = qwen3.convert_tokens_to_ids("<|endoftext|>")
    call = enc(
        '<think>\nx\n</think>\n\n<tool_call>\n{"name": "_sim_search", "arguments": {"query": "x"}}\n</tool_call>'
    )
    roomy = native_env(qwen3).rollout(
        [{"prompt": "q"}], Turns(qwen3, [call + [other_eos], enc("Done.") + [other_eos]])
    )[0]
    assert roomy.realigns == 1, "the setting below must REALIGN at the boundary"
    first_prompt = roomy.turns[0].sampled_len + roomy.turns[0].prompt_len  # the sample after turn 0
    sent, room = call + [other_eos], roomy.turns[1].prompt_len
    if limit == "max_seq_len":
        [ep] = native_env(qwen3, max_seq_len=room).rollout([{"prompt": "q"}], Turns(qwen3, [sent]))
    else:
        with StandinServer(
            backend=lambda p, r: (sent, [-0.5] * len(sent), "stop"), vocab_size=len(qwen3), max_model_len=room
        ) as srv:
            cfg = M.load_config(None, [f"vllm_server_url={srv.url}", f"output_dir={tmp_path}/run"])
            client = M.VLLMServerClient(cfg, len(qwen3))
            [ep] = native_env(qwen3, max_seq_len=4 * room).rollout([{"prompt": "q"}], client)
            assert len([r for r in srv.requests if r["path"] == "/v1/completions"]) == 1
    assert ep.end_reason == "context" and len(ep.turns) == 1 and len(ep.samples) == 1
    s = ep.samples[0]
    assert len(s.input_ids) == first_prompt < room and s.input_ids[s.last_prompt_len :] == sent
    assert s.loss_mask[s.last_prompt_len :] == [1] * len(sent) and s.text == qwen3.decode(s.input_ids)
    assert ep.realigns == ep.realigned_tokens == 0 and ep.tokenization_mismatches == 0


def test_decomposed_unicode_from_a_tool_a_docstring_or_a_prompt_is_read_as_the_tokenizer_reads_it(qwen3):
    """Qwen's tokenizer NFC-normalises: a tool result, a native tool's docstring (its schema is in the template) or a
    prompt with a decomposed character ("n" + U+0303, as some Wikipedia passages have) must not make a fork, a
    mismatch that stops the run, or switch the bridge off."""
    nfd = "La Can\u0303ada Flintridge is a city in Los Angeles County."

    def search(query: str) -> str:
        """Search the archive of La Can\u0303ada."""
        return nfd

    enc = lambda t: qwen3.encode(t, add_special_tokens=False) + [qwen3.eos_token_id]  # noqa: E731
    call = '<think>\nx\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>'
    env = M.MultiTurnToolEnv(
        qwen3, [search], M.Config(system_prompt="", tool_format="native", max_env_steps=2, tokenization_check="strict")
    )
    sampler = Turns(qwen3, [enc(call), enc(call), enc("<think>\ny\n</think>\n\nIn California.")])
    [ep] = env.rollout([{"prompt": "Where is La Can\u0303ada?"}], sampler)
    assert "archive of La Ca\u00f1ada" in qwen3.decode(sampler.prompts[0])
    assert ep.end_reason == "answer" and ep.tool_calls == 2 and ep.tokenization_mismatches == 0
    assert len(ep.samples) == 1 and ep.forks == 0 and all(b["extends"] for b in ep.boundaries)
    assert env.chat.bridge_checks == 2, "the bridge stays on"
    assert "Ca\u00f1ada" in ep.messages[0]["content"] and ep.messages[2]["content"] == nfd.replace("n\u0303", "\u00f1")


def test_decomposed_unicode_sampled_by_the_policy_then_a_fork_neither_stops_the_run_nor_forks_again(qwen3):
    """The policy samples a decomposed character ("n" then U+0303, two tokens), then a call the template re-renders
    (keys in another order): the sample forks, and the new one holds that turn re-encoded, i.e. composed (NFC). Text
    is held and compared as the tokenizer reads it, so later boundaries extend and the check passes; ids stay as
    sampled."""
    enc = lambda t: qwen3.encode(t, add_special_tokens=False)  # noqa: E731
    eos = [qwen3.eos_token_id]
    nfd = enc("<think>\nLa Can") + enc("\u0303") + enc("ada\n</think>\n\n")
    odd = enc('<tool_call>\n{"arguments": {"query": "x"}, "name": "_sim_search"}\n</tool_call>')
    call = enc('<tool_call>\n{"name": "_sim_search", "arguments": {"query": "y"}}\n</tool_call>')
    for mode in ("strict", "ignore_strippable"):
        sampler = Turns(qwen3, [nfd + odd + eos, call + eos, call + eos, enc("Done.") + eos])
        [ep] = native_env(qwen3, tokenization_check=mode).rollout([{"prompt": "q"}], sampler)
        assert ep.end_reason == "answer" and ep.tokenization_mismatches == 0
        assert ep.forks == 1 and [b["extends"] for b in ep.boundaries] == [False, True, True]
        trained = [i for s in ep.samples for i, m in zip(s.input_ids, s.loss_mask) if m]
        assert trained == sum(sampler.sent, []) and enc("\u0303")[0] in trained
        assert "Ca\u00f1ada" in ep.messages[1]["content"], "the conversation holds the sampled text composed"
    s, env = M.Sample(), native_env(qwen3)  # a combining mark at the start of appended ids joins the character before
    env.chat.append(s, enc("n"), mask=0)
    env.chat.append(s, enc("\u0303"), mask=0)
    assert s.text == "\u00f1" == env.chat.dec(s.input_ids) and qwen3.decode(s.input_ids) == "n\u0303"


def test_max_env_steps_counts_every_call_of_a_turn(qwen3):
    """A native turn with three calls when two are allowed ends the episode, none of them run."""
    enc = lambda t: qwen3.encode(t, add_special_tokens=False) + [qwen3.eos_token_id]  # noqa: E731
    three = "\n".join(
        f'<tool_call>\n{{"name": "_sim_search", "arguments": {{"query": "{q}"}}}}\n</tool_call>' for q in "abc"
    )
    for limit, runs in ((2, 0), (3, 3)):
        [ep] = native_env(qwen3, max_env_steps=limit).rollout(
            [{"prompt": "q"}], Turns(qwen3, [enc(three), enc("Done.")])
        )
        assert ep.tool_calls == runs and sum(m["role"] == "tool" for m in ep.messages) == runs
        assert ep.end_reason == ("max_env_steps" if runs == 0 else "answer")


def test_two_native_calls_in_one_turn_under_a_one_call_template_are_one_counted_error(qwen3):
    """Llama 3.1's template raises on an assistant message with two tool calls: that turn stays its sampled text and
    gets one error result the model sees (counted), and neither call runs. Qwen3's template takes both, and both run."""
    ran = []

    def search(query: str) -> str:
        """Search."""
        ran.append(query)
        return "found"

    enc = lambda t: qwen3.encode(t, add_special_tokens=False) + [qwen3.eos_token_id]  # noqa: E731
    two = "\n".join(f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{q}"}}}}\n</tool_call>' for q in "ab")
    for name, runs in (("llama3_1", []), ("qwen3", ["a", "b"])):
        ran.clear()
        env = M.MultiTurnToolEnv(
            with_template(qwen3, name),
            [search],
            M.Config(system_prompt="", tool_format="native", max_env_steps=10, tokenization_check="strict"),
        )
        [ep] = env.rollout([{"prompt": "q"}], Turns(qwen3, [enc(two), enc("Done.")]))
        assert ep.end_reason == "answer" and ep.tokenization_mismatches == 0 and ran == runs
        if not runs:
            assert ep.tool_calls == ep.tool_errors == 1 and ep.messages[-3] == {"role": "assistant", "content": two}
            assert ep.messages[-2] == {
                "role": "tool",
                "content": "Error: ValueError: this chat template takes one "
                "tool call per turn; this turn made 2, and none of them ran",
            }
        else:
            assert ep.tool_calls == 2 and ep.tool_errors == 0


def test_a_tool_that_edits_its_arguments_changes_nothing_else(qwen3):
    """Native calls keep the parsed arguments in the assistant message, which the next prompt renders."""

    def tag(keys: list) -> str:
        """Tags keys (and edits the list it was given)."""
        keys.append("edited")
        return "tagged"

    enc = lambda t: qwen3.encode(t, add_special_tokens=False) + [qwen3.eos_token_id]  # noqa: E731
    call = '<think>\nx\n</think>\n\n<tool_call>\n{"name": "tag", "arguments": {"keys": ["a"]}}\n</tool_call>'
    sampler = Turns(qwen3, [enc(call), enc("<think>\ny\n</think>\n\nDone.")])
    cfg = M.Config(system_prompt="", tool_format="native", tokenization_check="strict")
    [ep] = M.MultiTurnToolEnv(qwen3, [tag], cfg).rollout([{"prompt": "q"}], sampler)
    assert ep.messages[1]["tool_calls"][0]["function"]["arguments"] == {"keys": ["a"]}
    assert ep.end_reason == "answer" and ep.tool_errors == 0 and ep.forks == 0, "the history the model saw, as sampled"


def test_check_template_defaults_to_the_trainers_tool_format_and_a_model_folders_template_alone_is_enough(
    tiny_model_dir, capsys
):
    assert CT.main(["--tokenizer", str(tiny_model_dir)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert f"tool_format={M.Config.tool_format}" in head and f"thinking_retention={M.Config.thinking_retention}" in head
    template = os.path.join(tiny_model_dir, "chat_template.jinja")  # a model folder's: its tokenizer is beside it
    assert os.path.isfile(template) and CT.main(["--chat-template", template]) == 0
    assert capsys.readouterr().out.startswith(f"check-template: {tiny_model_dir} ")


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "no tokenizer given: add --tokenizer DIR_OR_HUB_ID"),
        (["--tokenizer", "/no/such/dir"], "--tokenizer /no/such/dir: no such folder"),
        (["--tokenizer", "{tmp}"], "no tokenizer loads from it"),
        (["--chat-template", "{tmp}/none.jinja"], "--chat-template {tmp}/none.jinja: no such file"),
        (["--chat-template", "{tmp}/t.jinja"], "the folder of {tmp}/t.jinja holds no tokenizer: add --tokenizer"),
    ],
)
def test_check_template_input_it_cannot_use_is_one_line(tmp_path, capsys, args, says):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert CT.main([a.format(tmp=tmp_path) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("check-template: error: ") and err.count("\n") == 1 and says.format(tmp=tmp_path) in err, err


def test_merge_lora_says_not_found_for_a_path_that_is_not_there(tmp_path):
    import merge_lora

    with pytest.raises(SystemExit) as stop:
        merge_lora.main([str(tmp_path / "runs" / "x" / "checkpoint-9"), str(tmp_path / "out")])
    assert str(stop.value.code) == f"mt-grpo: error: {tmp_path}/runs/x/checkpoint-9 not found; " + (
        "give a LoRA run's checkpoint folder, e.g. runs/NAME/checkpoint-200"
    )
