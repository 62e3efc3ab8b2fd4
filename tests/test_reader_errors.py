"""One reader error: every failure of a reader is a ``readers.ReaderError`` (never a bare
UnicodeDecodeError, lmdb.Error or ValueError), and the readers package imports one way."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datacache import readers
from datacache.readers import ReaderError
from tests.helpers.layers import absolute_imports, circles, import_graph

READERS = Path(readers.__file__).resolve().parent


def _crafted_parquet(tmp_path: Path, table: pa.Table, old: bytes, new: bytes) -> str:
    path = str(tmp_path / "crafted.parquet")
    pq.write_table(table, path, compression="NONE")
    data = Path(path).read_bytes()
    assert old in data and len(old) == len(new)
    Path(path).write_bytes(data.replace(old, new))
    return path


@pytest.mark.parametrize("where", ["column name", "string value"])
def test_parquet_invalid_utf8_is_a_reader_error(where: str, tmp_path: Path) -> None:
    text = "\u00e9\u00e9\u00e9zz"
    table = pa.table({text: [1, 2]}) if where == "column name" else pa.table({"s": [text, "ok"]})
    path = _crafted_parquet(tmp_path, table, text.encode(), b"\xa1" * 8)
    with pytest.raises(ReaderError, match="crafted.parquet"):
        with readers.open_shard("parquet", path) as r:
            list(r)


def test_unknown_format_and_closed_reader_are_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(ReaderError, match="known formats"):
        readers.get_format("csv")
    assert issubclass(readers.UnknownFormatError, ReaderError)
    path = str(tmp_path / "a.tar")
    with readers.get_format("tar").ShardWriter(path, {"x": "int"}) as w:
        w.write({"x": 1})
    r = readers.open_shard("tar", path)
    r.close()
    with pytest.raises(ReaderError, match="a.tar: reader is closed"):
        r.get(0)


def test_readers_import_one_way_and_never_datacache() -> None:
    graph = import_graph(READERS)
    assert not circles(graph), f"import circles through {circles(graph)}"
    assert "codec" not in graph["errors"] and "base" not in graph["codec"]
    for p in READERS.glob("*.py"):
        assert "datacache" not in absolute_imports(p), f"{p.name} imports datacache"
