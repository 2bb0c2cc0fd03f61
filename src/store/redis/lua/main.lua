-- The driver: every check of the batch in order, all tiers of one check together (a rejected
-- request charges none), each key's state loaded once and written once. Mirrors
-- `decide` in src/algorithm/mod.rs.

local cache, order = {}, {}
local CLOCK_GUARD = F.window or F.log

for a = 2, #ARGV do
  local f = doubles(ARGV[a])
  local op, k, unit, grace, alg, n = f[1], f[2], f[3], f[4], f[5], f[6]
  -- One state per key, however many checks of the batch name it (each by its own index).
  local st = cache[KEYS[k]]
  if not st then
    local c = clock_of(unit)
    st = { k = k, unit = unit, grace = grace, alg = alg, n = n, tiers = {}, c = c }
    for i = 1, n do
      local j = 7 + (i - 1) * 3
      st.tiers[i] = { c = f[j], p = f[j + 1], b = f[j + 2] }
    end
    local packed = call('GET', KEYS[k])
    local raw = nil
    if packed then
      raw = doubles(packed)
      -- [1], [2]: the instant of the last write. Time never goes back for a key: Redis's TIME
      -- can step back (NTP, a failover to a replica whose clock is behind), and a window
      -- would then be entered again as if empty. A key decides at the later of now and its
      -- last write.
      if CLOCK_GUARD and rel(c, raw[1], raw[2]) > 0 then
        st.c = { per = c.per, s = raw[1], u = raw[2] }
      end
      table.remove(raw, 1)
      table.remove(raw, 1)
    end
    F.load(st, raw)
    cache[KEYS[k]] = st
    order[#order + 1] = st
  end
  local tiers = st.tiers
  local rest = 7 + n * 3
  if op == 2 then
    local old, new = f[rest], f[rest + 1]
    for i = 1, n do
      local j = rest + 2 + (i - 1) * 3
      local at = rel(st.c, f[j], f[j + 1])
      if new < old then
        F.refund(st, tiers[i], at, f[j + 2], old, old - new)
      elseif new > old then
        F.charge(st, tiers[i], max(at, 0), new - old)
      end
    end
  else
    local cost, max_delay = f[rest], f[rest + 1]
    local per = {}
    local over = false
    for i = 1, n do
      if cost > F.capacity(tiers[i]) then over = true end
    end
    local head
    if cost == 0 then
      -- A query: always admitted, charges nothing.
      for i = 1, n do per[i] = { -1, 0, 0 } end
      head = { 1, 0, -1 }
    elseif over then
      for i = 1, n do
        local v = 0
        if cost > F.capacity(tiers[i]) then v = 1 end
        per[i] = { -1, v, 0 }
      end
      head = { 2, 0, -1 }
    else
      -- The earliest instant every tier admits the request together.
      local t = 0
      for _ = 1, 64 do
        local nxt = t
        for i = 1, n do nxt = max(nxt, F.earliest(st, tiers[i], t, cost)) end
        if nxt == t then break end
        t = nxt
      end
      local queue = 0
      if max_delay >= 0 then
        for i = 1, n do queue = max(queue, F.queue_wait(st, tiers[i], t)) end
      end
      local wait = t + queue
      local budget = max(max_delay, 0)
      if wait > budget then
        for i = 1, n do
          local own = F.earliest(st, tiers[i], 0, cost)
          if own > 0 then per[i] = { own, 1, 0 } else per[i] = { -1, 0, 0 } end
        end
        head = { 0, 0, wait - budget }
      else
        -- Charged at the instant the request leaves (after a leaky bucket's queue).
        for i = 1, n do per[i] = { -1, 0, F.charge(st, tiers[i], wait, cost) } end
        head = { 1, wait, -1 }
      end
    end
    out(head[1]); out(head[2]); out(head[3])
    for i = 1, n do
      local remaining, reset = F.status(st, tiers[i])
      local p = per[i]
      out(remaining); out(reset); out(p[1]); out(p[2]); out(p[3])
    end
  end
end

-- Write every changed state back, with a TTL equal to what it needs.
for _, st in ipairs(order) do
  if st.dirty then
    local ttl = 0
    for i = 1, st.n do
      local _, reset = F.status(st, st.tiers[i])
      if reset > ttl then ttl = reset end
    end
    local key = KEYS[st.k]
    if ttl <= 0 then
      call('DEL', key)
      if F.drop then F.drop(st) end
    else
      local v = F.save(st)
      table.insert(v, 1, st.c.u)
      table.insert(v, 1, st.c.s)
      local ms = ttl_ms(st.unit, ttl, st.grace)
      call('SET', key, pack(v), 'PX', num(ms))
      if F.expire then F.expire(st, ms) end
    end
  end
end

out(now_s); out(now_ns)
return reply
