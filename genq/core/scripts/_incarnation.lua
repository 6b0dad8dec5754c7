-- A piece of other scripts, not one itself: `-- #include incarnation` puts it there (genq.core.scripts).
-- incarnation_ok(config key, incarnation): whether the job's stored config is that
-- incarnation (a config of a genq before incarnations has none: ""). A deleted job has no
-- config: nothing is its incarnation. The config is a msgpack map (records.pack).
-- Every script that writes for a job checks it, so nothing of a deleted job lands in its
-- successor (genq.core.ledger, "incarnation").
local function incarnation_ok(config_key, incarnation)
  local raw = redis.call('GET', config_key)
  if not raw then return false end
  return (cmsgpack.unpack(raw)['incarnation'] or '') == incarnation
end
