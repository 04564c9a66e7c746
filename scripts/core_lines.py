"""Issue 26's measure of the engine core: its lines of code (lines holding a token; comments,
blank lines and docstrings left out), per file and in all.

    python3 scripts/core_lines.py [FILE ...]   (default: the core, as below)
"""
import ast
import glob
import io
import sys
import tokenize
from pathlib import Path

CORE = ("shoal/engine/*.py", "shoal/kv/*.py", "shoal/config.py", "shoal/request.py",
        "shoal/sampling.py")
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
        tokenize.ENDMARKER}


def code_lines(path: str) -> tuple[int, int]:
    """(lines of code, lines) of one file."""
    src = Path(path).read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in SKIP:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return len(lines), len(src.splitlines())


if __name__ == "__main__":
    files = sys.argv[1:] or sorted(f for pattern in CORE for f in glob.glob(pattern))
    total_code = total = 0
    for f in files:
        code, lines = code_lines(f)
        total_code, total = total_code + code, total + lines
        print(f"{code:5d} {lines:5d} {f}")
    print(f"{total_code:5d} {total:5d} total")
