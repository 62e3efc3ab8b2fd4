"""Parquet list columns through ``datacache.DataLoader`` with workers (issue 37.7): a
``fixed_size_list<float32, 4>`` column is one float32 tensor of shape (B, 4), not a list of 4
float64 tensors; ragged lists (``input_ids``) give one line naming the field and ``collate_fn``,
not torch's bare "each element in list of batch should be of equal size"."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import datacache
from datacache import NodeCache, StreamingDataset, readers
from datacache.cli.main import main

N = 24
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]


def _indexed(root: Path, table: pa.Table, capsys: pytest.CaptureFixture[str]) -> str:
    """A folder holding ``table`` as two Parquet files, indexed in place (``datacache index``)."""
    root.mkdir()
    half = len(table) // 2
    pq.write_table(table.slice(0, half), root / "part-0.parquet", row_group_size=5)
    pq.write_table(table.slice(half), root / "part-1.parquet", row_group_size=5)
    assert main(["index", str(root), "--format", "parquet", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == len(table)
    return str(root)


def _vectors() -> pa.Table:
    vec = [[i, i + 0.5, -i, 1 / (i + 1)] for i in range(N)]
    return pa.table({"i": list(range(N)), "vec": pa.array(vec, pa.list_(pa.float32(), 4))})


def test_fixed_size_list_is_a_float32_ndarray_read_and_batched(tmp_path: Path, cache: NodeCache,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    url = _indexed(tmp_path / "vec", _vectors(), capsys)
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    seen: list[int] = []
    for batch in datacache.DataLoader(ds, batch_size=4, num_workers=2):
        vec, ids = batch["vec"], batch["i"]
        assert isinstance(vec, torch.Tensor) and vec.dtype == torch.float32 and vec.shape == (len(ids), 4), \
            f"vec came back as {type(vec).__name__} {getattr(vec, 'dtype', [getattr(t, 'dtype', t) for t in vec])}"
        want = torch.stack([torch.tensor([i, i + 0.5, -i, 1 / (i + 1)], dtype=torch.float32) for i in ids.tolist()])
        assert torch.equal(vec, want)
        seen += ids.tolist()
    assert sorted(seen) == list(range(N))
    with readers.open_shard("parquet", f"{url}/part-0.parquet") as r:
        assert r.schema == {"i": "int", "vec": "ndarray"}
        v = r.get(3)["vec"]
    assert isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (4,) and v.flags.writeable


def test_ragged_lists_name_the_field_and_collate_fn(tmp_path: Path, cache: NodeCache,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    ids = [list(range(1 + i % 5)) for i in range(N)]
    url = _indexed(tmp_path / "tok", pa.table({"i": list(range(N)), "input_ids": ids}), capsys)
    ds = StreamingDataset(url, cache=cache, shuffle=False)
    with pytest.raises(RuntimeError) as info:
        for _ in datacache.DataLoader(ds, batch_size=4, num_workers=2):
            pass
    last = str(info.value).strip().splitlines()[-1]  # the worker's traceback ends with the error it raised
    assert last.startswith("RuntimeError: datacache: field 'input_ids' holds lists of different lengths"), last
    assert "collate_fn=" in last, last

    def lengths(samples: list[dict[str, Any]]) -> list[int]:
        return [len(s["input_ids"]) for s in samples]

    got = [n for b in datacache.DataLoader(ds, batch_size=4, collate_fn=lengths) for n in b]
    assert sorted(got) == sorted(len(x) for x in ids)  # the way out the message names works
