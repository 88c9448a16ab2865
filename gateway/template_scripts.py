"""Lua scripts that write a template in one step each.

Redis runs a script atomically: no other client (another gateway sharing the
Redis, say) sees a template half written, and a gateway that dies mid-call
leaves either nothing or the whole write. A hash without ``token_ids`` (left
by a gateway from before these scripts, killed between its two writes) counts
as no template: reads skip it and a create replaces it.
"""

from __future__ import annotations

import redis

# KEYS: hash, index. ARGV: name, ttl seconds (0: none), the tenant's limits on
# templates and pinned blocks (0: none), this template's pinned blocks, the
# prefix of the tenant's template hashes, then field, value pairs.
# Returns 1 when created, 0 when the name is taken, -1 / -2 past a limit.
# NOTE: the limits read the tenant's other templates by names built here (not
# passed in KEYS): fine on one Redis, which is what the gateway supports.
_CREATE = """
if redis.call('HEXISTS', KEYS[1], 'token_ids') == 1 then return 0 end
local max_templates, max_pinned = tonumber(ARGV[3]), tonumber(ARGV[4])
if max_templates > 0 or max_pinned > 0 then
  local count, pinned = 0, tonumber(ARGV[5])
  for _, other in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    local hash = ARGV[6] .. other
    if redis.call('HEXISTS', hash, 'token_ids') == 1 then
      count = count + 1
      pinned = pinned + (tonumber(redis.call('HGET', hash, 'pin_blocks')) or 0)
    else
      redis.call('ZREM', KEYS[2], other)
    end
  end
  if max_templates > 0 and count >= max_templates then return -1 end
  if max_pinned > 0 and pinned > max_pinned then return -2 end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 7))
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
return 1
"""

# KEYS: hash. ARGV: ttl ("keep", "0": no expiry, or seconds), description
# ("" with ARGV[3] == "keep": unchanged). Returns 0 when there is no template.
_UPDATE = """
if redis.call('HEXISTS', KEYS[1], 'token_ids') == 0 then return 0 end
if ARGV[1] == '0' then redis.call('PERSIST', KEYS[1])
elseif ARGV[1] ~= 'keep' then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
if ARGV[3] ~= 'keep' then redis.call('HSET', KEYS[1], 'description', ARGV[2]) end
return 1
"""

# KEYS: hash, index. ARGV: name. Returns 1 when a template was deleted.
_DELETE = """
local existed = redis.call('HEXISTS', KEYS[1], 'token_ids')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return existed
"""

# KEYS: hash. ARGV: field, value. Never resurrects a deleted or expired template.
_SET_IF_PRESENT = """
if redis.call('HEXISTS', KEYS[1], 'token_ids') == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class TemplateScripts:
    """The scripts, registered on one client (EVALSHA, loaded again after a Redis restart)."""

    def __init__(self, client: redis.Redis) -> None:
        self.create = client.register_script(_CREATE)
        self.update = client.register_script(_UPDATE)
        self.delete = client.register_script(_DELETE)
        self.set_if_present = client.register_script(_SET_IF_PRESENT)
