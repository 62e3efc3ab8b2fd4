"""A new user's first contact with a store (issue 37, points 3 and 16): a typo in the endpoint, a URL
with one slash or naming manifest.json, a bucket that does not exist, no credentials, a manifest
hashed with another algorithm. Each answer is one line naming the URL or endpoint, the cause and
what to do. The command line runs as real subprocesses; the S3 cases use the SeaweedFS server.
"""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from datacache import (
    CacheConfig,
    ManifestError,
    NotFoundError,
    RetryConfig,
    StreamingDataset,
    UnreachableError,
    load_manifest,
    open_store,
    write_dataset,
)
from datacache.manifest import ShardInfo, compute_dataset_id
from tests.test_cli_messages import ROOT, _env, _run
from tools.s3server import free_ports

TYPOS = [(f"http://127.0.0.1:{free_ports(1)[0]}", "connection refused"),  # nothing listens there
         ("http://no-such-host.invalid:9000", "name not resolved")]  # .invalid never resolves (RFC 2606)


def _typo_env(base: Path, endpoint: str) -> dict[str, str]:
    env = _env(base)
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="typo-test-key", AWS_SECRET_ACCESS_KEY="typo-secret",
               AWS_DEFAULT_REGION="us-east-1")
    return env


@pytest.mark.timeout(120)
def test_ls_with_a_typo_in_the_endpoint_fails_in_one_line_naming_endpoint_and_cause(tmp_path: Path) -> None:
    """`datacache ls` with the default RetryConfig against a closed port and an unresolvable name
    (both at once): one line from the open-time path (the store never answered), exit code 3; it
    retried for 10 minutes before. The timeout guards that; no assertion on seconds."""
    procs = [(endpoint, cause, subprocess.Popen([sys.executable, "-m", "datacache.cli", "ls", "s3://bucket/ds/"],
                                                env=_typo_env(tmp_path, endpoint), cwd=ROOT, text=True,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
             for endpoint, cause in TYPOS]
    for endpoint, cause, proc in procs:
        out, err = proc.communicate(timeout=90)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert proc.returncode == 3 and out == "" and len(lines) == 1, (proc.returncode, out, err)
        assert lines[0].startswith("datacache: error: s3://bucket/ds/manifest.json: size: cannot reach the store at "
                                   f"{endpoint} (from AWS_ENDPOINT_URL): {cause}"), lines[0]
        assert "never answered" in lines[0] and "AWS_ENDPOINT_URL" in lines[0] and "typo-secret" not in lines[0]


@pytest.mark.parametrize("endpoint, cause", TYPOS, ids=["closed-port", "unresolvable-host"])  # ids: the port is random
def test_streaming_dataset_with_a_typo_in_the_endpoint_raises_unreachable(endpoint: str, cause: str,
                                                                         tmp_path: Path) -> None:
    opts = {"key": "typo-test-key", "secret": "typo-secret", "client_kwargs": {"endpoint_url": endpoint}}
    with pytest.raises(UnreachableError) as info:
        StreamingDataset("s3://bucket/ds/", storage_options=opts, retry=RetryConfig(connect_deadline=0),
                         cache=CacheConfig(ram_bytes="1MB", ssd_bytes=0, ram_dir=str(tmp_path / "ram"),
                                           ssd_dir=str(tmp_path / "ssd")))
    assert f"cannot reach the store at {endpoint} (from storage_options): {cause}" in str(info.value)


def test_a_url_with_one_slash_is_refused_not_read_as_a_local_folder(tmp_path: Path) -> None:
    """``s3:/bucket/x/`` was the local folder ``./s3:/bucket/x/`` ("no manifest.json at this prefix")."""
    for bad, meant in (("s3:/bucket/x/", "s3://bucket/x/"), ("gs:bucket/x", "gs://bucket/x"),
                       ("file:/data/x", "file:///data/x")):
        with pytest.raises(ValueError, match=f"not a valid URL.*did you mean '{meant}'"):
            open_store(bad)
    p = _run(["-m", "datacache.cli", "ls", "s3:/bucket/x/"], _env(tmp_path))
    assert p.returncode == 2 and "did you mean 's3://bucket/x/'" in p.stderr, (p.returncode, p.stderr)
    assert not (ROOT / "s3:").exists()


def test_a_url_naming_manifest_json_opens_its_dataset(s3_server: Any, tmp_path: Path) -> None:
    """``.../manifest.json`` names the dataset, on S3 and as a local path (it was looked up as
    ``.../manifest.json/manifest.json``); `datacache write` reads a local one as a dataset, not JSONL."""
    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex}/"
    local = tmp_path / "local"
    for where, opts in ((url, s3_server.storage_options()), (str(local), None)):
        m = write_dataset([{"x": i} for i in range(10)], where, shard_bytes=64, storage_options=opts, progress=False)
        named = f"{where.rstrip('/')}/manifest.json"
        assert load_manifest(open_store(named, opts)).dataset_id == m.dataset_id
        env = _env(tmp_path, s3_server)
        p = _run(["-m", "datacache.cli", "ls", named, "--json"], env)
        assert p.returncode == 0 and json.loads(p.stdout)["dataset_id"] == m.dataset_id, p.stderr
    p = _run(["-m", "datacache.cli", "write", str(local / "manifest.json"), str(tmp_path / "copy"), "-q"], env)
    assert p.returncode == 0, p.stderr
    assert load_manifest(open_store(str(tmp_path / "copy"))).num_samples == 10


def test_a_missing_bucket_says_the_bucket_does_not_exist(s3_server: Any, tmp_path: Path) -> None:
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:12]}"
    with pytest.raises(NotFoundError) as info:
        load_manifest(open_store(f"s3://{bucket}/ds/", s3_server.storage_options()))
    assert f"the bucket '{bucket}' does not exist" in str(info.value) and "no manifest.json" not in str(info.value)
    p = _run(["-m", "datacache.cli", "ls", f"s3://{bucket}/ds/"], _env(tmp_path, s3_server))
    assert p.returncode == 3 and f"the bucket '{bucket}' does not exist" in p.stderr, p.stderr


def test_missing_credentials_name_the_variables_and_storage_options(s3_server: Any, tmp_path: Path) -> None:
    """No AWS_ACCESS_KEY_ID, no credentials file, no instance metadata: botocore sends nothing; the
    error said "not retried; check the URL, the object name and storage_options"."""
    env = _env(tmp_path)
    env.update(AWS_ENDPOINT_URL=s3_server.endpoint_url, AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true")
    p = _run(["-m", "datacache.cli", "ls", f"s3://{s3_server.bucket}/ds/"], env)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert "no credentials found" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0] and "storage_options" in lines[0]


@pytest.mark.parametrize("edit", ["manifest", "shard"])
def test_an_unknown_hash_algorithm_is_refused(tmp_path: Path, edit: str) -> None:
    """A manifest (or a consistent one whose shard hash) declaring an algorithm datacache does not
    verify with was accepted; every such shard then failed its check later."""
    write_dataset([{"x": i} for i in range(10)], str(tmp_path / "ds"), shard_bytes=64, progress=False)
    path = tmp_path / "ds" / "manifest.json"
    doc = json.loads(path.read_text())
    if edit == "manifest":
        doc["hash_algorithm"] = "sha256"
    else:
        doc["shards"][0]["hash"] = "sha256:" + doc["shards"][0]["hash"].split(":", 1)[1]
        doc["dataset_id"] = compute_dataset_id(doc["format"], doc["schema"],
                                               tuple(ShardInfo(**s) for s in doc["shards"]))  # consistent
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="is 'sha256', but this datacache verifies shards only with 'xxh3_128'"):
        load_manifest(open_store(str(tmp_path / "ds")))
