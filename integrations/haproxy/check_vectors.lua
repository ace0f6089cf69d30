-- Checks retry_after.lua's ladder against vectors from the agent's own implementation:
-- lua5.3 check_vectors.lua VECTORS_FILE   (one tab-separated vector per line; see
-- tests/tests/integrations.rs). Exits non-zero on the first difference.
package.path = arg[0]:gsub("[^/]*$", "") .. "?.lua;" .. package.path
local M = require("retry_after")
local checked = 0
for line in io.lines(arg[1]) do
  local fields = {}
  for field in string.gmatch(line .. "\t", "([^\t]*)\t") do fields[#fields + 1] = field end
  local push_line, depth, streak, unit, elapsed, own, seconds, millis, rung, reason = table.unpack(fields)
  local push = assert(M.parse_estimate(push_line), push_line)
  local function opt(v) if v == "none" then return nil end return math.tointeger(tonumber(v)) end
  local seen = M.schedule(push, math.tointeger(tonumber(elapsed)), assert(M.parse_returns(own)))
  local s, ms, r, why = M.answer(push, opt(depth), opt(streak), tonumber(unit), seen)
  local got = string.format("%s %s %s %s", tostring(s or "none"), tostring(ms or "none"), r, why or "none")
  local want = string.format("%s %s %s %s", seconds, millis, rung, reason)
  if got ~= want then
    io.stderr:write("vector ", checked + 1, ": ", line, "\n  lua: ", got, "\n  agent: ", want, "\n")
    os.exit(1)
  end
  checked = checked + 1
end
print(string.format("%d vectors agree", checked))
