-- Kept returns for the Lua integrations: the places a proxy keeps for the clients it told to
-- come back, as policy/src/tickets.rs and reference-proxy/src/kept.rs keep them (checked
-- against the Rust answers in policy/tests/ticket_vectors.tsv with both interpreters).
--
-- A rejected client with a key (a header's value, its address, a return cookie's nonce) gets a
-- place at the earliest second with room and is told that second; coming back in it (up to
-- grace_s after) it is admitted whatever the queue holds, while fresh arrivals only get the
-- room the second's returns leave. Keys are kept hashed: the first 8 bytes of HMAC-SHA1 under
-- the proxies' secret, as 16 hex digits (no 64-bit integers: LuaJIT has none). HMAC-SHA1 is the
-- caller's (HAProxy's hmac converter, nginx's ngx.hmac_sha1), passed in as a function of the
-- message returning the 20 raw bytes.
--
-- The book lives in a store: plain Lua tables (HAProxy, one Lua state) or an nginx
-- lua_shared_dict (every worker's). Its memory is bounded: max_keys slots in buckets of 8, and
-- one bin per second for horizon_s + grace_s + 2 seconds. No I/O; runs on Lua 5.3/5.4 and
-- LuaJIT, so it uses neither `//` nor bitwise operators.

local T = {}

-- Slots per bucket: a key hashes to one bucket and takes any free slot in it.
T.BUCKET = 8
-- What became of places, in the order of REPORT's tickets= vocabulary (TicketOutcome).
T.OUTCOMES = { "issued", "honoured", "early", "expired", "refused", "replayed", "unrecorded",
  "unplaced", "over_share", "beyond_deadline" }
local ISSUED, HONOURED, EARLY, EXPIRED, REFUSED, REPLAYED, UNRECORDED, UNPLACED, OVER_SHARE,
  BEYOND_DEADLINE = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
T.UNRECORDED = UNRECORDED
-- The settings' defaults (KeptReturnsSettings).
T.DEFAULTS = { grace_s = 30, horizon_s = 300, max_keys = 100000, max_returns_per_key = 1,
  source_share_percent = 0, max_sources = 4096 }
-- Settled places beyond which older ones count half.
local SHOW_MEMORY = 4096.0
-- The largest count a REPORT entry may carry.
T.MAX_REPORT_COUNT = 10000000

local function clamp(x, lo, hi) if x < lo then return lo elseif x > hi then return hi else return x end end

-- Stores ---------------------------------------------------------------------------------------

-- A store on a plain Lua table: get(name) and set(name, value) of strings and numbers.
function T.table_store()
  local t = {}
  return {
    get = function(_, name) return t[name] end,
    set = function(_, name, value) t[name] = value return true end,
  }
end

-- A store on an nginx lua_shared_dict, its names under prefix. safe_set never evicts another
-- entry: a full dictionary fails the write, and the store counts it in failed (this worker's
-- count; the caller compares it before and after a decision and fails closed).
function T.dict_store(dict, prefix)
  local store = { failed = 0 }
  function store.get(_, name) return dict:get(prefix .. name) end
  function store.set(self, name, value)
    local ok = dict:safe_set(prefix .. name, value)
    if not ok then self.failed = self.failed + 1 end
    return ok
  end
  return store
end

-- Keys and cookies -----------------------------------------------------------------------------

-- Raw bytes as lower-case hex.
function T.hex(bytes)
  return (string.gsub(bytes, ".", function(c) return string.format("%02x", string.byte(c)) end))
end

-- A hasher around hmac (a function of a message giving HMAC-SHA1's 20 raw bytes under the
-- secret): mac(message) in 40 hex digits, key(raw) the book's key for raw in 16.
function T.hasher(hmac)
  local h = {}
  function h.mac(message) return T.hex(hmac(message)) end
  function h.key(raw) return string.sub(h.mac(raw), 1, 16) end
  return h
end

-- A return cookie's value: `<due>.<nonce>.<mac>`, signed for service; nonce is 16 hex digits.
function T.write_cookie(hasher, service, due, nonce)
  local body = string.format("%d.%s", due, string.lower(nonce))
  return body .. "." .. hasher.mac(service .. "." .. body)
end

-- The Set-Cookie value that hands a client at now_s the cookie of a place due at due under
-- nonce, named name and signed for service: alive to the end of the last second of its grace
-- (Max-Age = due - now_s + grace_s + 1), so that a client told less than the whole wait (the
-- clamp) still carries it at its place. Rust's ReturnCookie::set_cookie; every proxy sends this.
function T.set_cookie(hasher, service, name, due, nonce, now_s, grace_s)
  local max_age = math.max(due - now_s, 0) + grace_s + 1
  return string.format("%s=%s; Max-Age=%d; Path=/; HttpOnly", name, T.write_cookie(hasher, service, due, nonce), max_age)
end

-- Whether two strings are equal, looking at every byte whatever the first difference.
local function same(a, b)
  if #a ~= #b then return false end
  local differ = 0
  for i = 1, #a do
    if string.byte(a, i) ~= string.byte(b, i) then differ = differ + 1 end
  end
  return differ == 0
end

-- The due second of a cookie, as Rust's u64 parse takes it: digits with an optional "+";
-- "forged" for a number too large to hold exactly here (no proxy writes one), nil if not one.
local function cookie_due(text)
  local digits = string.match(text, "^%+?(%d+)$")
  if digits == nil then return nil end
  digits = string.match(digits, "^0*(%d.-)$") or digits
  if #digits > 20 or (#digits == 20 and digits > "18446744073709551615") then return nil end
  if #digits > 15 then return "forged" end
  return tonumber(digits)
end

-- A cookie's nonce as Rust's hex parse takes it: 16 characters, hex digits with an optional
-- "+"; written back in 16 lower-case digits. nil if not one.
local function cookie_nonce(text)
  if #text ~= 16 or not string.match(text, "^%+?%x+$") then return nil end
  text = string.lower(text)
  if string.sub(text, 1, 1) == "+" then text = "0" .. string.sub(text, 2) end
  return text
end

-- A cookie's value read and verified for service: due, nonce (16 hex digits); or nil and
-- "malformed" or "forged" (the request is then a fresh arrival).
function T.read_cookie(hasher, service, value)
  value = string.match(value, "^%s*(.-)%s*$")
  local parts = {}
  for part in string.gmatch(value .. ".", "([^.]*)%.") do parts[#parts + 1] = part end
  if #parts ~= 3 then return nil, "malformed" end
  local due = cookie_due(parts[1])
  if due == nil or #parts[2] ~= 16 or #parts[3] ~= 40 then return nil, "malformed" end
  local nonce = cookie_nonce(parts[2])
  if nonce == nil then return nil, "malformed" end
  if due == "forged" then return nil, "forged" end
  local expected = hasher.mac(string.format("%s.%d.%s", service, due, nonce))
  if not same(expected, string.lower(parts[3])) then return nil, "forged" end
  return due, nonce
end

-- The book -------------------------------------------------------------------------------------

local Book = {}
Book.__index = Book

-- The first slot index of key's bucket among buckets: its high 32 bits modulo the buckets. The
-- book's keys and the followed sources are found so (Rust's bucket_of).
local function bucket_start(key, buckets)
  return (tonumber(string.sub(key, 1, 8), 16) % buckets) * T.BUCKET
end

-- An empty book with settings (missing ones take T.DEFAULTS) in store.
function T.book(settings, store)
  local s = {}
  for name, default in pairs(T.DEFAULTS) do s[name] = (settings and settings[name]) or default end
  local book = setmetatable({ settings = s, store = store or T.table_store() }, Book)
  book.buckets = math.max(math.ceil(s.max_keys / T.BUCKET), 1)
  book.ring = s.horizon_s + s.grace_s + 2
  return book
end

-- A number the book keeps (0 when never written).
function Book:number(name) return self.store:get(name) or 0 end

-- Count n more of outcome (an index into T.OUTCOMES).
function Book:count(outcome, n)
  if n > 0 then self.store:set("n" .. outcome, self:number("n" .. outcome) + n) end
end

-- What the book has done so far: counts in T.OUTCOMES' order.
function Book:counters()
  local counts = {}
  for i = 1, #T.OUTCOMES do counts[i] = self:number("n" .. i) end
  return counts
end

-- Slot i: { key, due, count, spent }, nil when never used.
function Book:slot(i)
  local text = self.store:get("s" .. i)
  if text == nil then return nil end
  local key, due, count, spent = string.match(text, "^(%x+) (%d+) (%d+) (%d)$")
  return { key = key, due = tonumber(due), count = tonumber(count), spent = spent == "1" }
end

function Book:set_slot(i, slot)
  local text = string.format("%s %d %d %d", slot.key, slot.due, slot.count, slot.spent and 1 or 0)
  return self.store:set("s" .. i, text)
end

-- The bin of ring position j: { second, reserved, taken, on_time }, zeros when never used.
function Book:bin_at(j)
  local text = self.store:get("b" .. j)
  if text == nil then return { second = 0, reserved = 0, taken = 0, on_time = 0 } end
  local second, reserved, taken, on_time = string.match(text, "^(%d+) (%d+) (%d+) (%d+)$")
  return { second = tonumber(second), reserved = tonumber(reserved), taken = tonumber(taken),
    on_time = tonumber(on_time) }
end

function Book:set_bin(bin)
  local text = string.format("%d %d %d %d", bin.second, bin.reserved, bin.taken, bin.on_time)
  self.store:set("b" .. (bin.second % self.ring), text)
end

-- The bin of second, if the ring holds that second.
function Book:bin(second)
  local bin = self:bin_at(second % self.ring)
  if bin.second == second then return bin end
  return nil
end

-- The share of places kept by their clients lately (1 until places have been settled).
function Book:show_rate()
  local shown, given = self.store:get("shown") or 1.0, self.store:get("given") or 1.0
  return clamp(shown / given, 0.05, 1.0)
end

-- Settle every second whose grace has passed by now: its places were kept on time or not.
function Book:settle(now)
  local last = math.max(now - (self.settings.grace_s + 1), 0)
  local settled = self:number("settled")
  local first = math.max(settled + 1, math.max(last - (self.ring - 1), 0))
  if first <= last then
    local shown, given = self.store:get("shown") or 1.0, self.store:get("given") or 1.0
    for second = first, last do
      local bin = self:bin(second)
      if bin then
        shown = shown + math.min(bin.on_time, bin.reserved)
        given = given + bin.reserved
        if given > SHOW_MEMORY then shown, given = shown / 2.0, given / 2.0 end
      end
    end
    self.store:set("shown", shown + 0.0)
    self.store:set("given", given + 0.0)
  end
  if last > settled then self.store:set("settled", last) end
end

-- Whether places are given for now or later: clients are in line.
function Book:line_ahead(now) return self:number("last_due") >= now end

-- Returns expected in second: those taken in it, and those outstanding at the show rate.
function Book:expected(second)
  local bin = self:bin(second)
  if bin == nil then return 0.0 end
  return bin.taken + math.max(bin.reserved - bin.taken, 0) * self:show_rate()
end

-- Returns reserved for second and not yet taken.
function Book:outstanding(second)
  local bin = self:bin(second)
  if bin == nil then return 0 end
  return math.max(bin.reserved - bin.taken, 0)
end

-- The first slot index of key's bucket: its high 32 bits modulo the buckets.
function Book:bucket(key)
  return bucket_start(key, self.buckets)
end

-- The slot holding key (a place or a spent cookie): index and slot, or nil.
function Book:find(key)
  local first = self:bucket(key)
  for i = first, first + T.BUCKET - 1 do
    local slot = self:slot(i)
    if slot and slot.key == key and (slot.count > 0 or slot.spent) then return i, slot end
  end
  return nil
end

-- Whether slot (nil: never used) holds nothing live at now.
function Book:is_free(slot, now)
  return slot == nil or (slot.count == 0 and not slot.spent) or slot.due + self.settings.grace_s < now
end

-- Whether key's bucket has a slot holding nothing live at now.
function Book:has_free_slot(key, now)
  local first = self:bucket(key)
  for i = first, first + T.BUCKET - 1 do
    if self:is_free(self:slot(i), now) then return true end
  end
  return false
end

-- A slot of key's bucket holding nothing live at now; an expired place found there is counted.
function Book:free_slot(key, now)
  local first = self:bucket(key)
  for i = first, first + T.BUCKET - 1 do
    local slot = self:slot(i)
    if self:is_free(slot, now) then
      if slot and not slot.spent then self:count(EXPIRED, slot.count) end
      return i
    end
  end
  return nil
end

-- What key holds at second now: "nothing", "due", "early" (and its second) or "spent".
-- cookie_due is the due second of a place another proxy may have given key (a verified return
-- cookie whose nonce key is, or a place shared by peers). An expired place is counted and
-- forgotten here, and cookie_due's looked at instead; a place taken here is a replay when shown
-- again, and forgotten for another one of the same key. Rust's TicketBook::held.
function Book:held(key, cookie_due_s, now)
  self:settle(now)
  local grace = self.settings.grace_s
  local function window(due)
    if now < due then return "early", due elseif now <= due + grace then return "due" end
    return "nothing"
  end
  local held, due
  local i, slot = self:find(key)
  if i then
    if slot.spent then
      if cookie_due_s == nil then return "nothing" end
      if cookie_due_s == slot.due then
        self:count(REPLAYED, 1)
        return "spent"
      end
      -- Another place of the key, given since: its slot is free for it.
      self.store:set("s" .. i, nil)
    else
      held, due = window(slot.due)
      if held ~= "nothing" then
        if held == "early" then self:count(EARLY, 1) end
        return held, due
      end
      self:count(EXPIRED, slot.count)
      self.store:set("s" .. i, nil)
    end
  end
  if cookie_due_s ~= nil then
    held, due = window(cookie_due_s)
    if held ~= "nothing" and not self:has_free_slot(key, now) then
      -- Its taking could not be remembered (the bucket full of live places): a fresh arrival,
      -- never a place every replay would find.
      self:count(UNRECORDED, 1)
      return "nothing"
    end
  else
    held = "nothing"
  end
  if held == "early" then self:count(EARLY, 1) end
  return held, due
end

-- key takes one of its places at now (due, or early into free room); a cookie's place is
-- remembered as spent until it expires, so that a replay is not admitted again.
function Book:take(key, cookie_due_s, now)
  local due
  local i, slot = self:find(key)
  if i then
    slot.count = math.max(slot.count - 1, 0)
    slot.spent = cookie_due_s ~= nil
    self:set_slot(i, slot)
    due = slot.due
  else
    if cookie_due_s == nil then return end
    local free = self:free_slot(key, now)
    if free then self:set_slot(free, { key = key, due = cookie_due_s, count = 0, spent = true }) end
    due = cookie_due_s
  end
  if due <= now then self:count(HONOURED, 1) end
  local bin = self:bin(due)
  if bin then
    bin.taken = bin.taken + 1
    if now <= due + 1 then bin.on_time = bin.on_time + 1 end
    self:set_bin(bin)
  end
end

-- The first second s in min_s..max_s with room_per_s * (s + 1) >= depth + 1 + promised(0..s)
-- (policy.rs's earliest_second), or nil.
local function earliest_second(depth, room_per_s, promised, min_s, max_s)
  if not (room_per_s == room_per_s and room_per_s < math.huge and room_per_s > 0.0) then return nil end
  local ahead = depth + 0.0 + 1.0
  for s = 0, max_s do
    ahead = ahead + promised(s)
    if s >= min_s and room_per_s * (s + 1.0) >= ahead then return s end
    if ahead > room_per_s * (max_s + 1.0) then return nil end
  end
  return nil
end
T.earliest_second = earliest_second

-- The earliest second, at least min_s after second now, by whose end drain_rate has served
-- what is ahead: the part of this second gone (elapsed, 0 to 1), the queue_depth queued, every
-- return expected up to it, and one more. nil within the horizon or without a drain rate.
function Book:place(now, elapsed, queue_depth, drain_rate, min_s)
  local shows = self:show_rate()
  local gone = drain_rate * clamp(elapsed, 0.0, 1.0)
  local function ahead(s)
    local returns = self:outstanding(now + s) * shows
    if s == 0 then return returns + gone end
    return returns
  end
  local s = earliest_second(queue_depth, drain_rate, ahead, min_s, self.settings.horizon_s)
  return s and now + s
end

function Book:reserve(due)
  local bin = self:bin_at(due % self.ring)
  if bin.second ~= due then bin = { second = due, reserved = 0, taken = 0, on_time = 0 } end
  bin.reserved = bin.reserved + 1
  self:set_bin(bin)
end

-- Give key a place at due (from place), at now; a key holding a place gets another at the same
-- second, up to max_returns_per_key. The due second of the key's place, or nil when its bucket
-- is full of live places (counted as refused).
function Book:issue(key, due, now)
  local cap = math.max(self.settings.max_returns_per_key, 1)
  local i, slot = self:find(key)
  if i and not slot.spent then
    if slot.count >= cap then return slot.due end
    slot.count = slot.count + 1
  else
    i = i or self:free_slot(key, now)
    slot = { key = key, due = due, count = 1, spent = false }
  end
  if i == nil or not self:set_slot(i, slot) then
    self:count(REFUSED, 1)
    return nil
  end
  self:reserve(slot.due)
  if slot.due > self:number("last_due") then self.store:set("last_due", slot.due) end
  self:count(ISSUED, 1)
  return slot.due
end

-- Places per source (sources.rs): a source (an address, as a key) is given new places at most at
-- source_share_percent of the drain rate, up to one second's worth at once (at least one), so
-- that no source reserves more than its share however many keys it mints. Each followed source
-- takes a slot of max_sources (buckets of 8): its key, places left, and when.

-- Spend one place of source's allowance at time t (seconds with their fraction), the fleet
-- draining drain_rate: true where sources are not bounded; false (counted as over_share) when
-- it has none left, or is not followed and its bucket has no slot free (a slot is free when
-- its source's allowance is full again).
function Book:spend_source(source, t, drain_rate)
  local share = self.settings.source_share_percent
  if share == 0 then return true end
  local rate = drain_rate * share / 100
  local full = math.max(rate, 1.0)
  local first = bucket_start(source, math.max(math.ceil(self.settings.max_sources / T.BUCKET), 1))
  local store = self.store
  local function refilled(i)
    return math.min(store:get("ap" .. i) + math.max(t - store:get("at" .. i), 0) * rate, full)
  end
  local found, places
  for i = first, first + T.BUCKET - 1 do
    if store:get("ak" .. i) == source then found, places = i, refilled(i) break end
  end
  if found == nil then
    for i = first, first + T.BUCKET - 1 do
      if store:get("ak" .. i) == nil or refilled(i) >= full then found, places = i, full break end
    end
  end
  local spent = found ~= nil and places >= 1.0
  if found ~= nil then
    store:set("ak" .. found, source)
    store:set("ap" .. found, spent and places - 1.0 or places)
    store:set("at" .. found, t)
  end
  if not spent then self:count(OVER_SHARE, 1) end
  return spent
end

-- The key a request's source is followed under while sources are bounded (nil while they are
-- not): the last entry of header_value (what the load balancer in front saw, in its
-- X-Forwarded-For; nil without the header) or else peer (the connection's address: a client
-- cannot leave its share by leaving the header out). Rust's Keeping::source.
function T.source(book, hasher, header_value, peer)
  if book.settings.source_share_percent == 0 then return nil end
  local address = T.source_address(header_value, peer)
  return address and hasher.key(address)
end

-- The address of T.source: header_value's last entry, trimmed, or else peer. Rust's
-- source_address.
function T.source_address(header_value, peer)
  local last = header_value and string.match(header_value, "([^,]*)$")
  -- Trimmed of ASCII whitespace as Rust's trim_ascii does (no vertical tab).
  last = last and string.match(last, "^[ \t\n\f\r]*(.-)[ \t\n\f\r]*$")
  if last == nil or last == "" then return peer end
  return last
end

-- Promises (kept.rs) -------------------------------------------------------------------------

-- What a client whose place is due at due is told at second now_s: { due, seconds } with the
-- seconds within clamp ({ low, high }; one told the top comes back early and is told the rest).
function T.told(due, now_s, clamp_s)
  return { due = due, seconds = clamp(math.max(due - now_s, 0), clamp_s[1], clamp_s[2]) }
end

-- The wait a request allows, in whole seconds: the lesser of its deadline header's value
-- (header: seconds, up to 9 digits, a fraction allowed and cut off; anything else is no
-- deadline) and the proxy's budget for every request (budget_s); nil: no deadline. Rust's
-- deadline_s.
function T.deadline_s(header, budget_s)
  local from_header
  if header ~= nil then
    local value = string.match(header, "^%s*(.-)%s*$")
    local whole, fraction = string.match(value, "^(%d+)%.(%d+)$")
    whole = whole or string.match(value, "^(%d+)$")
    if whole and #whole <= 9 and (fraction == nil or #fraction <= 9) then
      from_header = tonumber(whole)
    end
  end
  if from_header and budget_s then return math.min(from_header, budget_s) end
  return from_header or budget_s
end

-- The place a rejected client with key, from source (nil: not bounded by source), is given at
-- second now_s (elapsed seconds into it), its request allowing a wait of deadline_s seconds
-- at most (nil: no deadline known):
-- with a drain rate, the earliest second with room behind queue_depth queued and every place
-- given, no sooner than clamp_s[1]; before the drain rate is known, the second of hint()
-- (which gives seconds and whether they come from a fresh estimate), if fresh: the proxy's own
-- static value knows no room, and a place at it would pass the queue's bound when it falls due
-- (the agent away). A place further than deadline_s is not given: nil and { due, seconds }
-- (told it, and not to retry; counted as beyond_deadline). A source past its share of the
-- drain gets no place either (spend_source; before the drain rate is known its allowance does
-- not fill: one place until it is). { due, seconds }, or nil (the rejection carries the hint
-- alone, counted as unplaced, over_share, or refused by the book). Rust's give_place.
function T.give_place(book, key, source, now_s, elapsed, queue_depth, drain_rate, clamp_s, deadline_s, hint)
  local due
  if drain_rate ~= nil then
    due = book:place(now_s, elapsed, queue_depth, drain_rate, clamp_s[1])
  else
    local seconds, fresh = hint()
    due = seconds and fresh and now_s + seconds or nil
  end
  if due == nil then
    book:count(UNPLACED, 1)
    return nil
  end
  if deadline_s ~= nil and due - now_s > deadline_s then
    book:count(BEYOND_DEADLINE, 1)
    return nil, T.told(due, now_s, clamp_s)
  end
  if source ~= nil and not book:spend_source(source, now_s + elapsed, drain_rate or 0.0) then
    return nil
  end
  due = book:issue(key, due, now_s)
  return due and T.told(due, now_s, clamp_s)
end

-- Glue: the rule around the book that HAProxy's and nginx's Lua share ----------------------

-- The header's clamp places are told within ({ low, high } seconds): a push's own, within 1 to
-- max_s; 1 to max_s without one.
function T.push_clamp(push, max_s)
  if push == nil then return { 1, max_s } end
  local high = math.max(math.min(push.max_retry_after_s, max_s), 1)
  return { math.max(math.min(push.min_retry_after_s, high), 1), high }
end

-- What the book is given from a fresh push (nil: none): the push if its policy keeps returns,
-- and its drain rate (nil unless a positive, finite number).
function T.book_inputs(push)
  local usable = push and push.retry_after_policy == "kept_returns" and push or nil
  local drain = usable and usable.drain_rate
  if drain and not (drain > 0 and drain < math.huge) then drain = nil end
  return usable, drain
end

-- The hint a rejection carries without a place, from a fresh push received age_s ago, for
-- queue_depth (policy: retry_after_policy.lua; jitter: a draw in [0, 1)): the agent's own
-- answer, kept_returns answering as scheduled_returns filling capacity. Seconds (nil: no
-- header), rung, and true: a hint from a fresh push.
function T.push_hint(policy, push, age_s, queue_depth, jitter)
  local as_agent = {}
  for key, value in pairs(push) do as_agent[key] = value end
  if push.retry_after_policy == "kept_returns" then
    as_agent.retry_after_policy, as_agent.overload_rule = "scheduled_returns", "fill_capacity"
  end
  local seconds, _millis, rung = policy.answer(as_agent, queue_depth, 0, jitter, policy.schedule(as_agent, age_s, {}))
  return seconds, rung, true
end

-- A rejection with kept returns at now (Unix seconds, with their fraction), its request
-- allowing a wait of deadline_s seconds at most (nil: no deadline): the place given to key
-- (nil: none can be), from source (nil: not bounded by source), by T.give_place, and the
-- seconds that tell it, rung "computed"; a place beyond the deadline is not given, and its
-- seconds are told with beyond true (say not to retry); else the hint's seconds and rung.
-- hint() gives seconds (nil: no header), rung, and whether they come from a fresh push
-- (T.push_hint; false for the proxy's own static value), and is asked at most once. Seconds,
-- rung, place, beyond.
function T.reject(book, key, source, now, queue_depth, drain_rate, clamp_s, deadline_s, hint)
  local asked
  local function ask()
    if asked == nil then asked = { hint() } end
    return asked[1], asked[2], asked[3]
  end
  local place, beyond
  if key ~= nil then
    local now_s = math.floor(now)
    local elapsed = math.floor((now - now_s) * 1000) / 1000
    place, beyond = T.give_place(book, key, source, now_s, elapsed, queue_depth, drain_rate, clamp_s,
      deadline_s, function()
        local seconds, _rung, fresh = ask()
        return seconds, fresh == true
      end)
  end
  if place then return place.seconds, "computed", place, false end
  if beyond then return beyond.seconds, "computed", nil, true end
  local seconds, rung = ask()
  return seconds, rung, nil, false
end

-- The fresh arrivals admitted in the current second, kept in store (FreshRoom).
function T.fresh_room(store)
  local room = {}
  -- Whether one more fresh arrival fits second now_s with returns expected in it: fewer than
  -- drain_rate admitted in all; always while the drain rate is unknown.
  function room.has_room(now_s, returns, drain_rate)
    if drain_rate == nil then return true end
    local admitted = store:get("fresh_second") == now_s and (store:get("fresh_admitted") or 0) or 0
    return admitted + returns < drain_rate
  end
  -- One fresh arrival admitted in second now_s.
  function room.admitted(now_s)
    if store:get("fresh_second") ~= now_s then
      store:set("fresh_second", now_s)
      store:set("fresh_admitted", 0)
    end
    store:set("fresh_admitted", (store:get("fresh_admitted") or 0) + 1)
  end
  return room
end

-- The admission rule (Router::arrive_kept) for a request at second now_s: returning is
-- { key, cookie_due } or nil (no key); queue_len the requests queued, queue_full whether the
-- queue is at its bound. "returned" (its place is due: admit it ahead of the queue), "queued"
-- (admit it: fresh into free room, or early taking its place), "early" and the place's second
-- (reject it, told the time left), or "rejected" (give it a place); then what the request held
-- (book:held's "nothing", "due", "early" or "spent").
function T.arrive(book, room, returning, now_s, queue_len, queue_full, drain_rate)
  local held, due = "nothing", nil
  if returning then held, due = book:held(returning.key, returning.cookie_due, now_s) end
  if held == "due" then
    book:take(returning.key, returning.cookie_due, now_s)
    return "returned", nil, held
  end
  -- Free room goes to a client in line first: a newcomer gets it only when no one is.
  local in_line = held == "early"
  local has_room = not queue_full and (queue_len == 0
    or ((in_line or not book:line_ahead(now_s)) and room.has_room(now_s, book:expected(now_s), drain_rate)))
  if has_room then
    if in_line then book:take(returning.key, returning.cookie_due, now_s) end
    room.admitted(now_s)
    return "queued", nil, held
  end
  if in_line then return "early", due, held end
  return "rejected", nil, held
end

-- Whether a request the book saw held a place (T.arrive's third value, "due" or "early"): a
-- return, which a report counts as a retry.
function T.is_return(held) return held == "due" or held == "early" end

-- Reports ----------------------------------------------------------------------------------------

-- The tickets= value for counts since reported (both in T.OUTCOMES' order): the non-zero
-- entries, each at most MAX_REPORT_COUNT, and the counts it carries; nil when nothing happened.
function T.tickets_entry(counts, reported)
  local entries, carried = {}, {}
  for i, name in ipairs(T.OUTCOMES) do
    local n = math.min(counts[i] - (reported[i] or 0), T.MAX_REPORT_COUNT)
    carried[i] = math.max(n, 0)
    if n > 0 then entries[#entries + 1] = string.format("%s:%d", name, n) end
  end
  if #entries == 0 then return nil end
  return table.concat(entries, ","), carried
end

-- The settings from a table of text values (environment variables, nginx options), each
-- checked: a whole number in its range. Settings and nil, or nil and what is wrong.
function T.settings(given)
  local ranges = { grace_s = { 0, 3600 }, horizon_s = { 1, 86400 }, max_keys = { 1, 100000000 },
    max_returns_per_key = { 1, 65535 }, source_share_percent = { 0, 100 },
    max_sources = { 1, 10000000 } }
  local s = {}
  for name, default in pairs(T.DEFAULTS) do
    local v = given[name]
    if v == nil or v == "" then
      s[name] = default
    else
      local n = tonumber(v)
      if n == nil or n ~= math.floor(n) or n < ranges[name][1] or n > ranges[name][2] then
        return nil, string.format("%s=%s is not a whole number from %d to %d", name, tostring(v),
          ranges[name][1], ranges[name][2])
      end
      s[name] = n
    end
  end
  return s
end

return T
