"""TriviaQA questions for the search task (the paper's setting), with every accepted answer.

Specs (a recipe passes no arguments, so the source is configured by environment variables):
    dataset: tasks/triviaqa.py:train_rows    the training questions
    tasks/triviaqa.py:eval_rows              held-out questions, disjoint from train_rows, for evaluation

Rows: {"prompt": the question, "aliases": [accepted answers], "answer": the canonical answer,
       "question_id": ...}. `rewards/triviaqa_reward.py` reads `aliases`; the trainer puts the tool
list in the system prompt, so `prompt` is the bare question.

Sources (TRIVIAQA_PATH):
- a local file, .jsonl / .json / .parquet: TriviaQA records as the HF dataset has them
  (`question`, `question_id`, `answer: {value, aliases, normalized_aliases}`), the official release's
  JSON (`{"Data": [{"Question", "QuestionId", "Answer": {"Value", "Aliases", ...}}]}`), or flat rows
  (`question` or `prompt`, plus `aliases` or `answer`). One file is split in two, deterministically:
  the TRIVIAQA_EVAL_SIZE questions with the smallest sha1(question_id) are eval, the rest train.
- otherwise a Hugging Face dataset name (default mandarjoshi/trivia_qa, config TRIVIAQA_CONFIG,
  default rc.nocontext: the `rc` questions without their evidence documents, a small download; `rc`
  works too). train_rows reads split `train`; eval_rows reads `validation` (TriviaQA's `test` has no
  answers), its TRIVIAQA_EVAL_SIZE questions with the smallest sha1(question_id).
Questions are de-duplicated by question_id (`rc` lists a question once per evidence domain), and
questions without an answer are dropped.

Environment variables:
  TRIVIAQA_PATH        local file or HF dataset name (default mandarjoshi/trivia_qa)
  TRIVIAQA_CONFIG      HF config (default rc.nocontext)
  TRIVIAQA_EVAL_SIZE   eval questions (default 500)
  TRIVIAQA_TRAIN_SIZE  cap on train questions, taken in sha1 order (default 0 = all)
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.wiki_search import _env_int  # noqa: E402  (the task's tool reads its settings the same way)

DEFAULT_SOURCE = "mandarjoshi/trivia_qa"
DEFAULT_CONFIG = "rc.nocontext"
DEFAULT_EVAL_SIZE = 500
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _get(rec: dict, *keys):
    for k in keys:
        if rec.get(k) is not None:
            return rec[k]
    return None


def to_row(rec: dict) -> dict | None:
    """One record (HF, official or flat layout) -> a row, or None when it has no question or no answer."""
    question = _get(rec, "question", "Question", "prompt")
    if not isinstance(question, str) or not question.strip():
        return None
    ans = _get(rec, "answer", "Answer")
    value, aliases = None, list(_get(rec, "aliases") or [])
    if isinstance(ans, dict):
        value = _get(ans, "value", "Value")
        aliases += list(_get(ans, "aliases", "Aliases") or []) or list(
            _get(ans, "normalized_aliases", "NormalizedAliases") or []
        )
    elif isinstance(ans, str):
        value = ans
    elif isinstance(ans, (list, tuple)):
        aliases += list(ans)
    aliases = [a for a in dict.fromkeys(str(a).strip() for a in ([value] if value else []) + aliases) if a]
    if not aliases:
        return None
    qid = _get(rec, "question_id", "QuestionId", "id")
    qid = str(qid) if qid is not None else "q-" + hashlib.sha1(question.strip().encode()).hexdigest()[:16]
    return {"prompt": question.strip(), "aliases": aliases, "answer": value or aliases[0], "question_id": qid}


def read_local(path: str) -> list[dict]:
    """Records of a local .jsonl, .json (a list, or the official {"Data": [...]}) or .parquet file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
    return data["Data"] if isinstance(data, dict) and "Data" in data else list(data)


def read_hub(name: str, config: str, split: str) -> list[dict]:
    """Records of a Hugging Face dataset split (downloaded once into the HF datasets cache)."""
    from datasets import load_dataset

    ds = load_dataset(name, config, split=split)
    keep = [c for c in ("question", "question_id", "answer") if c in ds.column_names]
    return ds.select_columns(keep).to_list()


def _rank(row: dict) -> str:
    return hashlib.sha1(row["question_id"].encode()).hexdigest()


def rows_of(records) -> list[dict]:
    """Rows of records, de-duplicated by question_id and sorted by sha1(question_id): a fixed, shuffled order."""
    rows = {}
    for rec in records:
        row = to_row(rec)
        if row is not None:
            rows.setdefault(row["question_id"], row)
    return sorted(rows.values(), key=_rank)


def make_dataset(
    split: str = "train",
    path: str | None = None,
    config: str | None = None,
    eval_size: int | None = None,
    limit: int | None = None,
) -> list[dict]:
    """Rows of one split ("train" or "eval"); None arguments fall back to the environment variables above.
    `limit` caps the rows returned (default: TRIVIAQA_TRAIN_SIZE for train, all of the eval set)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    source = path or os.environ.get("TRIVIAQA_PATH", "").strip() or DEFAULT_SOURCE
    eval_size = _env_int("TRIVIAQA_EVAL_SIZE", DEFAULT_EVAL_SIZE) if eval_size is None else eval_size
    if limit is None and split == "train":
        limit = _env_int("TRIVIAQA_TRAIN_SIZE", 0)
    local = os.path.exists(source) or source.endswith(LOCAL_SUFFIXES)
    if local:
        if not os.path.isfile(source):
            raise FileNotFoundError(f"TriviaQA file not found: {source} (from TRIVIAQA_PATH or the path argument)")
        rows = rows_of(read_local(source))
        if not 0 <= eval_size < len(rows):
            raise ValueError(
                f"{source} has {len(rows)} answered questions: an eval split of {eval_size} "
                f"(TRIVIAQA_EVAL_SIZE) leaves none to train on; set a smaller TRIVIAQA_EVAL_SIZE"
            )
        rows = rows[:eval_size] if split == "eval" else rows[eval_size:]
    else:
        config = config or os.environ.get("TRIVIAQA_CONFIG", "").strip() or DEFAULT_CONFIG
        rows = rows_of(read_hub(source, config, "train" if split == "train" else "validation"))
        if split == "eval":
            rows = rows[:eval_size]
    if not rows:
        raise ValueError(f"no {split} rows with an answer in {source}")
    return rows[:limit] if limit else rows


def train_rows() -> list[dict]:
    """Training questions (see the module docstring for the source and the split)."""
    return make_dataset("train")


def eval_rows() -> list[dict]:
    """Held-out questions, disjoint from train_rows()."""
    return make_dataset("eval")
