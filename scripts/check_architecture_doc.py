#!/usr/bin/env python3
"""Checks that docs/architecture.md names only what exists: every relative link and every
repository path in backticks exists, and every function named in a row of its tables occurs in
the files named in that row, and that no file of comm includes one of a layer above its own
(the table of comm's layers), that no module includes another module's detail/ headers, that
rpc's public headers declare nothing in a detail namespace, and
that docs/configuration.md names every TDIST_* variable
the code reads. Prints what is missing; exit status 1 if anything is.

    python3 scripts/check_architecture_doc.py [SOURCE_DIR]
"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
doc = open(os.path.join(root, "docs", "architecture.md")).read()
missing = []

for m in re.finditer(r"\]\(([^)#]+)(#[^)]*)?\)", doc):
    if not os.path.exists(os.path.normpath(os.path.join(root, "docs", m.group(1)))):
        missing.append("link " + m.group(1))

for m in re.finditer(r"`([A-Za-z0-9_./]+/[A-Za-z0-9_./]*)`", doc):
    path = m.group(1)
    if path.endswith((".h", ".cpp", ".py", ".sh", ".md", ".txt", "/")) and path != "tdist/":
        if not os.path.exists(os.path.join(root, path)):
            missing.append("path " + path)

# The files of apps/bench/ are named without their folder in the module list.
for name in re.findall(r"`([a-z_]+\.(?:h|cpp))`", doc):
    if "/" not in name and not os.path.exists(os.path.join(root, "apps", "bench", name)):
        missing.append("path apps/bench/" + name)

for line in doc.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 3 or cells[0] in ("step", "note") or set(cells[0]) <= set("-"):
        continue
    files = re.findall(r"`([A-Za-z0-9_/]+\.(?:h|cpp))`", cells[1])
    text = "".join(open(os.path.join(root, f)).read() for f in files
                   if os.path.exists(os.path.join(root, f)))
    for func in re.findall(r"`([A-Za-z_][A-Za-z0-9_:]*)(?:\([^`]*\))?`", cells[2]):
        if func.split("::")[-1] not in text:
            missing.append("function %s in none of %s" % (func, ", ".join(files)))

# comm's layers (the table under "Inside comm"): no file includes one of a layer above its own.
layers = []  # (name, [paths]) top down, the API first (every layer may include it)
for line in doc.split("### Inside comm", 1)[-1].split("\n## ", 1)[0].splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 4 and cells[0] not in ("layer",) and not set(cells[0]) <= set("-"):
        layers.append((cells[0], re.findall(r"`(comm/[A-Za-z0-9_./]*)`", cells[1])))


def layer_of(path):
    best = None
    for i, (_, paths) in enumerate(layers):
        for p in paths:
            if path == p or (p.endswith("/") and path.startswith(p)):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return None if best is None else best[0]


if not layers:
    missing.append("the table of comm's layers")
for folder, _, names in os.walk(os.path.join(root, "comm")):
    for name in names:
        if not name.endswith((".h", ".cpp")):
            continue
        path = os.path.relpath(os.path.join(folder, name), root)
        mine = layer_of(path)
        if mine is None:
            missing.append("a layer for %s" % path)
            continue
        for inc in re.findall(r'#include "tdist/(comm/[^"]+)"', open(os.path.join(root, path)).read()):
            theirs = layer_of(inc)
            if theirs is None or (theirs != 0 and theirs < mine) or (mine == 0 and theirs != 0):
                missing.append("layer order: %s (%s) includes %s (%s)" % (
                    path, layers[mine][0], inc, "?" if theirs is None else layers[theirs][0]))

# A module's detail/ folders are its own: another module (or an app) uses its public headers.
for module in ("core", "comm", "rpc", "autograd", "optim", "ddp", "fsdp", "pipeline", "apps",
               "python"):
    for folder, _, names in os.walk(os.path.join(root, module)):
        for name in names:
            if not name.endswith((".h", ".cpp")):
                continue
            path = os.path.relpath(os.path.join(folder, name), root)
            for m in re.finditer(r'#include "tdist/(([a-z_]+)/(?:[^"]*/)?detail/[^"]+)"',
                                 open(os.path.join(root, path)).read()):
                if m.group(2) != module:
                    missing.append("detail include: %s includes %s (a detail/ header of %s)" % (
                        path, m.group(1), m.group(2)))

# Public headers of these modules declare nothing in a detail namespace: internals live in
# their detail/ folder's headers, which the public header includes where it needs them.
for module in ("rpc",):
    for folder, _, names in os.walk(os.path.join(root, module)):
        if "detail" in os.path.relpath(folder, root).split(os.sep):
            continue
        for name in names:
            path = os.path.relpath(os.path.join(folder, name), root)
            if name.endswith(".h") and re.search(r"namespace\s+(?:[\w:]+::)?detail\b",
                                                 open(os.path.join(root, path)).read()):
                missing.append("detail namespace in a public header: %s (move it under %s/detail/)"
                               % (path, module))

# Every TDIST_* variable the code reads is in docs/configuration.md.
config = open(os.path.join(root, "docs", "configuration.md")).read()
for module in ("core", "comm", "rpc", "autograd", "optim", "ddp", "fsdp", "pipeline", "apps",
               "python"):
    for folder, _, names in os.walk(os.path.join(root, module)):
        for name in names:
            if name.endswith((".h", ".cpp")):
                text = open(os.path.join(folder, name)).read()
                for var in sorted(set(re.findall(r'"(TDIST_[A-Z0-9_]+)"', text))):
                    if var not in config:
                        missing.append("docs/configuration.md row for %s (read in %s)" % (
                            var, os.path.relpath(os.path.join(folder, name), root)))

for what in missing:
    print("docs check: " + what)
print("%d missing" % len(missing))
sys.exit(1 if missing else 0)
