#!/usr/bin/env python3
"""Checks that docs/architecture.md names only what exists: every relative link and every
repository path in backticks exists, and every function named in a row of its tables occurs in
the files named in that row. Prints what is missing; exit status 1 if anything is.

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

for what in missing:
    print("docs/architecture.md names what does not exist: " + what)
print("%d missing" % len(missing))
sys.exit(1 if missing else 0)
