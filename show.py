"""`show`: a run's episodes as a reader wants them, and `report.html`, the run on one page.

    python mt_grpo_trainer.py show RUN_DIR [--step N] [--worst | --best] [-n N] [--full] [--html]
    (or: bash run.sh show ...)

It reads RUN_DIR/episodes.jsonl, written every `log_episodes_steps` steps. Each episode: its rewards (per function,
and the group's mean outcome beside its own), its prompt, then each assistant turn with its advantage, turn reward,
sampled text, tool call, and the result it got; between turns, the boundary: the sample extends, a FORK (the chat
template rewrote the history: a new sample starts) or a REALIGN (the last turn's tail became context).
Without --step it shows the last logged step, or with --worst/--best every logged step, ordered by outcome reward
(then turn reward). Prompts and results are cut at 400 characters but with --full.

`--html` writes RUN_DIR/report.html, as every run does at its end (beside curves.png): the curves, the eval table by
step, and a few episodes per eval point (the worst, the median, the best) with each token shaded by its advantage
(green above 0, red below) and the masked tokens (prompt, template, tool results) grey. One self-contained file: its
CSS inline, the picture embedded. Tokens are decoded with the run's tokenizer (config.yaml's model_name_or_path, or a
checkpoint's); where none loads, each turn's text is shaded whole.
"""

import argparse
import base64
import functools
import glob
import html
import json
import os
import re
import statistics
import sys

import yaml

CUT = 400  # characters of a prompt or result message shown without --full
POINTS = 6  # eval points in report.html, at most
PER_POINT = 3  # episodes a point: the worst, the median, the best
CONTEXT_RUN = 240  # masked tokens in a row in report.html beyond which the middle is left out
TOKENS = 1500  # sampled tokens shown for an episode in report.html, at most


class ShowError(ValueError):
    """A run folder that cannot be shown: one line."""


STEP = re.compile(r'\{"step": (-?\d+)')  # how the trainer starts every line it writes: a line's step, unparsed


def read_jsonl(path: str, steps=None) -> list[dict]:
    """A file's JSON lines, or only those of `steps` (a set: the others are not parsed, which is most of a long run's
    episodes.jsonl); a torn last line, from a run killed mid-write, is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            hit = STEP.match(line)
            if steps is not None and hit and int(hit.group(1)) not in steps:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def logged_steps(path: str) -> list[int]:
    """The steps episodes.jsonl holds episodes of, read from the start of each line."""
    with open(path) as f:
        return sorted({int(hit.group(1)) for hit in map(STEP.match, f) if hit})


def episodes_file(run_dir: str) -> str:
    """RUN_DIR/episodes.jsonl, or one line that says why there is none."""
    if not os.path.isdir(run_dir):
        raise ShowError(f"{run_dir} is not a run folder: there is no such folder")
    path = os.path.join(run_dir, "episodes.jsonl")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
            raise ShowError(
                f"{run_dir} has no episodes.jsonl: the run logged none (log_episodes_steps: 0); "
                "train with log_episodes_steps=N to record every Nth step's episodes"
            )
        raise ShowError(f"{run_dir} is not a run folder: no episodes.jsonl or metrics.jsonl in it")
    return path


def outcome_order(ep: dict) -> tuple:
    return ep["outcome_reward"], ep["turn_reward"]


def select(path: str, step: int | None, order: str | None, n: int) -> tuple[list[dict], list[dict], str]:
    """The episodes to show, every episode of their steps (for their groups), and a line that says which."""
    steps = logged_steps(path)
    if not steps:
        raise ShowError(f"{path} holds no episode yet")
    if step is not None and step not in steps:
        raise ShowError(f"step {step} was not logged: episodes.jsonl holds steps {', '.join(map(str, steps))}")
    if step is None and not order:
        step = steps[-1]
    where = f"step {step}"
    wanted = {step}
    if step is None:
        where = "every logged step"
        wanted = set(steps)
    episodes = read_jsonl(path, wanted)
    pool = episodes
    how = "in logged order"
    if order == "worst":
        pool = sorted(pool, key=outcome_order)
        how = "worst first (outcome, then turn reward)"
    if order == "best":
        pool = sorted(pool, key=outcome_order, reverse=True)
        how = "best first (outcome, then turn reward)"
    logged = ", ".join(map(str, steps))
    if len(steps) > 8:
        logged = ", ".join(map(str, steps[:3])) + ", ..., " + ", ".join(map(str, steps[-3:]))
    line = (
        f"episodes logged at steps {logged}; showing {min(n, len(pool))} of {len(pool)} from {where}, {how} "
        "(--step N, --worst, --best, -n N, --full)"
    )
    return pool[:n], episodes, line


# --- one episode: its turns, found in its messages and its samples' token lists


def turns_of(ep: dict) -> tuple[list[dict], list[dict]]:
    """The prompt messages, and per sampled turn: its index, its message, the messages the environment added after it,
    the sample that holds it, and how many of its tokens the samples hold and train. The sampled turns are the last
    assistant messages, one per advantage (a few-shot prompt may hold assistant messages of its own)."""
    messages = ep["messages"]
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    sampled = assistant[len(assistant) - len(ep["advantages"]) :]
    first = len(messages)
    if sampled:
        first = sampled[0]
    turns = []
    for t, i in enumerate(sampled):
        end = len(messages)
        if t + 1 < len(sampled):
            end = sampled[t + 1]
        turn = {"index": t, "message": messages[i], "after": messages[i + 1 : end], "sample": None}
        turns.append({**turn, "held_tokens": 0, "trained_tokens": 0})
    for k, s in enumerate(ep["samples"]):
        for t, mask in zip(s["turn_idx"], s["loss_mask"]):
            if 0 <= t < len(turns):
                turns[t]["held_tokens"] += 1
                turns[t]["trained_tokens"] += mask
                if turns[t]["sample"] is None:
                    turns[t]["sample"] = k
    return messages[:first], turns


def sample_of(turns: list[dict], t: int) -> int | None:
    """The sample that holds turn t's tokens (None: no such turn, or it sampled none)."""
    if 0 <= t < len(turns):
        return turns[t]["sample"]
    return None


def boundary_kind(b: dict, turns: list[dict]) -> str:
    """extends | REALIGN | FORK: a REALIGN keeps the sample, a fork starts a new one."""
    if b["extends"]:
        return "extends"
    t = b["turn"]
    if b.get("realigned"):
        return "REALIGN"
    if sample_of(turns, t) is not None and sample_of(turns, t) == sample_of(turns, t - 1):
        return "REALIGN"
    return "FORK"


def boundary_line(b: dict, turns: list[dict]) -> str:
    t = b["turn"]
    what = "a tool result"
    if b["kind"] == "user":
        what = "a user message"
    kind = boundary_kind(b, turns)
    if kind == "extends":
        return f"turn {t} after {what}: the sample extends"
    if kind == "REALIGN":
        return (
            f"REALIGN before turn {t} (after {what}): the fresh rendering changed turn {t - 1}'s tail; "
            f"{b.get('realigned', 0)} of its sampled tokens became context"
        )
    sample = "a new sample starts"
    if sample_of(turns, t) is not None:
        sample = f"sample {sample_of(turns, t) + 1} starts"
    return f"FORK before turn {t} (after {what}): the chat template rewrote the history; {sample}"


def tool_calls_in(message: dict) -> list[str]:
    """The calls a turn made, as `name {arguments}`: the message's tool_calls (native), or <tool>/<tool_call> JSON."""
    calls = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", c)
        calls.append(f"{f.get('name')} {json.dumps(f.get('arguments', {}))}")
    content = message.get("content") or ""
    for tag in ("tool", "tool_call"):
        start = f"<{tag}>"
        for piece in content.split(start)[1:]:
            if f"</{tag}>" not in piece:
                continue
            payload = piece.split(f"</{tag}>")[0].strip()
            try:
                call = json.loads(payload)
                args = call.get("args", call.get("arguments", {}))
                calls.append(f"{call['name']} {json.dumps(args)}")
            except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
                calls.append(f"not a valid call: {payload[:200]}")
    return calls


def message_text(m: dict) -> str:
    return str(m.get("content") or "")


def message_lines(label: str, text: str, cut: int | None) -> list[str]:
    """`  [label] text`, a text of several lines indented under its label; cut at `cut` characters (None: whole)."""
    if cut and len(text) > cut:
        text = text[:cut] + f" [... {len(text) - cut} more characters; --full]"
    if "\n" not in text:
        return [f"  [{label}] {text}"]
    return [f"  [{label}]"] + ["    " + line for line in text.split("\n")]


def env_label(m: dict, boundary: dict | None) -> str:
    """A message the environment added: a tool result (whatever its role) at a tool boundary."""
    if boundary is None or boundary["kind"] != "tool" or m["role"] == "tool":
        return m["role"]
    return f"tool result, as a {m['role']} message"


def episode_text(ep: dict, group_outcomes: list[float], full: bool = False) -> str:
    """One episode, turn by turn; `group_outcomes`: its group's outcome rewards (its own among them)."""
    cut = CUT
    if full:
        cut = None
    rewards = " | ".join(f"{k} {v:.3f}" for k, v in ep["rewards"].items())
    group_mean = statistics.fmean(group_outcomes)
    lines = [
        f"=== step {ep['step']} | episode {ep['episode']} | group {ep['group']} | end: {ep['end_reason']} | "
        f"tool calls {ep['tool_calls']}, errors {ep['tool_errors']} | forks {ep['forks']}, realigns {ep['realigns']}",
        f"  outcome {ep['outcome_reward']:.3f} (its group's mean {group_mean:.3f} over {len(group_outcomes)}) | "
        f"turn {ep['turn_reward']:.3f} | rewards: {rewards}",
    ]
    prompt, turns = turns_of(ep)
    for m in prompt:
        lines += message_lines(m["role"], message_text(m), cut)
    boundaries = {b["turn"]: b for b in ep["boundaries"]}
    for turn in turns:
        t = turn["index"]
        b = boundaries.get(t)
        if t:  # what the environment said after the turn before, and the boundary it made
            if b is not None and boundary_kind(b, turns) == "extends":
                lines.append(f"  - {boundary_line(b, turns)}")
            elif b is not None:
                lines.append(f"  == {boundary_line(b, turns)}")
            for m in turns[t - 1]["after"]:
                lines += message_lines(env_label(m, b), message_text(m), cut)
        held = ""
        if turn["held_tokens"] > turn["trained_tokens"]:  # a branch's shared tokens, trained by the path it left
            held = f" ({turn['held_tokens'] - turn['trained_tokens']} more held as context)"
        turn_reward = 0.0
        if t < len(ep["turn_rewards"]):
            turn_reward = ep["turn_rewards"][t]
        lines.append(
            f"  --- turn {t} | advantage {ep['advantages'][t]:+.3f} | turn reward {turn_reward:.3f} | "
            f"{turn['trained_tokens']} tokens trained{held}"
        )
        if message_text(turn["message"]):  # a native turn that only calls a tool has no content
            lines += ["    " + line for line in message_text(turn["message"]).split("\n")]
        lines += [f"    tool call: {c}" for c in tool_calls_in(turn["message"])]
    if turns:  # results after the last turn (an episode cut by max_env_steps, or a prompt with no room to sample)
        for m in turns[-1]["after"]:
            lines += message_lines(env_label(m, boundaries.get(len(turns))), message_text(m), cut)
    return "\n".join(lines)


def group_outcomes(episodes: list[dict]) -> dict:
    by_group = {}
    for ep in episodes:
        by_group.setdefault((ep["step"], ep["group"]), []).append(ep["outcome_reward"])
    return by_group


# --- report.html: the curves, the eval table, and a few episodes per eval point, token by token


STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
img { max-width: 100%; } table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 2px 8px; }
td { text-align: right; font-variant-numeric: tabular-nums; } .ep { border: 1px solid #ddd; margin: 1em 0; }
.h { background: #f4f4f4; padding: 4px 8px; font-size: 13px; }
pre.toks { white-space: pre-wrap; word-break: break-all; margin: 0; padding: 8px; font-size: 12.5px; }
.m { color: #aaa; } .e { color: #aaa; font-style: italic; } .t.z { border-bottom: 1px dotted #888; }
.t.p { background: rgba(0, 160, 60, var(--a)); } .t.n { background: rgba(220, 30, 30, var(--a)); }
.b { display: block; color: #fff; background: #555; font: bold 11px system-ui; padding: 1px 6px; margin: 2px 0; }
.b.FORK, .b.REALIGN { background: #b35c00; } .note { color: #777; }
"""


def trained_span(text: str, adv: float, scale: float, title: str) -> str:
    """A trained token: green above 0, red below, as strong as |adv| against the page's largest; 0: underlined."""
    sign = "z"
    if adv > 0:
        sign = "p"
    if adv < 0:
        sign = "n"
    strength = 0.12 + 0.68 * min(abs(adv) / scale, 1)
    return (
        f'<span class="t {sign}" data-adv="{adv:+.4g}" style="--a:{strength:.2f}" title="{html.escape(title)}">'
        f"{html.escape(text)}</span>"
    )


def masked_span(pieces: list[str]) -> str:
    if len(pieces) > CONTEXT_RUN:
        keep = CONTEXT_RUN // 2
        left_out = f'<span class="e">[... {len(pieces) - 2 * keep} context tokens ...]</span>'
        return masked_span(pieces[:keep]) + left_out + masked_span(pieces[-keep:])
    return f'<span class="m">{html.escape("".join(pieces))}</span>'


def sample_html(ep: dict, k: int, turns: list[dict], decode, scale: float) -> str:
    """Sample k's tokens: runs of masked ones grey, each trained one shaded by its advantage; a REALIGN or tool
    boundary marked where the turn before it ended."""
    s = ep["samples"][k]
    marks = {}  # token position -> the boundary that follows it
    for b in ep["boundaries"]:
        t = b["turn"]
        kind = boundary_kind(b, turns)
        ends = [i for i, x in enumerate(s["turn_idx"]) if x == t - 1]
        if kind != "FORK" and ends:  # a fork's mark heads the sample it starts
            marks[ends[-1]] = f'<span class="b {kind}">{html.escape(boundary_line(b, turns))}</span>'
    out = []
    masked = []  # the masked tokens in a row, not yet written
    shown = 0
    for i, (tid, mask, t) in enumerate(zip(s["input_ids"], s["loss_mask"], s["turn_idx"])):
        if not mask:
            masked.append(decode(tid))
        else:
            if masked:
                out.append(masked_span(masked))
                masked = []
            if shown == TOKENS:
                out.append('<span class="e">[... the rest of the sample left out]</span>')
                break
            lp = s["sampler_logprobs"][i]
            adv = s["advantages"][i]
            out.append(trained_span(decode(tid), adv, scale, f"turn {t} | advantage {adv:+.3f} | logprob {lp:.3f}"))
            shown += 1
        if i in marks:
            if masked:
                out.append(masked_span(masked))
                masked = []
            out.append(marks[i])
    if masked:
        out.append(masked_span(masked))
    return "".join(out)


def text_html(ep: dict, scale: float) -> str:
    """Without a tokenizer: the messages, each sampled turn shaded whole by its advantage, the rest grey."""
    prompt, turns = turns_of(ep)
    out = [masked_span([message_text(m) + "\n"]) for m in prompt]
    for turn in turns:
        adv = ep["advantages"][turn["index"]]
        text = message_text(turn["message"])
        if turn["message"].get("tool_calls"):  # native calls, kept beside the content
            text += "".join(f"\n[tool call: {c}]" for c in tool_calls_in(turn["message"]))
        out.append(trained_span(text, adv, scale, f"turn {turn['index']} | advantage {adv:+.3f}"))
        out += [masked_span(["\n" + message_text(m) + "\n"]) for m in turn["after"]]
    return "".join(out)


def episode_html(ep: dict, label: str, decode, scale: float) -> str:
    rewards = " | ".join(f"{k} {v:.3f}" for k, v in ep["rewards"].items())
    advantages = ", ".join(f"{a:+.2f}" for a in ep["advantages"])
    head = (
        f"episode {ep['episode']} (group {ep['group']}) | end: {ep['end_reason']} | outcome "
        f"{ep['outcome_reward']:.3f} | turn {ep['turn_reward']:.3f} | {rewards} | tool calls {ep['tool_calls']}, "
        f"errors {ep['tool_errors']} | advantage per turn: {advantages}"
    )
    _, turns = turns_of(ep)
    body = []
    if decode is None:
        body.append(text_html(ep, scale))
    else:
        for k in range(len(ep["samples"])):
            fork = [
                b for b in ep["boundaries"] if boundary_kind(b, turns) == "FORK" and sample_of(turns, b["turn"]) == k
            ]
            if k and fork:
                body.append(f'<span class="b FORK">{html.escape(boundary_line(fork[0], turns))}</span>')
            body.append(sample_html(ep, k, turns, decode, scale))
    head = f"<b>{label}</b>: {html.escape(head)}"
    return f'<div class="ep"><div class="h">{head}</div><pre class="toks">{"".join(body)}</pre></div>'


def load_tokenizer(run_dir: str, config: dict):
    """The run's tokenizer (config.yaml's model_name_or_path, else its newest checkpoint's) and a note saying which;
    (None, why) where none loads."""
    candidates = [config.get("model_name_or_path")]
    checkpoints = [p for p in glob.glob(os.path.join(run_dir, "checkpoint-*")) if p.rsplit("-", 1)[-1].isdigit()]
    candidates += sorted(checkpoints, key=lambda p: int(p.rsplit("-", 1)[-1]), reverse=True)
    why = "config.yaml names no model"
    for path in candidates:
        if not path:
            continue
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=True), f"tokens decoded by {path}'s tokenizer"
        except Exception as e:  # a hub id not in the cache, a folder gone: text only
            why = f"{path}: {type(e).__name__}"
    return None, f"no tokenizer could be loaded ({why}): each turn's text is shaded whole"


def eval_table(rows: list[dict]) -> str:
    evaluated = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evaluated:
        return '<p class="note">This run did not evaluate (set eval_dataset and eval_steps).</p>'
    keys = sorted({k for r in evaluated for k in r if k.startswith("eval/")})
    head = "".join(f"<th>{html.escape(k.removeprefix('eval/'))}</th>" for k in keys)
    body = []
    for r in evaluated:
        cells = []
        for k in keys:
            value = ""  # a metric this evaluation lacks
            if k in r:
                value = f"{r[k]:.3f}"
            cells.append(f"<td>{value}</td>")
        body.append(f"<tr><th>{r['step']}</th>{''.join(cells)}</tr>")
    return f'<table class="eval"><tr><th>step</th>{head}</tr>{"".join(body)}</table>'


def report_points(logged: list[int], rows: list[dict]) -> list[tuple[int, dict | None]]:
    """(a logged step, the eval row it stands for) for each eval step, the logged step nearest to it; without
    evaluations, the logged steps. At most POINTS of them, spread over the run."""
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    points = {}
    for r in evals:
        if not logged:
            break
        nearest = min(logged, key=lambda s: (abs(s - r["step"]), s))
        if nearest not in points or nearest == r["step"]:  # a step both logged and evaluated stands for itself
            points[nearest] = r
    if not evals:
        points = dict.fromkeys(logged)
    chosen = sorted(points)
    if len(chosen) > POINTS:
        chosen = [chosen[round(i * (len(chosen) - 1) / (POINTS - 1))] for i in range(POINTS)]
    return [(s, points[s]) for s in chosen]


def picked(episodes: list[dict]) -> list[tuple[str, dict]]:
    """The worst, the median and the best episode of a step, by outcome then turn reward (each once), of those with
    an advantage (a group with reward spread) where there are any: what the gradient saw."""
    ranked = sorted(episodes, key=outcome_order)
    learning = [ep for ep in ranked if any(ep["advantages"])]
    if learning:
        ranked = learning
    labels = {0: "worst", len(ranked) // 2: "median", len(ranked) - 1: "best"}
    return [(label, ranked[i]) for i, label in sorted(labels.items())][:PER_POINT]


def point_html(step: int, row: dict | None, chosen: list[tuple[str, dict]], decode, scale: float) -> str:
    title = f"Step {step}"
    if row is not None:
        evals = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in row.items() if k.startswith("eval/"))
        at = ""
        if row["step"] != step:
            at = f" (the logged step nearest to the evaluation at step {row['step']})"
        title += f"{at}: eval {evals}"
    parts = [episode_html(ep, label, decode, scale) for label, ep in chosen]
    return f'<h3 id="step-{step}">{html.escape(title)}</h3>' + "".join(parts)


def episodes_html(run_dir: str, config: dict, logged: list[int], rows: list[dict]) -> str:
    """A legend, then per eval point its worst, median and best episode, token by token."""
    if not logged:
        return '<p class="note">No episodes: the run logged none (log_episodes_steps: 0, or it stopped first).</p>'
    wanted = dict(report_points(logged, rows))
    episodes = read_jsonl(os.path.join(run_dir, "episodes.jsonl"), set(wanted))
    points = [(s, row, picked([ep for ep in episodes if ep["step"] == s])) for s, row in wanted.items()]
    shown = [ep for _, _, chosen in points for _, ep in chosen]
    scale = max((abs(a) for ep in shown for a in ep["advantages"]), default=0.0) or 1.0
    tok, note = load_tokenizer(run_dir, config)
    decode = None  # token id -> its text, each id decoded once
    if tok is not None:
        decode = functools.cache(lambda i: tok.decode([i]))
    swatches = [trained_span(f" {a:+.2f} ", a, scale, "") for a in (-scale, 0.0, scale)]
    legend = (
        f"<p>Trained tokens shaded by advantage: {' '.join(swatches)}; "
        f"{masked_span([' masked (prompt, template, tool results) '])}. Hover a token for its advantage and sampler "
        f"logprob. Episodes logged at {len(logged)} step(s); shown: the worst, the median and the best of the step "
        f"nearest each evaluation, of those with an advantage where any had one. "
        f'<span class="note">{html.escape(note)}. In a terminal: bash run.sh show {html.escape(run_dir)} '
        "--step N [--worst | --best].</span></p>"
    )
    return legend + "".join(point_html(s, row, chosen, decode, scale) for s, row, chosen in points)


def write_report(run_dir: str, out: str | None = None) -> str:
    """RUN_DIR/report.html (or `out`), self-contained; returns its path."""
    if not os.path.isdir(run_dir):
        raise ShowError(f"{run_dir} is not a run folder: there is no such folder")
    rows = []
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    logged = []
    if os.path.isfile(os.path.join(run_dir, "episodes.jsonl")):
        logged = logged_steps(os.path.join(run_dir, "episodes.jsonl"))
    if not rows and not logged:
        raise ShowError(f"{run_dir} is not a run folder: no metrics.jsonl or episodes.jsonl in it")
    config = {}
    if os.path.isfile(os.path.join(run_dir, "config.yaml")):
        with open(os.path.join(run_dir, "config.yaml")) as f:
            config = yaml.safe_load(f) or {}
    name = os.path.basename(os.path.normpath(run_dir))
    curves = '<p class="note">No curves.png (`bash run.sh plot RUN_DIR` draws it).</p>'
    if os.path.isfile(os.path.join(run_dir, "curves.png")):
        with open(os.path.join(run_dir, "curves.png"), "rb") as f:
            curves = f'<img alt="curves" src="data:image/png;base64,{base64.b64encode(f.read()).decode()}">'
    trained = max((r["step"] for r in rows), default=0)
    about = (
        f"{config.get('model_name_or_path', '')} | advantage_mode {config.get('advantage_mode', '')} | {trained} steps"
    )
    page = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(name)}</title>',
        f"<style>{STYLE}</style></head><body><h1>{html.escape(name)}</h1><p>{html.escape(about)}</p>",
        f"<h2>Curves</h2>{curves}<h2>Evaluation by step</h2>{eval_table(rows)}",
        f"<h2>Episodes</h2>{episodes_html(run_dir, config, logged, rows)}</body></html>\n",
    ]
    out = out or os.path.join(run_dir, "report.html")
    with open(out, "w") as f:
        f.write("".join(page))
    return out


class Parser(argparse.ArgumentParser):
    def error(self, message):
        usage = " ".join(self.format_usage().split()[1:])
        raise ShowError(f"{message} (usage: {usage})")


def main(argv: list[str]) -> int:
    ap = Parser(prog="mt_grpo_trainer.py show", description="A run's episodes, turn by turn; --html: report.html.")
    ap.add_argument("run_dir", metavar="RUN_DIR")
    ap.add_argument("--step", type=int, metavar="N", help="only this logged step's episodes (default: the last)")
    order = ap.add_mutually_exclusive_group()
    every = "of every logged step unless --step"
    order.add_argument(
        "--worst", dest="order", action="store_const", const="worst", help=f"lowest reward first, {every}"
    )
    order.add_argument(
        "--best", dest="order", action="store_const", const="best", help=f"highest reward first, {every}"
    )
    ap.add_argument("-n", type=int, default=5, help="how many episodes (default 5)")
    ap.add_argument("--full", action="store_true", help="prompts and tool results whole")
    ap.add_argument("--html", action="store_true", help="write RUN_DIR/report.html and say where")
    try:
        a = ap.parse_args(argv)
        if a.html:
            print(f"[mt-grpo] report: {write_report(a.run_dir)}")
            return 0
        chosen, episodes, line = select(episodes_file(a.run_dir), a.step, a.order, a.n)
        groups = group_outcomes(episodes)
        print(f"{a.run_dir}: {line}")
        for ep in chosen:
            print("\n" + episode_text(ep, groups[ep["step"], ep["group"]], a.full))
    except ShowError as e:
        print(f"show: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `show RUN | head` stopped reading: it has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit raises it again
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
