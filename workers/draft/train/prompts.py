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


# --- chat: prompts shaped like real traffic ------------------------------------------------------
# Many voices (casual, terse, lowercase, long with context, non-native), many tasks (advice, maths
# with fresh numbers, code, lists, role-play, rewriting given text, planning), system prompts and
# follow-ups. ``self_instruct`` goes further: the target itself writes the user's turn.

VOICES = (
    "{q}", "{q}", "{q}", "hey, {ql}", "quick question: {ql}", "{ql}", "{ql} thanks", "Hi! {q} Thank you so much.",
    "{q} Please keep it short.", "So I was wondering... {ql}", "{q} I'm a beginner.", "{q} Explain like I'm five.",
    "Context: {ctx} {q}", "{ctx} Anyway, {ql}", "{q} (for a school project)", "{q}?? pls help", "{q} no jargon please.",
)
CONTEXTS = (
    "I just started a new job and everything is overwhelming.", "My teacher explained this today but I didn't get it.",
    "I'm writing a blog post for my small bakery.", "We're planning a family trip next month.",
    "My manager asked me to present this on Monday.", "I have an exam tomorrow morning.",
    "I've been reading about this all week and I'm confused.", "My kid asked me this at dinner and I had no answer.",
    "I run a tiny online shop selling handmade candles.", "I'm learning to code in my free time.",
)
QUESTIONS = (
    "what's the difference between {a} and {b}", "how do I get better at {a}", "is {a} worth it",
    "why do people care so much about {a}", "can you explain how {a} works", "what are the basics of {a}",
    "what's a good way to start with {a}", "what mistakes do people make with {a}", "how long does it take to learn {a}",
    "give me some tips for {a}", "what would happen if there were no {a}", "how is {a} related to {b}",
    "what's the history behind {a}", "which is better for a beginner, {a} or {b}",
)
SUBJECTS = TOPICS + (
    "knitting", "baking bread", "running a 10k", "learning guitar", "saving money", "writing a CV", "negotiating a salary",
    "growing herbs indoors", "training a puppy", "making friends as an adult", "studying for exams", "bird watching",
    "cooking rice", "choosing a laptop", "writing poetry", "starting a podcast", "Excel formulas", "git branches",
    "SQL joins", "HTTP cookies", "linear algebra", "probability", "world war one", "the Byzantine Empire", "tea",
    "yoga", "home insulation", "solar panels", "electric bikes", "cats", "sharks", "mushrooms", "the Northern Lights",
)
MATHS = (
    "What is {a} times {b}?", "If I have {a} apples and give away {c}, how many are left?",
    "A shirt costs ${a} and is {p}% off. What's the new price?", "Solve for x: {c}x + {a} = {b}",
    "What is {p}% of {b}?", "A train travels {a} km in {c} hours. What's its average speed?",
    "Is {a} a prime number?", "What's the average of {a}, {b} and {c}?", "Convert {a} minutes to hours and minutes.",
    "I earn ${b} a month and spend ${a}. What percentage do I save?", "Round {a}.{c} to the nearest whole number.",
)
LIST_TASKS = (
    "List {n} ideas for {a}.", "Give me {n} reasons to try {a}.", "Name {n} things everyone should know about {a}.",
    "Make a checklist for {a}.", "Write {n} bullet points summarising {a}.", "Suggest {n} names for a blog about {a}.",
    "What are {n} common questions about {a}? Answer each briefly.",
)
ROLES = (
    ("a pirate captain", "Tell me about your ship."), ("a friendly librarian", "Recommend me a book."),
    ("a strict fitness coach", "I skipped the gym again this week."), ("a medieval knight", "What is your quest?"),
    ("a travel agent", "I want somewhere warm in winter."), ("a detective", "Someone ate my lunch at work."),
    ("a job interviewer", "I'm ready for my interview."), ("a wise old tree", "What have you seen in your life?"),
    ("a barista", "What should I order today?"), ("a museum guide", "What's in this room?"),
)
PASSAGES = (
    "Our store will be closed on Monday for inventory. We apologise for any inconvenience and look forward to seeing "
    "you on Tuesday.",
    "hi all, reminder that the team lunch is friday at noon, pls tell me if u cant come so i can book the table",
    "The new update makes the app faster, fixes the login bug and adds a dark mode that many users asked for.",
    "I am writing to complain about the late delivery of my order, which arrived two weeks after the promised date.",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it boils at lower temperatures because "
    "the air pressure is lower.",
    "The project is behind schedule because two people left the team and the requirements changed twice.",
)
TEXT_TASKS = (
    "Make this more polite:\n\n{t}", "Summarise this in one sentence:\n{t}", "Fix any mistakes in this text: {t}",
    "Rewrite this for a ten-year-old: {t}", "Turn this into a short tweet: {t}", "What is the tone of this message? {t}",
    "Reply to this message: \"{t}\"", "Translate to Spanish: {t}", "Make this sound more exciting: {t}",
)
CODE_VOICES = (
    "Write a {lang} function that {task}.", "how do i write something in {lang} that {task}",
    "Can you show me {lang} code that {task}? Explain each line.", "I need a {lang} snippet that {task}, nothing fancy.",
    "What's the cleanest way in {lang} to write code that {task}?",
)
CODE_FIXES = (
    "Why does this Python code print None?\n\ndef add(a, b):\n    print(a + b)\n\nprint(add(2, 3))",
    "What's wrong here?\n\nfor i in range(10)\n    print(i)",
    "Explain what this does: [x * 2 for x in numbers if x > 0]",
    "my javascript says undefined: let total; total += 5; console.log(total)",
    "How can I make this faster?\n\nresult = []\nfor item in items:\n    if item not in result:\n        result.append(item)",
)
CHAT_SYSTEMS = (
    "You are a helpful assistant.", "You are a concise assistant. Answer briefly.", "You are a patient tutor.",
    "You are a friendly customer support agent for an online shop.", "You are an expert software engineer.",
    "Always answer in a cheerful tone.",
)
CHAT_FOLLOW_UPS = FOLLOW_UPS + (
    "ok but why?", "Can you give me another one?", "That's too long, shorter please.", "What about for kids?",
    "Can you write it as a table?", "Great, and what should I do next?", "hmm I don't get it", "Are you sure?",
    "Can you add a fun fact?", "Now do the same in JavaScript.", "Make it more formal.", "Give me a step-by-step version.",
)


def _voice(rng: random.Random, question: str) -> str:
    q = question[0].upper() + question[1:] + ("" if question.endswith("?") else "?")
    return rng.choice(VOICES).format(q=q, ql=question + ("" if question.endswith("?") else "?"),
                                     ctx=rng.choice(CONTEXTS))


def chat_conversation(seed: int, index: int) -> dict:
    """Conversation ``index`` of the chat-style generator: {"messages": [...], "follow_up": str | None}."""
    rng = random.Random(f"chat/{seed}/{index}")
    kind = rng.random()
    a, b = rng.sample(SUBJECTS, 2)
    if kind < 0.35:
        text = _voice(rng, rng.choice(QUESTIONS).format(a=a, b=b))
    elif kind < 0.45:
        text = rng.choice(MATHS).format(a=rng.randint(2, 250), b=rng.randint(100, 5000), c=rng.randint(2, 12),
                                        p=rng.choice((5, 10, 15, 20, 25, 30, 40, 50)))
    elif kind < 0.55:
        text = rng.choice(LIST_TASKS).format(n=rng.choice((3, 4, 5, 6, 7, 10)), a=a)
    elif kind < 0.63:
        role, opener = rng.choice(ROLES)
        text = f"Pretend you are {role}. {opener}"
    elif kind < 0.73:
        text = rng.choice(TEXT_TASKS).format(t=rng.choice(PASSAGES))
    elif kind < 0.85:
        text = rng.choice(CODE_VOICES).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS))
    elif kind < 0.9:
        text = rng.choice(CODE_FIXES)
    else:
        text = conversation(seed, index)["messages"][-1]["content"]
    if rng.random() < 0.3:
        text = text.lower().replace("?", "") if rng.random() < 0.5 else text
    messages = [{"role": "system", "content": rng.choice(CHAT_SYSTEMS)}] if rng.random() < 0.25 else []
    messages.append({"role": "user", "content": text})
    return {"messages": messages, "follow_up": rng.choice(CHAT_FOLLOW_UPS) if rng.random() < 0.3 else None}


PERSONAS = (
    "a tired nurse", "a high-school student", "a retired teacher", "a software developer", "a small-business owner",
    "a teenager who types in lowercase", "a non-native English speaker", "a parent of two young kids",
    "a biology student", "a traveller planning a trip", "a hobby gardener", "a gamer", "someone looking for a job",
    "a chef", "a novelist", "a personal trainer", "a nervous first-time home buyer", "a curious ten-year-old",
    "a marketing manager", "a university professor", "a grandmother learning to use the internet", "a musician",
)
GOALS = (
    "ask for help with a problem at work", "ask a question about science", "get help with a piece of code",
    "ask for a recipe", "get advice about a personal problem", "ask for a maths problem to be solved",
    "ask for a list of ideas", "ask for a short text to be rewritten (include the text)", "ask for a short poem",
    "start a role-play game", "ask for a summary of a topic", "ask how two things compare", "ask for a weekly plan",
    "ask a quick factual question", "ask for an explanation of a word", "ask for help writing an email",
    "ask for a recommendation", "ask for feedback on an idea",
)


def self_instruct(seed: int, index: int) -> dict:
    """A conversation whose user turn the target writes: {"writer": [...], "follow_up": ...}. The
    writer messages ask the target for one user message in a persona's voice; the data maker samples
    it (temperature 0.8) and then has the target answer it, as for any conversation."""
    rng = random.Random(f"self/{seed}/{index}")
    ask = rng.choice((
        "Write one message that {p} might send to an AI assistant to {g}. Write only the message.",
        "You are {p}. Write what you would type to a chatbot to {g}. Reply with the message only.",
        "Imagine {p} chatting with an AI assistant. They want to {g}. What do they type? Only their message.",
    )).format(p=rng.choice(PERSONAS), g=rng.choice(GOALS))
    return {"writer": [{"role": "user", "content": ask}], "writer_seed": rng.getrandbits(31),
            "follow_up": rng.choice(CHAT_FOLLOW_UPS) if rng.random() < 0.25 else None}


def clean_user_turn(text: str) -> str | None:
    """A generated user message, trimmed (labels, quotes, length); None when unusable."""
    text = text.strip()
    for label in ("Message:", "User:", "Me:", "Question:"):
        if text.lower().startswith(label.lower()):
            text = text[len(label):].strip()
    if len(text) > 2 and text[0] == text[-1] == '"':
        text = text[1:-1].strip()
    text = text[:800]
    return text if len(text) >= 8 else None


STYLES = ("templates", "chat", "self-instruct")


def mixed_conversation(seed: int, index: int, styles: tuple[str, ...]) -> dict:
    """Conversation ``index`` drawn in turn from ``styles`` (templates / chat / self-instruct)."""
    style = styles[index % len(styles)]
    if style == "templates":
        return conversation(seed, index)
    if style == "chat":
        return chat_conversation(seed, index)
    return self_instruct(seed, index)
