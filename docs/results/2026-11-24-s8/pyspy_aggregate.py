import sys, collections, re
path = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
leaf = collections.Counter(); incl = collections.Counter(); thr = collections.Counter(); total = 0
for line in open(path):
    stack, n = line.rstrip().rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    t = re.sub(r"\(\d+\)", "", frames[0]).strip()
    t = re.sub(r"127.0.0.1:\d+", "", t)
    thr[t] += n; total += n
    leaf[frames[-1]] += n
    for f in set(frames[1:]):
        incl[f] += n
print("total samples", total)
for t, n in thr.most_common(10): print(f"  thread {n/total:6.1%} {t}")
print("-- self")
for f, n in leaf.most_common(top): print(f"  {n/total:6.1%} {f}")
print("-- inclusive")
for f, n in incl.most_common(top): print(f"  {n/total:6.1%} {f}")
