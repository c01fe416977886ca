"""Feeding a GPU: loader throughput and training steps fed by wds_cloud and webdataset 1.0.2, in one run.

Data: 32,000 256x256 JPEGs in 64 local shards (generated once under bench/_data/), and 200,000 tiny
samples.  For each worker count (default 2, 8, 15):

- loader samples/s: tiny samples; raw JPEG bytes (wds_cloud as it comes, packed with ``pack_bytes=True``, and
  pickled with ``pack_bytes=False``);
  CPU decoding (``decode("rgb8")``, resized to 224 in the worker); GPU decoding (wds_cloud only:
  ``pack_bytes=True`` + ``gpu_decode``; needs CUDA and torchvision);
- training (CUDA only): ResNet-18 and ResNet-50 steps (bf16 autocast, channels_last, batch 256,
  SGD) fed by each loader, as a % of the same steps on synthetic input (4 loader workers by default).

Prints the table; writes it as JSON (``--json``, default bench_gpu.json) and as a plot (``--png``, default
bench_gpu.png; needs matplotlib).  webdataset is installed only in the benchmark environment.  On a
machine without CUDA the GPU rows are left out and say so.

    python bench/bench_gpu.py [--workers 2,8,15] [--train-workers 4] [--seconds 20]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

BATCH = 256


def jpeg(i: int) -> dict:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(i)
    small = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(small).resize((256, 256), Image.BILINEAR).save(out, format="JPEG", quality=90)
    return {"jpg": out.getvalue(), "cls": b"%d" % (i % 1000)}


def rate(loader, seconds: float, per_batch=None) -> float:
    """Samples/s over at most ``seconds`` (after one warm-up batch)."""
    it = iter(loader)
    next(it)
    n, started = 0, time.perf_counter()
    for batch in it:
        if per_batch is not None:
            batch = per_batch(batch)
        n += len(batch[1])
        if time.perf_counter() - started > seconds:
            break
    return n / (time.perf_counter() - started)


def loaders(impl: str, kind: str, spec: str, workers: int, pack=None):
    import numpy as np

    if impl == "webdataset":
        import webdataset as lib
    else:
        import wds_cloud as lib
    ds = lib.WebDataset(spec, shardshuffle=100, resampled=True)
    if kind == "tiny":
        ds = ds.to_tuple("txt", "cls")
    elif kind in ("raw", "gpu"):
        ds = ds.to_tuple("jpg", "cls")
    elif kind == "cpu":
        from PIL import Image

        def prepare(sample):
            image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB").resize((224, 224))
            return np.asarray(image).transpose(2, 0, 1).copy(), int(sample["cls"])

        ds = ds.map(prepare)
    ds = ds.batched(BATCH)
    kw = {"batch_size": None, "num_workers": workers, "persistent_workers": True}
    if impl == "wds_cloud":
        kw["pack_bytes"] = pack  # None: the default
    return lib.WebLoader(ds, **kw)


def train_rate(model_name: str, feed, seconds: float) -> float:
    import torch
    import torchvision

    model = getattr(torchvision.models, model_name)(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    n, started, warm = 0, None, 3
    for images, labels in feed:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images.contiguous(memory_format=torch.channels_last)), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        warm -= 1
        if warm == 0:
            torch.cuda.synchronize()
            started = time.perf_counter()
        elif warm < 0:
            n += len(labels)
            if time.perf_counter() - started > seconds:
                break
    torch.cuda.synchronize()
    return n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,8,15")
    parser.add_argument("--train-workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", default="bench_gpu.json")
    parser.add_argument("--png", default="bench_gpu.png")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch

    import wds_cloud as wds

    common.peer()
    jpg_spec, _ = common.dataset("gpu-jpeg", 64, 500, jpeg)
    tiny_spec, _ = common.dataset("gpu-tiny", 8, 25_000, common.tiny)
    cuda = torch.cuda.is_available()
    try:
        import torchvision  # noqa: F401

        has_tv = True
    except Exception:
        has_tv = False
    results: dict = {"loader": [], "training": [], "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def to_tensors(batch):
        return torch.as_tensor(batch[0]), torch.as_tensor(np_labels(batch[1]))

    for workers in [int(w) for w in args.workers.split(",")]:
        for kind, spec in (("tiny", tiny_spec), ("raw", jpg_spec), ("cpu", jpg_spec), ("gpu", jpg_spec)):
            row = {"workers": workers, "workload": kind}
            if kind == "gpu" and not (cuda and has_tv):
                row["note"] = "needs CUDA and torchvision"
                results["loader"].append(row)
                continue
            # wds_cloud as users get it (pack_bytes=None: buffers through the shared ring, columns kept lists),
            # and where there are bytes to move, packed (pack_bytes=True, what the GPU rows use) and pickled
            # (pack_bytes=False, as webdataset does)
            variants = (("wds_cloud", None), ("wds_cloud", True), ("wds_cloud", False), ("webdataset", False))
            for impl, pack in variants:
                if kind == "gpu" and (impl == "webdataset" or pack is not True):
                    continue
                if pack is not None and impl == "wds_cloud" and kind not in ("raw", "gpu"):
                    continue
                loader = loaders(impl, kind, spec, workers, pack)
                decode = wds.gpu_decode(0, size=224, crop=224) if kind == "gpu" else None
                label = impl + ({True: " packed", False: " pickled"}.get(pack, "") if impl == "wds_cloud" else "")
                row[label] = round(rate(loader, args.seconds, decode))
                print(f"{workers:>2} workers, {kind:<4} {label:<17} {row[label]:>9,} samples/s", flush=True)
            if "webdataset" in row:
                row["ratio"] = round(row["wds_cloud"] / row["webdataset"], 2)
            results["loader"].append(row)

    if cuda and has_tv:
        for model_name in ("resnet18", "resnet50"):
            images = torch.randn(BATCH, 3, 224, 224, device="cuda")
            labels = torch.randint(0, 1000, (BATCH,), device="cuda")
            synthetic = ((images, labels) for _ in iter(int, 1))
            base = train_rate(model_name, synthetic, args.seconds)
            row = {"model": model_name, "synthetic": round(base)}
            gpu_loader = loaders("wds_cloud", "gpu", jpg_spec, args.train_workers, pack=True)
            decode = wds.gpu_decode(0, size=224, crop=224, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
            feeds = {
                "wds_cloud gpu decode": ((decode(b)[0], torch.as_tensor(np_labels(b[1])).cuda()) for b in gpu_loader),
                "wds_cloud cpu decode": (
                    wds.to_device(to_tensors(b), "cuda")
                    for b in loaders("wds_cloud", "cpu", jpg_spec, args.train_workers)
                ),
                "webdataset cpu decode": (
                    wds.to_device(to_tensors(b), "cuda")
                    for b in loaders("webdataset", "cpu", jpg_spec, args.train_workers)
                ),
            }
            for name, feed in feeds.items():
                fed = train_rate(
                    model_name, ((x.float() if x.dtype == torch.uint8 else x, y) for x, y in feed), args.seconds
                )
                row[name] = f"{fed / base:.0%}"
                print(f"{model_name}: {name} {fed:,.0f} img/s = {fed / base:.0%} of synthetic {base:,.0f}", flush=True)
            results["training"].append(row)
    else:
        results["training_note"] = "training steps need CUDA and torchvision: not run on this machine"
        print(results["training_note"])

    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    plot(results, args.png)


def np_labels(column):
    import numpy as np

    return np.asarray([int(c) for c in column])


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: pip install matplotlib to get {path})")
        return
    kinds = sorted({r["workload"] for r in results["loader"]})
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.5))
    for ax, kind in zip(axes if len(kinds) > 1 else [axes], kinds):
        rows = [r for r in results["loader"] if r["workload"] == kind]
        for label in sorted({k for r in rows for k in r if k.startswith(("wds_cloud", "webdataset"))}):
            points = [(r["workers"], r[label]) for r in rows if label in r]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        if not any(k.startswith(("wds_cloud", "webdataset")) for r in rows for k in r):
            ax.text(0.5, 0.5, "not run here:\nneeds CUDA and torchvision", ha="center", va="center")
        ax.set_title(kind)
        ax.set_xlabel("DataLoader workers")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
