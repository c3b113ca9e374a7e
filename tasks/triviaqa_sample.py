"""The TriviaQA search task on the 9-question sample in tasks/data: a smoke test of the real path.

    dataset: tasks/triviaqa_sample.py:fewshot_rows     (or :train_rows, see below)

A recipe cannot set environment variables, so this wraps `tasks/triviaqa.py` and `tools/wiki_search.py`:
- rows: all 9 questions of `tasks/data/triviaqa_sample_allennlp.jsonl` (real TriviaQA questions with every
  alias, from allennlp's test fixtures; source and licence in tasks/data/SOURCES.md), read by `tasks.triviaqa.make_dataset` with no eval split;
- search corpus: the 10 Wikipedia evidence articles of those questions
  (`triviaqa_sample_allennlp_wiki_evidence.jsonl`; they hold the evidence of 6 of the 9), cut into
  100-word passages as DPR/wiki-18 does and written once, in wiki-18's `{"id", "contents"}` format,
  to .cache/triviaqa_sample/. `train_rows()` points `WIKI_SEARCH_CORPUS` at that file and sets
  `WIKI_SEARCH_MAX_CHARS=800` (results of ~200 tokens instead of ~350: CPU time), each only when
  the variable is not set already (then your choice wins). `search_env()` returns both.

Two datasets:
- `train_rows`: the bare question as the prompt (the paper's setting: the protocol is only in the
  system prompt);
- `fewshot_rows`: the question after two worked examples, given as earlier turns of the
  conversation (question, <tool> call, <result>, <answer>). SmolLM2-135M-Instruct ignores an XML
  protocol described in the system prompt (0 tool calls in 8 samples at temperature 0.7, also with
  an inline example); after two example exchanges about 5 in 8 first turns call wiki_search. The
  examples are part of the prompt, so no reward sees them.
"""

import hashlib
import json
import os
import sys

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PROJECT)
from tasks import triviaqa  # noqa: E402

DATA = os.path.join(PROJECT, "tasks", "data")  # shipped with the repository (tasks/data/SOURCES.md)
QUESTIONS = os.path.join(DATA, "triviaqa_sample_allennlp.jsonl")
EVIDENCE = os.path.join(DATA, "triviaqa_sample_allennlp_wiki_evidence.jsonl")
CACHE = os.path.join(PROJECT, ".cache", "triviaqa_sample")
PASSAGE_WORDS = 100
SEARCH_SETTINGS = {"WIKI_SEARCH_MAX_CHARS": "800"}


def _need(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"TriviaQA sample file not found: {path} (it ships with the repository in tasks/data; "
            "restore it with git checkout tasks/data)"
        )
    return path


def passages(article: dict, words: int = PASSAGE_WORDS) -> list[str]:
    """An article {title, text} as `"Title"\\n<up to `words` words>` passages, in order."""
    title, toks = str(article["title"]).strip(), str(article["text"]).split()
    return [f'"{title}"\n' + " ".join(toks[i : i + words]) for i in range(0, len(toks), words)]


def corpus() -> str:
    """Path of the passage corpus built from the evidence articles (built once, atomically)."""
    with open(_need(EVIDENCE), "rb") as f:
        raw = f.read()
    out = os.path.join(CACHE, f"wiki_evidence_{PASSAGE_WORDS}w-{hashlib.sha1(raw).hexdigest()[:12]}.jsonl")
    if os.path.isfile(out):
        return out
    os.makedirs(CACHE, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for line in raw.decode("utf-8").splitlines():
            if line.strip():
                for p in passages(json.loads(line)):
                    n += 1
                    f.write(json.dumps({"id": str(n), "contents": p}) + "\n")
    os.replace(tmp, out)
    return out


def _call(query: str) -> str:
    return (
        "<reasoning>I should search Wikipedia for this.</reasoning>\n"
        f"<tool>{json.dumps({'name': 'wiki_search', 'args': {'query': query}})}</tool>"
    )


# (question, query, title, passage, answer): facts outside the sample's questions and corpus
EXAMPLES = [
    (
        "Where does the Eiffel Tower stand?",
        "Eiffel Tower",
        "Eiffel Tower",
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
        "Paris",
    ),
    (
        "Who wrote the novel Moby-Dick?",
        "Moby-Dick author",
        "Moby-Dick",
        "Moby-Dick is an 1851 novel by American writer Herman Melville.",
        "Herman Melville",
    ),
]


def fewshot_messages() -> list[dict]:
    """The worked examples, as conversation turns in the XML protocol (results as wiki_search formats them)."""
    msgs = []
    for question, query, title, passage, answer in EXAMPLES:
        msgs += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": _call(query)},
            {"role": "user", "content": f"<result>\nDoc 1 (Title: {title})\n{passage}\n</result>"},
            {
                "role": "assistant",
                "content": f"<reasoning>The result answers it.</reasoning>\n<answer>{answer}</answer>",
            },
        ]
    return msgs


def fewshot_rows() -> list[dict]:
    """train_rows(), each prompt preceded by the worked examples (a list of messages)."""
    return [{**r, "prompt": fewshot_messages() + [{"role": "user", "content": r["prompt"]}]} for r in train_rows()]


def search_env() -> dict[str, str]:
    """The wiki_search environment variables this task uses (building the corpus if needed)."""
    return {"WIKI_SEARCH_CORPUS": corpus(), **SEARCH_SETTINGS}


def train_rows() -> list[dict]:
    """All 9 sample questions ({prompt, aliases, answer, question_id}); sets up the search (see above)."""
    for k, v in search_env().items():
        os.environ.setdefault(k, v)
    return triviaqa.make_dataset("train", path=_need(QUESTIONS), eval_size=0)
