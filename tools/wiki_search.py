"""The TriviaQA task's tool: search a Wikipedia corpus, return the top passages with their titles.

Two backends, chosen per call from the environment:
- local BM25 (default) over a JSONL corpus, one passage per line: Search-R1's wiki-18 format
  `{"id": ..., "contents": "\"Title\"\\npassage text"}`, or `{"title": ..., "text": ...}`. The index
  (bm25s, English stemming and stopwords, as Lucene/pyserini's default analyzer) is built once per
  corpus file and cached on disk under a folder keyed by the file's path, size and mtime; a changed
  file gets a new index. Building is atomic (a temporary folder renamed into place) and serialised
  across processes by a file lock, so 8 ranks starting together build it once. Passages are read
  from the corpus by byte offset at query time, so memory holds the index, not the text.
  Build ahead of training with `python tools/wiki_search.py --build` (the first call builds it
  otherwise, and may run past the trainer's tool_timeout on a big corpus).
  The full wiki-18 (21M passages, 14 GB) is too big to index in memory here: serve it with
  Search-R1's retrieval server instead (next item), or index a subset.
- remote: with WIKI_SEARCH_URL set, POST `{url}/retrieve` with Search-R1's body
  `{"queries": [query], "topk": k, "return_scores": true}` (Search-R1's retrieval_server.py, BM25 or
  e5), with a timeout and retries on connection errors and 5xx.

Environment variables (read on every call):
  WIKI_SEARCH_CORPUS     corpus JSONL (default data/wiki-18.jsonl, relative to the working folder). wiki-18:
                         `huggingface-cli download PeterJinGo/wiki-18-corpus --repo-type dataset --local-dir data`
                         then `gzip -d data/wiki-18.jsonl.gz`
  WIKI_SEARCH_TOPK       passages per query (default 3)
  WIKI_SEARCH_MAX_CHARS  cap on the returned text, all passages together (default 1500)
  WIKI_SEARCH_CACHE      index cache folder (default .cache/wiki_search in the project folder)
  WIKI_SEARCH_URL        remote retriever base URL, e.g. http://127.0.0.1:8000 (unset = local BM25)
  WIKI_SEARCH_TIMEOUT    seconds per remote request (default 8); WIKI_SEARCH_RETRIES: extra tries (default 2)

Errors (missing corpus, retriever down) raise; the trainer's environment turns them into an
"Error: ..." result the model sees and counts them as tool errors (rollout/tool_errors).
The output never repeats the query, so a query cannot plant the answer in its own result.
"""

import fcntl
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import uuid

import numpy as np
import requests

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CORPUS = "data/wiki-18.jsonl"
INDEX_FORMAT = "bm25s-lucene-k1.5-b0.75-en-stem-v1"  # part of the cache key: change it when indexing changes
STATS = {"builds": 0, "loads": 0}  # index builds / loads from disk in this process
_INDEXES: dict = {}  # cache key -> (BM25 retriever, line offsets)
_LOCK = threading.Lock()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _stemmer():
    import Stemmer

    return Stemmer.Stemmer("english")


def _tokenize_queries(queries: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(queries, stopwords="en", stemmer=_stemmer(), return_ids=False, show_progress=False)


def split_passage(doc: dict) -> tuple[str, str]:
    """(title, text) of a corpus record: wiki-18 `contents` is '"Title"\\ntext'; or `title` + `text` fields."""
    if "contents" in doc:
        head, _, text = str(doc["contents"]).partition("\n")
        title = head.strip()
        if len(title) >= 2 and title[0] == title[-1] == '"':
            title = title[1:-1]
        return title, text.strip()
    return str(doc.get("title", "")).strip(), str(doc.get("text", "")).strip()


# --- local BM25 -------------------------------------------------------------------------------


def corpus_path() -> str:
    path = os.path.abspath(os.path.expanduser(os.environ.get("WIKI_SEARCH_CORPUS", "").strip() or DEFAULT_CORPUS))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"wiki_search corpus not found: {path}. Set WIKI_SEARCH_CORPUS to a JSONL file with one passage per "
            'line ({"id", "contents": "\\"Title\\"\\ntext"}, as Search-R1\'s wiki-18). To get wiki-18: '
            "huggingface-cli download PeterJinGo/wiki-18-corpus --repo-type dataset --local-dir data && "
            "gzip -d data/wiki-18.jsonl.gz. Or set WIKI_SEARCH_URL to a running Search-R1 retrieval server."
        )
    return path


def index_dir(path: str) -> str:
    """Cache folder of a corpus file's index: keyed by its absolute path, size and mtime."""
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{INDEX_FORMAT}".encode()).hexdigest()[:16]
    cache = os.environ.get("WIKI_SEARCH_CACHE", "").strip() or os.path.join(PROJECT, ".cache", "wiki_search")
    return os.path.join(os.path.abspath(os.path.expanduser(cache)), f"{os.path.basename(path)}-{key}")


def _read_corpus(path: str):
    """Yield (byte offset, indexed text) for every non-blank line of the corpus."""
    with open(path, "rb") as f:
        offset = 0
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    title, text = split_passage(json.loads(line))
                except (json.JSONDecodeError, AttributeError) as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON object per line ({e})") from None
                yield offset, f"{title}\n{text}"
            offset += len(line)


def build_index(path: str, out: str) -> dict:
    """Index the corpus at `path` into folder `out` (atomically: built aside, then renamed). Returns its meta."""
    import bm25s

    t0 = time.time()
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        offsets = []

        def texts():
            for off, text in _read_corpus(path):
                offsets.append(off)
                yield text

        tok = bm25s.tokenization.Tokenizer(stopwords="en", stemmer=_stemmer())
        ids = list(tok.streaming_tokenize(texts(), update_vocab=True))
        if not ids:
            raise ValueError(f"wiki_search corpus {path} has no passages")
        retriever = bm25s.BM25(k1=1.5, b=0.75)
        retriever.index((ids, tok.get_vocab_dict()), show_progress=False)
        retriever.save(tmp, show_progress=False)
        np.save(os.path.join(tmp, "offsets.npy"), np.asarray(offsets, dtype=np.int64))
        meta = {
            "corpus": path,
            "size": os.path.getsize(path),
            "passages": len(offsets),
            "format": INDEX_FORMAT,
            "bm25s": bm25s.__version__,
            "seconds": round(time.time() - t0, 2),
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    STATS["builds"] += 1
    return meta


def load_index(path: str):
    """(retriever, offsets) of a corpus: from this process's cache, else from disk, else built (once)."""
    out = index_dir(path)
    with _LOCK:
        if out in _INDEXES:
            return _INDEXES[out]
        import bm25s

        os.makedirs(os.path.dirname(out), exist_ok=True)
        if not os.path.isdir(out):
            with open(out + ".lock", "w") as lock:  # one builder across processes (DDP ranks)
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    if not os.path.isdir(out):
                        build_index(path, out)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        retriever = bm25s.BM25.load(out, mmap=False, show_progress=False)
        offsets = np.load(os.path.join(out, "offsets.npy"))
        STATS["loads"] += 1
        _INDEXES[out] = (retriever, offsets)
        return _INDEXES[out]


def search_local(query: str, k: int) -> list[tuple[str, str, float]]:
    path = corpus_path()
    retriever, offsets = load_index(path)
    tokens = _tokenize_queries([query])
    k = min(k, len(offsets))
    docs, scores = retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
    hits = []
    with open(path, "rb") as f:
        for i, s in zip(docs[0], scores[0]):
            if s <= 0:  # no query term in the passage: not a hit
                continue
            f.seek(int(offsets[int(i)]))
            title, text = split_passage(json.loads(f.readline()))
            hits.append((title, text, float(s)))
    return hits


# --- remote (Search-R1 retrieval server) ------------------------------------------------------


def search_remote(url: str, query: str, k: int) -> list[tuple[str, str, float]]:
    timeout = float(os.environ.get("WIKI_SEARCH_TIMEOUT", "").strip() or 8)
    retries = _env_int("WIKI_SEARCH_RETRIES", 2)
    endpoint = url.rstrip("/") + "/retrieve"
    for attempt in range(retries + 1):
        try:
            r = requests.post(endpoint, json={"queries": [query], "topk": k, "return_scores": True}, timeout=timeout)
            if r.status_code < 500:
                break
            err = RuntimeError(f"retriever {endpoint} answered HTTP {r.status_code}: {r.text[:200]}")
        except (requests.ConnectionError, requests.Timeout) as e:
            err = RuntimeError(f"retriever {endpoint} unreachable: {type(e).__name__}: {e}")
        if attempt == retries:
            raise err
        time.sleep(0.5 * 2**attempt)
    if r.status_code != 200:
        raise RuntimeError(f"retriever {endpoint} answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        items = r.json()["result"][0]
        hits = []
        for item in items:  # {"document": {...}, "score": s} with return_scores, else the document itself
            doc = item["document"] if isinstance(item, dict) and "document" in item else item
            title, text = split_passage(doc)
            hits.append((title, text, float(item.get("score", 0.0)) if "document" in item else 0.0))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise RuntimeError(
            f"retriever {endpoint} sent an unexpected body ({type(e).__name__}: {e}): {r.text[:200]}"
        ) from None
    return hits[:k]


# --- formatting and the tool ------------------------------------------------------------------


def format_hits(hits: list[tuple[str, str, float]], max_chars: int) -> str:
    """'Doc i (Title: t)\\ntext' blocks, at most `max_chars` in all: each passage gets an equal share of
    what is left (a short one leaves more for the next), and a cut passage ends with '...'."""
    if not hits:
        return "No results found."
    out, left = [], max_chars
    for i, (title, text, _) in enumerate(hits):
        sep = "\n\n" if out else ""
        share = left // (len(hits) - i) - len(sep)
        block = f"Doc {i + 1} (Title: {title})\n{text}"
        if len(block) > share:
            block = block[: share - 3].rstrip() + "..." if share > 3 else ""
        if block:
            out.append(sep + block)
            left -= len(sep) + len(block)
    return "".join(out)


def wiki_search(query: str) -> str:
    """Search Wikipedia and return the top passages for `query`, each with its article title.

    Args:
        query: what to look up, as keywords or a question, e.g. "Eiffel Tower completion year"
    """
    if not isinstance(query, str) or not query.strip():
        raise ValueError("query must be a non-empty string")
    k = _env_int("WIKI_SEARCH_TOPK", 3)
    max_chars = _env_int("WIKI_SEARCH_MAX_CHARS", 1500)
    if k < 1 or max_chars < 1:
        raise ValueError("WIKI_SEARCH_TOPK and WIKI_SEARCH_MAX_CHARS must be >= 1")
    url = os.environ.get("WIKI_SEARCH_URL", "").strip()
    hits = search_remote(url, query, k) if url else search_local(query, k)
    return format_hits(hits, max_chars)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build the wiki_search BM25 index ahead of training, or try a query.")
    ap.add_argument("--build", action="store_true", help="build (or find) the index of WIKI_SEARCH_CORPUS")
    ap.add_argument("query", nargs="*", help="a query to run")
    a = ap.parse_args()
    if a.build:
        t0 = time.time()
        p = corpus_path()
        load_index(p)
        print(f"index of {p}: {index_dir(p)} ({'built' if STATS['builds'] else 'cached'}, {time.time() - t0:.1f}s)")
    if a.query:
        print(wiki_search(" ".join(a.query)))
    if not (a.build or a.query):
        ap.print_help()
        sys.exit(2)
