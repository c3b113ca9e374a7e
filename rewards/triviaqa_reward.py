"""Rewards of the TriviaQA search task (the paper's setting: MT-GRPO, Zeng et al. 2025, Sec. 5).

A reward function is `fn(completions, **dataset_columns) -> list[float]`: `completions[i]` is
episode i's generated messages (assistant turns and environment replies, after the prompt), and
each dataset column arrives as a list aligned with `completions`. Unused columns land in `**kwargs`.

Gold column: `aliases` (list[str]: every accepted answer, as `tasks/triviaqa.py` writes it). Rows
that only have `answer` (a string or a list of strings) work too.

Turn level (the first tool call and its result):
- tool_execution_reward_func      [0, 0.2]  0.2 x fraction of tool calls that succeeded (a result
                                            that is neither empty nor an "Error: ..." message)
- exist_answer_in_search_results  {0, 0.5}  0.5 if a gold alias occurs in the FIRST tool result
Outcome level (the final <answer>):
- exact_match_reward_func         {0, 1.0}  1.0 if the answer equals a gold alias
- exist_answer_reward_func        {0, 0.5}  0.5 if a gold alias occurs in the answer
- format_reward_func              [0, 0.2]  per assistant turn, averaged: tag sets present (0.4),
                                            nothing outside the tags (0.2), starts with <reasoning> (0.2),
                                            ends with </tool> or </answer> (0.2); x 0.2
- xml_reward_func                 [0, 0.2]  per assistant turn, averaged: each tag used opens and
                                            closes exactly once; x 0.2, floored at 0
The paper sums all six with weight 1: turn reward in [0, 0.7], outcome reward in [0, 1.9].

Per turn (the intermediate rewards of the paper's v2, arXiv 2505.11821v2 Sec. 6): these return, per episode, a
list with one number per assistant message, and an assistant message's tool results are the messages after
it, up to the next assistant message. The functions above return one number per episode.
- retrieval_turn_reward           {0, 0.3}  0.3 on the first turn whose tool result holds a gold alias
- format_turn_reward              {0.1, -0.2}  0.1 for a well-formed turn (<reasoning>...</reasoning>, then
                                            one <tool>...</tool> or <answer>...</answer>, nothing else, each
                                            tag once), -0.2 otherwise
- search_penalty_turn_reward      -LAMBDA_S per search the turn made, so an episode's entries sum to
                                            -LAMBDA_S x its number of searches (keyword `lambda_s`)
- tool_execution_turn_reward      [0, 0.2]  tool_execution_reward_func per turn: each turn gets 0.2 x its own
                                            calls that succeeded / the episode's calls, so the entries sum to
                                            the paper's number
Where a number lands: the trainer puts a turn function's number on the turn that called the first tool. For
`exist_answer_in_search_results`, which scores the first result, that is the turn it scores. For
`tool_execution_reward_func`, a rate over every call, it is not: under `advantage_mode: tree` and `reward_to_go` a
later turn would never be credited for its own calls. Use tool_execution_turn_reward there; mt_grpo and GRPO-MR
sum a turn function's entries, so for them the two are the same up to float rounding.
LAMBDA_S = 0.15, our choice: a well-formed search turn earns 0.1 of format, so a penalty above 0.1 makes a
search that finds nothing cost something, and one below 0.2 leaves the search that finds the answer a clear
gain (0.3 + 0.1 - 0.15). Another value: functools.partial(search_penalty_turn_reward, lambda_s=...).
Only the first turn that finds an alias earns the retrieval reward: paid on every such turn, a search repeated
after it found the answer would earn 0.3 + 0.1 - LAMBDA_S each time, and the policy would be paid to repeat it
until max_env_steps.

Matching uses TriviaQA's own answer normalisation (`normalize_answer`: lowercase, punctuation and
underscores to spaces, drop articles, collapse whitespace), the one behind the dataset's
`normalized_aliases`. "Occurs in" means as whole words of the normalised text ("york" occurs in
"born in york england", not in "yorkshire"). The paper's code compared lowercased strings and
plain substrings; normalising counts "The Beatles." as "beatles" and stops "us" matching "business".

Differences to the paper's code, on purpose: an "Error: ..." first result earns no search reward
(the paper matched inside it, and our error messages can echo arguments); its format check for
"spacing" always passed, ours asks that nothing but whitespace lies outside the tags; `<think>`
blocks (thinking models) are ignored by every check. Both tool protocols work: XML (the result is a
user message `<result>...</result>`) and native (role "tool"); the format rewards measure the XML
protocol only.
"""

import re
import string

RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
THINK = re.compile(r"<think>.*?</think>", re.S)
FIELDS = [("reasoning",), ("tool", "answer")]  # the protocol: <reasoning>, then <tool> or <answer>
PUNCT = set(string.punctuation + "\u2018\u2019\u00b4`")  # TriviaQA's set: ASCII punctuation and quote-like marks
WELL_FORMED = re.compile(r"<reasoning>.*?</reasoning>\s*(<tool>.*?</tool>|<answer>.*?</answer>)", re.S)
LAMBDA_S = 0.15  # the search-count penalty per search (module docstring)


# --- normalisation and episode parsing --------------------------------------------------------


def normalize_answer(s: str) -> str:
    """TriviaQA's answer normalisation (triviaqa/utils/dataset_utils.py, as behind `normalized_aliases`)."""
    s = str(s).replace("_", " ").lower()
    s = "".join(" " if ch in PUNCT else ch for ch in s)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def contains(text_norm: str, alias_norm: str) -> bool:
    """Whole-word containment of one normalised string in another."""
    return bool(alias_norm) and f" {alias_norm} " in f" {text_norm} "


def gold_lists(aliases, answer, n: int) -> list[list[str]]:
    """Per episode, the normalised gold aliases (empty ones dropped: "The" normalises to "")."""
    col = aliases if aliases is not None else answer
    if col is None:
        raise ValueError("TriviaQA rewards need a dataset column 'aliases' (list of accepted answers) or 'answer'")
    if len(col) != n:
        raise ValueError(f"gold column has {len(col)} rows for {n} completions")
    out = []
    for g in col:
        g = [g] if isinstance(g, str) else list(g or [])
        out.append([a for a in dict.fromkeys(normalize_answer(x) for x in g) if a])
    return out


def is_env_reply(m: dict) -> bool:
    """A tool result: native role 'tool', or the XML protocol's user message <result>...</result>."""
    return m.get("role") == "tool" or (m.get("role") == "user" and str(m.get("content", "")).startswith(RESULT_OPEN))


def tool_results(messages: list[dict]) -> list[str]:
    """The text of every tool result in an episode, in order (one per executed tool call)."""
    out = []
    for m in messages:
        if not is_env_reply(m):
            continue
        text = str(m.get("content") or "").strip()
        if m["role"] == "user":  # XML: strip the <result> wrapper (only the outer one)
            text = text[len(RESULT_OPEN) :]
            text = text[: -len(RESULT_CLOSE)] if text.endswith(RESULT_CLOSE) else text
        out.append(text.strip())
    return out


def is_error(result: str) -> bool:
    return not result.strip() or result.lstrip().startswith("Error:")


def holds_answer(result: str, gold: list[str]) -> bool:
    """A tool result that is not an error and holds a normalised gold alias as whole words."""
    return not is_error(result) and any(contains(normalize_answer(result), a) for a in gold)


def final_answer(messages: list[dict]) -> str | None:
    """Text of the last <answer>...</answer> of the last assistant message that has one, or None."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            hits = ANSWER.findall(THINK.sub("", str(m.get("content") or "")))
            if hits:
                return hits[-1].strip()
    return None


def assistant_texts(messages: list[dict]) -> list[str]:
    return [text for text, _ in turns(messages)]


def turns(messages: list[dict]) -> list[tuple[str, list[str]]]:
    """Per assistant message: its text (without <think> blocks) and the tool results after it, up to the next one."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            out.append((THINK.sub("", str(m.get("content") or "")).strip(), []))
        elif out and is_env_reply(m):
            out[-1][1].extend(tool_results([m]))
    return out


# --- turn level -------------------------------------------------------------------------------


def tool_execution_reward_func(completions, **kwargs) -> list[float]:
    """0.2 x (tool calls that returned a non-error result) / (tool calls executed); 0 without tool calls."""
    out = []
    for c in completions:
        results = tool_results(c)
        out.append(0.2 * sum(not is_error(r) for r in results) / len(results) if results else 0.0)
    return out


def exist_answer_in_search_results(completions, aliases=None, answer=None, **kwargs) -> list[float]:
    """0.5 if a gold alias occurs (normalised, whole words) in the first tool result; 0 if that is an error."""
    golds = gold_lists(aliases, answer, len(completions))
    out = []
    for c, gold in zip(completions, golds):
        results = tool_results(c)
        out.append(0.5 if results and holds_answer(results[0], gold) else 0.0)
    return out


# --- outcome level ----------------------------------------------------------------------------


def exact_match_reward_func(completions, aliases=None, answer=None, **kwargs) -> list[float]:
    """1.0 if the normalised final <answer> equals a normalised gold alias."""
    golds = gold_lists(aliases, answer, len(completions))
    out = []
    for c, gold in zip(completions, golds):
        a = final_answer(c)
        out.append(1.0 if a is not None and normalize_answer(a) in gold else 0.0)
    return out


def exist_answer_reward_func(completions, aliases=None, answer=None, **kwargs) -> list[float]:
    """0.5 if a normalised gold alias occurs (whole words) in the normalised final <answer>."""
    golds = gold_lists(aliases, answer, len(completions))
    out = []
    for c, gold in zip(completions, golds):
        a = final_answer(c)
        out.append(0.5 if a is not None and any(contains(normalize_answer(a), g) for g in gold) else 0.0)
    return out


def turn_format_score(text: str) -> float:
    """Format of one assistant turn in [0, 1] (see the module docstring)."""
    tags = [alt for field in FIELDS for alt in field]
    parsed = any(re.search(rf"<{t}>.*?</{t}>", text, re.S) for t in tags)
    present = sum(any(f"<{t}>" in text or f"</{t}>" in text for t in field) for field in FIELDS)
    outside = re.sub("|".join(rf"<{t}>.*?</{t}>" for t in tags), "", text, flags=re.S)
    score = 0.4 * present / len(FIELDS) if parsed else 0.0
    score += 0.2 if parsed and not outside.strip() else 0.0
    score += 0.2 if text.startswith("<reasoning>") else 0.0
    score += 0.2 if text.endswith(("</tool>", "</answer>")) else 0.0
    return score


def format_reward_func(completions, **kwargs) -> list[float]:
    """0.2 x the mean format score of the episode's assistant turns; 0 without assistant turns."""
    out = []
    for c in completions:
        turns = assistant_texts(c)
        out.append(0.2 * sum(map(turn_format_score, turns)) / len(turns) if turns else 0.0)
    return out


def turn_xml_score(text: str) -> float:
    """Tag usage of one assistant turn: for each protocol tag used, 1 - |count - 1| for its opening and
    for its closing tag, averaged (1.0 = every tag used once; duplicates go negative; no tags = 0)."""
    score, checks = 0, 0
    for t in (alt for field in FIELDS for alt in field):
        n_open, n_close = text.count(f"<{t}>"), text.count(f"</{t}>")
        if n_open or n_close:
            score += (1 - abs(n_open - 1)) + (1 - abs(n_close - 1))
            checks += 2
    return score / checks if checks else 0.0


def xml_reward_func(completions, **kwargs) -> list[float]:
    """0.2 x the mean tag-usage score of the episode's assistant turns, floored at 0."""
    out = []
    for c in completions:
        turns = assistant_texts(c)
        out.append(max(0.0, 0.2 * sum(map(turn_xml_score, turns)) / len(turns)) if turns else 0.0)
    return out


# --- per turn: the paper v2's intermediate rewards, one number per assistant message -----------------------


def retrieval_turn_reward(completions, aliases=None, answer=None, **kwargs) -> list[list[float]]:
    """Per turn: 0.3 on the first turn whose tool result holds a gold alias (an error result never does), else 0."""
    golds = gold_lists(aliases, answer, len(completions))
    out = []
    for c, gold in zip(completions, golds):
        found, row = False, []
        for _, results in turns(c):
            hit = not found and any(holds_answer(r, gold) for r in results)
            found = found or hit
            row.append(0.3 if hit else 0.0)
        out.append(row)
    return out


def tool_execution_turn_reward(completions, **kwargs) -> list[list[float]]:
    """Per turn: 0.2 x (its tool calls that returned a non-error result) / (the episode's tool calls executed); the
    entries sum to tool_execution_reward_func's number, and each sits on the turn whose calls earned it."""
    out = []
    for c in completions:
        per_turn = [results for _, results in turns(c)]
        calls = sum(map(len, per_turn))
        out.append([0.2 * sum(not is_error(r) for r in results) / max(calls, 1) for results in per_turn])
    return out


def well_formed(text: str) -> bool:
    """<reasoning>...</reasoning>, then one <tool>...</tool> or <answer>...</answer>, nothing else, each tag once."""
    used = {t: (text.count(f"<{t}>"), text.count(f"</{t}>")) for t in ("reasoning", "tool", "answer")}
    one_action = sorted([used["tool"], used["answer"]]) == [(0, 0), (1, 1)]
    return used["reasoning"] == (1, 1) and one_action and bool(WELL_FORMED.fullmatch(text))


def format_turn_reward(completions, **kwargs) -> list[list[float]]:
    """Per turn: 0.1 for a well-formed turn, -0.2 for a malformed one (the XML protocol)."""
    return [[0.1 if well_formed(text) else -0.2 for text, _ in turns(c)] for c in completions]


def search_penalty_turn_reward(completions, lambda_s: float = LAMBDA_S, **kwargs) -> list[list[float]]:
    """Per turn: -lambda_s for each search the turn made (each tool result after it), 0 on a turn without one."""
    return [[-lambda_s * len(results) if results else 0.0 for _, results in turns(c)] for c in completions]


TURN_REWARD_FUNCS = [tool_execution_reward_func, exist_answer_in_search_results]
PER_TURN_REWARD_FUNCS = [retrieval_turn_reward, format_turn_reward, search_penalty_turn_reward]
OUTCOME_REWARD_FUNCS = [exact_match_reward_func, exist_answer_reward_func, format_reward_func, xml_reward_func]
