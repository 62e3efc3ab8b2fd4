"""The ``datacache`` command line: warm, stat, ls, index, write, verify, clear.

The argument parser, the settings (flags > environment variables > ``CacheConfig`` defaults), error
reporting and exit codes live here; the subcommands themselves are in :mod:`datacache.cli.commands`.

Exit codes: 0 ok, 1 verification mismatch, 2 usage error, 3 data or storage error, 130 interrupted.
Errors are reported as one line, ``datacache: error: <message>``, without a traceback unless
``--debug`` is given. Run ``python -m datacache.cli.main`` or the ``datacache`` console script.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from .._version import __version__
from ..config import ENV_VARS, POLICIES, CacheConfig, cache_settings
from ..errors import DatacacheError
from ..plan.epoch import DEFAULT_WINDOW
from .commands import COMMANDS, Ctx, UsageError
from .common import fraction as _fraction
from .common import nonneg_int as _nonneg_int
from .common import pos_int as _pos_int
from .common import size as _size
from .common import url as _url

__all__ = ["main", "build_parser", "config_from_env", "cache_config_from", "storage_options_from", "ENV_VARS",
           "EXIT_OK", "EXIT_MISMATCH", "EXIT_USAGE", "EXIT_DATA", "EXIT_INTERRUPTED"]

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_DATA, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

def config_from_env(overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> CacheConfig:
    """A ``CacheConfig`` from ``overrides`` (non-None values, e.g. command-line flags), then the
    ``DATACACHE_*`` variables of ``env`` (default ``os.environ``), then the defaults: the resolution
    of :func:`datacache.config.cache_settings`, which a default ``CacheConfig()`` uses too.

    Raises ``UsageError`` (a ``ValueError``) naming the flag or variable that is invalid.
    """
    try:
        return CacheConfig(**cache_settings(overrides, env, label=lambda name: f"--{name.replace('_', '-')}"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cache_config_from(args: argparse.Namespace) -> CacheConfig:
    """The cache settings of a parsed command line: flags > environment variables > defaults."""
    return config_from_env({name: getattr(args, name, None) for name in ENV_VARS})


def storage_options_from(args: argparse.Namespace) -> dict[str, Any]:
    """``--storage-options`` (JSON, or ``@file.json``) plus ``--endpoint-url``. Credentials and the
    endpoint otherwise come from the usual AWS environment variables (``AWS_ENDPOINT_URL``...)."""
    opts: dict[str, Any] = {}
    text = getattr(args, "storage_options", None)
    if text:
        if text.startswith("@"):
            try:
                with open(text[1:], encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise UsageError(f"--storage-options: cannot read {text[1:]}: {exc.strerror}") from None
        try:
            opts = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"--storage-options is not valid JSON ({exc})") from None
        if not isinstance(opts, dict):
            raise UsageError("--storage-options must be a JSON object, e.g. '{\"anon\": true}'")
    endpoint = getattr(args, "endpoint_url", None)
    if endpoint:
        client_kwargs = dict(opts.get("client_kwargs") or {})
        client_kwargs["endpoint_url"] = endpoint
        opts["client_kwargs"] = client_kwargs
    return opts


# --------------------------------------------------------------------------------------- parser
_TOP_EPILOG = """\
examples:
  datacache ls s3://bucket/imagenet/
  datacache warm s3://bucket/imagenet/ --world-size 16 --nproc-per-node 8 --node-rank 1 --workers 4
  datacache stat --json
  datacache index s3://bucket/hf-dataset/ --format parquet --pattern 'data/train-*.parquet'
  datacache write ./images/ s3://bucket/images/ --format tar --group
  datacache verify s3://bucket/imagenet/ --cached-only
  datacache clear --ram

settings (flag > environment variable > default):
  --ram-bytes  DATACACHE_RAM_BYTES   RAM tier budget              (4GB)
  --ssd-bytes  DATACACHE_SSD_BYTES   SSD tier budget              (64GB)
  --ram-dir    DATACACHE_RAM_DIR     RAM tier directory           (/dev/shm/datacache-$USER)
  --ssd-dir    DATACACHE_SSD_DIR     SSD tier directory           (~/.cache/datacache)
  --policy     DATACACHE_POLICY      auto | lru | clairvoyant     (auto)
  --endpoint-url  AWS_ENDPOINT_URL   S3-compatible endpoint; credentials from the usual AWS_* variables

exit codes:
  0    success
  1    verification found a mismatch (datacache verify)
  2    usage error (bad flag, bad value)
  3    data or storage error (object missing, no permission, corrupt or invalid data)
  130  interrupted (Ctrl-C); the cache stays consistent
"""

_EPILOGS = {
    "warm": """\
Fills this node's cache with the shards this node's ranks read first in the given epoch, in the
order they need them (the same plan StreamingDataset computes), up to the tier budgets or
--bytes/--fraction. The RAM tier gets the first shards, the SSD tier the next ones. Running it
again fetches nothing; Ctrl-C stops promptly and leaves a consistent cache.

examples:
  # one process, no DataLoader workers, seed 0, epoch 0
  datacache warm s3://bucket/ds/
  # node 1 of a 2-node job with 8 ranks per node and 4 DataLoader workers per rank
  datacache warm s3://bucket/ds/ --world-size 16 --node-rank 1 --nproc-per-node 8 --workers 4
  # the same, naming the ranks; only the first 10% of what the node reads
  datacache warm s3://bucket/ds/ --world-size 16 --ranks 8-15 --workers 4 --fraction 0.1
  # what would be warmed, without fetching
  datacache warm s3://bucket/ds/ --dry-run --json
  # a mixed dataset: the StreamingDataset(streams=...) arguments in a file
  datacache warm --streams mix.yaml --world-size 8 --nproc-per-node 8 --workers 4 --batch-size 256
""",
    "stat": """\
Per tier: budget, bytes used, entries, hits and misses (a RAM miss is an SSD hit or a fetch);
bytes fetched from remote storage; and, per cached dataset (id = key prefix), entries and bytes.
With a dataset URL and --nodes N --node-rank K: node K's share of a job on N nodes (the shards it
keeps for the run, as `ls --nodes` shows them) and how much of it is cached on this node now.

examples:
  datacache stat
  datacache stat --json | jq .datasets
  # how much of node 3's share of a 64-node job (seed 5) this node's cache holds
  datacache stat s3://bucket/ds/ --nodes 64 --node-rank 3 --seed 5
  DATACACHE_SSD_DIR=/nvme/cache datacache stat
""",
    "ls": """\
Summary of a dataset's manifest: dataset id, format, schema, shards, samples and bytes.

examples:
  datacache ls s3://bucket/ds/
  # each node's share (shards and bytes) in a 64-node job with seed 5
  datacache ls s3://bucket/ds/ --nodes 64 --seed 5
  datacache ls s3://bucket/ds/ --shards
  datacache ls /data/ds --json
""",
    "index": """\
Builds manifest.json for objects already at a prefix (e.g. a Hugging Face Parquet dataset, or
WebDataset tars) without rewriting them. Without --format, URL must hold a dataset another
library wrote: MosaicML Streaming (MDS), LitData (optimize) or Hugging Face save_to_disk; its own
index names the shards, and any hashes it lists are checked. Sample counts come from the Parquet footers (two small
range reads per file, checked before anything else is read) or, for tar and lmdb, from the local
copy that hashing makes. Hashing needs every object to be read once (a progress bar shows it):
the manifest records a content hash per shard so the cache can verify what it serves.

examples:
  datacache index s3://bucket/mds-dataset/
  datacache index s3://bucket/hf/ --format parquet --split train
  datacache index s3://bucket/wds/ --format tar
  datacache index /data/lmdb-shards --format lmdb --threads 4
""",
    "write": """\
Converts SRC into a datacache dataset at DEST. SRC may be:
  a folder     one sample per file: {"__key__": relative path, "data": bytes}; with --group, files
               sharing a basename up to the first '.' form one sample, one field per extension
               (WebDataset-style: a/0001.jpg + a/0001.cls -> {"__key__": "a/0001", "jpg", "cls"}); in
               class folders (SRC/<class>/...) also "label" (index of the sorted classes) and "class"
  a .parquet   one sample per row (local or a URL); Hugging Face images become their bytes
  a .jsonl     one sample per line (a JSON object); lists and objects become JSON strings
  a dataset    a URL or folder with a manifest.json (samples are copied in shard order)
Tar shards cannot hold a "__key__" field: it is written as "key" instead.

examples:
  datacache write ./images/ s3://bucket/images/ --format tar --group --shuffle
  datacache write rows.jsonl s3://bucket/rows/ --shard-bytes 128MB
  datacache write s3://bucket/parquet-ds/ s3://bucket/zstd-ds/ --format zstd
""",
    "verify": """\
Checks shards against the content hashes in the manifest: the files of this dataset in the node
cache (re-hashed in place) and the remote objects (streamed and hashed). Exit code 1 and a list
of the mismatches if any differ.

examples:
  datacache verify s3://bucket/ds/
  datacache verify s3://bucket/ds/ --cached-only --json
""",
    "clear": """\
Removes cache entries (files in use by a reader are skipped). Neither --ram nor --ssd: both tiers.

examples:
  datacache clear
  datacache clear --ram
  datacache clear --dataset ds-0123456789abcdef01234567
""",
}


def _add_global_options(p: argparse.ArgumentParser, top: bool) -> None:
    """Options accepted before and after the subcommand (in subparsers they default to SUPPRESS so
    a value given before the subcommand is not overwritten)."""
    def d(value: Any) -> Any:
        return value if top else argparse.SUPPRESS
    g = p.add_argument_group("global options")
    g.add_argument("--ram-bytes", metavar="SIZE", default=d(None),
                   help="RAM tier budget, e.g. 8GB or 512MiB; 0 disables it (env DATACACHE_RAM_BYTES, default 4GB)")
    g.add_argument("--ssd-bytes", metavar="SIZE", default=d(None),
                   help="SSD tier budget; 0 disables it (env DATACACHE_SSD_BYTES, default 64GB)")
    g.add_argument("--ram-dir", metavar="DIR", default=d(None),
                   help="RAM tier directory (env DATACACHE_RAM_DIR, default /dev/shm/datacache-$USER)")
    g.add_argument("--ssd-dir", metavar="DIR", default=d(None),
                   help="SSD tier directory (env DATACACHE_SSD_DIR, default ~/.cache/datacache)")
    g.add_argument("--policy", choices=POLICIES, default=d(None),
                   help="eviction policy (env DATACACHE_POLICY, default auto)")
    g.add_argument("--storage-options", metavar="JSON", default=d(None),
                   help="fsspec storage options as a JSON object, or @file.json")
    g.add_argument("--endpoint-url", metavar="URL", default=d(None),
                   help="S3-compatible endpoint (else AWS_ENDPOINT_URL)")
    g.add_argument("--json", action="store_true", default=d(False), help="machine-readable output on stdout")
    g.add_argument("--quiet", "-q", action="store_true", default=d(False), help="no progress bars")
    g.add_argument("--debug", action="store_true", default=d(False), help="debug logging and full tracebacks")


def _sub(subs: Any, name: str, help: str) -> argparse.ArgumentParser:
    p = subs.add_parser(name, help=help, description=help, epilog=_EPILOGS[name], allow_abbrev=False,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_global_options(p, top=False)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="datacache", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_TOP_EPILOG, allow_abbrev=False,
        description="Node-local RAM+SSD cache and clairvoyant prefetcher for training data on object storage.")
    parser.add_argument("--version", action="version", version=f"datacache {__version__}")
    _add_global_options(parser, top=True)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _sub(subs, "warm", "fill this node's cache with what its ranks read first")
    p.add_argument("url", metavar="URL", type=_url, nargs="?", default=None,
                   help="dataset prefix (holding manifest.json)")
    p.add_argument("--streams", metavar="FILE", default=None,
                   help="instead of URL: a mixed dataset's streams, a JSON or YAML file of streams (url, proportion/"
                        "repeat/choose, storage_options, reader_options), epoch_size, batching, sampling")
    g = p.add_argument_group("plan (must match the training job's StreamingDataset)")
    g.add_argument("--epoch", type=_nonneg_int, default=0, help="epoch to warm for (default 0)")
    g.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    g.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True, help="shuffle (default on)")
    g.add_argument("--window", type=_pos_int, default=DEFAULT_WINDOW,
                   help=f"shuffle window in shards (default {DEFAULT_WINDOW})")
    g.add_argument("--drop-last", action="store_true", help="drop_last=True in the dataset")
    g.add_argument("--world-size", type=_pos_int, default=1, help="number of ranks in the job (default 1)")
    g.add_argument("--replication", type=_pos_int, default=1,
                   help="ranks per data-parallel group reading identical samples (default 1)")
    g.add_argument("--ranks", metavar="LIST", default=None, help="global ranks on this node, e.g. 0-7 or 0,2,4-6")
    g.add_argument("--node-rank", type=_nonneg_int, default=None, help="this node's index (with --nproc-per-node)")
    g.add_argument("--nproc-per-node", type=_pos_int, default=None, help="ranks per node")
    g.add_argument("--nodes", type=_pos_int, default=None,
                   help="nodes in the job (with --node-rank, instead of --nproc-per-node)")
    g.add_argument("--placement", choices=("node", "global"), default="node",
                   help="the dataset's placement (default node: each node keeps its shards for the run)")
    g.add_argument("--workers", type=_nonneg_int, default=0,
                   help="DataLoader num_workers per rank (default 0: the main process reads)")
    g.add_argument("--batch-size", type=_pos_int, default=1,
                   help="the dataset's batch_size in batched mode (default 1: samples mode)")
    g = p.add_argument_group("how much and how")
    g.add_argument("--bytes", type=_size, default=None, metavar="SIZE", help="warm at most this many bytes")
    g.add_argument("--fraction", type=_fraction, default=None,
                   help="warm at most this fraction of the bytes this node reads in the epoch")
    g.add_argument("--threads", type=_pos_int, default=8, help="shards fetched at once (default 8)")
    g.add_argument("--dry-run", action="store_true", help="show what would be warmed; fetch nothing")

    p = _sub(subs, "stat", "cache usage, hit rates and cached datasets")
    p.add_argument("url", metavar="URL", type=_url, nargs="?", default=None,
                   help="a dataset prefix: with --nodes, show how much of a node's share is cached")
    p.add_argument("--nodes", type=_pos_int, default=None, help="nodes in the job (with URL and --node-rank)")
    p.add_argument("--node-rank", type=_nonneg_int, default=None, help="the node whose share to show (default 0)")
    p.add_argument("--seed", type=int, default=0, help="the dataset seed, with --nodes (default 0)")

    p = _sub(subs, "ls", "summary of a dataset's manifest")
    p.add_argument("url", metavar="URL", type=_url, help="dataset prefix (holding manifest.json)")
    p.add_argument("--shards", "-l", action="store_true", help="also list every shard")
    p.add_argument("--nodes", type=_pos_int, default=None,
                   help="show each node's share of a job on this many nodes (node placement)")
    p.add_argument("--seed", type=int, default=0, help="the dataset seed, with --nodes (default 0)")

    p = _sub(subs, "index", "build manifest.json for an MDS/LitData/HF dataset or parquet/tar/lmdb files")
    p.add_argument("url", metavar="URL", type=_url, help="prefix holding the files")
    p.add_argument("--format", default=None, choices=("parquet", "tar", "lmdb"),
                   help="format of the files; without it, the MosaicML Streaming (MDS), LitData or Hugging Face "
                        "save_to_disk dataset at URL (found by its index.json / state.json)")
    p.add_argument("--pattern", metavar="GLOB", default=None,
                   help="which objects (relative names; '*' crosses '/'); default '*.parquet' / '*.tar' / '*.lmdb'")
    p.add_argument("--split", metavar="NAME", help="only this split's files (Hugging Face: NAME-*.parquet, NAME/)")
    p.add_argument("--threads", type=_pos_int, default=8, help="objects read at once (default 8)")
    p.add_argument("--force", action="store_true", help="replace an existing manifest.json")

    p = _sub(subs, "write", "convert a folder, Parquet, JSONL or dataset into a dataset")
    p.add_argument("src", metavar="SRC", type=_url, help="folder, .parquet file, .jsonl file, or dataset URL")
    p.add_argument("dest", metavar="DEST", type=_url, help="URL of the new dataset")
    p.add_argument("--format", default="zstd", choices=("zstd", "parquet", "lmdb", "tar"),
                   help="shard format (default zstd)")
    p.add_argument("--shard-bytes", type=_size, default=64_000_000, metavar="SIZE",
                   help="roll shards at this many payload bytes (default 64MB)")
    p.add_argument("--group", action="store_true", help="folder: group files by basename (WebDataset-style)")
    p.add_argument("--shuffle", action="store_true", help="folder: write the samples in a random order (seeded)")
    p.add_argument("--seed", type=int, default=0, help="seed of --shuffle (default 0)")
    p.add_argument("--src-type", choices=("auto", "folder", "parquet", "jsonl", "dataset"), default="auto",
                   help="what SRC is (default: guessed from it)")
    p.add_argument("--force", action="store_true", help="replace DEST's dataset (old shards go once the new is live)")

    p = _sub(subs, "verify", "check cached and/or remote shards against the manifest hashes")
    p.add_argument("url", metavar="URL", type=_url, help="dataset prefix (holding manifest.json)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--cached-only", action="store_true", help="only the files in the node cache")
    only.add_argument("--remote-only", action="store_true", help="only the remote objects")
    p.add_argument("--threads", type=_pos_int, default=8, help="objects read at once (default 8)")

    p = _sub(subs, "clear", "remove cache entries")
    p.add_argument("--ram", action="store_true", help="clear the RAM tier")
    p.add_argument("--ssd", action="store_true", help="clear the SSD tier")
    p.add_argument("--dataset", metavar="ID", default=None, help="only this dataset's entries (see `datacache stat`)")
    return parser


# ----------------------------------------------------------------------------------------- main
def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def _setup_logging(debug: bool) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if debug else logging.WARNING,
                        format="%(name)s: %(levelname)s: %(message)s" if debug else "%(message)s")
    if not debug:  # third-party chatter (botocore, s3fs) only in --debug
        for name in ("botocore", "s3fs", "fsspec", "aiobotocore", "urllib3"):
            logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    from ..readers import ReaderError as ShardReaderError

    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.debug)

    def fail(code: int, message: str) -> int:
        print(f"datacache: error: {message}", file=sys.stderr)
        return code

    try:
        ctx = Ctx(args=args, json=args.json, quiet=args.quiet, debug=args.debug,
                  cache_config=lambda: cache_config_from(args), storage_options=storage_options_from(args))
        return int(COMMANDS[args.command](ctx) or 0)
    except KeyboardInterrupt as exc:  # one line; a subcommand may say where it stopped
        _traceback(args.debug)
        detail = _one_line(exc) if str(exc) else ""
        print(f"datacache: interrupted{' ' + detail if detail else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as exc:
        _traceback(args.debug)
        return fail(EXIT_USAGE, _one_line(exc))
    except (DatacacheError, ShardReaderError, OSError) as exc:
        _traceback(args.debug)
        return fail(EXIT_DATA, _one_line(exc))
    except Exception as exc:  # unexpected: still one line unless --debug
        _traceback(args.debug)
        hint = "" if args.debug else " (run with --debug for the traceback)"
        return fail(EXIT_DATA, f"{type(exc).__name__}: {_one_line(exc)}{hint}")


def _traceback(debug: bool) -> None:
    if debug:
        traceback.print_exc(file=sys.stderr)

if __name__ == "__main__":
    sys.exit(main())
