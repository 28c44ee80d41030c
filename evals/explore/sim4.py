import sys
sys.path.insert(0, "evals/explore")
from sim import load, LRU, run
from sim5 import Session as S3
from collections import defaultdict

def future_children(reqs, fan=3):
    last, deep, out = {}, defaultdict(int), {}
    for i, ids in enumerate(reqs):
        parent = None
        for k in reversed(ids):
            g = last.get(k)
            if g is not None:
                deep[k] += 1
                if deep[k] <= fan:
                    parent = g
                break
        if parent is not None and parent not in out:
            out[parent] = i - parent
        for k in ids:
            last[k] = i
    return out

class Oracle(S3):
    FUT = None
    def cls(self, turn, nnew):
        return ("cont" if (self.gid - 1) in self.FUT else "end")

reqs = load(sys.argv[1])
Oracle.FUT = future_children(reqs)
import collections
distinct = len({k for r in reqs for k in r})
for frac in (0.05, 0.1):
    cap = int(frac * distinct)
    print(frac, run(reqs, Oracle(cap, horizon=2000)))
