#!/usr/bin/env python3
"""Differential fuzz of kinds.lua: the flat path (the batch as is, database 0) against the
general path (the same batch plus a trailing check of a non-flat policy on an unrelated key,
database 1), the replies and the stored state (values, PTTLs, lease sets) compared after every
batch. Random batches of 1-5 policed checks and releases over two keys and five flat policies
(GCRA of whole-unit T beside minute calendars and lease sets; units of 1 ns and 1 us): the same
key twice, costs 0 and above capacity, window boundaries, expired leases, releases of unknown
leases; BACK=1 also steps the clock back 300 ms now and then (the stored guard).

    redis-server --port 7401 --bind 127.0.0.1 --save "" &      # a throw-away server
    BATCHES=2000 COUNTFLAT=1 python3 benches/kinds_flat_diff.py 7401 SEED   # then kill it

COUNTFLAT=1 counts the batches that took the flat path (key __flat). PTTLs may differ by
SLACK ms (default 20; more on a busy machine, where the two calls lie further apart). Standard
library only.

OLD=<dir> compares with an older version instead: database 1 runs the same batch (no forcing
record) with the `kinds.lua` (and `prelude.lua`, `rate.lua`) of that directory, e.g. one
extracted with `git archive`; errors must then match too (without line numbers). SKEW=x sends,
with probability x per calendar tier of a record, bounds that do not cover the server clock
(shifted 180 s), so a batch may fail (`cover`). RANDPOL=1 draws five new flat policies (whole-
unit GCRA tiers, calendar tiers, lease sets, in any order) every 300 batches. TRUNC=x (with
OLD) overwrites, with probability x per batch, a state key of the batch on both databases with a
value tollgate never writes: a stored one cut short (a whole number of doubles, maybe none), or
8 bytes (a guard's seconds alone) where there was none; both versions must fail or not alike
(not with the same message: the flat path's inline check reads a tier's window before it sees
that a later tier's cost is above its capacity).

    OLD=/tmp/old/src/store/redis/lua SKEW=0.03 RANDPOL=1 python3 benches/kinds_flat_diff.py 7401 SEED
"""
import random, re, struct, sys, os

from resp import Conn, d

PORT = int(sys.argv[1]); SEED = int(sys.argv[2]) if len(sys.argv) > 2 else 1
SLACK = int(os.environ.get("SLACK", "20"))
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
L = os.path.join(ROOT, "src/store/redis/lua")
SRC = "".join(open(os.path.join(L, f)).read() for f in ("prelude.lua", "rate.lua", "line.lua", "boxes.lua", "cover.lua", "kinds.lua", "kinds_flat.lua", "kinds_general.lua"))
if os.environ.get("COUNTFLAT"):
    SRC = SRC.replace("if flat_batch() then", "if flat_batch() then redis.call('INCR', '__flat')")
    SRC = SRC.replace("if zero or slow then return flat_decide(st, i) end",
                      "if zero or slow then return flat_decide(st, i) end redis.call('INCR', '__fast')")
OLD = os.environ.get("OLD")
SRC_B = SRC
if OLD:
    SRC_B = "".join(open(os.path.join(OLD, f)).read() for f in ("prelude.lua", "rate.lua", "line.lua", "boxes.lua", "cover.lua", "kinds.lua", "kinds_flat.lua", "kinds_general.lua"))
SKEW = float(os.environ.get("SKEW", "0"))
TRUNC = float(os.environ.get("TRUNC", "0"))
# PXLOG=1: every SET's key and PX logged (list __px), compared exactly, not within SLACK.
PXLOG = os.environ.get("PXLOG")
if PXLOG:
    def logged(src):
        head = "local call, tonumber, floor, ceil, max, min = redis.call, tonumber, math.floor, math.ceil, math.max, math.min\n"
        assert head in src
        return src.replace(head, head + "do local rc = redis.call; call = function(c, ...) if c == 'SET' then "
                           "local k, _, _, px = ...; rc('RPUSH', '__px', k .. ' ' .. string.format('%.17g', px)) end "
                           "return rc(c, ...) end end\n")
    SRC, SRC_B = logged(SRC), logged(SRC_B)
RANDPOL = os.environ.get("RANDPOL")
def call(conn, src, keys, *args):
    """A reply's doubles, or the error's text without line numbers."""
    try:
        return undo(conn.cmd("EVAL", src, str(len(keys)), *keys, *args))
    except Exception as e:
        return re.sub(r"user_script:\d+:?|@user_script:\d+|script: \w+", "", str(e))
def undo(b): return struct.unpack("<%dd" % (len(b) // 8), b)
S = 1_000_000_000
# Policies: list of tiers (kind, a, b, c).
POLS = [
    [(0, 2, S, 3), (2, 5, 0, 0), (1, 2, 250, 0)],            # rate 2/s burst 3, 5 per minute, 2 slots
    [(0, 10, S, 4), (0, 100, 60 * S, 20), (1, 3, 1000, 0)],    # two rates, 3 slots
    [(2, 3, 0, 0), (0, 1, 2 * S, 1), (2, 7, 0, 0)],          # two calendars (minute) beside a rate
    [(0, 3, 10, 2)],                                           # non-whole T: never flat
]
UNITS = [1, 1, 1000, 1, 1, 1000]
POLS.insert(3, [(1, 2, 300, 0)])                               # slots alone
POLS.insert(4, [(2, 4, 0, 0), (0, 3, 3 * S, 2)])               # calendar and rate, no slots
POLS[2] = [(2, 3, 0, 0), (0, 1, 2 * S // 1000, 1), (2, 7, 0, 0)]  # unit 1 us
def rand_pols(rnd):
    """Five flat policies (POLS[5], the forcing non-flat one, stays)."""
    for x in range(5):
        UNITS[x] = rnd.choice([1, 1, 1000])
        tiers = []
        for _ in range(rnd.randint(1, 4)):
            k = rnd.choice([0, 0, 2, 2, 1])
            if k == 0:
                c = rnd.randint(1, 6)
                T = rnd.choice([50_000_000, 250_000_000, S, 3 * S]) // UNITS[x]
                tiers.append((0, c, c * T, rnd.randint(1, 2 * c)))
            elif k == 2:
                tiers.append((2, rnd.randint(1, 8), 0, 0))
            else:
                tiers.append((1, rnd.randint(1, 3), rnd.choice([100, 300, 2000]), 0))
        POLS[x] = tiers
def pol_arg():
    out = []
    for x, tiers in enumerate(POLS):
        out += [UNITS[x], 1000, 0, len(tiers), 0]  # not plain: guarded
        for (k, a, b, c) in tiers: out += [k, a, b, c, 0, 0, 0, 0, 0]
    return d(*out)
def bounds(now_s, rnd=None):
    w = now_s // 60 * 60
    if rnd and rnd.random() < SKEW: w += rnd.choice([-180, 180])
    return [w - 60, w, w + 60, w + 120]
def main():
    rnd = random.Random(SEED)
    A, B = Conn(PORT, 0), Conn(PORT, 1)
    for c in (A, B): c.cmd("FLUSHDB")
    now = 1_700_000_000 * S + 50 * S
    held = {}  # (key, pol) -> list of (id, costs, at_s, at_u)
    nid = 1
    errors = 0
    tally = {"__flat": 0, "__fast": 0}
    for batch in range(int(os.environ.get("BATCHES", "3000"))):
        if RANDPOL and batch % 300 == 0:
            rand_pols(rnd)
            for k in tally: tally[k] += int(A.cmd("GET", k) or 0)
            for c in (A, B): c.cmd("FLUSHDB")
            held = {}
        if rnd.random() < 0.1:
            # exactly on the next minute boundary (a calendar window's end), or 1 ns before
            now = (now // (60 * S) + 1) * 60 * S - rnd.choice([0, 0, 1])
        now += rnd.choice([0, 0, 1_000_000, 100_000_000, 250_000_000, 499_999_999, 500_000_000, 3 * S, 20 * S, 61 * S, -300_000_000 if os.environ.get("BACK") else 0])
        s, ns = now // S, now % S
        recs, keys, meta = [], [], []
        for _ in range(rnd.randint(1, 5)):
            key = rnd.choice(["a", "b"])
            p = {"a": 0, "b": 1}[key] if rnd.random() < 0.7 else rnd.choice([0, 1, 2, 3, 4])
            kname = "%s%d" % (key, p)
            tiers = POLS[p]
            ki = len(keys) + 1
            keys.append(kname)
            keys += ["%s:c%d" % (kname, q + 1) for q in range(sum(1 for t in tiers if t[0] == 1))]
            ncal = sum(1 for t in tiers if t[0] == 2)
            hs = held.setdefault((kname, p), [])
            if hs and rnd.random() < 0.4:
                if rnd.random() < 0.15:
                    lid, costs, cs_, cu_ = (nid + 10_000_000, [rnd.randint(1, 2) for _ in tiers], s, ns)
                else:
                    lid, costs, cs_, cu_ = hs.pop(rnd.randrange(len(hs)))
                body = [rnd.choice([1, 1, 1, 0])]
                for t, c in zip(tiers, costs):
                    body += [c, c, cs_, cu_, lid if t[0] == 1 else 0]
                for _ in range(ncal): body += [4] + bounds(s, rnd)
                for _ in range(ncal): w = cs_ // 60 * 60; body += [w, w + 60]
                rec = [2, ki, p + 1, 4 + len(body)] + body
                meta.append(("settle", 0))
            else:
                lid = nid; nid += 1
                costs = [rnd.choice([0, 1, 1, 1, 2, 3, 4, 6]) for _ in tiers]
                body = [-1, lid] + costs + [1]
                for _ in range(ncal): body += [4] + bounds(s, rnd)
                rec = [1, ki, p + 1, 4 + len(body)] + body
                meta.append(("check", (kname, p, lid, costs, s, ns)))
            recs.append(rec)
        flat = [x for r in recs for x in r]
        broken = None
        if TRUNC and rnd.random() < TRUNC:
            k = rnd.choice([k for k in keys if ":c" not in k])
            v = A.cmd("GET", k)
            v = v[:8 * rnd.randrange(len(v) // 8)] if v else d(s + rnd.choice([-1, 0, 1]))
            for c in (A, B): c.cmd("SET", k, v)
            broken = k
        # the forcing record: a check of the non-flat policy on its own key
        force = [1, len(keys) + 1, 6, 4 + 2 + 1 + 1, -1, 999, 1, 1]
        argv1 = d(1, s, ns)
        va = call(A, SRC, keys, argv1, pol_arg(), d(*flat))
        pa = {k: int(A.cmd("PTTL", k)) for k in set(keys)}
        if OLD:
            vb = call(B, SRC_B, keys, argv1, pol_arg(), d(*flat))
        else:
            vb = call(B, SRC_B, keys + ["z"], argv1, pol_arg(), d(*(flat + force)))
            if not isinstance(vb, str): vb = vb[:len(vb) - 2 - (3 + 5)] + vb[-2:]
        pb = {k: int(B.cmd("PTTL", k)) for k in set(keys)}
        if broken and isinstance(va, str) and isinstance(vb, str): vb = va
        if va != vb:
            print("REPLY DIFF batch", batch, "policies", POLS, UNITS, "recs", recs, "\nflat", va, "\n" + ("old " if OLD else "gen "), vb); return 1
        if PXLOG:
            xa, xb = A.cmd("LRANGE", "__px", "0", "-1"), B.cmd("LRANGE", "__px", "0", "-1")
            for c in (A, B): c.cmd("DEL", "__px")
            xb = [x for x in xb if not x.startswith(b"z ")]  # the forcing record's key
            if xa != xb:
                print("PX DIFF batch", batch, "recs", recs, "\nflat", xa, "\n" + ("old " if OLD else "gen "), xb); return 1
        failed = isinstance(va, str)
        if failed: errors += 1; meta = []
        # record admitted ones
        pos = 0
        for (kind, m) in meta:
            if kind != "check": continue
            kname, p, lid, costs, cs_, cu_ = m
            if va[pos] == 1 and any(c > 0 for c in costs):
                held[(kname, p)].append((lid, costs, cs_, cu_))
            pos += 3 + 5 * len(POLS[p])
        for k in sorted(set(keys)):
            z = ":c" in k
            ga, gb = (None, None) if z else (A.cmd("GET", k), B.cmd("GET", k))
            za = A.cmd("ZRANGE", k, "0", "-1", "WITHSCORES") if z else None
            zb = B.cmd("ZRANGE", k, "0", "-1", "WITHSCORES") if z else None
            ta, tb = pa[k], pb[k]
            if ga != gb or za != zb or abs(ta - tb) > SLACK:
                print("STATE DIFF batch", batch, k, "\nflat", ga and undo(ga), za, ta, "\n" + ("old " if OLD else "gen "), gb and undo(gb), zb, tb, "\nrecs", recs); return 1
        # (Deleted after the batch: a broken key fails every batch that loads it.)
        if broken:
            for c in (A, B): c.cmd("DEL", broken)
    for k in tally: tally[k] += int(A.cmd("GET", k) or 0)
    print("ok", SEED, "flat batches on A:", tally["__flat"], "on B:", B.cmd("GET", "__flat"),
          "checks decided inline on A:", tally["__fast"], "batches failed alike:", errors); return 0
sys.exit(main())
