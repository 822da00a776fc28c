"""Throwaway: per-process syscalls, context switches and py-spy under bench/frontend.py's lean load."""
import os, subprocess, sys, time
sys.path.insert(0, os.getcwd())
from bench.servers import start_server, stop_servers
from bench.pipeload import run_pipelined
from bench.frontend import _children, process_tree_cpu_s
from bench.mix import load_pairs
from client import Client


def io(pid):
    d = dict(l.split(": ") for l in open(f"/proc/{pid}/io").read().splitlines())
    tot = [int(d["syscr"]), int(d["syscw"]), 0, 0, 0.0]
    for tid in os.listdir(f"/proc/{pid}/task"):
        for l in open(f"/proc/{pid}/task/{tid}/status"):
            if l.startswith("voluntary_ctxt"): tot[2] += int(l.split()[1])
            if l.startswith("nonvoluntary_ctxt"): tot[3] += int(l.split()[1])
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tot[4] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    tot.append(int(f[12]) / os.sysconf("SC_CLK_TCK"))
    tot.append(int(f[7]) + int(f[9]))  # minflt + majflt
    return tot


def main():
    workers, secs, tag = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    extra = sys.argv[4:]
    pairs = load_pairs(None)
    proc, port = start_server("zero", "saved_models", max(1, 2 // workers), ["--workers", str(workers), *extra])
    try:
        with Client("127.0.0.1", port) as c:
            for q, ctx in pairs[:16]:
                c.answer(q, ctx, timeout=60)
        targets = [("fe", proc.pid)] + [(f"w{i}", k) for i, k in enumerate(_children(proc.pid))]
        spies = [] if "nospy" in tag else [subprocess.Popen(
            ["/tmp/prof/bin/py-spy", "record", "-p", str(pid), "-r", "250", "-d", str(int(secs)),
             "-f", "raw", "-o", f"/tmp/p8/{tag}-{name}.txt", "--threads", "--nonblocking", *(["--gil"] if "gil" in tag else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in targets]
        if os.environ.get("BATCH"):
            who = os.environ["BATCH"].split(",")
            for n, p in targets:
                if n[0] in who:
                    for tid in os.listdir(f"/proc/{p}/task"):
                        os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
            print("SCHED_BATCH", who)
        time.sleep(0.5)
        before = {n: io(p) for n, p in targets}
        cpu0 = process_tree_cpu_s(proc.pid)
        run = run_pipelined("127.0.0.1", port, pairs, connections=8, pipeline=16, processes=2, seconds=secs)
        cpu = process_tree_cpu_s(proc.pid) - cpu0
        after = {n: io(p) for n, p in targets}
        if os.environ.get("THREADS"):
            for n, p in targets:
                for tid in sorted(os.listdir(f"/proc/{p}/task")):
                    try:
                        name = open(f"/proc/{p}/task/{tid}/comm").read().strip()
                        f = open(f"/proc/{p}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    cpu = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
                    if cpu > 0.05:
                        print(f"    {n} {tid} {name}: {cpu:.2f} s total")
        for s in spies:
            s.wait()
        r = run["requests"]
        print(tag, "rps %.0f" % run["throughput_rps"], "cpu us/req %.0f" % (1e6 * cpu / r))
        for n, _ in targets:
            d = [y - x for x, y in zip(before[n], after[n])]
            print(f"  {n}: reads {d[0]/r:.2f} writes {d[1]/r:.2f} volctx {d[2]/r:.2f} invol {d[3]/r:.2f} cpu {1e6*d[4]/r:.0f} us/req, sys {1e6*d[5]/r:.0f} us/req, faults {d[6]/r:.2f}/req")
    finally:
        stop_servers(proc)


if __name__ == "__main__":
    main()
