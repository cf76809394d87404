"""Values and rules that import nothing but core: no I/O, no framework.

model.py       the domain values (conversations, turns, runs, leases, keys)
plans.py       a turn request checked into its plan; the one If-Match rule
asks.py        what a client of the OpenAI surface asks for one turn, and its echo
items.py       the item grammar: what an input or stored item may be
translate/     each provider's own item form (Anthropic's blocks, Gemini's parts, Chat's messages)
               and the one seam the rest reads them through; each form's request translation
window.py      which earlier turns a request sends, and the system prompt
ids.py         every id either surface shows, and reading them back
events.py      durable turns' event names and payloads
sizes.py       what a turn and a conversation hold, in bytes
usage.py       token usage, added up
strictjson.py  JSON as the contract reads it (no duplicate keys, no NaN, bounded depth)
errors.py      the one exception hierarchy, each with its status and code
"""
