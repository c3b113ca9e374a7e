"""MultiTurnToolEnv: masks come from sampled ids (I1), lists stay aligned (I2), non-sampled tokens are
masked (I3), samples extend or fork (I4), and failures become counted outcomes (I6): tool
calls that are malformed, cut, raise, hang, flood or return what is not text, empty generations, truncation."""

import json
import sys
import threading
import time

import pytest

import mt_grpo_trainer as M
from conftest import HANG_S, recipe_cfg, until
from tools.kv_lookup import TABLE


def char_ids(tok, text):
    """A valid but non-canonical tokenization: one token per character (the tokenizer would merge them)."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


class ScriptedSampler:
    """Returns scripted turns as non-canonical token ids with made-up logprobs; records every prompt."""

    policy_version = None  # as the in-process sampler: nothing to sync

    def __init__(self, tok, script, finish=None):
        self.tok, self.script, self.finish = tok, script, finish or {}
        self.prompts, self.sent = [], []

    def generate(self, prompts, max_tokens, temperature, top_p, stop, generator=None, sessions=None):
        outs = []
        for p in prompts:
            k = len(self.prompts)
            self.prompts.append(list(p))
            ids = char_ids(self.tok, self.script[k % len(self.script)])
            self.sent.append(ids)
            outs.append(M.Completion(ids, [-0.01 * (j + 1) for j in range(len(ids))], self.finish.get(k, "stop")))
        return outs

    def close(self):
        pass


def tool_call(key):
    return f"<reasoning>look</reasoning>\n<tool>{json.dumps({'name': 'lookup', 'args': {'key': key}})}</tool>"


def make_env(tok, tmp_path, *overrides):
    cfg = recipe_cfg(tmp_path, *overrides)
    return M.MultiTurnToolEnv(tok, [M.load_object(s) for s in cfg.tools], cfg)


def test_sampled_ids_are_trained_verbatim_and_everything_else_is_masked(tok, tmp_path):
    env = make_env(tok, tmp_path)
    script = [tool_call("golf"), f"<reasoning>done</reasoning>\n<answer>{TABLE['golf']}</answer>"]
    sampler = ScriptedSampler(tok, script)
    [ep] = env.rollout([{"prompt": "What is the value of golf?", "answer": TABLE["golf"]}], sampler)
    assert ep.end_reason == "answer" and ep.tool_calls == 1 and ep.tool_errors == 0
    assert len(ep.samples) == 1 and ep.forks == 0  # ChatML appends: one sample (I4)
    s = ep.samples[0]
    n = len(s.input_ids)
    assert len(s.loss_mask) == len(s.sampler_logprobs) == len(s.turn_idx) == n  # I2
    # I1: each turn's sampled ids sit right after exactly the prompt the sampler was given.
    for prompt, sent in zip(sampler.prompts, sampler.sent):
        assert s.input_ids[: len(prompt)] == prompt
        assert s.input_ids[len(prompt) : len(prompt) + len(sent)] == sent
        assert s.loss_mask[len(prompt) : len(prompt) + len(sent)] == [1] * len(sent)
    # The ids are the non-canonical ones, not a re-encoding of their text.
    assert tok.encode(script[0], add_special_tokens=False) != sampler.sent[0]
    trained = [i for i, m in zip(s.input_ids, s.loss_mask) if m]
    assert trained == sampler.sent[0] + sampler.sent[1]
    assert [lp for lp, m in zip(s.sampler_logprobs, s.loss_mask) if m] == [
        -0.01 * (j + 1) for j in range(len(sampler.sent[0]))
    ] + [-0.01 * (j + 1) for j in range(len(sampler.sent[1]))]
    # I3: prompt, template and tool-result tokens are all mask 0.
    masked_text = tok.decode([i for i, m in zip(s.input_ids, s.loss_mask) if not m])
    assert f"<result>\n{TABLE['golf']}\n</result>" in masked_text and "<|im_start|>user" in masked_text
    assert set(t for t, m in zip(s.turn_idx, s.loss_mask) if m) == {0, 1}
    assert all(t == -1 for t, m in zip(s.turn_idx, s.loss_mask) if not m)
    # The conversation the rewards see is the decoded sampled text.
    assert ep.completion[0] == {"role": "assistant", "content": script[0]}
    assert ep.first_result_turn == 1


def test_template_that_rewrites_history_forks_a_new_sample(tok, tmp_path):
    """A template that drops past <reasoning> blocks breaks extension: the sample is closed and the next
    one starts from exactly the tokens the sampler sees next (I4)."""
    env = make_env(tok, tmp_path)
    strip = (
        "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and loop.index0 < messages|length - 2 %}"
        "{% set c = c.split('</reasoning>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    old = tok.chat_template
    tok.chat_template = strip
    try:
        script = [tool_call("alpha"), tool_call("bravo"), "<answer>x</answer>"]
        env.cfg.tokenization_check = "off"
        sampler = ScriptedSampler(tok, script)
        [ep] = M.MultiTurnToolEnv(tok, env.tools.values(), env.cfg).rollout([{"prompt": "q"}], sampler)
        # Every prompt was the template's rendering at its turn, so the rewrite is a fork, not a mismatch: the
        # tokenization check passes under strict.
        env.cfg.tokenization_check = "strict"
        [strict] = M.MultiTurnToolEnv(tok, env.tools.values(), env.cfg).rollout(
            [{"prompt": "q"}], ScriptedSampler(tok, script)
        )
        assert strict.tokenization_mismatches == 0 and strict.forks == 1
    finally:
        tok.chat_template = old
    # turn 0 -> turn 1: the last assistant message keeps its reasoning, so the sample extends;
    # turn 1 -> turn 2: turn 0's reasoning is now dropped, so the sample forks.
    assert ep.forks == 1 and len(ep.samples) == 2
    second = ep.samples[1]
    assert second.input_ids[: len(sampler.prompts[2])] == sampler.prompts[2]
    assert [i for i, m in zip(second.input_ids, second.loss_mask) if m] == sampler.sent[2]
    first = ep.samples[0]
    assert [i for i, m in zip(first.input_ids, first.loss_mask) if m] == sampler.sent[0] + sampler.sent[1]


def test_max_env_steps_bounds_tool_calls(tok, tmp_path):
    env = make_env(tok, tmp_path, "max_env_steps=2")
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, [tool_call("alpha")]))
    assert ep.tool_calls == 2 and len(ep.turns) == 3 and ep.end_reason == "max_env_steps"
    assert sum(m["content"].startswith("<result>") for m in ep.completion) == 2


def test_an_empty_generation_ends_the_episode_with_a_flag(tok, tmp_path):
    env = make_env(tok, tmp_path)
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, [""]))
    assert ep.end_reason == "empty" and ep.done and len(ep.turns) == 1
    assert M.rollout_metrics([ep])["rollout/empty"] == 1.0


@pytest.mark.parametrize(
    "payload,err",
    [
        ("{not json", "JSONDecodeError"),
        ('{"args": {}}', 'expected {"name"'),
        ('{"name": "nope", "args": {}}', "unknown tool 'nope'"),
        ('{"name": {"tool": "lookup"}, "args": {}}', "unknown tool {'tool': 'lookup'}"),
        ('{"name": ["lookup"], "args": {}}', "unknown tool ['lookup']"),
        ('{"name": "lookup", "args": {"k": 1}}', "TypeError"),
        ('{"name": "lookup", "args": {"key": "zulu"}}', "unknown key 'zulu'"),
    ],
)
def test_malformed_tool_calls_become_counted_error_results(tok, tmp_path, payload, err):
    env = make_env(tok, tmp_path, "max_env_steps=1")
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, [f"<tool>{payload}</tool>", "<answer>a</answer>"]))
    assert ep.tool_errors == 1 and ep.end_reason == "answer"
    assert ep.completion[1]["content"].startswith("<result>\nError:") and err in ep.completion[1]["content"]


def test_a_tool_that_raises_becomes_a_counted_error_result(tok, tmp_path):
    def broken(key: str) -> str:
        """Always fails."""
        raise ConnectionError("index server down")

    env = M.MultiTurnToolEnv(tok, [broken], recipe_cfg(tmp_path, "max_env_steps=1"))
    [ep] = env.rollout(
        [{"prompt": "q"}],
        ScriptedSampler(tok, ['<tool>{"name": "broken", "args": {"key": "a"}}</tool>', "<answer>a</answer>"]),
    )
    assert ep.tool_errors == 1 and "Error: ConnectionError: index server down" in ep.completion[1]["content"]


def test_any_tool_result_reaches_the_model_as_text_and_its_faults_are_counted(tok, tmp_path):
    def surrogate(key: str) -> str:
        """Returns text no tokenizer can encode."""
        return "value \ud800 here"

    def exits(key: str) -> str:
        """Calls sys.exit, as a careless tool might."""
        sys.exit(3)

    def interrupts(key: str) -> str:
        """Raises KeyboardInterrupt inside the tool."""
        raise KeyboardInterrupt

    def nothing(key: str) -> str:
        """Returns None."""

    def number(key: str) -> int:
        """Returns an int."""
        return 42

    cfg = recipe_cfg(tmp_path, "max_env_steps=1")
    env = M.MultiTurnToolEnv(tok, [surrogate, exits, interrupts, nothing, number], cfg)
    call = '<tool>{"name": "%s", "args": {"key": "a"}}</tool>'
    results = {}
    for name in ("surrogate", "exits", "interrupts", "nothing", "number"):
        [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, [call % name, "<answer>a</answer>"]))
        assert ep.end_reason == "answer", name  # the episode, and the run, go on
        results[name] = (ep.completion[1]["content"], ep.tool_errors, ep.tool_output_replaced)
    assert results["surrogate"] == ("<result>\nvalue ? here\n</result>", 0, 1)
    assert results["exits"] == ("<result>\nError: SystemExit: 3\n</result>", 1, 0)
    assert results["interrupts"] == ("<result>\nError: KeyboardInterrupt: \n</result>", 1, 0)
    assert results["nothing"] == ("<result>\nError: the tool returned None\n</result>", 1, 0)
    assert results["number"] == ("<result>\n42\n</result>", 0, 0)
    assert M.rollout_metrics([ep])["rollout/tool_output_replaced"] == 0


def test_a_huge_tool_output_is_cut_before_tokenization(tok, tmp_path):
    def flood(key: str) -> str:
        """Returns a megabyte."""
        return "x" * 1_000_000

    env = M.MultiTurnToolEnv(
        tok, [flood], recipe_cfg(tmp_path, "max_env_steps=1", "tool_output_max_chars=200", "max_seq_len=4096")
    )
    [ep] = env.rollout(
        [{"prompt": "q"}],
        ScriptedSampler(tok, ['<tool>{"name": "flood", "args": {"key": "a"}}</tool>', "<answer>a</answer>"]),
    )
    result = ep.completion[1]["content"]
    assert "[cut: 999800 more characters]" in result and len(result) < 300
    assert ep.end_reason == "answer" and len(ep.samples[-1].input_ids) < 1000


def test_tool_call_cut_at_max_tokens_is_not_run(tok, tmp_path):
    env = make_env(tok, tmp_path)
    [ep] = env.rollout([{"prompt": "q"}], ScriptedSampler(tok, [tool_call("golf")], finish={0: "length"}))
    assert ep.end_reason == "truncated" and ep.tool_calls == 0 and len(ep.completion) == 1


def test_truncated_episodes_are_left_out_of_the_loss_when_asked(tok, tmp_path):
    rows = [{"prompt": "q"}] * 2
    for flag, expected in (("false", 2), ("true", 1)):
        env = make_env(tok, tmp_path, f"mask_truncated_completions={flag}")
        eps = env.rollout(rows, ScriptedSampler(tok, [tool_call("golf"), "<answer>x</answer>"], finish={0: "length"}))
        assert [e.end_reason for e in eps] == ["truncated", "answer"] and eps[0].tool_calls == 0
        samples, rejected = M.trainable_samples(eps, env.cfg)
        assert len(samples) == expected and rejected == 0


def test_prompt_over_context_budget_ends_episode_without_sampling(tok, tmp_path):
    env = make_env(tok, tmp_path, "max_seq_len=8")
    sampler = ScriptedSampler(tok, ["<answer>a</answer>"])
    [ep] = env.rollout([{"prompt": "a long question that does not fit"}], sampler)
    assert ep.end_reason == "context" and sampler.prompts == [] and ep.turns == []


def test_no_room_after_a_tool_result_rolls_the_prompt_back(tok, tmp_path):
    """The tool result is not left dangling in the sample: no sample exceeds max_seq_len, the check passes."""
    env = make_env(tok, tmp_path, "tokenization_check=strict")
    first = env.next_prompt(env.new_episode({"prompt": "What is the value of golf?"}))
    call = tool_call("golf")
    env = make_env(
        tok, tmp_path, "tokenization_check=strict", f"max_seq_len={len(first) + len(char_ids(tok, call)) + 3}"
    )
    [ep] = env.rollout([{"prompt": "What is the value of golf?"}], ScriptedSampler(tok, [call]))
    assert ep.end_reason == "context" and ep.tool_calls == 1 and len(ep.samples) == 1
    s = ep.samples[0]
    assert len(s.input_ids) <= env.cfg.max_seq_len and s.loss_mask[-1] == 1  # ends with the sampled call


def test_a_hanging_tool_is_cut_off_at_tool_timeout(tok, tmp_path):
    """An event, not a clock: the tool blocks until the test releases it, so the rollout returning at all, with the
    tool still blocked, shows it was cut off (the tool's own deadline, HANG_S, only ends a hang)."""
    import threading

    release = threading.Event()
    returned = []

    def slow(key: str) -> str:
        """Never answers in time."""
        release.wait(timeout=HANG_S)
        returned.append(key)
        return "late"

    cfg = recipe_cfg(tmp_path, "tool_timeout=0.2", "max_env_steps=1")
    env = M.MultiTurnToolEnv(tok, [slow], cfg)
    try:
        [ep] = env.rollout(
            [{"prompt": "q"}],
            ScriptedSampler(tok, ['<tool>{"name": "slow", "args": {"key": "a"}}</tool>', "<answer>a</answer>"]),
        )
        assert not returned, "the rollout went on while the tool was still running"
    finally:
        release.set()
    assert ep.tool_errors == 1 and "did not finish within tool_timeout=0.2s" in ep.completion[1]["content"]


def test_a_turns_tool_calls_run_at_once_and_a_hung_tool_never_blocks_the_exit(tok, tmp_path):
    """40 episodes call a tool that hangs: the turn waits tool_timeout once, not 40 times, every call
    is an error the model sees, and the process still exits (the stuck workers are daemons).
    No clock: 40 waits of tool_timeout=2s one after another (80 s) would overrun the subprocess's deadline of 60 s,
    which only catches a hang; run at once, the 40 calls take two rounds of the pool's 32 workers (about 4 s)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{M.__file__.rsplit("/", 1)[0]!r}, {M.__file__.rsplit("/", 1)[0] + "/tests"!r}]
        import mt_grpo_trainer as M
        from tests.conftest import toy_tokenizer
        from tests.test_env import char_ids
        class TwoTurns:   # every episode: a call to the hanging tool, then an answer
            calls = 0
            def generate(self, prompts, *a, **k):
                self.calls += 1
                text = '<tool>{{"name": "hang", "args": {{"key": "a"}}}}</tool>' if self.calls == 1 else '<answer>a</answer>'
                return [M.Completion(char_ids(tok, text), [-0.1] * len(char_ids(tok, text)), 'stop') for _ in prompts]
        def hang(key: str) -> str:
            '''Never returns.'''
            time.sleep(10_000)
        tok = toy_tokenizer()
        cfg = M.load_config('hf_recipes/toy/toy-kv--mt-grpo.yaml', ['tool_timeout=2', 'max_env_steps=1',
                                                                   'output_dir={tmp_path}/run'])
        env = M.MultiTurnToolEnv(tok, [hang], cfg)
        eps = env.rollout([{{'prompt': 'q'}}] * 40, TwoTurns())
        assert all(e.tool_errors == 1 and 'tool_timeout=2.0s' in e.completion[1]['content'] for e in eps)
        print('ok')
    """)
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=M.__file__.rsplit("/", 1)[0]
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_a_128_turn_tool_episode_stays_one_sample_of_linear_size(tok, tmp_path):
    """128 tool calls, then an answer: every turn extends the one sample (I4), each turn's ids follow exactly the
    prompt the sampler saw (I1), only sampled ids are trained (I3), the strict tokenization check passes (I5), and
    the sample holds each token once: linear in the turns, where one sample per turn would be quadratic."""
    keys = list(TABLE)
    script = [tool_call(keys[t % len(keys)]) for t in range(128)] + [f"<answer>{TABLE[keys[0]]}</answer>"]
    env = make_env(tok, tmp_path, "max_env_steps=200", "max_seq_len=100000", "tokenization_check=strict")
    sampler = ScriptedSampler(tok, script)
    [ep] = env.rollout([{"prompt": "What is the value of golf?"}], sampler)
    assert len(ep.turns) == 129 and ep.tool_calls == 128 and ep.tool_errors == 0 and ep.end_reason == "answer"
    assert len(ep.samples) == 1 and ep.forks == ep.realigns == 0 and ep.tokenization_mismatches == 0
    s = ep.samples[0]
    assert len(s.input_ids) == len(s.loss_mask) == len(s.sampler_logprobs) == len(s.turn_idx) == len(s.versions)
    for prompt, sent in zip(sampler.prompts, sampler.sent):
        assert s.input_ids[: len(prompt)] == prompt and s.input_ids[len(prompt) : len(prompt) + len(sent)] == sent
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == [i for ids in sampler.sent for i in ids]
    per_turn = sum(t.prompt_len + t.sampled_len for t in ep.turns)  # what one sample per turn would hold
    assert len(s.input_ids) == len(sampler.prompts[-1]) + len(sampler.sent[-1]) and per_turn > 50 * len(s.input_ids)


def test_tool_timeout_counts_from_when_a_worker_takes_the_call_not_from_the_queue():
    """128 calls of 0.3 s against 32 workers take four rounds (~1.2 s), past tool_timeout=1.0: none may time out."""

    def nap(x: str) -> str:
        """Sleeps 0.3 s."""
        time.sleep(0.3)
        return "ok"

    env = M.MultiTurnToolEnv(None, [nap], M.Config(tool_timeout=1.0))
    eps = [env.new_episode({"prompt": "q"}) for _ in range(128)]
    results = env.run_tools([(ep, {"name": "nap", "args": {"x": "1"}}) for ep in eps])
    assert results == ["ok"] * 128 and sum(ep.tool_errors for ep in eps) == 0


def test_a_pool_starts_workers_as_calls_come_and_they_leave_when_idle(monkeypatch):
    """A pool holds at most its size in threads while calls run, and none once it sits idle: a process that builds
    many runs (a sweep, a notebook, the test suite) does not collect hundreds of idle threads from each. A hung call's
    worker is abandoned, and the calls queued behind it still run."""
    monkeypatch.setattr(M.DaemonPool, "IDLE_EXIT", 0.2)
    release = threading.Event()
    pool = M.DaemonPool(4)

    others = set(threading.enumerate())

    def nap(secs: float):
        time.sleep(secs)

    def workers():
        return sum(t.name == "tool" and t.is_alive() for t in set(threading.enumerate()) - others)

    hung = pool.submit(release.wait)
    with pytest.raises(TimeoutError):
        pool.wait(hung, timeout=0.1)
    futures = [pool.submit(nap, secs=0.05) for _ in range(16)]
    assert workers() <= 5, "4 workers and the one abandoned"
    assert all(pool.wait(f, timeout=5) is None for f in futures)
    release.set()
    until(lambda: workers() == 0, "the pool's threads to leave once idle")
    assert pool.alive == 0 and pool.idle == 0
    assert pool.wait(pool.submit(nap, secs=0.01), timeout=5) is None, "an emptied pool starts workers again"
