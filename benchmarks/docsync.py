"""Shown outputs that cannot go stale: run the README's and docs' commands and rewrite what they print.

A fenced block that a reader is shown to run is tagged with an HTML comment on the line above it
(invisible when rendered); the next fenced block after it is the output it prints::

    <!-- run: id=models-meter lang=python cost=cheap ignore="img/s" -->
    ```python
    import models ...
    ```
    prints
    ```
    saved 18.8 MiB with Mesa vs 113.3 MiB: 0.166x
    ```

Options (``key=value``, values with spaces in double quotes):

=========  ===========================================================================================
id         unique name (``tools/refresh_docs.py --only ID``)
lang       ``python`` (run by this interpreter) or ``bash``
cost       ``cheap``: run and compared by the docs test (tests/test_docs.py); ``expensive``: run only by
           ``tools/refresh_docs.py --expensive``, which writes a stamp line under the output (commit,
           date): such an output is the code's at that commit, not necessarily at HEAD
grep       regex: only the output lines that match are shown (and compared)
tail       only the last N of those lines
ignore     regex: lines that match are not compared (timings, dates); they are still rewritten
mask       regex: the parts of a line that match are not compared (``eta: \\S+``, ``step \\S+ ms``)
tol        relative tolerance of every number when compared (default 0.02); text must be equal
timeout    seconds (default 900)
env        extra environment variables, ``"A=1 B=2"``
=========  ===========================================================================================

A command runs in a scratch directory whose entries link to the repo's top level (so ``configs/``,
``tools/``, ``.venv/`` resolve and ``outputs/`` is written there, never into the checkout), with the
repo on ``PYTHONPATH``, ``OMP_NUM_THREADS=1`` and, for the cheap blocks (the ones the docs test
compares), the variables of :func:`same_digits_env` (each unless already set; ``env`` overrides).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- run: (?P<opts>.*) -->\s*$")
FENCE = re.compile(r"^(```+|~~~+)")
STAMP = re.compile(r"^<sub>Output of commit .*</sub>\s*$")
NUMBER = re.compile(r"([-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)")
KEYS = {"id", "lang", "cost", "grep", "tail", "ignore", "mask", "tol", "timeout", "env"}


class DocError(ValueError):
    """A tagged block that cannot be parsed: names the file, the line and what was expected."""


@dataclasses.dataclass
class Block:
    """One tagged command: ``code`` (lines ``code_span``) and its shown output (lines ``out_span``)."""
    path: Path
    line: int                      # 1-based line of the marker
    opts: dict
    code: str
    code_span: tuple[int, int]     # 0-based [first, last] of the code fence lines
    out_span: tuple[int, int]      # 0-based [first, last] of the output fence lines
    output: str                    # the output as the file shows it now
    stamp_line: int | None         # 0-based line of an existing stamp, if any

    @property
    def id(self) -> str:
        return self.opts["id"]

    @property
    def cheap(self) -> bool:
        return self.opts.get("cost", "cheap") == "cheap"

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def _fence_end(lines: list[str], start: int, path: Path) -> int:
    fence = FENCE.match(lines[start]).group(1)
    for i in range(start + 1, len(lines)):
        if lines[i].rstrip() == fence:
            return i
    raise DocError(f"{path}:{start + 1}: fenced block never closed")


def parse(path: Path) -> list[Block]:
    """All tagged blocks of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        try:
            pairs = shlex.split(m.group("opts"))
        except ValueError as e:
            raise DocError(f"{path}:{i + 1}: bad run options ({e})") from None
        opts = {}
        for p in pairs:
            key, sep, value = p.partition("=")
            if not sep or key not in KEYS:
                raise DocError(f"{path}:{i + 1}: bad run option {p!r}; expected key=value with key in "
                               f"{sorted(KEYS)}")
            opts[key] = value
        if "id" not in opts or opts.get("lang") not in ("python", "bash"):
            raise DocError(f"{path}:{i + 1}: a run marker needs id=NAME and lang=python|bash")
        if opts.get("cost", "cheap") not in ("cheap", "expensive"):
            raise DocError(f"{path}:{i + 1}: cost must be cheap or expensive, got {opts['cost']!r}")
        c0 = i + 1
        if c0 >= len(lines) or not FENCE.match(lines[c0]):
            raise DocError(f"{path}:{i + 1}: a run marker must be followed directly by a fenced code block")
        c1 = _fence_end(lines, c0, path)
        o0 = c1 + 1
        while o0 < len(lines) and not FENCE.match(lines[o0]):
            if MARKER.match(lines[o0]) or lines[o0].startswith("#"):
                raise DocError(f"{path}:{i + 1}: no output block after the code block of {opts['id']!r}")
            o0 += 1
        if o0 >= len(lines):
            raise DocError(f"{path}:{i + 1}: no output block after the code block of {opts['id']!r}")
        o1 = _fence_end(lines, o0, path)
        stamp = o1 + 1 if o1 + 1 < len(lines) and STAMP.match(lines[o1 + 1]) else None
        blocks.append(Block(path, i + 1, opts, "\n".join(lines[c0 + 1:c1]), (c0, c1), (o0, o1),
                            "\n".join(lines[o0 + 1:o1]), stamp))
        i = o1 + 1
    ids = [b.id for b in blocks]
    dup = {x for x in ids if ids.count(x) > 1}
    if dup:
        raise DocError(f"{path}: run ids used twice: {sorted(dup)}")
    return blocks


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in doc_files(root) for b in parse(p)]


def _scratch_dir(root: Path) -> str:
    d = tempfile.mkdtemp(prefix="mesa_docs_")
    for entry in root.iterdir():
        if entry.name not in ("outputs", ".git"):
            os.symlink(entry, os.path.join(d, entry.name))
    return d


def same_digits_env() -> dict:
    """The environment the cheap shown outputs are produced and checked in: one thread, and on x86
    torch's CPU kernels (ATen's vector loops, oneDNN, MKL) at the AVX2 width, so that an AVX-512
    machine sums in the order an AVX2 one does. A Mesa run's stochastic rounding turns any
    last-bit difference into a different run within an epoch; in this environment the docs'
    Mesa training runs print the same digits on both kinds of machine (the thread count no
    longer matters: tests/test_determinism.py)."""
    env = {"OMP_NUM_THREADS": "1"}
    if platform.machine().lower() in ("x86_64", "amd64"):
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    return env


def run(block: Block, root: Path = ROOT) -> str:
    """Runs the block's code and returns the output to show (after grep / tail). Raises on failure."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    base = same_digits_env() if block.cheap else {"OMP_NUM_THREADS": "1"}
    for k, v in base.items():
        env.setdefault(k, v)
    for kv in shlex.split(block.opts.get("env", "")):
        k, _, v = kv.partition("=")
        env[k] = v
    if block.opts["lang"] == "python":
        cmd = [sys.executable, "-c", block.code]
    else:
        cmd = ["bash", "-c", "set -eo pipefail\n" + block.code]
    cwd = _scratch_dir(root)
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=float(block.opts.get("timeout", 900)))
    finally:
        subprocess.run(["rm", "-rf", cwd], check=False)
    text = proc.stdout + (proc.stderr if block.opts["lang"] == "bash" else "")
    if proc.returncode != 0:
        raise RuntimeError(f"{block.where()} ({block.id}): exit status {proc.returncode}\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    lines = [ln.rstrip() for ln in text.splitlines()]
    if "grep" in block.opts:
        pat = re.compile(block.opts["grep"])
        lines = [ln for ln in lines if pat.search(ln)]
    if "tail" in block.opts:
        lines = lines[-int(block.opts["tail"]):]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def _numbers_close(a: str, b: str, tol: float) -> bool:
    fa, fb = float(a), float(b)
    if math.isclose(fa, fb, rel_tol=tol, abs_tol=0.0):
        return True
    # one unit of the last shown digit is always allowed (0.166 vs 0.167, 4 vs 5 is not)
    digits = max(len(a.partition(".")[2]) if "." in a else 0, len(b.partition(".")[2]) if "." in b else 0)
    return digits > 0 and abs(fa - fb) <= 10.0 ** -digits + 1e-12


def differences(shown: str, got: str, opts: dict) -> list[str]:
    """Lines where ``got`` (a fresh run) differs from ``shown`` beyond the block's tolerances."""
    tol = float(opts.get("tol", 0.02))
    ignore = re.compile(opts["ignore"]) if "ignore" in opts else None
    mask = re.compile(opts["mask"]) if "mask" in opts else None
    keep = lambda text: [mask.sub("<masked>", ln) if mask else ln  # noqa: E731
                         for ln in text.splitlines() if not (ignore and ignore.search(ln))]
    a, b = keep(shown), keep(got)
    if len(a) != len(b):
        return [f"{len(a)} lines shown, {len(b)} printed:\n--- shown\n{shown}\n--- printed\n{got}"]
    out = []
    for la, lb in zip(a, b):
        pa, pb = NUMBER.split(la), NUMBER.split(lb)
        same = len(pa) == len(pb) and all(
            (_numbers_close(x, y, tol) if k % 2 else " ".join(x.split()) == " ".join(y.split()))
            for k, (x, y) in enumerate(zip(pa, pb)))
        if not same:
            out.append(f"shown:   {la}\nprinted: {lb}")
    return out


def _commit(root: Path) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        # (changes to Markdown files and plots only, e.g. the docs being refreshed, leave the
        # code at HEAD)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)*.md", ":(exclude)*.png"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+changes" if dirty else "")


def rewrite(path: Path, results: dict[str, str], root: Path = ROOT) -> int:
    """Writes fresh outputs (``results``: id -> text) into ``path``; expensive blocks get a stamp.
    Returns how many blocks changed."""
    lines = path.read_text().splitlines()
    changed = 0
    stamp_date = datetime.date.today().isoformat()
    for b in reversed(parse(path)):          # bottom up: earlier spans stay valid
        if b.id not in results:
            continue
        new = results[b.id].splitlines()
        o0, o1 = b.out_span
        tail = []
        if not b.cheap:
            tail = [f"<sub>Output of commit {_commit(root)}, {stamp_date}, written by tools/refresh_docs.py "
                    f"--only {b.id}</sub>"]
        end = b.stamp_line + 1 if b.stamp_line is not None else o1 + 1
        repl = [lines[o0]] + new + [lines[o1]] + tail
        if lines[o0:end] != repl:
            changed += 1
        lines[o0:end] = repl
    path.write_text("\n".join(lines) + "\n")
    return changed
