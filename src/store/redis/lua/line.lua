-- tollgate: the critical reserve kept out of the schedule, a reserve tier's line per key.
-- Mirrors src/algorithm/line.rs, which explains it; kinds.lua calls these where
-- `decide_kinds` calls the Rust ones. A line is `{ u = until, uu = used_until, x = used }`:
-- instants relative to the key's now in the policy's unit (u = 0: no schedule), `used` in
-- requests. A tier's TAT is rate.lua's (`xn` whole units after now, `xf` count-ths); only the
-- rate script's policies have lines (a reserve runs on GCRA), and only prelude.lua's helpers
-- are used here, so the window and log scripts carry these functions unused.
--
-- Stored after the penalty boxes, per tier with a critical reserve: until (seconds, units),
-- used_until (seconds, units), used (all zeros for none).

local L = {}

-- `used` at `at`: 0 from `uu + used x T` on.
function L.used_at(t, l, at)
  if l.x == 0 then return 0 end
  local qn, qf = mad(l.x, t.p, 0, t.c)
  local back = l.uu + qn
  if back < at or (back == at and qf == 0) then return 0 end
  return l.x
end

-- Whether a critical request of `cost` may leave at `at` ahead of the schedule.
function L.admits(t, l, reserve, at, cost)
  return at < l.u and L.used_at(t, l, at) + cost <= reserve
end

-- The units of the reserve a critical request may take now on the line.
function L.room(t, l, reserve)
  if l.u > 0 then return max(0, reserve - L.used_at(t, l, 0)) end
  return 0
end

-- Whole emission intervals, rounded up, by which a TAT `(xn, xf)` is past now + tau_std.
local function past(t, reserve, xn, xf)
  if xn < 0 then return 0 end
  local q, r = mad(xn, t.c, xf, t.p)
  if r > 0 then q = q + 1 end
  return max(0, q - (t.b - reserve))
end

-- Units charged now ahead of the schedule: `(xn, xf)` the TAT after.
function L.taken(t, l, reserve, cost, xn, xf)
  if l.u <= 0 then return end
  local used = L.used_at(t, l, 0)
  local new = min(used + cost, max(used, past(t, reserve, xn, xf)))
  if new ~= used then l.x, l.uu = new, l.u end
end

-- A request of class `class` admitted to leave at `at`: `full`, whether the TAT alone admitted
-- it then; `(bn, bf)` the TAT before its charge, `t` the tier after it.
function L.charged(t, l, reserve, class, at, cost, full, bn, bf)
  if class ~= 0 then
    -- A lower class: one that waits joins the schedule, or starts it.
    if at <= 0 then return end
    if l.u <= 0 then l.x, l.uu = past(t, reserve, bn, bf), 0 end
    if at > l.u then l.u = at end
  elseif not full then
    l.x, l.uu = L.used_at(t, l, at) + cost, l.u
  elseif at > 0 then
    -- Critical, waiting behind the schedule: no room ahead of it until it leaves.
    if at > l.u then l.u = at end
    l.x, l.uu = reserve, l.u
  elseif l.u > 0 then
    L.taken(t, l, reserve, cost, t.xn, t.xf)
  end
end

-- The key's lines from the stored numbers after `raw[j]` (none: fresh), pruned at now
-- against the tiers' TATs; returns the position after them.
function L.load(st, raw, j)
  st.line = {}
  for _, tier in ipairs(st.pol.tiers) do
    local ln = tier.line
    if ln then
      local l = { u = 0, uu = 0, x = 0 }
      -- Stored zeros: none (an ended line is stored as it was, and forgotten when read).
      if raw and (raw[j + 1] ~= 0 or raw[j + 2] ~= 0) then
        l.u, l.uu, l.x = rel(st.c, raw[j + 1], raw[j + 2]), rel(st.c, raw[j + 3], raw[j + 4]), raw[j + 5]
      end
      if raw then j = j + 5 end
      st.line[ln.x] = l
    end
  end
  return j
end

-- The hooks kinds.lua calls, on a key's state `st` and a tier `tier` (nothing for a tier
-- without a line).

-- For a critical request of `cost` on `tier` (with a line), decided now or later: the
-- earliest instant at which the line admits it (`Line::back`), and when the schedule ends;
-- nil for none.
local function back(st, tier, class, cost)
  local ln = class == 0 and tier.line
  if not ln then return nil end
  local t, l = st.tiers[tier.r], st.line[ln.x]
  if L.admits(t, l, ln.reserve, 0, cost) then return 0, l.u end
  if l.x == 0 or cost > ln.reserve then return nil end
  local qn, qf = mad(l.x, t.p, 0, t.c)
  local b = l.uu + qn
  if qf > 0 then b = b + 1 end
  if b < l.u then return max(b, 0), l.u end
  return nil
end

-- A request's departure on `tier` from `from`: `e`, or for a critical one the line admits at
-- once, now (on the line a request leaves at once or not at all).
function L.depart(st, tier, class, from, cost, e)
  if from == 0 and back(st, tier, class, cost) == 0 then return 0 end
  return e
end

-- A refused request's own retry on `tier`: `e`, or the line's, if sooner.
function L.own(st, tier, class, cost, e)
  local b = back(st, tier, class, cost)
  if b and b < e then return b end
  return e
end

-- A refused critical request's retry (`retry`, -1 for none): sooner when a line admits it,
-- decided then, every other tier admitting it then too (`depart` is kinds.lua's, policing).
function L.retry(st, class, cost, rounds, retry, depart)
  if class ~= 0 or retry < 0 then return retry end
  local tiers, n, any = st.pol.tiers, st.pol.n, false
  for t = 1, n do
    if cost[t] > 0 and back(st, tiers[t], class, cost[t]) then any = true end
  end
  if not any then return retry end
  local at = 0
  for _ = 1, rounds do
    local nxt = at
    for t = 1, n do
      local c = cost[t]
      if c > 0 then
        local b, u = back(st, tiers[t], class, c)
        local e
        if b and max(at, b) < u then e = max(at, b) else e = depart(st, tiers[t], class, at, c, false) end
        if e > nxt then nxt = e end
      end
    end
    if nxt == at then
      if at > 0 and at < retry then return at end
      return retry
    end
    at = nxt
  end
  return retry
end

-- What a request of `class` is told is left on `tier`: a critical one may also take what the
-- line holds of the reserve.
function L.remaining(st, tier, class, remaining)
  local ln = class == 0 and tier.line
  if not ln then return remaining end
  return max(remaining, L.room(st.tiers[tier.r], st.line[ln.x], ln.reserve))
end

-- Charges `cost` at `at` to `tier` (which has a line) for a request of `class`, and the line
-- follows (`charged` above). Returns F.charge's entry id.
function L.charge(st, tier, class, at, cost)
  local ln, r = tier.line, st.tiers[tier.r]
  local full, bn, bf = F.earliest(st, r, at, cost) <= at, r.xn, r.xf
  local e = F.charge(st, r, at, cost)
  L.charged(r, st.line[ln.x], ln.reserve, class, at, cost, full, bn, bf)
  return e
end

-- Forgets what no longer matters (`Line::prune`, and a line whose tier's TAT is not after
-- now), once F has loaded the tiers; a line forgotten is written back, as the memory store
-- forgets it for good (which a clock stepping back can tell).
function L.prune(st)
  for _, tier in ipairs(st.pol.tiers) do
    local ln = tier.line
    if ln then
      local l, t = st.line[ln.x], st.tiers[tier.r]
      if l.u <= 0 or t.xn < 0 or (t.xn == 0 and t.xf == 0) then
        if l.u ~= 0 or l.x ~= 0 then st.dirty = true end
        l.u, l.uu, l.x = 0, 0, 0
      elseif l.x > 0 and L.used_at(t, l, 0) == 0 then
        l.x = 0
        st.dirty = true
      end
    end
  end
end

-- Appends the key's lines to `v`.
function L.save(st, v)
  for _, tier in ipairs(st.pol.tiers) do
    local ln = tier.line
    if ln then
      local l = st.line[ln.x]
      if l.u > 0 then
        local s, u = abs(st.c, l.u)
        local s2, u2 = abs(st.c, l.uu)
        v[#v + 1], v[#v + 2], v[#v + 3], v[#v + 4], v[#v + 5] = s, u, s2, u2, l.x
      else
        v[#v + 1], v[#v + 2], v[#v + 3], v[#v + 4], v[#v + 5] = 0, 0, 0, 0, 0
      end
    end
  end
end
