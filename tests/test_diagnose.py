"""The run says why it is not learning: per-tool call shares and the tool-error rate as metrics, a tool-choice
collapse alarm, and at the end one block of reasons (only those that hold) with pointers into episodes.jsonl."""

import json
import os

import pytest

import mt_grpo_trainer as M
from conftest import recipe_cfg, small_run_args


def episode(tools: list[str], group: int = 0, advantage: float = 0.0) -> M.Episode:
    """An episode that called `tools` (one turn each) and then answered."""
    ep = M.Episode(row={}, messages=[], n_prompt_messages=0, end_reason="answer", group=group)
    ep.turns = [M.Turn(0, 1) for _ in range(len(tools) + 1)]
    ep.tool_calls = len(tools)
    ep.tool_names = list(tools)
    ep.advantages = [advantage] * len(ep.turns)
    return ep


def test_each_call_is_counted_to_its_tool_and_errors_are_a_share_of_the_calls():
    def add(a: int) -> str:
        """Adds."""
        return "1"

    def sub(a: int) -> str:
        """Subtracts."""
        raise ValueError("no")

    env = M.MultiTurnToolEnv(None, [add, sub], M.Config())
    eps = [env.new_episode({"prompt": "q"}) for _ in range(5)]
    calls = [
        {"name": "add", "args": {"a": 1}},
        {"name": "add", "args": {"a": 2}},
        {"name": "sub", "args": {"a": 1}},  # runs, and raises: a named call and an error
        {"name": "mul", "args": {"a": 1}},  # an unknown tool: an error, no tool's share
        json.JSONDecodeError("Expecting value", "{", 1),  # bad JSON: an error, no tool's share
    ]
    env.run_tools(list(zip(eps, calls)))
    assert [ep.tool_names for ep in eps] == [["add"], ["add"], ["sub"], [], []]
    m = M.rollout_metrics(eps)
    assert m["rollout/tool_error_rate"] == 3 / 5
    assert (m["rollout/tool_share_add"], m["rollout/tool_share_sub"]) == (2 / 3, 1 / 3)
    assert "rollout/tool_share_mul" not in m
    assert M.rollout_metrics([episode([])])["rollout/tool_error_rate"] == 0.0, "no call, no error rate to divide"


def test_groups_without_spread_are_the_share_whose_every_advantage_is_zero():
    eps = [episode(["a"], 0, 0.0), episode(["a"], 0, 0.0), episode(["a"], 1, 0.5), episode(["a"], 1, 0.0)]
    eps += [episode(["a"], 2, 0.0), episode(["a"], 2, 0.0)]
    assert M.episode_metrics(eps)["adv/groups_without_spread"] == pytest.approx(2 / 3)


def log_steps(logger, steps: list[list[str]], episodes: int = 8):
    """Log one step per entry: `episodes` episodes a step, each calling the tool named in turn from the entry."""
    for step, names in enumerate(steps, 1):
        eps = [episode([names[i % len(names)]]) for i in range(episodes)]
        logger.log(step, {**M.episode_metrics(eps), "rollout/rejected_nonfinite": 0, "time/step": 0.1}, eps, {})


@pytest.mark.parametrize("tools", [2, 1])
def test_one_tool_taking_the_calls_of_several_warns_once(tmp_path, tools):
    cfg = recipe_cfg(tmp_path, "tool_collapse_alarm=0.5", "tool_collapse_steps=5")
    cfg.tools = ["calc.py:miles_to_km", "calc.py:km_to_miles"][:tools]
    os.makedirs(cfg.output_dir)
    lines = []
    logger = M.MetricsLogger(cfg, 0, 1, 0, write=lines.append)
    log_steps(logger, [["miles_to_km", "km_to_miles"]] * 10 + [["miles_to_km"]] * 10)
    warnings = [x for x in lines if "tool-choice collapse" in x]
    logged = [json.loads(x) for x in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    assert logged[0]["rollout/tool_share_miles_to_km"] == 0.5 and logged[-1]["rollout/tool_share_miles_to_km"] == 1.0
    if tools == 1:  # one tool takes every call by necessity
        assert warnings == [] and not any(r["alarm/tool_choice_collapse"] for r in logged)
        return
    # the others' 5-step mean share falls below 0.5 x its peak 0.5 at step 13: (2 x 0.5 + 3 x 0) / 5 = 0.2
    assert len(warnings) == 1 and "at step 13" in warnings[0] and "miles_to_km 1.00" in warnings[0], lines
    assert [r["step"] for r in logged if r["alarm/tool_choice_collapse"]] == list(range(13, 21))
    assert not [x for x in lines if "tool-use collapse" in x], "the call rate did not move"


def healthy_steps(n: int = 20) -> list[dict]:
    """A run that learns: the outcome follows the turn reward, groups spread, few tool errors, both tools used."""
    steps = []
    for step in range(1, n + 1):
        steps.append(
            {
                "step": step,
                "reward/outcome": step / n,
                "reward/turn": step / n,
                "reward/lookup_hit_reward": step / n,
                "reward/exact_answer_reward": step / n,
                "rollout/tool_calls": 1.0,
                "rollout/tool_error_rate": 0.02,
                "rollout/tool_share_miles_to_km": 0.6,
                "rollout/tool_share_km_to_miles": 0.4,
                "adv/groups_without_spread": 0.2,
                "time/step": 0.1,
            }
        )
    return steps


SICK = {
    "no spread": ({"adv/groups_without_spread": 0.8}, "80% of the groups had no reward spread"),
    "tool errors": ({"rollout/tool_error_rate": 0.35}, "tool errors: 35% of the calls (1.00 calls an episode)"),
    "tool choice": (
        {"rollout/tool_share_miles_to_km": 0.97, "rollout/tool_share_km_to_miles": 0.03},
        "one of the 2 tools takes nearly every call: miles_to_km 0.97, km_to_miles 0.03",
    ),
    "turn without outcome": ({"reward/outcome": 0.05}, "the turn reward rose 0.275 -> 0.775 while the outcome did not"),
}


@pytest.mark.parametrize("sickness", [None, *SICK])
def test_the_summary_says_why_a_run_is_not_learning_once_and_only_what_holds(tmp_path, capsys, sickness):
    cfg = recipe_cfg(tmp_path)
    cfg.tools = ["calc.py:miles_to_km", "calc.py:km_to_miles"]
    steps = healthy_steps()
    if sickness:
        change, _ = SICK[sickness]
        for h in steps:
            h.update(change)
    failing = ["step 20 episode 5 (outcome 0.00, tool Error: JSONDecodeError: Expecting value)"]
    M.summarize(cfg, steps, failing)
    out = capsys.readouterr().out
    # the table carries each reward function's mean and the tool-error rate, first vs last
    assert "reward/lookup_hit_reward" in out and "reward/exact_answer_reward" in out
    assert "rollout/tool_error_rate" in out
    if sickness is None:
        assert "why it may not be learning" not in out and "where to look" not in out, out
        return
    assert out.count("why it may not be learning") == 1, out
    block = out.split("why it may not be learning")[1]
    for name, (_, line) in SICK.items():
        assert (line in block) == (name == sickness), (name, out)
    where = os.path.join(cfg.output_dir, "episodes.jsonl")
    assert f"where to look, in {where}: {failing[0]}" in block


def test_failing_episodes_point_at_the_lowest_outcomes_and_their_first_tool_error():
    def record(i: int, outcome: float, errors: int, messages: list[dict]) -> dict:
        ep = M.Episode(row={}, messages=messages, n_prompt_messages=1, end_reason="answer", tool_errors=errors)
        ep.outcome_reward = outcome
        return M.episode_record(7, i, 0, ep)

    prompt = {"role": "system", "content": "Error: in a prompt is no tool error"}
    call = {"role": "assistant", "content": "<tool>{</tool>"}
    error = {"role": "user", "content": "<result>\nError: JSONDecodeError: Expecting value\n</result>"}
    records = [
        record(0, 1.0, 0, [prompt, call]),
        record(1, 0.0, 0, [prompt, call]),
        record(2, 0.0, 1, [prompt, call, error]),
        record(3, 0.5, 0, [prompt, call]),
    ]
    assert M.failing_episodes(records, 2) == [
        "step 7 episode 2 (outcome 0.00, tool Error: JSONDecodeError: Expecting value)",
        "step 7 episode 1 (outcome 0.00, ended: answer)",
    ]


def test_a_run_that_cannot_learn_says_why_at_its_end_and_where_to_look(tiny_model_dir, tmp_path, capsys):
    """A random model earns no reward: every group is without spread, and the end of the run says so, once, with
    the step and episode numbers of episodes it wrote to episodes.jsonl."""
    args = small_run_args(tiny_model_dir, tmp_path / "run", save_steps=0)
    cfg = M.load_config(M.os.path.join(M.HERE, "hf_recipes/toy/toy-kv--mt-grpo.yaml"), [*args, "max_steps=4"])
    cfg.log_episodes_steps = 2
    M.train(cfg)
    out = capsys.readouterr().out
    assert out.count("why it may not be learning (the last 2 steps against the first)") == 1, out
    assert "100% of the groups had no reward spread" in out
    pointers = out.split("where to look, in ")[1].splitlines()[0]
    dumped = {(r["step"], r["episode"]) for r in map(json.loads, open(tmp_path / "run" / "episodes.jsonl"))}
    assert pointers.count("step 4 episode") == 3, pointers
    for part in pointers.split("; "):
        step, episode = part.split(" (")[0].removeprefix(f"{tmp_path / 'run' / 'episodes.jsonl'}: ").split()[1::2]
        assert (int(step), int(episode)) in dumped
