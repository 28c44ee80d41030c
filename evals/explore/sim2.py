"""Session policy v2: ghost owners for continuation events, survival curves refreshed."""
import sys, math, bisect
from collections import OrderedDict, defaultdict
sys.path.insert(0, "evals/explore")
from sim import load, LRU, run

class Session:
    def __init__(self, cap, maxturn=6, fan=3, horizon=None, W=None, refresh=500, size_classes=False):
        self.cap, self.maxturn, self.fan = cap, maxturn, fan
        self.W = W or max(30, cap // 15)
        self.horizon = horizon or max(1000, 6 * self.W)
        self.refresh = refresh
        self.owner = {}                 # cached key -> gid
        self.last = {}                  # any key seen -> gid of its last toucher (ghost too)
        self.deep = defaultdict(int)    # key -> requests whose deepest known key it was
        self.meta = {}                  # gid -> [t, c, turn, first_child_age or None]
        self.live = {}                  # gid -> [keys chain order (owned), n owned]
        self.byclass = defaultdict(OrderedDict)
        self.now = self.gid = self.size = 0
        self.hz = {}                    # (c, bin) -> hazard
        self.size_classes = size_classes
        self.edges = sorted({int(1.25 ** i) for i in range(0, 60)})
    def __contains__(self, k): return k in self.owner
    def bin(self, a):
        return bisect.bisect_right(self.edges, a)
    def cls(self, turn, nnew):
        c = min(turn, self.maxturn)
        if self.size_classes:
            c = (c, 0 if nnew <= 2 else 1 if nnew <= 8 else 2)
        return c
    def fit(self):
        """Per class, hazard of a first child within W after each age bin (groups born >= horizon ago)."""
        by = defaultdict(list)
        for gid, (t, c, turn, fa) in self.meta.items():
            if self.now - t >= self.horizon:
                by[c].append(fa if fa is not None and fa <= self.horizon else None)
        hz = {}
        for c, fas in by.items():
            if len(fas) < 30:
                continue
            ages = sorted(a for a in fas if a is not None)
            n = len(fas)
            for b in range(len(self.edges)):
                a = self.edges[b - 1] if b else 0
                if a > self.horizon:
                    break
                surv = n - bisect.bisect_left(ages, a)            # no child before a
                ev = bisect.bisect_right(ages, a + self.W) - bisect.bisect_left(ages, a)
                hz[(c, b)] = (ev + 0.5) / (surv + 1)
        self.hz = hz
    def h(self, c, a):
        v = self.hz.get((c, self.bin(a)))
        if v is None:
            if a > self.horizon:
                return 0.0
            return 1.0 / (2 + a / self.W)
        return v
    def request(self, hit, new):
        self.now += 1
        if self.now % self.refresh == 0:
            self.fit()
        ids = list(hit) + list(new)
        parent = None
        for k in reversed(ids):
            g = self.last.get(k)
            if g is not None:
                self.deep[k] += 1
                if self.deep[k] <= self.fan:
                    parent = g
                break
        if parent is not None:
            m = self.meta[parent]
            if m[3] is None:
                m[3] = self.now - m[0]
        turn = self.meta[parent][2] + 1 if parent is not None else 1
        gid = self.gid = self.gid + 1
        c = self.cls(turn, len(new))
        self.meta[gid] = [self.now, c, turn, None]
        for k in hit:
            old = self.owner[k]
            if old != gid:
                self.live[old][1] -= 1
            self.owner[k] = gid
        for k in ids:
            self.last[k] = gid
        for k in new:
            self.owner[k] = gid
            self.size += 1
        self.live[gid] = [ids, len(ids)]
        self.byclass[c][gid] = None
        self.evict()
    def evict(self):
        while self.size > self.cap:
            best, bv = None, None
            for c, od in self.byclass.items():
                while od:
                    gid = next(iter(od))
                    if self.live[gid][1] <= 0:
                        del od[gid]; del self.live[gid]
                        continue
                    break
                if not od:
                    continue
                gid = next(iter(od))
                v = self.h(c, self.now - self.meta[gid][0])
                if bv is None or v < bv:
                    best, bv = gid, v
            keys, _ = self.live[best]
            while keys:
                k = keys.pop()
                if self.owner.get(k) == best:
                    del self.owner[k]
                    self.size -= 1
                    self.live[best][1] -= 1
                    break
            if self.live[best][1] <= 0 or not keys:
                del self.byclass[self.meta[best][1]][best]
                del self.live[best]

if __name__ == "__main__":
    reqs = load(sys.argv[1])
    distinct = len({k for r in reqs for k in r})
    kw = eval("dict(" + (sys.argv[3] if len(sys.argv) > 3 else "") + ")")
    for frac in [float(x) for x in sys.argv[2].split(",")]:
        cap = int(frac * distinct)
        a = run(reqs, LRU(cap)); b = run(reqs, Session(cap, **kw))
        print(f"{frac:5.2f} cap {cap:6d}  LRU {a:.4f}  session {b:.4f}  ({b/a:.3f}x)", flush=True)
