-- tollgate: every algorithm, all tiers of one request, one atomic call.
--
-- The Rust algorithms (src/algorithm) are the reference; this script makes the same decisions.
-- Redis Lua numbers are doubles, exact for integers below 2^53, so:
--   * every instant is handled relative to `now`, in nanoseconds (small numbers); the hash
--     keeps them relative to its last write time (ws, wn) and re-bases them on load;
--   * GCRA, token bucket and leaky bucket share one core over an instant X in mixed radix
--     (whole nanoseconds + frac/count): GCRA's X is its TAT, the token bucket's X is the
--     instant it is full again, the leaky bucket's X the instant it is empty;
--   * products that may pass 2^53 go through `mad`, an exact (a*b + d) / c;
--   * numbers are written back with string.format('%.0f'), never with Lua's %.14g.
-- The store refuses, when the layer is built, tiers whose horizon would leave this range.
--
-- KEYS[1]   the state hash; KEYS[1 + i] the sliding-log sorted set of tier i (if any)
-- ARGV      op ('check' | 'settle'), clock ('S' = server TIME | 'C'), now_sec, now_nsec,
--           algorithm, ttl_grace_ms, ntiers, then count, period, burst per tier, then
--           for 'check': cost, max_delay (-1 = police)
--           for 'settle': old_cost, new_cost, then at_sec, at_nsec, id per tier

local B = 16777216 -- 2^24

local function fmt(x)
  return string.format('%.0f', x)
end

local function limbs(x)
  local x0 = x % B
  x = (x - x0) / B
  local x1 = x % B
  return x0, x1, (x - x1) / B
end

-- Exact a*b + d as six base-2^24 limbs (a, b, d non-negative integers below 2^53).
local function prod(a, b, d)
  local a0, a1, a2 = limbs(a)
  local b0, b1, b2 = limbs(b)
  local d0, d1, d2 = limbs(d)
  local l = { a0 * b0 + d0, a0 * b1 + a1 * b0 + d1, a0 * b2 + a1 * b1 + a2 * b0 + d2,
              a1 * b2 + a2 * b1, a2 * b2, 0 }
  for i = 1, 5 do
    local c = math.floor(l[i] / B)
    l[i] = l[i] - c * B
    l[i + 1] = l[i + 1] + c
  end
  return l
end

-- floor((a*b + d) / c) and the remainder, exactly (quotient below 2^53, c below 2^51).
local function mad(a, b, d, c)
  local q = math.floor((a * b + d) / c)
  local p = prod(a, b, d)
  while true do
    local m = prod(q, c, 0)
    local r = 0
    for i = 6, 1, -1 do r = r * B + (p[i] - m[i]) end
    if r < 0 then q = q - 1 elseif r >= c then q = q + 1 else return q, r end
  end
end

-- Exact floor(a / b) for integers (a may be negative), b > 0.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

local op = ARGV[1]
local now_s, now_n
if ARGV[2] == 'S' then
  local t = redis.call('TIME')
  now_s, now_n = tonumber(t[1]), tonumber(t[2]) * 1000
else
  now_s, now_n = tonumber(ARGV[3]), tonumber(ARGV[4])
end
local alg = ARGV[5]
local grace = tonumber(ARGV[6])
local ntiers = tonumber(ARGV[7])
local tiers = {}
for i = 1, ntiers do
  local j = 7 + (i - 1) * 3
  tiers[i] = { c = tonumber(ARGV[j + 1]), p = tonumber(ARGV[j + 2]), b = tonumber(ARGV[j + 3]) }
end
local rest = 8 + ntiers * 3

local key = KEYS[1]
local h = {}
do
  local flat = redis.call('HGETALL', key)
  for i = 1, #flat, 2 do h[flat[i]] = flat[i + 1] end
end
-- Time never goes back for a key: Redis's TIME can step backwards (NTP, a failover to a
-- replica whose clock is behind), and a window algorithm would then re-enter a window it has
-- already forgotten, as if it were empty. A key decides at the later of now and its last write.
if h.ws then
  local ws, wn = tonumber(h.ws), tonumber(h.wn)
  if ws > now_s or (ws == now_s and wn > now_n) then now_s, now_n = ws, wn end
end
-- Stored relative instants + shift = instants relative to now.
local shift = 0
if h.ws then
  shift = (tonumber(h.ws) - now_s) * 1e9 + (tonumber(h.wn) - now_n)
end
local function load_rel(field)
  local v = h[field]
  if v then return tonumber(v) + shift end
  return nil
end

-- Absolute (sec, nsec) of an instant `rel` ns after now.
local function abs_of(rel)
  local s = idiv(now_n + rel, 1e9)
  return now_s + s, now_n + rel - s * 1e9
end
-- Relative instant of an absolute (sec, nsec).
local function rel_of(s, n)
  return (s - now_s) * 1e9 + (n - now_n)
end

---------------------------------------------------------------------------------------------
-- Rate core (GCRA, token bucket, leaky bucket): X = (n, f) means n + f/count nanoseconds.

local function mixed_less(an, af, bn, bf)
  return an < bn or (an == bn and af < bf)
end

local function mixed_add(an, af, bn, bf, c)
  local f = af + bf
  if f >= c then return an + bn + 1, f - c end
  return an + bn, f
end

local function mixed_sub(an, af, bn, bf, c)
  local f = af - bf
  if f < 0 then return an - bn - 1, f + c end
  return an - bn, f
end

-- cost * T = cost * period / count, in mixed radix.
local function times_t(t, cost)
  return mad(cost, t.p, 0, t.c)
end

local rate = {}

function rate.load(t, i)
  local n = load_rel(i .. '.x')
  if n then
    t.xn, t.xf, t.last = n, tonumber(h[i .. '.f']), load_rel(i .. '.l')
  else
    -- Fresh: GCRA's TAT in the past; a full token bucket; an empty leaky bucket.
    t.xn, t.xf, t.last = 0, 0, 0
  end
end

function rate.save(t, i, out)
  out[#out + 1] = i .. '.x'; out[#out + 1] = fmt(t.xn)
  out[#out + 1] = i .. '.f'; out[#out + 1] = fmt(t.xf)
  out[#out + 1] = i .. '.l'; out[#out + 1] = fmt(t.last)
end

local function rate_base(t, from)
  if mixed_less(t.xn, t.xf, from, 0) then return from, 0 end
  return t.xn, t.xf
end

function rate.earliest(t, from, cost)
  local bn, bf = rate_base(t, from)
  local qn, qf = times_t(t, cost)
  local nn, nf = mixed_add(bn, bf, qn, qf, t.c)
  local tn, tf = times_t(t, t.b)
  local an, af = mixed_sub(nn, nf, tn, tf, t.c)
  if not mixed_less(from, 0, an, af) then return from end
  if af > 0 then return an + 1 end
  return an
end

function rate.charge(t, at, cost)
  local bn, bf = rate_base(t, at)
  local qn, qf = times_t(t, cost)
  t.xn, t.xf = mixed_add(bn, bf, qn, qf, t.c)
  if alg ~= 'gcra' and at > t.last then t.last = at end
  t.dirty = true
end

function rate.refund(t, cost)
  local qn, qf = times_t(t, cost)
  t.xn, t.xf = mixed_sub(t.xn, t.xf, qn, qf, t.c)
  if alg ~= 'gcra' and mixed_less(t.xn, t.xf, t.last, 0) then t.xn, t.xf = t.last, 0 end
  t.dirty = true
end

function rate.queue_wait(t, at)
  if alg ~= 'leaky_bucket' or not mixed_less(at, 0, t.xn, t.xf) then return 0 end
  local wn, wf = mixed_sub(t.xn, t.xf, at, 0, t.c)
  if wf > 0 then return wn + 1 end
  return wn
end

function rate.status(t)
  local en, ef = rate_base(t, 0)
  local tn, tf = times_t(t, t.b)
  local remaining = 0
  if not mixed_less(tn, tf, en, ef) then
    local rn, rf = mixed_sub(tn, tf, en, ef, t.c)
    remaining = mad(rn, t.c, rf, t.p)
  end
  local reset = en
  if ef > 0 then reset = reset + 1 end
  return remaining, reset
end

---------------------------------------------------------------------------------------------
-- Windows (fixed window, sliding window counter): absolute window indices k with counts.

local function window_clock(t)
  if not t.kn then t.kn, t.en = mad(now_s, 1e9, now_n, t.p) end
end

local function index_of(t, rel)
  return t.kn + idiv(t.en + rel, t.p)
end

local function start_of(t, k)
  return (k - t.kn) * t.p - t.en
end

local win = {}

function win.load(t, i)
  window_clock(t)
  t.w = {}
  local v = h[i .. '.w']
  if v then
    for k, n in string.gmatch(v, '(%d+):(%d+)') do t.w[tonumber(k)] = tonumber(n) end
  end
  local keep = t.kn
  if alg == 'sliding_counter' then keep = t.kn - 1 end
  for k in pairs(t.w) do
    if k < keep then t.w[k] = nil; t.dirty = true end
  end
end

function win.save(t, i, out)
  local parts = {}
  for k, n in pairs(t.w) do parts[#parts + 1] = fmt(k) .. ':' .. fmt(n) end
  out[#out + 1] = i .. '.w'; out[#out + 1] = table.concat(parts, ',')
end

local function used(t, k)
  return t.w[k] or 0
end

function win.earliest(t, from, cost)
  local k = index_of(t, from)
  while true do
    if alg == 'fixed_window' then
      if used(t, k) + cost <= t.c then return math.max(from, start_of(t, k)) end
    else
      local prev, cur = used(t, k - 1), used(t, k)
      if cur + cost <= t.c then
        local room = t.c - cur - cost
        local e_min = 0
        if prev > 0 and room < prev then
          e_min = t.p - mad(room, t.p, 0, prev)
        end
        if e_min < t.p then return math.max(from, start_of(t, k) + e_min) end
      end
    end
    k = k + 1
  end
end

function win.charge(t, at, cost)
  local k = index_of(t, at)
  t.w[k] = used(t, k) + cost
  t.dirty = true
end

function win.refund_at(t, at_rel, cost)
  local k = index_of(t, at_rel)
  if t.w[k] then
    t.w[k] = t.w[k] - math.min(t.w[k], cost)
    if t.w[k] == 0 then t.w[k] = nil end
    t.dirty = true
  end
end

function win.status(t)
  local last = nil
  for k in pairs(t.w) do
    if not last or k > last then last = k end
  end
  local lookback = 0
  if alg == 'sliding_counter' then lookback = 1 end
  local reset = 0
  if last then reset = math.max(0, start_of(t, last + 1 + lookback)) end
  local remaining
  if alg == 'fixed_window' then
    remaining = math.max(0, t.c - used(t, t.kn))
  else
    local prev = used(t, t.kn - 1)
    local part = 0
    if prev > 0 then part = mad(prev, t.en, 0, t.p) end
    remaining = math.max(0, t.c - used(t, t.kn) - prev + part)
  end
  return remaining, reset
end

---------------------------------------------------------------------------------------------
-- Sliding log: a sorted set per tier; member 'id:weight', score = instant - base, where the
-- base is a relative instant kept in the hash (re-based when it grows old).

local log = {}

function log.load(t, i)
  t.zkey = KEYS[1 + i]
  t.base = load_rel(i .. '.b')
  t.total = tonumber(h[i .. '.t'] or '0')
  t.next_id = tonumber(h[i .. '.i'] or '0')
  if not t.base then
    t.base, t.total = 0, 0
    t.dirty = true
    return
  end
  -- Prune entries with instant + period <= now, i.e. score <= -period - base.
  local cut = -t.p - t.base
  local gone = redis.call('ZRANGEBYSCORE', t.zkey, '-inf', fmt(cut))
  if #gone > 0 then
    for _, m in ipairs(gone) do
      t.total = t.total - tonumber(string.match(m, ':(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', t.zkey, '-inf', fmt(cut))
    t.dirty = true
  end
  if t.total == 0 then
    redis.call('DEL', t.zkey)
    t.base = 0
  elseif t.base < -1125899906842624 then -- 2^50 ns old: move the base to now
    local all = redis.call('ZRANGE', t.zkey, 0, -1, 'WITHSCORES')
    for j = 1, #all, 2 do
      redis.call('ZADD', t.zkey, fmt(tonumber(all[j + 1]) + t.base), all[j])
    end
    t.base = 0
    t.dirty = true
  end
end

function log.save(t, i, out)
  out[#out + 1] = i .. '.b'; out[#out + 1] = fmt(t.base)
  out[#out + 1] = i .. '.t'; out[#out + 1] = fmt(t.total)
  out[#out + 1] = i .. '.i'; out[#out + 1] = fmt(t.next_id)
end

local function entries(t)
  if not t.entries then
    t.entries = {}
    local all = redis.call('ZRANGE', t.zkey, 0, -1, 'WITHSCORES')
    for j = 1, #all, 2 do
      t.entries[#t.entries + 1] =
        { ts = tonumber(all[j + 1]) + t.base, w = tonumber(string.match(all[j], ':(%d+)$')) }
    end
  end
  return t.entries
end

function log.earliest(t, from, cost)
  if from == 0 and t.total + cost <= t.c then return 0 end
  local es = entries(t)
  local total = 0
  for _, e in ipairs(es) do
    if e.ts + t.p > from then total = total + e.w end
  end
  local at = from
  local j = 1
  while total + cost > t.c and j <= #es do
    local e = es[j]
    if e.ts + t.p > from then
      at = e.ts + t.p
      total = total - e.w
      while j + 1 <= #es and es[j + 1].ts == e.ts do
        j = j + 1
        if es[j].ts + t.p > from then total = total - es[j].w end
      end
    end
    j = j + 1
  end
  return at
end

function log.charge(t, at, cost)
  local id = t.next_id
  t.next_id = t.next_id + 1
  redis.call('ZADD', t.zkey, fmt(at - t.base), fmt(id) .. ':' .. fmt(cost))
  t.total = t.total + cost
  t.entries = nil
  t.dirty = true
  return id
end

-- Both the id and the instant must match: ids restart when a key's state is dropped, so a stale
-- ticket's id alone could name an entry of the key's next life; its instant cannot.
function log.refund_id(t, id, at, charged, cost)
  local member = fmt(id) .. ':' .. fmt(charged)
  local score = redis.call('ZSCORE', t.zkey, member)
  if not score or tonumber(score) + t.base ~= at then return end
  redis.call('ZREM', t.zkey, member)
  local left = charged - math.min(charged, cost)
  if left > 0 then redis.call('ZADD', t.zkey, score, fmt(id) .. ':' .. fmt(left)) end
  t.total = t.total - (charged - left)
  t.entries = nil
  t.dirty = true
end

function log.status(t)
  local remaining = math.max(0, t.c - t.total)
  local reset = 0
  if t.total > 0 then
    local last = redis.call('ZRANGE', t.zkey, -1, -1, 'WITHSCORES')
    if last[2] then reset = math.max(0, tonumber(last[2]) + t.base + t.p) end
  end
  return remaining, reset
end

---------------------------------------------------------------------------------------------

local impl
if alg == 'gcra' or alg == 'token_bucket' or alg == 'leaky_bucket' then
  impl = rate
elseif alg == 'fixed_window' or alg == 'sliding_counter' then
  impl = win
elseif alg == 'sliding_log' then
  impl = log
else
  return redis.error_reply('tollgate: unknown algorithm ' .. tostring(alg))
end

for i = 1, ntiers do impl.load(tiers[i], i) end

local function capacity(t)
  if impl == rate then return t.b end
  return t.c
end

-- Writes every changed state back, with a TTL equal to what it needs; returns statuses.
local function finish()
  local out = {}
  local ttl = 0
  local status = {}
  local dirty = false
  for i = 1, ntiers do
    local t = tiers[i]
    local remaining, reset = impl.status(t)
    status[i] = { remaining, reset }
    if reset > ttl then ttl = reset end
    if t.dirty then dirty = true end
  end
  if dirty then
    if ttl == 0 then
      redis.call('DEL', key)
      for i = 1, ntiers do
        if tiers[i].zkey then redis.call('DEL', tiers[i].zkey) end
      end
    else
      for i = 1, ntiers do impl.save(tiers[i], i, out) end
      out[#out + 1] = 'ws'; out[#out + 1] = fmt(now_s)
      out[#out + 1] = 'wn'; out[#out + 1] = fmt(now_n)
      redis.call('DEL', key)
      redis.call('HSET', key, unpack(out))
      local ms = fmt(math.ceil(ttl / 1e6) + grace)
      redis.call('PEXPIRE', key, ms)
      for i = 1, ntiers do
        if tiers[i].zkey and tiers[i].total > 0 then redis.call('PEXPIRE', tiers[i].zkey, ms) end
      end
    end
  end
  return status
end

if op == 'settle' then
  local old, new = tonumber(ARGV[rest]), tonumber(ARGV[rest + 1])
  for i = 1, ntiers do
    local t = tiers[i]
    local j = rest + 2 + (i - 1) * 3
    local at = rel_of(tonumber(ARGV[j]), tonumber(ARGV[j + 1]))
    local id = tonumber(ARGV[j + 2])
    if new < old then
      if impl == rate then rate.refund(t, old - new)
      elseif impl == win then win.refund_at(t, at, old - new)
      else log.refund_id(t, id, at, old, old - new) end
    elseif new > old then
      impl.charge(t, math.max(at, 0), new - old)
    end
  end
  finish()
  return { now_s, now_n }
end

local cost, max_delay = tonumber(ARGV[rest]), tonumber(ARGV[rest + 1])
-- reply: outcome (1 allowed, 0 limited, 2 cost above capacity), delay, retry, now_s, now_n,
-- then per tier: remaining, reset, own retry (-1 none), violated, at_s, at_n, id
local reply
local per = {}
local over = false
for i = 1, ntiers do
  if cost > capacity(tiers[i]) then over = true end
end
if cost == 0 then
  -- A query: always admitted, charges nothing.
  for i = 1, ntiers do per[i] = { -1, 0, 0, 0, 0 } end
  reply = { 1, 0, -1 }
elseif over then
  for i = 1, ntiers do
    local v = 0
    if cost > capacity(tiers[i]) then v = 1 end
    per[i] = { -1, v, 0, 0, 0 }
  end
  reply = { 2, 0, -1 }
else
  local t = 0
  for _ = 1, 64 do
    local nxt = t
    for i = 1, ntiers do nxt = math.max(nxt, impl.earliest(tiers[i], t, cost)) end
    if nxt == t then break end
    t = nxt
  end
  local queue = 0
  if max_delay >= 0 and impl == rate then
    for i = 1, ntiers do queue = math.max(queue, rate.queue_wait(tiers[i], t)) end
  end
  local wait = t + queue
  local budget = math.max(max_delay, 0)
  if wait > budget then
    for i = 1, ntiers do
      local own = impl.earliest(tiers[i], 0, cost)
      if own > 0 then per[i] = { own, 1, 0, 0, 0 } else per[i] = { -1, 0, 0, 0, 0 } end
    end
    reply = { 0, 0, wait - budget }
  else
    -- Charged at the instant the request leaves (after a leaky bucket's queue), as in Rust.
    for i = 1, ntiers do
      local id = impl.charge(tiers[i], wait, cost) or 0
      local s, n = abs_of(wait)
      per[i] = { -1, 0, s, n, id }
    end
    reply = { 1, wait, -1 }
  end
end
local status = finish()
reply[4], reply[5] = now_s, now_n
for i = 1, ntiers do
  local p = per[i]
  local base = 5 + (i - 1) * 7
  reply[base + 1] = status[i][1]
  reply[base + 2] = status[i][2]
  reply[base + 3] = p[1]
  reply[base + 4] = p[2]
  reply[base + 5] = p[3]
  reply[base + 6] = p[4]
  reply[base + 7] = p[5]
end
return reply
