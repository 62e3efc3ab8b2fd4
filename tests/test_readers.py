"""Tests for the ``readers`` package: one suite parametrized over every registered format,
plus codec, registry and format-specific (security) tests."""
from __future__ import annotations

import io
import json
import math
import multiprocessing
import os
import pickle
import random
import resource
import struct
import tarfile
import tempfile
from typing import Any, Callable

import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from datacache import readers
from datacache.readers import ReaderError, codec
from datacache.readers import zstd as rzstd
from datacache.readers._dczindex import HEAD
from tests.helpers.crafted import bomb_frame, craft_dcz

FORMAT_NAMES = sorted(name for name, fmt in readers.FORMATS.items() if fmt.writes)  # read in place only: not
# Small blocks / row groups so the generic suite crosses block and row-group boundaries.
WRITER_KW: dict[str, dict[str, Any]] = {"zstd": {"block_bytes": 4096},
                                        "parquet": {"row_group_rows": 7}}
SampleSet = tuple[dict[str, str], list[dict[str, Any]]]


# -- sample sets ------------------------------------------------------------------------------
def _mixed() -> SampleSet:
    rng = random.Random(1)
    ints = [0, 1, -1, 2**63 - 1, -(2**63)]
    floats = [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 1e-308]
    samples = [{
        "img": rng.randbytes(rng.choice([0, 1, 100, 3000])),
        "txt": rng.choice(["", "hello", "héllo wörld ✓", "x" * 500]),
        "n": ints[i % len(ints)] if i < 10 else rng.randint(-10**9, 10**9),
        "f": floats[i % len(floats)] if i < 10 else rng.random(),
        "arr": np.arange(i % 5 * 3, dtype=np.float32).reshape(-1, 3),
    } for i in range(40)]
    return {"img": "bytes", "txt": "str", "n": "int", "f": "float", "arr": "ndarray"}, samples


def _empty_fields() -> SampleSet:
    schema = {"b": "bytes", "s": "str", "i": "int", "f": "float", "a": "ndarray"}
    return schema, [{"b": b"", "s": "", "i": 0, "f": 0.0, "a": np.zeros(0)} for _ in range(5)]


def _large() -> SampleSet:
    rng = np.random.default_rng(2)
    samples = [{"blob": rng.bytes(2_500_000), "arr": np.zeros(3, np.int8)},
               {"blob": b"tiny", "arr": rng.random((400, 400))},  # 1.28 MB array
               {"blob": rng.bytes(1_100_000), "arr": np.ones((0, 7))}]
    return {"blob": "bytes", "arr": "ndarray"}, samples


def _arrays() -> SampleSet:
    base = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    values = [np.array(7, dtype=np.int32), np.array(2.5), np.zeros((0,), np.uint8),
              np.zeros((2, 0, 5), np.float16), np.arange(6, dtype=">i2").reshape(2, 3),
              np.asfortranarray(base), base[:, ::2, 1:], np.array([True, False]),
              np.array(["ab", "cde"], dtype="U3"), np.array([b"xy"], dtype="S4"),
              np.array([1 + 2j], np.complex128), np.array(["2024-01-01"], "datetime64[ns]"),
              np.ones((1, 1, 1, 1), np.uint64)]
    return {"a": "ndarray", "i": "int"}, [{"a": v, "i": k} for k, v in enumerate(values)]


def _single() -> SampleSet:
    return {"x": "bytes"}, [{"x": b"only one"}]


def _tiny() -> SampleSet:
    return {"k": "int"}, [{"k": i} for i in range(3000)]


def _uniform() -> SampleSet:  # equal-sized samples: the zstd reader decodes a block's at once
    return {"x": "ndarray", "i": "int"}, [{"x": np.full(16, k % 251, np.uint8), "i": k} for k in range(300)]


def _empty() -> SampleSet:
    return {"x": "bytes"}, []


SAMPLE_SETS: dict[str, Callable[[], SampleSet]] = {
    "mixed": _mixed, "empty_fields": _empty_fields, "large": _large, "arrays": _arrays,
    "single": _single, "tiny": _tiny, "uniform": _uniform, "empty": _empty}


# -- helpers ----------------------------------------------------------------------------------
def write_shard(fmt_name: str, path: str | os.PathLike[str], schema: dict[str, str],
                samples: list[dict[str, Any]], **kw: Any) -> str:
    fmt = readers.get_format(fmt_name)
    with fmt.ShardWriter(path, schema, **{**WRITER_KW.get(fmt_name, {}), **kw}) as writer:
        for sample in samples:
            writer.write(sample)
    assert writer.samples_written == len(samples)
    return os.fspath(path)


def shard_path(tmp_path: Any, fmt_name: str, stem: str = "shard") -> str:
    return str(tmp_path / f"{stem}{readers.get_format(fmt_name).extension}")


def same_value(got: Any, want: Any) -> bool:
    if isinstance(want, np.ndarray):
        return (isinstance(got, np.ndarray) and got.dtype == want.dtype
                and got.shape == want.shape and got.tobytes() == want.tobytes())
    if isinstance(want, float):
        if math.isnan(want):
            return isinstance(got, float) and math.isnan(got)
        return type(got) is float and struct.pack("<d", got) == struct.pack("<d", want)
    if isinstance(want, (bytes, bytearray, memoryview)):
        return type(got) is bytes and got == bytes(want)
    return type(got) is type(want) and got == want


def assert_sample(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) - set(want) <= {"__key__"}, f"unexpected fields {set(got) - set(want)}"
    for field, value in want.items():
        assert field in got, f"missing field {field!r}"
        assert same_value(got[field], value), f"field {field!r}: {got[field]!r} != {value!r}"


def assert_samples(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_sample(g, w)


def read_all(fmt_name: str, path: str, **kw: Any) -> list[dict[str, Any]]:
    with readers.open_shard(fmt_name, path, **kw) as reader:
        return [reader.get(i) for i in range(len(reader))] + list(reader)


@pytest.fixture(params=FORMAT_NAMES)
def fmt(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def mixed_shard(fmt: str, tmp_path: Any) -> tuple[str, list[dict[str, Any]]]:
    schema, samples = _mixed()
    return write_shard(fmt, shard_path(tmp_path, fmt), schema, samples), samples


# -- the generic suite (every registered format) -----------------------------------------------
@pytest.mark.parametrize("set_name", sorted(SAMPLE_SETS))
def test_roundtrip(fmt: str, set_name: str, tmp_path: Any) -> None:
    schema, samples = SAMPLE_SETS[set_name]()
    path = write_shard(fmt, shard_path(tmp_path, fmt), schema, samples)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temp/lock files left
    rng = random.Random(3)
    n = len(samples)
    with readers.open_shard(fmt, path) as reader:
        assert len(reader) == n
        assert_samples(list(reader), samples)
        for i in rng.sample(range(n), min(n, 50)):
            assert_sample(reader.get(i), samples[i])
        for _ in range(5):
            start = rng.randint(0, n)
            stop = rng.randint(start, n)
            assert_samples(list(reader.iter_range(start, stop)), samples[start:stop])
        assert list(reader.iter_range(n, n)) == [] and list(reader.iter_range(n, 0)) == []
        for k in (1, 3, n // 3, n):  # many sorted indices at once (a node mix's rows): what get returns
            rows = sorted(rng.sample(range(n), min(n, k)))
            assert_samples(reader.get_many(rows), [samples[i] for i in rows])
        assert reader.get_many([]) == []
        with pytest.raises(IndexError):
            reader.get_many([0, n])


def test_index_errors(fmt: str, mixed_shard: tuple[str, list[dict[str, Any]]]) -> None:
    path, samples = mixed_shard
    reader = readers.open_shard(fmt, path)
    for bad in (len(samples), len(samples) + 100, -1):
        with pytest.raises(IndexError):
            reader.get(bad)
    with pytest.raises(IndexError):
        list(reader.iter_range(0, len(samples) + 1))
    with pytest.raises(IndexError):
        list(reader.iter_range(-1, 2))
    assert_sample(reader[np.int64(3)], samples[3])
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(ValueError):
        reader.get(0)


def _child_read(reader: readers.ShardReader, conn: Any) -> None:
    try:
        samples = list(reader)
        conn.send(("ok", samples, reader._pid == os.getpid()))
    except BaseException as exc:  # report everything to the parent
        conn.send(("error", repr(exc), False))
    finally:
        conn.close()


def test_read_after_fork(fmt: str, mixed_shard: tuple[str, list[dict[str, Any]]]) -> None:
    path, samples = mixed_shard
    ctx = multiprocessing.get_context("fork")
    with readers.open_shard(fmt, path) as reader:
        assert_sample(reader.get(5), samples[5])  # handles are open in the parent
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_read, args=(reader, child_conn))
        proc.start()
        assert parent_conn.poll(30), "child did not answer"
        status, got, reopened = parent_conn.recv()
        proc.join(10)
        assert status == "ok", got
        assert reopened and proc.exitcode == 0
        assert_samples(got, samples)
        assert_samples(list(reader.iter_range(0, 10)), samples[:10])  # parent unaffected


def test_pickled_reader_reopens(fmt: str, mixed_shard: tuple[str, list[dict[str, Any]]]) -> None:
    path, samples = mixed_shard
    with readers.open_shard(fmt, path) as reader:
        reader.get(0)
        clone = pickle.loads(pickle.dumps(reader))
    assert_samples(list(clone), samples)
    clone.close()


def test_other_format_is_rejected(fmt: str, tmp_path: Any) -> None:
    schema, samples = _mixed()
    others = [write_shard(o, shard_path(tmp_path, o, f"other-{o}"), schema, samples)
              for o in FORMAT_NAMES if o != fmt]
    junk = tmp_path / "junk.bin"
    junk.write_bytes(random.Random(4).randbytes(8192))
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    for path in [*others, str(junk), str(empty)]:
        with pytest.raises(ReaderError) as info:
            read_all(fmt, path)
        assert path in str(info.value) and isinstance(info.value, ValueError)


def test_truncated_file_is_rejected(fmt: str, mixed_shard: tuple[str, list[dict[str, Any]]],
                                    tmp_path: Any) -> None:
    path, _ = mixed_shard
    data = open(path, "rb").read()
    for cut in (10, len(data) // 3, len(data) // 2, 2 * len(data) // 3):
        cut_path = tmp_path / f"cut{cut}.bin"
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ReaderError):
            read_all(fmt, str(cut_path))


def test_writer_rejects_bad_samples_and_aborts(fmt: str, tmp_path: Any) -> None:
    path = shard_path(tmp_path, fmt)
    writer = readers.get_format(fmt).ShardWriter(path, {"a": "int", "b": "str"})
    with pytest.raises(ValueError):
        writer.write({"a": 1})
    with pytest.raises(TypeError):
        writer.write({"a": "1", "b": "x"})
    writer.write({"a": 1, "b": "x"})
    assert writer.bytes_written > 0 and writer.samples_written == 1
    writer.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with readers.get_format(fmt).ShardWriter(path, {"a": "int"}) as writer:
            writer.write({"a": 2})
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


# -- registry ---------------------------------------------------------------------------------
def test_registry() -> None:
    assert {"zstd", "parquet", "lmdb", "tar"} <= set(readers.FORMATS)
    exts = {name: readers.get_format(name).extension for name in ("zstd", "parquet", "lmdb", "tar")}
    assert exts == {"zstd": ".dcz", "parquet": ".parquet", "lmdb": ".lmdb", "tar": ".tar"}
    with pytest.raises(readers.UnknownFormatError) as info:
        readers.get_format("csv")
    assert isinstance(info.value, ValueError) and "zstd" in str(info.value)
    with pytest.raises(ValueError):
        readers.register_format("zstd", readers.get_format("tar"))
    with pytest.raises(TypeError):
        readers.register_format("nope", object())
    readers.register_format("zstd", readers.get_format("zstd"))  # same object: fine


def test_reader_error_message() -> None:
    err = ReaderError("not a tar shard (bad header at offset 0)", path="/x/a.tar",
                      hint="Check the dataset's 'format' in manifest.json")
    assert str(err) == ("/x/a.tar: not a tar shard (bad header at offset 0). "
                        "Check the dataset's 'format' in manifest.json")
    assert err.path == "/x/a.tar" and isinstance(err, ValueError)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ReaderError and str(clone) == str(err)
    assert clone.path == "/x/a.tar" and clone.hint == err.hint
    assert readers.lmdb.lmdb is lmdb  # readers/lmdb.py imports the real library


# -- codec ------------------------------------------------------------------------------------
def test_infer_schema() -> None:
    sample = {"a": b"x", "b": bytearray(b"y"), "c": memoryview(b"z"), "d": "s", "e": 3,
              "f": np.int16(4), "g": 2.5, "h": np.float32(1.5), "i": np.zeros(3)}
    assert codec.infer_schema(sample) == {"a": "bytes", "b": "bytes", "c": "bytes", "d": "str",
                                          "e": "int", "f": "int", "g": "float", "h": "float",
                                          "i": "ndarray"}
    for bad in ({"flag": True}, {"flag": np.bool_(True)}, {"flag": None}, {"flag": [1]},
                {"flag": np.array([object()])}):
        with pytest.raises(TypeError, match="flag"):
            codec.infer_schema(bad)


def test_check_sample_errors() -> None:
    schema = {"a": "int", "b": "ndarray"}
    with pytest.raises(ValueError, match="missing"):
        codec.check_sample({"a": 1}, schema)
    with pytest.raises(TypeError, match="'a'"):
        codec.check_sample({"a": True, "b": np.zeros(1)}, schema)
    with pytest.raises(ValueError, match="int64"):
        codec.check_sample({"a": 2**63, "b": np.zeros(1)}, schema)
    with pytest.raises(TypeError, match="object"):
        codec.check_sample({"a": 1, "b": np.array([None])}, schema)
    with pytest.raises(ValueError):
        codec.check_schema({"a": "list"})


def test_decode_rejects_oversized_declarations() -> None:
    # an ndarray field declaring 2**40 x 2**20 float64 in 12 data bytes: no allocation
    raw = bytes([3]) + b"<f8" + bytes([2]) + struct.pack("<QQ", 2**40, 2**20) + bytes(12)
    with pytest.raises(ReaderError):
        codec.decode_field("ndarray", raw)
    with pytest.raises(ReaderError):  # a zero dimension next to an enormous one
        codec.decode_field("ndarray", bytes([3]) + b"<f8" + bytes([2]) +
                           struct.pack("<QQ", 0, 2**61))
    with pytest.raises(ReaderError):  # a field length larger than the buffer
        codec.decode_sample(struct.pack("<Q", 2**62) + b"abc", {"a": "bytes"})
    with pytest.raises(ReaderError):
        codec.decode_field("ndarray", bytes([2]) + b"|O" + bytes([1]) + struct.pack("<Q", 1)
                           + bytes(8))


def test_decoded_arrays_are_zero_copy() -> None:
    buf = codec.encode_sample({"a": np.arange(1000, dtype=np.int64)}, {"a": "ndarray"})
    arr = codec.decode_sample(buf, {"a": "ndarray"})["a"]
    assert not arr.flags.owndata and not arr.flags.writeable


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(codec.KINDS))
def test_decode_fuzz_raises_only_reader_error(raw: bytes, kind: str) -> None:
    try:
        codec.decode_sample(raw, {"x": kind, "y": "ndarray"})
    except ReaderError:
        pass


# -- hypothesis round trips for zstd ----------------------------------------------------------
_DTYPES = [np.uint8, np.int16, np.int32, np.int64, np.float32, np.float64, np.bool_, np.complex64]
_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bytes": st.binary(max_size=300),
    "str": st.text(max_size=40),
    "int": st.integers(-(2**63), 2**63 - 1),
    "float": st.floats(),
    "ndarray": st.sampled_from(_DTYPES).flatmap(lambda dt: hnp.arrays(
        dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))),
}
_SCHEMAS = st.dictionaries(st.text("abcxyz_", min_size=1, max_size=5),
                           st.sampled_from(codec.KINDS), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), _SCHEMAS, st.integers(1, 3000))
def test_zstd_hypothesis_roundtrip(data: st.DataObject, schema: dict[str, str],
                                   block_bytes: int) -> None:
    sample_st = st.fixed_dictionaries({f: _VALUES[k] for f, k in schema.items()})
    samples = data.draw(st.lists(sample_st, max_size=25))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_shard("zstd", os.path.join(tmp, "h.dcz"), schema, samples,
                           block_bytes=block_bytes, level=1)
        with rzstd.ZstdShardReader(path) as reader:
            assert reader.schema == schema
            assert_samples(list(reader), samples)
            if samples:
                i = data.draw(st.integers(0, len(samples) - 1))
                assert_sample(reader.get(i), samples[i])
                rows = sorted(set(data.draw(st.lists(st.integers(0, len(samples) - 1)))))
                assert_samples(reader.get_many(rows), [samples[r] for r in rows])


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**9), st.integers(1, 255))
def test_zstd_byte_flips_raise_only_reader_error(pos: int, xor: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_shard("zstd", os.path.join(tmp, "f.dcz"), *_mixed(), block_bytes=2048)
        data = bytearray(open(path, "rb").read())
        data[pos % len(data)] ^= xor
        open(path, "wb").write(bytes(data))
        try:
            read_all("zstd", path)
        except ReaderError:
            pass


# -- zstd: crafted files, bombs, dictionaries -------------------------------------------------


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _limited_child(fn: Callable[[], Any], headroom: int, conn: Any) -> None:
    limit = _proc_status_kib("VmSize") * 1024 + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    peak = _proc_status_kib("VmHWM")  # a forked child's high-water mark starts afresh
    try:
        fn()
        outcome = "no error"
    except BaseException as exc:
        outcome = type(exc).__name__
    conn.send((outcome, (_proc_status_kib("VmHWM") - peak) * 1024))


def run_with_memory_cap(fn: Callable[[], Any], headroom: int = 400 << 20,
                        max_growth: int = 64 << 20) -> str:
    """Run ``fn`` in a forked child whose address space may grow by ``headroom`` bytes only;
    assert its resident memory grew by less than ``max_growth``; return the outcome."""
    ctx = multiprocessing.get_context("fork")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_limited_child, args=(fn, headroom, child_conn))
    proc.start()
    assert parent_conn.poll(30), "child did not answer"
    outcome, growth = parent_conn.recv()
    proc.join(10)
    assert growth < max_growth, f"resident memory grew by {growth} bytes"
    return outcome


@pytest.mark.timeout(120)  # a hang guard (was: a 10 s wall-clock assert)
def test_zstd_bomb_small_declared_length(tmp_path: Any) -> None:
    declared = 70_000
    frame = bomb_frame(1100 << 20, declared)  # 1.1 GB of zeros, header says 70 kB
    path = craft_dcz(tmp_path / "bomb.dcz", [(frame, declared, [(0, declared)])])
    with rzstd.ZstdShardReader(path) as reader:
        assert run_with_memory_cap(lambda: reader.get(0)) == "ReaderError"
        with pytest.raises(ReaderError, match="decompress"):
            reader.get(0)


def test_zstd_bomb_without_content_size(tmp_path: Any) -> None:
    frame = bomb_frame(1100 << 20, None)
    path = craft_dcz(tmp_path / "bomb.dcz", [(frame, 1000, [(0, 1000)])])
    with rzstd.ZstdShardReader(path) as reader:
        assert run_with_memory_cap(lambda: reader.get(0)) == "ReaderError"


def test_zstd_huge_declared_raw_length(tmp_path: Any) -> None:
    frame = zstandard.ZstdCompressor().compress(b"x" * 100)
    path = craft_dcz(tmp_path / "huge.dcz", [(frame, 2**40, [(0, 100)])])
    assert run_with_memory_cap(lambda: read_all("zstd", path)) == "ReaderError"
    with pytest.raises(ReaderError, match="max_block_bytes"):
        rzstd.ZstdShardReader(path)
    normal = write_shard("zstd", tmp_path / "ok.dcz", *_mixed())
    with pytest.raises(ReaderError, match="max_block_bytes"):
        rzstd.ZstdShardReader(normal, max_block_bytes=100)


@pytest.mark.parametrize("case", ["sample_past_block", "huge_count", "block_past_file",
                                  "bad_schema", "overflowing_offset", "unknown_size"])
def test_zstd_crafted_index_is_rejected(case: str, tmp_path: Any) -> None:
    raw = codec.encode_sample({"x": b"hello"}, {"x": "bytes"})
    frame = zstandard.ZstdCompressor().compress(raw)
    good = (frame, len(raw), [(0, len(raw))])
    kwargs: dict[str, Any] = {}
    blocks = {
        "sample_past_block": [(frame, len(raw), [(1, len(raw))])],
        "huge_count": [good],
        "block_past_file": [(frame + b"", len(raw) + 10**6, [(0, len(raw))])],
        "bad_schema": [good],
        "overflowing_offset": [(frame, len(raw), [(2**64 - 1, 2)])],
        "unknown_size": [(zstandard.ZstdCompressor(write_content_size=False).compress(raw),
                          len(raw), [(0, len(raw))])],
    }[case]
    if case == "huge_count":
        kwargs["sample_count"] = 2**60
    if case == "bad_schema":
        kwargs["schema"] = {"x": "pickle"}
    path = craft_dcz(tmp_path / "c.dcz", blocks, **kwargs)
    if case == "block_past_file":  # point the block beyond the data region
        data = bytearray(open(path, "rb").read())
        io_off = struct.unpack_from("<Q", data, len(data) - 32)[0]
        head = HEAD.size + len(b'{"x":"bytes"}')
        struct.pack_into("<Q", data, io_off + head, 10**9)  # block file offset
        index = bytes(data[io_off:len(data) - 32])
        data[-32:] = rzstd._encode_footer(io_off, index, 1)
        open(path, "wb").write(bytes(data))
    with pytest.raises(ReaderError):
        read_all("zstd", path)


def test_zstd_truncated_by_one_byte(tmp_path: Any) -> None:
    path = write_shard("zstd", tmp_path / "t.dcz", *_mixed())
    data = open(path, "rb").read()
    (tmp_path / "t.dcz").write_bytes(data[:-1])
    with pytest.raises(ReaderError, match="truncated or corrupt"):
        rzstd.ZstdShardReader(path)
    (tmp_path / "t.dcz").write_bytes(data[:-40] + data[-32:])  # index shortened: bad checksum
    with pytest.raises(ReaderError):
        rzstd.ZstdShardReader(path)


def test_zstd_default_blocks_with_large_samples(tmp_path: Any) -> None:
    schema, samples = _large()  # every sample is larger than the default 1 MiB block
    path = write_shard("zstd", tmp_path / "l.dcz", schema, samples,
                       block_bytes=rzstd.DEFAULT_BLOCK_BYTES)
    with rzstd.ZstdShardReader(path) as reader:
        assert len(reader._blocks) == len(samples)
        assert_samples([reader.get(i) for i in (2, 0, 1)], [samples[i] for i in (2, 0, 1)])


def _json_samples(n: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    return [{"j": json.dumps({"user": rng.choice(["alice", "bob", "carol"]), "id": i,
                              "tags": ["train", "image", "label"][: i % 3 + 1],
                              "score": rng.random()})} for i in range(n)]


def test_zstd_trained_dictionary(tmp_path: Any) -> None:
    samples = _json_samples(2000)
    plain = write_shard("zstd", tmp_path / "plain.dcz", {"j": "str"}, samples, block_bytes=256)
    trained = write_shard("zstd", tmp_path / "dict.dcz", {"j": "str"}, samples, block_bytes=256,
                          train_dictionary=True, dict_train_samples=500, dict_size=8192)
    assert os.path.getsize(trained) < os.path.getsize(plain)
    with rzstd.ZstdShardReader(trained) as reader:
        assert reader._dict_bytes is not None
        assert_samples(list(reader), samples)
        assert_sample(reader.get(1234), samples[1234])
    # too few samples to train: falls back to no dictionary
    few = write_shard("zstd", tmp_path / "few.dcz", {"j": "str"}, samples[:3],
                      train_dictionary=True)
    assert_samples(read_all("zstd", few)[:3], samples[:3])


def test_zstd_given_dictionary(tmp_path: Any) -> None:
    samples = _json_samples(600)
    dictionary = zstandard.train_dictionary(4096, [s["j"].encode() for s in samples[:400]])
    path = write_shard("zstd", tmp_path / "d.dcz", {"j": "str"}, samples, block_bytes=512,
                       dictionary=dictionary)
    assert_samples(read_all("zstd", path)[:600], samples)


class _CountingDctx:
    def __init__(self, inner: zstandard.ZstdDecompressor) -> None:
        self.inner, self.calls = inner, 0

    def stream_reader(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        return self.inner.stream_reader(*args, **kw)


def test_zstd_each_block_decompressed_once(tmp_path: Any) -> None:
    schema, samples = _tiny()
    path = write_shard("zstd", tmp_path / "s.dcz", schema, samples, block_bytes=1000)
    with rzstd.ZstdShardReader(path) as reader:
        nblocks = len(reader._blocks)
        assert nblocks > 10
        counter = reader._dctx = _CountingDctx(reader._dctx)  # type: ignore[assignment]
        assert_samples(list(reader.iter_range(0, len(reader))), samples)
        assert counter.calls == nblocks
        reader._cached = (-1, memoryview(b""))
        counter.calls = 0
        for i in range(len(reader)):
            reader.get(i)
        assert counter.calls == nblocks


# -- parquet ----------------------------------------------------------------------------------
def test_parquet_column_projection(tmp_path: Any) -> None:
    schema, samples = _mixed()
    path = write_shard("parquet", tmp_path / "p.parquet", schema, samples)
    with readers.open_shard("parquet", path, columns=["txt", "arr"]) as reader:
        assert reader.schema == {"txt": "str", "arr": "ndarray"}
        got = list(reader)
    assert_samples(got, [{"txt": s["txt"], "arr": s["arr"]} for s in samples])
    with pytest.raises(ReaderError, match="nope"):
        readers.open_shard("parquet", path, columns=["nope"])
    assert pq.ParquetFile(path).metadata.num_row_groups == 6  # 40 rows / 7 per group


def test_parquet_without_datacache_metadata(tmp_path: Any) -> None:
    table = pa.table({
        "image": pa.array([b"\x89PNG", b"", None], pa.binary()),
        "text": pa.array(["a", "", "ü"], pa.large_string()),
        "label": pa.array([1, 2, 3], pa.int32()),
        "score": pa.array([0.5, 1.5, None], pa.float32()),
        "tags": pa.array([[1, 2], [], None], pa.list_(pa.int64())),
        "flag": pa.array([True, False, True]),
    })
    path = str(tmp_path / "hf.parquet")
    pq.write_table(table, path, row_group_size=2)
    with readers.open_shard("parquet", path) as reader:
        assert reader.schema == {"image": "bytes", "text": "str", "label": "int",
                                 "score": "float", "tags": "any", "flag": "any"}
        assert list(reader) == table.to_pylist()
        assert reader.get(2) == table.to_pylist()[2]


# -- lmdb -------------------------------------------------------------------------------------
def test_lmdb_foreign_file(tmp_path: Any) -> None:
    path = str(tmp_path / "foreign.lmdb")
    items = {b"zebra": b"1", b"apple": b"", b"\x00\x01": b"x" * 5000, b"m" * 100: b"mid"}
    env = lmdb.open(path, subdir=False, map_size=1 << 20)
    with env.begin(write=True) as txn:
        for key, value in items.items():
            txn.put(key, value)
    env.close()
    if os.path.exists(path + "-lock"):
        os.remove(path + "-lock")
    want = [{"key": k, "value": items[k]} for k in sorted(items)]
    with readers.open_shard("lmdb", path) as reader:
        assert reader.schema == {"key": "bytes", "value": "bytes"}
        assert len(reader) == len(items) and list(reader) == want
        assert reader.get(2) == want[2] and list(reader.iter_range(1, 3)) == want[1:3]


def test_lmdb_map_grows(tmp_path: Any) -> None:
    samples = [{"b": os.urandom(50_000)} for _ in range(40)]
    path = write_shard("lmdb", tmp_path / "g.lmdb", {"b": "bytes"}, samples,
                       map_size=64 << 10, commit_bytes=300_000)
    assert os.listdir(tmp_path) == ["g.lmdb"]
    assert_samples(read_all("lmdb", path)[:40], samples)


# -- tar --------------------------------------------------------------------------------------
def _tar_bytes(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def test_tar_webdataset_without_schema(tmp_path: Any) -> None:
    names = [("shard/", b""), ("shard/000001.jpg", b"JPEG1"), ("shard/000001.cls", b"3"),
             ("shard/000001.seg.png", b""), ("shard/README", b"skipped"),
             ("shard/000002.jpg", b"JPEG2"), ("shard/000002.cls", b"7")]
    members = []
    for name, data in names:
        info = tarfile.TarInfo(name.rstrip("/"))
        info.type = tarfile.DIRTYPE if name.endswith("/") else tarfile.REGTYPE
        members.append((info, data))
    path = tmp_path / "wds.tar"
    path.write_bytes(_tar_bytes(members))
    with readers.open_shard("tar", str(path)) as reader:
        assert reader.schema is None
        assert list(reader) == [
            {"__key__": "shard/000001", "jpg": b"JPEG1", "cls": b"3", "seg.png": b""},
            {"__key__": "shard/000002", "jpg": b"JPEG2", "cls": b"7"}]


def _member(name: str, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        info.linkname = "000001.jpg"
    return info


@pytest.mark.parametrize("member", [
    _member("../evil.jpg"), _member("a/../../evil.jpg"), _member("/etc/passwd.txt"),
    _member("a\\b.jpg"), _member("000002.jpg", tarfile.SYMTYPE),
    _member("000002.jpg", tarfile.LNKTYPE), _member("000002.dev", tarfile.CHRTYPE),
    _member("000002.fifo", tarfile.FIFOTYPE)], ids=lambda m: f"{m.name}-{m.type!r}")
def test_tar_unsafe_members_are_rejected(member: tarfile.TarInfo, tmp_path: Any) -> None:
    path = tmp_path / "evil.tar"
    path.write_bytes(_tar_bytes([(_member("000001.jpg"), b"ok"), (member, b"data")]))
    with pytest.raises(ReaderError, match="unsafe|not a regular file"):
        readers.open_shard("tar", str(path))
    assert sorted(os.listdir(tmp_path)) == ["evil.tar"]  # nothing extracted


def test_tar_huge_longname_header_does_not_allocate(tmp_path: Any) -> None:
    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = tarfile.GNUTYPE_LONGNAME, 8 * 1024**3 - 1
    path = tmp_path / "long.tar"
    path.write_bytes(info.tobuf(format=tarfile.GNU_FORMAT) + bytes(1024))
    assert run_with_memory_cap(lambda: readers.open_shard("tar", str(path))) == "ReaderError"


def test_tar_member_size_beyond_file(tmp_path: Any) -> None:
    data = bytearray(_tar_bytes([(_member("000001.jpg"), b"x" * 100)]))
    data[124:136] = b"%011o\0" % (10**9)  # size field
    data[148:156] = b"        "
    data[148:155] = b"%06o\0" % sum(data[:512])  # fix the header checksum
    path = tmp_path / "big.tar"
    path.write_bytes(bytes(data))
    with pytest.raises(ReaderError, match="beyond the file size|truncated"):
        readers.open_shard("tar", str(path))
