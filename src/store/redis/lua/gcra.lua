-- GCRA whose emission intervals are whole units (the common case): one string per key holding
-- every tier's TAT, read once and written once per batch, and no mixed-radix arithmetic. Makes
-- the decisions of rate.lua and src/algorithm/gcra.rs (`WholeGcra`).
-- A check: op, key index, unit, grace, algorithm (0), tiers, then T and tau (= T x burst) per
-- tier, then cost and the shaping budget (-1 polices), or for 'settle' the old and new cost
-- and the charge instant (seconds, units).

local cache, order = {}, {}

for a = 2, #ARGV do
  local f = doubles(ARGV[a])
  local op, k, unit, grace, n = f[1], f[2], f[3], f[4], f[6]
  local c = clock_of(unit)
  -- One state per key, however many checks of the batch name it (each by its own index).
  local st = cache[KEYS[k]]
  if not st then
    -- TATs relative to now (0 for a fresh key: GCRA only compares them with now).
    st = { k = k, unit = unit, grace = grace, n = n, c = c, tat = {} }
    local packed = call('GET', KEYS[k])
    if packed then
      local raw = doubles(packed)
      for i = 1, n do st.tat[i] = rel(c, raw[2 * i - 1], raw[2 * i]) end
    else
      for i = 1, n do st.tat[i] = 0 end
    end
    cache[KEYS[k]] = st
    order[#order + 1] = st
  end
  local tat = st.tat
  local rest = 7 + 2 * n
  if op == 2 then
    local old, new = f[rest], f[rest + 1]
    local at = max(rel(c, f[rest + 2], f[rest + 3]), 0)
    for i = 1, n do
      local T = f[5 + 2 * i]
      if new < old then
        tat[i] = tat[i] - (old - new) * T
      else
        tat[i] = max(tat[i], at) + (new - old) * T
      end
    end
    st.dirty = true
  else
    local cost, max_delay = f[rest], f[rest + 1]
    local budget = max(max_delay, 0)
    local over, wait = false, 0
    local own = {}
    for i = 1, n do
      local T, tau = f[5 + 2 * i], f[6 + 2 * i]
      if tat[i] < 0 then tat[i] = 0 end
      local o = tat[i] + cost * T - tau
      if o < 0 then o = 0 end
      own[i] = o
      if cost * T > tau then over = true end
      if o > wait then wait = o end
    end
    local outcome, delay, retry = 1, 0, -1
    if over then
      outcome = 2
    elseif cost > 0 then
      if wait > budget then
        outcome, retry = 0, wait - budget
      else
        delay = wait
        for i = 1, n do
          tat[i] = max(tat[i], wait) + cost * f[5 + 2 * i]
        end
        st.dirty = true
      end
    end
    out(outcome); out(delay); out(retry)
    for i = 1, n do
      local T, tau = f[5 + 2 * i], f[6 + 2 * i]
      local b = tat[i]
      local q = floor((tau - b) / T)
      if q * T > tau - b then q = q - 1 elseif (q + 1) * T <= tau - b then q = q + 1 end
      if q < 0 then q = 0 end
      out(q); out(b)
      if cost * T > tau then
        out(-1); out(1)
      elseif outcome == 0 and own[i] > 0 then
        out(own[i]); out(1)
      else
        out(-1); out(0)
      end
      out(0)
    end
  end
end

for _, st in ipairs(order) do
  if st.dirty then
    local ttl, v = 0, {}
    for i = 1, st.n do
      local r = st.tat[i]
      if r > ttl then ttl = r end
      v[2 * i - 1], v[2 * i] = abs(st.c, r)
    end
    if ttl > 0 then
      call('SET', KEYS[st.k], pack(v), 'PX', num(ttl_ms(st.unit, ttl, st.grace)))
    else
      call('DEL', KEYS[st.k])
    end
  end
end

out(now_s); out(now_ns)
return reply
