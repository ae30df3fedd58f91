"""A seeded generator of diverse chat prompts for self-distillation (no data set is downloaded).

Conversation i is a pure function of (seed, i): topics × task kinds × output formats, code tasks,
rewriting and summarising of generated passages, and follow-up turns (multi-turn: the follow-up is
asked after the target's own first answer, see :mod:`workers.draft.train.data`). Local text or
JSONL files can add prompts of the user's own (:func:`local_prompts`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "climate change", "the immune system",
    "compound interest", "volcanoes", "the Roman Empire", "quantum computing", "sourdough bread", "electric cars",
    "the water cycle", "plate tectonics", "the stock market", "sleep", "honeybees", "the printing press",
    "renewable energy", "the human brain", "coffee", "chess", "the Moon landing", "vaccines", "recycling",
    "jazz music", "the Great Wall of China", "inflation", "DNA", "rainforests", "marathon training", "the internet",
    "ancient Egypt", "volunteering", "public speaking", "meditation", "budgeting", "gardening tomatoes",
    "learning a language", "time management", "the solar system", "earthquakes", "birds' migration", "3D printing",
    "the Renaissance", "job interviews", "healthy breakfast", "remote work", "cybersecurity", "photography",
    "the Olympic Games", "climate-friendly travel", "cloud computing", "electric guitars", "ocean tides",
    "supply and demand", "antibiotics", "the Silk Road", "urban cycling", "houseplants", "board games",
    "the Industrial Revolution", "dinosaurs", "blockchain", "first aid", "camping", "password managers",
)
TASKS = (
    "Explain {topic} to a ten-year-old.", "Explain {topic} in simple terms.", "What is {topic}?",
    "Give me five interesting facts about {topic}.", "Write a short story that involves {topic}.",
    "Write a haiku about {topic}.", "What are the pros and cons of {topic}?", "Compare {topic} and {other}.",
    "Write a short email to a friend recommending they learn about {topic}.",
    "Describe the history of {topic} in a few sentences.", "What are common misconceptions about {topic}?",
    "Give me a step-by-step beginner's guide to {topic}.", "Write a tweet about {topic}.",
    "How does {topic} affect everyday life?", "Create a quiz with three questions about {topic}.",
    "Write a persuasive paragraph about why {topic} matters.", "Summarize what experts say about {topic}.",
    "What should a beginner know before getting into {topic}?", "Write a product description inspired by {topic}.",
    "Explain the connection between {topic} and {other}.",
)
FORMATS = ("", "", "", " Answer in one paragraph.", " Use bullet points.", " Use a numbered list.",
           " Keep it under 60 words.", " Include an example.", " Be concise.", " Use simple words.")
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a sentence", "merges two sorted lists", "finds the largest element of a list",
    "converts Celsius to Fahrenheit", "removes duplicates from a list while keeping order",
    "checks whether a string is a palindrome", "computes the factorial of n", "flattens a nested list",
    "returns the most common character in a string", "validates an email address with a regular expression",
    "reads a CSV file and returns the rows as dictionaries", "computes the average of a list of numbers",
    "sorts a list of dictionaries by a key", "implements binary search", "capitalises every word of a sentence",
)
LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C", "Rust", "Go", "SQL")
SENTENCES = (
    "the meeting got moved to tomorrow cause the boss is sick", "i think we should maybe try the other approach",
    "this product is really good and i like it a lot", "we was late because the train didnt come",
    "Please find attached the document you asked for yesterday.", "can u send me the report asap",
    "The results were not as good as we hoped, but we learned a lot.", "our team crushed the goals this quarter",
)
REWRITES = ("Rewrite this sentence more formally: \"{s}\"", "Fix the grammar: \"{s}\"",
            "Make this sound friendlier: \"{s}\"", "Translate into French: \"{s}\"",
            "Paraphrase: \"{s}\"")
FOLLOW_UPS = ("Can you make it shorter?", "Can you give me an example?", "Explain that in more detail.",
              "Now summarize it in one sentence.", "What would you add for an expert?", "Thanks! Why is that?",
              "Can you turn that into a list?", "How would I explain this to my grandmother?")


def conversation(seed: int, index: int) -> dict:
    """Conversation ``index``: {"messages": [...], "follow_up": str | None}."""
    rng = random.Random(f"{seed}/{index}")
    kind = rng.random()
    if kind < 0.15:
        lang = rng.choice(LANGUAGES)
        text = f"Write a {lang} function that {rng.choice(CODE_TASKS)}." + rng.choice(
            ("", " Add a short explanation.", " Include a docstring.", " Add a usage example."))
    elif kind < 0.25:
        text = rng.choice(REWRITES).format(s=rng.choice(SENTENCES))
    else:
        topic, other = rng.sample(TOPICS, 2)
        text = rng.choice(TASKS).format(topic=topic, other=other) + rng.choice(FORMATS)
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice((
            "You are a helpful assistant.", "You are a concise assistant.", "You are a friendly teacher."))})
    messages.append({"role": "user", "content": text})
    follow_up = rng.choice(FOLLOW_UPS) if rng.random() < 0.25 else None
    return {"messages": messages, "follow_up": follow_up}


HELD_OUT_SEED = 7_777_777  # no training run uses it: trainer seeds are s (train) and s + 1_000_003 (eval)


def held_out_prompts(tokenizer, count: int) -> dict[str, list[int]]:
    """``count`` chat prompts (token ids, generation prompt added) no train-draft conversation uses."""
    out = {}
    for i in range(count):
        text = tokenizer.apply_chat_template(conversation(HELD_OUT_SEED, i)["messages"], add_generation_prompt=True,
                                             tokenize=False)
        out[f"p{i}"] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def local_prompts(paths: list[str | Path]) -> list[dict]:
    """User prompts from local files: ``.jsonl`` lines with "prompt" / "text" / "messages", or plain
    text files (one prompt per blank-line-separated paragraph)."""
    out = []
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"prompt file {path} does not exist")
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
                if isinstance(item, dict) and isinstance(item.get("messages"), list):
                    messages = [m for m in item["messages"] if m.get("role") != "assistant"][:1] or item["messages"][:1]
                else:
                    text = item.get("prompt") or item.get("text") if isinstance(item, dict) else None
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{n}: expected a 'prompt', 'text' or 'messages' field")
                    messages = [{"role": "user", "content": text}]
                out.append({"messages": messages, "follow_up": None})
        else:
            for para in path.read_text().split("\n\n"):
                if para.strip():
                    out.append({"messages": [{"role": "user", "content": para.strip()}], "follow_up": None})
    return out
