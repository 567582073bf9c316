"""The layers workspaces are mounted from: repository bases, frozen forks, and files added on top.

All live in one pool-private directory (root-only), which every workspace sandbox sees as
/.layers (workspace_init.py):

    base-<key>   a repository snapshot at its base revision, made once per repository from a local
                 directory, a git repository at a commit (`git archive`), or an archive
                 (.tar, .tar.gz/.tgz, .tar.bz2, .tar.xz, .zip); the one full copy a repository costs
    f-<id>       a frozen copy of a workspace's upper layer, made when the workspace forks
    files-<hash> files laid over a workspace (a task's hidden tests), keyed by their content

Every entry is owned by root, files are readable and writable by any uid (mode 0666, executable
bits kept) and directories 0777, so a workspace's copy-up gives the sandbox's uid files it can edit.
Frozen layers are reference-counted by the workspaces mounted over them and deleted with the last.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import uuid
import zipfile
from collections import Counter
from pathlib import Path

from services.environment_sandbox.sandbox.job import InvalidJob, SandboxError

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".zip")


class RepositoryError(InvalidJob):
    """A repository that cannot be made into a base layer (missing, unknown commit, bad archive)."""


def repository_key(path: str, commit: str = "") -> str:
    """One key per repository snapshot: its real path and commit, or its modification time when it
    names no commit (a directory or archive edited between runs gets a new base)."""
    real = os.path.realpath(path)
    marker = commit or str(os.stat(real).st_mtime_ns if os.path.exists(real) else 0)
    return hashlib.sha256(f"{real}\0{marker}".encode()).hexdigest()[:16]


def normalize(root: Path) -> None:
    """Root-owned, editable by every uid, no set-id bits (see the module docstring)."""
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777)
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            info = os.lstat(path)
            os.lchown(path, 0, 0)
            if stat.S_ISREG(info.st_mode):
                os.chmod(path, (info.st_mode & 0o111) | 0o666)
            elif not stat.S_ISDIR(info.st_mode) and not stat.S_ISLNK(info.st_mode):
                os.unlink(path)  # devices, fifos, sockets are no part of a repository snapshot


def _extract_archive(archive: Path, dest: Path) -> None:
    name = archive.name
    if name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                target = os.path.normpath(dest / member)
                if not target.startswith(str(dest) + os.sep) and target != str(dest):
                    raise RepositoryError(f"{archive}: member {member!r} points outside the archive")
            zf.extractall(dest)
        return
    try:
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")  # refuses absolute paths, '..', devices, set-id bits
    except (tarfile.TarError, OSError) as exc:
        raise RepositoryError(f"{archive}: not a readable archive ({exc})") from None


def _git_export(repo: Path, commit: str, dest: Path) -> None:
    try:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", commit],
            capture_output=True,
            check=True,
            timeout=300,
        )
    except FileNotFoundError:
        raise RepositoryError(f"{repo}: exporting commit {commit!r} needs git on the host") from None
    except subprocess.CalledProcessError as exc:
        message = exc.stderr.decode(errors="replace").strip().splitlines()
        raise RepositoryError(
            f"{repo}: cannot export commit {commit!r}: {message[-1] if message else exc}"
        ) from None
    tar = dest.parent / f".{dest.name}.tar"
    tar.write_bytes(archive.stdout)
    try:
        _extract_archive(tar, dest)
    finally:
        tar.unlink(missing_ok=True)


class LayerStore:
    """The layer directory of one pool. Blocking (file copies): call from a thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(mode=0o700, exist_ok=True)
        if _on_overlayfs(directory):
            raise SandboxError(
                f"{directory} is on overlayfs, which cannot hold overlay layers with whiteouts: set "
                "sandbox.root_dir to a directory on another filesystem (ext4, xfs, tmpfs)"
            )
        self._refs: Counter[str] = Counter()

    def path(self, layer: str) -> Path:
        return self.directory / layer

    def base(self, path: str, commit: str = "") -> str:
        """The base layer of a repository snapshot, made on first use (the one full copy)."""
        source = Path(path)
        layer = f"base-{repository_key(path, commit)}"
        target = self.path(layer)
        if target.is_dir():
            return layer
        staging = self.directory / f".{layer}-{uuid.uuid4().hex[:6]}"
        staging.mkdir()
        try:
            if source.is_file() and source.name.endswith(ARCHIVE_SUFFIXES):
                _extract_archive(source, staging)
            elif source.is_dir() and commit:
                _git_export(source, commit, staging)
            elif source.is_dir():
                shutil.copytree(
                    source, staging, symlinks=True, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git")
                )
            else:
                raise RepositoryError(
                    f"repository {path!r}: not a directory or an archive ({', '.join(ARCHIVE_SUFFIXES)})"
                )
            normalize(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return layer

    def files(self, files: dict[str, str]) -> str:
        """A layer holding `files` (relative path -> text), shared by every caller with the same files."""
        digest = hashlib.sha256()
        for rel in sorted(files):
            _check_relative(rel)
            digest.update(rel.encode() + b"\0" + files[rel].encode() + b"\0")
        layer = f"files-{digest.hexdigest()[:16]}"
        target = self.path(layer)
        if target.is_dir():
            return layer
        staging = self.directory / f".{layer}-{uuid.uuid4().hex[:6]}"
        staging.mkdir()
        for rel, content in files.items():
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(content)
        normalize(staging)
        try:
            staging.rename(target)
        except OSError:  # made meanwhile by another caller
            shutil.rmtree(staging, ignore_errors=True)
        return layer

    @staticmethod
    def frozen_name() -> str:
        return f"f-{uuid.uuid4().hex[:12]}"

    def acquire(self, layers: list[str]) -> None:
        self._refs.update(layer for layer in layers if layer.startswith("f-"))

    def release(self, layers: list[str]) -> None:
        """Drop one reference to each layer; a frozen layer no workspace uses is deleted."""
        for layer in layers:
            if not layer.startswith("f-"):
                continue
            self._refs[layer] -= 1
            if self._refs[layer] <= 0:
                del self._refs[layer]
                shutil.rmtree(self.path(layer), ignore_errors=True)

    def discard(self, layer: str) -> None:
        """Delete a frozen layer no workspace was mounted over (a fork that failed half way)."""
        if not self._refs.get(layer):
            shutil.rmtree(self.path(layer), ignore_errors=True)


def _check_relative(rel: str) -> None:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidJob(f"files[{rel!r}]: must be a relative path without '.' or '..' parts")


def _on_overlayfs(path: Path) -> bool:
    """Whether `path` lies on an overlay filesystem (a container's root), from /proc/self/mountinfo."""
    best, fstype = "", ""
    real = os.path.realpath(path)
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            mount_point = fields[4]
            kind = fields[fields.index("-") + 1]
            if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(
                mount_point
            ) >= len(best):
                best, fstype = mount_point, kind
    except (OSError, ValueError, IndexError):
        return False
    return fstype == "overlay"
