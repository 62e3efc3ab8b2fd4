"""The public API is exactly what __all__ says, and every name in it exists; the layering holds."""
import importlib
import pathlib
import subprocess
import sys

import pytest

import datacache
from datacache import readers
from tests.helpers.layers import absolute_imports, circles, depth, import_graph, modules

EXPECTED = {
    "__version__", "write_dataset", "DatasetWriter", "Manifest", "ShardInfo", "load_manifest", "open_store", "Store",
    "NodeCache", "CacheHandle", "LRUPolicy", "ClairvoyantPolicy", "Schedule", "StreamingDataset", "DataLoader",
    "CachedDataset", "Stream", "CacheConfig", "PrefetchConfig", "TransferConfig", "RetryConfig", "PeerConfig",
    "parse_size",
    "DatacacheError", "StorageError", "TransientStorageError", "ThrottledError", "UnreachableError", "NotFoundError",
    "PermissionDeniedError", "ManifestError", "IntegrityError", "ReaderError", "CacheError", "DatasetExistsError",
}
ROOT = pathlib.Path(datacache.__file__).parent
LAYERS = ("store", "cache", "plan", "peer", "mixing", "read", "pytorch", "cli")
# which layer may import which (a layer may always import itself). "base" is datacache's top-level modules
# (config, errors, manifest, hashing, progress, dist, _localfs, _version, _torchcompat); "writer" writes datasets.
MAY_IMPORT = {
    "base": {"readers"},
    "store": {"base"},
    "cache": {"base", "readers"},
    "plan": {"base"},
    "peer": {"base", "cache"},
    "writer": {"base", "store", "readers"},
    "read": {"base", "store", "cache", "plan", "peer", "readers"},
    "mixing": {"base", "store", "cache", "plan", "peer", "read"},
    "pytorch": {"base", "store", "cache", "plan", "peer", "read", "mixing", "readers"},
    "cli": {"base", "store", "cache", "plan", "peer", "read", "mixing", "writer", "readers"},
}


def layer(module: str) -> str:
    head = module.split(".")[0]
    if head in LAYERS or head in ("readers", "__init__", "writer"):
        return {"__init__": "api"}.get(head, head)
    return "base"


def test_all_is_guarded() -> None:
    assert set(datacache.__all__) == EXPECTED
    for name in datacache.__all__:
        assert hasattr(datacache, name), name


def test_every_module_declares_all() -> None:
    for mod in sorted(modules(ROOT)):
        name = "datacache" if mod == "__init__" else f"datacache.{mod}"
        if name.endswith("__main__"):
            continue
        m = importlib.import_module(name)
        assert hasattr(m, "__all__"), f"{name} declares no __all__"
        for attr in m.__all__:
            assert hasattr(m, attr), f"{name}.{attr}"
    for name in ("datacache.readers", "datacache.readers.codec"):
        m = importlib.import_module(name)
        for attr in m.__all__:
            assert hasattr(m, attr), f"{name}.{attr}"


def test_only_the_store_imports_fsspec() -> None:
    users = sorted(m for m, p in modules(ROOT).items() if {"fsspec", "s3fs"} & absolute_imports(p))
    assert users and all(m.startswith("store.") for m in users), users


def test_only_the_peer_tier_imports_aiohttp() -> None:
    """The peer tier's HTTP server and client are the only network code outside the store layer."""
    users = sorted(m for m, p in modules(ROOT).items() if {"aiohttp", "yarl"} & absolute_imports(p))
    assert users and all(m.startswith("peer.") for m in users), users


def test_readers_import_nothing_of_datacache() -> None:
    """readers/ turns a local shard into samples: no cache, no network, no import of the rest of datacache."""
    for p in pathlib.Path(readers.__file__).parent.glob("*.py"):
        assert not {"datacache", "fsspec", "s3fs"} & absolute_imports(p), p.name
    graph = import_graph(pathlib.Path(readers.__file__).parent)
    assert all(dep in graph or dep == "__init__" for deps in graph.values() for dep in deps)


def test_the_wheel_installs_no_generic_top_level_name(tmp_path: pathlib.Path) -> None:
    """readers/ is installed as datacache.readers: the distribution claims the name datacache alone."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    conf = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "datacache" or p.startswith("datacache.") for p in conf["packages"]), conf["packages"]
    assert conf["package-dir"]["datacache.readers"] == "readers"
    assert readers.__name__ == "datacache.readers"
    code = ("import sys, datacache, datacache.cli.commands, datacache.pytorch.dataset, datacache.readers; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'readers'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_version_and_cli_help() -> None:
    out = subprocess.run([sys.executable, "-c", "import datacache, datacache.readers; print(datacache.__version__)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == datacache.__version__
    cli = [sys.executable, "-m", "datacache.cli"]
    help_ = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and help_.stdout.startswith("usage: datacache"), help_.stderr
    for command in ("warm", "stat", "ls", "index", "write", "verify", "clear"):
        assert f"\n    {command} " in help_.stdout, f"--help does not list {command}"
    version = subprocess.run([*cli, "--version"], capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and datacache.__version__ in version.stdout, version.stderr


def test_no_import_circle_even_through_package_inits() -> None:
    """Modules import each other one way, also counting the ``__init__`` Python runs before a
    subpackage's module (TYPE_CHECKING and function-local imports included)."""
    graph = import_graph(ROOT, with_inits=True)
    assert not circles(graph), f"import circles through {circles(graph)}"


def test_no_module_imports_a_package_above_it() -> None:
    """No module imports the ``__init__`` of datacache or of its own subpackage (the top of its house)."""
    graph = import_graph(ROOT)
    for m, deps in graph.items():
        own = m.split(".")[0] if "." in m else None
        assert "__init__" not in deps or m == "__init__", f"{m} imports datacache's __init__"
        assert own is None or own not in deps, f"{m} imports its own package's __init__"


@pytest.mark.parametrize("importer", sorted(MAY_IMPORT))
def test_each_layer_imports_only_the_layers_below_it(importer: str) -> None:
    graph = import_graph(ROOT)
    bad = {f"{m} -> {d}" for m, deps in graph.items() if layer(m) == importer
           for d in deps if layer(d) != importer and layer(d) not in MAY_IMPORT[importer]}
    assert not bad, f"{importer} may import only {sorted(MAY_IMPORT[importer])}: {sorted(bad)}"


def test_the_import_graph_is_at_most_ten_levels_deep() -> None:
    """The longest chain of imports that run (type checkers' imports aside) from the CLI down."""
    inner = set(modules(ROOT)) - set(LAYERS) - {"__init__"}
    graph = {m: deps & inner for m, deps in import_graph(ROOT, runtime_only=True).items()}
    chain = depth(graph, "cli.main")
    assert len(chain) <= 10, " -> ".join(chain)
    assert max(len(depth(graph, m)) for m in graph) <= 11  # the package __init__ sits one above the CLI
