"""LLM providers behind one port.

base.py              the port: a request, its events and reply, the provider's refusals
openai_responses.py  OpenAI's (or Azure's) Responses API over httpx
fake.py              the offline provider of PROVIDER=fake (fake_schema.py: what it accepts)
routing.py           several providers behind the port, routed by model (PROVIDERS_FILE)
"""
