"""The reverse task's reward: 1 for the exact reversal, else partial credit for each letter in its place."""


def reversal(data_source, solution_str, ground_truth, extra_info):
    answer = solution_str.strip()
    if answer == ground_truth:
        return {"score": 1.0, "exact": 1.0}
    hits = sum(a == b for a, b in zip(answer, ground_truth))
    return {"score": 0.5 * hits / max(extra_info["length"], len(answer)), "exact": 0.0}
