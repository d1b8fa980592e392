"""Small TinyGuess-style chat transcripts for the warm-start tests: a system prompt, the task, and
the assistant's guesses answered "higher"/"lower" (real text for a real tokenizer's chat template)."""

from __future__ import annotations

SYSTEM = "Guess the secret integer in [1, 50]. Reply as <answer>N</answer>."


def conversation(guesses: list[int], answers: list[str], first: str = "Guess the number.") -> list[dict[str, str]]:
    """A transcript of ``guesses``, each but possibly the last answered by the matching ``answers`` entry."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    for index, guess in enumerate(guesses):
        messages.append({"role": "assistant", "content": f"<think>halve the range</think><answer>{guess}</answer>"})
        if index < len(answers):
            messages.append({"role": "user", "content": answers[index]})
    return messages


#: Two transcripts of different lengths: three turns, and two.
CONVERSATIONS = [conversation([25, 12, 7], ["lower", "lower"]), conversation([25, 37], ["higher"])]
