-- kinds.lua, continued (the scripts are one chunk: kinds.lua, this file, kinds_general.lua).
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
          -- Fresh: the TAT and `last` far in the past, as `F.load` makes them (see gcra.lua's
          -- FRESH), and `F.save` writes them.
          local fs, fu = abs(c, -4503599627370496)
          for r = 1, pol.nrate do
            local q = 7 + 3 * r
            st[q], st[q + 1], st[q + 2] = -4503599627370496, fs, fu
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

