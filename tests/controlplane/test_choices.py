"""`n` choices, lists of prompts and `echo` through the official openai client against a live server."""

from __future__ import annotations

import pytest
from cp_support import CHAT_MODEL
from test_live_server import client_for, live, wait_for_events  # noqa: F401  (live is a fixture)

from controlplane.usage.models import UsageEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.real_model, pytest.mark.once]

MESSAGES = [{"role": "system", "content": "You write one short line. " * 12},
            {"role": "user", "content": "Name a colour."}]


def test_n_choices_share_the_prompt_and_count_it_once(live, backend):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    one = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=7)
    fresh = [{**MESSAGES[0], "content": "Answer in one short line. " * 12}, MESSAGES[1]]
    hits_before = backend.metrics()[CHAT_MODEL].prefix_cache_hit_tokens
    many = client.chat.completions.create(model=CHAT_MODEL, messages=fresh, max_tokens=6, temperature=1.0,
                                          seed=7, n=4)
    hits = backend.metrics()[CHAT_MODEL].prefix_cache_hit_tokens - hits_before
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in many.choices}) > 1  # each choice has its own generator
    # The prompt was computed once: the three siblings adopted its full blocks from the prefix cache.
    prompt = many.usage.prompt_tokens
    assert hits >= 3 * ((prompt - 1) // 16 * 16)
    again = client.chat.completions.create(model=CHAT_MODEL, messages=fresh, max_tokens=6, temperature=1.0, seed=7)
    assert again.choices[0].message.content == many.choices[0].message.content  # choice 0 keeps the seed
    # Usage counts the prompt once and every choice's output.
    assert many.usage.prompt_tokens == again.usage.prompt_tokens
    assert many.usage.completion_tokens >= 4
    events = [e for e in wait_for_events(3) if e.route == "openai.chat"]
    assert (events[1].input_tokens, events[1].output_tokens) == (prompt, many.usage.completion_tokens)
    assert one.usage.prompt_tokens > 0

    streamed = client.chat.completions.create(model=CHAT_MODEL, messages=fresh, max_tokens=6, temperature=1.0,
                                              seed=7, n=4, stream=True)
    texts = {i: "" for i in range(4)}
    finished = set()
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2, 3}
    assert [texts[i] for i in range(4)] == [c.message.content for c in many.choices]  # seeded: reproducible


def test_prompt_lists_and_echo(live):  # noqa: F811
    url, tenant = live
    client = client_for(url, tenant)
    prompts = ["The sky is", "Two plus two is", "Paris is in"]
    alone = [client.completions.create(model=CHAT_MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts]
    together = client.completions.create(model=CHAT_MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert len(together.choices) == 6
    assert [c.text for c in together.choices] == [t for t in alone for _ in range(2)]  # greedy: n copies
    echoed = client.completions.create(model=CHAT_MODEL, prompt=prompts[0], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompts[0] + alone[0]
    chunks = client.completions.create(model=CHAT_MODEL, prompt=prompts[0], max_tokens=4, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompts[0] + alone[0]
    assert UsageEvent.objects.filter(route="openai.completions").count() >= 1
