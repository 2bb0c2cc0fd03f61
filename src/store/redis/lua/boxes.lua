-- Penalty boxes (`Strikes` in src/algorithm/penalty.rs), each in a key of its own: the state
-- key's policy and key, and the tier's name (`{prefix}{policy|key}:p:<tier>`, see
-- `Prepared::keys`), not the policy's fingerprint. A reload that changes the policy (the
-- block's length, the tier's quota, its other tiers) finds each key's block and breaches where
-- they were, and instances of a fleet that reload one after another share them.
--
-- Value: packed doubles: blocked (0 or 1), until (seconds, nanoseconds), the breaches counted
-- (number, then each one's seconds and nanoseconds). Nanoseconds rather than the policy's
-- unit, so that a policy whose unit changes reads them too: a block's end rounded up to a
-- unit, a breach's instant down.
--
-- Made by kinds.lua only for a batch with penalty boxes (`boxes()` makes the functions: every
-- function a call of a script defines is a closure made anew, paid for on every call).

local function boxes()
  local BOX = {}

  -- The key of the `x`-th box of the key whose state key is `KEYS[k]`: after the sliding-log
  -- sets (log family) and the lease sets.
  local function name(k, pol, x)
    if F.log then return KEYS[k + pol.nrate + pol.nconc + x] end
    return KEYS[k + pol.nconc + x]
  end

  -- A stored (seconds, nanoseconds) relative to the clock `c`, in units of `unit` ns.
  local function since(c, unit, s, ns, up)
    local u = ns / unit
    if up then u = ceil(u) else u = floor(u) end
    return rel(c, s, u)
  end

  -- The boxes of the key at `KEYS[k]` into `st.pen`, each as `{ at, till, dirty, name,
  -- within }`: a block that ended and the breaches that left the window are forgotten
  -- (`Strikes::prune`), which rewrites the box, and the key's state (as a pruned window
  -- does). Instants relative to the key's now.
  BOX.load = function(st, k, pol)
    st.pen = {}
    for _, tier in ipairs(pol.tiers) do
      local p = tier.pen
      if p then
        local box = { at = {}, till = nil, dirty = false, name = name(k, pol, p.x),
                      within = p.within }
        local packed = call('GET', box.name)
        if packed then
          local raw = doubles(packed)
          if raw[1] == 1 then
            box.till = since(st.c, pol.unit, raw[2], raw[3], true)
            if box.till <= 0 then box.till = nil; box.dirty = true end
          end
          local j = 4
          for _ = 1, raw[4] do
            local a = since(st.c, pol.unit, raw[j + 1], raw[j + 2], false)
            if a + p.within > 0 then box.at[#box.at + 1] = a else box.dirty = true end
            j = j + 2
          end
          if box.dirty then st.dirty = true end
        end
        st.pen[p.x] = box
      end
    end
  end

  -- Writes back each box that changed, with a TTL of what it needs (the block, the last
  -- breach's window); deletes one with nothing left.
  BOX.save = function(st)
    for _, box in ipairs(st.pen) do
      if box.dirty then
        local ttl = box.till or 0
        for _, a in ipairs(box.at) do
          if a + box.within > ttl then ttl = a + box.within end
        end
        if ttl <= 0 then
          call('DEL', box.name)
        else
          local v = { 0, 0, 0, #box.at }
          if box.till then
            local s, u = abs(st.c, box.till)
            v[1], v[2], v[3] = 1, s, u * st.unit
          end
          for _, a in ipairs(box.at) do
            local s, u = abs(st.c, a)
            v[#v + 1], v[#v + 2] = s, u * st.unit
          end
          call('SET', box.name, pack(v), 'PX', ttl_ms(st.unit, ttl, st.grace))
        end
      end
    end
  end

  return BOX
end
