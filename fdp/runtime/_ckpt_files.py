"""Checksums of a checkpoint's files: written after each save, checked before a restore.

Orbax makes a checkpoint appear only once every process has written it (a
writer killed half-way leaves a temporary directory that is never listed), but
it does not notice files changed or cut short after that: a flipped bit in an
array file restores as wrong values, silently. So fdp records the size and
SHA-256 of every file of a finished checkpoint in ``fdp_checksums.json``, in
the step's directory, and a checkpoint without that file, or whose files no
longer match it, is not restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

MANIFEST = "fdp_checksums.json"
_VERSION = 1
# A step directory moved aside because it failed its check: a name Orbax does not list.
CORRUPT_SUFFIX = ".fdp-corrupt"


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST and not rel.startswith(f"{MANIFEST}."):
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str) -> None:
    """Records every file of ``step_dir`` (size and SHA-256), atomically."""
    files = {}
    for rel in _files(step_dir):
        path = os.path.join(step_dir, rel)
        files[rel] = {"size": os.path.getsize(path), "sha256": _digest(path)}
    tmp = os.path.join(step_dir, f"{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump({"version": _VERSION, "files": files}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    # The rename is the moment the checkpoint counts as complete.
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def check(step_dir: str) -> str | None:
    """Why ``step_dir`` must not be restored, or ``None`` if every file matches its checksum."""
    path = os.path.join(step_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (the save did not finish, or fdp did not write it)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for rel, want in sorted(files.items()):
        file = os.path.join(step_dir, rel)
        try:
            size = os.path.getsize(file)
        except OSError:
            return f"{rel} is missing"
        if size != want["size"]:
            return f"{rel} has {size} bytes, {want['size']} were written"
        if _digest(file) != want["sha256"]:
            return f"{rel} does not match its checksum (the file was changed or damaged)"
    return None


def move_aside(step_dir: str) -> str:
    """Renames a failed step directory so that Orbax no longer lists it; returns the new path."""
    target = f"{step_dir}{CORRUPT_SUFFIX}"
    if os.path.exists(target):
        target = f"{target}-{time.time_ns()}"
    os.replace(step_dir, target)
    return target
