"""Throwaway: machine-wide idle/steal during a saturated zero-engine run, with server CPU."""
import os, sys, time
sys.path.insert(0, os.getcwd())
from bench.servers import start_server, stop_servers
from bench.pipeload import run_pipelined
from bench.frontend import process_tree_cpu_s, _children
TCK = os.sysconf('SC_CLK_TCK')
def own(pid):
    f = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(f[11]) + int(f[12])) / TCK
from bench.mix import load_pairs
from client import Client

def cpu_times():
    f = open("/proc/stat").readline().split()[1:]
    return [int(x) for x in f]

def main():
    workers, secs = int(sys.argv[1]), float(sys.argv[2])
    extra = sys.argv[3:]
    pairs = load_pairs(None)
    proc, port = start_server("zero", "saved_models/qa", max(1, 2 // workers), ["--workers", str(workers), *extra])
    try:
        with Client("127.0.0.1", port) as c:
            for q, ctx in pairs[:16]:
                c.answer(q, ctx, timeout=60)
        time.sleep(0.5)
        a, ca, fa = cpu_times(), process_tree_cpu_s(proc.pid), own(proc.pid)
        run = run_pipelined("127.0.0.1", port, pairs, connections=int(os.environ.get("C", 8)), pipeline=int(os.environ.get("P", 16)), processes=2, seconds=secs)
        b, cb, fb = cpu_times(), process_tree_cpu_s(proc.pid), own(proc.pid)
        d = [y - x for x, y in zip(a, b)]
        tot = sum(d)
        names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
        print(f"workers {workers} rps {run['throughput_rps']:.0f} server cpu/req {1e6*(cb-ca)/run['requests']:.0f} us fe {1e6*(fb-fa)/run['requests']:.1f} us",
              " ".join(f"{n} {100*v/tot:.1f}%" for n, v in zip(names, d)))
    finally:
        stop_servers(proc)

if __name__ == "__main__":
    main()
