"""Checksums of a checkpoint's files: written after each save, checked before a restore.

Orbax makes a checkpoint appear only once every process has written it (a
writer killed half-way leaves a temporary directory that is never listed), but
it does not notice files changed or cut short after that: a flipped bit in an
array file restores as wrong values, silently. So fdp records the size and
SHA-256 of every file of a finished checkpoint in ``fdp_checksums.json``, in
the step's directory, and a checkpoint whose files no longer match it is not
restored.

Orbax publishes a step before fdp can checksum it, so there is a moment when a
whole step has no checksums. ``fdp_pending.json``, beside the steps, names the
step whose save is under way from before Orbax starts it until its checksums
are written: a listed step without checksums that it names was cut off in that
moment, not damaged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time

MANIFEST = "fdp_checksums.json"
PENDING = "fdp_pending.json"
_VERSION = 1
# A step directory moved aside because it failed its check: a name Orbax does not list.
CORRUPT_SUFFIX = ".fdp-corrupt"
# An old step being deleted: renamed first, so that no reader lists it half-deleted.
DELETING_SUFFIX = ".fdp-deleting"


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


def _write_json(path: str, value: object) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(step_dir: str) -> None:
    """Records every file of ``step_dir`` (size and SHA-256), atomically."""
    files = {}
    for rel in _files(step_dir):
        path = os.path.join(step_dir, rel)
        files[rel] = {"size": os.path.getsize(path), "sha256": _digest(path)}
    # The rename inside is the moment the checkpoint counts as complete.
    _write_json(os.path.join(step_dir, MANIFEST), {"version": _VERSION, "files": files})


def has_manifest(step_dir: str) -> bool:
    """Whether ``step_dir`` has its checksums file (whatever it says)."""
    return os.path.exists(os.path.join(step_dir, MANIFEST))


def mark_pending(directory: str, step: int) -> None:
    """Records, before Orbax starts writing ``step``, that its checksums are not written yet."""
    _write_json(os.path.join(directory, PENDING), {"step": step})


def pending_step(directory: str) -> int | None:
    """The step :func:`mark_pending` last named and :func:`clear_pending` did not clear."""
    try:
        with open(os.path.join(directory, PENDING)) as f:
            step = json.load(f)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def clear_pending(directory: str, step: int) -> None:
    """Forgets the pending mark once ``step`` has its checksums (if it names ``step``)."""
    if pending_step(directory) == step:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, PENDING))


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


def remove(step_dir: str) -> None:
    """Deletes an old step; a reader sees it listed whole or not at all."""
    target = f"{step_dir}{DELETING_SUFFIX}"
    if os.path.exists(target):
        target = f"{target}-{time.time_ns()}"
    os.replace(step_dir, target)
    shutil.rmtree(target, ignore_errors=True)


def remove_leftovers(directory: str) -> None:
    """Finishes deletions that a killed process left half done."""
    for name in os.listdir(directory):
        if DELETING_SUFFIX in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def move_aside(step_dir: str) -> str:
    """Renames a failed step directory so that Orbax no longer lists it; returns the new path."""
    target = f"{step_dir}{CORRUPT_SUFFIX}"
    if os.path.exists(target):
        target = f"{target}-{time.time_ns()}"
    os.replace(step_dir, target)
    return target
