-- retry-after-agent for nginx (the lua module: libnginx-mod-http-lua, LuaJIT).
--
-- One worker keeps a subscription to the agent per service and stores each pushed estimate in
-- the lua_shared_dict; the header filter of every worker stamps Retry-After on a 429 or 503
-- that has none (nginx's own limit_req / limit_conn rejections, or an upstream's), computed in
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
-- dict ("retry_after").

local policy = require("retry_after_policy")

local M = {}

local options = {
  socket = "/run/retry-after-agent/agent.sock",
  retry_after_s = 5,
  stale_ms = 5000,
  reconnect_max_ms = 5000,
  dict = "retry_after",
}
-- This worker's parsed copy of each service's latest push: { line, push }.
local parsed = {}

local function dict() return ngx.shared[options.dict] end

-- Seconds handed out are reported as the agent takes them: rung and whole seconds, 60 at most.
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

-- The Retry-After for one rejection of service, from its fresh push (nil: none is held) of
-- age seconds: seconds (nil: no header) and rung.
local function answer(service, push, age)
  if push == nil then
    if options.retry_after_s then return options.retry_after_s, "static" end
    return nil, "none"
  end
  local seen
  local now = ngx.now()
  if push.retry_after_policy == "scheduled_returns" then
    seen = policy.schedule(push, age, own_ahead(service, math.floor(now)))
  end
  local seconds, _millis, rung = policy.answer(push, nil, 0, math.random(), seen)
  if seconds and seen and seconds <= policy.MAX_RETRY_AFTER_S then
    local due = math.floor(now + seconds)
    dict():incr(string.format("own:%s:%d", service, due), 1, 0, policy.RETURN_BINS + 10)
  end
  return seconds, rung
end

-- header_filter_by_lua: a 429 or 503 without Retry-After gets the agent's; every response
-- is counted, as admitted or rejected, for the reports. With { replace_upstream = true }, an
-- upstream's own Retry-After (Ray Serve's static retry_after_s, say) is replaced too, while a
-- fresh estimate is held; without one it is left as the upstream sent it.
function M.stamp(service, stamp_options)
  local shared = dict()
  local status = ngx.status
  if status ~= 429 and status ~= 503 then
    shared:incr("admitted:" .. service, 1, 0)
    return
  end
  shared:incr("rejected:" .. service, 1, 0)
  local push, age = fresh_push(service)
  if ngx.header["Retry-After"] ~= nil then
    local replace = stamp_options and stamp_options.replace_upstream
    if not (replace and push) then return end
  end
  local seconds, rung = answer(service, push, age)
  if seconds == nil then return end
  ngx.header["Retry-After"] = string.format("%d", seconds)
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
    for s = 0, policy.MAX_RETRY_AFTER_S do
      local value = policy.handed_out_value(rung, s)
      local count = shared:get(handed_out_key(service, value))
      if count and count > 0 then handed_out[value] = count end
    end
  end
  return handed_out
end

-- One service's report: its lines sent in order, each counted off the dictionary once the agent
-- acknowledged it. False if the connection failed.
local function report(sock, service)
  local shared = dict()
  local admitted = shared:get("admitted:" .. service) or 0
  local rejected = shared:get("rejected:" .. service) or 0
  local lines = policy.report_lines(service, admitted, rejected, nil, take_handed_out(service))
  local function exchange(line)
    return sock:send(line .. "\n") and sock:receive("*l") == "OK"
  end
  return policy.send_report(lines, exchange, function(i, line)
    if i == 1 then
      shared:incr("admitted:" .. service, -admitted, 0)
      shared:incr("rejected:" .. service, -rejected, 0)
    end
    for value, count in pairs(line.carried) do
      shared:incr(handed_out_key(service, value), -count, 0)
    end
  end)
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

-- init_worker_by_lua: read the options; the first worker follows and reports every service.
function M.start(given)
  for key, value in pairs(given or {}) do options[key] = value end
  assert(type(options.services) == "table" and #options.services > 0,
    "retry_after_nginx.start: services must name at least one service")
  assert(dict() ~= nil, "retry_after_nginx.start: no lua_shared_dict " .. options.dict)
  if (ngx.worker.id() or 0) ~= 0 then return end
  for _, service in ipairs(options.services) do
    assert(ngx.timer.at(0, follow, service))
  end
  assert(ngx.timer.at(0, reporter))
end

return M
