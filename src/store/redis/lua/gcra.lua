-- GCRA whose emission intervals are whole units (the common case): one string per key holding
-- every tier's TAT, read once and written once per batch, and no mixed-radix arithmetic. Makes
-- the decisions of rate.lua and src/algorithm/gcra.rs (`WholeGcra`).
-- A policy's tier parameters: T and tau (= T x burst), in units. Written for speed: the
-- per-check work allocates nothing but the key's state, once per key.

local POL = policies(2)
local C = doubles(ARGV[3])
local STORED = stored(C, POL)
-- Per key (by name): its TATs relative to now (0 for a fresh key: GCRA only compares them
-- with now), its policy, and whether it changed.
local TAT, KPOL, DIRTY, order = {}, {}, {}, {}
local nc = #C

local i = 1
while i <= nc do
  local op, pol = C[i], POL[C[i + 2]]
  local n, tiers = pol.n, pol.tiers
  local name = KEYS[C[i + 1]]
  local tat = TAT[name]
  if not tat then
    tat = {}
    local packed = STORED[name]
    local c = clock_of(pol.unit)
    if packed then
      local raw = doubles(packed)
      for t = 1, n do tat[t] = (raw[2 * t - 1] - c.s) * c.per + (raw[2 * t] - c.u) end
    else
      for t = 1, n do tat[t] = 0 end
    end
    TAT[name], KPOL[name] = tat, pol
    order[#order + 1] = name
  end
  if op ~= 1 then
    -- A settlement (op 2), or the lease of op 3 settling the node's previous lease first.
    local s = i + 3
    if op == 3 then s = i + 6 end
    local old, new = C[s], C[s + 1]
    if old ~= new then
      -- Every tier was charged at the same instant.
      local c = clock_of(pol.unit)
      local at = (C[s + 2] - c.s) * c.per + (C[s + 3] - c.u)
      if at < 0 then at = 0 end
      for t = 1, n do
        local T = tiers[t].T
        if new < old then
          tat[t] = tat[t] - (old - new) * T
        else
          tat[t] = max(tat[t], at) + (new - old) * T
        end
      end
      DIRTY[name] = true
    end
  end
  if op == 2 then
    i = i + 5 + 3 * n
  else
    local cost, budget = C[i + 3], C[i + 4]
    local useful = 0
    if op == 3 then
      -- A lease: up to `budget` units (at least `cost`) of what every tier has now, a quarter
      -- of it at most, so that a key near its limit is leased a unit at a time; but up to
      -- `useful` units of what is there, however little, so that a node at the key's rate
      -- takes what accumulated since the last call instead of a few units per call.
      local block = budget
      budget = 0
      useful = C[i + 5]
      local avail = nil
      for t = 1, n do
        local tier = tiers[t]
        local b = tat[t]
        if b < 0 then b = 0 end
        local room = tier.tau - b
        local q = floor(room / tier.T)
        if q * tier.T > room then q = q - 1 elseif (q + 1) * tier.T <= room then q = q + 1 end
        if not avail or q < avail then avail = q end
      end
      local take = floor(avail / 4)
      if useful > take then
        take = useful
        if take > avail then take = avail end
      end
      if take > block then take = block end
      if take > cost then cost = take end
    end
    if budget < 0 then budget = 0 end
    local over, wait = false, 0
    for t = 1, n do
      local tier = tiers[t]
      if tat[t] < 0 then tat[t] = 0 end
      local o = tat[t] + cost * tier.T - tier.tau
      if o > wait then wait = o end
      if cost * tier.T > tier.tau then over = true end
    end
    local outcome, delay, retry = 1, 0, -1
    if over then
      outcome = 2
    elseif cost > 0 then
      if wait > budget then
        outcome, retry = 0, wait - budget
      else
        delay = wait
        for t = 1, n do
          local b = tat[t]
          if b < wait then b = wait end
          tat[t] = b + cost * tiers[t].T
        end
        DIRTY[name] = true
      end
    end
    local r = nreply
    reply[r + 1], reply[r + 2], reply[r + 3] = outcome, delay, retry
    r = r + 3
    for t = 1, n do
      local tier = tiers[t]
      local T, tau = tier.T, tier.tau
      local b = tat[t]
      local room = tau - b
      local q = floor(room / T)
      if q * T > room then q = q - 1 elseif (q + 1) * T <= room then q = q + 1 end
      if q < 0 then q = 0 end
      local own, violated = -1, 0
      if cost * T > tau then
        violated = 1
      elseif outcome == 0 then
        -- The tier's own wait, on the state before this check (unchanged: it was refused).
        local o = b + cost * T - tau
        if o > 0 then own, violated = o, 1 end
      end
      reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] = q, b, own, violated, 0
      r = r + 5
    end
    if op == 3 then
      -- When `useful` units will be there again (after this grant, or for a refusal), for the
      -- node to wait for (0: now).
      local hold = 0
      if useful > 0 and outcome ~= 2 then
        for t = 1, n do
          local tier = tiers[t]
          local h = tat[t] + useful * tier.T - tier.tau
          if h > hold then hold = h end
        end
      end
      reply[r + 1], reply[r + 2] = cost, hold
      r = r + 2
      i = i + 8 + 3 * n
    else
      i = i + 5
    end
    nreply = r
  end
end

for j = 1, #order do
  local name = order[j]
  if DIRTY[name] then
    local pol, tat = KPOL[name], TAT[name]
    local c = clock_of(pol.unit)
    local ttl, v = 0, {}
    for t = 1, pol.n do
      local rt = tat[t]
      if rt > ttl then ttl = rt end
      local u = c.u + rt
      local s = floor(u / c.per)
      if s * c.per > u then s = s - 1 elseif (s + 1) * c.per <= u then s = s + 1 end
      v[2 * t - 1], v[2 * t] = c.s + s, u - s * c.per
    end
    if ttl > 0 then
      -- Milliseconds below 1e14: Lua writes them exactly.
      call('SET', name, pack(v), 'PX', ceil(ttl * pol.unit / 1e6) + pol.grace)
    else
      call('DEL', name)
    end
  end
end

return finish()
