"""v5: groups lose value after their continuation; shared keys (many children / other requests' hits) in a rate-valued pool."""
import sys, math, bisect
from collections import defaultdict, OrderedDict
sys.path.insert(0, "evals/explore")
from sim import load, LRU, run
from sim3 import Session as S3

class Session(S3):
    def __init__(self, cap, **kw):
        super().__init__(cap, **kw)
        self.shared = {}        # key -> [first_seen, hits, last_hit]
    def __contains__(self, k):
        return k in self.owner or k in self.shared
    def request(self, hit, new):
        self.now += 1
        if self.now % self.refresh == 0:
            self.fit()
        ids = list(hit) + list(new)
        parent, pkey = None, None
        for k in reversed(ids):
            g = self.last.get(k)
            if g is not None:
                self.deep[k] += 1
                if self.deep[k] <= self.fan:
                    parent, pkey = g, k
                break
        if parent is not None:
            m = self.meta[parent]
            if m[3] is None:
                m[3] = self.now - m[0]
        turn = self.meta[parent][2] + 1 if parent is not None else 1
        gid = self.gid = self.gid + 1
        c = self.cls(turn, len(new))
        self.meta[gid] = [self.now, c, turn, None]
        mine = []
        for k in hit:
            if k in self.shared:
                s = self.shared[k]; s[1] += 1; s[2] = self.now
                continue
            old = self.owner[k]
            # a key of the parent's chain moves with the conversation; any other key read by a
            # request that does not continue its owner becomes shared
            if parent is not None and old == parent or old == gid:
                self.owner[k] = gid
                self.live[old][1] -= 1 if old != gid else 0
                mine.append(k)
            elif self.deep.get(k, 0) > self.fan or parent is None or old != parent:
                del self.owner[k]
                self.size -= 1
                self.live[old][1] -= 1
                self.shared[k] = [self.meta[old][0], 2, self.now]
        for k in ids:
            self.last[k] = gid
        for k in new:
            self.owner[k] = gid
            self.size += 1
            mine.append(k)
        self.live[gid] = [mine, len(mine)]
        self.byclass[c][gid] = None
        self.evict()
    def evict(self):
        if self.size + len(self.shared) <= self.cap:
            return
        target = self.cap - self.slack
        order = []
        for c, od in self.byclass.items():
            dead = [g for g in od if self.live[g][1] <= 0]
            for g in dead:
                del od[g]; del self.live[g]
            for g in od:
                m = self.meta[g]
                v = 0.0 if m[3] is not None else self.h(c, self.now - m[0])
                order.append((v, -m[0], 0, g))
        for k, (t0, n, lh) in self.shared.items():
            rate = n / (self.now - t0 + self.W)
            order.append((rate / max(1.0, (self.now - lh) / self.W), -lh, 1, k))
        order.sort()
        for v, _, kind, x in order:
            if self.size + len(self.shared) <= target:
                break
            if kind == 1:
                del self.shared[x]
                continue
            keys, _ = self.live[x]
            while keys and self.size + len(self.shared) > target:
                k = keys.pop()
                if self.owner.get(k) == x:
                    del self.owner[k]
                    self.size -= 1
                    self.live[x][1] -= 1
            if self.live[x][1] <= 0 or not keys:
                del self.byclass[self.meta[x][1]][x]
                del self.live[x]

if __name__ == "__main__":
    reqs = load(sys.argv[1])
    distinct = len({k for r in reqs for k in r})
    kw = eval("dict(" + (sys.argv[3] if len(sys.argv) > 3 else "") + ")")
    for frac in [float(x) for x in sys.argv[2].split(",")]:
        cap = int(frac * distinct)
        a = run(reqs, LRU(cap)); b = run(reqs, Session(cap, **kw))
        print(f"{frac:5.2f} cap {cap:6d}  LRU {a:.4f}  session {b:.4f}  ({b/a:.3f}x)", flush=True)
