"""A greedy streamed chat completion through the official openai client, as the tests and
benchmarks that compare outputs across disturbances ask for one."""

from __future__ import annotations

import openai


async def stream_greedy(
    client: openai.AsyncOpenAI,
    prompt: str,
    *,
    model: str = "demo",
    max_tokens: int = 300,
    seen: list[int] | None = None,
) -> str:
    """The streamed text of ``prompt`` at temperature 0, ``max_tokens`` long (end of
    sequence ignored); ``seen[0]`` counts the chunks as they arrive."""
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                text.append(choice.delta.content)
                if seen is not None:
                    seen[0] += 1
    return "".join(text)
