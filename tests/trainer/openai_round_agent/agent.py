"""The agent of tests/trainer/test_openai_agent_round.py: two requests of at most 8 tokens; rows of an even index
continue the conversation, odd ones start a second one with a summary (two training rows)."""


async def run(client, row):
    messages = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    text = first.choices[0].message.content or ""
    if row["extra_info"]["index"] % 2 == 0:
        messages += [first.choices[0].message, {"role": "user", "content": "and?"}]
    else:
        messages = [{"role": "user", "content": "so: " + text[:4]}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return float(len(second.choices[0].message.content or "") % 2)
