"""The outputs the README and docs/ show are what the code prints (issue 25).

Every cheap tagged block (``<!-- run: ... -->``, see ``benchmarks/docsync.py``) is run and compared
with the output shown under it: text equal, numbers within the block's relative tolerance (2% by
default), lines matching its ``ignore`` pattern (timings) skipped. Expensive blocks (the
benchmarks, the test suite itself) are not run here; they must carry the stamp of the commit and
date that produced them.
"""
from __future__ import annotations

import textwrap

import pytest

from benchmarks import docsync

BLOCKS = docsync.all_blocks()


def test_the_docs_parse_and_the_readme_is_short():
    assert {b.id for b in BLOCKS} >= {"frontier", "accuracy", "reinvest", "models-meter", "budget"}
    readme = (docsync.ROOT / "README.md").read_text().splitlines()
    assert len(readme) < 250, f"README.md has {len(readme)} lines; keep it under 250 (details go to docs/)"


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.cheap], ids=lambda b: b.id)
def test_expensive_outputs_are_stamped(block):
    assert block.stamp_line is not None, (
        f"{block.where()}: the output of {block.id!r} has no stamp; run tools/refresh_docs.py --only {block.id}")
    assert "to be produced" not in block.output


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.cheap], ids=lambda b: b.id)
def test_cheap_outputs_are_current(block):
    got = docsync.run(block)
    diff = docsync.differences(block.output, got, block.opts)
    assert not diff, (f"{block.where()}: {block.id!r} prints something else than shown; run "
                      f"tools/refresh_docs.py --only {block.id}\n" + "\n".join(diff))


def test_compare_tolerances():
    opts = {"tol": "0.02", "ignore": "step"}
    assert not docsync.differences("saved 18.7 MiB: 0.165x", "saved 18.8 MiB: 0.166x", opts)
    assert docsync.differences("saved 18.7 MiB: 0.165x", "saved 29.2 MiB: 0.258x", opts)
    assert docsync.differences("24 Mesa layers", "25 Mesa layers", opts)          # counts are exact
    assert docsync.differences("fc: 9/9 layers", "gelu: 9/9 layers", opts)       # text is exact
    assert not docsync.differences("a\nstep 14.6 ms", "a\nstep 99.1 ms", opts)   # ignored line
    assert docsync.differences("a", "a\nb", opts)                                # line count
    masked = {"mask": r"eta: \S+"}
    assert not docsync.differences("loss 2.30 eta: 0:03:20", "loss 2.30 eta: 0:00:01", masked)
    assert docsync.differences("loss 2.30 eta: 0:03:20", "loss 2.41 eta: 0:00:01", masked)


def test_rewrite_and_parse_errors(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(textwrap.dedent("""\
        # t
        <!-- run: id=hello lang=python cost=expensive -->
        ```python
        print("hi")
        ```
        prints
        ```
        old
        ```
        after
        """))
    (b,) = docsync.parse(md)
    assert (b.code, b.output, b.stamp_line) == ('print("hi")', "old", None)
    assert docsync.run(b, root=tmp_path) == "hi"
    docsync.rewrite(md, {"hello": "hi"}, root=tmp_path)
    docsync.rewrite(md, {"hello": "hi"}, root=tmp_path)      # idempotent: one stamp, not two
    text = md.read_text()
    assert text.count("<sub>Output of commit") == 1 and "\nhi\n" in text and text.endswith("after\n")
    (b,) = docsync.parse(md)
    assert b.output == "hi" and b.stamp_line is not None
    md.write_text("<!-- run: id=x lang=perl -->\n```\n1\n```\n```\n2\n```\n")
    with pytest.raises(docsync.DocError, match="x.md:1: a run marker needs id=NAME and lang=python"):
        docsync.parse(md)
    md.write_text("<!-- run: id=x lang=bash colour=red -->\n```\n1\n```\n")
    with pytest.raises(docsync.DocError, match="bad run option 'colour=red'"):
        docsync.parse(md)
