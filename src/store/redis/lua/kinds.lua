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
--
-- Files: this one (the layout, the batch's policies and records), kinds_flat.lua (the flat
-- path), kinds_general.lua (the general driver), concatenated into one chunk in that order.

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

