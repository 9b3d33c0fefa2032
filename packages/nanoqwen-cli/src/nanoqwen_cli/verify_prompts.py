"""The built-in prompt set of `nanoqwen-cli verify`: code and prose, chat and raw, short and long.

Diversity matters more than count: chat-templated and raw requests exercise different special tokens,
and the lengths are chosen to cross KV page boundaries (16 tokens) at different offsets.
"""

from __future__ import annotations

CHAT = "chat"
RAW = "raw"

PROMPTS: tuple[tuple[str, str], ...] = (
    (CHAT, "Write a Python function that returns the n-th Fibonacci number iteratively."),
    (RAW, "def quicksort(xs):\n    "),
    (CHAT, "Explain in two sentences what a hash map is."),
    (RAW, "// Rust: parse a comma-separated list of integers\nfn parse_list(s: &str) -> Vec<i64> {\n"),
    (CHAT, "hi"),
    (RAW, "The three laws of thermodynamics are"),
    (CHAT, "Translate to French: 'The weather is nice today, let us go for a walk by the river.'"),
    (RAW, "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return result<|fim_middle|>"),
    (CHAT, "What is wrong with this code?\n\nfor i in range(10)\n    print(i)"),
    (RAW, "SELECT name, COUNT(*) AS n FROM orders JOIN customers ON orders.customer_id = customers.id "),
    (CHAT, "List five prime numbers greater than 100, separated by commas."),
    (
        RAW,
        'import numpy as np\n\n\ndef softmax(x: np.ndarray) -> np.ndarray:\n    """Numerically stable softmax."""\n',
    ),
    (CHAT, "Write a haiku about compilers."),
    (RAW, "#include <stdio.h>\n\nint main(void) {\n    printf("),
    (
        CHAT,
        "Summarise the plot of Hamlet in one paragraph, naming the main characters and how the play ends.",
    ),
    (RAW, "Once upon a time"),
)


def prompt_set(n: int) -> list[tuple[str, str]]:
    """The first n prompts; beyond the built-in set, numbered variants of it (still distinct requests)."""
    out = []
    for i in range(n):
        kind, text = PROMPTS[i % len(PROMPTS)]
        if i >= len(PROMPTS):
            text = (
                f"{text} (variant {i // len(PROMPTS)})" if kind == CHAT else f"# {i // len(PROMPTS)}\n{text}"
            )
        out.append((kind, text))
    return out
