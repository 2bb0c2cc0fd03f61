-- tollgate: the part every script shares. A script decides a batch of checks (and settles
-- tickets) in order, at one instant, atomically; the Rust algorithms (src/algorithm) are the
-- reference and this makes the same decisions.
--
-- Time is counted in the policy's unit (1 ns, or 1 us for policies with long spans) relative
-- to `now`: Redis Lua numbers are doubles, exact for integers below 2^53, and every span the
-- store accepts is below 2^50 units. Stored instants are absolute `(seconds, units within the
-- second)` pairs; state is packed binary (struct.pack of little-endian doubles), so nothing is
-- parsed from or formatted to decimal text.
--
-- KEYS    the keys of the checks (each check says where its own start)
-- ARGV[1] struct '<ddd': clock (0 = the server's TIME, 1 = given), seconds, nanoseconds
-- ARGV[n] one check each, struct '<d...': op (1 check, 2 settle), key index, unit (ns),
--         ttl grace (ms), algorithm, tiers, the tiers' parameters, then the op's arguments
-- reply   per check: for 'check' outcome (1 allowed, 0 limited, 2 cost above capacity), delay,
--         retry (-1 none), then per tier remaining, reset, own retry (-1 none), violated, entry
--         id; nothing for 'settle'. Durations in units from the unit `now` falls in; then,
--         last, the instant decided at: seconds, nanoseconds.

local call, tonumber, floor, ceil, max, min = redis.call, tonumber, math.floor, math.ceil, math.max, math.min
local sunpack, spack, srep, sformat = struct.unpack, struct.pack, string.rep, string.format

-- An integer as a command argument: Lua's own conversion keeps 14 digits only.
local function num(x)
  return sformat('%.0f', x)
end

local now_s, now_ns
do
  local flag, s, ns = sunpack('<ddd', ARGV[1])
  if flag == 0 then
    local t = call('TIME')
    now_s, now_ns = tonumber(t[1]), tonumber(t[2]) * 1000
  else
    now_s, now_ns = s, ns
  end
end

-- struct formats of n doubles, made once per size.
local FMT = {}
local function fmt(n)
  local f = FMT[n]
  if not f then
    f = '<' .. srep('d', n)
    FMT[n] = f
  end
  return f
end

-- The doubles of a packed string (struct.unpack also returns the next position: dropped).
local function doubles(s)
  local t = { sunpack(fmt(#s / 8), s) }
  t[#t] = nil
  return t
end

local function pack(t)
  return spack(fmt(#t), unpack(t))
end

local B = 16777216 -- 2^24

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
    local c = floor(l[i] / B)
    l[i] = l[i] - c * B
    l[i + 1] = l[i + 1] + c
  end
  return l
end

-- floor((a*b + d) / c) and the remainder, exactly (quotient below 2^53, c below 2^51).
local function mad(a, b, d, c)
  local q = floor((a * b + d) / c)
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
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

-- The clock of one policy unit: units per second, and `now` as (seconds, units within it).
local CLOCKS = {}
local function clock_of(unit)
  local c = CLOCKS[unit]
  if not c then
    local per = 1e9 / unit
    c = { per = per, s = now_s, u = floor(now_ns / unit) }
    CLOCKS[unit] = c
  end
  return c
end

-- A stored absolute instant (s, u) relative to the clock's now, in units.
local function rel(c, s, u)
  return (s - c.s) * c.per + (u - c.u)
end

-- The absolute (s, u) of an instant `r` units after the clock's now.
local function abs(c, r)
  local v = c.u + r
  local s = idiv(v, c.per)
  return c.s + s, v - s * c.per
end

-- A TTL in milliseconds for a state that is full again `units` after now, plus the grace.
local function ttl_ms(unit, units, grace)
  return ceil(units * unit / 1e6) + grace
end

local reply = {}
local function out(v)
  reply[#reply + 1] = v
end
