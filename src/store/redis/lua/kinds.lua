-- The driver: every policy's checks, settlements and leases, whatever its tiers: rate tiers
-- (run by the family's F), calendar tiers and concurrency tiers, all or nothing in one check,
-- each key's state loaded once and written once. Mirrors `decide_kinds` in
-- src/algorithm/mod.rs and src/algorithm/calendar.rs; a plain policy (rate tiers counting
-- requests, every tier charged the same cost) is its all-rate, same-cost case.
--
-- ARGV[2] per policy: unit, grace, algorithm, tiers, plain (1: rate tiers alone counting
--         requests, without penalty box or reserve: see `guard` in `kpolicies`), then per
--         tier 9 numbers: kind (0 rate, 1 concurrency, 2 calendar) and its parameters: a
--         rate's count, period, burst; a concurrency tier's slots and lease (ms); a calendar
--         tier's count; then its penalty box: block (units; 0 for none), refusals, window
--         (units); then its reserves (`Reserve`): critical and standard units (0 for none).
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
--         op 3, a lease (policies of rate tiers alone): least cost, largest block, useful
--           block (0: none), then per tier the settlement of the previous lease as an op 2's
--           (old and new cost, instant, entry id; equal costs settle nothing);
--         op 4, a refresh: lease id, then per concurrency tier its slots.
-- KEYS    per record: the state key, the sliding-log sets of the rate tiers (log family
--         only), the lease sets of the concurrency tiers, the penalty boxes (boxes.lua); the
--         last two named by tier, not by the policy's fingerprint (`Prepared::keys`).
-- State   `(seconds, units)` of the last charge or settlement (the guard: see `load`), per
--         calendar tier its windows (number, then start, end, used), per tier with a critical
--         reserve its line (line.lua), then the rate tiers' state as F packs it: for a plain policy the guard and F's state alone. Concurrency
--         slots live in their sorted sets: one member per slot, `struct '<dd' (lease id,
--         slot)`, scored by the lease's expiry (ms since the epoch); expired members are
--         dropped first.
-- reply   packed doubles: per check, outcome (1 allowed, 0 limited, 2 cost above capacity),
--         delay, retry (-1 none), then per tier remaining, reset, own retry (-1 none),
--         violated, entry id (a concurrency tier's reset is left to the binding, which knows
--         the typical hold); per lease a check's, then the units charged and when a useful
--         block will be there again (0: now or never asked); per refresh, 1 or 0 per
--         concurrency tier (every slot was still leased); nothing per settlement; durations
--         in units from the unit `now` falls in; last, the instant decided at (seconds,
--         nanoseconds).
--
-- Two drivers over that one layout: the general one (`load`, `check`, `settle`, `lease`,
-- `refresh` and the write-back), and the flat path (`flat_batch`): a batch of policed checks
-- and releases of policies whose rate tiers are GCRA with whole-unit emission intervals,
-- without reserves or penalty boxes, decided as the general driver decides them with per-key
-- state in one array. Both read and write the same stored state, so nodes running either
-- agree. (A plain policy of whole-unit GCRA tiers runs gcra.lua instead, over the same state.)

-- Windows a shaped request may be reserved in (calendar::LOOKAHEAD).
local LOOKAHEAD = 8

-- An empty list, never written.
local NONE = {}

local function kpolicies()
  local P = doubles(ARGV[2])
  local out, i = {}, 1
  while i <= #P do
    local n = P[i + 3]
    local tiers, nrate, nconc, ncal, npen, nline = {}, 0, 0, 0, 0, 0
    local whole, withheld = true, false
    for t = 1, n do
      local j = i + 5 + (t - 1) * 9
      local kind = P[j]
      -- Every field in the constructor (a table grown field by field is rehashed as it grows,
      -- at a cost the server pays per call): `false` for what the tier has not.
      local tier = { kind = kind, c = false, p = false, b = false, r = false, T = false,
                     tau = false, cap = false, pen = false, withheld = false, line = false }
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
          whole, withheld = false, true
        end
        -- A critical reserve keeps a line per key (line.lua).
        if P[j + 7] > 0 then
          nline = nline + 1
          tier.line = { x = nline, reserve = P[j + 7] }
        end
        -- GCRA's emission interval T and tolerance tau (= T x burst), when T is whole units.
        if tier.p % tier.c == 0 then
          tier.T = tier.p / tier.c
          tier.tau = tier.T * tier.b
        else
          whole = false
        end
        -- What the tier holds at most (`Tier::capacity_for` when nothing is withheld).
        tier.cap = F.capacity(tier)
      elseif kind == 1 then
        nconc = nconc + 1
        tier.max, tier.lease, tier.q = P[j + 1], P[j + 2], nconc
        tier.cap = tier.max
      else
        ncal = ncal + 1
        tier.count, tier.w = P[j + 1], ncal
        tier.cap = tier.count
      end
      tiers[t] = tier
    end
    -- Rate tiers alone, nothing withheld, no penalty box: what a plain policy is (and a policy
    -- of other units): `check` and `settle` go straight to F, and a lease may be taken.
    local rates = nrate == n and npen == 0 and not withheld
    -- Whether a key keeps a clock guard: every policy but a plain one (of requests) of GCRA or
    -- the buckets, which only grow stricter when the clock steps back (as the memory store's
    -- `Core::guarded`).
    local guard = not (F.rate == true and P[i + 4] == 1)
    -- Lean: loading the key's state changes nothing stored (rate.lua's F prunes nothing, and
    -- there is no calendar window, penalty box or line to forget).
    local lean = F.rate == true and ncal == 0 and npen == 0 and nline == 0
    -- The flat path (see `flat_batch`): GCRA rate tiers of whole-unit T, no reserve, no
    -- penalty box.
    local flat = F.rate == true and P[i + 2] == 0 and npen == 0 and whole and guard
    -- The flat path's key state (see its `load`): the slots held per concurrency tier after
    -- `oh`, the windows per calendar tier after `oh + nconc`; `blank` sizes it.
    local oh = 9 + 3 * nrate
    local blank = false
    if flat then
      blank = {}
      for x = 1, 3 * nrate + nconc + ncal do blank[x] = false end
    end
    out[#out + 1] = { unit = P[i], grace = P[i + 1], alg = P[i + 2], n = n, tiers = tiers,
                      nrate = nrate, nconc = nconc, ncal = ncal, npen = npen, lean = lean,
                      nline = nline,
                      flat = flat, rates = rates, guard = guard, per = 1e9 / P[i], oh = oh,
                      blank = blank }
    i = i + 5 + n * 9
  end
  return out
end

local POL = kpolicies()

-- Whether a policy of the batch has tiers of other kinds than rates, penalty boxes or reserves:
-- only then are the functions for them below made (`if KINDS then`, into `K`). Every function
-- a call of a script defines is a closure made anew, with each local it captures, and
-- collected after: a batch of plain policies would pay for two dozen it never calls.
local KINDS, CAL = false, false
for _, pol in ipairs(POL) do
  if not pol.rates then KINDS = true end
  if pol.ncal > 0 then CAL = true end
end
-- Those functions, in one table: a function that may call them captures it alone (each local
-- a function captures is found and kept apart per call).
local K = {}
local C = doubles(ARGV[3])
-- Penalty boxes live in keys of their own (boxes.lua): its functions for a batch with boxes.
for _, pol in ipairs(POL) do
  if pol.npen > 0 and not K.box then K.box = boxes(C, POL) end
end
-- Every key's stored value (see `stored`), read once the batch knows which keys it loads.
local STORED = nil
local cache, order = {}, {}

-- Per check, reused (a check fills them for its tiers before reading them): each tier's
-- cost, own retry (-1 none), violated (0 or 1), entry id, and whether its slots are full.
local COST, OWN, VIOL, ENTRY, FULL = {}, {}, {}, {}, {}

-- What the flat path (below) needs of the functions for the other kinds, made before it: a
-- batch that takes it returns before the general path's functions are made.
if KINDS then
  -- The lease set of concurrency tier `tier` of the key at `k` (after the state key and the
  -- sliding-log sets).
  K.zkey = function(k, pol, tier)
    if F.log then return KEYS[k + pol.nrate + tier.q] end
    return KEYS[k + tier.q]
  end

  -- The slots held in the lease set `z` at `ms` (milliseconds since the epoch): the expired
  -- leases dropped, the rest counted. An empty (absent) set, the common case, costs one command.
  K.count_held = function(z, ms)
    local h = call('ZCARD', z)
    if h > 0 then h = h - call('ZREMRANGEBYSCORE', z, '-inf', num(ms)) end
    return h
  end

  K.slot = function(id, j)
    return spack('<dd', id, j)
  end

  -- Gives back the `c` slots of lease `id` in the set `z`, in one ZREM (Redis deletes a set
  -- that becomes empty); returns how many were held.
  K.give_back = function(z, id, c)
    if c == 1 then return call('ZREM', z, K.slot(id, 0)) end
    local args = {}
    for j = 0, c - 1 do args[j + 1] = K.slot(id, j) end
    return call('ZREM', z, unpack(args))
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
    if tier.kind == 1 and C[j] > 0 then K.give_back(K.zkey(k, pol, tier), C[j + 4], C[j]) end
  end
end


-- The flat path: a batch whose records are all policed checks and releases (settlements that
-- change no charge) of policies whose rate tiers are GCRA with a whole-unit emission interval,
-- without reserves or penalty boxes: the common case of a quota or a concurrency limit beside
-- a rate. It makes the decisions of `check` and `settle` and writes the state the write-back
-- below writes, specialised as gcra.lua specialises rate.lua: a whole-unit T leaves every
-- mixed-radix fraction 0, so a TAT is one number of units. Server time here goes mostly to
-- allocating and collecting Lua tables and to calls, so a key's state is one array (below)
-- plus one flat list of windows (start, end, used, ...) per calendar tier, instants are
-- computed inline, and nothing is allocated per tier or per check. A Lua call (and a C one:
-- `math.max`, `ipairs`) costs about as much as the few lines it runs, so a key's load and
-- write-back are inline in the batch loop, and a check that every tier admits now is decided
-- without one (`flat_check`); measured by `benches/calendar_cost.py`.
--
-- A key's state, by index: 1 its KEYS index, 2 its policy, 3 and 4 its now (seconds, units:
-- the later of the server's and the stored guard), 5 and 6 the stored guard (false when
-- fresh), 7 changed (pruned or charged), 8 charged, 9 its name; from 10, per rate tier its TAT
-- relative to now and the stored `last` (seconds, units; GCRA never moves it); after `oh`
-- the slots held per concurrency tier (false until counted), after `oc` the window lists.

-- Whether the batch takes the flat path; if so, reads the state of the keys it loads (a
-- batch of releases of policies whose state nothing prunes reads none: see `release_only`).
local function flat_batch()
  local i = 1
  local names, seen = {}, {}
  while i <= #C do
    local op, pol = C[i], POL[C[i + 2]]
    if not pol.flat then return false end
    if op == 1 then
      if C[i + 4] >= 0 then return false end
    elseif op ~= 2 or changes(pol, i) then
      return false
    end
    local name = KEYS[C[i + 1]]
    if (op == 1 or not pol.lean) and not seen[name] then
      seen[name] = true
      names[#names + 1] = name
    end
    i = i + C[i + 3]
  end
  STORED = {}
  if #names > 0 then
    local values = call('MGET', unpack(names))
    for j = 1, #names do STORED[names[j]] = values[j] end
  end
  return true
end

-- The flat path's functions are made only for a batch that takes it, and the general path's
-- (below) only for a batch that does not: every function a call of a script defines is a
-- closure made anew, paid for on every call.
if flat_batch() then
  if CAL then cover_all(C, POL, STORED, LOOKAHEAD) end

  -- The key's now in milliseconds since the epoch (lease expiries).
  local function flat_ms(st)
    return st[3] * 1000 + floor(st[4] * st[2].unit / 1e6)
  end

  -- `held`, flat: the lease set of concurrency tier `tier` and the slots held.
  local function flat_held(st, tier)
    local x = st[2].oh + tier.q
    local z = KEYS[st[1] + tier.q]
    local h = st[x]
    if not h then
      h = K.count_held(z, flat_ms(st))
      st[x] = h
    end
    return z, h
  end

  -- `earliest` (`F.earliest` of a GCRA tier, `cal_earliest`), flat.
  local function flat_earliest(st, tier, from, cost)
    local kind = tier.kind
    if kind == 0 then
      local b = st[7 + 3 * tier.r]
      if b < from then b = from end
      local a = b + cost * tier.T - tier.tau
      if from >= a then return from end
      return a
    end
    if kind == 2 then
      local list, cs, cu, per = st[(st[2].oh + st[2].nconc) + tier.w], st[3], st[4], st[2].per
      for y = 1, #list, 3 do
        local e = (list[y + 1] - cs) * per - cu
        if (list[y] - cs) * per - cu <= from and from < e and list[y + 2] + cost > tier.count then
          from = e
        end
      end
    end
    return from
  end

  -- `F.status` of a GCRA tier, `cal_status` of a calendar tier: what is left, and when the
  -- tier is full again (units from now).
  local function flat_status(st, tier)
    if tier.kind == 0 then
      local en = max(st[7 + 3 * tier.r], 0)
      local room, q = tier.tau - en, 0
      if room >= 0 then
        local T = tier.T
        q = floor(room / T)
        if q * T > room then q = q - 1 elseif (q + 1) * T <= room then q = q + 1 end
      end
      return q, en
    end
    local list, cs, cu, per = st[(st[2].oh + st[2].nconc) + tier.w], st[3], st[4], st[2].per
    local current, n = 0, #list
    for y = 1, n, 3 do
      if (list[y] - cs) * per - cu <= 0 and 0 < (list[y + 1] - cs) * per - cu then
        current = list[y + 2]
      end
    end
    local reset = 0
    if n > 0 then reset = max(0, (list[n - 1] - cs) * per - cu) end
    return max(0, tier.count - current), reset
  end

  -- `cover` of the bounds at `p` of the checks (their number, then the seconds).
  local function flat_cover(st, p)
    local cs, cu, per = st[3], st[4], st[2].per
    for x = p + 1, p + C[p] - 1 do
      if (C[x] - cs) * per - cu <= 0 and (C[x + 1] - cs) * per - cu > 0 then return end
    end
    return error('tollgate: the calendar windows sent do not cover the server clock (clock skew above 60 s?)')
  end

  -- `cal_charge` of a check (no settlement's window), flat.
  local function flat_cal_charge(st, tier, p, at, cost)
    local cs, cu, per = st[3], st[4], st[2].per
    local s, e = nil, nil
    for x = p + 1, p + C[p] - 1 do
      if (C[x] - cs) * per - cu <= at and at < (C[x + 1] - cs) * per - cu then
        s, e = C[x], C[x + 1]
        break
      end
    end
    if not s then return end
    st[7] = true
    local list = st[(st[2].oh + st[2].nconc) + tier.w]
    local n = #list
    for y = 1, n, 3 do
      if list[y] == s then
        list[y + 2] = list[y + 2] + cost
        return
      end
    end
    local p2 = n + 1
    for y = 1, n, 3 do
      if list[y] > s then p2 = y; break end
    end
    table.insert(list, p2, cost)
    table.insert(list, p2, e)
    table.insert(list, p2, s)
  end

  -- Per check, reused: the position of each calendar tier's bounds in the record.
  local BP = {}

  -- `check` of a policed request, flat: any case (`flat_check` takes the common one).
  local function flat_decide(st, i)
    local pol = st[2]
    local n, tiers = pol.n, pol.tiers
    local own, viol = OWN, VIOL
    local zero, over = true, false
    for t = 1, n do
      local cost = C[i + 5 + t]
      if cost > 0 then zero = false end
      if cost > tiers[t].cap then over = true end
    end
    local p = i + 7 + n
    for w = 1, pol.ncal do
      BP[w] = p
      p = p + 1 + C[p]
    end
    local h1, h2, h3
    if zero then
      for t = 1, n do own[t], viol[t] = -1, 0 end
      h1, h2, h3 = 1, 0, -1
    elseif over then
      for t = 1, n do
        own[t], viol[t] = -1, 0
        if C[i + 5 + t] > tiers[t].cap then viol[t] = 1 end
      end
      h1, h2, h3 = 2, 0, -1
    else
      -- The instant the request leaves (`converge`), as `check` finds it.
      local rounds = 2
      for w = 1, pol.ncal do rounds = rounds + 2 * (#st[(pol.oh + pol.nconc) + w] / 3) end
      local at, settled = 0, false
      for _ = 1, rounds do
        local nxt = at
        for t = 1, n do
          local cost = C[i + 5 + t]
          if cost > 0 then
            local e = flat_earliest(st, tiers[t], at, cost)
            if e > nxt then nxt = e end
          end
        end
        if nxt == at then settled = true; break end
        at = nxt
      end
      local full, any_full = FULL, false
      for t = 1, n do
        local tier, cost = tiers[t], C[i + 5 + t]
        full[t] = false
        if tier.kind == 1 and cost > 0 then
          local _, h = flat_held(st, tier)
          if h + cost > tier.max then full[t] = true; any_full = true end
        end
      end
      local retry = -1
      if not settled then
        at, retry = 0, 1
      elseif at > 0 then
        retry = at
      end
      for t = 1, n do
        local tier = tiers[t]
        if tier.kind == 2 and C[i + 5 + t] > 0 then flat_cover(st, BP[tier.w]) end
      end
      if retry ~= -1 or any_full then
        for t = 1, n do
          local tier, cost = tiers[t], C[i + 5 + t]
          own[t], viol[t] = -1, 0
          if full[t] then
            viol[t] = 1
          elseif cost > 0 and tier.kind ~= 1 then
            local e = flat_earliest(st, tier, 0, cost)
            if e > 0 then own[t], viol[t] = e, 1 end
          end
        end
        h1, h2, h3 = 0, 0, retry
      else
        for t = 1, n do
          local tier, cost = tiers[t], C[i + 5 + t]
          if cost > 0 then
            local kind = tier.kind
            if kind == 0 then
              local q = 7 + 3 * tier.r
              local b = st[q]
              if b < at then b = at end
              st[q] = b + cost * tier.T
              st[7], st[8] = true, true
            elseif kind == 2 then
              flat_cal_charge(st, tier, BP[tier.w], at, cost)
              st[8] = true
            else
              -- `take`: every slot of the lease in one ZADD.
              local z, h = flat_held(st, tier)
              local id, e = C[i + 5], num(flat_ms(st) + tier.lease)
              local added
              if cost == 1 then
                added = call('ZADD', z, e, K.slot(id, 0))
              else
                local args = {}
                for j = 0, cost - 1 do
                  args[2 * j + 1], args[2 * j + 2] = e, K.slot(id, j)
                end
                added = call('ZADD', z, unpack(args))
              end
              st[pol.oh + tier.q] = h + added
              call('PEXPIRE', z, num(tier.lease + pol.grace))
            end
          end
          own[t], viol[t] = -1, 0
        end
        h1, h2, h3 = 1, at, -1
      end
    end
    local r = nreply
    reply[r + 1], reply[r + 2], reply[r + 3] = h1, h2, h3
    r = r + 3
    for t = 1, n do
      local tier = tiers[t]
      local remaining, reset
      if tier.kind == 1 then
        local _, h = flat_held(st, tier)
        remaining, reset = max(0, tier.max - h), 0
      else
        remaining, reset = flat_status(st, tier)
      end
      reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] =
        remaining, reset, own[t], viol[t], 0
      r = r + 5
    end
    nreply = r
  end

  -- `check` of a policed request, flat. The common case inline, without a call per tier: no
  -- concurrency tier, a cost within every tier's capacity, and every tier admitting it now
  -- (the first round of `converge` settles at 0: a GCRA tier's `b + cost T - tau <= 0`, a
  -- calendar tier's window holding now not too full), so the request is charged now, in the
  -- window of the bounds holding now (what `cover` finds); any other goes to `flat_decide`.
  -- Function calls and loops are most of a check's server time here: this case makes none.
  local function flat_check(st, i)
    local pol = st[2]
    local n, tiers = pol.n, pol.tiers
    local cs, cu, per, oc = st[3], st[4], pol.per, pol.oh + pol.nconc
    if pol.nconc > 0 then return flat_decide(st, i) end
    local zero, slow = true, false
    for t = 1, n do
      local cost = C[i + 5 + t]
      if cost > 0 then
        zero = false
        local tier = tiers[t]
        if cost > tier.cap then
          slow = true
        elseif tier.kind == 0 then
          local b = st[7 + 3 * tier.r]
          if b < 0 then b = 0 end
          if b + cost * tier.T - tier.tau > 0 then slow = true end
        else -- a calendar tier (kind 2)
          local list = st[oc + tier.w]
          for y = 1, #list, 3 do
            if (list[y] - cs) * per - cu <= 0 and 0 < (list[y + 1] - cs) * per - cu
                and list[y + 2] + cost > tier.count then
              slow = true
            end
          end
        end
      end
    end
    if zero or slow then return flat_decide(st, i) end
    -- Charged now, tier by tier (a calendar tier's bounds follow the costs and the class).
    local p = i + 7 + n
    for t = 1, n do
      local tier, cost = tiers[t], C[i + 5 + t]
      if tier.kind == 0 then
        if cost > 0 then
          local q = 7 + 3 * tier.r
          local b = st[q]
          if b < 0 then b = 0 end
          st[q] = b + cost * tier.T
          st[7], st[8] = true, true
        end
      else
        local nb = C[p]
        if cost > 0 then
          local s, e = nil, nil
          for x = p + 1, p + nb - 1 do
            if (C[x] - cs) * per - cu <= 0 and (C[x + 1] - cs) * per - cu > 0 then
              s, e = C[x], C[x + 1]
              break
            end
          end
          if not s then
            return error('tollgate: the calendar windows sent do not cover the server clock (clock skew above 60 s?)')
          end
          st[7], st[8] = true, true
          local list = st[oc + tier.w]
          local m, found = #list, false
          for y = 1, m, 3 do
            if list[y] == s then
              list[y + 2] = list[y + 2] + cost
              found = true
              break
            end
          end
          if not found then
            local p2 = m + 1
            for y = 1, m, 3 do
              if list[y] > s then p2 = y; break end
            end
            table.insert(list, p2, cost)
            table.insert(list, p2, e)
            table.insert(list, p2, s)
          end
        end
        p = p + 1 + nb
      end
    end
    -- The reply: `flat_status` of each tier, inline.
    local r = nreply
    reply[r + 1], reply[r + 2], reply[r + 3] = 1, 0, -1
    r = r + 3
    for t = 1, n do
      local tier = tiers[t]
      local remaining, reset
      if tier.kind == 0 then
        local en = st[7 + 3 * tier.r]
        if en < 0 then en = 0 end
        local room, q = tier.tau - en, 0
        if room >= 0 then
          local T = tier.T
          q = floor(room / T)
          if q * T > room then q = q - 1 elseif (q + 1) * T <= room then q = q + 1 end
        end
        remaining, reset = q, en
      else
        local list = st[oc + tier.w]
        local current, m = 0, #list
        for y = 1, m, 3 do
          if (list[y] - cs) * per - cu <= 0 and 0 < (list[y + 1] - cs) * per - cu then
            current = list[y + 2]
          end
        end
        -- (`max`, inline: a C call per tier costs more than the rest.)
        reset = 0
        if m > 0 then
          local e = (list[m - 1] - cs) * per - cu
          if e > 0 then reset = e end
        end
        local left = tier.count - current
        remaining = 0
        if left > 0 then remaining = left end
      end
      reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4], reply[r + 5] =
        remaining, reset, -1, 0, 0
      r = r + 5
    end
    nreply = r
  end

  -- `settle` of a release (no charge changes), flat.
  local function flat_release(st, i)
    if C[i + 4] ~= 1 then return end
    local pol = st[2]
    for t = 1, pol.n do
      local tier = pol.tiers[t]
      local j = i + 5 + (t - 1) * 5
      if tier.kind == 1 and C[j] > 0 then
        local gone = K.give_back(KEYS[st[1] + tier.q], C[j + 4], C[j])
        local x = pol.oh + tier.q
        if st[x] then st[x] = st[x] - gone end
      end
    end
  end

  -- The numbers a key's state is packed from, reused (`pack` takes how many).
  local V = {}

  -- The batch.
  local i, nc = 1, #C
  while i <= nc do
    local op, k, pol = C[i], C[i + 1], POL[C[i + 2]]
    local name = KEYS[k]
    local st = cache[name]
    if not st and op == 2 and pol.lean then
      release_only(k, pol, i)
    else
      if not st then
        -- `load`, flat and inline.
        local c = CLOCKS[pol.unit] or clock_of(pol.unit)
        local cs, cu, per = c.s, c.u, pol.per
        st = { k, pol, cs, cu, false, false, false, false, name, unpack(pol.blank) }
        local packed = STORED[name]
        if not packed then
          for r = 1, pol.nrate do
            local q = 7 + 3 * r
            -- Fresh: the TAT in the past; `last` now (what `F.save` writes for it).
            st[q], st[q + 1], st[q + 2] = 0, cs, cu
          end
          for w = 1, pol.ncal do st[(pol.oh + pol.nconc) + w] = {} end
        else
          -- (`doubles`, inline.) The position struct.unpack returns last is dropped, as
          -- `doubles` drops it: a value shorter than the policy's state (never written by a
          -- version of this layout) then fails on a missing number, not reads the position.
          local nd = #packed / 8
          local raw = { sunpack(FMT[nd] or fmt(nd), packed) }
          raw[#raw] = nil
          local g1, g2 = raw[1], raw[2]
          -- Time never goes back for a key (see `load`): the flat path's policies all keep a
          -- guard.
          if (g1 - cs) * per + (g2 - cu) > 0 then
            cs, cu = g1, g2
            st[3], st[4] = cs, cu
          end
          st[5], st[6] = g1, g2
          local j = 2
          for w = 1, pol.ncal do
            -- The windows counted, less those that ended.
            j = j + 1
            local m = raw[j]
            local kept
            if m == 1 and (raw[j + 2] - cs) * per - cu > 0 then
              kept = { raw[j + 1], raw[j + 2], raw[j + 3] }
              j = j + 3
            else
              kept = {}
              local y = 0
              for _ = 1, m do
                if (raw[j + 2] - cs) * per - cu > 0 then
                  kept[y + 1], kept[y + 2], kept[y + 3] = raw[j + 1], raw[j + 2], raw[j + 3]
                  y = y + 3
                else
                  st[7] = true
                end
                j = j + 3
              end
            end
            st[(pol.oh + pol.nconc) + w] = kept
          end
          -- The stored fraction (raw[y + 3]) is not read, and the write-back writes 0: a
          -- whole-unit policy never has one, and a changed quota changes the state key's name,
          -- so no state written under a fractional emission interval is read here.
          for r = 1, pol.nrate do
            local q, y = 7 + 3 * r, j + 5 * r - 5
            st[q], st[q + 1], st[q + 2] = (raw[y + 1] - cs) * per + (raw[y + 2] - cu), raw[y + 4], raw[y + 5]
          end
        end
        cache[name] = st
        order[#order + 1] = st
      end
      if op == 1 then flat_check(st, i) else flat_release(st, i) end
    end
    i = i + C[i + 3]
  end
  -- The write-back (the general path's, below), flat and inline: per key a function call
  -- costs about as much as the work.
  for x = 1, #order do
    local st = order[x]
    if st[7] or st[8] then
      local pol = st[2]
      local cs, cu, per, oc = st[3], st[4], pol.per, pol.oh + pol.nconc
      -- The TTL: the latest reset of `flat_status`, inline.
      local ttl = 0
      for r = 1, pol.nrate do
        local en = st[7 + 3 * r]
        if en > ttl then ttl = en end
      end
      for w = 1, pol.ncal do
        local list = st[oc + w]
        local m = #list
        if m > 0 then
          local e = (list[m - 1] - cs) * per - cu
          if e > ttl then ttl = e end
        end
      end
      if ttl <= 0 then
        call('DEL', st[9])
      else
        -- The guard moves with charges only (see the write-back below).
        local v = V
        v[1], v[2] = cs, cu
        if st[5] and not st[8] then v[1], v[2] = st[5], st[6] end
        local m = 2
        for w = 1, pol.ncal do
          local list = st[oc + w]
          local nl = #list
          v[m + 1] = nl / 3
          for y = 1, nl do v[m + 1 + y] = list[y] end
          m = m + 1 + nl
        end
        for r = 1, pol.nrate do
          local q = 7 + 3 * r
          -- `abs`: the TAT as (seconds, units); the fraction is 0.
          local u = cu + st[q]
          local sx = floor(u / per)
          if sx * per > u then sx = sx - 1 elseif (sx + 1) * per <= u then sx = sx + 1 end
          v[m + 1], v[m + 2], v[m + 3], v[m + 4], v[m + 5] = cs + sx, u - sx * per, 0, st[q + 1], st[q + 2]
          m = m + 5
        end
        -- (`pack`, inline: a state of calendar windows holds a few hundred numbers at most.)
        local packed = m <= 4000 and spack(FMT[m] or fmt(m), unpack(v, 1, m)) or pack(v, m)
        call('SET', st[9], packed, 'PX', ceil(ttl * pol.unit / 1e6) + pol.grace)
      end
    end
  end
  return finish()
end


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
