"""Throwaway: per-thread CPU per request of a zero-engine server under the lean load."""
import os, sys, time
sys.path.insert(0, os.getcwd())
from bench.servers import start_server, stop_servers
from bench.pipeload import run_pipelined
from bench.frontend import _children
from bench.mix import load_pairs
from client import Client
TCK = os.sysconf("SC_CLK_TCK")

def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            st = open(f"/proc/{pid}/task/{tid}/status").read()
        except OSError:
            continue
        vol = int(st.split("voluntary_ctxt_switches:")[1].split()[0])
        out[tid] = (name, (int(f[11]) + int(f[12])) / TCK, vol)
    return out

def main():
    workers, secs = int(sys.argv[1]), float(sys.argv[2])
    extra = sys.argv[3:]
    pairs = load_pairs(None)
    proc, port = start_server("zero", "saved_models/qa", max(1, 2 // workers), ["--workers", str(workers), *extra])
    try:
        with Client("127.0.0.1", port) as c:
            for q, ctx in pairs[:16]:
                c.answer(q, ctx, timeout=60)
        targets = [("fe", proc.pid)] + [(f"w{i}", k) for i, k in enumerate(_children(proc.pid))]
        if os.environ.get("PIN"):
            for i, (n, p) in enumerate(targets[1:]):
                for tid in os.listdir(f"/proc/{p}/task"):
                    os.sched_setaffinity(int(tid), {i % os.cpu_count()})
            print("pinned")
        time.sleep(0.5)
        before = {n: threads(p) for n, p in targets}
        run = run_pipelined("127.0.0.1", port, pairs, connections=8, pipeline=16, processes=2, seconds=secs)
        after = {n: threads(p) for n, p in targets}
        r = run["requests"]
        print(f"rps {run['throughput_rps']:.0f} requests {r}")
        total = 0
        for n, _ in targets:
            for tid, (name, cpu, vol) in after[n].items():
                b = before[n].get(tid, (name, 0.0, 0))
                d = cpu - b[1]
                total += d
                if d > 0.01:
                    print(f"  {n} {tid} {name}: {1e6*d/r:.1f} us/req  vol switches {(vol-b[2])/r:.2f}/req")
        print(f"  total {1e6*total/r:.1f} us/req")
    finally:
        stop_servers(proc)

if __name__ == "__main__":
    main()
