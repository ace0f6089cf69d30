-- retry-after-agent for HAProxy (Lua 5.3, HAProxy 2.2 and later).
--
-- Keeps a subscription to the agent per service in a background task, so the rejection rule
-- only reads a variable: the Retry-After is computed in memory from the pushed estimate, with
-- HAProxy's own backend queue length as the queue depth (the agent's, for a service named
-- without a backend), by the same ladder, formula, jitter,
-- rounding and clamp as the agent (checked against vectors from the agent's implementation).
-- When no estimate newer than RETRY_AFTER_STALE_MS is held (the agent is unreachable), the
-- static value. A second task reports admissions, rejections and the values handed out to
-- the agent every second. With scheduled_returns, the returns this proxy promised count in
-- its own answers at once, before the agent's schedule holds them.
--
-- Configuration (global section of haproxy.cfg), see docs/integrations/haproxy.md:
--   lua-load /etc/haproxy/retry_after.lua
--   setenv RETRY_AFTER_SERVICES  api:replicas     # service:backend[,service:backend...]; a
--                                                 # service alone: its servers have no maxconn,
--                                                 # the depth is the agent's (give it the frontend)
--   setenv RETRY_AFTER_SOCKET    /run/retry-after-agent/agent.sock
--   setenv RETRY_AFTER_STATIC    5                # seconds, when no estimate is held
--   setenv RETRY_AFTER_STALE_MS  5000
--   setenv RETRY_AFTER_RECONNECT_MAX_MS 5000      # longest wait between reconnect attempts
--   setenv RETRY_AFTER_MS_HEADER on               # off: no retry-after-ms beside Retry-After
-- Kept returns, opt-in per service (the agent's policy kept_returns; see
-- docs/integrations/haproxy.md, "Kept returns"):
--   setenv RETRY_AFTER_KEEP        api=header:x-api-key   # service=header:<name>|source|cookie[,...]
--   setenv RETRY_AFTER_SECRET_FILE /etc/haproxy/retry_after.secret
--   setenv RETRY_AFTER_COOKIE      retry_after_return     # the return cookie's name
--   setenv RETRY_AFTER_GRACE_S 30, RETRY_AFTER_HORIZON_S 300, RETRY_AFTER_MAX_KEYS 100000,
--          RETRY_AFTER_MAX_RETURNS_PER_KEY 1
--   setenv RETRY_AFTER_SOURCE_SHARE_PERCENT 0  # 1-100: one client address's share of the drain
--   setenv RETRY_AFTER_SOURCE_HEADER x-forwarded-for  # its last entry is the address (else src)
--   setenv RETRY_AFTER_MAX_SOURCES 4096        # addresses followed at once
--   setenv RETRY_AFTER_DEADLINE_HEADER x-request-timeout  # a request's wait, in seconds
--   setenv RETRY_AFTER_MAX_WAIT_S 120          # the wait every request is allowed
--   setenv RETRY_AFTER_SHARED_PLACES api=places_api  # service=<backend with the stick table>:
--                                                    places of header and source keys shared
--                                                    with the other proxies (peers)
-- Actions:
--   http-request lua.retry_after <service>           sets txn.retry_after, txn.retry_after_ms,
--                                                    txn.retry_after_status and, unless
--                                                    RETRY_AFTER_MS_HEADER is off,
--                                                    txn.retry_after_ms_header (the value of
--                                                    the retry-after-ms header to stamp)
--   http-request lua.retry_after_admit <service>     kept returns: after txn.reject says whether
--                                                    the queue is at its bound, sets
--                                                    txn.retry_after_kept (returned, queued,
--                                                    early or rejected) and, on a rejection,
--                                                    txn.retry_after, txn.retry_after_status
--                                                    and txn.retry_after_cookie (Set-Cookie),
--                                                    with txn.retry_after_ms and
--                                                    txn.retry_after_ms_header as above;
--                                                    txn.retry_after_no_retry past a deadline;
--                                                    with shared places, txn.retry_after_place_key
--                                                    and txn.retry_after_place_due (the place's
--                                                    second, 0 once taken) for the stick table
--   http-request lua.retry_after_admitted <service>  counts an admitted request
--   http-response lua.retry_after_response <service> the agent's value on a server's 429/503
--                                                    (Retry-After, and retry-after-ms)
-- Service:
--   http-request use-service lua.retry_after_grpc    a gRPC rejection carrying the value set
--                                                    by lua.retry_after as grpc-retry-pushback-ms

-- The policy (shared with the nginx integration) lives in ../lua/retry_after_policy.lua, or
-- next to this file where both were copied into one directory.
local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
package.path = here .. "?.lua;" .. here .. "../lua/?.lua;" .. package.path
local M = require("retry_after_policy")
local T = require("retry_after_tickets")

local MAX_RETRY_AFTER_S = M.MAX_RETRY_AFTER_S
local MAX_KEPT_RETRY_AFTER_S = M.MAX_KEPT_RETRY_AFTER_S
local MAX_LINE = M.MAX_RESPONSE_LEN

-- Everything below runs inside HAProxy only.
if core == nil then return M end

-- Read once the whole configuration is parsed (see the init function below), so `setenv`
-- lines may come before or after `lua-load`.
local socket_path = "/run/retry-after-agent/agent.sock"
local retry_after_s = 5
local stale_ms = 5000
local reconnect_max_ms = 5000
local ms_header = true  -- RETRY_AFTER_MS_HEADER: stamp retry-after-ms beside Retry-After
local services = {}   -- service name -> { backend, push, received_ms, admitted, rejected, kept }
-- Kept returns: the secret (base64, as the hmac converter takes it) and the cookie's name.
local secret_b64
local cookie_name = "retry_after_return"
local source_header
local deadline_header  -- RETRY_AFTER_DEADLINE_HEADER: the seconds a request may wait, lowercase
local max_wait_s       -- RETRY_AFTER_MAX_WAIT_S: the wait allowed to every request (nil: none)
local read_kept_settings
local read_shared_places

local function now_ms()
  local t = core.now()
  return t.sec * 1000 + t.usec // 1000
end

-- HAProxy's queue for a backend, outside a transaction (nil for none).
local function backend_queue(backend)
  local proxy = backend and core.backends[backend]
  if proxy == nil then return nil end
  return tonumber(proxy:get_stats()["qcur"])
end

local function connect()
  local sock = core.tcp()
  sock:settimeout(stale_ms / 1000)
  if not sock:connect("unix@" .. socket_path) then sock:close() return nil end
  return sock
end

-- HAProxy's own queue for a service in a transaction; nil for a service named without a
-- backend (servers without maxconn: the queue is inside them, and the depth is the agent's).
local function own_queue(txn, state)
  if state.backend == nil then return nil end
  return txn.f:queue(state.backend)
end

-- One subscription per service, reconnecting with jittered, doubling delays.
local function follow(name, state)
  return function()
    local delay = 100
    while true do
      local sock = connect()
      if sock and sock:send("SUBSCRIBE " .. name .. "\n") then
        delay = 100
        while true do
          local line = sock:receive("*l")
          if line == nil or #line > MAX_LINE then break end
          local push = M.parse_estimate(line)
          if push == nil then break end
          state.push, state.received_ms = push, now_ms()
        end
      end
      if sock then sock:close() end
      core.msleep(math.floor(delay * (0.5 + math.random())))
      delay = math.min(delay * 2, reconnect_max_ms)
    end
  end
end

-- This proxy's own promised returns (scheduled_returns), by whole second: bins of
-- { second, count }, bounded at RETURN_BINS.
local function own_ahead(state, second)
  local own = {}
  for i = 1, M.RETURN_BINS do
    local bin = state.own[(second + i - 1) % M.RETURN_BINS]
    own[i] = (bin and bin[1] == second + i - 1) and bin[2] or 0
  end
  return own
end

local function own_promise(state, due)
  local key = due % M.RETURN_BINS
  local bin = state.own[key]
  if bin ~= nil and bin[1] > due then return end  -- a later second owns it: the clock stepped back
  if bin == nil or bin[1] ~= due then bin = { due, 0 } state.own[key] = bin end
  bin[2] = bin[2] + 1
end

-- What a service's book did since its last report, on a line of its own (tickets=); counted
-- as reported once the agent acknowledged it. False if the connection failed.
local function report_tickets(name, state, exchange)
  local kept = state.kept
  if kept == nil then return true end
  local entry, carried = T.tickets_entry(kept.book:counters(), kept.reported)
  if entry == nil then return true end
  if not exchange(string.format("REPORT %s admitted=0 rejected=0 tickets=%s", name, entry)) then
    return false
  end
  for i, n in ipairs(carried) do kept.reported[i] = (kept.reported[i] or 0) + n end
  return true
end

-- One service's report: its lines sent in order on sock, each counted off the service's
-- counts once the agent acknowledged it. False if the connection failed.
local function report(sock, name, state)
  local admitted, rejected = state.admitted, state.rejected
  -- With kept returns the book tells the returns (requests that held a place) from the rest.
  local retries = state.kept and { admitted = state.retries.admitted, rejected = state.retries.rejected }
  local lines = M.report_lines(name, admitted, rejected, backend_queue(state.backend), state.handed_out, retries)
  local function exchange(line)
    return sock:send(line .. "\n") and sock:receive("*l") == "OK"
  end
  local sent = M.send_report(lines, exchange, function(i, line)
    if i == 1 then
      state.admitted, state.rejected = state.admitted - admitted, state.rejected - rejected
      if retries then
        state.retries.admitted = state.retries.admitted - retries.admitted
        state.retries.rejected = state.retries.rejected - retries.rejected
      end
    end
    for value, count in pairs(line.carried) do
      local left = state.handed_out[value] - count
      state.handed_out[value] = left > 0 and left or nil
    end
  end)
  return sent and report_tickets(name, state, exchange)
end

-- Reports what each service's rejection rule did, every second, on one connection.
local function reporter()
  local sock
  while true do
    core.msleep(1000)
    if sock == nil then sock = connect() end
    if sock then
      for name, state in pairs(services) do
        if not report(sock, name, state) then
          sock:close()
          sock = nil
          break
        end
      end
    end
  end
end

-- base64 of raw bytes (the hmac converter takes its key so).
local function base64(raw)
  local alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
  local out = {}
  for i = 1, #raw, 3 do
    local a, b, c = string.byte(raw, i, i + 2)
    local n = a * 65536 + (b or 0) * 256 + (c or 0)
    for k, shift in ipairs({ 262144, 4096, 64, 1 }) do
      if k <= 2 or (k == 3 and b) or (k == 4 and c) then
        local d = (n // shift) % 64
        out[#out + 1] = string.sub(alphabet, d + 1, d + 1)
      else
        out[#out + 1] = "="
      end
    end
  end
  return table.concat(out)
end

-- The proxies' secret: RETRY_AFTER_SECRET_FILE's bytes, one trailing newline left off; nil
-- when the file cannot be read or is empty.
local function read_secret()
  local path = os.getenv("RETRY_AFTER_SECRET_FILE")
  local file = path and io.open(path, "rb")
  if file == nil then return nil end
  local secret = file:read("*a") or ""
  file:close()
  secret = string.gsub(secret, "\r?\n$", "")
  if secret == "" then return nil end
  return secret
end

-- RETRY_AFTER_KEEP (service=header:<name>|source|cookie, comma-separated) and the book's
-- settings: each service named gets a book, its memory bounded by RETRY_AFTER_MAX_KEYS.
read_kept_settings = function()
  local keep = os.getenv("RETRY_AFTER_KEEP") or ""
  if keep == "" then return end
  cookie_name = os.getenv("RETRY_AFTER_COOKIE") or cookie_name
  local settings, wrong = T.settings({
    grace_s = os.getenv("RETRY_AFTER_GRACE_S"),
    horizon_s = os.getenv("RETRY_AFTER_HORIZON_S"),
    max_keys = os.getenv("RETRY_AFTER_MAX_KEYS"),
    max_returns_per_key = os.getenv("RETRY_AFTER_MAX_RETURNS_PER_KEY"),
    source_share_percent = os.getenv("RETRY_AFTER_SOURCE_SHARE_PERCENT"),
    max_sources = os.getenv("RETRY_AFTER_MAX_SOURCES"),
  })
  source_header = os.getenv("RETRY_AFTER_SOURCE_HEADER")
  source_header = source_header and source_header ~= "" and string.lower(source_header) or nil
  deadline_header = os.getenv("RETRY_AFTER_DEADLINE_HEADER")
  deadline_header = deadline_header and deadline_header ~= "" and string.lower(deadline_header) or nil
  local budget = os.getenv("RETRY_AFTER_MAX_WAIT_S")
  if budget ~= nil and budget ~= "" then
    max_wait_s = T.deadline_s(budget, nil)
    if max_wait_s == nil then
      core.Alert("retry_after.lua: RETRY_AFTER_MAX_WAIT_S is " .. budget .. ", not a number of seconds; no budget is applied")
    end
  end
  local secret = read_secret()
  if settings == nil or secret == nil then
    core.Alert("retry_after.lua: kept returns are off: " .. (wrong or "RETRY_AFTER_SECRET_FILE gives no secret"))
    return
  end
  secret_b64 = base64(secret)
  for item in string.gmatch(keep, "[^,]+") do
    local name, source = string.match(item, "^%s*([^=%s]+)=([^%s]+)%s*$")
    local header = source and string.match(source, "^header:(.+)$")
    local state = name and services[name]
    if state and (header or source == "source" or source == "cookie") then
      state.kept = { source = source, header = header and string.lower(header),
        book = T.book(settings), room = T.fresh_room(T.table_store()), reported = {} }
    else
      core.Alert("retry_after.lua: RETRY_AFTER_KEEP: " .. item .. " is not <service>=header:<name>|source|cookie for a service of RETRY_AFTER_SERVICES")
    end
  end
end

-- RETRY_AFTER_SHARED_PLACES (service=backend, comma-separated): each service keeping returns
-- by header or source shares its places through the stick table of that backend (type string
-- len 16, store gpt0, replicated by HAProxy's peers), so that a client coming back through
-- another proxy finds its place there.
read_shared_places = function()
  for item in string.gmatch(os.getenv("RETRY_AFTER_SHARED_PLACES") or "", "[^,]+") do
    local name, backend = string.match(item, "^%s*([^=%s]+)=([^%s]+)%s*$")
    local state = name and services[name]
    local table_of = backend and core.backends[backend]
    if state and state.kept and state.kept.source ~= "cookie" and table_of and table_of.stktable then
      state.kept.shared = backend
    else
      core.Alert("retry_after.lua: RETRY_AFTER_SHARED_PLACES: " .. item .. " is not <service>=<backend with a stick-table> for a service keeping returns by header or source (cookies are shared already)")
    end
  end
end

core.register_init(function()
  socket_path = os.getenv("RETRY_AFTER_SOCKET") or socket_path
  retry_after_s = tonumber(os.getenv("RETRY_AFTER_STATIC") or "") or retry_after_s
  stale_ms = tonumber(os.getenv("RETRY_AFTER_STALE_MS") or "") or stale_ms
  reconnect_max_ms = tonumber(os.getenv("RETRY_AFTER_RECONNECT_MAX_MS") or "") or reconnect_max_ms
  local ms_setting = os.getenv("RETRY_AFTER_MS_HEADER") or "on"
  if ms_setting ~= "on" and ms_setting ~= "off" then
    core.Alert("retry_after.lua: RETRY_AFTER_MS_HEADER is " .. ms_setting .. ", not on or off; retry-after-ms stays on")
  end
  ms_header = ms_setting ~= "off"
  for item in string.gmatch(os.getenv("RETRY_AFTER_SERVICES") or "", "[^,]+") do
    local name, backend = string.match(item, "^%s*([^:%s]+):([^%s]+)%s*$")
    if not name then name = string.match(item, "^%s*([^:%s]+)%s*$") end
    if name then
      services[name] = { backend = backend, admitted = 0, rejected = 0, handed_out = {}, own = {},
        retries = { admitted = 0, rejected = 0 } }
    end
  end
  read_kept_settings()
  read_shared_places()
  if next(services) == nil then
    core.Alert("retry_after.lua: RETRY_AFTER_SERVICES names no service; only the static value will be used")
  end
  for name, state in pairs(services) do core.register_task(follow(name, state)) end
  core.register_task(reporter)
end)

-- The agent's answer from the held estimate for one rejection of a service, at `now`, with
-- `depth` as the queue (nil: the agent's): seconds (nil: no header), milliseconds and rung;
-- nil when no estimate newer than RETRY_AFTER_STALE_MS is held. Counts its own promise.
local function computed_answer(state, depth, now)
  if not (state.push and now - state.received_ms <= stale_ms) then return nil end
  local seen
  if state.push.retry_after_policy == "scheduled_returns" then
    local elapsed_s = math.max(now - state.received_ms, 0) / 1000
    seen = M.schedule(state.push, elapsed_s, own_ahead(state, now // 1000))
  end
  local seconds, millis, rung = M.answer(state.push, depth, 0, math.random(), seen)
  if seconds and seen and seconds <= MAX_RETRY_AFTER_S then
    own_promise(state, math.floor((now + seconds * 1000) / 1000))
  end
  return seconds, millis, rung
end

-- One rejection counted, and the value it carried (as the agent takes it: whole seconds, 300
-- at most); retry: the request was a return (it held a place).
local function count_rejection(state, seconds, rung, retry)
  state.rejected = state.rejected + 1
  if retry then state.retries.rejected = state.retries.rejected + 1 end
  if seconds then
    local value = M.handed_out_value(rung, seconds)
    state.handed_out[value] = (state.handed_out[value] or 0) + 1
  end
end

-- The answer's variables: txn.retry_after (seconds), txn.retry_after_ms (the same time in
-- milliseconds, for gRPC's grpc-retry-pushback-ms) and, unless RETRY_AFTER_MS_HEADER is off,
-- txn.retry_after_ms_header (what the configuration stamps as retry-after-ms). None is set
-- when there is no value to send.
local function set_answer(txn, seconds, millis)
  if not seconds then return end
  txn:set_var("txn.retry_after", seconds)
  txn:set_var("txn.retry_after_ms", millis)
  if ms_header then txn:set_var("txn.retry_after_ms_header", millis) end
end

-- http-request lua.retry_after <service>: the Retry-After for this rejection (set_answer) and
-- txn.retry_after_status.
core.register_action("retry_after", { "http-req" }, function(txn, name)
  local state = services[name]
  local seconds, status, rung = retry_after_s, 429, "static"
  local millis = seconds and seconds * 1000
  if state then
    if state.push then status = state.push.status_code end
    local answered, answered_ms, answered_rung = computed_answer(state, own_queue(txn, state), now_ms())
    if answered_rung then seconds, millis, rung = answered, answered_ms, answered_rung end
    count_rejection(state, seconds, rung)
  end
  set_answer(txn, seconds, millis)
  txn:set_var("txn.retry_after_status", status)
end, 1)

-- http-response lua.retry_after_response <service>: a 429 or 503 from the server (Ray Serve's
-- proxy, say) gets the agent's Retry-After, in place of the server's own while an estimate
-- newer than RETRY_AFTER_STALE_MS is held (the server's own, or none, otherwise), for the
-- queue the agent sees; every other response counts as admitted.
core.register_action("retry_after_response", { "http-res" }, function(txn, name)
  local state = services[name]
  if state == nil then return end
  local status = txn.f:status()
  if status ~= 429 and status ~= 503 then
    state.admitted = state.admitted + 1
    return
  end
  local seconds, millis, rung = computed_answer(state, nil, now_ms())
  count_rejection(state, seconds, rung)
  if seconds then
    txn.http:res_set_header("Retry-After", string.format("%d", seconds))
    if ms_header then
      txn.http:res_set_header("retry-after-ms", string.format("%d", millis))
    else
      txn.http:res_del_header("retry-after-ms")
    end
  end
end, 1)

-- gRPC's status for a rejection of HTTP status 429 (RESOURCE_EXHAUSTED) or 503 (UNAVAILABLE).
local GRPC_STATUS = { [429] = "8", [503] = "14" }

-- http-request use-service lua.retry_after_grpc, after lua.retry_after: the call turned away
-- as gRPC answers an error, trailers-only (one HEADERS frame ending the stream, which
-- `http-request return` cannot give a content-type), with grpc-retry-pushback-ms (gRFC A6)
-- when lua.retry_after set a value.
core.register_service("retry_after_grpc", "http", function(applet)
  local status = tonumber(applet:get_var("txn.retry_after_status"))
  applet:set_status(200)
  applet:add_header("content-type", "application/grpc")
  applet:add_header("grpc-status", GRPC_STATUS[status] or GRPC_STATUS[429])
  applet:add_header("grpc-message", "overloaded, retry later")
  local millis = applet:get_var("txn.retry_after_ms")
  if millis then applet:add_header("grpc-retry-pushback-ms", string.format("%d", millis)) end
  applet:start_response()
end)

-- Kept returns ---------------------------------------------------------------------------------

-- The held push and its age in seconds when it is fresh, else nil.
local function fresh_push(state, now)
  local push = state.push
  if push and now - state.received_ms <= stale_ms then return push, math.max(now - state.received_ms, 0) / 1000 end
  return nil
end

-- The second of the place another proxy gave key, from the shared stick table (its gpt0),
-- if the service shares places and one is there; nil otherwise (none, or taken: 0).
local function shared_due(kept, key)
  if kept.shared == nil then return nil end
  local entry = core.backends[kept.shared].stktable:lookup(key)
  local due = entry and tonumber(entry.gpt0)
  if due and due > 0 then return due end
  return nil
end

-- The place in the book of a request keyed by raw (an address, a header's value; nil: none):
-- { key, cookie_due }, cookie_due the second of a place another proxy gave it (shared_due).
local function keyed(kept, hasher, raw)
  local key = raw and hasher.key(raw)
  return key and { key = key, cookie_due = shared_due(kept, key) }
end

-- The request's place in the book if it may hold one: { key, cookie_due } (cookie_due for a
-- verified return cookie, whose nonce is the key, or for a place another proxy gave a shared
-- key, read from the stick table), or nil; hasher for the transaction.
local function returning(txn, kept, hasher, name)
  if kept.source == "source" then
    local addr = txn.f:src()
    return keyed(kept, hasher, addr and tostring(addr))
  elseif kept.header then
    local values = txn.http:req_get_headers()[kept.header]
    return keyed(kept, hasher, values and values[0])
  end
  local cookies = txn.http:req_get_headers()["cookie"] or {}
  for _, line in pairs(cookies) do
    for pair in string.gmatch(line, "[^;]+") do
      local k, v = string.match(pair, "^%s*([^=]+)=(.*)$")
      if k == cookie_name then
        local due, nonce = T.read_cookie(hasher, name, v)
        if due then return { key = nonce, cookie_due = due } end
      end
    end
  end
  return nil
end

-- A new place for a rejected request: its key and, in cookie mode, a fresh nonce; nil for a
-- request without a key.
local function new_key(txn, kept, found)
  if kept.source == "cookie" then
    return string.format("%08x%08x", txn.f:rand(), txn.f:rand())
  end
  return found and found.key
end

-- A rejection in kept mode (T.reject: a place, or the hint); sets txn.retry_after and, in
-- cookie mode with a place, txn.retry_after_cookie; txn.retry_after_no_retry when the place lay
-- beyond the request's deadline (RETRY_AFTER_DEADLINE_HEADER, RETRY_AFTER_MAX_WAIT_S), for the
-- configuration to stamp x-should-retry: false. Seconds (nil: no header) and rung.
local function reject_kept(txn, name, state, hasher, found, depth, drain, now)
  local kept = state.kept
  local push, age_s = fresh_push(state, now)
  local clamp = T.push_clamp(T.book_inputs(push), MAX_KEPT_RETRY_AFTER_S)
  local key = new_key(txn, kept, found)
  local source
  if kept.book.settings.source_share_percent > 0 then
    local values = source_header and txn.http:req_get_headers()[source_header]
    local peer = txn.f:src()
    source = T.source(kept.book, hasher, values and values[#values] or nil, peer and tostring(peer))
  end
  local wait = deadline_header and txn.http:req_get_headers()[deadline_header]
  local deadline = T.deadline_s(wait and wait[0], max_wait_s)
  local seconds, rung, place, beyond = T.reject(kept.book, key, source, now / 1000, depth, drain, clamp,
    deadline, function()
      if push == nil then return retry_after_s, "static" end
      return T.push_hint(M, push, age_s, depth, math.random())
    end)
  if beyond then txn:set_var("txn.retry_after_no_retry", true) end
  if place and kept.shared then
    txn:set_var("txn.retry_after_place_key", key)
    txn:set_var("txn.retry_after_place_due", place.due)
  end
  if place and kept.source == "cookie" then
    txn:set_var("txn.retry_after_cookie",
      T.set_cookie(hasher, name, cookie_name, place.due, key, now // 1000, kept.book.settings.grace_s))
  end
  return seconds, rung
end

-- http-request lua.retry_after_admit <service>, after txn.reject says whether the backend's
-- queue is at its bound: a place due is admitted (txn.retry_after_kept "returned": give it a
-- higher priority class), a fresh or early request into free room ("queued"); else it is
-- rejected, told the time left to its place ("early") or given one ("rejected"), with
-- txn.retry_after, txn.retry_after_status and in cookie mode txn.retry_after_cookie set. For a
-- service without kept returns, the rejection of lua.retry_after.
core.register_action("retry_after_admit", { "http-req" }, function(txn, name)
  local state = services[name]
  local full = txn:get_var("txn.reject")
  full = full == true or full == 1
  local own = state and own_queue(txn, state)
  local now = now_ms()
  local outcome, due, hasher, found, held = full and "rejected" or "queued", nil, nil, nil, nil
  local push, drain = nil, nil
  if state then push, drain = T.book_inputs(fresh_push(state, now)) end
  local depth = own or (push and push.queue_depth) or 0
  if state and state.kept then
    hasher = T.hasher(function(message) return txn.c:hmac(message, "sha1", secret_b64) end)
    found = returning(txn, state.kept, hasher, name)
    outcome, due, held = T.arrive(state.kept.book, state.kept.room, found, now // 1000, depth, full, drain)
  end
  txn:set_var("txn.retry_after_kept", outcome)
  -- A shared place taken here is taken for every proxy: its second goes to 0 in the table.
  if found and state.kept.shared and (held == "due" or (held == "early" and outcome == "queued")) then
    txn:set_var("txn.retry_after_place_key", found.key)
    txn:set_var("txn.retry_after_place_due", 0)
  end
  local retry = T.is_return(held)
  if retry then txn:set_var("txn.retry_after_return", true) end
  if outcome == "returned" or outcome == "queued" then return end
  local seconds, millis, rung = retry_after_s, nil, "static"
  if state and outcome == "early" then
    seconds, rung = T.told(due, now // 1000, T.push_clamp(push, MAX_KEPT_RETRY_AFTER_S)).seconds, "computed"
  elseif state and state.kept then
    seconds, rung = reject_kept(txn, name, state, hasher, found, depth, drain, now)
  elseif state then
    local answered, answered_ms, answered_rung = computed_answer(state, own, now)
    if answered_rung then seconds, millis, rung = answered, answered_ms, answered_rung end
  end
  if state then count_rejection(state, seconds, rung, retry) end
  -- A kept place (and the static value) is a whole second: the seconds told bring the client
  -- back within it, at the fraction of a second it left at, so its milliseconds are the same
  -- time. Only a computed answer has milliseconds of its own.
  set_answer(txn, seconds, millis or (seconds and seconds * 1000))
  txn:set_var("txn.retry_after_status", state and state.push and state.push.status_code or 429)
end, 1)

-- http-request lua.retry_after_admitted <service>: counts a request let through.
core.register_action("retry_after_admitted", { "http-req" }, function(txn, name)
  local state = services[name]
  if state then
    state.admitted = state.admitted + 1
    if txn:get_var("txn.retry_after_return") then state.retries.admitted = state.retries.admitted + 1 end
  end
end, 1)

return M
