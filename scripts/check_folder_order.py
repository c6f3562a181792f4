#!/usr/bin/env -S /usr/bin/python3
"""Checks that the folders of src/ depend on each other one way only.

FOLDER_ORDER lists every folder of src/ from the bottom up: a file in a folder may include files
of its own folder and of the folders before it, never of a folder after it. An interface two
folders share lives below both (core/step_engine.h, core/backward_observer.h, data/batch.h), so
that each folder can be built, read and tested with only what is below it.

Usage: check_folder_order.py [SRC_DIR]   (default: the src/ beside this script's folder)
       check_folder_order.py --self-check  (the checker on a made-up tree that breaks the order)
Prints one line per upward include, file:line naming both folders, and exits 1; exits 0 when
there is none. A folder of src/ missing from the order is an error too (it must be placed).
"""

import os
import re
import sys
import tempfile

FOLDER_ORDER = [
    "core",      # config, errors, files, hooks and the interfaces shared by the folders above
    "kernels",   # CPU kernels
    "store",     # the chunk store and memory tiers
    "optim",     # AdamW over the store
    "data",      # shards, tokenizers, loaders and their batches
    "model",     # layers, GPT, llama, the CLIP towers
    "comm",      # MPI, gradient sync, codecs, ZeRO
    "ckpt",      # checkpoints and run directories
    "monitor",   # metrics endpoint, alerts, reports
    "pipeline",  # schedules, stages, partitioners, `keel schedule`
    "runtime",   # the trainer and its step engines' assembly, generation
    "sim",       # the cluster simulator, `keel simulate`
    "cli",       # the keel command
]

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"/]+)/')
SOURCE_SUFFIXES = (".h", ".hpp", ".cc", ".cpp")


def problems_of(src):
    """Every upward include (file:line) and every folder missing from FOLDER_ORDER under src."""
    rank = {folder: i for i, folder in enumerate(FOLDER_ORDER)}
    folders = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    shown = os.path.dirname(src)  # paths print as src/<folder>/<file>
    problems = []
    for folder in folders:
        if folder not in rank:
            problems.append(f"{os.path.relpath(os.path.join(src, folder), shown)}: a folder missing from FOLDER_ORDER "
                            f"in {os.path.basename(__file__)}")
    for folder in folders:
        for root, dirs, files in os.walk(os.path.join(src, folder)):
            dirs.sort()
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    for line_number, line in enumerate(f, start=1):
                        m = INCLUDE.match(line)
                        if m is None or m.group(1) not in folders:
                            continue  # a library's header, or a file of no src/ folder
                        target = m.group(1)
                        if target == folder or folder not in rank or target not in rank:
                            continue
                        if rank[target] > rank[folder]:
                            problems.append(f"{os.path.relpath(path, shown)}:{line_number}: {folder}/ includes {target}/, "
                                            f"which comes after it in the folder order")
    return problems


def self_check():
    """The checker on a made-up tree: an upward include, an unplaced folder, and allowed includes."""
    files = {
        "core/hook.h": '#pragma once\n#include "core/error.h"\n  #  include "cli/command.h"\n#include <nlohmann/json.hpp>\n',
        "core/error.h": "#pragma once\n",
        "model/gpt.cpp": '#include "model/gpt.h"\n#include "core/hook.h"\n#include "kernels/ops.h"\n',
        "model/gpt.h": '#include "pipeline/layout.h"\n',
        "kernels/ops.h": "#pragma once\n",
        "pipeline/layout.h": '#include "model/gpt.h"\n',
        "cli/command.h": '#include "model/gpt.h"\n#include "shiny/new.h"\n',
        "shiny/new.h": '#include "core/hook.h"\n',
    }
    expected = [
        "src/shiny: a folder missing from FOLDER_ORDER in " + os.path.basename(__file__),
        "src/core/hook.h:3: core/ includes cli/, which comes after it in the folder order",
        "src/model/gpt.h:1: model/ includes pipeline/, which comes after it in the folder order",
    ]
    with tempfile.TemporaryDirectory() as top:
        src = os.path.join(top, "src")
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(src, path)), exist_ok=True)
            with open(os.path.join(src, path), "w", encoding="utf-8") as f:
                f.write(text)
        found = problems_of(src)
    if found != expected:
        print("self-check failed: expected\n  " + "\n  ".join(expected) + "\nfound\n  " + "\n  ".join(found))
        return 1
    print(f"self-check: the made-up tree's {len(expected)} problems found, nothing else")
    return 0


def main(argv):
    if len(argv) > 1 and argv[1] == "--self-check":
        return self_check()
    src = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    src = os.path.normpath(os.path.abspath(src))
    problems = problems_of(src)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s) with the folder order: {' < '.join(FOLDER_ORDER)}")
        return 1
    print(f"folder order holds over the {len(FOLDER_ORDER)} folders of {src}: {' < '.join(FOLDER_ORDER)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
