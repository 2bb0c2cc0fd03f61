-- Fixed window and sliding window counter: windows of `period` aligned to the Unix epoch, by
-- absolute index, with the units counted in each. Mirrors src/algorithm/window.rs.
-- State: per tier the number of windows kept, then (index, used) per window.

local F = { window = true }

-- The absolute index of the window `now` falls in, and the units since it started.
local function window_clock(st, t)
  if not t.kn then t.kn, t.en = mad(st.c.s, st.c.per, st.c.u, t.p) end
end

local function index_of(t, r)
  return t.kn + idiv(t.en + r, t.p)
end

local function start_of(t, k)
  return (k - t.kn) * t.p - t.en
end

local function used(t, k)
  return t.w[k] or 0
end

function F.tier(p)
  return { c = p.c, p = p.p, b = p.b, kn = false, en = false, w = false }
end

function F.load(st, raw, o)
  local j = o
  for i = 1, st.n do
    local t = st.tiers[i]
    window_clock(st, t)
    t.w = {}
    if raw then
      j = j + 1
      for _ = 1, raw[j] do
        t.w[raw[j + 1]] = raw[j + 2]
        j = j + 2
      end
    end
    local keep = t.kn
    if st.alg == 4 then keep = t.kn - 1 end
    for k in pairs(t.w) do
      if k < keep then t.w[k] = nil; st.dirty = true end
    end
  end
end

function F.save(st, v)
  for i = 1, st.n do
    local t = st.tiers[i]
    local at = #v + 1
    v[at] = 0
    for k, n in pairs(t.w) do
      v[#v + 1], v[#v + 2] = k, n
      v[at] = v[at] + 1
    end
  end
  return v
end

function F.capacity(t)
  return t.c
end

function F.earliest(st, t, from, cost)
  local k = index_of(t, from)
  while true do
    if st.alg == 3 then
      if used(t, k) + cost <= t.c then return max(from, start_of(t, k)) end
    else
      local prev, cur = used(t, k - 1), used(t, k)
      if cur + cost <= t.c then
        local room = t.c - cur - cost
        local e_min = 0
        if prev > 0 and room < prev then
          e_min = t.p - mad(room, t.p, 0, prev)
        end
        if e_min < t.p then return max(from, start_of(t, k) + e_min) end
      end
    end
    k = k + 1
  end
end

function F.charge(st, t, at, cost)
  local k = index_of(t, at)
  t.w[k] = used(t, k) + cost
  st.dirty = true
  return 0
end

function F.refund(st, t, at, id, charged, cost)
  local k = index_of(t, at)
  if t.w[k] then
    t.w[k] = t.w[k] - min(t.w[k], cost)
    if t.w[k] == 0 then t.w[k] = nil end
    st.dirty = true
  end
end

function F.queue_wait(st, t, at)
  return 0
end

-- The windows counted in, over every tier: what bounds the rounds of a joint departure
-- (`rounds` in src/algorithm/mod.rs).
function F.entries(st)
  local count = 0
  for i = 1, st.n do
    for _ in pairs(st.tiers[i].w) do count = count + 1 end
  end
  return count
end

function F.status(st, t)
  local last = nil
  for k in pairs(t.w) do
    if not last or k > last then last = k end
  end
  local lookback = 0
  if st.alg == 4 then lookback = 1 end
  local reset = 0
  if last then reset = max(0, start_of(t, last + 1 + lookback)) end
  local remaining
  if st.alg == 3 then
    remaining = max(0, t.c - used(t, t.kn))
  else
    local prev = used(t, t.kn - 1)
    local part = 0
    if prev > 0 then part = mad(prev, t.en, 0, t.p) end
    remaining = max(0, t.c - used(t, t.kn) - prev + part)
  end
  return remaining, reset
end
