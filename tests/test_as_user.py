"""The root-only tests, run as a normal user (issue 17.6): each runs in a fresh pytest inside a user
and mount namespace (tests/helpers/as_user.py), as user ``nobody`` when the suite runs as root, so
that a normal user's ``make test`` exercises the README rows they verify (a small file system, a
cache directory owned by someone else). Each must pass there, not skip."""
from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers.as_user import run_test_as_user

ROOT_ONLY = [  # node id: how many tests it holds
    ("tests/test_cache.py::test_budget_shrinks_to_a_small_filesystem_with_one_warning", 1),
    ("tests/test_cache.py::test_cache_dir_owned_by_another_user_is_refused", 2),
    ("tests/test_cache.py::test_pass_through_fallback_owned_by_another_user_is_skipped", 1),
    ("tests/test_fastpath.py::test_no_ring_where_shared_memory_is_short", 1),
    ("tests/test_disk_full.py", 6),
    ("tests/test_hostile.py::test_cache_dir_owned_by_another_user_is_refused", 4),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nodeid,count", ROOT_ONLY, ids=[n.split("/")[-1].replace(".py::", "-") for n, _ in ROOT_ONLY])
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
