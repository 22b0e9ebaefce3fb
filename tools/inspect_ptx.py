"""Summarise PTX files: instruction counts, and registers/spills via ptxas when it is on PATH.

    python tools/inspect_ptx.py DIR/*.ptx

A .cubin next to a .ptx (same stem) also gives registers and stack frame without ptxas.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None):
    from cute_attn.artifacts import format_table, report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="PTX files")
    p.add_argument("--no-ptxas", action="store_true", help="do not run ptxas -v even if available")
    args = p.parse_args(argv)
    reports = []
    for path in args.files:
        with open(path) as f:
            ptx = f.read()
        cubin_path = os.path.splitext(path)[0] + ".cubin"
        cubin = open(cubin_path, "rb").read() if os.path.exists(cubin_path) else None
        reports.append(report(os.path.basename(os.path.splitext(path)[0]), ptx, cubin, run_ptxas=not args.no_ptxas))
    print(format_table(reports))


if __name__ == "__main__":
    main()
