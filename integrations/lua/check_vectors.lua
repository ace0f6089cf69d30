-- Checks retry_after_policy.lua's ladder against vectors from the agent's own implementation,
-- with either interpreter the integrations run on:
--   lua5.3 check_vectors.lua VECTORS_FILE     (HAProxy's)
--   luajit check_vectors.lua VECTORS_FILE     (nginx's)
-- One tab-separated vector per line: policy/tests/vectors.tsv, made by policy/tests/vectors.rs.
-- Exits non-zero on the first difference.
package.path = arg[0]:gsub("[^/]*$", "") .. "?.lua;" .. package.path
local M = require("retry_after_policy")
local unpack = table.unpack or unpack
local checked = 0
for line in io.lines(arg[1]) do
  local fields = {}
  for field in string.gmatch(line .. "\t", "([^\t]*)\t") do fields[#fields + 1] = field end
  local push_line, depth, streak, jitter_draw, elapsed, own, seconds, millis, rung, reason = unpack(fields)
  local push = assert(M.parse_estimate(push_line), push_line)
  local function opt(v) if v == "none" then return nil end return M.to_integer(tonumber(v)) end
  local seen = M.schedule(push, tonumber(elapsed), assert(M.parse_returns(own)))
  local s, ms, r, why = M.answer(push, opt(depth), opt(streak), tonumber(jitter_draw), seen)
  local got = string.format("%s %s %s %s", tostring(s or "none"), tostring(ms or "none"), r, why or "none")
  local want = string.format("%s %s %s %s", seconds, millis, rung, reason)
  if got ~= want then
    io.stderr:write("vector ", checked + 1, ": ", line, "\n  lua: ", got, "\n  agent: ", want, "\n")
    os.exit(1)
  end
  checked = checked + 1
end
-- Report lines: each within the agent's line limit, every entry carried once.
local handed_out, total = {}, 0
for s = 0, 60 do handed_out["c" .. s] = 1234567 total = total + 1 end
local carried = 0
for _, report in ipairs(M.report_lines("api", 3, 4, 2, handed_out)) do
  assert(#report.line <= M.MAX_LINE_LEN, report.line)
  for _ in pairs(report.carried) do carried = carried + 1 end
end
assert(carried == total, "report lines carry every entry")
print(string.format("%d vectors agree (%s)", checked, jit and jit.version or _VERSION))
