"""Session policy v3: Gittins index per (class, age bin), batch eviction over all live groups."""
import sys, math, bisect
from collections import defaultdict
sys.path.insert(0, "evals/explore")
from sim import load, LRU, run
from sim2 import Session as S2

class Session(S2):
    def __init__(self, cap, slack=0.01, **kw):
        super().__init__(cap, **kw)
        self.slack = max(1, int(slack * cap))
    def fit(self):
        by = defaultdict(list)
        for gid, (t, c, turn, fa) in self.meta.items():
            if self.now - t >= self.horizon:
                by[c].append(fa if fa is not None and fa <= self.horizon else None)
        hz = {}
        grid = [e for e in self.edges if e <= self.horizon] + [self.horizon]
        for c, fas in by.items():
            if len(fas) < 30:
                continue
            ages = sorted(a for a in fas if a is not None)
            n = len(fas)
            S = [(n - bisect.bisect_left(ages, a)) / n for a in grid]   # P(no child before a)
            # integral of S between grid points (trapezoid)
            cum = [0.0]
            for i in range(1, len(grid)):
                cum.append(cum[-1] + 0.5 * (S[i] + S[i - 1]) * (grid[i] - grid[i - 1]))
            for i, a in enumerate(grid[:-1]):
                if S[i] <= 0:
                    hz[(c, self.bin(a))] = 0.0
                    continue
                best = 0.0
                for j in range(i + 1, len(grid)):
                    occ = cum[j] - cum[i]
                    if occ > 0:
                        best = max(best, (S[i] - S[j]) / occ)
                hz[(c, self.bin(a))] = best
        self.hz = hz
    def h(self, c, a):
        v = self.hz.get((c, self.bin(a)))
        if v is None:
            if a >= self.horizon and self.hz:
                return 0.0
            return 1.0 / (self.W + a)
        return v
    def evict(self):
        if self.size <= self.cap:
            return
        target = self.cap - self.slack
        order = []
        for c, od in self.byclass.items():
            dead = [g for g in od if self.live[g][1] <= 0]
            for g in dead:
                del od[g]; del self.live[g]
            for g in od:
                order.append((self.h(c, self.now - self.meta[g][0]), -self.meta[g][0], g))
        order.sort()
        for _, _, best in order:
            keys, _ = self.live[best]
            while keys and self.size > target:
                k = keys.pop()
                if self.owner.get(k) == best:
                    del self.owner[k]
                    self.size -= 1
                    self.live[best][1] -= 1
            if self.live[best][1] <= 0 or not keys:
                del self.byclass[self.meta[best][1]][best]
                del self.live[best]
            if self.size <= target:
                break

if __name__ == "__main__":
    reqs = load(sys.argv[1])
    distinct = len({k for r in reqs for k in r})
    kw = eval("dict(" + (sys.argv[3] if len(sys.argv) > 3 else "") + ")")
    for frac in [float(x) for x in sys.argv[2].split(",")]:
        cap = int(frac * distinct)
        a = run(reqs, LRU(cap)); b = run(reqs, Session(cap, **kw))
        print(f"{frac:5.2f} cap {cap:6d}  LRU {a:.4f}  session {b:.4f}  ({b/a:.3f}x)", flush=True)
