"""How densely a Python file is written: code tokens per code line, and the packing patterns behind a high figure.

    python bench/code_density.py mt_grpo_trainer.py [OTHER.py ...]

Counts with Python's `tokenize`. Docstrings, comments and layout (newlines, indents) are not code tokens, so a
line split in two adds a line and no token: a token budget cannot be met by packing, nor lost by unpacking.
For mt_grpo_trainer.py the read path (everything before the appendix banner) is measured on its own too.
tests/test_shape.py reads the same figures from `measure`.
"""

import ast
import io
import sys
import tokenize

LAYOUT = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}
APPENDIX_BANNER = "# APPENDIX: plumbing"


def docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers of every string that stands alone as a statement (docstrings, field docstrings)."""
    lines = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Expr):
            continue
        if not isinstance(node.value, ast.Constant):
            continue
        if not isinstance(node.value.value, str):
            continue
        lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def measure(source: str, first: int = 1, last: int | None = None) -> dict:
    """Code tokens, code lines, tokens per code line, parallel assignments binding 3+ names, and conditional
    expressions (`x if c else y`), over lines first..last (1-based, inclusive) of `source`."""
    tree = ast.parse(source)
    if last is None:
        last = len(source.splitlines())
    docs = docstring_lines(tree)
    tokens = 0
    code_lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        row = tok.start[0]
        if tok.type in LAYOUT or row in docs:
            continue
        if first <= row <= last:
            tokens += 1
            code_lines.add(row)
    packed = 0
    conditionals = 0
    for node in ast.walk(tree):
        if not first <= getattr(node, "lineno", 0) <= last:
            continue
        if isinstance(node, ast.Assign):
            packed += any(isinstance(t, ast.Tuple) and len(t.elts) >= 3 for t in node.targets)
        if isinstance(node, ast.IfExp):
            conditionals += 1
    n = max(len(code_lines), 1)
    return {
        "code_tokens": tokens,
        "code_lines": len(code_lines),
        "tokens_per_line": tokens / n,
        "parallel_assignments": packed,
        "conditionals_per_1000": 1000 * conditionals / n,
    }


def read_path_end(source: str) -> int:
    """The last line before the appendix banner (the whole file if it has none)."""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(APPENDIX_BANNER):
            return i
    return len(lines)


def row(name: str, m: dict) -> str:
    return (
        f"| {name} | {m['code_tokens']:,} | {m['code_lines']:,} | {m['tokens_per_line']:.1f} | "
        f"{m['parallel_assignments']} | {m['conditionals_per_1000']:.0f} |"
    )


def main(paths: list[str]):
    print(
        "| file | code tokens | code lines | tokens per code line | 3+-name assignments | `x if c else y` per 1,000 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for path in paths:
        with open(path) as f:
            source = f.read()
        print(row(path, measure(source)))
        end = read_path_end(source)
        if end < len(source.splitlines()):
            print(row(f"{path}, read path", measure(source, 1, end)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["mt_grpo_trainer.py"])
