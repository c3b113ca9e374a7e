"""`show` and report.html on a real two-step run of the warm toy model: each episode turn by turn (sampled text, tool
call, result, reward per function, advantage, boundaries), ordered and filtered; a bad folder in one line; and the
report's curves, eval table and tokens shaded by the advantage they were trained with. Forks and REALIGNs: the real
Qwen3 template's episodes, recorded as the trainer records them."""

import base64
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

import check_template as CT
import mt_grpo_trainer as M
import show
from conftest import ROOT
from tasks import fixtures
from test_train import run_cfg
from test_turn_credit import ByTurn


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_dir):
    """A real run: two steps, every step's episodes logged, evaluated at steps 0 and 2; its console output too."""
    tmp = tmp_path_factory.mktemp("show")
    evals = ["eval_dataset=tasks/toy_kv.py:make_eval_dataset", "eval_max_examples=4", "eval_steps=2"]
    steps = ["max_steps=2", "log_episodes_steps=1", "max_tokens=48", "prompts_per_step=4", "learning_rate=5e-4"]
    cfg = run_cfg(tmp, toy_model_dir, "run", *steps, *evals)  # the recipe's learning rate: the model still calls
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        M.train(cfg)
    return tmp / "run", out.getvalue()


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "episodes.jsonl")]


def show_out(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        M.main(["show", *map(str, argv)])
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    return out.out


def blocks(out: str) -> dict:
    """The printed episodes, by (step, episode)."""
    found = {}
    for block in out.split("\n=== ")[1:]:
        step, episode = map(int, re.match(r"step (\d+) \| episode (\d+)", block).groups())
        found[step, episode] = block
    return found


def test_show_prints_each_turn_with_its_text_tool_call_result_rewards_and_advantage(run, capsys):
    run_dir, _ = run
    out = show_out(capsys, run_dir, "--step", 2, "-n", 100)
    step2 = [r for r in records(run_dir) if r["step"] == 2]
    printed = blocks(out)
    assert set(printed) == {(2, r["episode"]) for r in step2}, "--step 2: that step's episodes, every one"
    called = [r for r in step2 if r["tool_calls"] and not r["tool_errors"]]
    assert called and any(r["advantages"] and any(r["advantages"]) for r in step2), "the warm model calls its tool"
    for r in step2:
        block = printed[2, r["episode"]]
        for name, value in r["rewards"].items():
            assert f"{name} {value:.3f}" in block, block
        assistant = [m for m in r["messages"] if m["role"] == "assistant"]
        for t, (m, adv) in enumerate(zip(assistant, r["advantages"])):
            turn = block.split(f"--- turn {t} | ")[1]
            assert turn.startswith(f"advantage {adv:+.3f} | turn reward {r['turn_rewards'][t]:.3f}"), turn[:80]
            assert all("    " + line in turn for line in m["content"].split("\n")), "the sampled text"
    for r in called:
        block = printed[2, r["episode"]]
        i = next(i for i, m in enumerate(r["messages"]) if "<tool>" in m["content"])
        call = json.loads(re.search(r"<tool>(.*?)</tool>", r["messages"][i]["content"], re.S).group(1))
        assert f"tool call: lookup {json.dumps(call['args'])}" in block
        result = r["messages"][i + 1]["content"]  # the toy's XML format: the result as a user message
        assert "[tool result, as a user message]\n" + "\n".join("    " + x for x in result.split("\n")) in block
        assert "- turn 1 after a tool result: the sample extends" in block, block


def test_worst_and_best_order_every_logged_step_by_reward_and_step_filters(run, capsys):
    run_dir, _ = run
    recs = records(run_dir)
    key = {(r["step"], r["episode"]): (r["outcome_reward"], r["turn_reward"]) for r in recs}
    for flag, reverse in (("--worst", False), ("--best", True)):
        out = show_out(capsys, run_dir, flag, "-n", 6)
        shown = [tuple(map(int, x)) for x in re.findall(r"^=== step (\d+) \| episode (\d+)", out, re.M)]
        assert len(shown) == 6 and f"showing 6 of {len(recs)} from every logged step" in out
        assert [key[s] for s in shown] == sorted(key.values(), reverse=reverse)[:6], flag
    out = show_out(capsys, run_dir, "--step", 1, "--best", "-n", 3)
    assert set(re.findall(r"^=== step (\d+)", out, re.M)) == {"1"}
    first = max(key[s] for s in key if s[0] == 1)
    assert f"outcome {first[0]:.3f}" in out.split("\n=== ")[1]
    assert set(re.findall(r"^=== step (\d+)", show_out(capsys, run_dir), re.M)) == {"2"}, "the last logged step"


def test_run_sh_passes_show_through_from_any_folder(run):
    run_dir, _ = run
    env = {**os.environ, "MTGRPO_VENV": os.path.dirname(os.path.dirname(sys.executable)), "OMP_NUM_THREADS": "1"}
    argv = ["bash", os.path.join(ROOT, "run.sh"), "show", ".", "--best", "-n", "1"]
    r = subprocess.run(argv, cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "showing 1 of" in r.stdout and r.stdout.count("\n=== step ") == 1, r.stderr[-2000:]


def show_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        M.main(["show", *map(str, argv)])
    err = capsys.readouterr().err
    assert done.value.code == 1 and err.startswith("show: error: ") and err.count("\n") == 1, err
    return err


def test_a_bad_run_folder_or_step_is_one_line(run, tmp_path, capsys):
    run_dir, _ = run
    assert "is not a run folder: there is no such folder" in show_error(capsys, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "no episodes.jsonl or metrics.jsonl in it" in show_error(capsys, tmp_path / "empty")
    (tmp_path / "quiet").mkdir()
    (tmp_path / "quiet" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "log_episodes_steps=N" in show_error(capsys, tmp_path / "quiet")
    assert "step 7 was not logged: episodes.jsonl holds steps 1, 2" in show_error(capsys, run_dir, "--step", 7)
    assert "unrecognized arguments: --wrost" in show_error(capsys, run_dir, "--wrost")


class Page(HTMLParser):
    """What report.html shows: its images, its table's rows, and per episode (step, episode) its token spans as
    (class, data-adv, text) and its boundary marks."""

    def __init__(self):
        super().__init__()
        self.images, self.rows, self.episodes, self.style = [], [], {}, ""
        self.step = None
        self.stack = []  # open tags: (tag, attrs)
        self.head = None  # the episode header being read
        self.current = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.stack.append((tag, attrs))
        if tag in ("img", "meta"):  # no end tag
            self.stack.pop()
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "tr":
            self.rows.append([])
        if tag == "h3":
            self.step = int(attrs["id"].removeprefix("step-"))
        if tag == "div" and attrs.get("class") == "h":
            self.head = ""
        if tag == "span" and self.current is not None and "class" in attrs:  # its text follows
            kind = attrs["class"].split()
            if kind[0] == "b":
                self.current["marks"].append((kind[1], ""))
            else:
                self.current["spans"].append((kind, attrs.get("data-adv"), ""))

    def handle_endtag(self, tag):
        tag_, attrs = self.stack.pop()
        assert tag_ == tag, f"</{tag}> closes <{tag_}>: the page is not well formed"
        if tag_ == "div" and attrs.get("class") == "h":
            episode = int(re.search(r"episode (\d+)", self.head).group(1))
            self.current = self.episodes.setdefault((self.step, episode), {"spans": [], "marks": []})
            self.head = None

    def handle_data(self, data):
        if not self.stack:
            return
        tag, attrs = self.stack[-1]
        if tag == "style":
            self.style += data
        if tag in ("td", "th") and self.rows:
            self.rows[-1].append(data)
        if self.head is not None:
            self.head += data
        if tag == "span" and self.current is not None and "class" in attrs:
            where = "spans"
            if attrs["class"].startswith("b "):
                where = "marks"
            *first, text = self.current[where][-1]
            self.current[where][-1] = (*first, text + data)


def read_page(path) -> Page:
    page = Page()
    page.feed(open(path).read())
    page.close()
    assert not page.stack, f"unclosed tags: {page.stack}"
    return page


def test_each_run_writes_report_html_with_its_curves_eval_table_and_tokens_shaded_by_advantage(run):
    run_dir, console = run
    assert console.rstrip("\n").split("\n")[-1].startswith(f"[mt-grpo] open {run_dir / 'report.html'}: "), console[
        -300:
    ]
    page = read_page(run_dir / "report.html")
    png = (run_dir / "curves.png").read_bytes()
    assert page.images == ["data:image/png;base64," + base64.b64encode(png).decode()], "curves.png, embedded"
    metrics = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    evaluated = {m["step"]: m for m in metrics if "eval/exact_answer_reward" in m}
    assert sorted(evaluated) == [0, 2]
    header, *rows = page.rows
    col = header.index("exact_answer_reward")
    assert {int(r[0]): r[col] for r in rows} == {
        s: f"{m['eval/exact_answer_reward']:.3f}" for s, m in evaluated.items()
    }
    # a few episodes per eval point: step 0's nearest logged step (1) and step 2, each episode token by token
    assert {step for step, _ in page.episodes} == {1, 2} and len(page.episodes) <= 2 * show.PER_POINT
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(M.load_config(str(run_dir / "config.yaml")).model_name_or_path)
    recs = {(r["step"], r["episode"]): r for r in records(run_dir)}
    shaded = 0
    for key, shown in page.episodes.items():
        [s] = recs[key]["samples"]  # the toy's template extends: one sample
        trained = [(a, tok.decode([i])) for i, m, a in zip(s["input_ids"], s["loss_mask"], s["advantages"]) if m]
        spans = [(float(adv), text) for kind, adv, text in shown["spans"] if kind[0] == "t"]
        assert [(round(a, 3), text) for a, text in spans] == [(round(a, 3), text) for a, text in trained], key
        greyed = "".join(text for kind, _, text in shown["spans"] if kind == ["m"])
        assert greyed == tok.decode([i for i, m in zip(s["input_ids"], s["loss_mask"]) if not m]), "masked: grey"
        assert "".join(text for _, _, text in shown["spans"]) == tok.decode(s["input_ids"]), "every token, in order"
        shaded += sum(1 for kind, _, _ in shown["spans"] if kind[0] == "t" and kind[1] in "pn")
        if recs[key]["tool_calls"]:
            assert shown["marks"] == [("extends", "turn 1 after a tool result: the sample extends")]
    assert shaded, "some tokens carry an advantage"
    assert re.search(r"\.m \{ color: #aaa", page.style) and re.search(r"\.t\.p \{ background: rgba\(0, 160", page.style)
    assert os.path.getsize(run_dir / "report.html") < len(png) * 4 / 3 + 200_000, "small: a few episodes"


def boundary_run(tmp_path, boundary: str, tokenizer: str):
    """Episodes of the real Qwen3 template, recorded as the trainer records them: without thinking every tool
    boundary FORKs; with a second end-of-turn token each one REALIGNs (tests/test_turn_credit.py's episodes)."""
    from transformers import AutoTokenizer

    fix = fixtures.ensure()
    qwen3 = AutoTokenizer.from_pretrained(os.path.join(fix, "qwen3_tokenizer"))
    qwen3.chat_template = open(os.path.join(fix, "qwen3_chat_template.jinja")).read()
    eos = [qwen3.eos_token_id]
    think = ""
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    if boundary == "realign":
        eos = [qwen3.convert_tokens_to_ids("<|endoftext|>")]
        think = "<think>\nx\n</think>\n\n"
        kwargs = {}
    call = '<tool_call>\n{"name": "_sim_search", "arguments": {"query": "q%d"}}\n</tool_call>'
    cfg = M.Config(system_prompt="", tool_format="native", max_env_steps=10, num_generations=2, **kwargs)
    env = M.MultiTurnToolEnv(qwen3, [CT._sim_search], cfg)
    script = [qwen3.encode(think + t, add_special_tokens=False) + eos for t in (call % 0, call % 1, "Done.")]
    eps = env.rollout([{"prompt": "q"}] * 2, ByTurn(qwen3, script, "<|im_start|>assistant"))
    M.assign_advantages(eps, [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [1.0, 0.0], cfg)
    run_dir = tmp_path / boundary
    run_dir.mkdir()
    with open(run_dir / "episodes.jsonl", "w") as f:
        f.writelines(json.dumps(M.episode_record(1, i, ep.group, ep)) + "\n" for i, ep in enumerate(eps))
    (run_dir / "config.yaml").write_text(f"model_name_or_path: {tokenizer or os.path.join(fix, 'qwen3_tokenizer')}\n")
    return run_dir, eps


@pytest.mark.parametrize("boundary", ["fork", "realign"])
def test_forks_and_realigns_are_marked_in_show_and_in_the_report(tmp_path, capsys, boundary):
    run_dir, eps = boundary_run(tmp_path, boundary, "")
    out = show_out(capsys, run_dir, "-n", 1)
    assert 'tool call: _sim_search {"query": "q1"}' in out and "[tool] Results for q0: 42 is the answer." in out
    if boundary == "fork":
        assert eps[0].forks == 2 and len(eps[0].samples) == 3
        assert (
            "== FORK before turn 1 (after a tool result): the chat template rewrote the history; sample 2 starts" in out
        )
        assert (
            "== FORK before turn 2 (after a tool result): the chat template rewrote the history; sample 3 starts" in out
        )
    else:
        assert eps[0].realigns == 2 and len(eps[0].samples) == 1
        assert (
            "== REALIGN before turn 1 (after a tool result): the fresh rendering changed turn 0's tail; 1 of its" in out
        )
    page = read_page(show.write_report(str(run_dir)))
    marks = [kind for shown in page.episodes.values() for kind, _ in shown["marks"]]
    assert marks == [boundary.upper()] * 2 * len(page.episodes), "each boundary marked where it falls"
    for (_, i), shown in page.episodes.items():
        trained = [a for s in eps[i].samples for a, m in zip(s.advantages, s.loss_mask) if m]
        assert [float(adv) for kind, adv, _ in shown["spans"] if kind[0] == "t"] == pytest.approx(trained, abs=1e-3)


def test_without_a_tokenizer_the_report_shades_each_turn_whole(tmp_path):
    run_dir, eps = boundary_run(tmp_path, "realign", str(tmp_path / "gone"))
    page = read_page(show.write_report(str(run_dir)))
    assert "no tokenizer could be loaded" in open(run_dir / "report.html").read()
    for (_, i), shown in page.episodes.items():
        turns = [(float(adv), text) for kind, adv, text in shown["spans"] if kind[0] == "t"]
        assistant = eps[i].completion[::2]
        assert [a for a, _ in turns] == pytest.approx(eps[i].advantages, abs=1e-3) and len(assistant) == 3
        for t, ((_, text), m) in enumerate(zip(turns, assistant)):
            assert text.startswith(m["content"]) and (t == 2 or f'"query": "q{t}"' in text), "the turn's text, whole"
