"""The tool of the agent cost bench (bench/agent_cost.py): as cheap as a tool gets, so the bench measures the loop."""


def ping() -> str:
    """Answer at once."""
    return "k"
