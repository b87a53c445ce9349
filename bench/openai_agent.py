"""The agent program of ``bench.openai_agent_cost``: ``turns`` requests of ``turn_tokens`` tokens each, a tool
message after each but the last, the whole history sent back each time (the official client, no rlcore import)."""


async def run(client, row):
    messages = list(row["messages"])
    turns, tokens = row["extra_info"]["turns"], row["extra_info"]["turn_tokens"]
    for turn in range(turns):
        response = await client.chat.completions.create(model="policy", messages=messages, max_tokens=tokens)
        messages.append(response.choices[0].message)
        if turn < turns - 1:
            messages.append({"role": "tool", "content": "k"})
    return 0.0
