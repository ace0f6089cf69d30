-- retry-after-agent for nginx (the lua module: libnginx-mod-http-lua, LuaJIT).
--
-- One worker keeps a subscription to the agent per service and stores each pushed estimate in
-- the lua_shared_dict; the header filter of every worker stamps Retry-After on a 429 or 503
-- that has none (nginx's own limit_req / limit_conn rejections, or an upstream's), with
-- retry-after-ms beside it (the same time in milliseconds), computed in
-- memory from that estimate by retry_after_policy.lua (the same ladder as the agent, checked
-- against its vectors with LuaJIT), with the queue the agent sees at nginx's listener. With no
-- estimate newer than stale_ms, the static retry_after_s. The same worker reports admissions,
-- rejections and the values handed out every second. With scheduled_returns, the returns
-- promised by every worker count in the answers at once, through the shared dictionary.
--
-- Configuration (http block), see docs/integrations/nginx.md:
--   lua_package_path "/etc/nginx/lua/?.lua;;";
--   lua_shared_dict retry_after 1m;
--   init_worker_by_lua_block {
--     require("retry_after_nginx").start({ services = { "api" } })
--   }
-- and in each location whose rejections it answers:
--   header_filter_by_lua_block { require("retry_after_nginx").stamp("api") }
-- (stamp("api", { replace_upstream = true }) also replaces an upstream's own Retry-After).
-- Options of start (defaults): socket ("/run/retry-after-agent/agent.sock"), retry_after_s (5,
-- or false for no header without an estimate), stale_ms (5000), reconnect_max_ms (5000),
-- dict ("retry_after"), retry_after_ms (true; false: no retry-after-ms header).
--
-- Kept returns (the agent's policy kept_returns; docs/integrations/nginx.md, "Kept returns"):
-- start's option keep = { api = { key = "header:x-api-key" | "source" | "cookie",
-- max_queued = 64 } }, with secret_file, cookie ("retry_after_return"), grace_s (30),
-- horizon_s (300), max_keys (100000), max_returns_per_key (1), source_share_percent (0; 1 to
-- 100: one client address's share of the drain), source_header (nil; e.g. "x-forwarded-for":
-- its last entry is the address, else $remote_addr), max_sources (4096), deadline_header (nil;
-- e.g. "x-request-timeout": the seconds a request may wait) and max_wait_s (nil: the wait every
-- request is allowed): a place beyond either is not given, the client is told its seconds and
-- x-should-retry: false; and tickets_dict
-- ("retry_after_tickets", a lua_shared_dict of its own: the book every worker shares). In the
-- location, before limit_req (whose key, $retry_after_limit, admit empties for a return so that
-- it is not held in limit_req's queue):
--   set $retry_after_limit $server_name;
--   rewrite_by_lua_block { require("retry_after_nginx").admit("api") }

local policy = require("retry_after_policy")
local tickets = require("retry_after_tickets")

local M = {}

local options = {
  socket = "/run/retry-after-agent/agent.sock",
  retry_after_s = 5,
  stale_ms = 5000,
  reconnect_max_ms = 5000,
  dict = "retry_after",
  tickets_dict = "retry_after_tickets",
  cookie = "retry_after_return",
  retry_after_ms = true,
}
-- Kept returns per service: { source, header, max_queued, book, room }; the secret.
local kept = {}
-- How long a worker may hold a book's lock before another may take it: far beyond the
-- in-memory work it covers (no I/O, no yield), so only a dead worker's lock ever runs out.
local BOOK_LOCK_S = 1
-- This worker's return-cookie nonces: HMAC-SHA1 of a counter under a key read from
-- /dev/urandom when the worker starts (no two workers, containers or restarts share one).
local nonce_key, nonces_drawn = nil, 0
-- A place for a request the book let on that limit_req then rejected (defined with the book).
local place_after_limit
local secret
-- This worker's parsed copy of each service's latest push: { line, push }.
local parsed = {}

local function dict() return ngx.shared[options.dict] end

-- Seconds handed out are reported as the agent takes them: rung and whole seconds, 300 at most.
local function handed_out_key(service, value)
  return "handed_out:" .. service .. ":" .. value
end

-- The service's latest push and its age in seconds, or nil when none is fresh.
local function fresh_push(service)
  local shared = dict()
  local line = shared:get("push:" .. service)
  local received = shared:get("received:" .. service)
  if line == nil or received == nil then return nil end
  local age = ngx.now() - received
  if age * 1000 > options.stale_ms then return nil end
  local cached = parsed[service]
  if cached == nil or cached.line ~= line then
    cached = { line = line, push = policy.parse_estimate(line) }
    parsed[service] = cached
  end
  if cached.push == nil then return nil end
  return cached.push, math.max(age, 0)
end

-- Every worker's promises due from this second on, one count per second.
local function own_ahead(service, second)
  local shared, own = dict(), {}
  for i = 1, policy.RETURN_BINS do
    own[i] = shared:get(string.format("own:%s:%d", service, second + i - 1)) or 0
  end
  return own
end

-- Stamps the answer on the response: Retry-After in seconds and, unless the retry_after_ms
-- option is false, retry-after-ms (the same time in milliseconds; an upstream's is removed
-- then, so the two never disagree).
local function set_headers(seconds, millis)
  ngx.header["Retry-After"] = string.format("%d", seconds)
  ngx.header["retry-after-ms"] = options.retry_after_ms and string.format("%d", millis) or nil
end

-- Tell a rejected request its kept place: seconds (nil: no header) and their rung, counted as
-- handed out, and in cookie mode the return cookie; beyond: the place lay beyond the request's
-- deadline and was not given (x-should-retry: false). A place is a whole second: the seconds
-- told bring the client back within it, so its milliseconds are the same time.
local function tell_place(service, seconds, rung, cookie, beyond)
  if seconds then
    set_headers(seconds, seconds * 1000)
    dict():incr(handed_out_key(service, policy.handed_out_value(rung, seconds)), 1, 0)
  end
  if cookie then ngx.header["Set-Cookie"] = cookie end
  if beyond then ngx.header["x-should-retry"] = "false" end
end

-- The Retry-After for one rejection of service, from its fresh push (nil: none is held) of
-- age seconds: seconds (nil: no header), milliseconds and rung, as policy.answer gives them.
local function answer(service, push, age)
  if push == nil then
    if options.retry_after_s then return options.retry_after_s, options.retry_after_s * 1000, "static" end
    return nil, "none"
  end
  local seen
  local now = ngx.now()
  if push.retry_after_policy == "scheduled_returns" then
    seen = policy.schedule(push, age, own_ahead(service, math.floor(now)))
  end
  local seconds, millis, rung = policy.answer(push, nil, 0, math.random(), seen)
  if seconds and seen and seconds <= policy.MAX_RETRY_AFTER_S then
    local due = math.floor(now + seconds)
    dict():incr(string.format("own:%s:%d", service, due), 1, 0, policy.RETURN_BINS + 10)
  end
  return seconds, millis, rung
end

-- Count one request of service as admitted or rejected (outcome), for the reports; with kept
-- returns, also as a retry if the book saw it hold a place.
local function count(service, outcome)
  local shared = dict()
  shared:incr(outcome .. ":" .. service, 1, 0)
  if ngx.ctx.retry_after_return then shared:incr("retry_" .. outcome .. ":" .. service, 1, 0) end
end

-- header_filter_by_lua: a 429 or 503 without Retry-After gets the agent's (for a service
-- keeping returns, a request admit let on that limit_req rejected gets a place); every response
-- is counted, as admitted or rejected, for the reports. With { replace_upstream = true }, an
-- upstream's own Retry-After (Ray Serve's static retry_after_s, say) is replaced too, while a
-- fresh estimate is held; without one it is left as the upstream sent it.
function M.stamp(service, stamp_options)
  if ngx.ctx.retry_after_answered then return end
  local shared = dict()
  local status = ngx.status
  if status ~= 429 and status ~= 503 then
    count(service, "admitted")
    return
  end
  count(service, "rejected")
  -- limit_req's rejections carry no Retry-After; an upstream's own is left to the rules below.
  if ngx.ctx.retry_after_queued and ngx.header["Retry-After"] == nil then
    local seconds, rung, cookie, beyond = place_after_limit(service)
    if seconds then return tell_place(service, seconds, rung, cookie, beyond) end
  end
  local push, age = fresh_push(service)
  if ngx.header["Retry-After"] ~= nil then
    local replace = stamp_options and stamp_options.replace_upstream
    if not (replace and push) then return end
  end
  local seconds, millis, rung = answer(service, push, age)
  if seconds == nil then return end
  set_headers(seconds, millis)
  shared:incr(handed_out_key(service, policy.handed_out_value(rung, seconds)), 1, 0)
end

local function connect()
  local sock = ngx.socket.tcp()
  sock:settimeout(options.stale_ms)
  local ok = sock:connect("unix:" .. options.socket)
  if not ok then return nil end
  return sock
end

-- One subscription per service, reconnecting with jittered, doubling delays, until the worker
-- exits.
local function follow(premature, service)
  if premature then return end
  local delay = 0.1
  while not ngx.worker.exiting() do
    local sock = connect()
    if sock and sock:send("SUBSCRIBE " .. service .. "\n") then
      delay = 0.1
      while not ngx.worker.exiting() do
        local line = sock:receive("*l")
        if line == nil or #line > policy.MAX_RESPONSE_LEN or policy.parse_estimate(line) == nil then
          break
        end
        local shared = dict()
        shared:set("push:" .. service, line)
        shared:set("received:" .. service, ngx.now())
      end
    end
    if sock then sock:close() end
    ngx.sleep(delay * (0.5 + math.random()))
    delay = math.min(delay * 2, options.reconnect_max_ms / 1000)
  end
end

-- What a service's rejections handed out since the last report, from the dictionary.
local function take_handed_out(service)
  local shared, handed_out = dict(), {}
  for _, rung in ipairs({ "computed", "static" }) do
    for s = 0, policy.MAX_KEPT_RETRY_AFTER_S do
      local value = policy.handed_out_value(rung, s)
      local count = shared:get(handed_out_key(service, value))
      if count and count > 0 then handed_out[value] = count end
    end
  end
  return handed_out
end

-- What a service's book did since its last report, on a line of its own (tickets=); counted
-- as reported, in the dictionary, once the agent acknowledged it. False if the connection failed.
local function report_tickets(service, exchange)
  local k = kept[service]
  if k == nil then return true end
  local shared, reported = dict(), {}
  for i = 1, #tickets.OUTCOMES do reported[i] = shared:get("reported:" .. service .. ":" .. i) or 0 end
  local counts = k.book:counters()
  -- The book cannot count what it could not write: unrecorded is kept in the main dictionary.
  local unrecorded_at = tickets.UNRECORDED
  counts[unrecorded_at] = counts[unrecorded_at] + (shared:get("unrecorded:" .. service) or 0)
  local entry, carried = tickets.tickets_entry(counts, reported)
  if entry == nil then return true end
  if not exchange(string.format("REPORT %s admitted=0 rejected=0 tickets=%s", service, entry)) then
    return false
  end
  for i, n in ipairs(carried) do shared:incr("reported:" .. service .. ":" .. i, n, 0) end
  return true
end

-- One service's report: its lines sent in order, each counted off the dictionary once the agent
-- acknowledged it. False if the connection failed.
local function report(sock, service)
  local shared = dict()
  local admitted = shared:get("admitted:" .. service) or 0
  local rejected = shared:get("rejected:" .. service) or 0
  -- With kept returns the book tells the returns (requests that held a place) from the rest.
  local retries = kept[service] and { admitted = shared:get("retry_admitted:" .. service) or 0,
    rejected = shared:get("retry_rejected:" .. service) or 0 }
  local lines = policy.report_lines(service, admitted, rejected, nil, take_handed_out(service), retries)
  local function exchange(line)
    return sock:send(line .. "\n") and sock:receive("*l") == "OK"
  end
  local sent = policy.send_report(lines, exchange, function(i, line)
    if i == 1 then
      shared:incr("admitted:" .. service, -admitted, 0)
      shared:incr("rejected:" .. service, -rejected, 0)
      if retries then
        shared:incr("retry_admitted:" .. service, -retries.admitted, 0)
        shared:incr("retry_rejected:" .. service, -retries.rejected, 0)
      end
    end
    for value, count in pairs(line.carried) do
      shared:incr(handed_out_key(service, value), -count, 0)
    end
  end)
  return sent and report_tickets(service, exchange)
end

-- Reports every service each second on one connection, until the worker exits.
local function reporter(premature)
  if premature then return end
  local sock
  while not ngx.worker.exiting() do
    ngx.sleep(1)
    sock = sock or connect()
    if sock then
      for _, service in ipairs(options.services) do
        if not report(sock, service) then
          sock:close()
          sock = nil
          break
        end
      end
    end
  end
end

-- Kept returns --------------------------------------------------------------------------------

-- The proxies' secret: secret_file's bytes, one trailing newline left off.
local function read_secret(path)
  local file = path and io.open(path, "rb")
  assert(file, "retry_after_nginx.start: keep needs a readable secret_file")
  local text = string.gsub(file:read("*a") or "", "\r?\n$", "")
  file:close()
  assert(text ~= "", "retry_after_nginx.start: secret_file is empty")
  return text
end

-- Every service of options.keep gets its book in the tickets dictionary, under its name.
local function start_kept()
  if options.keep == nil or next(options.keep) == nil then return end
  local shared = ngx.shared[options.tickets_dict]
  assert(shared, "retry_after_nginx.start: keep needs a lua_shared_dict " .. options.tickets_dict)
  local settings = assert(tickets.settings(options))
  local budget = options.max_wait_s
  assert(budget == nil or (type(budget) == "number" and budget >= 0 and budget == math.floor(budget)),
    "retry_after_nginx.start: max_wait_s=" .. tostring(budget) .. " is not a whole number of seconds")
  secret = read_secret(options.secret_file)
  local random = assert(io.open("/dev/urandom", "rb"), "retry_after_nginx.start: /dev/urandom")
  nonce_key = random:read(32)
  random:close()
  assert(nonce_key and #nonce_key == 32, "retry_after_nginx.start: 32 bytes from /dev/urandom")
  for service, how in pairs(options.keep) do
    local header = string.match(how.key or "", "^header:(.+)$")
    assert(header or how.key == "source" or how.key == "cookie",
      "retry_after_nginx.start: keep." .. service .. ".key is header:<name>, source or cookie")
    local store = tickets.dict_store(shared, service .. ":")
    kept[service] = { source = how.key, header = header, max_queued = how.max_queued or 64,
      book = tickets.book(settings, store), room = tickets.fresh_room(store) }
    -- Made now, so that counting a request the book could not take never needs new memory.
    dict():safe_add("unrecorded:" .. service, 0)
  end
end

-- A new return cookie's nonce: 16 hex digits, unpredictable and never repeated by a worker.
local function new_nonce()
  nonces_drawn = nonces_drawn + 1
  return string.sub(tickets.hex(ngx.hmac_sha1(nonce_key, tostring(nonces_drawn))), 1, 16)
end

local hasher = tickets.hasher(function(message) return ngx.hmac_sha1(secret, message) end)

-- The request's place in the book if it may hold one: { key, cookie_due } or nil.
local function returning(service, k)
  if k.source == "source" then return { key = hasher.key(ngx.var.remote_addr) } end
  if k.header then
    local value = ngx.req.get_headers()[k.header]
    if type(value) == "table" then value = value[1] end
    return value and { key = hasher.key(value) }
  end
  local value = ngx.var["cookie_" .. options.cookie]
  if value == nil then return nil end
  local due, nonce = tickets.read_cookie(hasher, service, value)
  return due and { key = nonce, cookie_due = due }
end

-- The values given, and how many (n): a nil among them is kept.
local function pack(...) return { n = select("#", ...), ... } end

-- Run f with the service's book held by this worker alone (a lock in the dictionary, taken
-- with safe_add: a full dictionary never evicts a place to make room for it): waited for up to
-- 50 ms where the phase may sleep (may_sleep), else tried 50 times at once; false when it could
-- not be had (busy, or no memory for the lock).
local function with_book(service, f, may_sleep)
  local shared, lock = ngx.shared[options.tickets_dict], "lock:" .. service
  for _ = 1, 50 do
    local taken, err = shared:safe_add(lock, true, BOOK_LOCK_S)
    if err == "no memory" then return false end
    if taken then
      -- Every value f gives, nil among them (a table's length stops at a nil).
      local result = pack(pcall(f))
      shared:delete(lock)
      if not result[1] then error(result[2]) end
      return unpack(result, 1, result.n)
    end
    if may_sleep then ngx.sleep(0.001) end
  end
  return false
end

-- The header's clamp places are told within, from a push (tickets.push_clamp).
local function push_clamp(push) return tickets.push_clamp(push, policy.MAX_KEPT_RETRY_AFTER_S) end

-- A place for a rejected request (its key, or a fresh nonce in cookie mode), or the hint
-- (tickets.reject): seconds to tell (nil: no header), their rung, in cookie mode with a place
-- the Set-Cookie value, and whether the place lay beyond the request's deadline (none given).
-- push: the fresh push (nil: none), age seconds old.
local function give_place(service, k, found, push, age, depth, drain, now)
  local clamp = push_clamp(tickets.book_inputs(push))
  local key = found and found.key
  if k.source == "cookie" then key = new_nonce() end
  local source
  if k.book.settings.source_share_percent > 0 then
    local value = options.source_header and ngx.req.get_headers()[options.source_header]
    if type(value) == "table" then value = value[#value] end
    source = tickets.source(k.book, hasher, value, ngx.var.remote_addr)
  end
  local wait = options.deadline_header and ngx.req.get_headers()[options.deadline_header]
  if type(wait) == "table" then wait = wait[1] end
  local deadline = tickets.deadline_s(wait, options.max_wait_s)
  local seconds, rung, place, beyond = tickets.reject(k.book, key, source, now, depth, drain, clamp,
    deadline, function()
      if push == nil then return options.retry_after_s or nil, "static" end
      return tickets.push_hint(policy, push, age, depth, math.random())
    end)
  local cookie
  if place and k.source == "cookie" then
    cookie = tickets.set_cookie(hasher, service, options.cookie, place.due, key, math.floor(now),
      k.book.settings.grace_s)
  end
  return seconds, rung, cookie, beyond
end

-- What the book is given from a push: tickets.book_inputs, and its queue_depth (0 without one).
local function book_inputs(push)
  local usable, drain = tickets.book_inputs(push)
  return usable, drain, (push and push.queue_depth) or 0
end

-- The decision for one request under the book's lock: outcome and, for a rejection, seconds,
-- rung, cookie and beyond (give_place's). If the book failed a write on the way (a full
-- dictionary), "unrecorded": the decision is dropped, and the request is treated as if kept
-- returns were off.
local function decide(service, k, push, age)
  local now = ngx.now()
  local now_s = math.floor(now)
  local failed = k.book.store.failed
  local usable, drain, depth = book_inputs(push)
  local found = returning(service, k)
  -- The queue's bound is limit_req's (its burst), never the agent's depth: that depth counts
  -- the requests nginx is answering 429 too, so under a flood of rejections it reads the
  -- flood's concurrency and would shut fresh arrivals out with the replicas idle.
  local outcome, due, held = tickets.arrive(k.book, k.room, found, now_s, depth, false, drain)
  local seconds, rung, cookie, beyond
  if outcome == "early" then
    seconds, rung = tickets.told(due, now_s, push_clamp(usable)).seconds, "computed"
  elseif outcome == "rejected" then
    seconds, rung, cookie, beyond = give_place(service, k, found, push, age, depth, drain, now)
  end
  if k.book.store.failed ~= failed then return "unrecorded" end
  ngx.ctx.retry_after_return = tickets.is_return(held)
  return outcome, seconds, rung, cookie, beyond
end

-- A place for a request the book let on as fresh (or early, taking its place) that limit_req
-- then rejected, its burst full where the push's queue_depth was not: behind a full queue.
-- Seconds, rung, cookie and beyond; nil when the book's lock is busy (header_filter may not sleep) or
-- the place could not be recorded: the hint, and counted as unrecorded either way.
function place_after_limit(service)
  local k = kept[service]
  local push, age = fresh_push(service)
  local _, drain, depth = book_inputs(push)
  local ok, recorded, seconds, rung, cookie, beyond = with_book(service, function()
    local failed = k.book.store.failed
    local seconds, rung, cookie, beyond =
      give_place(service, k, returning(service, k), push, age, math.max(depth, k.max_queued), drain, ngx.now())
    return k.book.store.failed == failed, seconds, rung, cookie, beyond
  end, false)
  -- A place the book could not record, or could not decide for (its lock held by another
  -- worker all the while), is not told: the hint, below, and counted.
  if not (ok and recorded) then
    dict():incr("unrecorded:" .. service, 1, 0)
    return nil
  end
  return seconds, rung, cookie, beyond
end

-- rewrite_by_lua, before limit_req: kept returns for service. A place due is let past limit_req
-- (its key $retry_after_limit emptied); a fresh or early request with room goes on to
-- limit_req; any other is rejected here with the push's status, Retry-After (the time left to
-- its place, or a new place) and in cookie mode the return cookie.
function M.admit(service)
  local k = kept[service]
  if k == nil then return end
  local push, age = fresh_push(service)
  local ok, outcome, seconds, rung, cookie, beyond = with_book(service, function() return decide(service, k, push, age) end, true)
  if not ok or outcome == "unrecorded" then
    -- No book to decide by (its lock busy for 50 ms, no memory for the lock, or a write of the
    -- decision refused): the request goes on to limit_req as without kept returns, never past
    -- it, with no place and no cookie; counted.
    dict():incr("unrecorded:" .. service, 1, 0)
    return
  end
  if outcome == "returned" then ngx.var.retry_after_limit = "" end
  -- limit_req may still turn it away: stamp then gives it a place.
  if outcome == "queued" then ngx.ctx.retry_after_queued = true end
  if outcome == "returned" or outcome == "queued" then return end
  count(service, "rejected")
  ngx.ctx.retry_after_answered = true
  tell_place(service, seconds, rung, cookie, beyond)
  ngx.header["Content-Type"] = "text/plain"
  ngx.status = push and push.status_code or 429
  ngx.say("overloaded, retry later")
  return ngx.exit(ngx.status)
end

-- init_worker_by_lua: read the options; the first worker follows and reports every service.
function M.start(given)
  for key, value in pairs(given or {}) do options[key] = value end
  assert(type(options.services) == "table" and #options.services > 0,
    "retry_after_nginx.start: services must name at least one service")
  assert(dict() ~= nil, "retry_after_nginx.start: no lua_shared_dict " .. options.dict)
  -- Jitter only (reconnect delays, the ladder's spread); nonces come from new_nonce.
  math.randomseed(ngx.now() * 1000 + ngx.worker.pid())
  start_kept()
  if (ngx.worker.id() or 0) ~= 0 then return end
  for _, service in ipairs(options.services) do
    assert(ngx.timer.at(0, follow, service))
  end
  assert(ngx.timer.at(0, reporter))
end

return M
