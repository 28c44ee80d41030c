import sys
sys.path.insert(0, "evals/explore")
from sim import load
from collections import defaultdict
reqs = load("benchmarks/data/conversation_trace.jsonl.gz")
last, deep = {}, defaultdict(int)
seen = set()
cat = defaultdict(int); tot = 0
gaps = []
for i, ids in enumerate(reqs):
    k = 0
    while k < len(ids) and ids[k] in seen: k += 1
    tot += len(ids)
    parent = None
    for x in reversed(ids):
        g = last.get(x)
        if g is not None:
            deep[x] += 1
            if deep[x] <= 3: parent = g
            break
    for j in range(k):
        x = ids[j]
        if deep[x] > 3 or (parent is None):
            cat["shared/no parent"] += 1
        elif last[x] == parent:
            cat["parent chain"] += 1
        else:
            cat["other"] += 1
    if parent is not None: gaps.append(i - parent)
    for x in ids: last[x] = i; seen.add(x)
print({k: v / tot for k, v in cat.items()})
gaps.sort(); n = len(gaps)
print("gaps quantiles", [gaps[int(q * n)] for q in (0.1, 0.25, 0.5, 0.75, 0.9)])
