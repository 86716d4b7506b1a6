"""Reruns the commands the README and docs/ show and rewrites the outputs they are shown to print.

    .venv/bin/python tools/refresh_docs.py               # the cheap blocks (seconds each)
    .venv/bin/python tools/refresh_docs.py --expensive   # also demo, benchmarks, accuracy (hours)
    .venv/bin/python tools/refresh_docs.py --only demo   # one block by id
    .venv/bin/python tools/refresh_docs.py --check       # compare only (what tests/test_docs.py does)
    .venv/bin/python tools/refresh_docs.py --list

The tags and their options: ``benchmarks/docsync.py``.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks import docsync


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--expensive", action="store_true", help="also run the blocks tagged cost=expensive")
    p.add_argument("--only", nargs="+", metavar="ID", help="run these blocks (any cost)")
    p.add_argument("--check", action="store_true", help="compare with the shown outputs, rewrite nothing")
    p.add_argument("--list", action="store_true", help="list the tagged blocks and exit")
    args = p.parse_args(argv)
    try:
        blocks = docsync.all_blocks()
    except docsync.DocError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.list:
        for b in blocks:
            print(f"{b.id:24s} {b.opts.get('cost', 'cheap'):9s} {b.opts['lang']:6s} {b.where()}")
        return 0
    if args.only:
        unknown = set(args.only) - {b.id for b in blocks}
        if unknown:
            print(f"error: no block with id {sorted(unknown)}; see --list", file=sys.stderr)
            return 1
        todo = [b for b in blocks if b.id in args.only]
    else:
        todo = [b for b in blocks if b.cheap or args.expensive]
    results, failed = {}, 0
    for b in todo:
        t0 = time.time()
        try:
            got = docsync.run(b)
        except (RuntimeError, OSError) as e:
            print(f"FAILED {e}", file=sys.stderr)
            failed += 1
            continue
        diff = docsync.differences(b.output, got, b.opts)
        state = "same" if not diff else f"{len(diff)} line(s) differ"
        print(f"{b.id}: {state} ({time.time() - t0:.0f} s, {b.where()})")
        for d in diff[:5]:
            print("  " + d.replace("\n", "\n  "))
        failed += bool(diff) and args.check
        results.setdefault(b.path, {})[b.id] = got
    if not args.check:
        for path, res in results.items():
            n = docsync.rewrite(path, res)
            print(f"rewrote {n} block(s) in {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
