"""What a server holds in memory: after start-up, at the peak of a load, after it, and over a
soak.

Each layout is a real server.py (and its worker processes) on a free port. Its memory is every
process's resident set (RSS) and proportional set (PSS: shared pages counted once across the
processes, so the PSS of a layout adds up to what it holds together), read from /proc.

    # the default repository in one process and with --workers 2: idle, peak, after the load
    .venv/bin/python bench/memory.py --layouts ",--workers 2" --json memory.json
    # the soak: 10 minutes of the mix with 10% bad requests, memory every 10 s
    .venv/bin/python bench/memory.py --soak 600 --json soak.json

The load: ``--requests`` requests from ``--clients`` connections, half QA with contexts long
enough for several full 384-token windows, half embed of 8 texts. The soak sends the same mix
with one request in ten bad (an empty question, an unknown model, a text over the cap) and
reports the growth from its first minute's end to its last sample.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.mix import load_pairs  # noqa: E402
from bench.servers import ROOT, start_server, stop_servers  # noqa: E402
from clients.blocking import Client  # noqa: E402
from protocol.errors import ServerError  # noqa: E402
from telemetry.memory import proportional_mb, resident_mb  # noqa: E402

#: Characters of context per QA request: about 1,000 tokens, three full 384-token windows.
LONG_CONTEXT_CHARS = 4500
#: Texts per embed request.
EMBED_TEXTS = 8


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (its worker processes, their children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return found


def snapshot(pid: int) -> dict[str, Any]:
    """Each process's RSS and PSS (MB) under ``pid``, and their sums."""
    procs = [{"pid": p, "rss_mb": resident_mb(p), "pss_mb": proportional_mb(p)}
             for p in descendants(pid)]
    procs = [p for p in procs if p["rss_mb"] is not None]
    return {"processes": procs, "rss_mb": round(sum(p["rss_mb"] for p in procs), 1),
            "pss_mb": round(sum(p["pss_mb"] or 0 for p in procs), 1)}


def requests_mix(seed: int) -> list[tuple[str, Any]]:
    """The mix: ("qa", (question, long context)) and ("embed", texts), alternating."""
    pairs = load_pairs()
    out: list[tuple[str, Any]] = []
    for i, (question, _) in enumerate(pairs):
        context = " ".join(c for _, c in pairs[i:] + pairs[:i])[:LONG_CONTEXT_CHARS]
        out.append(("qa", (question, context)))
        texts = [c for _, c in (pairs[i:] + pairs[:i])[:EMBED_TEXTS]]
        out.append(("embed", texts))
    return out[seed % len(out):] + out[:seed % len(out)]


def bad_request(client: Client, n: int) -> None:
    """One of three bad requests; each must come back as a typed error."""
    try:
        if n % 3 == 0:
            client.answer("", "A context.", timeout=60)
        elif n % 3 == 1:
            client.embed(["a text"], model="no-such-model", timeout=60)
        else:
            client.embed(["x" * 200_000], timeout=60)
    except ServerError:
        return
    raise AssertionError("a bad request was answered as if good")


def drive(port: int, requests: int, clients: int, bad_every: int = 0,
          until: float | None = None) -> dict[str, int]:
    """Send ``requests`` of the mix (or, with ``until``, as many as fit before it) from
    ``clients`` connections; one in ``bad_every`` bad. Counts of ok, bad and failed."""
    mix = requests_mix(0)
    counts = {"ok": 0, "bad": 0, "failed": 0}
    lock = threading.Lock()
    tickets = iter(range(requests if until is None else 10**9))

    def one_client() -> None:
        with Client("127.0.0.1", port) as client:
            while True:
                with lock:
                    n = next(tickets, None)
                if n is None or (until is not None and time.monotonic() >= until):
                    return
                kind = "ok"
                try:
                    if bad_every and n % bad_every == bad_every - 1:
                        bad_request(client, n)
                        kind = "bad"
                    else:
                        op, payload = mix[n % len(mix)]
                        if op == "qa":
                            client.answer(*payload, model="qa", timeout=120)
                        else:
                            client.embed(payload, model="embed", timeout=120)
                except (ServerError, OSError, AssertionError):
                    kind = "failed"
                with lock:
                    counts[kind] += 1

    threads = [threading.Thread(target=one_client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


def sample_peak(pid: int, stop: threading.Event, peak: dict[str, float]) -> None:
    """Keep the highest RSS and PSS sums seen until ``stop``."""
    while not stop.wait(0.25):
        now = snapshot(pid)
        peak["rss_mb"] = max(peak.get("rss_mb", 0.0), now["rss_mb"])
        peak["pss_mb"] = max(peak.get("pss_mb", 0.0), now["pss_mb"])


def measure_load(flags: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start a server with ``flags``; its memory idle, at the load's peak, and after it."""
    proc, port = start_server("onnx", args.model_dir, args.sessions, shlex.split(flags),
                              timeout_s=600, root=args.root)
    try:
        time.sleep(args.settle)
        idle = snapshot(proc.pid)
        stop, peak = threading.Event(), {}
        watcher = threading.Thread(target=sample_peak, args=(proc.pid, stop, peak))
        watcher.start()
        started = time.monotonic()
        counts = drive(port, args.requests, args.clients)
        seconds = time.monotonic() - started
        stop.set()
        watcher.join()
        time.sleep(args.settle)
        after = snapshot(proc.pid)
    finally:
        stop_servers(proc)
    return {"flags": flags, "idle": idle, "peak": peak, "after": after, "counts": counts,
            "load_s": round(seconds, 1)}


def measure_soak(flags: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start a server with ``flags`` and send the mix, one in ten bad, for ``--soak`` seconds;
    memory every ``--every`` seconds; growth from the first minute's end to the last sample."""
    proc, port = start_server("onnx", args.model_dir, args.sessions, shlex.split(flags),
                              timeout_s=600, root=args.root)
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    until = started + args.soak
    counts: dict[str, int] = {}
    load = threading.Thread(target=lambda: counts.update(
        drive(port, 0, args.clients, bad_every=10, until=until)))
    try:
        load.start()
        while load.is_alive():
            load.join(args.every)
            now = snapshot(proc.pid)
            samples.append({"t_s": round(time.monotonic() - started, 1),
                            "rss_mb": now["rss_mb"], "pss_mb": now["pss_mb"]})
            print(f"  {samples[-1]['t_s']:6.0f} s  RSS {now['rss_mb']:7.1f} MB  "
                  f"PSS {now['pss_mb']:7.1f} MB", flush=True)
    finally:
        stop_servers(proc)
    base = next((s for s in samples if s["t_s"] >= 60), samples[0])
    growth = (samples[-1]["rss_mb"] - base["rss_mb"]) / base["rss_mb"]
    return {"flags": flags, "samples": samples, "counts": counts, "base": base,
            "growth": round(growth, 4)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", default="saved_models", help="the repository served")
    parser.add_argument("--layouts", default=",--workers 2",
                        help="comma-separated server flags, one server each ('' : defaults)")
    parser.add_argument("--sessions", type=int, default=2, help="--num_inference_sessions")
    parser.add_argument("--requests", type=int, default=1000, help="requests of the load")
    parser.add_argument("--clients", type=int, default=16, help="connections at once")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds idle before each idle and after-load reading")
    parser.add_argument("--soak", type=float, default=0.0,
                        help="seconds of soak (one in ten bad), instead of the load")
    parser.add_argument("--every", type=float, default=10.0, help="soak: seconds per sample")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose server.py runs (another commit's)")
    parser.add_argument("--json", help="write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run each layout and print its figures."""
    args = parse_args(argv)
    results = []
    for flags in args.layouts.split(","):
        flags = flags.strip()
        label = flags or "(defaults)"
        if args.soak:
            result = measure_soak(flags, args)
            print(f"{label}: soak {args.soak:.0f} s {result['counts']}: RSS "
                  f"{result['base']['rss_mb']:.0f} MB at {result['base']['t_s']:.0f} s, "
                  f"{result['samples'][-1]['rss_mb']:.0f} MB at the end "
                  f"({100 * result['growth']:+.1f}%)", flush=True)
        else:
            result = measure_load(flags, args)
            print(f"{label}: idle RSS {result['idle']['rss_mb']:.0f} MB (PSS "
                  f"{result['idle']['pss_mb']:.0f}); peak {result['peak'].get('rss_mb', 0):.0f}"
                  f" ({result['peak'].get('pss_mb', 0):.0f}); after {args.requests} requests "
                  f"{result['after']['rss_mb']:.0f} ({result['after']['pss_mb']:.0f}); "
                  f"{len(result['after']['processes'])} processes; {result['counts']} in "
                  f"{result['load_s']} s", flush=True)
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
