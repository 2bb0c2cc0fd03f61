#!/usr/bin/env python3
"""Redis's own time per check of plain policies (no concurrency or calendar tier, no penalty
box, no reserve) through the scripts of `src/store/redis/lua` (`kinds.lua`'s driver), beside
those of an older version given as `OLD`, a directory holding its `lua` folder's files, e.g.
of the version whose plain policies ran a driver of their own (`main.lua`):

    mkdir /tmp/old && git archive 040c099 src/store/redis/lua | tar -x -C /tmp/old
    redis-server --port 7401 --bind 127.0.0.1 --save "" &     # two throw-away servers
    redis-server --port 7402 --bind 127.0.0.1 --save "" &
    OLD=/tmp/old/src/store/redis/lua python3 benches/plain_drivers.py 7401 7402  # then kill them

Per case: token bucket with one tier and with two, fixed window, sliding log; PER_CALL (21)
checks per call (each on its own key, over 10,000 keys), 64 calls pipelined on one connection per server.
The two versions run at once, one per server (so that a busy machine slows both alike), and
swap servers from run to run, RUNS times. Each run starts from empty databases, creates every
key's state in one unmeasured pass, resets the statistics, then sends CALLS calls to each
server; it prints each server's CPU per check (`used_cpu_user + used_cpu_sys` of `INFO cpu`:
scripts, commands and networking) and the scripts' own time per check (`usec` of `EVALSHA` in
`INFO commandstats`: wall time, which a busy machine inflates). The medians and ranges close
the output. Without `OLD`, only this version runs, on the first server.

Standard library only (the RESP client of `benches/resp.py`); loopback only. It runs FLUSHALL
and RESETSTAT, so point it at a throw-away server.
"""
import os
import statistics
import sys

from resp import Conn, d, enc

PORTS = [int(p) for p in sys.argv[1:3]]
CALLS = int(os.environ.get("CALLS", "3000"))
RUNS = int(os.environ.get("RUNS", "3"))
OLD = os.environ.get("OLD")
PER_CALL = int(os.environ.get("PER_CALL", "21"))
INFLIGHT = 64
KEYS = 10_000
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LUA = os.path.join(ROOT, "src/store/redis/lua")


def src(name, folder=LUA):
    return open(os.path.join(folder, name)).read()


# The cases: algorithm number (script/record.rs's `alg`), family file, tiers as (count, period ns,
# burst). Every check is admitted, as in the kinds bench: the charging path.
CASES_ALL = [
    ("token bucket, 1 tier", 1, "rate.lua", [(1000, 10**9, 1000)]),
    ("token bucket, 2 tiers", 1, "rate.lua", [(1000, 10**9, 1000), (4 * 10**9, 3600 * 10**9, 4 * 10**9)]),
    ("fixed window", 3, "window.lua", [(1000, 10**9, 1000)]),
    ("sliding log", 5, "log.lua", [(1000, 60 * 10**9, 1000)]),
]
# CASES=1,3 runs the first and third only.
CASES = [CASES_ALL[int(i) - 1] for i in os.environ.get("CASES", "1,2,3,4").split(",")]


def main_layout(alg, tiers):
    """`Prepared::new` and `Prepared::check` of a plain policy before the merge."""
    policy = [1, 1000, alg, len(tiers)]
    for c, p, b in tiers:
        policy += [c, p, b]
    def record(k):
        return [1, k, 1, 1, -1]
    return d(*policy), record


def kinds_layout(alg, tiers):
    """`Prepared::new` and `Prepared::check` of a plain policy, for `kinds.lua`."""
    policy = [1, 1000, alg, len(tiers), 1]
    for c, p, b in tiers:
        policy += [0, c, p, b, 0, 0, 0, 0, 0]
    n = len(tiers)
    def record(k):
        return [1, k, 1, 7 + n, -1, 0] + [1] * n + [1]
    return d(*policy), record


conns = [Conn(p) for p in PORTS]
header = d(0, 0, 0)


def cpu(c):
    info = c.cmd("INFO", "cpu").decode()
    v = dict(l.split(":", 1) for l in info.split("\r\n") if ":" in l)
    return float(v["used_cpu_user"]) + float(v["used_cpu_sys"])


def evalsha_usec(c):
    stats = c.cmd("INFO", "commandstats").decode()
    for l in stats.split("\r\n"):
        if l.startswith("cmdstat_evalsha:"):
            return float(l.split("usec=")[1].split(",")[0])
    return 0.0


def call(sha, policy, record, alg, ntiers, first):
    """One call of PER_CALL checks on keys first, first + 1, ... (mod KEYS)."""
    keys, records = [], []
    for j in range(PER_CALL):
        name = "plain:%d" % ((first + j) % KEYS)
        records.append(d(*record(len(keys) + 1)))
        keys.append(name)
        if alg == 5:
            keys += ["%s:z%d" % (name, t + 1) for t in range(ntiers)]
    return enc("EVALSHA", sha, len(keys), *keys, header, policy, b"".join(records))


def send(sides, alg, ntiers, calls):
    """`calls` calls to each side (connection, script, policy, record maker) at once: 64
    pipelined on each, both servers working at the same time."""
    done = 0
    while done < calls:
        n = min(INFLIGHT, calls - done)
        for c, sha, policy, record in sides:
            c.s.sendall(b"".join(call(sha, policy, record, alg, ntiers, (done + j) * PER_CALL)
                                 for j in range(n)))
        for c, _, _, _ in sides:
            for _ in range(n):
                c.reply()
        done += n


def run(sides, alg, ntiers):
    for c, _, _, _ in sides:
        c.cmd("FLUSHALL")
    send(sides, alg, ntiers, KEYS // PER_CALL + 1)
    for c, _, _, _ in sides:
        c.cmd("CONFIG", "RESETSTAT")
    before = [cpu(c) for c, _, _, _ in sides]
    send(sides, alg, ntiers, CALLS)
    checks = CALLS * PER_CALL
    return [((cpu(c) - b) * 1e6 / checks, evalsha_usec(c) / checks)
            for (c, _, _, _), b in zip(sides, before)]


drivers = [("kinds.lua", LUA, "kinds.lua", kinds_layout)]
if OLD:
    drivers.insert(0, ("main.lua", OLD, "main.lua", main_layout))
results = {}
for name, alg, family, tiers in CASES:
    for r in range(RUNS):
        # The servers swap drivers from run to run.
        order = drivers if r % 2 == 0 else drivers[::-1]
        sides = []
        for c, (dname, folder, driver, layout) in zip(conns, order):
            text = src("prelude.lua", folder) + src(family, folder) + src(driver, folder)
            sha = c.cmd("SCRIPT", "LOAD", text).decode()
            policy, record = layout(alg, tiers)
            sides.append((c, sha, policy, record))
        for (dname, _, _, _), (cpu_us, lua_us) in zip(order, run(sides, alg, len(tiers))):
            results.setdefault((name, dname), []).append((cpu_us, lua_us))
            print(f"{name:24s} {dname:10s} run {r + 1}: server_cpu_us_per_check={cpu_us:5.2f} "
                  f"evalsha_us_per_check={lua_us:5.2f}", flush=True)


def summary(xs):
    return f"{statistics.median(xs):5.2f} [{min(xs):.2f}-{max(xs):.2f}]"


print()
for name, _, _, _ in CASES:
    for dname, _, _, _ in drivers:
        rs = results[(name, dname)]
        print(f"{name:24s} {dname:10s} server cpu/check {summary([x[0] for x in rs])} us, "
              f"evalsha/check {summary([x[1] for x in rs])} us")
