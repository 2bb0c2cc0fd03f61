-- tollgate: the part every script but gcra.lua shares. A script decides a batch of checks
-- (and settles tickets) in order, at one instant, atomically; the Rust algorithms
-- (src/algorithm) are the reference and this makes the same decisions.
--
-- Time is counted in the policy's unit (1 ns, or 1 us for policies with long spans) relative
-- to `now`: Redis Lua numbers are doubles, exact for integers below 2^53, and every span the
-- store accepts is below 2^50 units. Stored instants are absolute `(seconds, units within the
-- second)` pairs; state is packed binary (struct.pack of little-endian doubles), so nothing is
-- parsed from or formatted to decimal text.
--
-- ARGV[1] struct '<ddd': clock (0 = the server's TIME, 1 = given), seconds, nanoseconds
-- ARGV[2], ARGV[3], KEYS: the policies, the records and their keys (see kinds.lua)

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

-- Packs the numbers of `t` (in chunks: unpack() returns at most a few thousand values).
local function pack(t, n)
  n = n or #t
  if n <= 4000 then return spack(fmt(n), unpack(t, 1, n)) end
  local parts = {}
  for i = 1, n, 4000 do
    local j = min(i + 3999, n)
    parts[#parts + 1] = spack(fmt(j - i + 1), unpack(t, i, j))
  end
  return table.concat(parts)
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
  local x = a * b + d
  if x < 4503599627370496 then
    -- Below 2^52: x and q * c (at most x + c < 2^53) are exact doubles; one correction at most.
    local q = floor(x / c)
    local r = x - q * c
    if r < 0 then return q - 1, r + c elseif r >= c then return q + 1, r - c end
    return q, r
  end
  local q = floor(x / c)
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

local reply, nreply = {}, 0
local function out(v)
  nreply = nreply + 1
  reply[nreply] = v
end

-- The reply: every number out() gave, then the instant decided at.
local function finish()
  out(now_s)
  out(now_ns)
  return pack(reply, nreply)
end

-- Every key the checks name, once, with its stored value (one MGET): name -> value or false.
-- `step` finds the next check.
local function stored(C, POL, step)
  local names, seen, i = {}, {}, 1
  while i <= #C do
    local name = KEYS[C[i + 1]]
    if not seen[name] then
      seen[name] = true
      names[#names + 1] = name
    end
    i = step(C, i, POL)
  end
  local values = call('MGET', unpack(names))
  local out = {}
  for j = 1, #names do out[names[j]] = values[j] end
  return out
end
