"""The tool-use collapse alarm: per-turn tool-call rates, and one warning when the first turn's rate collapses."""

import json
import os

import mt_grpo_trainer as M
from conftest import recipe_cfg


def episode(turns: int, end_reason: str) -> M.Episode:
    ep = M.Episode(row={}, messages=[], n_prompt_messages=0, end_reason=end_reason)
    ep.turns = [M.Turn(0, 1) for _ in range(turns)]
    return ep


def test_tool_rate_per_turn_index_counts_the_turns_that_called_a_tool():
    eps = [
        episode(1, "answer"),  # answered at once: no call
        episode(2, "answer"),  # a call, then the answer
        episode(2, "max_env_steps"),  # a call, then a second one the limit did not run: it still called
        episode(1, "truncated"),
    ]  # a call cut by max_tokens is no call
    m = M.rollout_metrics(eps)
    assert (m["rollout/tool_rate_turn0"], m["rollout/tool_rate_turn1"]) == (0.5, 0.25)
    assert "rollout/tool_rate_turn2" not in m
    assert "rollout/tool_rate_turn0" not in M.rollout_metrics([episode(1, "answer")])


def test_an_episode_that_ran_out_of_context_after_a_call_still_called():
    """Turn 0 called a tool, then the next prompt left no room to sample: that turn called; no turn at all did not."""
    m = M.rollout_metrics([episode(1, "context"), episode(0, "context")])
    assert m["rollout/tool_rate_turn0"] == 0.5 and "rollout/tool_rate_turn1" not in m


def test_the_alarm_warns_once_when_the_first_turns_tool_rate_collapses_and_the_run_goes_on(tmp_path):
    cfg = recipe_cfg(tmp_path, "tool_collapse_alarm=0.5", "tool_collapse_steps=5")
    os.makedirs(cfg.output_dir)
    lines = []
    logger = M.MetricsLogger(cfg, 0, 1, 0, write=lines.append)
    # 8 episodes a step: 6 call the tool first for 10 steps, then 1 for 10 steps, then 6 again
    rates = [6] * 10 + [1] * 10 + [6] * 10
    for step, callers in enumerate(rates, 1):
        eps = [episode(2 if i < callers else 1, "answer") for i in range(8)]
        logger.log(step, {**M.episode_metrics(eps), "rollout/rejected_nonfinite": 0, "time/step": 0.1}, eps, {})
    warnings = [x for x in lines if "tool-use collapse" in x]
    # the 5-step mean falls below 0.5 x 0.75 at step 14: (0.75 + 4 x 0.125) / 5 = 0.25
    assert len(warnings) == 1 and "at step 14" in warnings[0] and "0.25" in warnings[0] and "0.75" in warnings[0]
    logged = [json.loads(x) for x in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    assert [r["step"] for r in logged] == list(range(1, 31)), "the alarm never stops the run"
    on = [r["step"] for r in logged if r["alarm/tool_collapse"]]
    assert on[0] == 14 and on == list(range(14, on[-1] + 1)) and on[-1] < 30, "on while collapsed, off once recovered"


def test_the_alarm_is_off_at_zero_and_a_steady_low_rate_is_no_collapse():
    off, steady = M.ToolCollapseAlarm(0.0, 3), M.ToolCollapseAlarm(0.5, 3)
    assert not any(off.update(s, r) for s, r in enumerate([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]))
    assert not any(steady.update(s, 0.1) for s in range(20)) and not steady.on


def test_a_tool_rate_that_never_rose_is_no_collapse():
    """A policy that called its tool once in 300 first turns and then never: a peak of 0.00 has nothing to lose."""
    alarm = M.ToolCollapseAlarm(0.5, 3)
    rates = [0.0, 0.01, 0.0] + [0.0] * 20
    assert not any(alarm.update(s, r) for s, r in enumerate(rates)) and not alarm.on


def test_a_step_where_no_group_has_reward_spread_is_explained_once(tmp_path):
    """A new task whose model never earns a reward: every advantage is 0, so the run says why nothing is learned, and
    what to try, once; a step with spread says nothing."""
    cfg = recipe_cfg(tmp_path)
    os.makedirs(cfg.output_dir)
    lines = []
    logger = M.MetricsLogger(cfg, 0, 1, 0, write=lines.append)
    for step in (1, 2, 3):
        eps = [episode(1, "answer") for _ in range(4)]
        for ep in eps:
            ep.advantages = [0.0]
        logger.log(step, {**M.episode_metrics(eps), "rollout/rejected_nonfinite": 0, "time/step": 0.1}, eps, {})
    notes = [x for x in lines if "no gradient" in x]
    assert len(notes) == 1 and "at step 1" in notes[0], lines
    assert all(w in notes[0] for w in ("few-shot", "warm start", "partial credit", "call the tool"))
    lines.clear()
    logger = M.MetricsLogger(cfg, 0, 1, 0, write=lines.append)
    eps = [episode(1, "answer") for _ in range(4)]
    for ep, a in zip(eps, (1.0, -1.0, 1.0, -1.0)):
        ep.advantages = [a]
    logger.log(1, {**M.episode_metrics(eps), "rollout/rejected_nonfinite": 0, "time/step": 0.1}, eps, {})
    assert not [x for x in lines if "no gradient" in x]
