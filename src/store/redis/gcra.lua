-- tollgate, fast path: GCRA tiers whose emission intervals are whole nanoseconds (the common
-- case). Same decisions as limit.lua and the Rust algorithms, with one GET and one SET.
--
-- KEYS[1]  a string: every tier's TAT as absolute `sec:nsec`, comma-separated
-- ARGV     op ('check' | 'settle'), clock ('S' = server TIME | 'C'), now_sec, now_nsec,
--          ttl_grace_ms, ntiers, then T (ns) and tau (= T * burst, ns) per tier, then
--          for 'check': cost, max_delay (-1 = police)
--          for 'settle': old_cost, new_cost, at_sec, at_nsec
-- All values stay below 2^53 (the store refuses longer spans), so Lua's doubles are exact, and
-- below 10^14, so `tostring` writes them in full. GCRA needs no protection against a clock
-- stepping back: an earlier `now` only waits longer. Written for speed: no closures, no
-- per-tier tables but the reply, locals for library functions.

local call, tonumber, tostring, floor, ceil = redis.call, tonumber, tostring, math.floor, math.ceil
local A = ARGV
local now_s, now_n
if A[2] == 'S' then
  local t = call('TIME')
  now_s, now_n = tonumber(t[1]), tonumber(t[2]) * 1000
else
  now_s, now_n = tonumber(A[3]), tonumber(A[4])
end
local grace, n = tonumber(A[5]), tonumber(A[6])
local rest = 7 + 2 * n

-- TATs relative to now, in ns (0 for a fresh key), per tier.
local rel = {}
local raw = call('GET', KEYS[1])
if raw then
  local i = 1
  for s, ns in string.gmatch(raw, '(%d+):(%d+)') do
    rel[i] = (tonumber(s) - now_s) * 1e9 + (tonumber(ns) - now_n)
    i = i + 1
  end
end
for i = #rel + 1, n do rel[i] = 0 end

-- Writes the TATs (relative `r[i]`) back with a TTL of `ttl` ns plus the grace.
local function save(r, ttl)
  local out = {}
  for i = 1, n do
    local v = now_n + r[i]
    local s = floor(v / 1e9)
    if s * 1e9 > v then s = s - 1 elseif (s + 1) * 1e9 <= v then s = s + 1 end
    out[i] = tostring(now_s + s) .. ':' .. tostring(v - s * 1e9)
  end
  call('SET', KEYS[1], table.concat(out, ','), 'PX', ceil(ttl / 1e6) + grace)
end

if A[1] == 'settle' then
  local old, new = tonumber(A[rest]), tonumber(A[rest + 1])
  if not raw and new <= old then return { now_s, now_n } end
  local at = (tonumber(A[rest + 2]) - now_s) * 1e9 + (tonumber(A[rest + 3]) - now_n)
  if at < 0 then at = 0 end
  local ttl = 0
  for i = 1, n do
    local T = tonumber(A[5 + 2 * i])
    local r = rel[i]
    if new < old then
      r = r - (old - new) * T
    else
      if r < at then r = at end
      r = r + (new - old) * T
    end
    rel[i] = r
    if r > ttl then ttl = r end
  end
  if ttl > 0 then save(rel, ttl) else call('DEL', KEYS[1]) end
  return { now_s, now_n }
end

local cost, max_delay = tonumber(A[rest]), tonumber(A[rest + 1])
-- reply: outcome (1 allowed, 0 limited, 2 cost above capacity), delay, retry, now_s, now_n,
-- then per tier: remaining, reset, own retry (-1 none), violated, at_s, at_n, id (0).
-- While deciding, a tier's slots hold its T (j+1), tau (j+2) and earliest (j+3).
local reply = { 1, 0, -1, now_s, now_n }
local over, wait = false, 0
for i = 1, n do
  local j = 5 + (i - 1) * 7
  local T, tau = tonumber(A[5 + 2 * i]), tonumber(A[6 + 2 * i])
  local base = rel[i]
  if base < 0 then base = 0 end
  rel[i] = base
  local own = base + cost * T - tau
  if own < 0 then own = 0 end
  if cost * T > tau then over = true end
  if own > wait then wait = own end
  reply[j + 1], reply[j + 2], reply[j + 3], reply[j + 4] = T, tau, own, 0
  reply[j + 5], reply[j + 6], reply[j + 7] = 0, 0, 0
end

local budget = max_delay
if budget < 0 then budget = 0 end
if over then
  reply[1] = 2
elseif cost > 0 then
  if wait > budget then
    reply[1], reply[3] = 0, wait - budget
  else
    reply[2] = wait
    local ttl = 0
    for i = 1, n do
      local j = 5 + (i - 1) * 7
      local r = rel[i]
      if r < wait then r = wait end
      r = r + cost * reply[j + 1]
      rel[i] = r
      if r > ttl then ttl = r end
    end
    save(rel, ttl)
    -- The charge instant, absolute.
    local v = now_n + wait
    local s = floor(v / 1e9)
    if s * 1e9 > v then s = s - 1 elseif (s + 1) * 1e9 <= v then s = s + 1 end
    for i = 1, n do
      local j = 5 + (i - 1) * 7
      reply[j + 5], reply[j + 6] = now_s + s, v - s * 1e9
    end
  end
end

for i = 1, n do
  local j = 5 + (i - 1) * 7
  local T, tau, own = reply[j + 1], reply[j + 2], reply[j + 3]
  local b = rel[i]
  local q = floor((tau - b) / T)
  if q * T > tau - b then q = q - 1 elseif (q + 1) * T <= tau - b then q = q + 1 end
  if q < 0 then q = 0 end
  reply[j + 1], reply[j + 2], reply[j + 3] = q, b, -1
  if cost * T > tau then
    reply[j + 4] = 1
  elseif reply[1] == 0 and own > 0 then
    reply[j + 3], reply[j + 4] = own, 1
  end
end
return reply
