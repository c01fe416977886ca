"""Rate against connections: where parallel parts help, where they cost, and what the controller chooses.

Two stores, each read with a fixed ``concurrency`` of 1, 2, 4, 8 and 16, then with the default (the
measured level, on a host this process has not read from before):

- an emulated distant link (30 ms to the first byte, 50 MB/s per connection; ``tests/servers.py`` behind
  ``FaultProxy``, each in its own process), 8 shards of 22 MB;
- moto on loopback, where every GET, ranged or not, copies the whole object first (a store where a
  range costs in proportion to the object), 2 shards of 128 MB;
- a host that suffers from connections (``FaultProxy(crowd=4)``: 30 ms, 6 MB/s per connection while at
  most 4 send, every one slowed to 1 MB/s while more do), 8 shards of 22 MB: the best fixed level is 4,
  and the table gives the level the default learned and its time against the best fixed level's;
- a host crowded mid-read (30 ms, 10 MB/s per connection; from 1.5 s after it came up, more than 2
  connections sending slow every one to 0.3 MB/s), 6 shards of 22 MB, pinned at 1 and 2 only: whether the
  default, which climbed while the host was fast, comes back to 2.

``--only suffering`` (or ``--only crowded``) runs that one alone; ``--levels 4`` reads the suffering host at
those fixed levels only (a short run).

Prints a table and writes the figure of ``docs/cloud.md`` (``--svg``, default docs/img/concurrency.svg).

    python bench/bench_concurrency.py [--svg PATH] [--repeat 2] [--only suffering [--levels 4] | --only crowded]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_wan  # noqa: E402
import common  # noqa: E402

from tests import cloud  # noqa: E402

LEVELS = (1, 2, 4, 8, 16)

#: the suffering host: a proxy process paced per connection, slower for all while more than ``crowd`` send
CROWDED = (
    "import sys, time\nfrom wds_cloud.testing.faults import FaultProxy\n"
    "p = FaultProxy(sys.argv[1], latency=0.03, rate=6e6, crowd=4, crowd_rate=1e6)\n"
    "print(p.port, flush=True)\ntime.sleep(1e9)\n"
)

#: the host crowded mid-read: 30 ms, 10 MB/s per connection, until 1.5 s after it came up more than 2 connections
#: sending slow every one to 0.3 MB/s (the best pinned level is then 2)
CROWDED_LATER = (
    "import sys, time\nfrom wds_cloud.testing.faults import FaultProxy\n"
    "p = FaultProxy(sys.argv[1], latency=0.03, rate=10e6)\n"
    "print(p.port, flush=True)\ntime.sleep(1.5)\np.crowd_rate = 0.3e6\np.crowd = 2\ntime.sleep(1e9)\n"
)


def suffering(repeat, levels=LEVELS, script=CROWDED, shards=8, name="suffering host"):
    """Rates per fixed level and the default's against a host that suffers past 4 connections (``script``: the
    script of another such host)."""
    spec, _ = common.dataset("wan", 8, 64, bench_wan.sample)
    directory = os.path.dirname(spec)
    names = sorted(p for p in os.listdir(directory) if p.endswith(".tar"))[:shards]
    port = cloud.free_port()
    server = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxies = []
    try:
        cloud.wait_for_port(port, server, "HTTP server", timeout=300)

        def urls():  # a new proxy (a new host) each time: the default starts from nothing learned
            proxy = subprocess.Popen(
                [sys.executable, "-c", script, f"http://127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True
            )
            proxies.append(proxy)
            assert proxy.stdout is not None
            proxy_port = int(proxy.stdout.readline())
            return [f"http://127.0.0.1:{proxy_port}/{name}" for name in names]

        return curve(name, urls, None, repeat, levels)
    finally:
        for proxy in proxies:
            proxy.kill()
            proxy.wait()
        server.kill()
        server.wait()


def crowded_later(repeat):
    """The row of a host crowded mid-read (6 x 22 MB; pinned at 1 and 2 only: pinned higher, the read takes minutes
    at 0.3 MB/s per connection): whether the default finds 2 again once the level it climbed to slows."""
    title = "crowded from 1.5 s: 30 ms, 10 MB/s per connection, 0.3 MB/s past 2"
    return (title, *suffering(repeat, (1, 2), CROWDED_LATER, shards=6, name="crowded mid-read"))


def read(urls, concurrency, options=None) -> tuple[float, dict]:
    """(MB/s of sample data, the host's report) for one pass."""
    import wds_cloud as wds

    ds = wds.WebDataset(urls, shardshuffle=False, concurrency=concurrency, storage_options=options)
    started = time.perf_counter()
    total = sum(len(value) for sample in ds for key, value in sample.items() if key in ("jpg", "npy"))
    seconds = time.perf_counter() - started
    (report,) = ds.stats.hosts.values() or [{}]
    return total / seconds / 1e6, report


def curve(name, make_urls, options, repeat, levels=LEVELS):
    """Rates per fixed level and the default's (fresh host each time), best of ``repeat``."""
    from wds_cloud.io import concurrency

    fixed = {}
    for level in levels:
        fixed[level] = max(read(make_urls(), level, options)[0] for _ in range(repeat))
        print(f"{name}: concurrency={level}: {fixed[level]:.0f} MB/s", flush=True)
    best = (0.0, {})
    for _ in range(repeat):
        concurrency.forget()
        result = read(make_urls(), None, options)
        best = max(best, result, key=lambda r: r[0])
    rate, report = best
    print(
        f"{name}: default (measured): {rate:.0f} MB/s, ended at {report.get('level')} connections: {report.get('why')}",
        flush=True,
    )
    return fixed, rate, report


def svg(panels, path) -> None:
    """A small two-panel line chart (no plotting library needed)."""
    width, height, pad = 360, 260, 48
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * len(panels)}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width * len(panels)}" height="{height}" fill="white"/>',
    ]
    for i, (title, fixed, rate, report) in enumerate(panels):
        x0 = i * width
        top = max(max(fixed.values()), rate) * 1.15

        def px(level):
            return x0 + pad + LEVELS.index(level) * (width - 2 * pad) / (len(LEVELS) - 1)

        def py(value):
            return height - pad - value / top * (height - 2 * pad)

        out.append(f'<text x="{x0 + width / 2}" y="18" text-anchor="middle" font-weight="bold">{title}</text>')
        out.append(
            f'<line x1="{x0 + pad}" y1="{height - pad}" x2="{x0 + width - pad}" y2="{height - pad}" stroke="black"/>'
        )
        out.append(f'<line x1="{x0 + pad}" y1="{pad - 10}" x2="{x0 + pad}" y2="{height - pad}" stroke="black"/>')
        for level in LEVELS:
            out.append(f'<text x="{px(level)}" y="{height - pad + 15}" text-anchor="middle">{level}</text>')
        out.append(f'<text x="{x0 + width / 2}" y="{height - 12}" text-anchor="middle">connections (fixed)</text>')
        for k in range(5):
            value = top * k / 4
            out.append(f'<text x="{x0 + pad - 4}" y="{py(value) + 4}" text-anchor="end">{value:.0f}</text>')
        out.append(
            f'<text x="{x0 + 12}" y="{height / 2}" transform="rotate(-90 {x0 + 12} {height / 2})" '
            'text-anchor="middle">MB/s</text>'
        )
        points = " ".join(f"{px(level):.1f},{py(fixed[level]):.1f}" for level in LEVELS)
        out.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
        for level in LEVELS:
            out.append(f'<circle cx="{px(level):.1f}" cy="{py(fixed[level]):.1f}" r="3" fill="#1f77b4"/>')
        out.append(
            f'<line x1="{x0 + pad}" y1="{py(rate):.1f}" x2="{x0 + width - pad}" y2="{py(rate):.1f}" '
            'stroke="#d62728" stroke-dasharray="5,3"/>'
        )
        out.append(
            f'<text x="{x0 + width - pad}" y="{py(rate) - 5:.1f}" text-anchor="end" fill="#d62728">'
            f"default: {rate:.0f} MB/s, ends at {report.get('level')}</text>"
        )
    out.append("</svg>")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--svg", default=os.path.join(os.path.dirname(HERE), "docs", "img", "concurrency.svg"))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--only", choices=["suffering", "crowded"], help="run one store only (no figure)")
    parser.add_argument(
        "--levels", type=int, nargs="+", choices=LEVELS, default=list(LEVELS), help="fixed levels read (with --only)"
    )
    args = parser.parse_args()
    import warnings

    warnings.simplefilter("ignore")
    import wds_cloud  # noqa: F401  (imports and plugins before any clock)

    if args.only == "suffering":
        return report_rows(
            [("suffering host: 30 ms, 6 MB/s per connection, 1 MB/s past 4", *suffering(args.repeat, args.levels))]
        )
    if args.only == "crowded":
        return report_rows([crowded_later(args.repeat)])
    panels = []
    spec, _ = common.dataset("wan", 8, 64, bench_wan.sample)
    directory, name = os.path.dirname(spec), os.path.basename(spec)
    port = cloud.free_port()
    server = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(HERE), "tests", "servers.py"), "http", str(port), directory],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    links = []
    try:
        cloud.wait_for_port(port, server, "HTTP server", timeout=300)

        def link_urls():  # a new proxy (a new host) each time: the default starts from nothing learned
            link = bench_wan.Link(port, 30, 50)
            links.append(link)
            return f"http://127.0.0.1:{link.__enter__()}/{name}"

        fixed, rate, report = curve("emulated link", link_urls, None, args.repeat)
        panels.append(("emulated link: 30 ms, 50 MB/s per connection", fixed, rate, report))
    finally:
        for link in links:
            link.__exit__()
        server.kill()
        server.wait()

    import boto3

    large_spec, _ = common.dataset("large", 4, 16, common.large)
    moto_port = cloud.free_port()
    moto = subprocess.Popen(
        [shutil.which("moto_server", path=os.path.dirname(sys.executable)), "-H", "127.0.0.1", "-p", str(moto_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        cloud.wait_for_port(moto_port, moto, "moto_server")
        endpoint = f"http://127.0.0.1:{moto_port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="bench")
        paths = sorted(p for p in os.listdir(os.path.dirname(large_spec)) if p.endswith(".tar"))[:2]
        for p in paths:
            client.upload_file(os.path.join(os.path.dirname(large_spec), p), "bench", p)
        options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
        fixed, rate, report = curve("moto", lambda: [f"s3://bench/{p}" for p in paths], options, args.repeat)
        panels.append(("moto: every range costs the whole object", fixed, rate, report))
    finally:
        cloud.stop(moto)

    report_rows(
        panels + [("suffering host: 30 ms, 6 MB/s per connection, 1 MB/s past 4", *suffering(1)), crowded_later(1)]
    )
    svg(panels, args.svg)
    print(f"\nfigure: {args.svg}")


def report_rows(panels) -> None:
    """The table: MB/s per fixed level, the default's (and the level it ended at), and its ratio to the best."""
    print()
    rows = []
    for title, fixed, rate, report in panels:
        best_level = max(fixed, key=fixed.get)
        rows.append(
            [title]
            + [f"{fixed[level]:.0f}" if level in fixed else "-" for level in LEVELS]
            + [f"{rate:.0f} ({report.get('level')})", f"{rate / fixed[best_level]:.2f}x of {best_level}"]
        )
    print(common.table(rows, ["store"] + [str(level) for level in LEVELS] + ["default (ends at)", "vs best fixed"]))


if __name__ == "__main__":
    main()
