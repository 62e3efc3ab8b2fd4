"""``datacache write`` and ``datacache index`` on what a new user brings: image class folders,
Hugging Face Parquet (splits, float32 columns, image structs), remote Parquet files."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datacache import load_manifest, open_store, readers, write_dataset
from datacache.cli.main import main

CLASSES = ["cat", "dog", "zebra"]
PER_CLASS = 6


def _cli(args: list[str], capsys: pytest.CaptureFixture[str], rc: int = 0) -> tuple[Any, str]:
    code = main([*args, "--json", "--quiet"])
    out = capsys.readouterr()
    assert code == rc, (code, out.out, out.err)
    return (json.loads(out.out) if rc == 0 else None), out.err


def _read(url: str, opts: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every sample of the dataset at ``url``, in shard order (shards fetched through the store)."""
    store = open_store(url, opts)
    m = load_manifest(store)
    out = []
    for info in m.shards:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dc-test-{os.getpid()}-{info.name.replace('/', '_')}"
        path.write_bytes(store.read_bytes(info.name))
        try:
            with readers.open_shard(m.format, path) as r:
                out += list(r)
        finally:
            path.unlink()
    return out


def _image_folder(root: Path) -> Path:
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(PER_CLASS):
            (root / c / f"{i:03d}.jpg").write_bytes(f"{c}-{i}".encode() * 10)
            (root / c / f"{i:03d}.txt").write_bytes(c.encode())
    return root


def test_write_image_folder_adds_labels_and_warns_that_it_is_class_sorted(tmp_path: Path, capsys: Any) -> None:
    src = str(_image_folder(tmp_path / "images")) + "/"
    out, err = _cli(["write", src, str(tmp_path / "plain")], capsys)
    assert out["classes"] == CLASSES and out["num_samples"] == 2 * len(CLASSES) * PER_CLASS
    assert "class folder by class folder (3 classes)" in err and "--shuffle" in err
    got = _read(str(tmp_path / "plain"))
    for s in got:
        cls = s["__key__"].split("/")[0]
        assert s["class"] == cls and s["label"] == CLASSES.index(cls)
    assert [s["label"] for s in got] == sorted(s["label"] for s in got)  # class-sorted, as warned

    out, err = _cli(["write", src, str(tmp_path / "grouped"), "--group", "--format", "tar"], capsys)
    grouped = _read(str(tmp_path / "grouped"))
    assert len(grouped) == len(CLASSES) * PER_CLASS
    assert all(s["txt"].decode() == CLASSES[s["label"]] == s["class"] for s in grouped)


def test_write_shuffle_is_seeded_and_mixes_the_classes(tmp_path: Path, capsys: Any) -> None:
    src = str(_image_folder(tmp_path / "images"))
    orders = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        _, err = _cli(["write", src, str(tmp_path / name), "--group", "--shuffle", "--seed", seed], capsys)
        assert "warning" not in err
        got = _read(str(tmp_path / name))
        assert all(s["label"] == CLASSES.index(s["__key__"].split("/")[0]) for s in got)
        orders.append([s["__key__"] for s in got])
    assert orders[0] == orders[1] != orders[2]
    assert sorted(orders[0]) == sorted(orders[2]) and orders[0] != sorted(orders[0])
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    _, err = _cli(["write", str(tmp_path / "x.jsonl"), str(tmp_path / "d"), "--shuffle"], capsys, rc=2)
    assert "--shuffle shuffles the files of a folder" in err


def _hf_table(n: int, offset: int = 0) -> pa.Table:
    png = [b"\x89PNG" + bytes([i]) * 30 for i in range(offset, offset + n)]
    return pa.table({
        "image": pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(png, offset)]),
        "label": list(range(offset, offset + n)),
        "score": pa.array([i / 4 for i in range(offset, offset + n)], pa.float32()),
    })


def _check_hf(got: list[dict[str, Any]], n: int) -> None:
    assert [s["label"] for s in got] == list(range(n))
    assert all(s["image"] == b"\x89PNG" + bytes([s["label"]]) * 30 for s in got)
    assert all(np.asarray(s["score"]).dtype == np.float32 and float(s["score"]) == s["label"] / 4 for s in got)


def test_parquet_float32_columns_keep_their_dtype_when_read(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"f": pa.array([0.5, 1.5], pa.float32()), "d": [0.5, 1.5]}), path)
    with readers.open_shard("parquet", path) as r:
        rows = list(r)
    assert [type(s["f"]) for s in rows] == [np.float32, np.float32] and rows[1]["f"] == 1.5
    assert isinstance(rows[0]["d"], float)


def test_write_local_hf_parquet_keeps_images_and_float32(tmp_path: Path, capsys: Any) -> None:
    pq.write_table(_hf_table(20), tmp_path / "train.parquet")
    out, _ = _cli(["write", str(tmp_path / "train.parquet"), str(tmp_path / "out")], capsys)
    assert out["schema"] == {"image": "bytes", "label": "int", "score": "ndarray"}
    _check_hf(_read(str(tmp_path / "out")), 20)


def _put_parquet(store: Any, name: str, table: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    store.write_bytes(name, buf.getvalue())


def test_write_remote_parquet_file_and_indexed_hf_prefix(s3_server: Any, make_s3_url: Any, capsys: Any) -> None:
    opts = json.dumps(s3_server.storage_options())
    src, dest, dest2 = make_s3_url(), make_s3_url(), make_s3_url()
    store = open_store(src, s3_server.storage_options())
    _put_parquet(store, "data/train-00000-of-00002.parquet", _hf_table(10))
    _put_parquet(store, "data/train-00001-of-00002.parquet", _hf_table(10, offset=10))
    out, _ = _cli(["write", f"{src}data/train-00000-of-00002.parquet", dest, "--storage-options", opts], capsys)
    assert out["src_type"] == "parquet" and out["num_samples"] == 10
    _check_hf(_read(dest, s3_server.storage_options()), 10)
    _cli(["index", src, "--format", "parquet", "--storage-options", opts], capsys)
    out, _ = _cli(["write", src, dest2, "--storage-options", opts], capsys)
    assert out["src_type"] == "dataset" and out["num_samples"] == 20
    _check_hf(_read(dest2, s3_server.storage_options()), 20)


def test_index_refuses_mixed_splits_and_takes_split(s3_server: Any, make_s3_url: Any, capsys: Any) -> None:
    opts = json.dumps(s3_server.storage_options())
    url = make_s3_url()
    store = open_store(url, s3_server.storage_options())
    for name, n in (("data/train-00000-of-00002.parquet", 5), ("data/train-00001-of-00002.parquet", 6),
                    ("data/test-00000-of-00001.parquet", 3), ("other/validation/0000.parquet", 2)):
        _put_parquet(store, name, pa.table({"x": list(range(n))}))
    _, err = _cli(["index", url, "--format", "parquet", "--storage-options", opts], capsys, rc=2)
    assert "test, train, validation" in err and "--split train" in err
    out, _ = _cli(["index", url, "--format", "parquet", "--split", "train", "--storage-options", opts], capsys)
    assert out["num_shards"] == 2 and out["num_samples"] == 11
    assert load_manifest(store).extra["split"] == "train"
    out, _ = _cli(["index", url, "--format", "parquet", "--split", "validation", "--force",
                   "--storage-options", opts], capsys)
    assert out["num_samples"] == 2
    _, err = _cli(["index", url, "--format", "parquet", "--split", "nope", "--force",
                   "--storage-options", opts], capsys, rc=3)
    assert "split 'nope'" in err


@pytest.mark.parametrize("fmt, expected", [("parquet", "not a parquet file (no PAR1 magic at the end)"),
                                           ("tar", "not a tar file")])
def test_index_names_an_object_of_another_format(fmt: str, expected: str, s3_server: Any, make_s3_url: Any,
                                                 capsys: Any) -> None:
    """The format's probe (readers) finds it; the CLI's message names the object and the flags."""
    opts = json.dumps(s3_server.storage_options())
    url = make_s3_url()
    open_store(url, s3_server.storage_options()).write_bytes(f"part-0.{fmt}", b"junk" * 300)
    _, err = _cli(["index", url, "--format", fmt, "--storage-options", opts], capsys, rc=3)
    assert f"{url}part-0.{fmt}: {expected}" in err and "Check --format and --pattern" in err


_MDS_INDEX = {"version": 2, "shards": [{
    "column_encodings": ["int", "str"], "column_names": ["label", "text"], "column_sizes": [8, None],
    "compression": None, "format": "mds", "hashes": [], "samples": 2, "size_limit": 67108864, "version": 2,
    "raw_data": {"basename": "shard.00000.mds", "bytes": 64, "hashes": {}}, "zip_data": None}]}
_LITDATA_INDEX = {"chunks": [{"chunk_bytes": 64, "chunk_size": 2, "dim": None, "filename": "chunk-0-0.bin"}],
                  "config": {"chunk_bytes": 64000000, "chunk_size": None, "compression": None,
                             "data_format": ["int", "str"], "data_spec": "[1, {}]", "item_loader": "PyTreeLoader"},
                  "updated_at": "1712345678.0"}


def _foreign(root: Path, layout: str) -> Path:
    """A folder as the library named ``layout`` writes it (index and data files; the data is junk)."""
    root.mkdir()
    if layout == "mds":
        (root / "index.json").write_text(json.dumps(_MDS_INDEX))
        (root / "shard.00000.mds").write_bytes(b"\0" * 64)
    elif layout == "litdata":
        (root / "index.json").write_text(json.dumps(_LITDATA_INDEX))
        (root / "chunk-0-0.bin").write_bytes(b"\0" * 64)
    elif layout == "datacache":  # a dataset in a folder of the source
        write_dataset(({"i": i} for i in range(3)), str(root / "train"), progress=False)
    elif layout == "hf":
        (root / "dataset_info.json").write_text(json.dumps({"citation": "", "features": {}}))
        (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
        (root / "data-00000-of-00001.arrow").write_bytes(b"\0" * 64)
    else:  # a DatasetDict saved to disk
        (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
        (root / "train").mkdir()
        (root / "train" / "state.json").write_text("{}")
    return root


@pytest.mark.parametrize("layout, what, todo", [
    ("mds", "is a MosaicML Streaming (MDS) dataset (index.json)", "`datacache index {src}`"),
    ("litdata", "is a LitData optimized dataset (index.json)", "`datacache index {src}`"),
    ("datacache", "/train (in {src}) is a datacache dataset (manifest.json)", "pass that folder itself"),
    ("hf", "is a Hugging Face datasets folder (save_to_disk)", "`datacache index {src}`"),
    ("hf_dict", "is a Hugging Face datasets folder (save_to_disk)", "`datacache index {src}/SPLIT`"),
], ids=["mds", "litdata", "datacache", "hf", "hf_dict"])
def test_write_refuses_a_folder_holding_another_librarys_dataset(tmp_path: Path, capsys: Any, layout: str,
                                                                 what: str, todo: str) -> None:
    """Issue 37.5: ``datacache write`` of an MDS folder wrote index.json and the shards as samples."""
    src = str(_foreign(tmp_path / "src", layout))
    _, err = _cli(["write", src, str(tmp_path / "out")], capsys, rc=2)
    assert len(err.strip().splitlines()) == 1 and what.format(src=src) in err and todo.format(src=src) in err, err
    assert "--src-type folder" in err and not (tmp_path / "out").exists()
    out, _ = _cli(["write", src, str(tmp_path / "raw"), "--src-type", "folder"], capsys)  # asked for: the files
    assert out["src_type"] == "folder" and out["num_samples"] >= 2


def test_write_takes_a_folder_with_an_index_json_of_its_own(tmp_path: Path, capsys: Any) -> None:
    """An ``index.json`` that is not a dataset index (nor a stray manifest.json) is a file like any other."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "index.json").write_text(json.dumps({"pages": ["a", "b"], "shards": 3}))
    (src / "sub").mkdir()
    (src / "sub" / "manifest.json").write_text(json.dumps({"name": "my app"}))
    out, _ = _cli(["write", str(src), str(tmp_path / "out")], capsys)
    assert out["num_samples"] == 2
