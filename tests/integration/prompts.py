"""Prompts shared by the integration tests: varied, with a chat-templated and a long one."""

LONG_TEXT = (
    "PagedAttention manages the key-value cache of a transformer the way an operating system "
    "manages memory: the cache is split into fixed-size blocks, each sequence keeps a block "
    "table that maps its logical blocks to physical ones, and blocks are allocated only when a "
    "sequence grows into them. Because the only waste is the unused tail of each sequence's "
    "last block, many more sequences fit in the same memory, and the batch can grow until the "
    "memory, not fragmentation, is the limit. Blocks can also be shared: parallel samples of "
    "one prompt point at the same prompt blocks, and copy a block only when one of them writes "
    "into it. "
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a list of five fruits:\n1.",
    "Once upon a time, in a small village by the sea, there lived",
    "Traduisez en anglais : « Le chat dort sur le canapé. »",
    "Question: What is 17 multiplied by 3?\nAnswer:",
    "The three laws of thermodynamics are",
    LONG_TEXT * 4 + "\nSummarize the text above in one sentence:",
]

CHAT = [{"role": "user", "content": "What is the largest planet in our solar system?"}]


def batch_prompts(n: int) -> list[str]:
    """n distinct short prompts for batch-invariance tests."""
    topics = ["rivers", "mountains", "computers", "music", "the moon", "bread", "chess",
              "volcanoes", "bicycles", "oceans", "languages", "trees", "clocks", "honey",
              "glass", "trains"]
    styles = ["Write one sentence about", "Tell me a fact about"]
    out = []
    for i in range(n):
        out.append(f"{styles[i % 2]} {topics[(i // 2) % len(topics)]}{'.' if i % 4 < 2 else ':'}")
    return out
