"""The public API is exactly what __all__ says, and every name in it exists; the layering holds."""
import importlib
import pathlib
import subprocess
import sys

import datacache
import readers
from tests.helpers.layers import circles, import_graph

EXPECTED = {
    "__version__", "write_dataset", "DatasetWriter", "Manifest", "ShardInfo", "load_manifest", "open_store", "Store",
    "NodeCache", "CacheHandle", "LRUPolicy", "ClairvoyantPolicy", "Schedule", "StreamingDataset", "DataLoader", "CachedDataset", "Stream", "CacheConfig",
    "PrefetchConfig", "TransferConfig", "RetryConfig", "parse_size", "DatacacheError", "StorageError",
    "TransientStorageError", "ThrottledError", "UnreachableError", "NotFoundError", "PermissionDeniedError",
    "ManifestError",
    "IntegrityError",
    "ReaderError", "CacheError", "DatasetExistsError",
}


def test_all_is_guarded() -> None:
    assert set(datacache.__all__) == EXPECTED
    for name in datacache.__all__:
        assert hasattr(datacache, name), name


def test_every_module_declares_all() -> None:
    for mod in ("datacache.cache", "datacache.config", "datacache.dataset", "datacache.errors", "datacache.eviction",
                "datacache.manifest", "datacache.mapped", "datacache.plan", "datacache.prefetch", "datacache.resume",
                "datacache.storage", "datacache.writer", "datacache.shards", "datacache.nodeplan", "datacache.congestion", "datacache.streams",
                "readers", "readers.codec"):
        m = importlib.import_module(mod)
        for name in m.__all__:
            assert hasattr(m, name), f"{mod}.{name}"


def test_only_storage_imports_fsspec() -> None:
    root = pathlib.Path(datacache.__file__).parent
    users = sorted(p.name for p in root.glob("*.py") if "import fsspec" in p.read_text() or "from fsspec" in p.read_text())
    assert users == ["storage.py"]
    for p in pathlib.Path(readers.__file__).parent.glob("*.py"):
        text = p.read_text()
        assert "import fsspec" not in text and "from datacache" not in text and "import datacache" not in text, p.name


def test_version_and_cli_help() -> None:
    out = subprocess.run([sys.executable, "-c", "import datacache, readers; print(datacache.__version__)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == datacache.__version__
    # the installed command's --help and --version (was: named for --help but never ran it)
    cli = [sys.executable, "-m", "datacache.cli"]
    help_ = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and help_.stdout.startswith("usage: datacache"), help_.stderr
    for command in ("warm", "stat", "ls", "index", "write", "verify", "clear"):
        assert f"\n    {command} " in help_.stdout, f"--help does not list {command}"
    version = subprocess.run([*cli, "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and datacache.__version__ in version.stdout, version.stderr


def test_no_import_circle_and_no_module_imports_the_package_above_it() -> None:
    """datacache's modules import each other one way (no circle, TYPE_CHECKING imports included),
    and none imports the package's ``__init__`` (the top of the house)."""
    graph = import_graph(pathlib.Path(datacache.__file__).parent)
    assert not circles(graph), f"import circles through {circles(graph)}"
    assert not [m for m, deps in graph.items() if "__init__" in deps and m != "__init__"]

