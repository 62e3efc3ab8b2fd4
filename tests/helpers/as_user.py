"""Running the root-only tests as a normal user (issue 17.6).

A few tests need what only root may do: mount a small tmpfs (the ``small_tmpfs`` fixture) or hand a
cache directory to another user (``give_away``). A normal user can do both inside a user namespace
of their own (``unshare --user --map-root-user --mount``): they are "root" there over a private
mount namespace, so they may mount a tmpfs, and a directory of a user the namespace does not map
(e.g. root's) shows the overflow uid 65534, another user's, once bind-mounted over a cache path.

``run_test_as_user(nodeid, base)`` runs one test in a fresh pytest in such a namespace, as the
calling user, or as user ``nobody`` (setpriv) when the caller is root, so that it really runs
without root's privileges. ``give_away(path)`` is what the chown tests call.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
OTHER_UID = 12345  # the owner root gives a directory away to
FOREIGN_ENV = "DATACACHE_TEST_FOREIGN_DIR"  # a directory of a user the namespace does not map


def in_user_namespace() -> bool:
    """True inside a user namespace that maps only part of the uids (not the initial one)."""
    try:
        lines = Path("/proc/self/uid_map").read_text().split("\n")
    except OSError:
        return False
    return [ln.split() for ln in lines if ln.strip()] != [["0", "0", "4294967295"]]


def give_away(path: Path | str) -> int:
    """Make the existing directory ``path`` another user's; returns its owner's uid as seen here.

    As root: ``chown`` to ``OTHER_UID``. In a user namespace (the normal user's variant): bind-mount
    over it a directory whose owner the namespace does not map. Skips where neither is possible."""
    if not in_user_namespace():
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root (tests/test_as_user.py runs this as a normal user)")
        os.chown(path, OTHER_UID, OTHER_UID)
        return OTHER_UID
    src = os.environ.get(FOREIGN_ENV, "/")
    r = subprocess.run(["mount", "--bind", src, str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount {src} over {path} in this user namespace: {r.stderr.strip()}")
    uid = os.stat(path).st_uid
    assert uid != os.getuid(), f"{src} is ours in this namespace; set {FOREIGN_ENV} to another user's directory"
    return uid


def run_test_as_user(nodeid: str, base: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the test ``nodeid`` (``tests/x.py::name``) in a new pytest inside a user and mount
    namespace, without root's privileges (as ``nobody`` if we are root). ``base``: a directory for
    its files that ``nobody`` can reach (not under pytest's 0700 tmp_path). Its output starts with
    the uid it ran as (outside the namespace)."""
    for tool in ("unshare", "setpriv") if os.getuid() == 0 else ("unshare",):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (util-linux)")
    work = base / "work"
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))}
    env.update(HOME=str(work), TMPDIR=str(work), PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    drop: list[str] = []
    if os.getuid() == 0:
        foreign = base / "foreign"  # an empty directory of root's, a user nobody's namespace does not map
        foreign.mkdir(mode=0o755, exist_ok=True)
        env[FOREIGN_ENV] = str(foreign)
        os.chmod(base, 0o755)
        os.chown(work, NOBODY, NOBODY)
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    inner = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(work / "pytest"),
             "-o", "addopts=", nodeid]
    # uid 0 in the namespace is the same name as root's outside: a /dev/shm of its own keeps root's
    # /dev/shm/datacache-pass-0 (another user's, seen from here) out of the way
    script = ('id -u; exec unshare --user --map-root-user --mount -- '
              'sh -c \'mount -t tmpfs -o mode=1777,size=64m tmpfs /dev/shm && exec "$@"\' sh "$@"')
    cmd = [*drop, "sh", "-c", script, "sh", *inner]
    if drop:
        cmd = _reachable(cmd, base)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _reachable(cmd: list[str], base: Path) -> list[str]:
    """``cmd`` run (by root) in a private mount namespace where ``nobody`` can reach what the test
    needs: the interpreter (the venv's path and the real one), its prefixes and ``sys.path``, and
    the checkout (issue 37.4: a clone under ``mktemp -d`` or ``/root``). Each directory on those
    paths that others may not enter is masked by an empty tmpfs (mode 0755) holding only the
    entries on the paths, bind-mounted back; nested closed directories are masked outer first.
    Skips with the reason where it cannot work (the checkout itself or ``base`` closed)."""
    if os.stat(ROOT).st_mode & 0o005 != 0o005:
        pytest.skip(f"user nobody cannot read the checkout {ROOT} (mode {os.stat(ROOT).st_mode & 0o777:o})")
    if (outer := _closed_parent(base.parent)) is not None:
        pytest.skip(f"{base} lies under {outer}, which user nobody cannot enter: point TMPDIR elsewhere")
    masks = _masks(_needed_paths())
    if not masks:
        return cmd
    held = base / "held"
    stage, restore = [], []
    for closed, keeps in masks.items():  # outer first: an inner one is reachable once its outer one is back
        q = shlex.quote(str(closed))
        restore.append(f"mount -t tmpfs -o mode=755,size=1m tmpfs {q}")
        for keep in sorted(keeps):
            src = held / str(len(stage))
            src.mkdir(parents=True)
            stage.append(f"mount --bind {q}/{shlex.quote(keep)} {src}")
            restore.append(f"mkdir {q}/{shlex.quote(keep)} && mount --bind {src} {q}/{shlex.quote(keep)}")
    script = " && ".join([*stage, *restore, f"cd {shlex.quote(str(ROOT))}", 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *cmd]


def _needed_paths() -> set[Path]:
    """The directories the inner pytest reads: the checkout, the interpreter's (as named and as
    resolved), its prefixes and the existing ``sys.path`` entries (directories, or a zip's folder)."""
    found = {ROOT, Path(sys.executable).parent, Path(os.path.realpath(sys.executable)).parent,
             Path(sys.prefix), Path(sys.base_prefix)}
    # an editable install maps these by absolute path, which need not be ROOT (a checkout mounted elsewhere)
    for name in ("datacache", "datacache.readers"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            found.add(Path(spec.origin).parent)
    for entry in sys.path:
        p = Path(entry or ".").absolute()
        if p.exists():
            found.add(p if p.is_dir() else p.parent)
    return {q for p in found for q in (p, Path(os.path.realpath(p)))}


def _masks(paths: set[Path]) -> dict[Path, set[str]]:
    """Closed directory (others lack +x) -> the names in it on the way to ``paths``, outer first."""
    masks: dict[Path, set[str]] = {}
    for path in paths:
        for parent in reversed(path.parents[:-1]):  # not "/"
            if not os.stat(parent).st_mode & 0o001:
                masks.setdefault(parent, set()).add(path.relative_to(parent).parts[0])
    return dict(sorted(masks.items(), key=lambda kv: len(kv[0].parts)))


def _closed_parent(path: Path) -> Path | None:
    """The outermost directory from ``/`` down to ``path`` that others may not enter, or None."""
    return next((p for p in (*reversed(path.parents), path) if not os.stat(p).st_mode & 0o001), None)
