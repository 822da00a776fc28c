"""Throwaway: py-spy the 2-worker front end (and optionally a worker) under the lean load."""
import os, sys, time, subprocess
sys.path.insert(0, os.getcwd())
from bench.servers import start_server, stop_servers
from bench.pipeload import run_pipelined
from bench.frontend import _children, process_tree_cpu_s
from bench.mix import load_pairs
from client import Client

def main():
    secs = float(sys.argv[1]); which = sys.argv[2]
    pairs = load_pairs(None)
    proc, port = start_server("zero", "saved_models/qa", 1, ["--workers", "2"])
    try:
        with Client("127.0.0.1", port) as c:
            for q, ctx in pairs[:16]:
                c.answer(q, ctx, timeout=60)
        kids = _children(proc.pid)
        pid = proc.pid if which == "fe" else kids[0]
        spy = subprocess.Popen(["/tmp/prof/bin/py-spy", "record", "-r", "500", "-d", str(int(secs)), "-f", "raw",
                                "-o", f"/tmp/s11/{which}.raw", "-p", str(pid), "--threads", "--gil"])
        t0 = process_tree_cpu_s(pid) if which != "fe" else None
        run = run_pipelined("127.0.0.1", port, pairs, connections=8, pipeline=16, processes=2, seconds=secs)
        spy.wait()
        print("rps", run["throughput_rps"], "requests", run["requests"])
    finally:
        stop_servers(proc)

if __name__ == "__main__":
    main()
