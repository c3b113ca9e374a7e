"""What broke when the trainer was tried as a new user would, each now a defined outcome: the run goes on
with the fault counted, or it stops at once with one line that names the cause and the fix."""
import copy
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import mt_grpo_trainer as M
from conftest import ROOT, recipe_cfg, toy_error
from test_env import ScriptedSampler
from test_templates import FIX, Turns, qwen3  # noqa: F401 (a fixture)

TOY = "hf_recipes/toy/toy-kv--mt-grpo.yaml"


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "mt_grpo_trainer.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(r, *needles):
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = [x for x in r.stderr.splitlines() if x.startswith("mt-grpo: error")]
    assert len(line) == 1 and all(n in line[0] for n in needles), r.stderr[-2000:]


# --- 1. two runs on one output_dir -------------------------------------------------------------------

def test_a_second_run_on_a_held_output_dir_refuses_and_a_dead_runs_lock_is_taken_over(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    common = [TOY, f"model_name_or_path={tiny_model_dir}", "model_builder=", f"output_dir={run}", "prompts_per_step=2",
              "num_generations=2", "max_tokens=8", "save_steps=2", "eval_steps=0"]
    first = subprocess.Popen([sys.executable, "mt_grpo_trainer.py", *common, "max_steps=500"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoint-2").is_dir():
        time.sleep(0.2)
    second = cli(*common, "max_steps=3", "seed=1")
    one_line_error(second, f"output_dir '{run}' is in use by the run with PID {first.pid}", "choose another output_dir")
    assert "seed: 0" in (run / "config.yaml").read_text(), "the second run touched nothing"
    first.send_signal(signal.SIGKILL)                # a hard crash leaves its lock behind
    first.wait(timeout=30)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)), "one run's steps only"
    third = cli(*common, "max_steps=3", "seed=1")
    assert third.returncode == 0, third.stderr[-2000:]
    assert f"was left by a run that is gone (PID {first.pid}): taking it over" in third.stdout
    assert not os.path.exists(f"{run}.lock"), "a finished run lets go of its folder"
    assert "seed: 1" in (run / "config.yaml").read_text() and any(p.name.startswith("run.") for p in tmp_path.iterdir())


# --- 2, 3 and "Also": what tools hand back -----------------------------------------------------------

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
        assert ep.end_reason == "answer", name     # the episode, and the run, go on
        results[name] = (ep.completion[1]["content"], ep.tool_errors, ep.tool_output_replaced)
    assert results["surrogate"] == ("<result>\nvalue ? here\n</result>", 0, 1)
    assert results["exits"] == ("<result>\nError: SystemExit: 3\n</result>", 1, 0)
    assert results["interrupts"] == ("<result>\nError: KeyboardInterrupt: \n</result>", 1, 0)
    assert results["nothing"] == ("<result>\nError: the tool returned None\n</result>", 1, 0)
    assert results["number"] == ("<result>\n42\n</result>", 0, 0)
    assert M.rollout_metrics([ep])["rollout/tool_output_replaced"] == 0


# --- 4. dataset columns ------------------------------------------------------------------------------

def test_dataset_rows_must_share_their_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "x"}\n{"prompt": "b"}\n')
    with pytest.raises(M.ConfigError, match=r"row 1 lacks column\(s\) answer that row 0 does not; every row needs"):
        M.load_rows(str(path))
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "answer": "x"}\n')
    with pytest.raises(M.ConfigError, match=r"row 1 has column\(s\) answer that row 0 does not"):
        M.load_rows(str(path))


@pytest.mark.parametrize("data,needle", [
    (b'{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c",}\n',
     "d.jsonl, line 4, column 16: not JSON (Expecting property name"),
    (b'{"prompt": "a"}\n\n["b"]\n', "d.jsonl', line 3: row 1 is ['b'], not an object with a 'prompt'"),
    (b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
     "d.jsonl, line 2: byte 15 of the line is not UTF-8 (invalid continuation byte); save the file as UTF-8"),
])
def test_a_jsonl_dataset_that_does_not_parse_is_one_line_naming_the_files_line(tmp_path, capsys, data, needle):
    (tmp_path / "d.jsonl").write_bytes(data)
    err = toy_error(capsys, tmp_path, f"dataset={tmp_path}/d.jsonl")
    assert needle in err, err


@pytest.mark.parametrize("prompt,needle", [
    (5, "has prompt 5;"), ("  ", "has prompt '  ';"), ([], "has prompt [];"),
    ({"role": "user", "content": "q"}, "has prompt {'role': 'user', 'content': 'q'};"),
    ([{"role": "user", "content": "q"}, {"role": "user"}], "has prompt message 1: {'role': 'user'};"),
    ([{"role": "user", "content": None}], "has prompt message 0: {'role': 'user', 'content': None};"),
    (["q"], "has prompt message 0: 'q';")])
def test_every_prompt_is_a_string_or_a_list_of_messages_checked_at_load(tmp_path, capsys, prompt, needle):
    rows = [{"prompt": "fine"}, {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows + [{"prompt": prompt}]) + "\n")
    err = toy_error(capsys, tmp_path, f"eval_dataset={tmp_path}/d.jsonl")
    assert f"dataset '{tmp_path}/d.jsonl', line 3: row 2 {needle} a prompt must be a non-empty string" in err, err
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows + [{"answer": 1}]) + "\n")
    err = toy_error(capsys, tmp_path, f"dataset={tmp_path}/d.jsonl")
    assert "line 3: row 2 is {'answer': 1}, not an object with a 'prompt' column" in err, err
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert M.load_rows(str(tmp_path / "d.jsonl")) == rows


# --- tools and reward functions that could only fail later ---------------------------------------------

PLUGINS = """
async def lookup(key: str) -> str:
    return key

class Tool:
    __name__ = "tool"
    async def __call__(self, key: str) -> str:
        return key

tool = Tool()
NOT_A_FUNCTION = "lookup"

async def reward(completions, **kw):
    return [1.0] * len(completions)

def stream(completions, **kw):
    yield 1.0
"""


@pytest.mark.parametrize("override,needle", [
    ("tools=[tools/kv_lookup.py:lookup, {p}:lookup]",
     "tool '{p}:lookup' is an async def or a generator, not a function that returns its result; write it as a plain"),
    ("tools=[{p}:tool]", "tool '{p}:tool' is an async def or a generator"),
    ("tools=[{p}:NOT_A_FUNCTION]", "tool '{p}:NOT_A_FUNCTION' is a str, not a function"),
    ("outcome_reward_funcs=[{p}:reward]", "reward function '{p}:reward' is an async def or a generator"),
    ("turn_reward_funcs=[{p}:stream]", "reward function '{p}:stream' is an async def or a generator"),
    ("tools=[tools/kv_lookup.py:lookup, {d}/other.py:lookup]",
     "tools 'tools/kv_lookup.py:lookup' and '{d}/other.py:lookup' are both named 'lookup'; rename one"),
])
def test_tools_and_rewards_that_could_only_fail_later_fail_at_load(tmp_path, capsys, override, needle):
    (tmp_path / "plugins.py").write_text(PLUGINS)
    (tmp_path / "other.py").write_text("def lookup(key: str) -> str:\n    return 'other'\n")
    fmt = dict(p=tmp_path / "plugins.py", d=tmp_path)
    err = toy_error(capsys, tmp_path, override.format(**fmt))
    assert needle.format(**fmt) in err, err


# --- the model path ---------------------------------------------------------------------------------

def test_a_model_that_cannot_be_loaded_is_one_line_saying_what_was_tried(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)   # no network: only the local cache
    for path in ("./models/none-here", f"{tmp_path}/no/such/model"):
        err = toy_error(capsys, tmp_path, f"model_name_or_path={path}")
        assert f"model_name_or_path '{path}' does not exist (no such folder); set it to a model folder" in err, err
    err = toy_error(capsys, tmp_path, "model_name_or_path=mt-grpo-tests/no-such-model")
    assert "AutoTokenizer cannot load 'mt-grpo-tests/no-such-model' as a hub id (no such folder): We couldn" in err
    (tmp_path / "empty").mkdir()
    err = toy_error(capsys, tmp_path, f"model_name_or_path={tmp_path}/empty")
    assert f"cannot load '{tmp_path}/empty' from that folder:" in err and "saved by save_pretrained" in err, err


# --- 5, 6, 8. recipes ------------------------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("temperature=0", "temperature must be in (0, 2], got 0"), ("temperature=-1", "temperature must be in (0, 2]"),
    ("epsilon=-0.1", "epsilon must be in [0, 1], got -0.1"), ("max_steps=-1", "max_steps must be >= 1, got -1"),
    ("top_p=0", "top_p must be in (0, 1], got 0"), ("prompts_per_step=0", "prompts_per_step must be >= 1, got 0"),
    ("learning_rate=nan", "learning_rate must be > 0, got 'nan'"), ("learning_rate=inf", "learning_rate must be > 0"),
    ("adam_betas=[0.9, 1.0]", "adam_betas must be in [0, 1)"), ("vllm_gpu_memory_utilization=1.5", "must be in (0, 1]")])
def test_values_out_of_range_fail_before_anything_runs(tmp_path, override, message):
    r = cli(TOY, override, f"output_dir={tmp_path}/run")
    one_line_error(r, message)
    assert not (tmp_path / "run").exists(), "nothing was written: not even config.yaml"


def test_every_numeric_key_has_its_range_and_help_shows_it():
    import dataclasses
    import typing
    ranges, hints = M.field_ranges(), typing.get_type_hints(M.Config)
    numeric = [f.name for f in dataclasses.fields(M.Config) if hints[f.name] in (int, float, list[float])]
    assert sorted(ranges) == sorted(numeric)
    for f in dataclasses.fields(M.Config):   # every default is inside its own range
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert f.name not in ranges or all(M.in_range(x, ranges[f.name]) for x in np.atleast_1d(default)), f.name
    h = cli("--help")
    assert "temperature (float, default 1.0, range (0, 2])" in h.stdout


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(open(TOY).read() + "learning_rate: 1.0e-2\n")
    first = next(i for i, x in enumerate(open(TOY).read().splitlines()) if x.startswith("learning_rate:")) + 1
    last = len(recipe.read_text().splitlines())
    with pytest.raises(M.ConfigError, match=f"recipe key 'learning_rate' is set twice, on lines {first} and {last} of {recipe}"):
        M.load_config(str(recipe))


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path, tiny_model_dir):
    (tmp_path / "a_file").write_text("")
    r = cli(TOY, f"model_name_or_path={tiny_model_dir}", "model_builder=", f"output_dir={tmp_path}/a_file/run")
    one_line_error(r, f"cannot write the run folder '{tmp_path}/a_file/run'", "set output_dir to a folder you can write to")


# --- "Also": what reward functions may return --------------------------------------------------------

def test_rewards_must_be_real_numbers(tmp_path):
    eps = [M.new_episode({"prompt": "q"}, "") for _ in range(4)]
    ok = lambda completions, **_: [1, 0.5, np.float32(0.25), torch.tensor(True)]
    assert M.score(eps, [ok], [1.0]) == [1.0, 0.5, 0.25, 1.0]
    assert M.score(eps, [lambda completions, **_: [np.bool_(True), np.int64(2), False, 3]], [1.0]) == [1.0, 2.0, 0.0, 3.0]
    for junk in ("1.0", None, torch.tensor([1.0, 2.0]), [1.0]):
        with pytest.raises(M.RewardError, match="not a number but a"):
            M.score(eps, [lambda completions, **_: [junk] * 4], [1.0])


# --- a working folder that moves, plug-ins that edit what they are given, reward functions that never return ---

def test_a_tool_that_changes_the_working_folder_moves_no_run_file(tmp_path, tiny_model_dir, monkeypatch):
    """Every path the run writes later is made absolute at set-up: a relative output_dir stays where it was."""
    from test_env import tool_call
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    (tmp_path / "cd.py").write_text(f'import os\n\ndef lookup(key: str) -> str:\n    """Look up, then move away."""\n'
                                    f'    os.chdir({str(elsewhere)!r})\n    return "v"\n')
    cfg = recipe_cfg(tmp_path, f"model_name_or_path={tiny_model_dir}", "model_builder=", "max_steps=2",
                     f"tools=[{tmp_path}/cd.py:lookup]", "prompts_per_step=2", "num_generations=2", "log_episodes_steps=1")
    script = [tool_call("a"), "<answer>v</answer>"]
    monkeypatch.setattr(M, "LocalSampler", lambda model, tok: ScriptedSampler(tok, script))
    monkeypatch.chdir(home)                          # restored at teardown
    cfg.output_dir = "run"
    history = M.train(cfg)
    assert os.getcwd() == str(elsewhere) and all(h["rollout/tool_calls"] > 0 for h in history), "the tool moved us"
    run = home / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert {json.loads(x)["step"] for x in (run / "episodes.jsonl").read_text().splitlines()} == {1, 2}
    assert (run / "checkpoint-2" / "trainer_state.pt").is_file() and not (elsewhere / "run").exists()
    assert not (home / "run.lock").exists(), "the lock was found again and removed"
    assert M.load_config(str(run / "config.yaml")).output_dir == str(run), "config.yaml records the folder used"


def test_the_server_log_is_found_after_the_working_folder_moved(tiny_model_dir, tmp_path, monkeypatch):
    from tests.vllm_standin import StandinServer
    (tmp_path / "vllm.log").write_text("the engine died: out of memory\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MTGRPO_VLLM_LOG", "vllm.log")   # run.sh's default is relative, too
    with StandinServer(tiny_model_dir) as srv:
        client = M.VLLMServerClient(M.load_config(None, [f"vllm_server_url={srv.url}", "server_dead_timeout=0.01",
                                                         f"output_dir={tmp_path}/run"]), srv.vocab_size)
    os.chdir(tmp_path.parent)
    client.check_alive(OSError("refused"))           # the server is gone: from now on it is down
    time.sleep(0.05)
    with pytest.raises(M.SamplerError, match="has not been healthy") as e:
        client.check_alive(OSError("refused"))
    assert f"Last lines of the server's log ({tmp_path}/vllm.log):\nthe engine died" in str(e.value)


def test_a_reward_function_that_edits_what_it_is_given_changes_nothing_else():
    row = {"prompt": "q", "answer": "v", "aliases": ["v", "w"]}
    eps = [M.new_episode(row, "") for _ in range(2)]    # a group's episodes share their dataset row, as in training
    for ep in eps:
        ep.messages.append({"role": "assistant", "content": "<answer>v</answer>"})
    before, seen = copy.deepcopy([(ep.messages, ep.row) for ep in eps]), []

    def vandal(completions, answer, aliases, **columns):
        completions[0][0]["content"] = "edited"
        completions[1].append({"role": "user", "content": "added"})
        answer[0], columns["prompt"][1] = "x", "y"
        aliases[0].append("z")
        return [0.0, 0.0]

    def witness(completions, **columns):
        seen.append((completions, columns))
        return [1.0, 1.0]

    assert M.score(eps, [vandal, witness], [1.0, 1.0]) == [1.0, 1.0]
    assert [(ep.messages, ep.row) for ep in eps] == before, "what episodes.jsonl records is what was sampled"
    done = [{"role": "assistant", "content": "<answer>v</answer>"}]
    assert seen == [([done, done], {"prompt": ["q", "q"], "answer": ["v", "v"], "aliases": [["v", "w"], ["v", "w"]]})]


@pytest.mark.skipif(not os.path.isdir(FIX), reason="needs ../shared/fixtures (the real Qwen3 tokenizer)")
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


def test_a_reward_function_that_never_returns_stops_the_run_in_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """Bounded by reward_timeout at start-up (check_rewards scores two episodes) and in the loop (four)."""
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import os\nimport threading\n\nrelease = threading.Event()\n\n\ndef stuck(completions, **_):\n"
                     "    if len(completions) > int(os.environ['STUCK_ABOVE']):\n        release.wait()\n"
                     "    return [0.0] * len(completions)\n")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}   # a failed train() keeps its own
    try:
        for above, model in (("0", tmp_path / "never_built"), ("2", tiny_model_dir)):
            monkeypatch.setenv("STUCK_ABOVE", above)
            t = time.time()
            with pytest.raises(SystemExit):
                M.main([TOY, f"output_dir={tmp_path}/run{above}", f"outcome_reward_funcs=[{stuck}:stuck]",
                        "reward_timeout=1", f"model_name_or_path={model}", "model_builder=", "prompts_per_step=2",
                        "num_generations=2", "max_tokens=8"])
            err = capsys.readouterr().err
            assert [x for x in err.splitlines() if x.startswith("mt-grpo: error")] == [
                f"mt-grpo: error: reward function 'stuck' ({stuck}) did not return within reward_timeout=1.0s; "
                "saved checkpoints are unaffected"] and "Traceback" not in err and time.time() - t < 30, err
        assert not (tmp_path / "never_built").exists(), "at start-up: before any model work"
    finally:
        M.load_object(f"{stuck}:release").set()
        for s, h in handlers.items():
            signal.signal(s, h)
