"""Format knowledge lives in the format modules: a remote object's cheap check (``probe``), the
WebDataset key split and a plain tar's field kinds; the CLI only asks them."""
from __future__ import annotations

import ast
import io
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datacache import readers
from datacache.readers import ReaderError
from datacache.readers.tar import member_key

ROOT = Path(__file__).resolve().parents[1]


class _Ranges:
    """``read_range`` over bytes, counting the reads (as a remote object's range requests)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.calls = data, 0

    def __call__(self, start: int, end: int) -> bytes:
        self.calls += 1
        return self.data[start:end]


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=7)
    return buf.getvalue()


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_parquet_probe_tells_rows_and_schema_from_the_footer_in_one_read() -> None:
    data = _parquet_bytes(pa.table({"t": [f"r{i}" for i in range(30)], "n": list(range(30)),
                                    "f": [i / 2 for i in range(30)], "b": [b"x"] * 30}))
    ranges = _Ranges(data)
    fmt = readers.get_format("parquet")
    assert fmt.probe is not None and not fmt.union_schema
    assert fmt.probe(ranges, len(data), "s3://b/p/part.parquet") == \
        (30, {"t": "str", "n": "int", "f": "float", "b": "bytes"})
    assert ranges.calls == 1


@pytest.mark.parametrize("fmt_name, other", [("parquet", "tar"), ("tar", "parquet")])
def test_probe_refuses_a_file_of_another_format_naming_it(fmt_name: str, other: str) -> None:
    data = _tar_bytes({"a.jpg": b"x" * 600}) if other == "tar" else _parquet_bytes(pa.table({"n": [1]}))
    probe = readers.get_format(fmt_name).probe
    assert probe is not None
    with pytest.raises(ReaderError, match=f"not a {fmt_name} file") as info:
        probe(_Ranges(data), len(data), "s3://b/p/obj")
    assert info.value.path == "s3://b/p/obj" and info.value.message.startswith(f"not a {fmt_name} file")


def test_plain_webdataset_tar_reports_one_bytes_field_per_extension(tmp_path: Path) -> None:
    path = tmp_path / "wds.tar"
    path.write_bytes(_tar_bytes({"d/s1.jpg": b"j", "d/s1.cls": b"1", "d/s2.jpg": b"j", "d/s2.meta.json": b"{}",
                                 "README": b"skipped"}))
    assert readers.get_format("tar").union_schema
    with readers.open_shard("tar", path) as r:
        assert r.schema is None and len(r) == 2
        assert r.field_kinds() == {"jpg": "bytes", "cls": "bytes", "meta.json": "bytes"}
    assert member_key("a/b/0001.seg.png") == ("a/b/0001", "seg.png") and member_key("a/README") is None


def test_cli_modules_hold_no_format_knowledge() -> None:
    for path in sorted((ROOT / "datacache").glob("_cli*.py")):
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not imported & {"tarfile", "pyarrow", "pyarrow.parquet", "readers.parquet"}, path.name
