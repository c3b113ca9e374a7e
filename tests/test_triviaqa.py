"""The TriviaQA search task: the paper's rewards on hand-written episodes, wiki_search (local BM25 with
its on-disk cache, and a Search-R1-style remote retriever), and the dataset loader."""

import functools
import http.server
import json
import os
import threading
import time

import pytest

import mt_grpo_trainer as M
from rewards import triviaqa_reward as R
from tasks import triviaqa as T
from tools import wiki_search as W

DATA = os.path.join(os.path.dirname(M.__file__), "tasks", "data")  # sources and licences: tasks/data/SOURCES.md
WIKI18 = os.path.join(DATA, "wiki18_sample_1000.jsonl")
TQA = os.path.join(DATA, "triviaqa_sample_allennlp.jsonl")
EVIDENCE = os.path.join(DATA, "triviaqa_sample_allennlp_wiki_evidence.jsonl")


def call(query):
    return f"<reasoning>Search first.</reasoning>\n<tool>{json.dumps({'name': 'wiki_search', 'args': {'query': query}})}</tool>"


def result(text):
    return {"role": "user", "content": f"<result>\n{text}\n</result>"}


def answer(text):
    return {"role": "assistant", "content": f"<reasoning>The result says so.</reasoning>\n<answer>{text}</answer>"}


ALIASES = ["Sinclair Lewis", "Harry Sinclair Lewis", "(Harry) Sinclair Lewis", "The"]  # "The" normalises to ""


def rewards(episodes, aliases=ALIASES, **columns):
    """Every reward function, as the trainer's score() calls them: dataset columns as aligned lists."""
    cols = {"aliases": [aliases] * len(episodes), "prompt": ["q"] * len(episodes), "question_id": ["x"] * len(episodes)}
    cols.update(columns)
    return {f.__name__: f(episodes, **cols) for f in R.TURN_REWARD_FUNCS + R.OUTCOME_REWARD_FUNCS}


# --- rewards ----------------------------------------------------------------------------------


def test_normalisation_is_triviaqas():
    assert R.normalize_answer("  The Beatles!! ") == "beatles"
    assert R.normalize_answer("Lewis, (Harry) Sinclair") == "lewis harry sinclair"
    assert R.normalize_answer("Campbell-Bannerman") == "campbell bannerman"
    assert R.normalize_answer("30\u2019s") == "30 s" and R.normalize_answer("New_York") == "new york"
    assert R.normalize_answer("An apple a day") == "apple day"


def test_normalisation_reproduces_the_datasets_normalized_aliases():
    for line in open(TQA):
        a = json.loads(line)["answer"]
        assert {R.normalize_answer(x) for x in a["aliases"]} == set(a["normalized_aliases"])
        assert R.normalize_answer(a["value"]) == a["normalized_value"]


def test_a_successful_episode_earns_every_reward():
    ep = [
        {"role": "assistant", "content": call("Nobel Prize Literature 1930")},
        result("Doc 1 (Title: Sinclair Lewis)\nHarry Sinclair Lewis was an American novelist..."),
        answer("Sinclair Lewis"),
    ]
    r = rewards([ep])
    assert r == {
        "tool_execution_reward_func": [0.2],
        "exist_answer_in_search_results": [0.5],
        "exact_match_reward_func": [1.0],
        "exist_answer_reward_func": [0.5],
        "format_reward_func": [pytest.approx(0.2)],
        "xml_reward_func": [0.2],
    }


def test_tool_errors_lower_the_execution_reward_and_an_error_result_finds_nothing():
    ok = result("Doc 1 (Title: Sinclair Lewis)\nSinclair Lewis won the Nobel Prize in 1930.")
    err = result("Error: ValueError: query must be a non-empty string; Sinclair Lewis")  # an echo is no search hit
    one_of_two = [
        {"role": "assistant", "content": call("")},
        err,
        {"role": "assistant", "content": call("Nobel 1930")},
        ok,
        answer("Sinclair Lewis"),
    ]
    only_error = [{"role": "assistant", "content": call("")}, err, answer("no idea")]
    no_tool = [answer("Sinclair Lewis")]
    r = rewards([one_of_two, only_error, no_tool])
    assert r["tool_execution_reward_func"] == [pytest.approx(0.1), 0.0, 0.0]
    # the FIRST result counts: the error, although the second result holds the answer
    assert r["exist_answer_in_search_results"] == [0.0, 0.0, 0.0]
    assert r["exact_match_reward_func"] == [1.0, 0.0, 1.0]


def test_the_execution_reward_per_turn_credits_each_turn_for_its_own_calls():
    """tool_execution_reward_func's number is a rate over every call, and the trainer puts a number on the first
    calling turn; the per-turn form puts each turn's share on that turn, and sums to the same number."""
    ok = result("Doc 1 (Title: Sinclair Lewis)\nSinclair Lewis won the Nobel Prize in 1930.")
    err = result("Error: ValueError: query must be a non-empty string")
    late = [
        {"role": "assistant", "content": call("")},
        err,
        {"role": "assistant", "content": call("x")},
        ok,
        answer("a"),
    ]
    early = [
        {"role": "assistant", "content": call("x")},
        ok,
        {"role": "assistant", "content": call("")},
        err,
        answer("a"),
    ]
    no_tool = [answer("Sinclair Lewis")]
    completions = [late, early, no_tool]
    per_turn = R.tool_execution_turn_reward(completions)
    assert per_turn == [[0.0, 0.1, 0.0], [0.1, 0.0, 0.0], [0.0]]
    assert [sum(r) for r in per_turn] == pytest.approx(R.tool_execution_reward_func(completions))
    eps = []
    for c in completions:
        n_turns = sum(m["role"] == "assistant" for m in c)
        msgs = [{"role": "user", "content": "q"}] + c
        ep = M.Episode(row={"prompt": "q"}, messages=msgs, n_prompt_messages=1, turns=[M.Turn(0, 1)] * n_turns)
        ep.first_result_turn = 1 if n_turns > 1 else None
        eps.append(ep)
    number = M.score(eps, [R.tool_execution_reward_func], [1.0], 60, per_turn=True)
    assert number == [[pytest.approx(0.1), 0.0, 0.0], [pytest.approx(0.1), 0.0, 0.0], [0.0]], "on the first call"
    assert M.score(eps, [R.tool_execution_turn_reward], [1.0], 60, per_turn=True) == per_turn


def test_the_search_reward_reads_the_first_result_only():
    hit, miss = result("Sinclair Lewis was born in Sauk Centre."), result("Upton Sinclair wrote The Jungle.")
    first = [
        {"role": "assistant", "content": call("a")},
        hit,
        {"role": "assistant", "content": call("b")},
        miss,
        answer("x"),
    ]
    second = [
        {"role": "assistant", "content": call("a")},
        miss,
        {"role": "assistant", "content": call("b")},
        hit,
        answer("x"),
    ]
    assert R.exist_answer_in_search_results([first, second], aliases=[ALIASES, ALIASES]) == [0.5, 0.0]
    assert R.tool_execution_reward_func([first, second]) == [0.2, 0.2]


def test_exact_match_versus_containment_after_normalisation():
    eps = [
        [answer(a)]
        for a in [
            "the Sinclair Lewis.",
            "SINCLAIR  LEWIS",
            "It was Sinclair Lewis, the novelist",
            "Sinclair",
            "Sinclair Lewisham",
            "",
        ]
    ]
    r = rewards(eps)
    assert r["exact_match_reward_func"] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert r["exist_answer_reward_func"] == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0]  # whole words: "lewisham" is no hit


def test_the_final_answer_is_the_last_one_given_and_thinking_is_ignored():
    ep = [
        answer("Upton Sinclair"),
        {
            "role": "assistant",
            "content": "<think>maybe <answer>Upton</answer></think>"
            "<reasoning>r</reasoning>\n<answer>Sinclair Lewis</answer>",
        },
    ]
    assert R.final_answer(ep) == "Sinclair Lewis"
    assert R.exact_match_reward_func([ep], aliases=[ALIASES]) == [1.0]
    assert R.format_reward_func([ep[1:]]) == [pytest.approx(0.2)]


def test_malformed_xml_scores_lower_format_and_tag_rewards():
    good = [answer("Sinclair Lewis")]
    no_tags = [{"role": "assistant", "content": "Sinclair Lewis"}]
    unclosed = [{"role": "assistant", "content": "<reasoning>hmm\n<answer>Sinclair Lewis</answer>"}]
    doubled = [{"role": "assistant", "content": "<reasoning>a</reasoning><reasoning>b</reasoning>\n<answer>x</answer>"}]
    chatty = [{"role": "assistant", "content": "Sure! <reasoning>a</reasoning>\n<answer>x</answer> Hope this helps."}]
    fmt = R.format_reward_func([good, no_tags, unclosed, doubled, chatty])
    xml = R.xml_reward_func([good, no_tags, unclosed, doubled, chatty])
    assert fmt[0] == pytest.approx(0.2) and xml[0] == pytest.approx(0.2)
    assert fmt[1] == 0.0 and xml[1] == 0.0
    assert 0 < fmt[2] < 0.2 and 0 < xml[2] < 0.2  # <reasoning> never closed
    assert xml[3] < 0.2 and fmt[3] == pytest.approx(0.2)  # tags used twice
    assert fmt[4] < 0.2 and xml[4] == pytest.approx(0.2)  # text outside the tags
    # the tag-usage reward is floored at 0 however many duplicates there are
    assert R.xml_reward_func([[{"role": "assistant", "content": "<answer>" * 5 + "</answer>"}]]) == [0.0]
    # turns are averaged: one good turn and one without tags
    assert R.format_reward_func([[no_tags[0], good[0]]]) == [pytest.approx(0.1)]


def test_native_tool_messages_and_the_answer_column_work_too():
    ep = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "wiki_search", "arguments": {"query": "q"}}}],
        },
        {"role": "tool", "content": "Doc 1 (Title: Paris)\nParis is the capital of France."},
        {"role": "assistant", "content": "<answer>Paris</answer>"},
    ]
    r = {f.__name__: f([ep], answer=["Paris"], prompt=["q"]) for f in R.TURN_REWARD_FUNCS + R.OUTCOME_REWARD_FUNCS[:2]}
    assert r == {
        "tool_execution_reward_func": [0.2],
        "exist_answer_in_search_results": [0.5],
        "exact_match_reward_func": [1.0],
        "exist_answer_reward_func": [0.5],
    }
    with pytest.raises(ValueError, match="column 'aliases'"):
        R.exact_match_reward_func([ep], prompt=["q"])


def test_rewards_plug_into_the_trainers_score():
    funcs = [M.load_object(f"rewards/triviaqa_reward.py:{f.__name__}", "reward") for f in R.OUTCOME_REWARD_FUNCS]
    row = {
        "prompt": "Who won?",
        "aliases": ["Chicago Bears", "Bears"],
        "answer": "Chicago Bears",
        "question_id": "tc_10",
    }
    eps = [
        M.Episode(row=row, messages=[{"role": "user", "content": row["prompt"]}, answer(a)], n_prompt_messages=1)
        for a in ["Chicago Bears", "the Bears", "New England Patriots"]
    ]
    assert M.score(eps, funcs, [1.0] * 4, 60) == pytest.approx([1.9, 1.9, 0.4])
    assert eps[0].rewards["exact_match_reward_func"] == 1.0


# --- wiki_search: local BM25 --------------------------------------------------------------------


@pytest.fixture()
def wiki(monkeypatch, tmp_path):
    """wiki_search over the 1,000-passage wiki-18 sample, with a fresh index cache."""
    monkeypatch.setenv("WIKI_SEARCH_CORPUS", WIKI18)
    monkeypatch.setenv("WIKI_SEARCH_CACHE", str(tmp_path / "cache"))
    for var in ("WIKI_SEARCH_URL", "WIKI_SEARCH_TOPK", "WIKI_SEARCH_MAX_CHARS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(W, "_INDEXES", {})
    monkeypatch.setattr(W, "STATS", {"builds": 0, "loads": 0})
    return [W.split_passage(json.loads(line)) for line in open(WIKI18)]


def test_a_passages_own_words_retrieve_it_first(wiki):
    out = W.wiki_search("Evan Morris lobbyist Genentech Roche")
    assert out.startswith("Doc 1 (Title: Evan Morris)\nEvan Morris Evan L. Morris (January 26, 1977")
    assert out.count("(Title: ") == 3 and len(out) <= 1500
    top1 = 0
    for title, text in wiki[::10]:
        hits = W.search_local(f"{title} {' '.join(text.split()[30:45])}", 3)
        top1 += hits[0][:2] == (title, text)
    assert top1 >= 0.95 * len(wiki[::10]), f"top-1 for only {top1}/{len(wiki[::10])} passages"


def test_the_index_is_built_once_and_reused_from_disk(wiki):
    W.wiki_search("Horatio Hale ethnologist")
    assert W.STATS == {"builds": 1, "loads": 1}
    [folder] = [
        p
        for p in os.listdir(os.environ["WIKI_SEARCH_CACHE"])
        if os.path.isdir(os.path.join(os.environ["WIKI_SEARCH_CACHE"], p))
    ]
    path = os.path.join(os.environ["WIKI_SEARCH_CACHE"], folder)
    assert (
        folder.startswith("wiki18_sample_1000.jsonl-")
        and json.load(open(os.path.join(path, "meta.json")))["passages"] == 1000
    )
    stamp = os.stat(os.path.join(path, "offsets.npy")).st_mtime_ns
    W.wiki_search("Dibba Al-Hisn fort")  # same process: the in-memory index
    assert W.STATS == {"builds": 1, "loads": 1}
    W._INDEXES.clear()  # a new process: loaded from disk, not rebuilt
    out = W.wiki_search("Horatio Hale ethnologist")
    assert W.STATS == {"builds": 1, "loads": 2} and "Horatio Hale" in out
    assert os.stat(os.path.join(path, "offsets.npy")).st_mtime_ns == stamp
    assert not [p for p in os.listdir(os.environ["WIKI_SEARCH_CACHE"]) if ".tmp-" in p]


def test_a_changed_corpus_gets_a_new_index(wiki, monkeypatch, tmp_path):
    corpus = tmp_path / "mini.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": '"Aardvark"\nThe aardvark is a burrowing mammal.'}) + "\n")
    monkeypatch.setenv("WIKI_SEARCH_CORPUS", str(corpus))
    assert "burrowing mammal" in W.wiki_search("aardvark")
    with open(corpus, "a") as f:
        f.write(json.dumps({"id": "1", "contents": '"Zebu"\nThe zebu is humped cattle.'}) + "\n")
    os.utime(corpus, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert W.wiki_search("zebu cattle").startswith("Doc 1 (Title: Zebu)") and W.STATS["builds"] == 2
    assert W.wiki_search("xylophone quartz") == "No results found."


def test_output_is_capped(wiki, monkeypatch):
    assert len(W.wiki_search("Florida research institute")) <= 1500
    for cap in (120, 400):
        monkeypatch.setenv("WIKI_SEARCH_MAX_CHARS", str(cap))
        out = W.wiki_search("Florida research institute")
        assert len(out) <= cap and out.count("(Title: ") == 3 and out.endswith("...")
    monkeypatch.setenv("WIKI_SEARCH_TOPK", "1")
    monkeypatch.setenv("WIKI_SEARCH_MAX_CHARS", "100000")
    out = W.wiki_search("Florida Environmental Research Institute Tampa")
    assert out.count("(Title: ") == 1 and not out.endswith("...")


def test_missing_corpus_and_empty_query_fail_clearly(wiki, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="non-empty"):
        W.wiki_search("  ")
    monkeypatch.setenv("WIKI_SEARCH_CORPUS", str(tmp_path / "nope.jsonl"))
    with pytest.raises(
        FileNotFoundError, match=r"corpus not found: .*nope\.jsonl\. Set WIKI_SEARCH_CORPUS.*wiki-18-corpus"
    ):
        W.wiki_search("anything")
    # the trainer's environment hands the error to the model and counts it
    cfg = M.load_config(None, ["tools=[tools/wiki_search.py:wiki_search]", f"output_dir={tmp_path}/run"])
    env = M.MultiTurnToolEnv(None, [M.load_object(s) for s in cfg.tools], cfg)
    ep = M.Episode(row={"prompt": "q"}, messages=[], n_prompt_messages=0)
    (out,) = env.run_tools([(ep, {"name": "wiki_search", "args": {"query": "x"}})])
    assert out.startswith("Error: FileNotFoundError: wiki_search corpus not found") and ep.tool_errors == 1
    assert "wiki_search(query: str) -> str: Search Wikipedia" in env.system_prompt


@pytest.fixture()
def evidence(monkeypatch, tmp_path):
    """wiki_search over TriviaQA's own evidence articles, split into 100-word title/text passages; the fixture's
    questions by question_id."""
    corpus = tmp_path / "evidence.jsonl"
    with open(corpus, "w") as f:
        for line in open(EVIDENCE):
            art = json.loads(line)
            words = art["text"].split()
            for j in range(0, len(words), 100):
                f.write(json.dumps({"title": art["title"], "text": " ".join(words[j : j + 100])}) + "\n")
    monkeypatch.setenv("WIKI_SEARCH_CORPUS", str(corpus))
    monkeypatch.setenv("WIKI_SEARCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WIKI_SEARCH_URL", raising=False)
    monkeypatch.setenv("WIKI_SEARCH_TOPK", "3")
    monkeypatch.setenv("WIKI_SEARCH_MAX_CHARS", "1500")
    return {r["question_id"]: r for r in T.rows_of(T.read_local(TQA))}


def test_title_text_corpora_and_a_real_question_end_to_end(evidence):
    """TriviaQA's own evidence articles, split into 100-word passages: the question finds the answer."""
    rows = evidence
    for qid, title in [("tc_8", "Angola"), ("tc_9", "David Soul")]:
        row = rows[qid]
        out = W.wiki_search(row["prompt"])
        assert out.startswith(f"Doc 1 (Title: {title})")
        ep = [{"role": "assistant", "content": call(row["prompt"])}, result(out), answer(row["answer"])]
        assert R.exist_answer_in_search_results([ep], aliases=[row["aliases"]]) == [0.5]
        assert R.exist_answer_in_search_results([ep], aliases=[["Vladivostok"]]) == [0.0]


def test_per_turn_rewards_credit_the_search_that_found_the_answer(evidence):
    """A real question, searched three times: per turn, the second search (the first to find the answer) earns the
    retrieval reward, which the episode-level reward, reading the first result only, never sees."""
    row = evidence["tc_9"]  # Which city does David Soul come from? Chicago
    queries = ["Arthur Balfour Conservative leader", row["prompt"], "David Soul"]
    ep, searched = [], [W.wiki_search(q) for q in queries]
    for q, out in zip(queries, searched):
        ep += [{"role": "assistant", "content": call(q)}, result(out)]
    ep.append(answer(row["answer"]))
    found = [R.holds_answer(out, R.gold_lists([row["aliases"]], None, 1)[0]) for out in searched]
    assert found == [False, True, True]  # the fixture's data: the miss and the hits are real
    aliases = [row["aliases"]]
    assert R.retrieval_turn_reward([ep], aliases=aliases) == [[0.0, 0.3, 0.0, 0.0]]  # the first hit only
    assert R.exist_answer_in_search_results([ep], aliases=aliases) == [0.0]
    assert R.format_turn_reward([ep]) == [[0.1] * 4]
    assert R.search_penalty_turn_reward([ep]) == [[-R.LAMBDA_S] * 3 + [0.0]]


def test_per_turn_rewards_have_one_entry_per_assistant_message():
    hit = result("Doc 1 (Title: Sinclair Lewis)\nSinclair Lewis won the Nobel Prize in 1930.")
    malformed = {"role": "assistant", "content": "Let me search. <tool>{}</tool>"}
    ep = [
        malformed,
        result("Error: ValueError: expected a query; Sinclair Lewis"),  # an error never holds the answer
        {"role": "assistant", "content": call("Nobel 1930")},
        result("Upton Sinclair wrote The Jungle."),
        {"role": "assistant", "content": call("Nobel Prize Literature 1930")},
        hit,
        {"role": "user", "content": "Are you sure?"},  # a user message is no tool result
        answer("Sinclair Lewis"),
    ]
    no_search = [answer("Sinclair Lewis")]
    r = {f.__name__: f([ep, no_search], aliases=[ALIASES] * 2, prompt=["q"] * 2) for f in R.PER_TURN_REWARD_FUNCS}
    assert r == {
        "retrieval_turn_reward": [[0.0, 0.0, 0.3, 0.0], [0.0]],
        "format_turn_reward": [[-0.2, 0.1, 0.1, 0.1], [0.1]],
        "search_penalty_turn_reward": [[-0.15, -0.15, -0.15, 0.0], [0.0]],
    }
    # the penalty sums to -lambda_s x searches, and a partial sets lambda_s
    assert sum(functools.partial(R.search_penalty_turn_reward, lambda_s=0.05)([ep])[0]) == pytest.approx(-0.15)
    # native tool results (role "tool") belong to the assistant message before them too
    native = [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "wiki_search"}}]},
        {"role": "tool", "content": "Sinclair Lewis was born in Sauk Centre."},
        {"role": "assistant", "content": "<answer>Sinclair Lewis</answer>"},
    ]
    assert R.retrieval_turn_reward([native], answer=["Sinclair Lewis"]) == [[0.3, 0.0]]
    assert R.search_penalty_turn_reward([native]) == [[-0.15, 0.0]]


def test_a_well_formed_turn_has_reasoning_then_one_action_and_nothing_else():
    good = [
        "<reasoning>a</reasoning>\n<answer>x</answer>",
        call("q"),
        "<think>hm</think><reasoning>a</reasoning><tool>{}</tool>",
    ]
    bad = [
        "<answer>x</answer>",  # no reasoning
        "<reasoning>a</reasoning>",  # no action
        "<reasoning>a</reasoning>\n<answer>x</answer> Hope this helps.",  # text outside the tags
        "Sure. <reasoning>a</reasoning>\n<answer>x</answer>",
        "<reasoning>a</reasoning><reasoning>b</reasoning>\n<answer>x</answer>",  # a tag twice
        "<reasoning>a</reasoning>\n<tool>{}</tool><answer>x</answer>",  # two actions
        "<reasoning>a <tool>{}</tool></reasoning>\n<answer>x</answer>",  # a call inside the reasoning
        "<reasoning>a\n<answer>x</answer>",  # reasoning never closed
    ]
    eps = [[{"role": "assistant", "content": t}] for t in good + bad]
    assert R.format_turn_reward(eps) == [[0.1]] * len(good) + [[-0.2]] * len(bad)


# --- wiki_search: remote retriever --------------------------------------------------------------


class Retriever(http.server.BaseHTTPRequestHandler):
    """Search-R1's retrieval_server.py, as far as wiki_search uses it: POST /retrieve."""

    script = []  # per request: ("ok" | "500" | "garbage" | "slow")
    bodies = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Retriever.bodies.append((self.path, body))
        mode = Retriever.script.pop(0) if Retriever.script else "ok"
        if mode == "slow":
            threading.Event().wait(1.0)  # (time.sleep is patched to speed up the client's backoff)
        if mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal error")
            return
        docs = [
            {
                "document": {"id": str(i), "contents": f'"Doc {i} title"\npassage {i} about {body["queries"][0]}'},
                "score": 10.0 - i,
            }
            for i in range(body["topk"])
        ]
        payload = b"{not json" if mode == "garbage" else json.dumps({"result": [docs]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.fixture()
def remote(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    Retriever.script, Retriever.bodies = [], []
    monkeypatch.setenv("WIKI_SEARCH_URL", f"http://127.0.0.1:{server.server_address[1]}/")
    monkeypatch.setenv("WIKI_SEARCH_TIMEOUT", "0.5")
    monkeypatch.setenv("WIKI_SEARCH_CORPUS", "/nonexistent/never-read.jsonl")
    monkeypatch.delenv("WIKI_SEARCH_TOPK", raising=False)
    monkeypatch.delenv("WIKI_SEARCH_MAX_CHARS", raising=False)
    monkeypatch.setattr(time, "sleep", lambda s, _sleep=time.sleep: _sleep(min(s, 0.01)))  # fast backoff, bounded
    yield server
    server.shutdown()
    server.server_close()


def test_remote_retriever_speaks_search_r1(remote):
    out = W.wiki_search("Eiffel Tower")
    assert Retriever.bodies == [("/retrieve", {"queries": ["Eiffel Tower"], "topk": 3, "return_scores": True})]
    assert out == (
        "Doc 1 (Title: Doc 0 title)\npassage 0 about Eiffel Tower\n\n"
        "Doc 2 (Title: Doc 1 title)\npassage 1 about Eiffel Tower\n\n"
        "Doc 3 (Title: Doc 2 title)\npassage 2 about Eiffel Tower"
    )


def test_remote_retriever_retries_then_fails_clearly(remote, monkeypatch):
    Retriever.script = ["500", "ok"]
    assert W.wiki_search("x").startswith("Doc 1") and len(Retriever.bodies) == 2
    monkeypatch.setenv("WIKI_SEARCH_RETRIES", "1")
    Retriever.script = ["500", "500"]
    with pytest.raises(RuntimeError, match="HTTP 500"):
        W.wiki_search("x")
    Retriever.script = ["garbage"]
    with pytest.raises(RuntimeError, match="unexpected body"):
        W.wiki_search("x")
    monkeypatch.setenv("WIKI_SEARCH_RETRIES", "0")
    Retriever.script = ["slow"]  # answers after 1 s: only the 0.5 s timeout makes this fail (no clock needed)
    with pytest.raises(RuntimeError, match="unreachable: .*Timeout"):
        W.wiki_search("x")


# --- dataset ------------------------------------------------------------------------------------


def test_fixture_rows_have_the_columns_and_a_deterministic_disjoint_split():
    path = TQA
    train, ev = T.make_dataset("train", path=path, eval_size=3), T.make_dataset("eval", path=path, eval_size=3)
    assert (len(train), len(ev)) == (6, 3)
    assert (
        T.make_dataset("train", path=path, eval_size=3) == train
        and T.make_dataset("eval", path=path, eval_size=3) == ev
    )
    ids = [r["question_id"] for r in train + ev]
    assert len(set(ids)) == 9 and not {r["question_id"] for r in train} & {r["question_id"] for r in ev}
    for r in train + ev:
        assert set(r) == {"prompt", "aliases", "answer", "question_id"}
        assert isinstance(r["prompt"], str) and r["prompt"].endswith("?") and r["answer"] in r["aliases"]
    sinclair = next(r for r in train + ev if r["question_id"] == "tc_1")
    assert sinclair["prompt"] == "Which American-born Sinclair won the Nobel Prize for Literature in 1930?"
    assert sinclair["aliases"][0] == "Sinclair Lewis" and "Harry Sinclair Lewis" in sinclair["aliases"]
    # a bigger eval split only moves questions from train to eval
    ev4 = T.make_dataset("eval", path=path, eval_size=4)
    assert ev4[:3] == ev and T.make_dataset("train", path=path, eval_size=4, limit=2) == train[1:3]


def test_recipe_functions_read_the_environment(monkeypatch):
    monkeypatch.setenv("TRIVIAQA_PATH", TQA)
    monkeypatch.setenv("TRIVIAQA_EVAL_SIZE", "2")
    monkeypatch.delenv("TRIVIAQA_TRAIN_SIZE", raising=False)
    rows = M.load_rows("tasks/triviaqa.py:train_rows")
    assert len(rows) == 7 and len(M.load_rows("tasks/triviaqa.py:eval_rows")) == 2
    monkeypatch.setenv("TRIVIAQA_TRAIN_SIZE", "5")
    assert T.train_rows() == rows[:5]
    monkeypatch.setenv("TRIVIAQA_EVAL_SIZE", "9")
    with pytest.raises(ValueError, match="9 answered questions: an eval split of 9.*TRIVIAQA_EVAL_SIZE"):
        T.train_rows()
    monkeypatch.setenv("TRIVIAQA_PATH", "/nonexistent/triviaqa.jsonl")
    with pytest.raises(FileNotFoundError, match="TriviaQA file not found"):
        T.train_rows()


def test_official_json_parquet_and_flat_layouts(tmp_path):
    recs = [json.loads(line) for line in open(TQA)]
    want = T.rows_of(recs)
    official = {
        "Data": [
            {
                "Question": r["question"],
                "QuestionId": r["question_id"],
                "Answer": {
                    "Value": r["answer"]["value"],
                    "Aliases": r["answer"]["aliases"],
                    "NormalizedAliases": r["answer"]["normalized_aliases"],
                },
            }
            for r in recs
        ]
    }
    (tmp_path / "official.json").write_text(json.dumps(official))
    assert T.rows_of(T.read_local(str(tmp_path / "official.json"))) == want
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "t.parquet")
    assert T.rows_of(T.read_local(str(tmp_path / "t.parquet"))) == want
    flat = T.rows_of(
        [
            {"prompt": "Capital of France?", "answer": "Paris"},
            {"question": "2+2?", "aliases": ["4", "four"]},
            {"question": "Unanswered?", "answer": {"value": "", "aliases": []}},
        ]
    )
    assert sorted((r["prompt"], tuple(r["aliases"])) for r in flat) == [
        ("2+2?", ("4", "four")),
        ("Capital of France?", ("Paris",)),
    ]


def test_hub_source_reads_train_and_validation_and_dedupes(monkeypatch):
    """The Hugging Face path, with load_dataset answered locally (no hub here): the real column mapping."""
    import datasets

    recs = [json.loads(line) for line in open(TQA)]
    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        part = recs[:6] if split == "train" else recs[6:]
        rows = [
            {"question": r["question"], "question_id": r["question_id"], "question_source": "x", "answer": r["answer"]}
            for r in part + part[:2]
        ]  # rc lists some questions twice
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.delenv("TRIVIAQA_PATH", raising=False)
    monkeypatch.delenv("TRIVIAQA_CONFIG", raising=False)
    monkeypatch.delenv("TRIVIAQA_TRAIN_SIZE", raising=False)
    train = T.train_rows()
    ev = T.make_dataset("eval", eval_size=2)
    assert calls == [
        ("mandarjoshi/trivia_qa", "rc.nocontext", "train"),
        ("mandarjoshi/trivia_qa", "rc.nocontext", "validation"),
    ]
    assert len(train) == 6 and len(ev) == 2 and not {r["question_id"] for r in train} & {r["question_id"] for r in ev}
    assert train == T.rows_of(recs[:6])


def test_the_sample_recipe_reads_its_questions_and_corpus_from_the_repository():
    """A fresh clone has nothing beside it: the CPU recipe's TriviaQA sample ships in tasks/data, with its source and
    licence in tasks/data/SOURCES.md."""
    from tasks import triviaqa_sample as S

    for shipped in (S.QUESTIONS, S.EVIDENCE):
        assert os.path.commonpath([DATA, shipped]) == DATA and os.path.isfile(shipped), shipped
    sources = open(os.path.join(DATA, "SOURCES.md")).read()
    for name in os.listdir(DATA):
        assert name == "SOURCES.md" or f"`{name}`" in sources, f"{name} ships without its source in SOURCES.md"
    assert "CC BY-SA" in sources
    assert len(T.read_local(S.QUESTIONS)) == 9
