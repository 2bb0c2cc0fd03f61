-- kinds.lua, continued: the general path (the scripts are one chunk: kinds.lua,
-- kinds_flat.lua, this file).

if KINDS then
  -- A calendar bound (seconds) relative to the key's now, in units.
  K.brel = function(c, b)
    return (b - c.s) * c.per - c.u
  end

  -- The key's now in milliseconds since the epoch (lease expiries).
  K.now_ms = function(st)
    return st.c.s * 1000 + floor(st.c.u * st.unit / 1e6)
  end
end

local function load(k, pol)
  local name = KEYS[k]
  local c = clock_of(pol.unit)
  -- A table sized once (one per key per batch), not grown field by field: the fields every
  -- key has, 13 of them, fit the 16 slots Lua gives a table's named fields (the next size, 32,
  -- costs the server twice the memory to allocate and collect, per key); `cal`, `pen` and
  -- `held` are added for policies with calendar tiers, penalty boxes or concurrency tiers. It
  -- is also the state F knows (`k`, `unit`, `alg`, `n` and `tiers`: the rate tiers, `c`,
  -- `dirty`).
  local st = { k = k, name = name, unit = pol.unit, grace = pol.grace, n = pol.nrate, pol = pol,
               alg = pol.alg, tiers = false, c = c, g1 = false, g2 = false, dirty = false,
               charged = false }
  local raw = nil
  local packed = STORED[name]
  if packed then
    raw = doubles(packed)
    -- [1], [2]: the guard, the instant of the last charge (or settlement). Time never goes
    -- back for a key that keeps a guard: Redis's TIME can step back (NTP, a failover to a
    -- replica whose clock is behind), and a window would then be entered again as if empty.
    -- Such a key decides at the later of now and its guard.
    if pol.guard and rel(c, raw[1], raw[2]) > 0 then
      st.c = { per = c.per, s = raw[1], u = raw[2] }
    end
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
          if K.brel(st.c, raw[j + 2]) > 0 then
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
  -- The penalty boxes, from their own keys, per record (boxes.lua).
  if pol.npen > 0 then st.pen = {} end
  if pol.nline > 0 then j = L.load(st, raw, j) end
  local rate_tiers, tiers = {}, pol.tiers
  for t = 1, pol.n do
    local tier = tiers[t]
    if tier.kind == 0 then rate_tiers[tier.r] = F.tier(tier) end
  end
  st.tiers = rate_tiers
  F.load(st, raw, j)
  if pol.nline > 0 then L.prune(st) end
  -- The slots held per concurrency tier, counted once per batch (see `held`).
  if pol.nconc > 0 then st.held = {} end
  return st
end

if KINDS then
  -- The lease set of concurrency tier `tier`, and the slots held. Expired leases are dropped
  -- and the rest counted on the first look of the batch; then the count follows what the
  -- batch adds and removes (every batch decides at one instant, so nothing expires meanwhile).
  K.held = function(st, tier)
    local z = K.zkey(st.k, st.pol, tier)
    local h = st.held[tier.q]
    if not h then
      h = K.count_held(z, K.now_ms(st))
      st.held[tier.q] = h
    end
    return z, h
  end

  -- Every slot of lease `id` in tier `tier` (`c` of them) scored `expiry`, in one ZADD; the
  -- count of `st` follows the members added.
  K.take = function(st, tier, z, id, c, expiry)
    local args, e = {}, num(expiry)
    for j = 0, c - 1 do
      args[2 * j + 1], args[2 * j + 2] = e, K.slot(id, j)
    end
    st.held[tier.q] = st.held[tier.q] + call('ZADD', z, unpack(args))
  end


  -- Calendar: the window list of tier `tier`, and the bounds `B` of the record.
  K.cal_used = function(list, start)
    for _, win in ipairs(list) do
      if win[1] == start then return win[3] end
    end
    return 0
  end

  -- The index of the window of `B` holding the key's now (at least LOOKAHEAD windows after it).
  K.locate = function(st, B)
    for x = 1, #B - LOOKAHEAD do
      if K.brel(st.c, B[x]) <= 0 and K.brel(st.c, B[x + 1]) > 0 then return x end
    end
    return error('tollgate: the calendar windows sent do not cover the server clock (clock skew above 60 s?)')
  end

  -- The earliest instant >= from at which `cost` fits the window holding it, through the
  -- counted windows (ascending; only they can be full): `calendar::earliest`.
  K.cal_earliest = function(st, tier, from, cost)
    for _, win in ipairs(st.cal[tier.w]) do
      if K.brel(st.c, win[1]) <= from and from < K.brel(st.c, win[2]) and win[3] + cost > tier.count then
        from = K.brel(st.c, win[2])
      end
    end
    return from
  end

  -- That the bounds `B` cover the key's now, as `locate` does for bounds of a policed check
  -- (no lookahead: any window of them may hold it).
  K.cover = function(st, B)
    for x = 1, #B - 1 do
      if K.brel(st.c, B[x]) <= 0 and K.brel(st.c, B[x + 1]) > 0 then return end
    end
    return error('tollgate: the calendar windows sent do not cover the server clock (clock skew above 60 s?)')
  end

  -- When `at` lies after the lookahead (the LOOKAHEAD windows from the one holding the key's
  -- now), the end of the window holding now; else nil (`calendar::beyond`).
  K.cal_beyond = function(st, B, at)
    local j = K.locate(st, B)
    local current = K.brel(st.c, B[j + 1])
    if at >= current and at >= K.brel(st.c, B[j + LOOKAHEAD]) then return current end
    return nil
  end

  -- Charges `cost` to the window holding `at`: one of the bounds `B`, or else `W`, the window a
  -- settlement names (its charge's).
  K.cal_charge = function(st, tier, B, at, cost, W)
    local list = st.cal[tier.w]
    local s, e = nil, nil
    for x = 1, #B - 1 do
      if K.brel(st.c, B[x]) <= at and at < K.brel(st.c, B[x + 1]) then
        s, e = B[x], B[x + 1]
        break
      end
    end
    if not s and W and K.brel(st.c, W[1]) <= at and at < K.brel(st.c, W[2]) then s, e = W[1], W[2] end
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

  K.cal_refund = function(st, tier, at, cost)
    local list = st.cal[tier.w]
    for y, win in ipairs(list) do
      if K.brel(st.c, win[1]) <= at and at < K.brel(st.c, win[2]) then
        win[3] = win[3] - min(win[3], cost)
        if win[3] == 0 then table.remove(list, y) end
        st.dirty = true
        return
      end
    end
  end

  K.cal_status = function(st, tier)
    local list = st.cal[tier.w]
    local current = 0
    for _, win in ipairs(list) do
      if K.brel(st.c, win[1]) <= 0 and 0 < K.brel(st.c, win[2]) then current = win[3] end
    end
    local reset = 0
    if #list > 0 then reset = max(0, K.brel(st.c, list[#list][2])) end
    return max(0, tier.count - current), reset
  end

  -- The calendar bounds of a record, from position `p`: one list per calendar tier; and the
  -- position after them.
  K.bounds = function(pol, p)
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
  K.capacity = function(tier, class)
    if tier.kind == 0 then
      if tier.withheld then return F.capacity(tier) - tier.withheld[class + 1] end
      return F.capacity(tier)
    end
    if tier.kind == 1 then return tier.max end
    return tier.count
  end
end

-- The rate tier of `tier` as F knows it.
local function rt(st, tier)
  return st.tiers[tier.r]
end

-- The rate tier of `tier` as a request of class `class` sees it: the burst less what a reserve
-- withholds from the class (`Tier::rate_for`): a copy of its state, only read (earliest,
-- status), never charged; charges go to the tier itself. GCRA and the buckets only: the policy
-- builder refuses a reserve on any other algorithm, and this copies only their fields.
local function rt_for(st, tier, class)
  local r = st.tiers[tier.r]
  if not tier.withheld then return r end
  return { c = r.c, p = r.p, b = r.b - tier.withheld[class + 1], xn = r.xn, xf = r.xf,
           last = r.last }
end

-- Penalty boxes (`Strikes` in src/algorithm/penalty.rs).

if KINDS then
  -- The time left in tier `tier`'s block of the key, if it is blocked.
  K.blocked = function(st, tier)
    if not tier.pen then return nil end
    local till = st.pen[tier.pen.x].till
    if till and till > 0 then return till end
    return nil
  end

  -- The time left until the latest of the key's blocks ends, if it is blocked.
  K.blocked_until = function(st)
    if st.pol.npen == 0 then return nil end
    local latest = nil
    for _, tier in ipairs(st.pol.tiers) do
      local left = K.blocked(st, tier)
      if left and (not latest or left > latest) then latest = left end
    end
    return latest
  end

  -- The later of a retry (-1: none) and `left`.
  K.later = function(r, left)
    if r < 0 then return left end
    return max(r, left)
  end

  -- Counts a breach now (`Strikes::breach`); when it is the `after`-th in the window, the block
  -- starts (and the count starts over): returns its length.
  K.breach = function(st, p)
    local box = st.pen[p.x]
    box.at[#box.at + 1] = 0
    st.dirty, box.dirty = true, true
    if #box.at < p.after then return nil end
    box.at = {}
    box.till = p.block
    return p.block
  end
end

-- The earliest instant >= from at which tier `tier` admits `cost` for class `class`.
local function earliest(st, tier, class, from, cost)
  if tier.kind == 0 then return F.earliest(st, rt_for(st, tier, class), from, cost) end
  if tier.kind == 2 then return K.cal_earliest(st, tier, from, cost) end
  return from
end

if KINDS then
  -- ... and when shaping, after a leaky bucket's queue: it holds the request until the water
  -- ahead of it has drained (`TierState::departure`).
  K.depart = function(st, tier, class, from, cost, shaping)
    local e = earliest(st, tier, class, from, cost)
    if shaping and tier.kind == 0 then
      e = e + F.queue_wait(st, rt_for(st, tier, class), e)
    end
    return e
  end
end

-- Decides a request of `COST` per tier for class `class` (`decide_kinds` in
-- src/algorithm/mod.rs): `budget_arg` its shaping budget (-1 polices), `id` the lease id of
-- its slots, `B` the calendar bounds of its record. Replies, and returns the outcome. Its
-- steps are `decide_kinds`'s in order (capacity, `converge` over `rounds`, slots, calendar
-- lookahead, penalty boxes, then charge or refuse); unlike it, it writes the reply as it goes
-- instead of building a `Decision`, and a policy of rates alone goes to F directly instead of
-- through `depart` and `capacity` (the same values: nothing is withheld from it).
local function decide(st, class, budget_arg, id, B)
  local pol = st.pol
  local n, tiers, rates = pol.n, pol.tiers, pol.rates
  local cost, own, viol, entry = COST, OWN, VIOL, ENTRY
  local zero, over = true, false
  for t = 1, n do
    local c = cost[t]
    if c > 0 then zero = false end
    -- Nothing is withheld from a policy of rates alone: its capacity is the tier's.
    if c > (rates and tiers[t].cap or K.capacity(tiers[t], class)) then over = true end
  end
  local h1, h2, h3
  local shaping = budget_arg >= 0
  if zero then
    for t = 1, n do own[t], viol[t], entry[t] = -1, 0, 0 end
    h1, h2, h3 = 1, 0, -1
  elseif over then
    for t = 1, n do
      local v = 0
      if cost[t] > (rates and tiers[t].cap or K.capacity(tiers[t], class)) then v = 1 end
      own[t], viol[t], entry[t] = -1, v, 0
    end
    h1, h2, h3 = 2, 0, -1
  else
    -- The instant the request leaves: the earliest at which every rate and calendar tier
    -- admits it together, where each is charged (`converge` and `rounds` in
    -- src/algorithm/mod.rs).
    local rounds = 2
    if F.entries then rounds = rounds + 2 * F.entries(st) end
    for w = 1, pol.ncal do rounds = rounds + 2 * #st.cal[w] end
    for x = 1, pol.nline do if st.line[x].u > 0 then rounds = rounds + 2 end end
    local at, settled = 0, false
    local rts = st.tiers
    for _ = 1, rounds do
      local nxt = at
      if rates then
        -- `depart` of a rate tier with nothing withheld: F alone.
        for t = 1, n do
          local c = cost[t]
          if c > 0 then
            local e = F.earliest(st, rts[t], at, c)
            if shaping then e = e + F.queue_wait(st, rts[t], e) end
            if e > nxt then nxt = e end
          end
        end
      else
        for t = 1, n do
          local c = cost[t]
          if c > 0 then
            nxt = max(nxt, L.depart(st, tiers[t], class, at, c, K.depart(st, tiers[t], class, at, c, shaping)))
          end
        end
      end
      if nxt == at then settled = true; break end
      at = nxt
    end
    -- Whether each tier's slots are full (read only when any is).
    local full, any_full = FULL, false
    for t = 1, pol.nconc > 0 and n or 0 do
      local tier = tiers[t]
      full[t] = false
      if tier.kind == 1 and cost[t] > 0 then
        local _, h = K.held(st, tier)
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
    -- A critical request refused may be admitted sooner on a line, decided then (line.lua).
    if pol.nline > 0 then retry = L.retry(st, class, cost, rounds, retry, K.depart) end
    -- A departure after a calendar tier's lookahead is refused too: not before the lookahead
    -- moves on, when the current window ends. A policed request leaves now or is refused
    -- (with a retry after its departure, later than the current window's end when the
    -- departure is beyond the lookahead): its bounds need only cover now.
    for t = 1, pol.ncal > 0 and n or 0 do
      local tier = tiers[t]
      if tier.kind == 2 and cost[t] > 0 then
        if shaping then
          local current = K.cal_beyond(st, B[tier.w], at)
          if current then retry = max(retry, current) end
        else
          K.cover(st, B[tier.w])
        end
      end
    end
    -- A blocked key is refused whatever its tiers say, until the latest of its blocks ends.
    local till = pol.npen > 0 and K.blocked_until(st)
    if retry ~= -1 or any_full or till then
      for t = 1, n do
        if any_full and full[t] then
          own[t], viol[t], entry[t] = -1, 1, 0
        elseif cost[t] == 0 or tiers[t].kind == 1 then
          own[t], viol[t], entry[t] = -1, 0, 0
        else
          local e = L.own(st, tiers[t], class, cost[t], earliest(st, tiers[t], class, 0, cost[t]))
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
          local left = K.blocked(st, tiers[t])
          if left then own[t], viol[t], entry[t] = K.later(own[t], left), 1, 0 end
        end
        retry = K.later(retry, till)
      else
        -- A breach of a tier with a penalty box counts, and may start a block: the request
        -- is then refused until it ends, or until its tiers admit it if that is later.
        for t = 1, n do
          local p = tiers[t].pen
          if p and viol[t] == 1 then
            local left = K.breach(st, p)
            if left then
              own[t] = K.later(own[t], left)
              retry = K.later(retry, left)
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
          if tier.line then
            e = L.charge(st, tier, class, at, c)
          elseif tier.kind == 0 then
            e = F.charge(st, rts[tier.r], at, c)
          elseif tier.kind == 2 then
            K.cal_charge(st, tier, B[tier.w], at, c)
          else
            local z = K.held(st, tier)
            expiry = K.now_ms(st) + tier.lease
            K.take(st, tier, z, id, c, expiry)
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
    if rates then
      remaining, reset = F.status(st, st.tiers[t])
    elseif tier.kind == 0 then
      remaining, reset = F.status(st, rt_for(st, tier, class))
      remaining = L.remaining(st, tier, class, remaining)
    elseif tier.kind == 2 then
      remaining, reset = K.cal_status(st, tier)
    else
      local _, h = K.held(st, tier)
      remaining, reset = max(0, tier.max - h), 0
    end
    -- A blocked tier has nothing left until the block ends.
    if tier.pen then
      local left = K.blocked(st, tier)
      if left then remaining, reset = 0, max(reset, left) end
    end
    out(remaining); out(reset); out(own[t]); out(viol[t]); out(entry[t])
  end
  return h1
end

-- A check (op 1): its costs, class and calendar bounds from the record.
local function check(st, i)
  local pol = st.pol
  local n = pol.n
  for t = 1, n do COST[t] = C[i + 5 + t] end
  local B = nil
  if pol.ncal > 0 then B = K.bounds(pol, i + 7 + n) end
  decide(st, C[i + 6 + n], C[i + 4], C[i + 5], B)
end

-- A lease (op 3) of a policy of rates alone (GCRA, the buckets, fixed windows: lease mode
-- refuses the others): the node's previous lease settled first (per tier as a settlement's
-- old and new cost, instant and entry id; equal costs settle nothing), then, policed, up to
-- `block` units (at least `cost`) of what every tier has now, a quarter of it at most, so
-- that a key near its limit is leased a unit at a time; for the rate algorithms, up to
-- `useful` units of what is there, however little (see gcra.lua). The reply adds the units
-- charged and when `useful` units will be there again (after this grant, or for a refusal),
-- for the node to wait for (0: now or never asked).
local function lease(st, i)
  local pol = st.pol
  if not pol.rates then
    return error('tollgate: a lease of a policy that is not of rates alone')
  end
  local n, rts = pol.n, st.tiers
  for t = 1, n do
    local j = i + 7 + (t - 1) * 5
    local old, new = C[j], C[j + 1]
    -- A settlement that changes what was charged moves the guard, as a charge does.
    if new ~= old then
      st.charged = true
      local at = rel(st.c, C[j + 2], C[j + 3])
      if new < old then
        F.refund(st, rts[t], at, C[j + 4], old, old - new)
      else
        F.charge(st, rts[t], max(at, 0), new - old)
      end
    end
  end
  local cost, block, useful = C[i + 4], C[i + 5], C[i + 6]
  local avail = nil
  for t = 1, n do
    local remaining = F.status(st, rts[t])
    if not avail or remaining < avail then avail = remaining end
  end
  local take = floor(avail / 4)
  if useful > take then
    take = useful
    if take > avail then take = avail end
  end
  if take > block then take = block end
  if take > cost then cost = take end
  for t = 1, n do COST[t] = cost end
  local outcome = decide(st, 1, -1, 0, nil)
  local hold = 0
  if useful > 0 and outcome ~= 2 then
    for t = 1, n do hold = max(hold, F.earliest(st, rts[t], 0, useful)) end
  end
  out(cost); out(hold)
end

local function settle(st, i)
  local pol = st.pol
  local n, tiers = pol.n, pol.tiers
  local release = C[i + 4]
  local B, p = nil, nil
  if pol.ncal > 0 then B, p = K.bounds(pol, i + 5 + 5 * n) end
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
        F.refund(st, rt(st, tier), at, id, old, old - new)
      elseif new > old then
        F.charge(st, rt(st, tier), max(at, 0), new - old)
        -- Charged now, ahead of any schedule: a line counts it (line.lua).
        local ln, r = tier.line, rt(st, tier)
        if ln then L.taken(r, st.line[ln.x], ln.reserve, new - old, r.xn, r.xf) end
      end
    elseif tier.kind == 2 then
      if new < old then
        K.cal_refund(st, tier, at, old - new)
      elseif new > old then
        local W = { C[p + 2 * (tier.w - 1)], C[p + 2 * (tier.w - 1) + 1] }
        K.cal_charge(st, tier, B[tier.w], max(at, 0), new - old, W)
      end
    elseif release == 1 and old > 0 then
      local gone = K.give_back(K.zkey(st.k, pol, tier), id, old)
      if st.held[tier.q] then st.held[tier.q] = st.held[tier.q] - gone end
    end
  end
end

if KINDS then
  K.refresh = function(st, i)
    local pol = st.pol
    local id = C[i + 4]
    local x = 0
    for _, tier in ipairs(pol.tiers) do
      if tier.kind == 1 then
        x = x + 1
        local slots = C[i + 4 + x]
        local z = K.held(st, tier)
        local all = 1
        local expiry = K.now_ms(st) + tier.lease
        for j = 0, slots - 1 do
          if call('ZADD', z, 'XX', 'CH', num(expiry), K.slot(id, j)) == 0 and not call('ZSCORE', z, K.slot(id, j)) then
            all = 0
          end
        end
        if slots > 0 and all == 1 then call('PEXPIRE', z, num(tier.lease + st.grace)) end
        out(all)
      end
    end
  end
end

STORED = stored(C, POL, function(C, i) return i + C[i + 3] end)
if CAL then cover_all(C, POL, STORED, LOOKAHEAD) end
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
    if st.pen then K.box.enter(st) end
    if op == 1 then
      check(st, i)
    elseif op == 2 then
      settle(st, i)
    elseif op == 3 then
      lease(st, i)
    else
      K.refresh(st, i)
    end
    if st.pen then K.box.leave(st) end
  end
  i = i + C[i + 3]
end

-- Write every changed state back, with a TTL equal to what it needs.
-- A settlement that changed nothing stored (a refund to a window that ended) still moves the
-- guard, as in memory.
if K.box then K.box.save() end
for _, st in ipairs(order) do
  if st.dirty or st.charged then
    local pol = st.pol
    local ttl = 0
    if pol.rates then
      for t = 1, pol.n do
        local _, r = F.status(st, st.tiers[t])
        if r > ttl then ttl = r end
      end
    end
    -- (A policy of rates alone: done above.)
    for _, tier in ipairs(pol.rates and NONE or pol.tiers) do
      local reset = 0
      if tier.kind == 0 then
        local _, r = F.status(st, st.tiers[tier.r])
        reset = r
      elseif tier.kind == 2 then
        local _, r = K.cal_status(st, tier)
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
      if F.drop then F.drop(st) end
    else
      -- The guard moves with charges only: a refused check (or a query) that rewrote the
      -- state (pruned, a log rebased) keeps it, so a clock stepping back finds the key as the
      -- in-memory store does, which keeps no trace of refused checks.
      local v = { st.c.s, st.c.u }
      if st.g1 and not st.charged then v = { st.g1, st.g2 } end
      for w = 1, pol.ncal do
        local list = st.cal[w]
        v[#v + 1] = #list
        for _, win in ipairs(list) do
          v[#v + 1], v[#v + 2], v[#v + 3] = win[1], win[2], win[3]
        end
      end
      if pol.nline > 0 then L.save(st, v) end
      F.save(st, v)
      call('SET', st.name, pack(v), 'PX', ttl_ms(st.unit, ttl, st.grace))
      if F.expire then F.expire(st, ttl_ms(st.unit, ttl, st.grace)) end
    end
  end
end

return finish()
