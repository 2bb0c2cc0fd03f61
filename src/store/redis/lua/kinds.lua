-- The driver of policies of several kinds: rate tiers (run by the family's F, as in main.lua),
-- calendar tiers and concurrency tiers, all or nothing in one check. Mirrors `decide_kinds`
-- in src/algorithm/mod.rs and src/algorithm/calendar.rs.
--
-- ARGV[2] per policy: unit, grace, algorithm, tiers, then per tier 9 numbers: kind (0 rate,
--         1 concurrency, 2 calendar) and its parameters: a rate's count, period, burst; a
--         concurrency tier's slots and lease (ms); a calendar tier's count; then its penalty
--         box: block (units; 0 for none), refusals, window (units); then its reserves
--         (`Reserve`): critical and standard units (0 for none).
-- ARGV[3] every record starts op, key index, policy index, record length:
--         op 1, a check: budget (-1 polices), lease id, each tier's cost, the request's class
--           (`Priority`: 0 critical, 1 standard, 2 sheddable), then per calendar
--           tier the bounds of its windows (their number, then the seconds: each window's
--           start and the last one's end), from before `now` to after it, and for a shaped
--           check (budget >= 0) the lookahead after that;
--         op 2, a settlement: release (1 gives the slots back), then per tier the old and new
--           cost, the charge's instant (seconds, units) and entry id (the lease id for a
--           concurrency tier), then the calendar bounds as for a shaped check, then per calendar
--           tier the start and end (seconds) of the window holding its charge's instant;
--         op 4, a refresh: lease id, then per concurrency tier its slots.
-- KEYS    per record: the state key, the sliding-log sets of the rate tiers (log family
--         only), the lease sets of the concurrency tiers (`{state}:c1`, ...).
-- State   `(seconds, units)` of the last charge (see main.lua), per calendar tier its windows (number, then
--         start, end, used), per tier with a penalty box whether the key is blocked (0 or 1),
--         until when (seconds, units), and the breaches counted (number, then each one's
--         seconds and units), then the rate tiers' state as F packs it. Concurrency slots live
--         in their sorted sets: one member per slot, `struct '<dd' (lease id, slot)`, scored
--         by the lease's expiry (ms since the epoch); expired members are dropped first.
-- reply   per check as main.lua's (a concurrency tier's reset is left to the binding, which
--         knows the typical hold); per refresh, 1 or 0 per concurrency tier (every slot was
--         still leased); nothing per settlement.

-- Windows a shaped request may be reserved in (calendar::LOOKAHEAD).
local LOOKAHEAD = 8

local function kpolicies()
  local P = doubles(ARGV[2])
  local out, i = {}, 1
  while i <= #P do
    local n = P[i + 3]
    local tiers, nrate, nconc, ncal, npen = {}, 0, 0, 0, 0
    for t = 1, n do
      local j = i + 4 + (t - 1) * 9
      local kind = P[j]
      local tier = { kind = kind }
      if P[j + 4] > 0 then
        npen = npen + 1
        tier.pen = { block = P[j + 4], after = P[j + 5], within = P[j + 6], x = npen }
      end
      if kind == 0 then
        nrate = nrate + 1
        tier.c, tier.p, tier.b, tier.r = P[j + 1], P[j + 2], P[j + 3], nrate
        -- What a reserve withholds from each class (`Reserve::withheld_from`), by class + 1.
        if P[j + 7] + P[j + 8] > 0 then
          tier.withheld = { 0, P[j + 7], P[j + 7] + P[j + 8] }
        end
      elseif kind == 1 then
        nconc = nconc + 1
        tier.max, tier.lease, tier.q = P[j + 1], P[j + 2], nconc
      else
        ncal = ncal + 1
        tier.count, tier.w = P[j + 1], ncal
      end
      tiers[t] = tier
    end
    -- Lean: loading the key's state changes nothing stored (rate.lua's F prunes nothing).
    local lean = F.rate == true and ncal == 0 and npen == 0
    out[#out + 1] = { unit = P[i], grace = P[i + 1], alg = P[i + 2], n = n, tiers = tiers,
                      nrate = nrate, nconc = nconc, ncal = ncal, npen = npen, lean = lean }
    i = i + 4 + n * 9
  end
  return out
end

local POL = kpolicies()
local C = doubles(ARGV[3])
local STORED = stored(C, POL, function(C, i) return i + C[i + 3] end)
local cache, order = {}, {}

-- A calendar bound (seconds) relative to the key's now, in units.
local function brel(c, b)
  return (b - c.s) * c.per - c.u
end

-- The key's now in milliseconds since the epoch (lease expiries).
local function now_ms(st)
  return st.c.s * 1000 + floor(st.c.u * st.unit / 1e6)
end

local function load(k, pol)
  local name = KEYS[k]
  local c = clock_of(pol.unit)
  -- Every field named in the constructor: a table sized once (one per key per batch), not
  -- grown field by field.
  local st = { k = k, name = name, unit = pol.unit, grace = pol.grace, n = pol.n, pol = pol,
               c = c, cal = false, pen = false, held = false, rs = false, g1 = false,
               g2 = false, dirty = false, charged = false }
  local raw = nil
  local packed = STORED[name]
  if packed then
    raw = doubles(packed)
    -- Time never goes back for a key (see main.lua).
    if rel(c, raw[1], raw[2]) > 0 then st.c = { per = c.per, s = raw[1], u = raw[2] } end
    st.g1, st.g2 = raw[1], raw[2]
  end
  local j = 2
  if pol.ncal > 0 then
    local cal = {}
    for w = 1, pol.ncal do
      -- The windows counted, less those that ended.
      local kept = {}
      if raw then
        j = j + 1
        for _ = 1, raw[j] do
          if brel(st.c, raw[j + 2]) > 0 then
            kept[#kept + 1] = { raw[j + 1], raw[j + 2], raw[j + 3] }
          else
            st.dirty = true
          end
          j = j + 3
        end
      end
      cal[w] = kept
    end
    st.cal = cal
  end
  -- The penalty boxes (`Strikes::prune`): a block that ended and the breaches that left the
  -- window are forgotten. Instants relative to the key's now.
  if pol.npen > 0 then
    st.pen = {}
    for _, tier in ipairs(pol.tiers) do
      local p = tier.pen
      if p then
        local box = { at = {}, till = nil }
        if raw then
          if raw[j + 1] == 1 then
            box.till = rel(st.c, raw[j + 2], raw[j + 3])
            if box.till <= 0 then box.till = nil; st.dirty = true end
          end
          local m = raw[j + 4]
          j = j + 4
          for _ = 1, m do
            local a = rel(st.c, raw[j + 1], raw[j + 2])
            if a + p.within > 0 then box.at[#box.at + 1] = a else st.dirty = true end
            j = j + 2
          end
        end
        st.pen[p.x] = box
      end
    end
  end
  local rate_tiers = {}
  for _, tier in ipairs(pol.tiers) do
    if tier.kind == 0 then
      rate_tiers[#rate_tiers + 1] = { c = tier.c, p = tier.p, b = tier.b, xn = 0, xf = 0, last = 0 }
    end
  end
  st.rs = { k = k, name = name, unit = pol.unit, alg = pol.alg, n = pol.nrate, tiers = rate_tiers,
            c = st.c, dirty = false }
  local rest = nil
  if raw then
    rest = {}
    for x = j + 1, #raw do rest[#rest + 1] = raw[x] end
  end
  F.load(st.rs, rest)
  -- The slots held per concurrency tier, counted once per batch (see `held`).
  if pol.nconc > 0 then st.held = {} end
  return st
end

-- The lease set of concurrency tier `tier` of the key at `k` (after the state key and the
-- sliding-log sets).
local function zkey(k, pol, tier)
  if F.log then return KEYS[k + pol.nrate + tier.q] end
  return KEYS[k + tier.q]
end

-- The lease set of concurrency tier `tier`, and the slots held. Expired leases are dropped
-- and the rest counted on the first look of the batch; then the count follows what the
-- batch adds and removes (every batch decides at one instant, so nothing expires meanwhile).
local function held(st, tier)
  local z = zkey(st.k, st.pol, tier)
  local h = st.held[tier.q]
  if not h then
    call('ZREMRANGEBYSCORE', z, '-inf', num(now_ms(st)))
    h = call('ZCARD', z)
    st.held[tier.q] = h
  end
  return z, h
end

local function slot(id, j)
  return spack('<dd', id, j)
end

-- Every slot of lease `id` in tier `tier` (`c` of them) scored `expiry`, in one ZADD; the
-- count of `st` follows the members added.
local function take(st, tier, z, id, c, expiry)
  local args, e = {}, num(expiry)
  for j = 0, c - 1 do
    args[2 * j + 1], args[2 * j + 2] = e, slot(id, j)
  end
  st.held[tier.q] = st.held[tier.q] + call('ZADD', z, unpack(args))
end

-- Gives back the `c` slots of lease `id` in the set `z`, in one ZREM (Redis deletes a set
-- that becomes empty); returns how many were held.
local function give_back(z, id, c)
  local args = {}
  for j = 0, c - 1 do args[j + 1] = slot(id, j) end
  return call('ZREM', z, unpack(args))
end

-- Calendar: the window list of tier `tier`, and the bounds `B` of the record.
local function cal_used(list, start)
  for _, win in ipairs(list) do
    if win[1] == start then return win[3] end
  end
  return 0
end

-- The index of the window of `B` holding the key's now (at least LOOKAHEAD windows after it).
local function locate(st, B)
  for x = 1, #B - LOOKAHEAD do
    if brel(st.c, B[x]) <= 0 and brel(st.c, B[x + 1]) > 0 then return x end
  end
  return error('tollgate: the calendar windows sent do not cover the server clock (clock skew above 60 s?)')
end

-- The earliest instant >= from at which `cost` fits the window holding it, through the
-- counted windows (ascending; only they can be full): `calendar::earliest`.
local function cal_earliest(st, tier, from, cost)
  for _, win in ipairs(st.cal[tier.w]) do
    if brel(st.c, win[1]) <= from and from < brel(st.c, win[2]) and win[3] + cost > tier.count then
      from = brel(st.c, win[2])
    end
  end
  return from
end

-- That the bounds `B` cover the key's now, as `locate` does for bounds of a policed check
-- (no lookahead: any window of them may hold it).
local function cover(st, B)
  for x = 1, #B - 1 do
    if brel(st.c, B[x]) <= 0 and brel(st.c, B[x + 1]) > 0 then return end
  end
  return error('tollgate: the calendar windows sent do not cover the server clock (clock skew above 60 s?)')
end

-- When `at` lies after the lookahead (the LOOKAHEAD windows from the one holding the key's
-- now), the end of the window holding now; else nil (`calendar::beyond`).
local function cal_beyond(st, B, at)
  local j = locate(st, B)
  local current = brel(st.c, B[j + 1])
  if at >= current and at >= brel(st.c, B[j + LOOKAHEAD]) then return current end
  return nil
end

-- Charges `cost` to the window holding `at`: one of the bounds `B`, or else `W`, the window a
-- settlement names (its charge's).
local function cal_charge(st, tier, B, at, cost, W)
  local list = st.cal[tier.w]
  local s, e = nil, nil
  for x = 1, #B - 1 do
    if brel(st.c, B[x]) <= at and at < brel(st.c, B[x + 1]) then
      s, e = B[x], B[x + 1]
      break
    end
  end
  if not s and W and brel(st.c, W[1]) <= at and at < brel(st.c, W[2]) then s, e = W[1], W[2] end
  if not s then return end
  for _, win in ipairs(list) do
    if win[1] == s then
      win[3] = win[3] + cost
      st.dirty = true
      return
    end
  end
  local p = #list + 1
  for y, win in ipairs(list) do
    if win[1] > s then p = y; break end
  end
  table.insert(list, p, { s, e, cost })
  st.dirty = true
end

local function cal_refund(st, tier, at, cost)
  local list = st.cal[tier.w]
  for y, win in ipairs(list) do
    if brel(st.c, win[1]) <= at and at < brel(st.c, win[2]) then
      win[3] = win[3] - min(win[3], cost)
      if win[3] == 0 then table.remove(list, y) end
      st.dirty = true
      return
    end
  end
end

local function cal_status(st, tier)
  local list = st.cal[tier.w]
  local current = 0
  for _, win in ipairs(list) do
    if brel(st.c, win[1]) <= 0 and 0 < brel(st.c, win[2]) then current = win[3] end
  end
  local reset = 0
  if #list > 0 then reset = max(0, brel(st.c, list[#list][2])) end
  return max(0, tier.count - current), reset
end

-- The calendar bounds of a record, from position `p`: one list per calendar tier; and the
-- position after them.
local function bounds(pol, p)
  local out = {}
  for w = 1, pol.ncal do
    local nb = C[p]
    local B = {}
    for x = 1, nb do B[x] = C[p + x] end
    out[w] = B
    p = p + 1 + nb
  end
  return out, p
end

-- The capacity of `tier` for a request of class `class` (`Tier::capacity_for`).
local function capacity(tier, class)
  if tier.kind == 0 then
    if tier.withheld then return F.capacity(tier) - tier.withheld[class + 1] end
    return F.capacity(tier)
  end
  if tier.kind == 1 then return tier.max end
  return tier.count
end

-- The rate tier of `tier` as F knows it.
local function rt(st, tier)
  return st.rs.tiers[tier.r]
end

-- The rate tier of `tier` as a request of class `class` sees it: the burst less what a reserve
-- withholds from the class (`Tier::rate_for`): a copy of its state, only read (earliest,
-- status), never charged; charges go to the tier itself.
local function rt_for(st, tier, class)
  local r = st.rs.tiers[tier.r]
  if not tier.withheld then return r end
  return { c = r.c, p = r.p, b = r.b - tier.withheld[class + 1], xn = r.xn, xf = r.xf,
           last = r.last }
end

-- Penalty boxes (`Strikes` in src/algorithm/penalty.rs).

-- The time left in tier `tier`'s block of the key, if it is blocked.
local function blocked(st, tier)
  if not tier.pen then return nil end
  local till = st.pen[tier.pen.x].till
  if till and till > 0 then return till end
  return nil
end

-- The time left until the latest of the key's blocks ends, if it is blocked.
local function blocked_until(st)
  if st.pol.npen == 0 then return nil end
  local latest = nil
  for _, tier in ipairs(st.pol.tiers) do
    local left = blocked(st, tier)
    if left and (not latest or left > latest) then latest = left end
  end
  return latest
end

-- The later of a retry (-1: none) and `left`.
local function later(r, left)
  if r < 0 then return left end
  return max(r, left)
end

-- Counts a breach now (`Strikes::breach`); when it is the `after`-th in the window, the block
-- starts (and the count starts over): returns its length.
local function breach(st, p)
  local box = st.pen[p.x]
  box.at[#box.at + 1] = 0
  st.dirty = true
  if #box.at < p.after then return nil end
  box.at = {}
  box.till = p.block
  return p.block
end

-- The earliest instant >= from at which tier `tier` admits `cost` for class `class`.
local function earliest(st, tier, class, from, cost)
  if tier.kind == 0 then return F.earliest(st.rs, rt_for(st, tier, class), from, cost) end
  if tier.kind == 2 then return cal_earliest(st, tier, from, cost) end
  return from
end

-- ... and when shaping, after a leaky bucket's queue: it holds the request until the water
-- ahead of it has drained (`TierState::departure`).
local function depart(st, tier, class, from, cost, shaping)
  local e = earliest(st, tier, class, from, cost)
  if shaping and tier.kind == 0 then
    e = e + F.queue_wait(st.rs, rt_for(st, tier, class), e)
  end
  return e
end

-- Per check, reused (a check fills them for its tiers before reading them): each tier's
-- cost, own retry (-1 none), violated (0 or 1), entry id, and whether its slots are full.
local COST, OWN, VIOL, ENTRY, FULL = {}, {}, {}, {}, {}

local function check(st, i)
  local pol = st.pol
  local n, tiers = pol.n, pol.tiers
  local budget_arg, id = C[i + 4], C[i + 5]
  local cost, own, viol, entry = COST, OWN, VIOL, ENTRY
  local class = C[i + 6 + n]
  local zero, over = true, false
  for t = 1, n do
    cost[t] = C[i + 5 + t]
    if cost[t] > 0 then zero = false end
    if cost[t] > capacity(tiers[t], class) then over = true end
  end
  local B = nil
  if pol.ncal > 0 then B = bounds(pol, i + 7 + n) end
  local h1, h2, h3
  local shaping = budget_arg >= 0
  if zero then
    for t = 1, n do own[t], viol[t], entry[t] = -1, 0, 0 end
    h1, h2, h3 = 1, 0, -1
  elseif over then
    for t = 1, n do
      local v = 0
      if cost[t] > capacity(tiers[t], class) then v = 1 end
      own[t], viol[t], entry[t] = -1, v, 0
    end
    h1, h2, h3 = 2, 0, -1
  else
    -- The instant the request leaves: the earliest at which every rate and calendar tier
    -- admits it together, where each is charged (`converge` and `rounds` in
    -- src/algorithm/mod.rs).
    local rounds = 2
    if F.entries then rounds = rounds + 2 * F.entries(st.rs) end
    for w = 1, pol.ncal do rounds = rounds + 2 * #st.cal[w] end
    local at, settled = 0, false
    for _ = 1, rounds do
      local nxt = at
      for t = 1, n do
        if cost[t] > 0 then nxt = max(nxt, depart(st, tiers[t], class, at, cost[t], shaping)) end
      end
      if nxt == at then settled = true; break end
      at = nxt
    end
    local full, any_full = FULL, false
    for t = 1, n do
      local tier = tiers[t]
      full[t] = false
      if tier.kind == 1 and cost[t] > 0 then
        local _, h = held(st, tier)
        if h + cost[t] > tier.max then full[t] = true; any_full = true end
      end
    end
    local budget = max(budget_arg, 0)
    -- Past the budget, the earliest retry is when the departure is within it.
    local retry = -1
    if not settled then
      at, retry = 0, 1
    elseif at > budget then
      retry = at - budget
    end
    -- A departure after a calendar tier's lookahead is refused too: not before the lookahead
    -- moves on, when the current window ends. A policed request leaves now or is refused
    -- (with a retry after its departure, later than the current window's end when the
    -- departure is beyond the lookahead): its bounds need only cover now.
    for t = 1, n do
      local tier = tiers[t]
      if tier.kind == 2 and cost[t] > 0 then
        if shaping then
          local current = cal_beyond(st, B[tier.w], at)
          if current then retry = max(retry, current) end
        else
          cover(st, B[tier.w])
        end
      end
    end
    -- A blocked key is refused whatever its tiers say, until the latest of its blocks ends.
    local till = blocked_until(st)
    if retry ~= -1 or any_full or till then
      for t = 1, n do
        if full[t] then
          own[t], viol[t], entry[t] = -1, 1, 0
        elseif cost[t] == 0 or tiers[t].kind == 1 then
          own[t], viol[t], entry[t] = -1, 0, 0
        else
          local e = earliest(st, tiers[t], class, 0, cost[t])
          if e > 0 then
            own[t], viol[t], entry[t] = e, 1, 0
          else
            own[t], viol[t], entry[t] = -1, 0, 0
          end
        end
      end
      if till then
        -- Blocked: refused, charging nothing and counting as no breach, not before the block
        -- ends, nor before the tiers admit the request.
        for t = 1, n do
          local left = blocked(st, tiers[t])
          if left then own[t], viol[t], entry[t] = later(own[t], left), 1, 0 end
        end
        retry = later(retry, till)
      else
        -- A breach of a tier with a penalty box counts, and may start a block: the request
        -- is then refused until it ends, or until its tiers admit it if that is later.
        for t = 1, n do
          local p = tiers[t].pen
          if p and viol[t] == 1 then
            local left = breach(st, p)
            if left then
              own[t] = later(own[t], left)
              retry = later(retry, left)
            end
          end
        end
      end
      h1, h2, h3 = 0, 0, retry
    else
      local expiry = nil
      for t = 1, n do
        local tier, c = tiers[t], cost[t]
        local e = 0
        -- Units charged to a rate or calendar tier move the guard; slots taken alone do not.
        if c > 0 and tier.kind ~= 1 then st.charged = true end
        if c > 0 then
          if tier.kind == 0 then
            e = F.charge(st.rs, rt(st, tier), at, c)
          elseif tier.kind == 2 then
            cal_charge(st, tier, B[tier.w], at, c)
          else
            local z = held(st, tier)
            expiry = now_ms(st) + tier.lease
            take(st, tier, z, id, c, expiry)
            call('PEXPIRE', z, num(tier.lease + st.grace))
          end
        end
        own[t], viol[t], entry[t] = -1, 0, e
      end
      h1, h2, h3 = 1, at, -1
    end
  end
  out(h1); out(h2); out(h3)
  for t = 1, n do
    local tier = tiers[t]
    local remaining, reset
    if tier.kind == 0 then
      remaining, reset = F.status(st.rs, rt_for(st, tier, class))
    elseif tier.kind == 2 then
      remaining, reset = cal_status(st, tier)
    else
      local _, h = held(st, tier)
      remaining, reset = max(0, tier.max - h), 0
    end
    -- A blocked tier has nothing left until the block ends.
    local left = blocked(st, tier)
    if left then remaining, reset = 0, max(reset, left) end
    out(remaining); out(reset); out(own[t]); out(viol[t]); out(entry[t])
  end
end

-- Whether the settlement at `i` (of policy `pol`) changes what a rate or calendar tier was
-- charged: else it only gives slots back.
local function changes(pol, i)
  for t = 1, pol.n do
    local j = i + 5 + (t - 1) * 5
    if pol.tiers[t].kind ~= 1 and C[j] ~= C[j + 1] then return true end
  end
  return false
end

-- A settlement that only gives slots back, of a key the batch has not loaded.
local function release_only(k, pol, i)
  if C[i + 4] ~= 1 then return end
  for t = 1, pol.n do
    local tier = pol.tiers[t]
    local j = i + 5 + (t - 1) * 5
    if tier.kind == 1 and C[j] > 0 then give_back(zkey(k, pol, tier), C[j + 4], C[j]) end
  end
end

local function settle(st, i)
  local pol = st.pol
  local n, tiers = pol.n, pol.tiers
  local release = C[i + 4]
  local B, p = bounds(pol, i + 5 + 5 * n)
  for t = 1, n do
    local j = i + 5 + (t - 1) * 5
    local old, new, id = C[j], C[j + 1], C[j + 4]
    local at = rel(st.c, C[j + 2], C[j + 3])
    local tier = tiers[t]
    -- A settlement that changes what a rate or calendar tier was charged moves the guard, as
    -- a charge does; a release of slots does not.
    if tier.kind ~= 1 and new ~= old then st.charged = true end
    if tier.kind == 0 then
      if new < old then
        F.refund(st.rs, rt(st, tier), at, id, old, old - new)
      elseif new > old then
        F.charge(st.rs, rt(st, tier), max(at, 0), new - old)
      end
    elseif tier.kind == 2 then
      if new < old then
        cal_refund(st, tier, at, old - new)
      elseif new > old then
        local W = { C[p + 2 * (tier.w - 1)], C[p + 2 * (tier.w - 1) + 1] }
        cal_charge(st, tier, B[tier.w], max(at, 0), new - old, W)
      end
    elseif release == 1 and old > 0 then
      local gone = give_back(zkey(st.k, pol, tier), id, old)
      if st.held[tier.q] then st.held[tier.q] = st.held[tier.q] - gone end
    end
  end
end

local function refresh(st, i)
  local pol = st.pol
  local id = C[i + 4]
  local x = 0
  for _, tier in ipairs(pol.tiers) do
    if tier.kind == 1 then
      x = x + 1
      local slots = C[i + 4 + x]
      local z = held(st, tier)
      local all = 1
      local expiry = now_ms(st) + tier.lease
      for j = 0, slots - 1 do
        if call('ZADD', z, 'XX', 'CH', num(expiry), slot(id, j)) == 0 and not call('ZSCORE', z, slot(id, j)) then
          all = 0
        end
      end
      if slots > 0 and all == 1 then call('PEXPIRE', z, num(tier.lease + st.grace)) end
      out(all)
    end
  end
end

local i = 1
while i <= #C do
  local op, k, pol = C[i], C[i + 1], POL[C[i + 2]]
  local name = KEYS[k]
  -- A settlement that only gives slots back loads the state too: as in memory, it prunes
  -- what has ended (observable when the clock steps back); unless nothing of it can end
  -- (rate tiers of GCRA or the buckets, no calendar tier, no penalty box), when the state
  -- would be neither read nor written.
  local st = cache[name]
  if not st and op == 2 and pol.lean and not changes(pol, i) then
    release_only(k, pol, i)
  else
    if not st then
      st = load(k, pol)
      cache[name] = st
      order[#order + 1] = st
    end
    if op == 1 then
      check(st, i)
    elseif op == 2 then
      settle(st, i)
    else
      refresh(st, i)
    end
  end
  i = i + C[i + 3]
end

-- Write every changed state back, with a TTL equal to what it needs.
-- A settlement that changed nothing stored (a refund to a window that ended) still moves the
-- guard, as in memory.
for _, st in ipairs(order) do
  if st.dirty or st.rs.dirty or st.charged then
    local pol = st.pol
    local ttl = 0
    for _, tier in ipairs(pol.tiers) do
      local reset = 0
      if tier.kind == 0 then
        local _, r = F.status(st.rs, st.rs.tiers[tier.r])
        reset = r
      elseif tier.kind == 2 then
        local _, r = cal_status(st, tier)
        reset = r
      end
      if reset > ttl then ttl = reset end
      -- A penalty box lasts while the key is blocked or a breach counts.
      local p = tier.pen
      if p then
        local box = st.pen[p.x]
        if box.till and box.till > ttl then ttl = box.till end
        -- Breaches are in the order counted, not of their instants when the clock stepped back.
        for _, a in ipairs(box.at) do
          if a + p.within > ttl then ttl = a + p.within end
        end
      end
    end
    if ttl <= 0 then
      call('DEL', st.name)
      if F.drop then F.drop(st.rs) end
    else
      -- The guard moves with charges only (see main.lua).
      local v = { st.c.s, st.c.u }
      if st.g1 and not st.charged then v = { st.g1, st.g2 } end
      for w = 1, pol.ncal do
        local list = st.cal[w]
        v[#v + 1] = #list
        for _, win in ipairs(list) do
          v[#v + 1], v[#v + 2], v[#v + 3] = win[1], win[2], win[3]
        end
      end
      for _, tier in ipairs(pol.tiers) do
        local p = tier.pen
        if p then
          local box = st.pen[p.x]
          if box.till then
            local s, u = abs(st.c, box.till)
            v[#v + 1], v[#v + 2], v[#v + 3] = 1, s, u
          else
            v[#v + 1], v[#v + 2], v[#v + 3] = 0, 0, 0
          end
          v[#v + 1] = #box.at
          for _, a in ipairs(box.at) do
            local s, u = abs(st.c, a)
            v[#v + 1], v[#v + 2] = s, u
          end
        end
      end
      for _, x in ipairs(F.save(st.rs)) do v[#v + 1] = x end
      call('SET', st.name, pack(v), 'PX', ttl_ms(st.unit, ttl, st.grace))
      if F.expire then F.expire(st.rs, ttl_ms(st.unit, ttl, st.grace)) end
    end
  end
end

return finish()
