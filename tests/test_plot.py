"""A picture of a run: curves.png at a run's end, `plot` for several runs on one picture, and the end-of-run summary
of a short run."""

import json

import pytest

import mt_grpo_trainer as M
from conftest import recipe_cfg

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(folder, steps: int, slope: float, eval_every: int = 0):
    """A run's metrics.jsonl, as the trainer writes it: with evaluation, a row of step 0 (the model before training)."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        if eval_every:
            f.write(json.dumps({"step": 0, "eval/exact_answer_reward": 0.0, "time/eval": 0.1}) + "\n")
        for step in range(1, steps + 1):
            m = {"step": step, "reward/outcome": slope * step / steps, "reward/turn": 0.5, "time/step": 0.1}
            m.update({"rollout/tool_calls": 1.0, "loss/policy": 0.01 * (-1) ** step})
            if eval_every and step % eval_every == 0:
                m["eval/exact_answer_reward"] = slope * step / steps
            f.write(json.dumps(m) + "\n")
        f.write('{"step": ')  # a torn last line, as a run killed mid-write leaves


def test_plot_draws_several_runs_on_one_picture(tmp_path, capsys):
    write_run(tmp_path / "runs" / "toy--mt_grpo", 30, 1.0, eval_every=10)
    write_run(tmp_path / "runs" / "toy--advantage_mode=grpo_outcome", 30, 0.5, eval_every=10)
    out = tmp_path / "ablation.png"
    with pytest.raises(SystemExit) as done:
        M.main(
            [
                "plot",
                str(tmp_path / "runs" / "toy--mt_grpo"),
                str(tmp_path / "runs" / "toy--advantage_mode=grpo_outcome"),
                "--out",
                str(out),
            ]
        )
    assert done.value.code == 0 and out.read_bytes().startswith(PNG)
    assert str(out) in capsys.readouterr().out


def test_plot_of_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        M.main(["plot", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert (
        done.value.code == 1
        and err == f"plot: error: {tmp_path / 'nope'} is not a run folder: no metrics.jsonl in it\n"
    )


def test_a_short_runs_summary_compares_its_first_and_last_steps_and_draws_its_curves(tmp_path, capsys):
    cfg = recipe_cfg(tmp_path)
    write_run(tmp_path / "run", 3, 1.0)
    history = json.loads("[" + ",".join((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[:3]) + "]")
    M.summarize(cfg, history)
    out = capsys.readouterr().out
    assert "before/after: step 1 -> step 3" in out and "reward/outcome         0.333 -> 1.000" in out, out
    assert (
        f"run files in {cfg.output_dir}: config.yaml, metrics.jsonl, episodes.jsonl, checkpoint-*/, curves.png" in out
    )
    assert (tmp_path / "run" / "curves.png").read_bytes().startswith(PNG)


def test_the_eval_panels_start_at_step_0_and_the_summary_compares_it_with_the_last_eval(tmp_path, capsys, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # plot() closes its figure: kept here, to read what was drawn
    cfg = recipe_cfg(tmp_path)
    write_run(tmp_path / "run", 4, 1.0, eval_every=2)
    history = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[:5]]
    M.summarize(cfg, history)
    out = capsys.readouterr().out
    assert "before/after: step 1, then 2-step means" in out and "reward/outcome         0.250 | 0.375 -> 0.875" in out
    assert "eval/exact_answer_reward 0.000 (step 0) -> 1.000 (step 4)" in out and "(step 2)" not in out, out
    assert (tmp_path / "run" / "curves.png").read_bytes().startswith(PNG)
    panels = {ax.get_title(): ax for ax in figures[0].axes}
    assert list(panels["eval: exact_answer_reward"].lines[0].get_xdata()) == [0, 2, 4]
    assert list(panels["outcome reward"].lines[0].get_xdata()) == [1, 2, 3, 4], "trained steps only"


@pytest.mark.parametrize("top", [0.969, 2.0])
def test_an_eval_rate_is_drawn_on_its_whole_range_and_another_metric_on_its_own(tmp_path, monkeypatch, top):
    """Greedy held-out exact answers of 0.945 then 0.969, auto-scaled, fill the panel like a leap from 0 to 1: a metric
    whose values all lie in [0, 1] gets the axis 0-1; one that leaves it (a reward summed over turns) keeps its own."""
    import matplotlib.pyplot as plt

    from plot import plot

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    write_run(tmp_path / "run", 4, 1.0, eval_every=2)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # after the torn line: the reader skips that one only
        f.write("\n" + json.dumps({"step": 2, "eval/greedy_exact_answer_reward": 0.945}) + "\n")
        f.write(json.dumps({"step": 4, "eval/greedy_exact_answer_reward": top}) + "\n")
    plot([str(tmp_path / "run")], str(tmp_path / "curves.png"))
    panels = {ax.get_title(): ax for ax in figures[0].axes}
    greedy = panels["eval: greedy_exact_answer_reward"].get_ylim()
    assert (greedy == (0, 1)) == (top <= 1), greedy
    assert panels["eval: exact_answer_reward"].get_ylim() == (0, 1)
    assert panels["turn reward"].get_ylim() != (0, 1), "training panels keep their own scale"
