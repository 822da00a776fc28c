"""Throwaway: 1-worker (in-process) server, per-thread CPU sampled mid-run, several runs."""
import os, sys, time, threading
sys.path.insert(0, os.getcwd())
from bench.servers import start_server, stop_servers
from bench.pipeload import run_pipelined
from bench.frontend import process_tree_cpu_s
from bench.mix import load_pairs
from client import Client
TCK = os.sysconf("SC_CLK_TCK")

def snap(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            st = open(f"/proc/{pid}/task/{tid}/status").read()
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except OSError:
            continue
        vol = int(st.split("voluntary_ctxt_switches:")[1].split()[0])
        inv = int(st.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[tid] = (name, int(f[11]) / TCK, int(f[12]) / TCK, vol, inv)
    return out

def main():
    runs, secs = int(sys.argv[1]), float(sys.argv[2])
    pairs = load_pairs(None)
    proc, port = start_server("zero", "saved_models/qa", 2, ["--workers", "1"])
    try:
        with Client("127.0.0.1", port) as c:
            for q, ctx in pairs[:16]:
                c.answer(q, ctx, timeout=60)
        for r in range(runs):
            res = {}
            def sample():
                time.sleep(2)
                a = snap(proc.pid); t0 = time.monotonic()
                time.sleep(secs - 4)
                b = snap(proc.pid); res["dt"] = time.monotonic() - t0
                res["a"], res["b"] = a, b
            t = threading.Thread(target=sample); t.start()
            run = run_pipelined("127.0.0.1", port, pairs, connections=8, pipeline=16, processes=2, seconds=secs)
            t.join()
            a, b, dt = res["a"], res["b"], res["dt"]
            rps = run["throughput_rps"]; n = rps * dt
            groups = {}
            for tid, (name, u, s, v, i) in b.items():
                if tid not in a: continue
                _, u0, s0, v0, i0 = a[tid]
                g = groups.setdefault(name.split("-")[0] if name.startswith(("conn", "session")) else name, [0, 0, 0, 0])
                g[0] += u - u0; g[1] += s - s0; g[2] += v - v0; g[3] += i - i0
            tot = sum(g[0] + g[1] for g in groups.values())
            print(f"run {r}: rps {rps:.0f} cpu/req {1e6*tot/n:.0f} us cores {tot/dt:.2f}  " +
                  "  ".join(f"{k}: usr {1e6*g[0]/n:.0f} sys {1e6*g[1]/n:.0f} vol {g[2]/n:.2f} inv {g[3]/n:.2f}" for k, g in sorted(groups.items()) if g[0] + g[1] > 0.01), flush=True)
    finally:
        stop_servers(proc)

if __name__ == "__main__":
    main()
