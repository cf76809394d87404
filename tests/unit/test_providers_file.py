"""PROVIDERS_FILE (service/platform/providers_file.py) and routing by model
(service/providers/routing.py): several providers at once, each model served by one, a bad
file refused at start-up with one line naming it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from service.app import build_provider, check_provider
from service.platform.settings import Settings, SettingsError
from service.providers.openai_responses import Endpoint, ResponsesProvider
from service.providers.routing import Routed
from service.providers.wire import WireLimits
from tests.support.fakeapi import FakeResponsesAPI
from tests.support.helpers import Target, sdk

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "providers.example.toml"
TWO_FAKES = """
[providers.local]
kind = "fake"
models = ["fake-a", "fake-b"]

[providers.other]
kind = "fake"
models = ["fake-c"]
"""


def written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "providers.toml"
    path.write_text(text)
    return path


def test_the_example_file_reads_as_the_readme_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-example")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "azure-example")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-example")
    monkeypatch.setenv("GEMINI_API_KEY", "gemini-example")
    named = Settings(providers_file=EXAMPLE).providers()
    assert named is not None and named.default_model == "gpt-5-mini"
    assert [(p.name, p.kind, p.models) for p in named.providers] == [
        ("openai", "openai", ("gpt-5", "gpt-5-mini")),
        ("claude", "anthropic", ("claude-sonnet-4-5", "claude-haiku-4-5")),
        ("google", "gemini", ("gemini-3-pro-preview", "gemini-2.5-flash")),
        ("eu", "azure", ("my-deployment",)),
        ("local", "chat", ("Qwen/Qwen3-8B",)),
        ("offline", "fake", ("fake-llm",)),
    ]
    assert named.providers[4].api_key is None  # no key: no Authorization header
    assert named.providers[0].api_key == "sk-example"  # read from the variable it names
    served = {"gpt-5", "gpt-5-mini", "claude-sonnet-4-5", "claude-haiku-4-5"}
    served |= {
        "my-deployment",
        "Qwen/Qwen3-8B",
        "fake-llm",
        "gemini-3-pro-preview",
        "gemini-2.5-flash",
    }
    assert Settings(providers_file=EXAMPLE).served_models() == served


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (TWO_FAKES.replace('"fake-c"', '"fake-a"'), "model 'fake-a' is served by both"),
        (
            TWO_FAKES.replace(
                'kind = "fake"\nmodels = ["fake-c"]', 'kind = "bard"\nmodels = ["x"]'
            ),
            "kind must be one of openai, azure, anthropic, gemini, chat, fake, not 'bard'",
        ),
        (
            '[providers.v]\nkind = "chat"\nmodels = ["qwen"]',
            "kind 'chat' needs base_url",
        ),
        (
            '[providers.g]\nkind = "gemini"\nmodels = ["gemini-3"]',
            "kind 'gemini' needs api_key_env",
        ),
        (
            '[providers.c]\nkind = "anthropic"\nmodels = ["claude"]',
            "kind 'anthropic' needs api_key_env",
        ),
        (
            '[providers.o]\nkind = "openai"\napi_key_env = "TS_TEST_UNSET_KEY"\nmodels = ["m"]',
            "the variable TS_TEST_UNSET_KEY (api_key_env) is not set",
        ),
        ('[providers.o]\nkind = "openai"\nmodels = []', "models must be a non-empty list"),
        (
            '[providers.o]\nkind = "openai"\nbase_url = "https://u:p@x.example"\nmodels = ["m"]',
            "must not carry credentials",
        ),
        ('default_model = "nope"\n' + TWO_FAKES, "default_model 'nope' is served by no provider"),
        (
            '[providers.o]\nkind = "fake"\nmodels = ["m"]\napi_key = "sk-inline"',
            "unknown key 'api_key'",
        ),
        ("[providers.o\n", "is not valid TOML"),
        ('default_model = "m"\n', "no [providers.NAME] table"),
    ],
)
def test_a_bad_file_stops_the_start_with_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, names: str
) -> None:
    monkeypatch.delenv("TS_TEST_UNSET_KEY", raising=False)
    with pytest.raises(SettingsError) as refused:
        Settings(providers_file=written(tmp_path, text))
    message = str(refused.value)
    assert message.startswith("PROVIDERS_FILE: ") and names in message and "\n" not in message
    assert "sk-inline" not in message  # a key written in the file by mistake is not repeated


async def test_models_are_listed_with_their_provider_and_turns_routed_by_model(
    tmp_path: Path,
) -> None:
    """/v1/models names each model's provider; a /v1 turn and an /api/v1 turn each go to the
    provider of the model they name, a turn naming none to the default model's, and a model no
    provider serves is 400 model_not_found on either surface, before any provider call."""
    path = written(tmp_path, 'default_model = "fake-c"\n' + TWO_FAKES)
    settings = Settings(providers_file=path)
    provider = build_provider(settings)
    assert isinstance(provider, Routed)
    async with sdk(Target(), provider, providers_file=path) as (client, _, plain):
        listed = await client.models.list()
        owners = [("fake-c", "other"), ("fake-a", "local"), ("fake-b", "local")]
        assert [(m.id, m.owned_by) for m in listed.data] == owners
        assert (await client.models.retrieve("fake-a")).owned_by == "local"

        answered = await client.responses.create(model="fake-a", input="hi", store=True)
        assert answered.model == "fake-a"
        chained = await client.responses.create(input="again", previous_response_id=answered.id)
        assert chained.model == "fake-c"  # the default model, on the other provider

        first = await plain.post("/api/v1/chat", json={"message": "hi", "model": "fake-b"})
        assert first.status_code == 200, first.text
        cid = first.json()["conversation_id"]
        second = await plain.post("/api/v1/chat", json={"message": "on", "conversation_id": cid})
        assert second.status_code == 200, second.text
        turns = (await plain.get(f"/api/v1/conversations/{cid}")).json()["turns"]
        assert [t["model"] for t in turns] == ["fake-b", "fake-c"]

        # An Idempotency-Key's retry must name the same model: another is another request.
        keyed = {"Idempotency-Key": "k-1"}
        once = await plain.post(
            "/api/v1/chat", json={"message": "k", "model": "fake-a"}, headers=keyed
        )
        assert once.status_code == 200, once.text
        again = await plain.post(
            "/api/v1/chat", json={"message": "k", "model": "fake-a"}, headers=keyed
        )
        assert again.json()["conversation_id"] == once.json()["conversation_id"]
        other = await plain.post(
            "/api/v1/chat", json={"message": "k", "model": "fake-c"}, headers=keyed
        )
        assert (
            other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
        )

        refused = await plain.post("/api/v1/chat", json={"message": "hi", "model": "gpt-9"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as v1_refused:
            await client.responses.create(model="gpt-9", input="hi")
        assert v1_refused.value.code == "model_not_found" and v1_refused.value.param == "model"


async def test_each_request_reaches_the_endpoint_of_its_models_provider() -> None:
    """Two Responses API providers behind the router: each call goes to its model's endpoint
    with that provider's key, and each turn's origin names the provider that answered it."""
    first, second = FakeResponsesAPI(), FakeResponsesAPI()
    limits = WireLimits(1.0, 5.0, 262_144)
    one = ResponsesProvider(
        Endpoint.openai("https://one.invalid/v1", "sk-one", "m-1", "one"),
        limits,
        transport=httpx.MockTransport(first.handle),
    )
    two = ResponsesProvider(
        Endpoint.openai("https://two.invalid/v1", None, "m-2", "two"),
        limits,
        transport=httpx.MockTransport(second.handle),
    )
    routed = Routed([("one", one, ["m-1"]), ("two", two, ["m-2", "m-3"])], "m-1")
    async with sdk(Target(), routed, models="m-1,m-2,m-3") as (client, _, _plain):
        await client.responses.create(model="m-3", input="hi")
        await client.responses.create(input="hi")
    assert [r["model"] for r in first.requests] == ["m-1"]
    assert [r["model"] for r in second.requests] == ["m-3"]
    assert first.headers[0]["authorization"] == "Bearer sk-one"
    assert "authorization" not in second.headers[0]  # a server without a key gets none
    assert routed.origin_for("m-3").provider == "two"
    assert routed.origin_for("m-3").endpoint == "https://two.invalid/v1/responses"
    assert routed.origin_for(None) == one.origin


async def test_the_example_file_builds_each_kind_on_its_own_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = ("OPENAI_API_KEY", "AZURE_OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY")
    for variable in keys:
        monkeypatch.setenv(variable, f"key-of-{variable}")
    provider = build_provider(Settings(providers_file=EXAMPLE))
    try:
        assert isinstance(provider, Routed)
        endpoints = {
            model: (provider.origin_for(model).provider, provider.origin_for(model).endpoint)
            for model, _ in provider.models
        }
        assert endpoints["claude-haiku-4-5"] == ("claude", "https://api.anthropic.com/v1/messages")
        assert endpoints["gpt-5"] == ("openai", "https://api.openai.com/v1/responses")
        eu = ("eu", "https://my-resource.openai.azure.com/openai/v1/responses")
        assert endpoints["my-deployment"] == eu
        assert endpoints["fake-llm"] == ("offline", "builtin")
        google = ("google", "https://generativelanguage.googleapis.com/v1beta/models/")
        assert endpoints["gemini-2.5-flash"] == google
        assert "key-of" not in repr(provider.origin_for("claude-haiku-4-5"))
        assert "key-of" not in repr(provider.origin_for("gemini-2.5-flash"))
    finally:
        await provider.close()


@pytest.mark.parametrize(
    ("provider", "names"),
    [
        ("anthropic", "anthropic needs ANTHROPIC_API_KEY and ANTHROPIC_MODEL"),
        ("gemini", "gemini needs GEMINI_API_KEY and GEMINI_MODEL"),
        ("openai", "openai needs OPENAI_API_KEY and OPENAI_MODEL"),
        ("azure", "azure needs AZURE_OPENAI_ENDPOINT, _API_KEY and _DEPLOYMENT"),
    ],
)
def test_serve_refuses_a_provider_without_its_key_before_it_starts(
    provider: str, names: str
) -> None:
    """`turnstore serve` checks this first and exits with the line (it was a traceback)."""
    with pytest.raises(ValueError, match=names):
        check_provider(Settings(llm_provider=provider))
    check_provider(Settings(llm_provider="anthropic", anthropic_api_key="k", anthropic_model="m"))
