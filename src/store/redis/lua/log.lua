-- Sliding window log: one sorted set per tier, one weighted entry per admitted request, the
-- live weight kept beside it. Mirrors src/algorithm/log.rs. Every operation reads only what it
-- needs: the entries that expired, the oldest entries that must expire for a request to fit
-- (at most its cost of them), the newest entry; never the whole log.
-- Member: struct '<dd' (id, weight); score: the entry's instant minus the tier's base.
-- State, per tier: the base as (seconds, units), the live weight, the next id.

local F = { log = true }

-- Rebase when the base is older than this (2^49 units): scores stay below 2^53.
local REBASE = 562949953421312

local function weight(member)
  local _, w = sunpack('<dd', member)
  return w
end

-- The weight of the entries with base-relative scores in (lo, hi].
local function weight_between(t, lo, hi)
  local total = 0
  local es = call('ZRANGEBYSCORE', t.z, '(' .. num(lo), num(hi))
  for i = 1, #es do total = total + weight(es[i]) end
  return total
end

function F.tier(p)
  return { c = p.c, p = p.p, b = p.b, z = false, base = 0, total = 0, next_id = 0 }
end

function F.load(st, raw, o)
  for i = 1, st.n do
    local t = st.tiers[i]
    t.z = KEYS[st.k + i]
    if raw then
      local j = o + (i - 1) * 4
      t.base, t.total, t.next_id = rel(st.c, raw[j + 1], raw[j + 2]), raw[j + 3], raw[j + 4]
    else
      t.base, t.total, t.next_id = 0, 0, 0
    end
    if t.total > 0 then
      -- Prune the entries that are no longer live: instant + period <= now.
      local cut = -t.p - t.base
      local gone = call('ZRANGEBYSCORE', t.z, '-inf', num(cut))
      if #gone > 0 then
        for g = 1, #gone do t.total = t.total - weight(gone[g]) end
        call('ZREMRANGEBYSCORE', t.z, '-inf', num(cut))
        st.dirty = true
      end
    end
    if t.total == 0 then
      if t.base ~= 0 then st.dirty = true end
      t.base = 0
    elseif t.base < -REBASE then
      -- Rare (a log busy without a pause for 2^49 units): move every live entry to base now.
      local all = call('ZRANGE', t.z, 0, -1, 'WITHSCORES')
      for j = 1, #all, 2 do
        call('ZADD', t.z, num(tonumber(all[j + 1]) + t.base), all[j])
      end
      t.base = 0
      st.dirty = true
    end
  end
end

function F.save(st, v)
  for i = 1, st.n do
    local t = st.tiers[i]
    local bs, bu = abs(st.c, t.base)
    v[#v + 1], v[#v + 2], v[#v + 3], v[#v + 4] = bs, bu, t.total, t.next_id
  end
  return v
end

function F.capacity(t)
  return t.c
end

-- The earliest instant >= from at which `cost` more fits: the oldest live entries leave one
-- by one (those of one instant together) until the live weight has room.
function F.earliest(st, t, from, cost)
  local live = t.total
  if from > 0 and live > 0 then
    -- Entries that expire between now and `from` no longer count at `from`.
    live = live - weight_between(t, -t.p - t.base, from - t.p - t.base)
  end
  local excess = live + cost - t.c
  if excess <= 0 then return from end
  -- Each entry weighs at least 1: the first `excess` live entries free enough.
  local es = call('ZRANGEBYSCORE', t.z, '(' .. num(from - t.p - t.base), '+inf', 'WITHSCORES',
    'LIMIT', 0, num(excess))
  local freed = 0
  for j = 1, #es, 2 do
    freed = freed + weight(es[j])
    if freed >= excess then return tonumber(es[j + 1]) + t.base + t.p end
  end
  return from
end

function F.charge(st, t, at, cost)
  local id = t.next_id
  t.next_id = id + 1
  call('ZADD', t.z, num(at - t.base), spack('<dd', id, cost))
  t.total = t.total + cost
  st.dirty = true
  return id
end

-- Both the id and the instant must match: ids restart when a key's state is dropped, so a
-- stale ticket's id alone could name an entry of the key's next life; its instant cannot.
function F.refund(st, t, at, id, charged, cost)
  local member = spack('<dd', id, charged)
  local score = call('ZSCORE', t.z, member)
  if not score or tonumber(score) + t.base ~= at then return end
  call('ZREM', t.z, member)
  local left = charged - min(charged, cost)
  if left > 0 then call('ZADD', t.z, score, spack('<dd', id, left)) end
  t.total = t.total - (charged - left)
  st.dirty = true
end

function F.queue_wait(st, t, at)
  return 0
end

function F.status(st, t)
  local remaining = max(0, t.c - t.total)
  local reset = 0
  if t.total > 0 then
    local last = call('ZRANGE', t.z, -1, -1, 'WITHSCORES')
    if last[2] then reset = max(0, tonumber(last[2]) + t.base + t.p) end
  end
  return remaining, reset
end

-- The sets expire with the state.
function F.expire(st, ms)
  for i = 1, st.n do
    local t = st.tiers[i]
    if t.total > 0 then call('PEXPIRE', t.z, num(ms)) else call('DEL', t.z) end
  end
end

function F.drop(st)
  for i = 1, st.n do call('DEL', st.tiers[i].z) end
end
