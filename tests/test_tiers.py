"""The suite's own scheduling (tests/helpers/tiers.py): the files handed out first exist, and the
order of the tests is a permutation that keeps each file's tests in their order."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.tiers import HEAVIEST_FIRST, weight_order

ROOT = Path(__file__).resolve().parents[1]


def test_heaviest_first_names_existing_test_files_once() -> None:
    """A renamed or split file would otherwise silently go back to the end of the queue."""
    missing = [f for f in HEAVIEST_FIRST if not (ROOT / f).is_file()]
    assert missing == [], f"tests/helpers/tiers.py HEAVIEST_FIRST names files that are gone: {missing}"
    assert len(set(HEAVIEST_FIRST)) == len(HEAVIEST_FIRST)


def test_weight_order_puts_listed_files_first_and_keeps_every_test_once_in_file_order() -> None:
    a, b = HEAVIEST_FIRST[0], HEAVIEST_FIRST[1]
    ids = ["tests/test_x.py::t1", f"{b}::t1", "tests/test_x.py::t2", f"{a}::t1", f"{b}::t2[p]", f"{a}::t2"]
    ordered = [ids[i] for i in weight_order(ids)]
    assert sorted(ordered) == sorted(ids)
    assert ordered == [f"{a}::t1", f"{a}::t2", f"{b}::t1", f"{b}::t2[p]", "tests/test_x.py::t1", "tests/test_x.py::t2"]
