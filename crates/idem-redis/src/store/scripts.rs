//! The Lua scripts. Each runs atomically on the server, so every read-decide-write of a record
//! is one step: no other command interleaves (no check-then-set).
//!
//! A record is one string value, packed with Redis' built-in `struct` library (see
//! [`super::codec`] for the layout), written with `SET … PX` so the write and the native TTL
//! are one command. One value instead of a hash keeps each script to 2–3 `redis.call`s, the
//! main server-side cost. Times are microseconds of the server's `TIME` plus the clock offset
//! passed as an `ARGV` (always 0 outside tests); doubles hold them exactly (below 2^53).

use redis::Script;

/// Every script, loaded once per store (clones share them).
pub(super) struct Scripts {
    pub(super) claim: Script,
    pub(super) claim_many: Script,
    pub(super) finish: Script,
    pub(super) complete_many: Script,
    pub(super) release: Script,
    pub(super) extend: Script,
    pub(super) force_release: Script,
    pub(super) force_fail: Script,
    pub(super) purge: Script,
    pub(super) now: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            claim: Script::new(&claim()),
            claim_many: Script::new(&claim_many()),
            finish: Script::new(&finish()),
            complete_many: Script::new(&complete_many()),
            release: Script::new(&release()),
            extend: Script::new(&extend()),
            force_release: Script::new(&force_release()),
            force_fail: Script::new(&force_fail()),
            purge: Script::new(&purge()),
            now: Script::new(&now()),
        }
    }
}

/// Shared helpers, prepended to every script.
const PRELUDE: &str = r#"
local function now_us(offset)
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(offset)
end
local HDR = '>BbI4ddddd'
local function decode(v)
  local r = {raw = v}
  local pos
  r.st, r.prev, r.att, r.tok, r.cr, r.up, r.lu, r.exp, pos = struct.unpack(HDR, v)
  r.fp, pos = struct.unpack('>I4c0', v, pos)
  r.hasres, r.res, pos = struct.unpack('>BI4c0', v, pos)
  r.sc, r.id, pos = struct.unpack('>I4c0I4c0', v, pos)
  r.deaths = 0
  if pos <= #v then r.deaths = struct.unpack('>I4', v, pos) end
  return r
end
local function load(k)
  local v = redis.call('GET', k)
  if not v then return nil end
  return decode(v)
end
-- Writes the record with a native TTL at its logical expiry, in whole milliseconds rounded
-- up, so Redis never deletes a record before it expires.
local function save(k, r, now)
  local v = struct.pack('>BbI4dddddI4c0BI4c0I4c0I4c0', r.st, r.prev, r.att, r.tok, r.cr, r.up,
    r.lu, r.exp, #r.fp, r.fp, r.hasres, #r.res, r.res, #r.sc, r.sc, #r.id, r.id)
  if r.deaths > 0 then v = v .. struct.pack('>I4', r.deaths) end
  local ms = math.ceil((r.exp - now) / 1000)
  if ms < 1 then ms = 1 end
  redis.call('SET', k, v, 'PX', string.format('%.0f', ms))
end
local function live(r, now) return r.st == 0 and r.lu > now end
"#;

/// One claim, as a function the single and batch scripts call; `r` is the decoded record
/// (`nil`: none). Replies: `{0, token, attempt, until, prev or -1, fp, deaths}` acquired; `{1, record}`
/// completed or in doubt; `{2, retry_after_us, attempt}` in progress; `{3, record}` conflict.
const CLAIM_FN: &str = r#"
local function claim(k, r, scope, id, fp, lease, retain, now, take)
  local untl = now + lease
  local keep = now + math.max(retain, lease)
  if (not r) or (r.exp <= now and not live(r, now)) then
    local token = now
    if r then token = math.max(r.tok + 1, now) end
    if token < 1 then token = 1 end
    save(k, {st = 0, prev = -1, att = 1, tok = token, cr = now, up = now, lu = untl, exp = keep,
      fp = fp, hasres = 0, res = '', sc = scope, id = id, deaths = 0}, now)
    return {0, token, 1, untl, -1, fp, 0}
  end
  if r.fp ~= '' and fp ~= '' and r.fp ~= fp then return {3, r.raw} end
  if r.st == 1 or r.st == 4 then return {1, r.raw} end
  if live(r, now) then return {2, r.lu - now, r.att} end
  if r.st == 0 and take == 0 then return {2, 0, r.att} end
  if r.st == 0 then r.deaths = r.deaths + 1 end
  r.prev = r.st
  r.st = 0
  r.att = r.att + 1
  r.tok = math.max(r.tok + 1, now)
  r.up = now
  r.lu = untl
  r.exp = math.max(r.exp, keep)
  r.hasres = 0
  r.res = ''
  if r.fp == '' then r.fp = fp end
  save(k, r, now)
  return {0, r.tok, r.att, untl, r.prev, r.fp, r.deaths}
end
"#;

/// KEYS: the record. ARGV: scope, id, fingerprint ('' for none), lease µs, retain µs, offset,
/// takeover (1: take over a lease that ran out; 0: answer it in progress).
pub(crate) fn claim() -> String {
    format!(
        "{PRELUDE}{CLAIM_FN}
local now = now_us(ARGV[6])
return claim(KEYS[1], load(KEYS[1]), ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]),
  tonumber(ARGV[5]), now, tonumber(ARGV[7]))"
    )
}

/// KEYS: the records, in request order. ARGV: offset, then 8 per key (scope, id, fingerprint,
/// lease µs, retain µs, takeover, the packed fresh record or '', its TTL ms). One script: the
/// batch is one round trip and one atomic step, and a key repeated in the batch sees its
/// earlier occurrence's claim. With a fresh record (the fast claim), a key is first
/// `SET … NX GET`: absent, that one command claims it; present, its value is decided as the
/// claim script decides it. `TIME` is read only when some key exists.
pub(crate) fn claim_many() -> String {
    format!(
        "{PRELUDE}{CLAIM_FN}
local now = nil
local out = {{}}
for i = 1, #KEYS do
  local a = 1 + (i - 1) * 8
  local fresh = ARGV[a + 7]
  local r
  if fresh ~= '' then
    local v = redis.call('SET', KEYS[i], fresh, 'NX', 'GET', 'PX', ARGV[a + 8])
    if v then r = decode(v) end
  else
    r = load(KEYS[i])
  end
  if fresh ~= '' and not r then
    local _, _, _, tok, _, _, lu = struct.unpack('>BbI4ddddd', fresh)
    out[i] = {{0, tok, 1, lu, -1, ARGV[a + 3], 0}}
  else
    if not now then now = now_us(ARGV[1]) end
    out[i] = claim(KEYS[i], r, ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], tonumber(ARGV[a + 4]),
      tonumber(ARGV[a + 5]), now, tonumber(ARGV[a + 6]))
  end
end
return out"
    )
}

/// One fenced finish, as a function the single and batch scripts call: 1, or 0 when the lease
/// was lost. The hot path of every message, so it touches only what changes: the header is
/// read up to the token, the fingerprint and the scope and id are copied as bytes, not decoded.
/// Offsets (1-based): state 1, previous 2, attempt 3, token 7, created 15, fingerprint length 47.
const FINISH_FN: &str = r#"
local function finish(k, token, state, hasres, res, retain, now)
  local v = redis.call('GET', k)
  if not v then return 0 end
  local st, prev, att, tok, cr = struct.unpack('>BbI4dd', v)
  if st ~= 0 or tok ~= tonumber(token) then return 0 end
  local fpend = 51 + struct.unpack('>I4', v, 47)
  local rlen = struct.unpack('>I4', v, fpend + 1)
  local exp = now + tonumber(retain)
  local ms = math.ceil((exp - now) / 1000)
  if ms < 1 then ms = 1 end
  redis.call('SET', k, struct.pack('>BbI4ddddd', tonumber(state), prev, att, tok, cr, now, -1, exp)
    .. string.sub(v, 47, fpend - 1) .. struct.pack('>BI4', tonumber(hasres), #res) .. res
    .. string.sub(v, fpend + 5 + rlen), 'PX', string.format('%.0f', ms))
  return 1
end
"#;

/// Fenced finish (complete or fail). KEYS: the record. ARGV: token, state code, has result
/// ('1'/'0'), result, retain µs, offset. Replies 1, or 0 when the lease was lost.
pub(crate) fn finish() -> String {
    format!(
        "{PRELUDE}{FINISH_FN}
return finish(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], now_us(ARGV[6]))"
    )
}

/// Fenced completions of a batch (group commit: one round trip). KEYS: the records. ARGV:
/// offset, now (µs, offset included, from the store's estimate of this server's clock; '' to
/// read `TIME`), then 4 per key (token, has result, result, retain µs). Replies 1 or 0 per key.
/// The time only stamps the record's update and expiry; fencing compares tokens, never times.
pub(crate) fn complete_many() -> String {
    format!(
        "{PRELUDE}{FINISH_FN}
local now = tonumber(ARGV[2]) or now_us(ARGV[1])
local out = {{}}
for i = 1, #KEYS do
  local a = 2 + (i - 1) * 4
  out[i] = finish(KEYS[i], ARGV[a + 1], 1, ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], now)
end
return out"
    )
}

/// Fenced release. KEYS: the record. ARGV: token, offset. Replies 1, or 0 when lost.
pub(crate) fn release() -> String {
    format!(
        "{PRELUDE}
local r = load(KEYS[1])
if (not r) or r.st ~= 0 or r.tok ~= tonumber(ARGV[1]) then return 0 end
local now = now_us(ARGV[2])
r.st = 2
r.up = now
r.lu = -1
save(KEYS[1], r, now)
return 1"
    )
}

/// Fenced extend. KEYS: the record. ARGV: token, by µs, offset. Replies the new lease end, or
/// -1 when lost.
pub(crate) fn extend() -> String {
    format!(
        "{PRELUDE}
local r = load(KEYS[1])
if (not r) or r.st ~= 0 or r.tok ~= tonumber(ARGV[1]) then return -1 end
local now = now_us(ARGV[3])
r.lu = now + tonumber(ARGV[2])
r.exp = math.max(r.exp, r.lu)
r.up = now
save(KEYS[1], r, now)
return r.lu"
    )
}

/// Operator release, whatever the state. KEYS: the record. ARGV: offset. Replies 1 or 0
/// (absent).
pub(crate) fn force_release() -> String {
    format!(
        "{PRELUDE}
local r = load(KEYS[1])
if not r then return 0 end
local now = now_us(ARGV[1])
r.st = 2
r.tok = math.max(r.tok + 1, now)
r.up = now
r.lu = -1
save(KEYS[1], r, now)
return 1"
    )
}

/// Operator failure unless completed: failed, with the reason as its result. KEYS: the
/// record. ARGV: reason, offset. Replies 1, or 0 (absent or completed).
pub(crate) fn force_fail() -> String {
    format!(
        "{PRELUDE}
local r = load(KEYS[1])
if (not r) or r.st == 1 then return 0 end
local now = now_us(ARGV[2])
r.st = 3
r.tok = math.max(r.tok + 1, now)
r.up = now
r.lu = -1
r.hasres = 1
r.res = ARGV[1]
save(KEYS[1], r, now)
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
  local r = load(KEYS[i])
  if r and r.exp <= now and not live(r, now) then
    redis.call('DEL', KEYS[i])
    n = n + 1
  end
end
return n"
    )
}

/// The server's time in µs plus the offset. ARGV: offset.
pub(crate) fn now() -> String {
    format!("{PRELUDE}\nreturn now_us(ARGV[1])")
}
