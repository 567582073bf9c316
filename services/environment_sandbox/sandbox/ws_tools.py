"""The file tools of a workspace, run inside the sandbox: read a range, write, search, apply a diff.

Standard library only: the runtime (runtime.py) holds a copy as /opt/looprl/looprl_tools.py and
the environment runs `python /opt/looprl/looprl_tools.py <tool>` with the arguments as JSON on
stdin, as the sandbox's uid in /workspace, so a path the agent names can reach nothing the sandbox
cannot (no host path, no hidden test). Output is what the model reads; a refusal exits 1 with one
readable line. The host imports `apply_patch_text` from here too, to build a task's hidden test
files from its test_patch.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", "node_modules", ".venv"}


class PatchError(ValueError):
    """A diff that does not parse or does not apply; the message says where."""


@dataclass
class Hunk:
    old_start: int
    lines: list[tuple[str, str]] = field(default_factory=list)  # (" " | "-" | "+", line with its newline)

    def old(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "+"]

    def new(self) -> list[str]:
        return [text for tag, text in self.lines if tag != "-"]


@dataclass
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


def _strip_path(raw: str) -> str | None:
    path = raw.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_patch(text: str) -> list[FilePatch]:
    """The files of a unified diff (git's or diff -u's), in order."""
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_strip_path(line[4:]), _strip_path(lines[i + 1][4:])))
            i += 2
            continue
        match = _HUNK.match(line)
        if match:
            if not files:
                raise PatchError(f"line {i + 1}: a hunk before any '--- a/file' / '+++ b/file' header")
            old_len = 1 if match.group(2) is None else int(match.group(2))
            new_len = 1 if match.group(4) is None else int(match.group(4))
            hunk = Hunk(int(match.group(1)))
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_len or seen_new < new_len):
                body = lines[i]
                tag = body[:1]
                if body.startswith("\\"):  # "\ No newline at end of file": the previous line has none
                    if hunk.lines:
                        prev_tag, prev = hunk.lines[-1]
                        hunk.lines[-1] = (prev_tag, prev.rstrip("\n"))
                    i += 1
                    continue
                if tag not in (" ", "-", "+") and body.strip() == "":
                    tag, body = " ", " " + body  # an editor stripped the blank context line's space
                if tag not in (" ", "-", "+"):
                    raise PatchError(f"line {i + 1}: hunk ended early (expected ' ', '-' or '+')")
                hunk.lines.append((tag, body[1:]))
                seen_old += tag != "+"
                seen_new += tag != "-"
                i += 1
            if i < len(lines) and lines[i].startswith("\\"):
                tag, prev = hunk.lines[-1]
                hunk.lines[-1] = (tag, prev.rstrip("\n"))
                i += 1
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise PatchError("no file header ('--- a/file' then '+++ b/file') found: not a unified diff")
    return files


def _find(lines: list[str], block: list[str], near: int) -> int:
    """Where `block` occurs in `lines`, the occurrence nearest to `near`; -1 if nowhere."""
    if not block:
        return min(max(near, 0), len(lines))
    for distance in range(len(lines) + 1):
        for at in (near - distance, near + distance) if distance else (near,):
            if 0 <= at <= len(lines) - len(block) and lines[at : at + len(block)] == block:
                return at
    return -1


def apply_hunks(original: str, patch: FilePatch) -> str:
    lines = original.splitlines(keepends=True)
    offset = 0
    for number, hunk in enumerate(patch.hunks, 1):
        old = hunk.old()
        at = _find(lines, old, hunk.old_start - 1 + offset if old else hunk.old_start + offset)
        if at < 0:
            # Tolerate a file whose last line lacks (or has) the newline the diff assumed.
            stripped = [line.rstrip("\n") for line in lines]
            at = _find(stripped, [line.rstrip("\n") for line in old], hunk.old_start - 1 + offset)
            if at < 0:
                raise PatchError(
                    f"{patch.path}: hunk {number} (@@ -{hunk.old_start}) does not apply: its context "
                    "and removed lines are not in the file"
                )
        lines[at : at + len(old)] = hunk.new()
        offset = at - (hunk.old_start - 1) + len(hunk.new()) - len(old)
    return "".join(lines)


def inside(root: str, rel: str) -> str:
    path = os.path.normpath(os.path.join(root, rel))
    if not (path == root or path.startswith(root.rstrip("/") + "/")):
        raise PatchError(f"{rel}: outside the workspace")
    return path


def apply_patch_text(root: str, text: str) -> list[str]:
    """Apply a unified diff under `root`: every file is checked before any is written."""
    results: dict[str, str | None] = {}
    for patch in parse_patch(text):
        if not patch.path:
            raise PatchError("a file diff with /dev/null on both sides")
        if patch.old_path is None:
            original = ""
        else:
            source = inside(root, patch.old_path)
            if patch.old_path in results:
                original = results[patch.old_path] or ""
            elif os.path.isfile(source):
                with open(source, encoding="utf-8", newline="") as fh:
                    original = fh.read()
            else:
                raise PatchError(f"{patch.old_path}: no such file to patch")
        updated = apply_hunks(original, patch)
        if patch.new_path is None:
            results[patch.old_path or ""] = None
        else:
            if patch.old_path and patch.old_path != patch.new_path:
                results[patch.old_path] = None
            results[patch.new_path] = updated
    for rel, content in results.items():
        path = inside(root, rel)
        if content is None:
            if os.path.lexists(path):
                os.unlink(path)
            continue
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as fh:
            fh.write(content)
    return list(results)


# -- the tools (in the sandbox) ----------------------------------------------------------------------


def read_file(path: str, start_line: int = 1, end_line: int = 0) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()
    start = max(1, int(start_line))
    end = len(lines) if not end_line or int(end_line) <= 0 else min(len(lines), int(end_line))
    if start > max(1, len(lines)):
        return f"{path} has {len(lines)} lines; start_line {start} is past its end"
    width = len(str(end))
    shown = "\n".join(f"{n:>{width}}  {lines[n - 1]}" for n in range(start, end + 1))
    return shown if shown else f"{path} is empty"


def write_file(path: str, content: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(content)
    return f"wrote {len(content.encode())} bytes to {path}"


def search(pattern: str, path: str = ".", max_results: int = 50) -> str:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern: not a valid regular expression ({exc})") from None
    hits: list[str] = []
    paths = [path] if os.path.isfile(path) else []
    for dirpath, dirnames, filenames in os.walk(path) if not paths else []:
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        paths.extend(os.path.join(dirpath, name) for name in sorted(filenames))
    for file in paths:
        try:
            with open(file, encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if regex.search(line):
                        hits.append(f"{os.path.relpath(file)}:{number}: {line.rstrip()}")
                        if len(hits) >= max_results:
                            return "\n".join([*hits, f"[stopped at {max_results} matches]"])
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable
    return "\n".join(hits) if hits else f"no match for {pattern!r}"


def apply_patch(patch: str) -> str:
    changed = apply_patch_text(os.getcwd(), patch)
    return "patched " + ", ".join(changed)


TOOLS = {"read_file": read_file, "write_file": write_file, "search": search, "apply_patch": apply_patch}


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in TOOLS:
        print(f"unknown tool {name!r}", file=sys.stderr)
        return 2
    try:
        print(TOOLS[name](**json.loads(sys.stdin.read() or "{}")))
    except (OSError, ValueError, TypeError) as exc:
        message = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"error: {message}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
