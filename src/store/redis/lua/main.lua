-- The driver: every check of the batch in order, all tiers of one check together (a rejected
-- request charges none), each key's state loaded once and written once. Mirrors
-- `decide` in src/algorithm/mod.rs.

local POL = policies(3)
local C = doubles(ARGV[3])
local STORED = stored(C, POL)
local cache, order = {}, {}
local CLOCK_GUARD = F.window or F.log

-- The earliest instant >= from at which tier `t` lets `cost` leave: when shaping, a leaky
-- bucket holds the request until the water ahead of it has drained (`TierState::departure`).
local function depart(st, t, from, cost, shaping)
  local e = F.earliest(st, t, from, cost)
  if shaping then e = e + F.queue_wait(st, t, e) end
  return e
end

local i = 1
while i <= #C do
  local op, k, pol = C[i], C[i + 1], POL[C[i + 2]]
  local n = pol.n
  local name = KEYS[k]
  -- One state per key, however many checks of the batch name it.
  local st = cache[name]
  if not st then
    local c = clock_of(pol.unit)
    st = { k = k, name = name, unit = pol.unit, grace = pol.grace, alg = pol.alg, n = n, tiers = {}, c = c }
    for t = 1, n do
      local p = pol.tiers[t]
      st.tiers[t] = { c = p.c, p = p.p, b = p.b }
    end
    local packed = STORED[name]
    local raw = nil
    if packed then
      raw = doubles(packed)
      -- [1], [2]: the guard, the instant of the last charge (or settlement). Time never goes
      -- back for a key: Redis's TIME can step back (NTP, a failover to a replica whose clock
      -- is behind), and a window would then be entered again as if empty. A key decides at
      -- the later of now and its guard.
      if CLOCK_GUARD and rel(c, raw[1], raw[2]) > 0 then
        st.c = { per = c.per, s = raw[1], u = raw[2] }
      end
      st.guard = { raw[1], raw[2] }
      table.remove(raw, 1)
      table.remove(raw, 1)
    end
    F.load(st, raw)
    cache[name] = st
    order[#order + 1] = st
  end
  local tiers = st.tiers
  if op ~= 1 then
    -- A settlement (op 2), or the lease of op 3 settling the node's previous lease first.
    local s = i + 3
    if op == 3 then s = i + 6 end
    local old, new = C[s], C[s + 1]
    -- A settlement that changes what was charged moves the guard, as a charge does.
    if new ~= old then st.charged = true end
    for t = 1, n do
      local j = s + 2 + (t - 1) * 3
      local at = rel(st.c, C[j], C[j + 1])
      if new < old then
        F.refund(st, tiers[t], at, C[j + 2], old, old - new)
      elseif new > old then
        F.charge(st, tiers[t], max(at, 0), new - old)
      end
    end
  end
  if op ~= 2 then
    local cost, max_delay = C[i + 3], C[i + 4]
    local useful = 0
    if op == 3 then
      -- A lease (fixed windows, GCRA and the buckets, policing): up to `max_delay` units (at
      -- least `cost`) of what every tier has now, a quarter of it at most, so that a key near
      -- its limit is leased a unit at a time; for the rate algorithms, up to `useful` units
      -- of what is there, however little (see gcra.lua).
      useful = C[i + 5]
      local avail = nil
      for t = 1, n do
        local remaining = F.status(st, tiers[t])
        if not avail or remaining < avail then avail = remaining end
      end
      local take = floor(avail / 4)
      if useful > take then
        take = useful
        if take > avail then take = avail end
      end
      if take > max_delay then take = max_delay end
      if take > cost then cost = take end
      max_delay = -1
    end
    local per = {}
    local over = false
    for t = 1, n do
      if cost > F.capacity(tiers[t]) then over = true end
    end
    local head
    if cost == 0 then
      -- A query: always admitted, charges nothing.
      for t = 1, n do per[t] = { -1, 0, 0 } end
      head = { 1, 0, -1 }
    elseif over then
      for t = 1, n do
        local v = 0
        if cost > F.capacity(tiers[t]) then v = 1 end
        per[t] = { -1, v, 0 }
      end
      head = { 2, 0, -1 }
    else
      -- The instant the request leaves: the earliest at which every tier admits it together,
      -- where every tier is charged (`converge` and `rounds` in src/algorithm/mod.rs).
      local shaping = max_delay >= 0
      local rounds = 2
      if F.entries then rounds = rounds + 2 * F.entries(st) end
      local at, settled = 0, false
      for _ = 1, rounds do
        local nxt = at
        for t = 1, n do nxt = max(nxt, depart(st, tiers[t], at, cost, shaping)) end
        if nxt == at then settled = true; break end
        at = nxt
      end
      local budget = max(max_delay, 0)
      if not settled or at > budget then
        for t = 1, n do
          local own = F.earliest(st, tiers[t], 0, cost)
          if own > 0 then per[t] = { own, 1, 0 } else per[t] = { -1, 0, 0 } end
        end
        local retry = 1
        if settled then retry = at - budget end
        head = { 0, 0, retry }
      else
        -- Charged at the instant the request leaves (after a leaky bucket's queue).
        st.charged = true
        for t = 1, n do per[t] = { -1, 0, F.charge(st, tiers[t], at, cost) } end
        head = { 1, at, -1 }
      end
    end
    out(head[1]); out(head[2]); out(head[3])
    for t = 1, n do
      local remaining, reset = F.status(st, tiers[t])
      local p = per[t]
      out(remaining); out(reset); out(p[1]); out(p[2]); out(p[3])
    end
    if op == 3 then
      -- When `useful` units will be there again (after this grant, or for a refusal), for the
      -- node to wait for (0: now).
      local hold = 0
      if useful > 0 and head[1] ~= 2 then
        for t = 1, n do hold = max(hold, F.earliest(st, tiers[t], 0, useful)) end
      end
      out(cost); out(hold)
    end
  end
  i = next_check(C, i, POL)
end

-- Write every changed state back, with a TTL equal to what it needs.
-- A settlement that changed nothing stored (a refund to a window that ended) still moves the
-- guard, as in memory.
for _, st in ipairs(order) do
  if st.dirty or (st.charged and CLOCK_GUARD) then
    local ttl = 0
    for t = 1, st.n do
      local _, reset = F.status(st, st.tiers[t])
      if reset > ttl then ttl = reset end
    end
    if ttl <= 0 then
      call('DEL', st.name)
      if F.drop then F.drop(st) end
    else
      local v = F.save(st)
      -- The guard moves with charges only: a refused check (or a query) that rewrote the state
      -- (pruned, a log rebased) keeps it, so a clock stepping back finds the key as the
      -- in-memory store does, which keeps no trace of refused checks.
      local guard = st.guard
      if st.charged or not guard then guard = { st.c.s, st.c.u } end
      table.insert(v, 1, guard[2])
      table.insert(v, 1, guard[1])
      -- Milliseconds below 1e14: Lua writes them exactly.
      local ms = ttl_ms(st.unit, ttl, st.grace)
      call('SET', st.name, pack(v), 'PX', ms)
      if F.expire then F.expire(st, ms) end
    end
  end
end

return finish()
