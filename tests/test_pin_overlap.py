"""tools/pin_overlap.py: its arithmetic of copies hidden behind steps, and its refusal without a GPU.
(The measurement itself needs a CUDA device; the pinned batches' values are checked on any machine
by tests/test_field_types.py.)"""
from __future__ import annotations

import pytest
import torch

from tools import pin_overlap


def test_hidden_is_the_share_of_copy_time_inside_the_steps() -> None:
    steps = [(0.0, 4.0), (5.0, 9.0), (10.0, 14.0)]
    assert pin_overlap.hidden([(1.0, 3.0)], steps) == 1.0  # inside one step
    assert pin_overlap.hidden([(4.0, 5.0)], steps) == 0.0  # in the gap between two
    assert pin_overlap.hidden([(3.0, 6.0)], steps) == pytest.approx(2 / 3)  # across a gap
    assert pin_overlap.hidden([(8.0, 11.0), (15.0, 16.0)], steps) == pytest.approx(2 / 4)  # one in, one after
    assert pin_overlap.hidden([(-2.0, 1.0)], steps) == pytest.approx(1 / 3)  # before the first step
    assert pin_overlap.hidden([(2.0, 2.0)], steps) == 0.0  # no copy time


def test_busy_is_the_steps_time_over_their_span() -> None:
    assert pin_overlap.busy([(0.0, 4.0), (4.0, 8.0)]) == 1.0
    assert pin_overlap.busy([(0.0, 4.0), (6.0, 10.0)]) == pytest.approx(0.8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_measures_nothing_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert pin_overlap.main(["--mb", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
