-- tollgate: GCRA whose emission intervals are whole units (the common case), as one
-- self-contained script: one string per key holding every tier's TAT, read once and written
-- once per batch, and no mixed-radix arithmetic. Makes the decisions of rate.lua and
-- src/algorithm/gcra.rs (`WholeGcra`), with the arguments and reply of prelude.lua (see there).
--
-- Written for Redis's time: it leaves out the shared prelude, whose two dozen helper functions
-- and tables a script call creates on every call (a Lua closure or table is an allocation,
-- and this script runs on every check and lease call of the GCRA policies), and it allocates
-- per call only its argument and reply tables, two per policy and one per key. It reads a
-- single key with GET (the common case: one check or one lease call), several with one MGET.
--
-- Records: op 1 a check, op 2 a settlement (per tier the old and new cost, the charge's
-- instant and entry id, as kinds.lua's), op 3 a lease, op 4 a lease of the key's schedule
-- (op 3's record and one more number, the horizon: see `Prepared::lease_ahead`).

local call, floor, ceil, max, tonumber = redis.call, math.floor, math.ceil, math.max, tonumber
local sunpack, spack, srep = struct.unpack, struct.pack, string.rep

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

-- The batch's policies (ARGV[2]: unit, ttl grace, algorithm, tiers, then per tier T and tau,
-- in units): per policy its tiers' T and tau, and its clock (units per second, and the unit
-- of its second that now falls in).
local POL = {}
do
  local a = ARGV[2]
  local P = { sunpack('<' .. srep('d', #a / 8), a) }
  local i, np = 1, #P - 1 -- struct.unpack's last value is the next position
  while i <= np do
    local unit, n = P[i], P[i + 3]
    local T, tau = {}, {}
    for t = 1, n do
      T[t], tau[t] = P[i + 2 + 2 * t], P[i + 3 + 2 * t]
    end
    POL[#POL + 1] = { unit = unit, grace = P[i + 1], n = n, T = T, tau = tau,
                      per = 1e9 / unit, u = floor(now_ns / unit) }
    i = i + 4 + 2 * n
  end
end

local C = { sunpack('<' .. srep('d', #ARGV[3] / 8), ARGV[3]) }
local nc = #C - 1

-- Every key the checks name, with its stored value (false when absent).
local STORED = {}
do
  local names, i = {}, 1
  while i <= nc do
    local name = KEYS[C[i + 1]]
    if STORED[name] == nil then
      STORED[name] = false
      names[#names + 1] = name
    end
    local op = C[i]
    if op == 1 then i = i + 5
    elseif op == 2 then i = i + 3 + 5 * POL[C[i + 2]].n
    elseif op == 3 then i = i + 8 + 3 * POL[C[i + 2]].n
    else i = i + 9 + 3 * POL[C[i + 2]].n end
  end
  if #names == 1 then
    STORED[names[1]] = call('GET', names[1])
  elseif #names > 1 then
    local values = call('MGET', unpack(names))
    for j = 1, #names do STORED[names[j]] = values[j] end
  end
end

local reply, nreply = {}, 0
-- Per key (by name): its TATs relative to now, its policy, and whether it changed. A fresh
-- key's TATs are far in the past (2^52 units before now), not now: a tier left fresh beside
-- one that is charged is written so, and a clock that later steps back finds it in the past,
-- as the memory store's TAT of 0 is (a TAT of now would refuse until the clock caught up).
local FRESH = -4503599627370496
local TAT, KPOL, DIRTY, order = {}, {}, {}, {}

local i = 1
while i <= nc do
  local op, pol = C[i], POL[C[i + 2]]
  local n, Ts, taus = pol.n, pol.T, pol.tau
  local name = KEYS[C[i + 1]]
  local tat = TAT[name]
  if not tat then
    tat = {}
    local packed = STORED[name]
    if packed then
      -- Absolute (seconds, units) pairs, made relative to now.
      local raw = { sunpack('<' .. srep('d', #packed / 8), packed) }
      local per, u = pol.per, pol.u
      for t = 1, n do tat[t] = (raw[2 * t - 1] - now_s) * per + (raw[2 * t] - u) end
    else
      for t = 1, n do tat[t] = FRESH end
    end
    TAT[name], KPOL[name] = tat, pol
    order[#order + 1] = name
  end
  if op == 2 then
    -- A settlement, tier by tier (equal costs settle nothing).
    for t = 1, n do
      local j = i + 3 + 5 * (t - 1)
      local old, new = C[j], C[j + 1]
      if old ~= new then
        local at = (C[j + 2] - now_s) * pol.per + (C[j + 3] - pol.u)
        if at < 0 then at = 0 end
        if new < old then
          tat[t] = tat[t] - (old - new) * Ts[t]
        else
          tat[t] = max(tat[t], at) + (new - old) * Ts[t]
        end
        DIRTY[name] = true
      end
    end
  elseif op ~= 1 then
    -- The lease of op 3 or 4 settling the node's previous lease first.
    local s = i + 6
    local old, new = C[s], C[s + 1]
    if old ~= new then
      -- Every tier was charged at the same instant.
      local at = (C[s + 2] - now_s) * pol.per + (C[s + 3] - pol.u)
      if at < 0 then at = 0 end
      for t = 1, n do
        local T = Ts[t]
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
    i = i + 3 + 5 * n
  else
    local cost, budget = C[i + 3], C[i + 4]
    local useful, ahead, horizon = 0, false, 0
    if op >= 3 then
      -- A lease: up to `budget` units (at least `cost`) of what every tier has now, a quarter
      -- of it at most, so that a key near its limit is leased a unit at a time; but up to
      -- `useful` units of what is there, however little, so that a node at the key's rate
      -- takes what accumulated since the last call instead of a few units per call.
      local block = budget
      budget = 0
      useful = C[i + 5]
      if op == 4 then horizon = C[i + 8 + 3 * n] end
      local avail = nil
      for t = 1, n do
        local T = Ts[t]
        local b = tat[t]
        if b < 0 then b = 0 end
        local room = taus[t] - b
        local q = floor(room / T)
        if q * T > room then q = q - 1 elseif (q + 1) * T <= room then q = q + 1 end
        if not avail or q < avail then avail = q end
      end
      local take = floor(avail / 4)
      if useful > take then
        take = useful
        if take > avail then take = avail end
      end
      if take > block then take = block end
      if op == 4 and take < useful then
        -- A lease of the key's schedule (op 4): a useful block of the units that come next,
        -- also those that conform only later, as long as the block's last unit conforms
        -- within `horizon` of now on every tier. The node spends each unit only once it
        -- conforms, so each is admitted as an exact check at its own instant would be (on a
        -- tier that does not limit the key, up to about one unit ahead: `b + cost x T` is
        -- charged from the tier's own TAT, without exact GCRA's step up to the instant).
        local fut = useful
        if fut > block then fut = block end
        if fut >= cost then
          ahead = true
          for t = 1, n do
            local b = tat[t]
            if b < 0 then b = 0 end
            if b + fut * Ts[t] - taus[t] > horizon then ahead = false end
          end
          if ahead then take = fut end
        end
      end
      if take > cost then cost = take end
    end
    if budget < 0 then budget = 0 end
    local over, wait = false, 0
    -- (A TAT in the past stays as it is: a later settlement charges from the later of it and
    -- its charge's instant, as the memory store does.)
    for t = 1, n do
      local T, tau = Ts[t], taus[t]
      local b = tat[t]
      if b < 0 then b = 0 end
      local o = b + cost * T - tau
      if o > wait then wait = o end
      if cost * T > tau then over = true end
    end
    local outcome, delay, retry = 1, 0, -1
    if over then
      outcome = 2
    elseif ahead then
      -- Each tier from its own TAT: the node paces the units per tier.
      for t = 1, n do
        if tat[t] < 0 then tat[t] = 0 end
        tat[t] = tat[t] + cost * Ts[t]
      end
      DIRTY[name] = true
    elseif cost > 0 then
      if wait > budget then
        outcome, retry = 0, wait - budget
      else
        delay = wait
        for t = 1, n do
          local b = tat[t]
          if b < wait then b = wait end
          tat[t] = b + cost * Ts[t]
        end
        DIRTY[name] = true
      end
    end
    local r = nreply
    reply[r + 1], reply[r + 2], reply[r + 3] = outcome, delay, retry
    r = r + 3
    for t = 1, n do
      local T, tau = Ts[t], taus[t]
      local b = tat[t]
      if b < 0 then b = 0 end
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
    if op >= 3 then
      -- When `useful` units will be there again (after this grant, or for a refusal), for the
      -- node to wait for (0: now); for op 4, when a useful block fits the horizon again.
      local hold = 0
      if useful > 0 and outcome ~= 2 then
        for t = 1, n do
          local b = tat[t]
          if b < 0 then b = 0 end
          local h = b + useful * Ts[t] - taus[t] - horizon
          if h > hold then hold = h end
        end
      end
      reply[r + 1], reply[r + 2] = cost, hold
      r = r + 2
      if op == 3 then i = i + 8 + 3 * n else i = i + 9 + 3 * n end
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
    local per = pol.per
    local ttl, v = 0, {}
    for t = 1, pol.n do
      local rt = tat[t]
      if rt > ttl then ttl = rt end
      local u = pol.u + rt
      local s = floor(u / per)
      if s * per > u then s = s - 1 elseif (s + 1) * per <= u then s = s + 1 end
      v[2 * t - 1], v[2 * t] = now_s + s, u - s * per
    end
    if ttl > 0 then
      -- Milliseconds below 1e14: Lua writes them exactly.
      call('SET', name, spack('<' .. srep('d', 2 * pol.n), unpack(v)), 'PX', ceil(ttl * pol.unit / 1e6) + pol.grace)
    else
      call('DEL', name)
    end
  end
end

-- The reply: the checks' numbers, then the instant decided at (in chunks: unpack() returns at
-- most a few thousand values).
reply[nreply + 1], reply[nreply + 2] = now_s, now_ns
nreply = nreply + 2
if nreply <= 4000 then return spack('<' .. srep('d', nreply), unpack(reply, 1, nreply)) end
local parts = {}
for j = 1, nreply, 4000 do
  local k = j + 3999
  if k > nreply then k = nreply end
  parts[#parts + 1] = spack('<' .. srep('d', k - j + 1), unpack(reply, j, k))
end
return table.concat(parts)
