#!/usr/bin/env python3
"""Redis server instructions per check of a calendar tier beside GCRA, against a second rate
tier, counted deterministically: the script calls of the kinds bench (`benches/kinds.rs`,
`kinds/cpu/...`) replayed against a throw-away `redis-server` run under callgrind.

    python3 benches/calendar_cost.py [PORT]             # default port 7431; needs valgrind
    OLD=/tmp/old/src/store/redis/lua python3 benches/calendar_cost.py   # also an older lua

e.g. `mkdir /tmp/old && git archive main src/store/redis/lua | tar -x -C /tmp/old`. It starts
`valgrind --tool=callgrind redis-server --port PORT --bind 127.0.0.1 --save ""` itself (and
stops it at the end). Per case and script version: FLUSHALL, one unmeasured pass creating
every key's state (KEYS keys, 10,000; 100 units a check, so that the daily rate tier's state
outlives the slow server), then the instruction counters are zeroed
(`callgrind_control -z`), CALLS calls (500) of PER_CALL (21) policed checks each, every one
admitted, are sent (64 pipelined), and the counters dumped (`callgrind_control -d`): the
instructions of the whole server (scripts, commands, networking) divided by the checks.

Cases (as `Prepared::new` and `Prepared::check_kinds` in src/store/redis/script/record.rs send them;
unit 1 ns, grace 0):
  cal   kinds.lua: GCRA 1,000,000/s burst 1,000,000 + a calendar day in Europe/Berlin (4e9 a
        day); a policed check sends the bounds of the windows holding now -/+ 60 s (here: one
        day, its start and end).
  day   kinds.lua's flat path: the same GCRA tier + a rate tier of 10,000 a day (not plain,
        so that kinds.lua runs it).
  dayg  gcra.lua: GCRA + 10,000 a day as the plain policy the bench's `gcra+day` is.
Printed: instructions per check per case, and cal/day, cal/dayg. KEEP=DIR keeps each case's
callgrind dump there (`callgrind_annotate DIR/new-cal.callgrind` shows where they go).

Standard library only (the RESP client of `benches/resp.py`); loopback only.
"""
import datetime
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

from resp import Conn, d, enc

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 7431
KEYS = int(os.environ.get("KEYS", "10000"))
CALLS = int(os.environ.get("CALLS", "500"))
PER_CALL = int(os.environ.get("PER_CALL", "21"))
INFLIGHT = 64
OLD = os.environ.get("OLD")
KEEP = os.environ.get("KEEP")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
LUA = os.environ.get("LUA", os.path.join(ROOT, "src/store/redis/lua"))
S = 10**9


def src(folder, *names):
    return "".join(open(os.path.join(folder, n)).read() for n in names)


def berlin_day(now_s):
    """The Europe/Berlin day holding `now_s` (seconds since the epoch): its start and end."""
    try:
        from zoneinfo import ZoneInfo
        tz = ZoneInfo("Europe/Berlin")
    except Exception:  # no tz database: CET (the bench runs in winter as well)
        tz = datetime.timezone(datetime.timedelta(hours=1))
    local = datetime.datetime.fromtimestamp(now_s, tz)
    start = local.replace(hour=0, minute=0, second=0, microsecond=0)
    end = (start + datetime.timedelta(days=1, hours=2)).replace(hour=0)
    return int(start.timestamp()), int(end.timestamp())


def bounds(now_s):
    """`calendar::bounds` of a policed check: the days holding now - 60 s and now + 60 s."""
    s1, e1 = berlin_day(now_s - 60)
    s2, e2 = berlin_day(now_s + 60)
    return [2, s1, e1] if s1 == s2 else [3, s1, e1, e2]


GCRA = (0, 1_000_000, S, 1_000_000)
DAY = (0, 10_000, 86_400 * S, 10_000)
CAL = (2, 4_000_000_000, 0, 0)


def kinds_case(tiers):
    policy = [1, 0, 0, len(tiers), 0]
    for kind, a, b, c in tiers:
        policy += [kind, a, b, c, 0, 0, 0, 0, 0]
    ncal = sum(1 for t in tiers if t[0] == 2)

    def record(k, cost=1):
        body = [-1, 0] + [cost] * len(tiers) + [2]
        for _ in range(ncal):
            body += bounds(int(time.time()))
        return [1, k, 1, 4 + len(body)] + body
    return ("prelude.lua", "rate.lua", "line.lua", "boxes.lua", "cover.lua", "kinds.lua", "kinds_flat.lua", "kinds_general.lua"), d(*policy), record


def gcra_case(tiers):
    policy = [1, 0, 0, len(tiers)]
    for _, count, period, burst in tiers:
        policy += [period // count, period // count * burst]
    return ("gcra.lua",), d(*policy), lambda k, cost=1: [1, k, 1, cost, -1]


CASES = {
    "cal": kinds_case([GCRA, CAL]),
    "day": kinds_case([GCRA, DAY]),
    "dayg": gcra_case([GCRA, DAY]),
}

# CASES=cal,day measures those alone.
ONLY = os.environ.get("CASES", "cal,day,dayg").split(",")


def send(c, sha, policy, record, calls, first_call, cost=1):
    done = 0
    while done < calls:
        n = min(INFLIGHT, calls - done)
        out = []
        for j in range(n):
            first = (first_call + done + j) * PER_CALL
            keys, recs = [], []
            for x in range(PER_CALL):
                keys.append("cal:%d" % ((first + x) % KEYS))
                recs.append(d(*record(len(keys), cost)))
            out.append(enc("EVALSHA", sha, len(keys), *keys, d(0, 0, 0), policy, b"".join(recs)))
        c.s.sendall(b"".join(out))
        for _ in range(n):
            r = c.reply()
            # every check admitted: outcome 1 (the first double)
            assert os.environ.get("NOCHECK") or r[:8] == d(1), r
        done += n


def totals(path):
    for line in open(path):
        if line.startswith("totals:") or line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError("no totals in " + path)


def main():
    if not shutil.which("valgrind"):
        sys.exit("valgrind is needed")
    out = tempfile.mkdtemp(prefix="calcost")
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=%s/cg.%%p" % out,
         "redis-server", "--port", str(PORT), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                c = Conn(PORT)
                break
            except OSError:
                time.sleep(0.1)
        versions = [("new", LUA)] + ([("old", OLD)] if OLD else [])
        result = {}
        for vname, folder in versions:
            for cname in ONLY:
                files, policy, record = CASES[cname]
                c.cmd("FLUSHALL")
                sha = c.cmd("SCRIPT", "LOAD", src(folder, *files)).decode()
                # 100 units each: a daily rate tier's state then lives 864 s, not 8.64 s,
                # which the server under callgrind (tens of times slower) would outlive.
                send(c, sha, policy, record, KEYS // PER_CALL + 1, 0, 100)
                subprocess.run(["callgrind_control", "-z", str(server.pid)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                send(c, sha, policy, record, CALLS, KEYS // PER_CALL + 1)
                before = set(glob.glob(out + "/cg.*"))
                subprocess.run(["callgrind_control", "-d", str(server.pid)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                new = sorted(set(glob.glob(out + "/cg.*")) - before, key=os.path.getmtime)
                ir = totals(new[-1]) / (CALLS * PER_CALL)
                result[(vname, cname)] = ir
                if KEEP:
                    shutil.copy(new[-1], os.path.join(KEEP, "%s-%s.callgrind" % (vname, cname)))
                print(f"{vname:4s} {cname:5s} {ir:10.0f} instructions per check", flush=True)
            r = result
            if len(ONLY) < 3:
                continue
            print(f"{vname:4s} cal/day {r[(vname, 'cal')] / r[(vname, 'day')]:.3f}  "
                  f"cal/dayg {r[(vname, 'cal')] / r[(vname, 'dayg')]:.3f}", flush=True)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
