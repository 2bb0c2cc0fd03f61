-- tollgate: whether the calendar windows each record of a batch carries cover the instant its
-- key decides at: the later of now and the key's clock guard (see `load` in kinds.lua). This
-- process computes the windows (Lua has no time zone data) around its own clock, 60 s either
-- side; after a clock step back of more than that, a key's guard lies past them. The batch
-- then stops before it reads or writes anything else, naming the instant it needs, and the
-- store sends it again with windows that reach it (src/store/redis/cover.rs).

-- Stops the batch with an error naming the latest instant (whole seconds since the epoch) at
-- which a record's key decides that its windows do not cover (with `lookahead` windows after
-- it for a shaped check or a settlement); returns when they all do.
local function cover_all(C, POL, STORED, lookahead)
  local need = nil
  local i = 1
  while i <= #C do
    local op, pol = C[i], POL[C[i + 2]]
    if pol.ncal > 0 and (op == 1 or op == 2) then
      local c = clock_of(pol.unit)
      local s, u, per = c.s, c.u, c.per
      local packed = STORED[KEYS[C[i + 1]]]
      if packed and pol.guard then
        local g1, g2 = sunpack('<dd', packed)
        if (g1 - s) * per + (g2 - u) > 0 then s, u = g1, g2 end
      end
      -- The bounds: after a check's costs and class, or a settlement's charges.
      local p, ahead = i + 5 + 5 * pol.n, lookahead
      if op == 1 then
        p = i + 7 + pol.n
        if C[i + 4] < 0 then ahead = 1 end
      end
      for _ = 1, pol.ncal do
        local nb, ok = C[p], false
        for x = p + 1, p + nb - ahead do
          if (C[x] - s) * per - u <= 0 and (C[x + 1] - s) * per - u > 0 then
            ok = true
            break
          end
        end
        if not ok and (not need or s > need) then need = s end
        p = p + 1 + nb
      end
    end
    i = i + C[i + 3]
  end
  if need then return error('tollgate: calendar windows needed at ' .. num(need) .. ' s') end
end
