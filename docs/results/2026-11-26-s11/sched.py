"""Throwaway: perf sched record during a saturated 2-worker run."""
import os, sys, time, subprocess
sys.path.insert(0, os.getcwd())
from bench.servers import start_server, stop_servers
from bench.pipeload import run_pipelined
from bench.frontend import _children
from bench.mix import load_pairs
from client import Client

def main():
    pairs = load_pairs(None)
    proc, port = start_server("zero", "saved_models/qa", 1, ["--workers", "2"])
    try:
        with Client("127.0.0.1", port) as c:
            for q, ctx in pairs[:16]:
                c.answer(q, ctx, timeout=60)
        print("fe", proc.pid, "workers", _children(proc.pid), flush=True)
        import threading
        def rec():
            time.sleep(3)
            subprocess.run(["perf", "sched", "record", "-o", "/tmp/s11/sched.data", "--", "sleep", "2"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t = threading.Thread(target=rec); t.start()
        run = run_pipelined("127.0.0.1", port, pairs, connections=8, pipeline=16, processes=2, seconds=8)
        t.join()
        print("rps", run["throughput_rps"])
    finally:
        stop_servers(proc)

if __name__ == "__main__":
    main()
