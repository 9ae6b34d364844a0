//! The Lua scripts. Each runs atomically on the server, so every read-decide-write of a record
//! is one step: no other command interleaves (R3: no check-then-set).
//!
//! Records are hashes with these fields (absent when not set):
//! `st` state code, `fp` 32-byte fingerprint, `res` result or reason, `att` attempt, `tok` fencing
//! token, `prev` state taken over, `cr`/`up` created/updated, `lu` lease end, `exp` logical
//! expiry, `sc`/`id` the key's scope and id. Times are microseconds of the server's `TIME` plus
//! the clock offset passed as the last `ARGV` (always 0 outside tests). Numbers are written with
//! `%.0f`, exact for integers below 2^53 (µs timestamps are about 2^51).

/// Shared helpers, prepended to every script.
const PRELUDE: &str = r#"
local function now_us(offset)
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(offset)
end
local function s(n) return string.format('%.0f', n) end
-- Native TTL for a record whose logical expiry is `exp`: whole milliseconds, rounded up, so
-- Redis never deletes a record before its logical expiry.
local function ttl(k, exp, now)
  local ms = math.ceil((exp - now) / 1000)
  if ms < 1 then ms = 1 end
  redis.call('PEXPIRE', k, s(ms))
end
local FIELDS = {'st','fp','res','att','tok','prev','cr','up','lu','exp','sc','id'}
local function record(k) return redis.call('HMGET', k, unpack(FIELDS)) end
"#;

/// One claim, as a function the single and batch scripts call. Replies:
/// `{0, token, attempt, until, prev or -1, fp or false}` acquired;
/// `{1, record}` completed or in doubt; `{2, retry_after_us, attempt}` in progress;
/// `{3, record}` conflict.
const CLAIM_FN: &str = r#"
local function claim(k, scope, id, fp, lease, retain, now)
  local f = redis.call('HMGET', k, 'st', 'fp', 'att', 'tok', 'lu', 'exp')
  local st, sfp, att, tok, lu, exp = f[1], f[2], f[3], f[4], f[5], f[6]
  local untl = now + lease
  local keep = now + math.max(retain, lease)
  local live = st == '0' and lu and tonumber(lu) > now
  if (not st) or (tonumber(exp) <= now and not live) then
    local token = now
    if tok then token = math.max(tonumber(tok) + 1, now) end
    if token < 1 then token = 1 end
    redis.call('DEL', k)
    redis.call('HSET', k, 'st', '0', 'att', '1', 'tok', s(token), 'cr', s(now), 'up', s(now),
      'lu', s(untl), 'exp', s(keep), 'sc', scope, 'id', id)
    if fp ~= '' then redis.call('HSET', k, 'fp', fp) end
    ttl(k, keep, now)
    local rfp = false
    if fp ~= '' then rfp = fp end
    return {0, token, 1, untl, -1, rfp}
  end
  if sfp and fp ~= '' and sfp ~= fp then return {3, record(k)} end
  if st == '1' or st == '4' then return {1, record(k)} end
  if live then return {2, tonumber(lu) - now, tonumber(att)} end
  local token = math.max(tonumber(tok) + 1, now)
  local attempt = tonumber(att) + 1
  local newexp = math.max(tonumber(exp), keep)
  redis.call('HSET', k, 'st', '0', 'prev', st, 'att', s(attempt), 'tok', s(token), 'up', s(now),
    'lu', s(untl), 'exp', s(newexp))
  redis.call('HDEL', k, 'res')
  local rfp = sfp
  if (not sfp) and fp ~= '' then
    redis.call('HSET', k, 'fp', fp)
    rfp = fp
  end
  ttl(k, newexp, now)
  return {0, token, attempt, untl, tonumber(st), rfp}
end
"#;

/// KEYS: the record. ARGV: scope, id, fingerprint ('' for none), lease µs, retain µs, offset.
pub(crate) fn claim() -> String {
    format!(
        "{PRELUDE}{CLAIM_FN}
local now = now_us(ARGV[6])
return claim(KEYS[1], ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), now)"
    )
}

/// KEYS: the records, in request order. ARGV: offset, then 5 per key (scope, id, fingerprint,
/// lease µs, retain µs). One script: the batch is one round trip and one atomic step, and a key
/// repeated in the batch sees its earlier occurrence's claim.
pub(crate) fn claim_many() -> String {
    format!(
        "{PRELUDE}{CLAIM_FN}
local now = now_us(ARGV[1])
local out = {{}}
for i = 1, #KEYS do
  local a = 1 + (i - 1) * 5
  out[i] = claim(KEYS[i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], tonumber(ARGV[a + 4]),
    tonumber(ARGV[a + 5]), now)
end
return out"
    )
}

/// Fenced finish (complete or fail). KEYS: the record. ARGV: token, state code, has result
/// ('1'/'0'), result, retain µs, offset. Replies 1, or 0 when the lease was lost.
pub(crate) fn finish() -> String {
    format!(
        "{PRELUDE}
local k = KEYS[1]
local f = redis.call('HMGET', k, 'st', 'tok')
if f[1] ~= '0' or f[2] ~= ARGV[1] then return 0 end
local now = now_us(ARGV[6])
local exp = now + tonumber(ARGV[5])
redis.call('HSET', k, 'st', ARGV[2], 'up', s(now), 'exp', s(exp))
redis.call('HDEL', k, 'lu')
if ARGV[3] == '1' then redis.call('HSET', k, 'res', ARGV[4]) else redis.call('HDEL', k, 'res') end
ttl(k, exp, now)
return 1"
    )
}

/// Fenced release. KEYS: the record. ARGV: token, offset. Replies 1, or 0 when lost.
pub(crate) fn release() -> String {
    format!(
        "{PRELUDE}
local k = KEYS[1]
local f = redis.call('HMGET', k, 'st', 'tok')
if f[1] ~= '0' or f[2] ~= ARGV[1] then return 0 end
local now = now_us(ARGV[2])
redis.call('HSET', k, 'st', '2', 'up', s(now))
redis.call('HDEL', k, 'lu')
return 1"
    )
}

/// Fenced extend. KEYS: the record. ARGV: token, by µs, offset. Replies the new lease end, or
/// -1 when lost.
pub(crate) fn extend() -> String {
    format!(
        "{PRELUDE}
local k = KEYS[1]
local f = redis.call('HMGET', k, 'st', 'tok', 'exp')
if f[1] ~= '0' or f[2] ~= ARGV[1] then return -1 end
local now = now_us(ARGV[3])
local untl = now + tonumber(ARGV[2])
local exp = math.max(tonumber(f[3]), untl)
redis.call('HSET', k, 'lu', s(untl), 'exp', s(exp), 'up', s(now))
ttl(k, exp, now)
return untl"
    )
}

/// Operator release, whatever the state. KEYS: the record. ARGV: offset. Replies 1 or 0
/// (absent).
pub(crate) fn force_release() -> String {
    format!(
        "{PRELUDE}
local k = KEYS[1]
local tok = redis.call('HGET', k, 'tok')
if not tok then return 0 end
local now = now_us(ARGV[1])
redis.call('HSET', k, 'st', '2', 'tok', s(math.max(tonumber(tok) + 1, now)), 'up', s(now))
redis.call('HDEL', k, 'lu')
return 1"
    )
}

/// Deletes the given records that are logically expired (retention passed, no live lease), at
/// most ARGV[2] of them. KEYS: candidates. ARGV: offset, limit. Replies how many it deleted.
/// Only needed with a test clock offset: without one, Redis' TTL deletes each record at its
/// expiry.
pub(crate) fn purge() -> String {
    format!(
        "{PRELUDE}
local now = now_us(ARGV[1])
local limit = tonumber(ARGV[2])
local n = 0
for i = 1, #KEYS do
  if n >= limit then break end
  local f = redis.call('HMGET', KEYS[i], 'st', 'lu', 'exp')
  if f[3] then
    local live = f[1] == '0' and f[2] and tonumber(f[2]) > now
    if tonumber(f[3]) <= now and not live then
      redis.call('DEL', KEYS[i])
      n = n + 1
    end
  end
end
return n"
    )
}

/// The server's time in µs plus the offset. ARGV: offset.
pub(crate) fn now() -> String {
    format!("{PRELUDE}\nreturn now_us(ARGV[1])")
}
