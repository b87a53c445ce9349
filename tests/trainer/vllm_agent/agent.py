"""The agent of tests/trainer/test_vllm_round.py's openai-loop round: two turns of the same conversation; its reward
is the share of 'a' in what the model wrote."""


async def run(client, row):
    messages = list(row["messages"])
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [first.choices[0].message, {"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return text.count("a") / max(len(text), 1)
