"""The verdicts docs/templates.md records for the real chat templates of the families that train: every row of its
table is run through `check-template` (the command the doc shows) and must give what the row says, so the doc cannot
go stale. The templates are the pinned packages' files (tasks/fixtures.py), checked with the Qwen3 tokenizer and the
family's end-of-turn token (the doc says why that is sound)."""

import functools
import os
import re
import shlex

import pytest

import check_template as CT
from conftest import ROOT
from tasks import fixtures

FIX = fixtures.ensure()
DOC = os.path.join(ROOT, "docs", "templates.md")
MARKER = "<!-- verdicts: tests/test_template_verdicts.py reads this table -->"


def doc_rows() -> list[dict]:
    """The table's rows, one per (fixture, flags, format, retention): what check-template must print."""
    text = open(DOC, encoding="utf-8").read()
    assert MARKER in text, f"{DOC} has lost its verdict table's marker"
    lines = text.split(MARKER, 1)[1].strip().splitlines()
    rows = []
    for line in lines[2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        fixture, _family, flags, formats, retentions, no_thinking, thinking = cells
        for fmt in formats.split(", "):
            for retention in retentions.split(", "):
                rows.append(
                    {
                        "fixture": fixture.strip("`"),
                        "flags": flags.strip("`"),
                        "format": fmt,
                        "retention": retention,
                        "no_thinking": no_thinking,
                        "thinking": no_thinking if thinking == "same" else thinking,
                    }
                )
    return rows


ROWS = doc_rows()


load_tokenizer = functools.cache(
    CT.load_tokenizer
)  # one load for the rows of a template and flags (the check reads it)


def measured(argv: list[str], capsys, monkeypatch) -> dict:
    """check-template's verdict per setting, as the doc's table writes it."""
    monkeypatch.setattr(CT, "load_tokenizer", load_tokenizer)
    code = CT.main(argv)
    out, err = capsys.readouterr()
    if code == 1 and err.startswith("check-template: error: the chat template refuses"):
        assert err.count("\n") == 1, f"a refusal is one line: {err}"
        return {"refused": err.split("): ", 1)[1].strip()}
    assert code == 0 and "VIOLATION" not in out, out + err
    verdict, setting = {}, None
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in ("no_thinking", "thinking"):
            setting = words[0]
            verdict[setting] = line.split("boundaries: ")[1]
        elif setting and words[:1] == ["WARNING"]:
            verdict[setting] += ", results hidden"
    return verdict


def row_id(r: dict) -> str:
    return f"{r['fixture']}-{r['format']}-{r['retention']}" + ("-no-system" if "--system-prompt" in r["flags"] else "")


@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_check_template_gives_the_verdict_the_doc_records(row, capsys, monkeypatch):
    argv = ["--tokenizer", os.path.join(FIX, "qwen3_tokenizer")]
    argv += ["--chat-template", os.path.join(FIX, f"{row['fixture']}_chat_template.jinja")]
    argv += [*shlex.split(row["flags"]), "--tool-format", row["format"], "--thinking-retention", row["retention"]]
    got = measured(argv, capsys, monkeypatch)
    if "refused" in got:
        assert row["no_thinking"].startswith("refused: ") and row["thinking"] == row["no_thinking"], got
        assert got["refused"].startswith(row["no_thinking"].removeprefix("refused: ")), got
    else:
        assert got == {"no_thinking": row["no_thinking"], "thinking": row["thinking"]}


def test_the_table_covers_every_template_fixture_in_both_formats_under_every_retention():
    covered = {}
    for r in ROWS:
        covered.setdefault((r["fixture"], r["flags"]), []).append((r["format"], r["retention"]))
    want = sorted((f, t) for f in ("xml", "native") for t in ("template", "tool_cycle", "all"))
    for key, cases in covered.items():
        assert sorted(cases) == want, f"{key}: the table has {sorted(cases)}"
    templates = {name.removesuffix("_chat_template.jinja") for name in fixtures.NAMES if name.endswith(".jinja")}
    assert {fixture for fixture, _ in covered} == templates


def test_the_bridge_steps_aside_for_a_template_that_refuses_its_stub():
    """Without a system message the bridge's stub (the first message and the last user query) is two user messages,
    which Gemma's template refuses: the prompt is rendered whole instead, and equals the full rendering."""
    import mt_grpo_trainer as M

    tok = CT.load_tokenizer(
        os.path.join(FIX, "qwen3_tokenizer"), os.path.join(FIX, "gemma_chat_template.jinja"), "<end_of_turn>"
    )
    env = M.MultiTurnToolEnv(tok, [CT._sim_search], M.Config(system_prompt="", tool_format="xml"))
    call = '<tool>{"name": "_sim_search", "args": {"query": "q"}}</tool>'
    script = [("assistant", call), ("assistant", "<answer>1</answer>"), ("user", "Why?"), ("assistant", call)]
    ep, seen = CT.simulate_episode(env, [*script, ("assistant", "<answer>2</answer>")], tok.eos_token_id)
    assert env.chat.bridge_checks == -1, "the bridge is off for good"
    assert len(ep.samples) == 1 and CT.check_invariants(ep, seen, env) == []
    assert tok.decode(seen[-1][0]) == env.chat.render(ep.messages[:-1], ep.sampled_texts)
