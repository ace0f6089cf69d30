-- The policy side of the Lua integrations: parse the agent's pushes, answer a rejection by the
-- same ladder, formula, jitter, rounding and clamp as the agent (checked against vectors made
-- by the agent's own implementation, policy/tests/vectors.tsv, with both interpreters), and
-- print the reports. No I/O. Loaded by HAProxy (Lua 5.3) and by nginx (LuaJIT, Lua 5.1
-- semantics), so it uses neither `//` nor integer-only functions.

local M = {}

local MAX_RETRY_AFTER_S = 60
-- The default clamp's top, and the widest of the hint policies, seconds.
M.MAX_RETRY_AFTER_S = MAX_RETRY_AFTER_S
local MAX_KEPT_RETRY_AFTER_S = 300
-- The longest Retry-After the agent gives, seconds: a service keeping returns may tell a place
-- up to its book's horizon (opt-in, `max_retry_after_s` above 60). Every clamp stays within it.
M.MAX_KEPT_RETRY_AFTER_S = MAX_KEPT_RETRY_AFTER_S
-- The longest answer line the agent sends (bytes, without the newline).
M.MAX_RESPONSE_LEN = 2048

-- Splits a response line into its leading words and its key=value options.
function M.parse_fields(line)
  local words, options = {}, {}
  for word in string.gmatch(line, "[^ \r\n]+") do
    local key, value = string.match(word, "^([^=]+)=(.*)$")
    if key then options[key] = value else words[#words + 1] = word end
  end
  return words, options
end

-- An integral number as an integer (Lua 5.3), or as it is (LuaJIT: every number is a double);
-- nil for anything else.
local to_integer = math.tointeger or function(x)
  if type(x) == "number" and x == math.floor(x) and x - x == 0 then return x end
  return nil
end
M.to_integer = to_integer

local function opt_int(v) if v == nil or v == "none" then return nil end return to_integer(tonumber(v)) end
local function opt_float(v) if v == nil or v == "none" then return nil end return tonumber(v) + 0.0 end

-- Bins of a schedule of promised returns: one per second, a minute ahead and some.
M.RETURN_BINS = 64

-- Parses a returns= schedule (counts per second from the push, comma-separated), or nil.
function M.parse_returns(v)
  local counts = {}
  if v == nil or v == "none" then return counts end
  for count in string.gmatch(v .. ",", "([^,]*),") do
    if not string.match(count, "^%d+$") or #count > 10 or #counts >= M.RETURN_BINS then return nil end
    local n = to_integer(tonumber(count))
    if n == nil or n > 4294967295 then return nil end
    counts[#counts + 1] = n
  end
  return counts
end

-- What to answer with elapsed_s seconds after the push: { returns, overload_age_s }, the
-- push's returns from then on (shifted by the whole seconds elapsed), bin by bin no less than
-- own (this proxy's own promises from now on), and the overload's age then.
function M.schedule(push, elapsed_s, own)
  if elapsed_s < 0 then elapsed_s = 0 end
  local returns, skip = {}, math.floor(elapsed_s)
  for i = 1, M.RETURN_BINS do
    returns[i] = math.max(push.returns[i + skip] or 0, own[i] or 0)
  end
  local age = push.overload_age_s and (push.overload_age_s + elapsed_s + 0.0) or nil
  return { returns = returns, overload_age_s = age }
end

-- Parses an ESTIMATE line into a table, or nil. Its fields are named as the line's keys.
function M.parse_estimate(line)
  local words, o = M.parse_fields(line)
  if words[1] ~= "ESTIMATE" or words[2] == nil then return nil end
  if M.parse_returns(o.returns) == nil then return nil end
  local overload_rule = o.overload_rule or "latest_with_room"
  if overload_rule ~= "latest_with_room" and overload_rule ~= "latest" and overload_rule ~= "fill_capacity" then
    return nil
  end
  return {
    service = words[2],
    retry_after_policy = o.retry_after_policy or "static",
    status_code = opt_int(o.status_code) or 429,
    retry_after_s = opt_int(o.retry_after_s),
    queue_depth = opt_int(o.queue_depth),
    drain_rate = opt_float(o.drain_rate),
    occupancy = opt_float(o.occupancy),
    occupancy_weight = opt_float(o.occupancy_weight) or 0.25,
    backoff_weight = opt_float(o.backoff_weight) or 0.25,
    backoff_streak_saturation = opt_int(o.backoff_streak_saturation) or 5,
    jitter = opt_float(o.jitter) or 0.2,
    min_retry_after_s = opt_int(o.min_retry_after_s) or 1,
    max_retry_after_s = opt_int(o.max_retry_after_s) or 60,
    arrival_rate = opt_float(o.arrival_rate),
    returns = M.parse_returns(o.returns),
    overload_rule = overload_rule,
    overload_age_s = opt_float(o.overload_age_s),
    overload_horizon_factor = opt_float(o.overload_horizon_factor),
  }
end

local function finite(x) return x == x and x ~= math.huge and x ~= -math.huge end
local function clamp(x, lo, hi) if x < lo then return lo elseif x > hi then return hi else return x end end

local function jitter_factor(jitter, jitter_draw)
  local j = finite(jitter) and clamp(jitter, 0.0, 0.999) or 0.0
  local u = finite(jitter_draw) and clamp(jitter_draw, 0.0, 1.0) or 0.5
  return 1.0 + j * (2.0 * u - 1.0)
end

-- value seconds, rounded up to whole seconds and milliseconds (microseconds first), clamped.
local function rounded(value, min_s, max_s)
  if not (finite(value) and value >= 0.0) then return nil end
  local top = clamp(max_s, 1, MAX_KEPT_RETRY_AFTER_S)
  local bottom = clamp(min_s, 1, top)
  local x = value * 1e6
  if x >= 2.0^62 then return top, top * 1000 end
  local whole = math.floor(x)
  local micros = to_integer(whole) + ((x - whole >= 0.5) and 1 or 0)
  local seconds = clamp(math.floor((micros + 999999) / 1000000), bottom, top)
  local millis = clamp(math.floor((micros + 999) / 1000), bottom * 1000, top * 1000)
  return seconds, millis
end

-- The first second s in low..high with room_per_s * (s + 1) >= depth + 1 + promised[0..s].
-- (Bin i of a schedule is promised[i + 1]: Lua counts from 1.)
local function earliest_second(depth, room_per_s, promised, low, high)
  if not (finite(room_per_s) and room_per_s > 0.0) then return nil end
  local ahead = depth + 0.0 + 1.0
  for s = 0, high do
    ahead = ahead + (promised[s + 1] or 0)
    if s >= low and room_per_s * (s + 1.0) >= ahead then return s end
  end
  return nil
end

local function latest_second_with_room(drain, promised, low, high)
  for s = high, low, -1 do
    if (promised[s + 1] or 0) + 1.0 <= drain then return s end
  end
  return nil
end

-- The latest second considered in an overload of this age: ceil(factor * age) in the clamp.
local function overload_horizon(push, age, low, high)
  local factor = push.overload_horizon_factor
  if factor == nil or age == nil or not finite(factor * age) then return high end
  local h = math.ceil(factor * age)
  if h < 0 then h = 0 end
  if h >= 2.0^62 then return high end
  return clamp(to_integer(h) or high, low, high)
end

-- scheduled_returns' second (docs/estimator.md): room after the fresh arrivals for the queue,
-- the returns promised and this one; else the overload rule up to the horizon; else the
-- horizon.
local function scheduled_returns(push, depth, seen)
  local promised = seen.returns
  local arrivals = push.arrival_rate
  if arrivals == nil or not finite(arrivals) or arrivals <= 0.0 then arrivals = 0.0 end
  local high = clamp(push.max_retry_after_s, 1, MAX_KEPT_RETRY_AFTER_S)
  local low = clamp(push.min_retry_after_s, 1, high)
  local horizon = overload_horizon(push, seen.overload_age_s, low, high)
  local s = earliest_second(depth, push.drain_rate - arrivals, promised, low, high)
  if s == nil and push.overload_rule == "fill_capacity" then
    s = earliest_second(depth, push.drain_rate, promised, low, horizon)
  elseif s == nil and push.overload_rule == "latest_with_room" then
    s = latest_second_with_room(push.drain_rate, promised, math.max(math.floor(horizon / 2), low), horizon)
  end
  return (s or horizon) + 0.0
end

-- The ladder for one rejection: seconds (or nil: no header), millis, rung, reason (or nil).
-- seen: the promised returns and the overload's age (default the push's own; see M.schedule).
function M.answer(push, depth, streak, jitter_draw, seen)
  if depth == nil then depth = push.queue_depth end
  streak = streak or 0
  local reason
  if push.retry_after_policy == "static" then
    reason = "static_policy"
  elseif push.drain_rate == nil or not finite(push.drain_rate) or push.drain_rate <= 0.0 then
    reason = "drain_not_warm"
  elseif depth == nil then
    reason = "queue_invisible"
  elseif push.retry_after_policy == "scheduled_returns" or push.retry_after_policy == "kept_returns" then
    -- kept_returns, answered without a book: scheduled_returns with the fill_capacity rule.
    local rules = push
    if push.retry_after_policy == "kept_returns" then
      rules = setmetatable({ overload_rule = "fill_capacity" }, { __index = push })
    end
    local base = scheduled_returns(rules, depth, seen or { returns = push.returns, overload_age_s = push.overload_age_s })
    local u = finite(jitter_draw) and clamp(jitter_draw, 0.0, 0.999) or 0.5
    local seconds, millis = rounded(math.max(base - u, 0.0), push.min_retry_after_s, push.max_retry_after_s)
    return seconds, millis, "computed", nil
  else
    local occupancy = push.occupancy
    if occupancy == nil or not finite(occupancy) then occupancy = 0.0 else occupancy = clamp(occupancy, 0.0, 1.0) end
    local backoff = math.min((streak + 0.0) / (math.max(push.backoff_streak_saturation, 1) + 0.0), 1.0)
    local factor = 1.0 + push.occupancy_weight * occupancy + push.backoff_weight * backoff
    local base = (depth + 0.0) / push.drain_rate * factor
    if finite(base) and base >= 0.0 then
      local seconds, millis = rounded(base * jitter_factor(push.jitter, jitter_draw), push.min_retry_after_s, push.max_retry_after_s)
      if seconds then return seconds, millis, "computed", nil end
    end
    reason = "estimate_unusable"
  end
  if push.retry_after_s then return push.retry_after_s, push.retry_after_s * 1000, "static", reason end
  return nil, nil, "none", reason
end

-- Longest request line the agent accepts (bytes, without the newline).
M.MAX_LINE_LEN = 512

-- The handed_out entry of one rejection's value, as the agent takes it: its rung ("c"
-- computed, "s" static) and whole seconds, MAX_KEPT_RETRY_AFTER_S at most ("c5").
function M.handed_out_value(rung, seconds)
  return string.format("%s%d", rung == "static" and "s" or "c",
    math.min(math.floor(seconds), MAX_KEPT_RETRY_AFTER_S))
end

-- Send one report's lines (from report_lines) in order: exchange(line) sends one and is true
-- once the agent answered OK; count_off(i, report) is then called, to take what that line
-- carried (the admissions and rejections with the first, report.carried with each) off the
-- proxy's counts. False at the first line not acknowledged: the rest stay counted, for the
-- next report.
function M.send_report(lines, exchange, count_off)
  for i, report in ipairs(lines) do
    if not exchange(report.line) then return false end
    count_off(i, report)
  end
  return true
end

-- The REPORT lines for one report, each with the handed_out entries it carries: handed_out
-- maps handed_out_value entries ("c5", "s5") to counts; entries that do not fit one line go on in
-- further lines with admitted=0 rejected=0. retries: { admitted = n, rejected = n }, the
-- returns among them, for a proxy that tells them (one keeping places); nil otherwise.
function M.report_lines(name, admitted, rejected, queue_depth, handed_out, retries)
  local keys = {}
  for value in pairs(handed_out) do keys[#keys + 1] = value end
  table.sort(keys)
  local head = string.format("REPORT %s admitted=%d rejected=%d", name, admitted, rejected)
  if queue_depth then head = head .. string.format(" queue_depth=%d", queue_depth) end
  if retries then
    head = head .. string.format(" retry_admitted=%d retry_rejected=%d", retries.admitted, retries.rejected)
  end
  local lines, line, carried = {}, head .. " handed_out=", {}
  local rest = string.format("REPORT %s admitted=0 rejected=0 handed_out=", name)
  for _, value in ipairs(keys) do
    local entry = value .. ":" .. handed_out[value]
    if next(carried) ~= nil and #line + 1 + #entry > M.MAX_LINE_LEN then
      lines[#lines + 1] = { line = line, carried = carried }
      line, carried = rest, {}
    end
    line = line .. (next(carried) ~= nil and "," or "") .. entry
    carried[value] = handed_out[value]
  end
  if next(carried) == nil then line = line .. "none" end
  lines[#lines + 1] = { line = line, carried = carried }
  return lines
end

return M
