"""The Lua scripts of the Redis replay store (replay/redis_store.py has the key layout).

Every script that changes state runs at most once per operation id. The client picks a fresh
id per call and passes ``P op:<id>`` as the last key; ``once`` stores the script's reply there
(with a TTL longer than the client's retry window) and a re-run with the same id, i.e. redis-py
re-sending the command after a dropped connection whose reply was lost, returns that stored
reply and changes nothing. A run that changed nothing (``reserve`` granting 0, a ``claim`` that
found too few groups, a ``commit`` with nothing to drop) stores no reply: running it again is
the same as running it once, so memoising it would only fill Redis with keys.
"""

from __future__ import annotations

KEY_NAMES = ("ready", "ready_ver", "gver", "gbytes", "seen", "claims", "stats", "refused",
             "evicted", "staleness", "acked", "live_ready", "live_held", "live", "g:")
"""Passed to every script as KEYS, in this order; the last is the prefix of payload keys.
After them come the operation key (``P op:<id>``) and, for ``put``, the staging key."""

RULES = """
-- Transcribed from replay/admission.py; keep the two in step (a test compares them).
local function admission_capacity(max_concurrent, running, eta, version, batch_groups, accepted, evicted)
  local by_concurrency = max_concurrent - running
  local by_staleness = (eta + version + 1) * batch_groups - (accepted - evicted + running)
  return math.max(0, math.min(by_concurrency, by_staleness))
end
local function staleness(learner_version, group_version)
  return math.max(0, learner_version - group_version)
end
local function is_stale(learner_version, group_version, eta)
  return staleness(learner_version, group_version) > eta
end
"""

_LUA_NAMES = {"staleness": "hist", "g:": "gkey"}
"""Lua local names of the keys whose KEY_NAMES entry is not a Lua identifier (or is taken)."""

_BIND_KEYS = "".join(f"local {_LUA_NAMES.get(name, name)} = KEYS[{i}]\n"
                     for i, name in enumerate(KEY_NAMES, start=1))

PRELUDE = RULES + _BIND_KEYS + f"local op_key, op_ttl = KEYS[{len(KEY_NAMES) + 1}], ARGV[#ARGV]  -- see once()\n" + """
local function num(v) return tonumber(v) or 0 end
local function add(key, field, n)  -- HINCRBY, but Lua renders -0 as "-0", which Redis refuses
  if n ~= 0 then redis.call('HINCRBY', key, field, n) end
end
local function stat(name) return num(redis.call('HGET', stats, name)) end
local function release(n)
  redis.call('HSET', stats, 'running', math.max(0, stat('running') - n))
end
local function is_live(gid) return redis.call('SISMEMBER', live, gid) == 1 end
local function drop_payload(gid)
  redis.call('UNLINK', gkey .. gid)  -- a background thread frees the megabyte
  redis.call('HDEL', gbytes, gid)
  redis.call('SREM', live, gid)
end
local function unhold(gid)  -- no longer held (bytes, gver); the payload stays
  add(stats, 'bytes', -num(redis.call('HGET', gbytes, gid)))
  redis.call('HDEL', gver, gid)
  redis.call('SREM', live_held, gid)
end
local function forget(gid)  -- drop a held group's data, keeping its id in `seen`
  unhold(gid)
  drop_payload(gid)
end
local function commit(v)  -- forget the retained groups of claims acknowledged at or before v
  local flat, n = redis.call('HGETALL', acked), 0
  for i = 1, #flat, 2 do
    local rec = cjson.decode(flat[i + 1])
    if rec[1] <= v then
      for _, gid in ipairs(rec[2]) do drop_payload(gid) end
      redis.call('HDEL', acked, flat[i])
      n = n + #rec[2]
    end
  end
  add(stats, 'retained', -n)
  return n
end
-- Run body() at most once per operation key. body returns (reply, changed); only a run that
-- changed state is remembered. on_replay undoes what the re-sent request itself added.
local function once(body, on_replay)
  local done = redis.call('GET', op_key)
  if done then
    if on_replay then on_replay() end
    return cjson.decode(done)
  end
  local reply, changed = body()
  if changed then redis.call('SET', op_key, cjson.encode(reply), 'EX', op_ttl) end
  return reply
end
"""

# Each body reads its arguments from ARGV[1..]; the client appends the operation TTL last.
_BODIES = {
    "reserve": """
return once(function()
  local running = stat('running')
  local granted = math.min(tonumber(ARGV[1]), admission_capacity(tonumber(ARGV[2]), running,
    tonumber(ARGV[3]), stat('version'), tonumber(ARGV[4]), stat('accepted'), stat('scheduled_evicted')))
  redis.call('HSET', stats, 'running', running + granted)
  return granted, granted > 0
end)
""",
    "release": """
return once(function()
  release(tonumber(ARGV[1]))
  return 0, true
end)
""",
    # A re-sent put also re-SETs its staging key in the same pipeline: on_replay unlinks it.
    # ARGV: gid, nbytes, version, capacity_groups, capacity_bytes, eta, scheduled (1/0),
    # live_capacity_groups.
    "put": f"""
local staged = KEYS[{len(KEY_NAMES) + 2}]
""" + """
local function put()
  local gid, nbytes, v = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
  local scheduled = ARGV[7] == '1'
  local function refuse(reason, detail)
    redis.call('UNLINK', staged)
    redis.call('HINCRBY', refused, reason, 1)
    return {reason, detail}, true
  end
  if redis.call('SISMEMBER', seen, gid) == 1 then
    return refuse('duplicate', 'group ' .. gid .. ' was already accepted')
  end
  local held, bytes = redis.call('HLEN', gver), stat('bytes')
  if held >= tonumber(ARGV[4]) or bytes + nbytes > tonumber(ARGV[5]) then
    return refuse('full', held .. ' groups / ' .. bytes .. ' bytes held')
  end
  local live_n = redis.call('SCARD', live_held)
  if not scheduled and live_n >= tonumber(ARGV[8]) then
    return refuse('live_full', live_n .. ' live groups held')
  end
  -- a scheduled group is finished, whatever happens next: its reservation ends here
  if scheduled then release(1) end
  local version, eta = stat('version'), tonumber(ARGV[6])
  if is_stale(version, v, eta) then
    return refuse('stale', 'group version ' .. v .. ' < ' .. (version - eta))
  end
  redis.call('SADD', seen, gid)
  if scheduled then
    redis.call('RPUSH', ready, gid)
    redis.call('HINCRBY', stats, 'accepted', 1)
  else
    redis.call('RPUSH', live_ready, gid)
    redis.call('SADD', live, gid)
    redis.call('SADD', live_held, gid)
    redis.call('HINCRBY', stats, 'live_accepted', 1)
  end
  redis.call('ZADD', ready_ver, v, gid)
  redis.call('RENAME', staged, gkey .. gid)
  redis.call('PERSIST', gkey .. gid)  -- the staging key's TTL: held now until commit
  redis.call('HSET', gver, gid, v)
  redis.call('HSET', gbytes, gid, nbytes)
  redis.call('HINCRBY', stats, 'bytes', nbytes)
  return {'accepted', ''}, true
end
return once(put, function() redis.call('UNLINK', staged) end)
""",
    # Evicting stale groups is idempotent by itself; only a claim that took groups is kept.
    # ARGV: num_groups, eta, fewest live, most live.
    "claim": """
return once(function()
  local n, eta, version = tonumber(ARGV[1]), tonumber(ARGV[2]), stat('version')
  for _, gid in ipairs(redis.call('ZRANGEBYSCORE', ready_ver, '-inf', '(' .. (version - eta))) do
    if is_stale(version, num(redis.call('HGET', gver, gid)), eta) then
      local live = is_live(gid)
      redis.call('LREM', live and live_ready or ready, 1, gid)
      redis.call('ZREM', ready_ver, gid)
      forget(gid)
      redis.call('HINCRBY', evicted, 'stale', 1)
      if not live then redis.call('HINCRBY', stats, 'scheduled_evicted', 1) end
    end
  end
  local n_live = math.min(tonumber(ARGV[4]), redis.call('LLEN', live_ready))
  if n_live < tonumber(ARGV[3]) or redis.call('LLEN', ready) < n - n_live then return false, false end
  local gids = {}
  for _, list_n in ipairs({{live_ready, n_live}, {ready, n - n_live}}) do
    if list_n[2] > 0 then
      for _, gid in ipairs(redis.call('LPOP', list_n[1], list_n[2])) do gids[#gids + 1] = gid end
    end
  end
  local cid = 'c' .. (redis.call('HINCRBY', stats, 'claim_seq', 1) - 1)
  local ages = {}
  for i, gid in ipairs(gids) do
    redis.call('ZREM', ready_ver, gid)
    ages[i] = staleness(version, num(redis.call('HGET', gver, gid)))
    redis.call('HINCRBY', hist, ages[i], 1)
  end
  redis.call('HSET', claims, cid, cjson.encode(gids))
  return {cid, gids, ages}, true
end)
""",
    # ARGV: claim id, new version, commit (1/0: commit(new version) too).
    "ack": """
return once(function()
  local raw = redis.call('HGET', claims, ARGV[1])
  if not raw then return false, false end
  local gids, vers, n_live = cjson.decode(raw), {}, 0
  for i, gid in ipairs(gids) do  -- payload retained until commit
    vers[i] = num(redis.call('HGET', gver, gid))
    if is_live(gid) then n_live = n_live + 1 end
    unhold(gid)
  end
  add(stats, 'live_trained', n_live)
  redis.call('HDEL', claims, ARGV[1])
  redis.call('HSET', acked, ARGV[1], cjson.encode({tonumber(ARGV[2]), gids, vers}))
  redis.call('HINCRBY', stats, 'trained', #gids)
  redis.call('HINCRBY', stats, 'retained', #gids)
  if tonumber(ARGV[2]) > stat('version') then redis.call('HSET', stats, 'version', ARGV[2]) end
  if ARGV[3] == '1' then commit(tonumber(ARGV[2])) end
  return #gids, true
end)
""",
    "commit": """
return once(function()
  local n = commit(tonumber(ARGV[1]))
  return n, n > 0
end)
""",
    "recover": """
return once(function()
  local order, requeued = {}, 0
  local function seq(cid) return tonumber(string.sub(cid, 2)) end
  local flat = redis.call('HGETALL', claims)
  for i = 1, #flat, 2 do
    local gids, vers = cjson.decode(flat[i + 1]), {}
    for j, gid in ipairs(gids) do vers[j] = num(redis.call('HGET', gver, gid)) end
    order[#order + 1] = {seq(flat[i]), gids, vers}
  end
  redis.call('DEL', claims)
  if ARGV[1] ~= '' then  -- rewind to the checkpoint: claims trained after it are delivered again
    local v, back, live_back = tonumber(ARGV[1]), 0, 0
    commit(v)
    flat = redis.call('HGETALL', acked)
    for i = 1, #flat, 2 do
      local rec = cjson.decode(flat[i + 1])
      order[#order + 1] = {seq(flat[i]), rec[2], rec[3]}
      for j, gid in ipairs(rec[2]) do
        redis.call('HSET', gver, gid, rec[3][j])
        redis.call('HINCRBY', stats, 'bytes', num(redis.call('HGET', gbytes, gid)))
        if is_live(gid) then
          redis.call('SADD', live_held, gid)
          live_back = live_back + 1
        end
      end
      back = back + #rec[2]
    end
    redis.call('DEL', acked)
    add(stats, 'trained', -back)
    add(stats, 'live_trained', -live_back)
    add(stats, 'retained', -back)
    redis.call('HSET', stats, 'version', v)
  end
  -- newest claim first and each claim back to front: LPUSH then leaves the oldest at the head
  table.sort(order, function(a, b) return a[1] > b[1] end)
  for _, c in ipairs(order) do
    for i = #c[2], 1, -1 do
      redis.call('LPUSH', is_live(c[2][i]) and live_ready or ready, c[2][i])
      redis.call('ZADD', ready_ver, c[3][i], c[2][i])
      requeued = requeued + 1
    end
  end
  return requeued, true
end)
""",
}

SCRIPTS = {name: PRELUDE + body for name, body in _BODIES.items()}
"""The full text of each script, by operation name."""
