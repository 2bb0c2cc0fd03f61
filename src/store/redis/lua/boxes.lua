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
-- Every box the batch names is read once (one MGET) and written once, at the end; each record
-- sees it as the records before left it, so two state keys of one box (the bindings before
-- and after a reload, in one batch) share it as memory's hand-over does. A record works on
-- the box relative to its key's now (`enter`), then puts it back (`leave`).
--
-- Made by kinds.lua only for a batch with penalty boxes (`boxes()` makes the functions: every
-- function a call of a script defines is a closure made anew, paid for on every call).

local function boxes(C, POL)
  local BOX = {}
  -- By key name, the boxes as stored: `till` false or { seconds, nanoseconds }, `at` the
  -- breaches as such pairs, `dirty`, and what writing it needs (the longest window seen, in
  -- nanoseconds, and the grace); `names` in the order first read.
  local cache, names = nil, {}

  -- The key of the `x`-th box of the key whose state key is `KEYS[k]`: after the sliding-log
  -- sets (log family) and the lease sets.
  local function name(k, pol, x)
    if F.log then return KEYS[k + pol.nrate + pol.nconc + x] end
    return KEYS[k + pol.nconc + x]
  end

  -- Reads every box the records name, in one MGET.
  local function fetch()
    cache = {}
    local i = 1
    while i <= #C do
      local k, pol = C[i + 1], POL[C[i + 2]]
      for x = 1, pol.npen do
        local n = name(k, pol, x)
        if not cache[n] then
          cache[n] = true
          names[#names + 1] = n
        end
      end
      i = i + C[i + 3]
    end
    local values = call('MGET', unpack(names))
    for j, n in ipairs(names) do
      local e = { till = false, at = {}, dirty = false, within = 0, grace = 0 }
      if values[j] then
        local raw = doubles(values[j])
        if raw[1] == 1 then e.till = { raw[2], raw[3] } end
        local y = 4
        for _ = 1, raw[4] do
          e.at[#e.at + 1] = { raw[y + 1], raw[y + 2] }
          y = y + 2
        end
      end
      cache[n] = e
    end
  end

  -- A stored (seconds, nanoseconds) relative to the clock `c`, in units of `unit` ns.
  local function since(c, unit, s, ns, up)
    local u = ns / unit
    if up then u = ceil(u) else u = floor(u) end
    return rel(c, s, u)
  end

  -- The boxes of `st` into `st.pen`, as `{ at, till, dirty, name }` relative to the key's
  -- now: a block that ended and the breaches that left the window are forgotten
  -- (`Strikes::prune`), which rewrites the box and the key's state (as a pruned window does).
  BOX.enter = function(st)
    if not cache then fetch() end
    local pol = st.pol
    for _, tier in ipairs(pol.tiers) do
      local p = tier.pen
      if p then
        local n = name(st.k, pol, p.x)
        local e = cache[n]
        local box = { at = {}, till = nil, dirty = false, name = n }
        if e.till then
          box.till = since(st.c, pol.unit, e.till[1], e.till[2], true)
          if box.till <= 0 then
            box.till, e.till, e.dirty, st.dirty = nil, false, true, true
          end
        end
        local kept = {}
        for _, a in ipairs(e.at) do
          local r = since(st.c, pol.unit, a[1], a[2], false)
          if r + p.within > 0 then
            box.at[#box.at + 1] = r
            kept[#kept + 1] = a
          else
            e.dirty, st.dirty = true, true
          end
        end
        e.at = kept
        if p.within * pol.unit > e.within then e.within = p.within * pol.unit end
        e.grace = pol.grace
        st.pen[p.x] = box
      end
    end
  end

  -- Puts back what a record changed of the boxes of `st`.
  BOX.leave = function(st)
    local pol = st.pol
    for _, box in ipairs(st.pen) do
      if box.dirty then
        local e = cache[box.name]
        e.dirty, e.till, e.at = true, false, {}
        if box.till then
          local s, u = abs(st.c, box.till)
          e.till = { s, u * pol.unit }
        end
        for _, a in ipairs(box.at) do
          local s, u = abs(st.c, a)
          e.at[#e.at + 1] = { s, u * pol.unit }
        end
        box.dirty = false
      end
    end
  end

  -- Writes back every box that changed, with a TTL of what it needs from the server's now
  -- (the block, the last breach's window); deletes one with nothing left.
  BOX.save = function()
    if not cache then return end
    -- Milliseconds from now until an instant (seconds, nanoseconds).
    local function left(t) return (t[1] - now_s) * 1000 + (t[2] - now_ns) / 1e6 end
    for _, n in ipairs(names) do
      local e = cache[n]
      if e.dirty then
        local ttl = e.till and left(e.till) or 0
        for _, a in ipairs(e.at) do ttl = max(ttl, left(a) + e.within / 1e6) end
        if ttl <= 0 then
          call('DEL', n)
        else
          local v = { 0, 0, 0, #e.at }
          if e.till then v[1], v[2], v[3] = 1, e.till[1], e.till[2] end
          for _, a in ipairs(e.at) do
            v[#v + 1], v[#v + 2] = a[1], a[2]
          end
          call('SET', n, pack(v), 'PX', num(ceil(ttl) + e.grace))
        end
      end
    end
  end

  return BOX
end
