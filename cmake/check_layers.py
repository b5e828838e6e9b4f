#!/usr/bin/env python3
"""Check kvq's header layering against the layer table of docs/architecture.md.

Usage: check_layers.py --table docs/architecture.md ROOT [ROOT...]

Each ROOT is an include directory (include/, extras/include/) holding kvq/...; every header under
ROOT/kvq is read and each `#include "kvq/..."` (or <kvq/...>) in it is checked: the included
header must belong to the including header's own layer or to a layer its row lists under
"May include". A header or include whose path matches no layer is an error too.

Exit 0 and a one-line summary when every include points down; exit 1 naming each offending
include (file:line) otherwise; exit 2 on a usage or table error.
"""
import argparse
import os
import re
import sys

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"](kvq/[^">]+)[">]')


def parse_table(path):
    """Return [(layer, [path prefixes], set(may_include))] from the marked table."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        sys.exit(f"check_layers: cannot read {path}: {e}")
    m = re.search(r"<!-- layers:begin -->(.*?)<!-- layers:end -->", text, re.S)
    if not m:
        print(f"check_layers: {path}: no <!-- layers:begin/end --> table", file=sys.stderr)
        sys.exit(2)
    layers = []
    for line in m.group(1).splitlines():
        line = line.strip()
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| Layer"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 4:
            print(f"check_layers: {path}: bad table row: {line}", file=sys.stderr)
            sys.exit(2)
        name, paths, _owns, may = cells
        prefixes = re.findall(r"`([^`]+)`", paths)
        allowed = set() if may in ("-", "") else {x.strip() for x in may.split(",")}
        layers.append((name, prefixes, allowed))
    names = {n for n, _, _ in layers}
    for n, _, allowed in layers:
        unknown = allowed - names
        if unknown:
            print(f"check_layers: {path}: layer {n} lists unknown layers {sorted(unknown)}",
                  file=sys.stderr)
            sys.exit(2)
    return layers


def layer_of(rel, layers):
    """The layer of kvq-relative path `rel` (longest matching prefix), or None."""
    best, best_len = None, -1
    for name, prefixes, _ in layers:
        for p in prefixes:
            hit = rel.startswith(p) if p.endswith("/") else rel == p
            if hit and len(p) > best_len:
                best, best_len = name, len(p)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True, help="docs/architecture.md")
    ap.add_argument("roots", nargs="+", help="include directories holding kvq/")
    args = ap.parse_args()
    layers = parse_table(args.table)
    allowed = {n: a | {n} for n, _, a in layers}

    errors, headers, includes = [], 0, 0
    for root in args.roots:
        base = os.path.join(root, "kvq")
        if not os.path.isdir(base):
            print(f"check_layers: {base}: not a directory", file=sys.stderr)
            sys.exit(2)
        for dirpath, _, files in os.walk(base):
            for f in sorted(files):
                if not f.endswith((".hpp", ".h", ".cuh")):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, base).replace(os.sep, "/")
                own = layer_of(rel, layers)
                headers += 1
                if own is None:
                    errors.append(f"{path}: kvq/{rel} belongs to no layer of {args.table}")
                    continue
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for lineno, line in enumerate(fh, 1):
                        m = INCLUDE_RE.match(line)
                        if not m:
                            continue
                        includes += 1
                        target = m.group(1)[len("kvq/"):]
                        tl = layer_of(target, layers)
                        if tl is None:
                            errors.append(f"{path}:{lineno}: includes kvq/{target}, which "
                                          f"belongs to no layer")
                        elif tl not in allowed[own]:
                            errors.append(
                                f"{path}:{lineno}: layer {own} includes kvq/{target} of layer "
                                f"{tl} (upward or sideways; {own} may include: "
                                f"{', '.join(sorted(allowed[own]))})")
    if errors:
        for e in errors:
            print(e)
        print(f"check_layers: {len(errors)} include(s) break the layer order "
              f"({headers} headers, {includes} includes checked)")
        return 1
    print(f"check_layers: OK: {headers} headers, {includes} kvq includes, "
          f"0 upward or sideways")
    return 0


if __name__ == "__main__":
    sys.exit(main())
