"""LLM providers behind one port.

base.py              the port: a request, its events and reply, the provider's refusals
openai_responses.py  OpenAI's (or Azure's) Responses API over httpx
fake.py              the offline provider of PROVIDER=fake (fake_schema.py: what it accepts)
routing.py           several providers behind the port, routed by model (PROVIDERS_FILE)
anthropic.py         Anthropic's Messages API over httpx (anthropic_request.py: its request)
chat_completions.py  Chat Completions servers (vLLM, Ollama...) over httpx
                     (chat_completions_request.py: its request)
gemini.py            the Gemini API (generateContent) over httpx (gemini_request.py: its request)
wire.py              what every HTTP adapter does alike: httpx's errors, Retry-After, trace
"""
