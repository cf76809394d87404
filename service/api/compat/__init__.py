"""The OpenAI surface (/v1), as OpenAI's clients read it.

responses.py       the /v1/responses routes
commands.py        a create's body made into the use case's command (core/asks.Asked)
answers.py         a response asked, answered: a Response, its event stream, or relayed
response_views.py  a kept response shown: as it is now, its input items, its events again
stream.py          a response's events, numbered and built as OpenAI streams them
conversations.py   the /v1/conversations routes and their items
item_views.py      items as the surface shows them (ids, sealed reasoning), and pages
objects.py         request bodies and the objects answered (Response, compaction, ...)
models.py          /v1/models
"""
