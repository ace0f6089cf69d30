-- Checks retry_after_tickets.lua against the Rust book's answers, with either interpreter the
-- integrations run on:
--   luajit check_tickets.lua VECTORS_FILE     (nginx's; HMAC-SHA1 from the pure-Lua SHA-1 below)
--   lua5.3 check_tickets.lua VECTORS_FILE     (HAProxy's; the mac, cookie and read lines need
--                                              a global hmac_sha1(secret, message) giving the
--                                              20 raw bytes, as policy/tests/ticket_ports_lua.rs
--                                              provides, and are skipped without one)
-- One tab-separated operation per line: policy/tests/ticket_vectors.tsv, made by
-- policy/tests/ticket_vectors.rs (its header explains the lines). Exits non-zero on the first
-- difference; prints how many lines agree, and how many were skipped.
package.path = arg[0]:gsub("[^/]*$", "") .. "?.lua;" .. package.path
local T = require("retry_after_tickets")
local unpack = table.unpack or unpack

-- SHA-1 and HMAC-SHA1 on LuaJIT's bit library (every value a signed 32-bit number).
local function luajit_hmac_sha1()
  local ok, bit = pcall(require, "bit")
  if not ok then return nil end
  local band, bor, bxor, bnot, rol, tobit = bit.band, bit.bor, bit.bxor, bit.bnot, bit.rol, bit.tobit
  local function sha1(message)
    local h0, h1, h2, h3, h4 = tobit(0x67452301), tobit(0xEFCDAB89), tobit(0x98BADCFE),
      tobit(0x10325476), tobit(0xC3D2E1F0)
    local bits = #message * 8
    message = message .. "\128" .. string.rep("\0", (55 - #message) % 64)
      .. string.char(0, 0, 0, 0, math.floor(bits / 16777216) % 256, math.floor(bits / 65536) % 256,
        math.floor(bits / 256) % 256, bits % 256)
    local w = {}
    for chunk = 1, #message, 64 do
      for i = 0, 15 do
        local a, b, c, d = string.byte(message, chunk + i * 4, chunk + i * 4 + 3)
        w[i] = bor(bit.lshift(a, 24), bit.lshift(b, 16), bit.lshift(c, 8), d)
      end
      for i = 16, 79 do w[i] = rol(bxor(w[i - 3], w[i - 8], w[i - 14], w[i - 16]), 1) end
      local a, b, c, d, e = h0, h1, h2, h3, h4
      for i = 0, 79 do
        local f, k
        if i < 20 then f, k = bor(band(b, c), band(bnot(b), d)), 0x5A827999
        elseif i < 40 then f, k = bxor(b, c, d), 0x6ED9EBA1
        elseif i < 60 then f, k = bor(band(b, c), band(b, d), band(c, d)), 0x8F1BBCDC
        else f, k = bxor(b, c, d), 0xCA62C1D6 end
        a, b, c, d, e = tobit(rol(a, 5) + f + e + k + w[i]), a, rol(b, 30), c, d
      end
      h0, h1, h2, h3, h4 = tobit(h0 + a), tobit(h1 + b), tobit(h2 + c), tobit(h3 + d), tobit(h4 + e)
    end
    local out = {}
    for _, h in ipairs({ h0, h1, h2, h3, h4 }) do
      local x = bit.tohex(h)
      for i = 1, 8, 2 do out[#out + 1] = string.char(tonumber(string.sub(x, i, i + 1), 16)) end
    end
    return table.concat(out)
  end
  return function(secret, message)
    if #secret > 64 then secret = sha1(secret) end
    secret = secret .. string.rep("\0", 64 - #secret)
    local inner, outer = {}, {}
    for i = 1, 64 do
      local b = string.byte(secret, i)
      inner[i] = string.char(bxor(b, 0x36))
      outer[i] = string.char(bxor(b, 0x5c))
    end
    return sha1(table.concat(outer) .. sha1(table.concat(inner) .. message))
  end
end

local hmac_sha1 = rawget(_G, "hmac_sha1") or luajit_hmac_sha1()
local function hasher(secret)
  return T.hasher(function(message) return hmac_sha1(secret, message) end)
end

local function opt(v) if v == "-" then return nil end return tonumber(v) end

local book
-- What the port answers for one line's fields (the expected answer left off), or nil for a
-- line it cannot check here.
local function run(f)
  local op = f[1]
  if op == "book" then
    book = T.book({ max_keys = tonumber(f[2]), grace_s = tonumber(f[3]), horizon_s = tonumber(f[4]),
      max_returns_per_key = tonumber(f[5]), source_share_percent = tonumber(f[6]),
      max_sources = tonumber(f[7]) })
    return ""
  elseif op == "held" then
    local held, due = book:held(f[2], opt(f[3]), tonumber(f[4]))
    if held == "early" then return string.format("early:%d", due) end
    return held
  elseif op == "take" then
    book:take(f[2], opt(f[3]), tonumber(f[4]))
    return "ok"
  elseif op == "issue" then
    local due = book:issue(f[2], tonumber(f[3]), tonumber(f[4]))
    return due and string.format("%d", due) or "refused"
  elseif op == "place" then
    local due = book:place(tonumber(f[2]), tonumber(f[3]), tonumber(f[4]), tonumber(f[5]), tonumber(f[6]))
    return due and string.format("%d", due) or "none"
  elseif op == "give" then
    local hint_s, fresh = opt(f[10]), f[11] == "1"
    local source = f[3] ~= "-" and f[3] or nil
    local place, beyond = T.give_place(book, f[2], source, tonumber(f[4]), tonumber(f[5]), tonumber(f[6]),
      opt(f[7]), { tonumber(f[8]), tonumber(f[9]) }, opt(f[12]), function() return hint_s, fresh end)
    if beyond then return string.format("beyond:%d:%d", beyond.due, beyond.seconds) end
    return place and string.format("%d:%d", place.due, place.seconds) or "none"
  elseif op == "expected" then
    return string.format("%.6f", book:expected(tonumber(f[2])))
  elseif op == "source" then
    return T.source_address(f[2] ~= "-" and f[2] or nil, f[3])
  elseif op == "deadline" then
    local d = T.deadline_s(f[2] ~= "-" and f[2] or nil, opt(f[3]))
    return d and string.format("%d", d) or "-"
  elseif op == "counters" then
    local counts = {}
    for i, n in ipairs(book:counters()) do counts[i] = string.format("%d", n) end
    return table.concat(counts, ",")
  elseif hmac_sha1 == nil then
    return nil
  elseif op == "mac" then
    local h = hasher(f[2])
    return h.mac(f[3]) .. "\t" .. h.key(f[3])
  elseif op == "cookie" then
    return T.write_cookie(hasher(f[2]), f[3], tonumber(f[4]), f[5])
  elseif op == "setcookie" then
    return T.set_cookie(hasher(f[2]), f[3], f[4], tonumber(f[5]), f[6], tonumber(f[7]), tonumber(f[8]))
  elseif op == "read" then
    local due, nonce = T.read_cookie(hasher(f[2]), f[3], f[4])
    if due == nil then return nonce end
    return string.format("%d.%s", due, nonce)
  end
  error("unknown operation: " .. op)
end

local checked, skipped = 0, 0
for line in io.lines(arg[1]) do
  local fields = {}
  for field in string.gmatch(line .. "\t", "([^\t]*)\t") do fields[#fields + 1] = field end
  local count = { book = 7, mac = 3, counters = 1 }
  local n = count[fields[1]] or #fields - 1
  local want = table.concat(fields, "\t", n + 1)
  local got = run({ unpack(fields, 1, n) })
  if got == nil then
    skipped = skipped + 1
  elseif got ~= want then
    io.stderr:write("line ", checked + skipped + 1, ": ", line, "\n  lua: ", got, "\n  rust: ", want, "\n")
    os.exit(1)
  else
    checked = checked + 1
  end
end
local interpreter = jit and jit.version or _VERSION
if skipped > 0 then
  print(string.format("%d ticket vectors agree (%s), %d without HMAC-SHA1 skipped", checked, interpreter, skipped))
else
  print(string.format("%d ticket vectors agree (%s)", checked, interpreter))
end
