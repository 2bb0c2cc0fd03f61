#!/usr/bin/env python3
"""Redis's own time per script call of the GCRA family (`src/store/redis/lua/gcra.lua`), beside
INCR and an empty script: `INFO commandstats` (usec_per_call: time inside the command) and
`INFO cpu` (used_cpu_user + used_cpu_sys over the calls), with one request in flight and with
64 pipelined on one connection (about what 64 tasks on one multiplexed connection send).

    redis-server --port 7400 --bind 127.0.0.1 --save "" &     # a throw-away server
    python3 benches/script_calls.py 7400                      # then kill it

Standard library only (the RESP client of `benches/resp.py`); loopback only. It runs RESETSTAT between
cases, so point it at a throw-away server. Records as `script/record.rs` packs them: GCRA at 400,000 a
second with a burst of 4,000 (T = 2,500 ns, tau = 10 ms), the server's clock.
"""
import os
import sys
import time

from resp import Conn, d, enc

PORT = int(sys.argv[1])
CALLS = int(os.environ.get("CALLS", "10000"))
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


c = Conn(PORT)
gcra = open(os.path.join(ROOT, "src/store/redis/lua/gcra.lua")).read()
header = d(0, 0, 0)
policy = d(1, 1000, 0, 1, 2500, 2500 * 4000)
check = d(1, 1, 1, 1, -1)
lease = d(3, 1, 1, 1, 512, 400, 0, 0, 0, 0, 0)


def load(src):
    return c.cmd("SCRIPT", "LOAD", src).decode()


def cpu():
    info = c.cmd("INFO", "cpu").decode()
    v = dict(l.split(":", 1) for l in info.split("\r\n") if ":" in l)
    return float(v["used_cpu_user"]) + float(v["used_cpu_sys"])


def run(name, make, calls, inflight):
    c.cmd("CONFIG", "RESETSTAT")
    before = cpu()
    done = 0
    while done < calls:
        n = min(inflight, calls - done)
        c.s.sendall(b"".join(make(done + j) for j in range(n)))
        for _ in range(n):
            c.reply()
        done += n
    used = (cpu() - before) * 1e6
    stats = c.cmd("INFO", "commandstats").decode()
    per = [l.split("usec_per_call=")[1].split(",")[0] for l in stats.split("\r\n")
           if l.startswith(("cmdstat_evalsha:", "cmdstat_incr:"))]
    print(f"{name:44s} in_flight={inflight:2d} usec_per_call={per[0]:>7s} "
          f"server_cpu_us_per_call={used / calls:6.1f}")


sha, empty = load(gcra), load("return 1")
cases = [
    ("INCR", lambda i: enc("INCR", "calls:incr"), CALLS),
    ("EVALSHA of `return 1`", lambda i: enc("EVALSHA", empty, 0), CALLS),
    ("gcra.lua: a check, one key", lambda i: enc("EVALSHA", sha, 1, "calls:hot", header, policy, check), CALLS),
    ("gcra.lua: a check, 10,000 keys", lambda i: enc("EVALSHA", sha, 1, "calls:cold:%d" % (i % 10000), header, policy, check), CALLS),
    ("gcra.lua: a lease call, one key", lambda i: enc("EVALSHA", sha, 1, "calls:lease", header, policy, lease), CALLS),
    ("gcra.lua: 4 checks per call, 10,000 keys",
     lambda i: enc("EVALSHA", sha, 4, *["calls:four:%d" % ((4 * i + j) % 10000) for j in range(4)],
                   header, policy, b"".join(d(1, j + 1, 1, 1, -1) for j in range(4))), CALLS // 4),
]
for inflight in (1, 64):
    for name, make, calls in cases:
        run(name, make, calls, inflight)

# What a script call's parts cost (64 in flight): the commands and the argument handling a
# lease call cannot do without, against the whole script.
parts = [
    ("TIME", "local t = redis.call('TIME') return 1"),
    ("TIME, GET", "local t = redis.call('TIME') local v = redis.call('GET', KEYS[1]) return 1"),
    ("TIME, GET, SET PX", "local t = redis.call('TIME') local v = redis.call('GET', KEYS[1]) "
     "redis.call('SET', KEYS[1], 'abcdefghabcdefgh', 'PX', 1000) return 1"),
    ("TIME, GET, SET PX, arguments and reply packed",
     "local t = redis.call('TIME') local a = {struct.unpack('<ddddddddddd', ARGV[3])} "
     "local p = {struct.unpack('<dddddd', ARGV[2])} local v = redis.call('GET', KEYS[1]) "
     "redis.call('SET', KEYS[1], struct.pack('<dd', 1, 2), 'PX', 1000) "
     "return struct.pack('<dddddddddddd', 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)"),
    ("gcra.lua, whole", gcra),
]
for name, src in parts:
    s = load(src)
    run("lease call: " + name, lambda i, s=s: enc("EVALSHA", s, 1, "calls:parts", header, policy, lease), CALLS, 64)
