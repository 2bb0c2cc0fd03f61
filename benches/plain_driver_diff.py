#!/usr/bin/env python3
"""Differential fuzz of a rolling deploy: plain policies (rate tiers counting requests, no
penalty box, no reserve) decided by an older version's scripts, given as `OLD` (a directory
holding its `lua` folder's files, e.g. of the version whose plain policies ran `main.lua`),
and by this version's (`kinds.lua`'s driver), on one Redis.

Three databases replay the same random batches: 0 through the old scripts alone, 1 through the
new ones alone, 2 through either, chosen per batch (the nodes of a fleet half deployed, sharing
state). Their replies and their stored state (values, PTTLs, sliding-log sets) must be equal
after every batch (PTTLs within 200 ms: the databases are written one after the other, on a
machine that may be busy). Batches of 1-5 records over two keys of three policies of one family: checks
(costs 0 to above capacity, policed or shaped), settlements of earlier admissions (refunds and
extra charges), and leases (GCRA, buckets, fixed windows) giving back earlier leases' rest;
units of 1 ns and 1 us; the clock jumps forward and, with BACK=1, steps back now and then.

    mkdir /tmp/old && git archive 040c099 src/store/redis/lua | tar -x -C /tmp/old
    redis-server --port 7401 --bind 127.0.0.1 --save "" &     # a throw-away server
    OLD=/tmp/old/src/store/redis/lua BATCHES=2000 python3 benches/plain_driver_diff.py 7401 SEED

Standard library only (the RESP client of `benches/resp.py`); loopback only. It runs FLUSHDB
on databases 0-2, so point it at a throw-away server.
"""
import os
import random
import struct
import sys

from resp import Conn, d

PORT = int(sys.argv[1])
SEED = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
NEW = os.path.join(ROOT, "src/store/redis/lua")
OLD = os.environ["OLD"]
S = 1_000_000_000


def script(folder, family, driver):
    return "".join(open(os.path.join(folder, f)).read() for f in ("prelude.lua", family, driver))


FAMILIES = {
    "rate": ([0, 1, 2], "rate.lua"),
    "window": ([3, 4], "window.lua"),
    "log": ([5], "log.lua"),
}
SCRIPTS = {f: (script(OLD, lua, "main.lua"), script(NEW, lua, "kinds.lua"))
           for f, (_, lua) in FAMILIES.items()}


def undo(b):
    return struct.unpack("<%dd" % (len(b) // 8), b)


def random_policy(rnd, alg):
    unit = rnd.choice([1, 1, 1000])
    tiers = []
    for _ in range(rnd.randint(1, 3)):
        count = rnd.randint(1, 12 if alg == 5 else 30)
        period = rnd.choice([10, 100, 1000, 3000, 60_000]) * 1_000_000 // unit
        if alg == 0 and period % count == 0:
            period += 1  # GCRA of a fractional emission interval: whole ones run gcra.lua
        burst = count if alg >= 3 else rnd.randint(1, 2 * count)
        tiers.append((count, period, burst))
    return {"alg": alg, "unit": unit, "tiers": tiers}


def policy_args(pols, new):
    out = []
    for p in pols:
        out += [p["unit"], 1000, p["alg"], len(p["tiers"])]
        if new:
            out.append(1)
        for c, per, b in p["tiers"]:
            out += [0, c, per, b, 0, 0, 0, 0, 0] if new else [c, per, b]
    return d(*out)


def record(rec, ki, pi, n, new):
    """A record of `rec` (kind, fields) for the old (main.lua) or the new (kinds.lua) driver."""
    kind = rec[0]
    if kind == "check":
        _, cost, budget = rec
        if new:
            return [1, ki, pi, 7 + n, budget, 0] + [cost] * n + [1]
        return [1, ki, pi, cost, budget]
    if kind == "settle":
        _, old, cost, charges = rec
        if new:
            out = [2, ki, pi, 5 + 5 * n, 0]
            for s, u, i in charges:
                out += [old, cost, s, u, i]
            return out
        out = [2, ki, pi, old, cost]
        for s, u, i in charges:
            out += [s, u, i]
        return out
    _, cost, block, useful, granted, spent, charges = rec
    if new:
        out = [3, ki, pi, 7 + 5 * n, cost, block, useful]
        for s, u, i in charges:
            out += [granted, spent, s, u, i]
        return out
    out = [3, ki, pi, cost, block, useful, granted, spent]
    for s, u, i in charges:
        out += [s, u, i]
    return out


def main():
    rnd = random.Random(SEED)
    dbs = [Conn(PORT, db) for db in (0, 1, 2)]
    for c in dbs:
        c.cmd("FLUSHDB")
    back = os.environ.get("BACK")
    now = 1_700_000_000 * S + rnd.randrange(S)
    family = rnd.choice(list(FAMILIES))
    pols = [random_policy(rnd, rnd.choice(FAMILIES[family][0])) for _ in range(3)]
    held = {}  # (key, policy) -> [(kind, cost or granted, charges)]
    mixed = {"old": 0, "new": 0}
    for batch in range(int(os.environ.get("BATCHES", "2000"))):
        if batch % 200 == 0:
            # Another family and other policies, on fresh databases.
            for c in dbs:
                c.cmd("FLUSHDB")
            family = rnd.choice(list(FAMILIES))
            pols = [random_policy(rnd, rnd.choice(FAMILIES[family][0])) for _ in range(3)]
            held = {}
        now += rnd.choice([0, 0, 1000, 1_000_000, 7_000_000, 50_000_000, 250_000_000, 3 * S, 61 * S])
        if back and rnd.random() < 0.1:
            now -= rnd.choice([1000, 5_000_000, 300_000_000])
        s, ns = now // S, now % S
        recs, keys, meta = [], [], []
        for _ in range(rnd.randint(1, 5)):
            pi = rnd.randrange(3)
            p = pols[pi]
            n = len(p["tiers"])
            kname = "%s%d" % (rnd.choice("ab"), pi)
            ki = len(keys) + 1
            keys.append(kname)
            if p["alg"] == 5:
                keys += ["%s:z%d" % (kname, t + 1) for t in range(n)]
            hs = held.setdefault((kname, pi), [])
            roll = rnd.random()
            if hs and roll < 0.3:
                kind, old, charges = hs.pop(rnd.randrange(len(hs)))
                if kind == "lease" and p["alg"] <= 3:
                    rec = ("lease", rnd.randint(1, 3), rnd.choice([1, 4, 16, 64]),
                           rnd.choice([0, 1, 4]) if p["alg"] != 3 else 0, old,
                           rnd.randint(0, old), charges)
                else:
                    rec = ("settle", old, rnd.choice([0, 0, 1, 2, 4, 8]), charges)
            elif p["alg"] <= 3 and roll < 0.5:
                rec = ("lease", rnd.randint(1, 3), rnd.choice([1, 4, 16, 64]),
                       rnd.choice([0, 1, 4]) if p["alg"] != 3 else 0, 0, 0, [(0, 0, 0)] * n)
            else:
                cost = rnd.choice([0, 1, 1, 1, 2, 3, 5, 40])
                budget = -1 if rnd.random() < 0.6 else rnd.choice([0, 1000, 10_000_000, 3 * S]) // p["unit"]
                rec = ("check", cost, budget)
            recs.append((rec, ki, pi + 1, n))
            meta.append((rec[0], kname, pi, p))
        argv1 = d(1, s, ns)
        old_s, new_s = SCRIPTS[family]
        replies, pttls = [], []
        for x, c in enumerate(dbs):
            new = x == 1 or (x == 2 and rnd.random() < 0.5)
            if x == 2:
                mixed["new" if new else "old"] += 1
            body = d(*[v for r in recs for v in record(r[0], r[1], r[2], r[3], new)])
            reply = c.cmd("EVAL", new_s if new else old_s, str(len(keys)), *keys, argv1,
                          policy_args(pols, new), body)
            replies.append(undo(reply))
            pttls.append({k: int(c.cmd("PTTL", k)) for k in set(keys)})
        if replies[0] != replies[1] or replies[0] != replies[2]:
            print("REPLY DIFF batch", batch, "family", family, "policies", pols, "\nrecords",
                  recs, "\nold  ", replies[0], "\nnew  ", replies[1], "\nmixed", replies[2])
            return 1
        # The tickets of admissions and grants, as the Rust side makes them.
        v, pos = replies[0], 0
        ds, dns = v[-2], v[-1]
        for (rec, _, _, n), (kind, kname, pi, p) in zip(recs, meta):
            if kind == "settle":
                continue
            per_sec = S // p["unit"]
            at0 = int(ds) * per_sec + int(dns) // p["unit"]
            out, delay = v[pos], int(v[pos + 1])
            width = 3 + 5 * n + (2 if kind == "lease" else 0)
            # What was charged: the check's cost, or the units a lease granted.
            cost = int(v[pos + width - 2]) if kind == "lease" else rec[1]
            if out == 1 and cost > 0:
                at = at0 + delay
                ids = [int(v[pos + 3 + 5 * t + 4]) for t in range(n)]
                charges = [(at // per_sec, at % per_sec, i) for i in ids]
                held[(kname, pi)].append((kind, cost, charges))
            pos += width
        for k in sorted(set(keys)):
            vals = [None if ":z" in k else c.cmd("GET", k) for c in dbs]
            zs = [c.cmd("ZRANGE", k, "0", "-1", "WITHSCORES") if ":z" in k else None for c in dbs]
            ts = [t[k] for t in pttls]
            if len(set(vals)) != 1 or zs[0] != zs[1] or zs[0] != zs[2] or max(ts) - min(ts) > 200:
                print("STATE DIFF batch", batch, k, "\nold  ", vals[0] and undo(vals[0]), zs[0],
                      ts[0], "\nnew  ", vals[1] and undo(vals[1]), zs[1], ts[1], "\nmixed",
                      vals[2] and undo(vals[2]), zs[2], ts[2], "\nrecords", recs)
                return 1
    print("ok", SEED, "batches of database 2 through the old scripts:", mixed["old"],
          "through the new:", mixed["new"])
    return 0


sys.exit(main())
