"""Every command in README.md runs as written from the checkout: each line of its
``sh`` blocks is either run (with this venv's ``python`` and ``encdec`` first on
PATH) and must exit 0, or skipped for a stated reason (set-up, network, a GPU, a
server left running). A line that fits neither fails, so a new README command
cannot go unchecked. The Python blocks must parse, the relative links must point
at files that exist, and the README stays at most 250 lines."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250

# (pattern, why the line is not run here); the first that matches decides.
SKIPPED = [
    (r"^make (run|test)\b", "make run / make test are the suite's own entry points"),
    (r"^pip install\b", "installs packages (the venv running this test has them)"),
    (r"^encdec serve\b", "starts a server that keeps running"),
    (r"^curl\b", "talks to a running server"),
    (r"--model (facebook|openai)/", "downloads a checkpoint from the Hugging Face hub"),
]
# Lines run as written; the second element marks the slow ones (a real model).
RUN = [
    (r"^encdec( [a-z-]+)? --help$", False),
    (r"^python -m benchmarks\.[a-z_]+ --help$", False),
    (r"^encdec transcribe tests/data/speech/\S+\.wav$", True),
]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _commands() -> list[str]:
    """The commands of the ``sh`` blocks: continuation lines joined, comments and a
    trailing ``&`` dropped."""
    out = []
    for block in _blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(re.sub(r"\s*&$", "", line))
    return out


def _classify(command: str) -> tuple[str, str | None, bool]:
    """("skip", reason, _) or ("run", None, slow) or ("unknown", None, _)."""
    for pattern, reason in SKIPPED:
        if re.search(pattern, command):
            return "skip", reason, False
    for pattern, slow in RUN:
        if re.search(pattern, command):
            return "run", None, slow
    return "unknown", None, False


def _params():
    for command in _commands():
        kind, reason, slow = _classify(command)
        marks = [pytest.mark.slow] if slow else []
        if kind == "skip":
            marks.append(pytest.mark.skip(reason=reason))
        yield pytest.param(command, kind, marks=marks, id=command[:60])


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; the guides belong in docs/"


def test_the_readme_has_commands_to_check():
    kinds = [_classify(c)[0] for c in _commands()]
    assert kinds.count("run") >= 5 and kinds.count("skip") >= 3, kinds


@pytest.mark.parametrize("command,kind", list(_params()))
def test_readme_command_runs_as_written(command, kind, tmp_path):
    assert kind == "run", f"README command {command!r} is neither run nor skipped with a reason in {__file__}"
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "HF_HUB_OFFLINE": "1", "ENCDEC_NUM_THREADS": os.environ.get("ENCDEC_NUM_THREADS", "2")}
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{command!r} printed nothing"


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_readme_python_block_parses(index):
    assert ast.parse(_blocks("python")[index]).body  # a SyntaxError fails it; an empty block too


def test_readme_links_point_at_files():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "README links into docs/"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
