-- GCRA, token bucket and leaky bucket, as one core over an instant X in mixed radix (whole
-- units + frac/count): GCRA's X is its TAT, the token bucket's X the instant it is full again,
-- the leaky bucket's X the instant it is empty. Mirrors src/algorithm/{gcra,bucket}.rs.
-- State, per tier: X as (seconds, units), its fraction, and the bucket's last instant.
--
-- Where the shape differs from the Rust, and why. gcra.rs keeps the TAT scaled by `count`
-- (u128); here X = TAT / count, whole units and a fraction in count-ths: the same number, in
-- doubles that stay exact. bucket.rs keeps each bucket's level (`units x period`) at `last`;
-- here a bucket is the GCRA it is equivalent to, X = `last + (capacity - level) / count` for
-- the token bucket and `last + level / count` for the leaky one, so `earliest`, `charge` and
-- `status` are GCRA's for all three (`token::earliest`'s `need - at(from) <= 0` is
-- `max(X, from) + cost T - tau <= from`), `refund` caps X at `last` where bucket.rs caps the
-- level at its capacity (token) or 0 (leaky), and `queue_wait` is `X - at` where
-- `leaky::queue_wait` drains `at(t)`. That layout is what nodes of every version store and
-- read: a bucket kept as bucket.rs keeps it would change the state's keys, so a rolling deploy
-- would start every key afresh.

local F = { rate = true }

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

-- A tier's state, every field named (a table sized once).
function F.tier(p)
  return { c = p.c, p = p.p, b = p.b, xn = 0, xf = 0, last = 0 }
end

-- The tiers' state from the stored numbers after `raw[o]` (none: fresh).
function F.load(st, raw, o)
  local c = st.c
  for i = 1, st.n do
    local t = st.tiers[i]
    if raw then
      local j = o + (i - 1) * 5
      t.xn, t.xf, t.last = rel(c, raw[j + 1], raw[j + 2]), raw[j + 3], rel(c, raw[j + 4], raw[j + 5])
    else
      -- Fresh, far in the past (2^52 units before now: see gcra.lua's FRESH), as the memory
      -- store's fresh state is as of its epoch (`Core::fresh`): GCRA's TAT, and the instant a
      -- token bucket was full (a leaky bucket empty) with its last instant. A bucket fresh as
      -- of now would project backwards when the clock steps back, and refuse what a fresh key
      -- in memory admits.
      t.xn, t.xf, t.last = -4503599627370496, 0, -4503599627370496
    end
  end
end

-- Appends the tiers' state to `v`.
function F.save(st, v)
  local c = st.c
  for i = 1, st.n do
    local t = st.tiers[i]
    local xs, xu = abs(c, t.xn)
    local ls, lu = abs(c, t.last)
    v[#v + 1], v[#v + 2], v[#v + 3], v[#v + 4], v[#v + 5] = xs, xu, t.xf, ls, lu
  end
  return v
end

local function base(t, from)
  if mixed_less(t.xn, t.xf, from, 0) then return from, 0 end
  return t.xn, t.xf
end

function F.capacity(t)
  return t.b
end

function F.earliest(st, t, from, cost)
  local bn, bf = base(t, from)
  local qn, qf = times_t(t, cost)
  local nn, nf = mixed_add(bn, bf, qn, qf, t.c)
  local tn, tf = times_t(t, t.b)
  local an, af = mixed_sub(nn, nf, tn, tf, t.c)
  if not mixed_less(from, 0, an, af) then return from end
  if af > 0 then return an + 1 end
  return an
end

function F.charge(st, t, at, cost)
  local bn, bf = base(t, at)
  local qn, qf = times_t(t, cost)
  t.xn, t.xf = mixed_add(bn, bf, qn, qf, t.c)
  if st.alg ~= 0 and at > t.last then t.last = at end
  st.dirty = true
  return 0
end

function F.refund(st, t, at, id, charged, cost)
  local qn, qf = times_t(t, cost)
  t.xn, t.xf = mixed_sub(t.xn, t.xf, qn, qf, t.c)
  if st.alg ~= 0 and mixed_less(t.xn, t.xf, t.last, 0) then t.xn, t.xf = t.last, 0 end
  st.dirty = true
end

function F.queue_wait(st, t, at)
  if st.alg ~= 2 or not mixed_less(at, 0, t.xn, t.xf) then return 0 end
  local wn, wf = mixed_sub(t.xn, t.xf, at, 0, t.c)
  if wf > 0 then return wn + 1 end
  return wn
end

function F.status(st, t)
  local en, ef = base(t, 0)
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
