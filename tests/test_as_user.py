"""The root-only tests, run as a normal user (issue 17.6): each runs in a fresh pytest inside a user
and mount namespace (tests/helpers/as_user.py), as user ``nobody`` when the suite runs as root, so
that a normal user's ``make test`` exercises the README rows they verify (a small file system, a
cache directory owned by someone else). Each must pass there, not skip."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.as_user import ROOT, run_test_as_user

ROOT_ONLY = [  # node id: how many tests it holds
    ("tests/test_cache.py::test_budget_shrinks_to_a_small_filesystem_with_one_warning", 1),
    ("tests/test_cache.py::test_cache_dir_owned_by_another_user_is_refused", 2),
    ("tests/test_cache.py::test_pass_through_fallback_owned_by_another_user_is_skipped", 1),
    ("tests/test_fastpath.py::test_no_ring_where_shared_memory_is_short", 1),
    ("tests/test_disk_full.py", 6),
    ("tests/test_hostile.py::test_cache_dir_owned_by_another_user_is_refused", 4),
]

CASE_IDS = [n.split("/")[-1].replace(".py::", "-") for n, _ in ROOT_ONLY]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nodeid,count", ROOT_ONLY, ids=CASE_IDS)
def test_root_only_test_passes_as_a_normal_user(nodeid: str, count: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="datacache-as-user-"))
    try:
        r = run_test_as_user(nodeid, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = r.stdout + r.stderr
    uid = out.split("\n", 1)[0].strip()
    assert uid.isdigit() and int(uid) != 0, f"ran as uid {uid!r}, not as a normal user:\n{out[-3000:]}"
    if "unshare: " in out and r.returncode != 0:
        pytest.skip(f"no user namespaces here: {out.splitlines()[1] if len(out.splitlines()) > 1 else out}")
    assert r.returncode == 0, out[-4000:]
    assert re.search(rf"\b{count} passed\b", out) and "skipped" not in out, out[-4000:]


@pytest.mark.timeout(300)
def test_runs_from_a_checkout_and_venv_under_a_private_directory(tmp_path: Path) -> None:
    """Issue 37.4: ``git clone . $(mktemp -d)/p && make test`` put the checkout and its ``.venv``
    under a 0700 directory, and ``nobody`` got ``exec: …/.venv/bin/python: Permission denied``.
    Here the checkout and this venv are bind-mounted under a 0700 directory and one case above
    runs from there: it must pass as a normal user."""
    if os.getuid() != 0:
        pytest.skip("only root runs these as user nobody; a normal user can enter their own 0700 directories")
    exe, prefix = Path(sys.executable), Path(sys.prefix)
    if prefix not in exe.parents:
        pytest.skip(f"the interpreter {exe} is not under its prefix {prefix}")
    private = tmp_path / "private"
    (private / "p").mkdir(parents=True)
    (private / "env").mkdir()
    private.chmod(0o700)
    case = "tests/test_as_user.py::test_root_only_test_passes_as_a_normal_user[" + CASE_IDS[0] + "]"
    script = 'mount --bind "$1" "$2/p" && mount --bind "$3" "$2/env" && cd "$2/p" && shift 3 && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(ROOT),
           str(private), str(prefix), str(private / "env" / exe.relative_to(prefix)), "-m", "pytest", "-q",
           "-p", "no:cacheprovider", "-o", "addopts=", case]
    env = {**os.environ, "PYTHONPATH": str(private / "p"), "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    if "1 skipped" in out:
        pytest.skip(f"the case skips here: {out[-500:]}")
    assert r.returncode == 0 and "1 passed" in out, out[-4000:]
