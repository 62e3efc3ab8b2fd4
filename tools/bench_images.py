"""The ``images`` scenario of ``tools/bench.py`` (issue 40.5): JPEG bytes, decoded and randomly cropped in
the DataLoader workers, every system on the same files.

Data: ``--images-size`` bytes (default 200 MB) of real JPEGs made at bench time with Pillow
(``jpeg(i)``): image ``i`` is ImageNet-like in size and content, 360-680 x 270-500 pixels, a smooth
colour field with a random texture and grain, JPEG quality 88-96, about 100 KB on average (ImageNet's
training JPEGs average about 110 KB), the same bytes for every system (seeded by ``i``). Each system
writes them with its own writer as a ``bytes`` field ``jpeg`` beside ``label`` and ``id``
(``tools/bench_write.py``).

Loading: batch 64, the scenario's workers, a fill epoch then the measured epoch from the cache, no
simulated compute (the decode is the work). Each sample is decoded and cropped in the worker by
``Decode`` (the same code for every system, passed through each system's documented hook: datacache
``StreamingDataset(transform=)``, LitData ``StreamingDataset(transform=)``, Streaming a subclass's
``__getitem__``): ``torchvision.io.decode_jpeg`` where torchvision imports, else Pillow; a random
crop of 8-100 % of the area at an aspect ratio of 3/4 to 4/3, resized to 224 x 224 (torchvision's
``RandomResizedCrop``), as a uint8 HWC array.

Figures: images/s; the CPU of the whole run (``tools/bench_cpu.py``: the training process and every
worker) and, inside it, the decode's: ``Decode`` times itself with the thread's CPU clock
(``time.thread_time``) and each process publishes its running total in a small file of
``spec["decode_dir"]`` (``DecodeClock``), summed by the runner before and after each epoch. The
loader's own CPU = the run's - the decode's; its share of the run's CPU, and its CPU-seconds per GB
of JPEG bytes delivered, are compared across systems. Bound: the decode's CPU spread over the
workers (``decode_s / workers``), the epoch's wall if the workers did nothing else.

Thread-safety: ``Decode`` may be called from several threads of a process at once (datacache
collates in a thread of the worker): the process's total is kept under a lock.
"""
from __future__ import annotations

import functools
import io
import os
import threading
import time
from typing import Any

import numpy as np

CROP = 224
BATCH = 64


def jpeg(i: int) -> bytes:
    """Image ``i``'s JPEG bytes (deterministic: seeded by ``i``; the same Pillow gives the same bytes)."""
    from PIL import Image

    rng = np.random.default_rng([7, i])
    w, h = int(rng.integers(360, 680)), int(rng.integers(270, 500))
    field = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(field).resize((w, h), Image.BICUBIC), dtype=np.int16)
    grid = rng.integers(0, 256, (h // 6 + 1, w // 6 + 1), dtype=np.uint8)
    texture = np.asarray(Image.fromarray(grid).resize((w, h), Image.BILINEAR), dtype=np.int16) - 128
    grain = int(rng.integers(8, 40))
    noise = rng.integers(-grain, grain + 1, (h, w, 1), dtype=np.int16)
    img = np.clip(base + (texture[..., None] * int(rng.integers(8, 48)) >> 7) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=int(rng.integers(88, 97)))
    return buf.getvalue()


def sample(i: int, n: int) -> dict[str, Any]:
    """Sample ``i`` of ``n``: the JPEG, a label (the class of ``tools/bench_quality.py``) and the id."""
    return {"jpeg": jpeg(i), "label": i * 100 // max(n, 1), "id": i}


class DecodeClock:
    """The decode CPU-seconds of this process, published in ``DIR/<pid>`` (one float64, mapped), so
    the runner can sum every worker's (``total``). Thread-safe; fork-safe (a child opens its own)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._pid = -1
        self._cell: np.ndarray | None = None
        self._sum = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first use in this process (a forked worker's copy)
                path = os.path.join(self.directory, str(os.getpid()))
                self._cell = np.memmap(path, dtype=np.float64, mode="w+", shape=(1,))
                self._pid, self._sum = os.getpid(), 0.0
            self._sum += seconds
            self._cell[0] = self._sum  # type: ignore[index]

    @staticmethod
    def total(directory: str) -> float:
        """Every process's decode CPU-seconds so far (those that exited included: their files stay)."""
        out = 0.0
        for name in os.listdir(directory):
            out += float(np.fromfile(os.path.join(directory, name), dtype=np.float64, count=1)[0])
        return out

    def __getstate__(self) -> dict[str, Any]:  # a spawned worker starts its own count
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"])  # type: ignore[misc]


@functools.lru_cache(maxsize=1)
def _decoder() -> Any:
    """torchvision's ``decode_jpeg`` where torchvision imports (a real one, not the stubs that
    ``tools/bench_systems.py`` injects for Streaming), else None (Pillow)."""
    try:
        import torchvision  # noqa: F401
        from torchvision.io import decode_jpeg
    except Exception:  # noqa: BLE001 - not installed, or a build that does not import beside this torch
        return None
    import sys

    return None if getattr(sys.modules.get("torchvision"), "__bench_stub__", False) else decode_jpeg


class Decode:
    """The per-sample transform: ``{"jpeg": bytes, ...}`` -> ``{"image": uint8 (224, 224, 3), ...}``,
    a RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) of the decoded image, timed on the thread's CPU
    clock into a ``DecodeClock``. The crop is drawn from a generator seeded by the sample id."""

    def __init__(self, decode_dir: str) -> None:
        self.clock = DecodeClock(decode_dir)
        self.with_torchvision: bool | None = None

    def __call__(self, s: dict[str, Any]) -> dict[str, Any]:
        t = time.thread_time()
        image = self.crop(bytes(s["jpeg"]), int(s["id"]))
        self.clock.add(time.thread_time() - t)
        return {"image": image, "label": s["label"], "id": s["id"]}

    def crop(self, data: bytes, seed: int) -> np.ndarray:
        decode = _decoder()
        self.with_torchvision = decode is not None
        if decode is not None:
            import torch
            from torchvision.transforms.v2 import functional as F  # noqa: N812

            img = decode(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            h, w = img.shape[-2:]
            top, left, ch, cw = _box(w, h, seed)
            return F.resized_crop(img, top, left, ch, cw, [CROP, CROP], antialias=True).permute(1, 2, 0).numpy()
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            top, left, ch, cw = _box(im.width, im.height, seed)
            out = im.convert("RGB").resize((CROP, CROP), Image.BILINEAR, box=(left, top, left + cw, top + ch))
        return np.asarray(out)


def _box(w: int, h: int, seed: int) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a RandomResizedCrop box (torchvision's rule, 10 tries then the
    centre crop at the nearest allowed ratio)."""
    rng = np.random.default_rng(seed)
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw, ch = int(round((target * ratio) ** 0.5)), int(round((target / ratio) ** 0.5))
        if 0 < cw <= w and 0 < ch <= h:
            return int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw
    side = min(w, h)
    return (h - side) // 2, (w - side) // 2, side, side


def streaming_dataset(base: type, transform: Decode) -> type:
    """A subclass of Streaming's ``StreamingDataset`` whose samples pass through ``transform``
    (Streaming's documented way: override ``__getitem__``)."""
    class Decoded(base):  # type: ignore[misc, valid-type]
        def __getitem__(self, at: Any) -> Any:
            item = super().__getitem__(at)
            return transform(item) if isinstance(at, (int, np.integer)) else item

    return Decoded


def figures(rec: dict[str, Any], workers: int) -> dict[str, Any]:
    """One images epoch's figures from its record: images/s, decode and loader CPU, the bound."""
    decode, cpu = rec.get("decode_cpu_s", 0.0), rec.get("cpu_s")
    out = {"images_s": rec["samples"] / rec["wall"], "decode_s": decode, "bound": decode / max(workers, 1)}
    if cpu is not None:
        out.update(loader_cpu_s=cpu - decode, loader_share=(cpu - decode) / cpu if cpu > 0 else 0.0)
    return out


__all__ = ["BATCH", "CROP", "Decode", "DecodeClock", "figures", "jpeg", "sample", "streaming_dataset"]
