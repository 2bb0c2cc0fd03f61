#!/usr/bin/env python3
"""Differential fuzz of a rolling deploy for policies that are not plain (calendar and
concurrency tiers, penalty boxes, reserves, rate tiers of other units): an older version's
`kinds.lua`, given as `OLD` (a directory holding its `lua` folder's files, e.g. of the version
before plain policies ran kinds.lua, whose ARGV[2] has no plain flag), against this version's,
on one Redis. Databases 3, 4 and 5 replay the same random batches: old scripts, new scripts,
either chosen per batch; replies (errors compared without line numbers), state values, lease
and log sets must match, PTTLs within 200 ms. Batches of 1 to MAXREC (default 5) records over
two keys of three random policies of one family: checks (costs 0 to above capacity per tier,
classes, policed or shaped), settlements (refunds, extra charges, releases) and refreshes;
units of 1 ns and 1 us; BACK=1 steps the clock back now and then. OLD_PLAIN=1 when the older
version's ARGV[2] has the plain flag too (any version since plain policies ran kinds.lua).
COUNTFLAT=1 counts, on database 4 (this version's scripts), the batches that took the flat
path and its checks decided inline (`flat_check`'s common case) or by `flat_decide`.

    mkdir /tmp/old && git archive 040c099 src/store/redis/lua | tar -x -C /tmp/old
    redis-server --port 7401 --bind 127.0.0.1 --save "" &     # a throw-away server
    OLD=/tmp/old/src/store/redis/lua BACK=1 MAXREC=10 python3 benches/kinds_driver_diff.py 7401 SEED

Standard library only (`benches/resp.py`); loopback only; runs FLUSHDB on databases 3-5.
"""
import os, random, re, struct, sys
from resp import Conn, d
PORT = int(sys.argv[1]); SEED = int(sys.argv[2])
OLD = os.environ["OLD"]
# OLD_PLAIN=1: the older version's ARGV[2] has the plain flag too (any version since it).
OLD_PLAIN = os.environ.get("OLD_PLAIN")
NEW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src/store/redis/lua")
S = 10**9
def src(folder, fam, drv): return "".join(open(os.path.join(folder, f)).read() for f in ("prelude.lua", fam, drv))
FAM = {"rate": ([0, 1, 2], "rate.lua"), "window": ([3, 4], "window.lua"), "log": ([5], "log.lua")}
SCR = {f: (src(OLD, l, "kinds.lua"), src(NEW, l, "kinds.lua")) for f, (_, l) in FAM.items()}
COUNT = os.environ.get("COUNTFLAT")
CNT = ["__flat", "__fast", "__slow"]
if COUNT:
    def counted(s):
        s = s.replace("if flat_batch() then", "if flat_batch() then redis.call('INCR', '__flat')")
        return s.replace("if zero or slow then return flat_decide(st, i) end",
                         "if zero or slow then redis.call('INCR', '__slow') return flat_decide(st, i) end "
                         "redis.call('INCR', '__fast')")
    SCR = {f: (o, counted(n)) for f, (o, n) in SCR.items()}
def undo(b): return struct.unpack("<%dd" % (len(b) // 8), b)
def rpol(rnd, alg):
    unit = rnd.choice([1, 1, 1000]); tiers = []
    for _ in range(rnd.randint(1, 3)):
        k = rnd.choice([0, 0, 0, 1, 2])
        pen = (0, 0, 0); res = (0, 0)
        if k == 0:
            c = rnd.randint(1, 12 if alg == 5 else 20)
            per = rnd.choice([10, 100, 1000, 3000]) * 1_000_000 // unit
            if alg == 0 and rnd.random() < 0.5 and per % c == 0: per += 1
            b = c if alg >= 3 else rnd.randint(1, 2 * c)
            if rnd.random() < 0.3: pen = (rnd.choice([50, 500, 2000]) * 1_000_000 // unit, rnd.randint(1, 3), rnd.choice([100, 1000]) * 1_000_000 // unit)
            if alg == 0 and rnd.random() < 0.3 and b >= 3: res = (rnd.randint(0, b // 3), rnd.randint(0, b // 3))
            tiers.append((0, c, per, b) + pen + res)
        elif k == 1:
            tiers.append((1, rnd.randint(1, 4), rnd.choice([100, 300, 5000]), 0, 0, 0, 0, 0, 0))
        else:
            if rnd.random() < 0.3: pen = (rnd.choice([50, 500]) * 1_000_000 // unit, rnd.randint(1, 3), 1000 * 1_000_000 // unit)
            tiers.append((2, rnd.randint(1, 8), 0, 0) + pen + (0, 0))
    # (A policy of rate tiers alone, no box, no reserve, stands for one of other units.)
    return {"alg": alg, "unit": unit, "tiers": tiers}
def pargs(pols, new):
    out = []
    for p in pols:
        out += [p["unit"], 1000, p["alg"], len(p["tiers"])] + ([0] if new or OLD_PLAIN else [])
        for t in p["tiers"]: out += list(t)
    return d(*out)
def bounds(s):
    w = s // 60 * 60
    return [12] + [w - 60 + 60 * x for x in range(12)]
def main():
    rnd = random.Random(SEED)
    dbs = [Conn(PORT, x) for x in (3, 4, 5)]
    held = {}; nid = 1; now = 1_700_000_000 * S + rnd.randrange(60 * S)
    back = os.environ.get("BACK")
    counts = dict.fromkeys(CNT, 0)
    def tally():
        for k in CNT: counts[k] += int(dbs[1].cmd("GET", k) or 0)
    for batch in range(int(os.environ.get("BATCHES", "2000"))):
        if batch % 200 == 0:
            if COUNT: tally()
            for c in dbs: c.cmd("FLUSHDB")
            fam = rnd.choice(list(FAM)); pols = [rpol(rnd, rnd.choice(FAM[fam][0])) for _ in range(3)]; held = {}
        now += rnd.choice([0, 0, 1000, 1_000_000, 50_000_000, 250_000_000, 3 * S, 61 * S])
        if back and rnd.random() < 0.1: now -= rnd.choice([1000, 5_000_000, 300_000_000])
        s, ns = now // S, now % S
        recs, keys, meta = [], [], []
        for _ in range(rnd.randint(1, int(os.environ.get("MAXREC", "5")))):
            pi = rnd.randrange(3); p = pols[pi]; tiers = p["tiers"]; n = len(tiers)
            kname = "%s%d" % (rnd.choice("ab"), pi); ki = len(keys) + 1; keys.append(kname)
            nr = sum(1 for t in tiers if t[0] == 0)
            if p["alg"] == 5: keys += ["%s:z%d" % (kname, r + 1) for r in range(nr)]
            keys += ["%s:c%d" % (kname, q + 1) for q in range(sum(1 for t in tiers if t[0] == 1))]
            ncal = sum(1 for t in tiers if t[0] == 2); nconc = sum(1 for t in tiers if t[0] == 1)
            hs = held.setdefault((kname, pi), [])
            roll = rnd.random()
            if hs and roll < 0.35:
                lid, costs, ids, cs_, cu_ = hs.pop(rnd.randrange(len(hs)))
                body = [rnd.choice([1, 1, 0])]
                for t, c, e in zip(tiers, costs, ids):
                    new = c if t[0] == 1 else rnd.choice([c, c, 0, max(0, c - 1), c + 1, c + 3])
                    body += [c, new, cs_, cu_, lid if t[0] == 1 else e]
                if ncal:
                    for _ in range(ncal): body += bounds(s)
                    for _ in range(ncal): w = cs_ // 60 * 60; body += [w, w + 60]
                rec = [2, ki, pi + 1, 4 + len(body)] + body; meta.append(("settle", None))
            elif hs and nconc and roll < 0.45:
                lid, costs, ids, cs_, cu_ = rnd.choice(hs)
                body = [lid] + [c for t, c in zip(tiers, costs) if t[0] == 1]
                rec = [4, ki, pi + 1, 4 + len(body)] + body; meta.append(("refresh", nconc))
            else:
                lid = nid; nid += 1
                costs = [rnd.choice([0, 1, 1, 1, 2, 3, 5, 40]) for _ in tiers]
                budget = -1 if rnd.random() < 0.6 else rnd.choice([0, 1000, 10_000_000, 3 * S]) // p["unit"]
                body = [budget, lid] + costs + [rnd.choice([0, 1, 1, 2])]
                for _ in range(ncal): body += bounds(s)
                rec = [1, ki, pi + 1, 4 + len(body)] + body; meta.append(("check", (kname, pi, lid, costs, s, ns, p)))
            recs.append(rec)
        flat = [x for r in recs for x in r]
        old_s, new_s = SCR[fam]
        reps, pt = [], []
        for x, c in enumerate(dbs):
            new = x == 1 or (x == 2 and rnd.random() < 0.5)
            try:
                r = c.cmd("EVAL", new_s if new else old_s, str(len(keys)), *keys, d(1, s, ns), pargs(pols, new), d(*flat))
                reps.append(undo(r) if isinstance(r, bytes) else r)
            except Exception as e:
                reps.append(re.sub(r"user_script:\d+|script: \w+|@user_script:\d+", "", "ERR %s" % e))
            pt.append({k: int(c.cmd("PTTL", k)) for k in set(keys)})
        if reps[0] != reps[1] or reps[0] != reps[2]:
            print("REPLY DIFF", batch, fam, pols, "\nrecs", recs, "\nold", reps[0], "\nnew", reps[1], "\nmix", reps[2]); return 1
        if isinstance(reps[0], str):
            print("both failed alike:", reps[0][:200])
            continue
        v, pos = reps[0], 0
        for kind, m in meta:
            if kind == "settle": continue
            if kind == "refresh": pos += m; continue
            kname, pi, lid, costs, cs_, cu_, p = m
            n = len(p["tiers"]); per_sec = S // p["unit"]
            if v[pos] == 1 and any(costs):
                at = int(cs_) * per_sec + int(cu_) // p["unit"] + int(v[pos + 1])
                ids = [int(v[pos + 3 + 5 * t + 4]) for t in range(n)]
                held[(kname, pi)].append((lid, costs, ids, at // per_sec, at % per_sec))
            pos += 3 + 5 * n
        for k in sorted(set(keys)):
            z = ":" in k
            vals = [c.cmd("ZRANGE", k, "0", "-1", "WITHSCORES") if z else c.cmd("GET", k) for c in dbs]
            ts = [t[k] for t in pt]
            if vals[0] != vals[1] or vals[0] != vals[2] or max(ts) - min(ts) > 200:
                print("STATE DIFF", batch, k, fam, pols, "\nrecs", recs, [(not z and x and undo(x)) or x for x in vals], ts); return 1
    if COUNT: tally(); print("counts (new, database 4):", counts)
    print("ok", SEED); return 0
sys.exit(main())
