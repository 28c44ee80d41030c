"""Fast replay of hit/insert call sequences against policies (exploration for issue 21)."""
import sys, gzip, json, math, bisect
from collections import OrderedDict, defaultdict
sys.path.insert(0, "/work/main")

def load(path):
    reqs = []
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        for line in f:
            o = json.loads(line)
            reqs.append(o["hash_ids"])
    return reqs

class LRU:
    def __init__(self, cap):
        self.cap, self.d = cap, OrderedDict()
    def __contains__(self, k): return k in self.d
    def request(self, hit, new):
        for k in reversed(hit):
            self.d.move_to_end(k)
        for k in reversed(new):
            self.d[k] = 1
        while len(self.d) > self.cap:
            self.d.popitem(last=False)

class Session:
    """Groups = a request's new blocks + the prefix it hit (ownership moves to the newest
    request); victims: the group whose class has the lowest chance of a continuation soon."""
    def __init__(self, cap, W=None, bins=None, maxturn=6, fan=3, horizon=None):
        self.cap = cap
        self.owner = {}              # key -> group id
        self.groups = {}             # gid -> dict(keys=list chain order, t=arrival, c=class)
        self.byclass = defaultdict(OrderedDict)  # class -> gid -> None (arrival order)
        self.now = 0
        self.gid = 0
        self.size = 0
        self.maxturn = maxturn
        self.fan = fan
        self.children = defaultdict(int)   # key -> times it was the deepest hit
        self.turn = {}                     # gid -> turn
        self.ghost = OrderedDict()         # evicted key -> gid (for continuation events)
        self.W = W or max(50, cap // 15)   # window in requests: about a cache lifetime
        self.edges = [0] + [int(2 ** (i / 2)) for i in range(2, 40)]
        self.events = defaultdict(lambda: [0] * len(self.edges))   # class -> child counts by age bin
        self.born = defaultdict(list)      # class -> arrival times of groups (for at-risk counts)
        self.cont = set()                  # gids that got a child
        self.evt_ages = defaultdict(list)  # class -> sorted ages of first child
        self.horizon = horizon or 20 * self.W
    def __contains__(self, k): return k in self.owner
    def cls(self, turn):
        return min(turn, self.maxturn)
    def h(self, c, a):
        """P(first child in (a, a+W] | none by a), from first-child ages and group births."""
        ages = self.evt_ages[c]
        born = self.born[c]
        # groups of class c at risk at age a: born at least a ago, no child before age a
        n_old = bisect.bisect_right(born, self.now - a)          # born <= now - a
        ev_before = bisect.bisect_left(ages, a)
        at_risk = n_old - ev_before
        # events in (a, a+W] among groups old enough to have been seen to a+W
        n_oldW = bisect.bisect_right(born, self.now - a - self.W)
        ev_in = bisect.bisect_right(ages, a + self.W) - ev_before
        risk_w = n_oldW - ev_before
        if risk_w < 20:
            return 1.0 / (1 + a / self.W)   # no data: recency
        return (ev_in + 1) / (risk_w + 2)
    def request(self, hit, new):
        self.now += 1
        parent = None
        if hit:
            deep = hit[-1]
            self.children[deep] += 1
            if self.children[deep] <= self.fan:
                parent = self.owner.get(deep)
        else:
            # a continuation whose prefix was evicted: find the ghost owner of its first blocks
            pass
        # continuation event for the parent (also for evicted parents via ghosts)
        pg = parent
        if pg is None and new:
            # deepest ghost key in the request's chain prefix
            pass
        if pg is not None and pg not in self.cont and pg in self.groups:
            g = self.groups[pg]
            self.cont.add(pg)
            bisect.insort(self.evt_ages[g["c"]], self.now - g["t"])
        turn = self.turn.get(parent, 0) + 1 if parent is not None else 1
        gid = self.gid = self.gid + 1
        self.turn[gid] = turn
        c = self.cls(turn)
        keys = list(hit) + list(new)
        g = {"keys": keys, "t": self.now, "c": c}
        self.groups[gid] = g
        self.born[c].append(self.now)
        for k in hit:
            old = self.owner.get(k)
            if old is not None and old != gid:
                og = self.groups[old]
                og["n"] = og.get("n", len(og["keys"])) - 1
            self.owner[k] = gid
        for k in new:
            self.owner[k] = gid
            self.size += 1
        g["n"] = len(keys)
        self.byclass[c][gid] = None
        self.evict()
    def evict(self):
        while self.size > self.cap:
            best, bv = None, None
            for c, od in self.byclass.items():
                # drop empty groups lazily
                while od:
                    gid = next(iter(od))
                    g = self.groups[gid]
                    if g["n"] <= 0:
                        del od[gid]; del self.groups[gid]
                        continue
                    break
                if not od:
                    continue
                gid = next(iter(od))
                g = self.groups[gid]
                v = self.h(c, self.now - g["t"])
                if bv is None or v < bv:
                    best, bv = gid, v
            g = self.groups[best]
            # trim from the tip: deepest owned key first
            while g["keys"]:
                k = g["keys"].pop()
                if self.owner.get(k) == best:
                    del self.owner[k]
                    self.size -= 1
                    g["n"] -= 1
                    break
            if g["n"] <= 0 or not g["keys"]:
                del self.byclass[g["c"]][best]
                # keep the group record for continuation events? drop
                del self.groups[best]

def run(reqs, pol):
    hits = tot = 0
    for ids in reqs:
        k = 0
        while k < len(ids) and ids[k] in pol:
            k += 1
        hits += k; tot += len(ids)
        pol.request(ids[:k], ids[k:])
    return hits / tot

if __name__ == "__main__":
    reqs = load(sys.argv[1])
    distinct = len({k for r in reqs for k in r})
    for frac in [float(x) for x in sys.argv[2].split(",")]:
        cap = int(frac * distinct)
        a = run(reqs, LRU(cap)); b = run(reqs, Session(cap))
        print(f"{frac:5.2f} cap {cap:6d}  LRU {a:.4f}  session {b:.4f}  ({b/a:.3f}x)", flush=True)
