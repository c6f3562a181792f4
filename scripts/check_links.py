#!/usr/bin/env python3
"""Checks that every relative link in Markdown files resolves.

usage: check_links.py [--root DIR] FILE.md ...   (exit 1 and one line per broken link)
       check_links.py --self-test                (proves the checker finds broken links)
       check_links.py --config-keys DEFAULT.toml FILE.md ...
                                                 (every key of DEFAULT.toml, `section.key`, is named in the files)

A link `[text](target)`, an image `![alt](target)` or a reference definition `[ref]: target`
whose target is not a URL must name a file or directory that exists, relative to the file that
holds it. A `#anchor` (alone: this file; after a .md path: that file) must be the slug of a
heading in the target, by GitHub's rules: inline Markdown removed, lower case, every character
that is not a letter, digit, underscore, space or hyphen dropped, spaces turned into hyphens,
and a repeated slug suffixed -1, -2, ... Links inside code (fenced blocks, `inline`) are text,
not links, and are not checked.
"""
import os
import re
import sys
import tempfile

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def text_lines(path):
    """The file's lines outside fenced code blocks, as (line number, text)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    in_fence = False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield number, line


def heading_text(markdown):
    """A heading's visible text: inline code keeps its content, links keep their text."""
    text = INLINE_CODE.sub(lambda m: m.group(2), markdown)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"(?<!\w)_{1,3}(\S(?:.*?\S)?)_{1,3}(?!\w)", r"\1", text)


def slug(text):
    text = heading_text(text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    """Every heading's slug in a Markdown file, with GitHub's -N suffixes for repeats."""
    if path not in cache:
        seen = {}
        found = set()
        for _, line in text_lines(path):
            match = HEADING.match(line)
            if not match:
                continue
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        cache[path] = found
    return cache[path]


def links(path):
    for number, line in text_lines(path):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            yield number, definition.group(1)
            continue
        without_code = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        for match in INLINE_LINK.finditer(without_code):
            yield number, match.group(2)


def problems(path, root):
    """One message per link in `path` that does not resolve."""
    for number, target in links(path):
        if not target or URL_SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{os.path.relpath(path, root)}:{number}: link {target}"
        if file_part:
            if file_part.startswith("/"):
                yield f"{where}: expected a relative path, found an absolute one"
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
            if not os.path.exists(resolved):
                yield f"{where}: expected the file {os.path.relpath(resolved, root)} to exist, found none"
                continue
        else:
            resolved = path
        if anchor:
            if not resolved.endswith(".md") or os.path.isdir(resolved):
                yield f"{where}: an anchor needs a Markdown file, found {os.path.relpath(resolved, root)}"
            elif anchor not in anchors(resolved):
                yield (f"{where}: expected a heading with anchor #{anchor} in "
                       f"{os.path.relpath(resolved, root)}, found none")


def check(paths, root):
    found = []
    for path in paths:
        if not os.path.isfile(path):
            found.append(f"{path}: expected a Markdown file, found none")
            continue
        found.extend(problems(os.path.abspath(path), root))
    return found


def self_test():
    """The checker must pass good links and report each kind of broken one."""
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "docs"))
        with open(os.path.join(root, "docs", "page.md"), "w", encoding="utf-8") as f:
            f.write("# Page\n\n## Checkpoints and recovery\n\n## CLIP-style image–text models (`[clip]`)\n\n"
                    "## Notes\n\n## Notes\n\n## `run_dir` and _why_\n\n```\n# not a heading\n```\n")
        with open(os.path.join(root, "README.md"), "w", encoding="utf-8") as f:
            f.write("# Top\n\n"
                    "[good file](docs/page.md) [good anchor](docs/page.md#checkpoints-and-recovery)\n"
                    "[code in heading](docs/page.md#clip-style-imagetext-models-clip)\n"
                    "[repeat](docs/page.md#notes-1) [underscores](docs/page.md#run_dir-and-why) [here](#top) [dir](docs/) [web](https://example.org/x)\n"
                    "[ref]: docs/page.md#page\n"
                    "`[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
                    "[missing file](docs/missing.md)\n"
                    "[missing anchor](docs/page.md#no-such-heading)\n"
                    "[fenced heading](docs/page.md#not-a-heading)\n"
                    "![missing image](docs/missing.png)\n"
                    "[missing here](#nowhere)\n"
                    "[absolute](/etc/passwd)\n"
                    "[broken ref]: docs/gone.md\n")
        found = check([os.path.join(root, "README.md")], root)
        expected_lines = [12, 13, 14, 15, 16, 17, 18]
        lines = [int(message.split(":")[1]) for message in found]
        if lines != expected_lines:
            print("check_links self-test: expected broken links on lines "
                  f"{expected_lines}, found {lines}:", *found, sep="\n  ")
            return 1
    print(f"check_links self-test: {len(expected_lines)} broken links found, no good link reported")
    return 0


def undocumented_keys(default_toml, paths):
    """Keys of the default config (commented-out ones included) that no page names as `section.key`."""
    text = "".join(open(p, encoding="utf-8").read() for p in paths)
    section, missing = None, []
    with open(default_toml, encoding="utf-8") as f:
        for line in f:
            header = re.match(r"^\[(\w+)\]", line)
            if header:
                section = header.group(1)
                continue
            key = re.match(r"^#?\s*(\w+)\s*=", line)
            if key and section and f"`{section}.{key.group(1)}`" not in text:
                missing.append(f"{section}.{key.group(1)}")
    return missing


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    if len(argv) >= 3 and argv[0] == "--config-keys":
        missing = undocumented_keys(argv[1], argv[2:])
        for key in missing:
            print(f"config key {key}: expected `{key}` in one of {len(argv) - 2} pages, found it in none")
        print(f"check_links --config-keys: {len(missing)} undocumented keys")
        return 1 if missing else 0
    root = os.getcwd()
    if len(argv) >= 2 and argv[0] == "--root":
        root = os.path.abspath(argv[1])
        argv = argv[2:]
    if not argv:
        print("usage: check_links.py [--root DIR] FILE.md ... | --self-test", file=sys.stderr)
        return 2
    paths = [p if os.path.isabs(p) else os.path.join(root, p) for p in argv]
    found = check(paths, root)
    for message in found:
        print(message)
    print(f"check_links: {len(paths)} files, {len(found)} broken links")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
