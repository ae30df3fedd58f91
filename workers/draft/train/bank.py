"""A prompt bank shaped like real chat, for self-distillation at scale (no data set is downloaded).

Conversation i is a pure function of (seed, i): a task kind (explanations, advice, how-to, code to
write, debug or translate, maths with fresh numbers, lists, rewriting and summarising generated
passages, creative writing, role-play under a system prompt, messages to write, plans, language
questions, JSON and tool-call requests, conversations with earlier turns, and self-instruct, where
the target writes the user's turn) × a subject drawn from the kind's own pools × a voice (plain,
polite, casual lowercase, terse, typos, with context) × an output format, with an optional system
prompt and up to two follow-ups that the target answers after its own replies. The combinations
run into millions; :data:`BANK_VERSION` names the mapping, so a corpus made from it can tell when
conversation i would now be another one.

A conversation is ``{"messages": [...], "follow_ups": [str, ...]}`` or, for self-instruct,
``{"writer": [...], "writer_seed": int, "follow_ups": [...]}`` (the target samples the user turn
from the writer messages, :func:`workers.draft.train.prompts.clean_user_turn` trims it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from .bank_words import (  # the bank's words: topics, voices, formats, frames
    SCIENCE, HISTORY, TECH, EVERYDAY, HOBBIES, PLACES,
    FOODS, ANIMALS, JOBS, ALL_TOPICS, CONTEXTS, OPENERS,
    CLOSERS, FORMATS, SYSTEMS, GENERIC_FOLLOW_UPS, LANGS, CODE_GOALS,
    CODE_CONSTRAINTS, _VARS, _OPENINGS, _BODIES, _THINGS, _DAYS,
    _REASONS, _FACT_FRAMES, ROLEPLAYS, _FIELDS, TOOLS, _SETUPS,
    PERSONAS, GOALS, KINDS, _VERBATIM,
)

BANK_VERSION = 1

# --- voices ------------------------------------------------------------------------------------


def _typos(rng: random.Random, text: str) -> str:
    """A few swapped or dropped letters, as in hurried typing."""
    words = text.split(" ")
    for _ in range(max(1, len(words) // 9)):
        i = rng.randrange(len(words))
        w = words[i]
        if len(w) > 3 and w.isalpha():
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:] if rng.random() < 0.6 else w[:j] + w[j + 1:]
    return " ".join(words)


def _lower(text: str) -> str:
    text = text.lower()
    return text[:-1] if text.endswith((".", "?")) and "\n" not in text else text


VOICES: tuple[tuple[str, Callable[[random.Random, str], str]], ...] = (
    ("plain", lambda rng, t: t),
    ("plain", lambda rng, t: t),
    ("plain", lambda rng, t: t),
    ("polite", lambda rng, t: rng.choice(("Hi! ", "Hello, ", "Hi there. ", "")) + t + " " +
     rng.choice(("Thank you!", "Thanks a lot.", "Much appreciated.", "Thanks so much in advance."))),
    ("casual", lambda rng, t: rng.choice(OPENERS) + " " + _lower(t) + " " + rng.choice(CLOSERS)),
    ("lower", lambda rng, t: _lower(t)),
    ("typos", lambda rng, t: _typos(rng, _lower(t) if rng.random() < 0.5 else t)),
    ("context", lambda rng, t: rng.choice(CONTEXTS) + " " + t),
    ("context", lambda rng, t: t + " " + rng.choice(CONTEXTS)),
    ("urgent", lambda rng, t: t + rng.choice((" asap", " quickly please", " need this in 5 min", "!!", " urgent"))),
)

# --- task kinds: each returns (user text, follow-ups that suit it) -------------------------------


def _explain(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    t = rng.choice(SCIENCE + HISTORY + TECH)
    q = rng.choice((
        "How does {t} work?", "What is {t}, in simple terms?", "Can you explain {t}?", "Why does {t} matter?",
        "I never understood {t}. Can you explain it?", "What's the basic idea behind {t}?",
        "What do most people get wrong about {t}?", "Give me an intuition for {t}.", "ELI5 {t}",
        "What's a good analogy for {t}?", "explain {t} but assume I know nothing", "{t}: what's the deal with it?",
        "What are the key facts about {t} I should remember for an exam?", "How would you teach {t} in 5 minutes?",
        "Who figured out {t}, and how?", "What's the difference between {t} and {u}?",
        "How are {t} and {u} connected, if at all?",
    )).format(t=t, u=rng.choice(SCIENCE + HISTORY + TECH))
    return q, ("Can you give a real-world example?", "And what about " + rng.choice(ALL_TOPICS) + "?",
               "What's the history of that idea?", "Quiz me on it with three questions.")


def _advice(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    q = rng.choice((
        "I'm thinking about getting into {h}. Where do I start?", "Any tips for {e}?",
        "I keep failing at {e}. What am I doing wrong?", "Is {h} expensive to get into?",
        "How do I stay motivated with {h}?", "What's the smartest way to approach {e}?",
        "I'm a {j} and I want to get better at {e}. Suggestions?", "My friend says {h} is boring. Convince me otherwise.",
        "How much time per week should I spend on {h} to actually improve?", "I have {n} euros. Is that enough to start {h}?",
        "What are the first three things a beginner should learn in {h}?", "Is it too late to start {h} at {age}?",
        "How do I talk to my manager about {e}?", "What do {j}s wish people knew about their job?",
        "I'm considering becoming a {j}. What's the day-to-day like?",
    )).format(h=rng.choice(HOBBIES), e=rng.choice(EVERYDAY), j=rng.choice(JOBS), n=rng.choice((50, 100, 200, 500)),
              age=rng.choice((30, 40, 52, 65, 70)))
    return q, ("What if that doesn't work?", "What equipment do I need?", "How long until I see progress?",
               "ok, give me a plan for the first week")


def _howto(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    q = rng.choice((
        "How do I make {f}?", "What's the easiest recipe for {f}?", "Step-by-step: {e}.",
        "How do I go about {e}?", "Walk me through {e} like I've never done it.", "Can I make {f} without an oven?",
        "How do I make {f} vegan?", "I have {x}, {y} and {z}. Can I make {f} with that?",
        "How do I store leftover {f}?", "What goes wrong most often when making {f}?",
    )).format(f=rng.choice(FOODS), e=rng.choice(EVERYDAY), x=rng.choice(("rice", "eggs", "flour", "beans")),
              y=rng.choice(("garlic", "milk", "tomatoes", "cheese")), z=rng.choice(("an onion", "butter", "spinach", "lemons")))
    return q, ("How long does it keep?", "Can I double the quantities?", "What can I use instead of the first ingredient?",
               "Make it a shopping list.")


def _code_write(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    lang, goal = rng.choice(LANGS), rng.choice(CODE_GOALS)
    q = rng.choice((
        "Write a {l} function that {g}.", "{l}: something that {g}", "how would i write code in {l} that {g}",
        "Can you give me {l} code that {g}?", "I need a {l} snippet that {g}.", "What's the idiomatic {l} way to write "
        "a function that {g}?", "write me a {l} program that {g}",
    )).format(l=lang, g=goal) + rng.choice(CODE_CONSTRAINTS)
    return q, ("Can you add error handling?", "Now write tests for it.", "What's the time complexity?",
               f"Now do it in {rng.choice(LANGS)}.", "Explain it line by line.", "Can it be made shorter?")


def _snippet(rng: random.Random) -> str:
    v = rng.choice(_VARS)
    f = rng.choice(("total", "process", "clean", "summarize", "compute", "count_items", "check"))
    return rng.choice((
        f"def {f}({v}):\n    result = 0\n    for i in range(len({v}) + 1):\n        result += {v}[i]\n    return result",
        f"def {f}({v}=[]):\n    {v}.append(1)\n    return {v}",
        f"const {f} = ({v}) => {{\n  {v}.forEach(x => {{ return x * 2 }})\n}}",
        f"SELECT name, COUNT(*) FROM {v} WHERE COUNT(*) > 2 GROUP BY name;",
        f"for (int i = 0; i <= n; i++) {{\n    sum += {v}[i];\n}}",
        f"if {v} == None:\n    print('empty')\nelif len({v}) = 0:\n    print('also empty')",
        f"{v} = [1, 2, 3]\nfor x in {v}:\n    if x % 2 == 0:\n        {v}.remove(x)\nprint({v})",
        f"async function {f}() {{\n  const res = fetch('/api/{v}');\n  return res.json();\n}}",
        f"def {f}(a, b):\n    return a / b\n\nprint({f}(10, 0))",
        f"while True:\n    line = input()\n    if line == 'quit':\n        break\n    {v}.append(line)",
        f"x = '5'\ny = 3\nprint(x + y)",
        f"let {v} = [3, 1, 10, 2];\n{v}.sort();\nconsole.log({v});",
        f"import json\nwith open('{v}.json') as fh:\n    {v} = json.load(fh)\nprint({v}['first'])",
    ))


def _code_debug(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    code = _snippet(rng)
    q = rng.choice((
        "What's wrong with this code?\n\n{c}", "Why doesn't this work?\n```\n{c}\n```", "Can you explain what this "
        "does?\n\n{c}", "{c}\n\nthis gives me an error, help", "Review this code and suggest improvements:\n\n{c}",
        "Is there a bug here?\n\n{c}", "How would you rewrite this more cleanly?\n\n{c}",
    )).format(c=code)
    return q, ("How do I avoid that in the future?", "Can you show the fixed version only?", "Why is that a problem?")


def _code_concept(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    a, b = rng.sample(TECH, 2)
    lang = rng.choice(LANGS)
    q = rng.choice((
        "When should I use {a} instead of {b}?", "How do I get started with {a} as a junior developer?",
        "What's a {l} example of {a}?", "Explain {a} with a short {l} example.", "What are common interview questions "
        "about {a}?", "Is {l} a good first programming language?", "What's the difference between {l} and {m}?",
        "How do I convert this {l} idea to {m}: a loop that sums a list?", "git: how do I undo my last commit but keep "
        "the changes?", "What does '{err}' mean in {l}?",
    )).format(a=a, b=b, l=lang, m=rng.choice(LANGS), err=rng.choice((
        "index out of range", "null pointer exception", "segmentation fault", "undefined is not a function",
        "permission denied", "stack overflow", "connection refused", "syntax error: unexpected token")))
    return q, ("Show me a minimal example.", "What are the gotchas?", "How does that compare in " + rng.choice(LANGS) + "?")


def _maths(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    a, b, c = rng.randint(3, 97), rng.randint(120, 9800), rng.randint(2, 15)
    p = rng.choice((3, 7, 12, 15, 18, 22, 35, 45, 60))
    q = rng.choice((
        "What's {a} × {c}?", "What is {b} divided by {c}?", "{a}+{b}=?", "Calculate {p}% of {b}.",
        "A jacket is {b} pence and there's a {p}% discount. How much do I pay?", "Solve: {c}x - {a} = {b}",
        "If a car uses {c} litres per 100 km, how much fuel for {b} km?", "I walk {a} minutes a day. How many hours "
        "is that in a year?", "What's the area of a circle with radius {c} cm?", "Convert {b} grams to pounds.",
        "I split a bill of {b} between {c} people and add a {p}% tip. How much each?", "What is {a} squared?",
        "Is {b} divisible by {c}? Explain.", "simplify the fraction {a}/{b}", "A recipe for {c} people needs {a} g of "
        "flour. How much for {n} people?", "If I invest {b} at {p}% a year, what do I have after {c} years?",
        "What's the probability of rolling two sixes with two dice?", "Mean and median of {a}, {c}, {p}, {n} and {a2}?",
        "A train leaves at 9:{mm} and the trip takes {a} minutes. When does it arrive?", "What's {b} in binary?",
        "How many seconds are in {c} days?", "What is the derivative of {c}x^3 + {a}x?",
    )).format(a=a, b=b, c=c, p=p, n=rng.randint(2, 20), a2=rng.randint(1, 99), mm=rng.randint(10, 59))
    return q, ("Show your working.", "How did you get that?", "Can you check that answer again?",
               "Now explain it for a 12-year-old.", "What formula did you use?")


def _lists(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    n = rng.choice((3, 4, 5, 5, 6, 7, 8, 10, 12))
    q = rng.choice((
        "List {n} {kind} for {who}.", "Give me {n} ideas for {occ}.", "{n} {kind}, go", "What are {n} good names "
        "for a {pet}?", "Brainstorm {n} titles for a blog post about {t}.", "Name {n} {animals}-related facts.",
        "Make a packing list for {days} days in {place}.", "Give me {n} conversation starters for {occ}.",
        "List the pros and cons of {t}.", "Top {n} mistakes beginners make in {h}?", "Suggest {n} {kind} that "
        "don't cost money.",
    )).format(n=n, kind=rng.choice(("gift ideas", "weekend activities", "healthy snacks", "podcast topics",
                                    "team-building games", "study tricks", "date ideas", "rainy-day projects")),
              who=rng.choice(("a 7-year-old", "my dad who likes fishing", "a coworker", "a new neighbour", "teenagers",
                              "someone who has everything", "a remote team")),
              occ=rng.choice(("a first meeting with clients", "a family reunion", "a school fundraiser", "a wedding toast",
                              "a team offsite", "a long road trip", "a networking event")),
              pet=rng.choice(("goldfish", "black cat", "golden retriever", "pet rabbit", "parrot", "tortoise")),
              t=rng.choice(ALL_TOPICS), animals=rng.choice(ANIMALS), days=rng.randint(2, 14),
              place=rng.choice(PLACES), h=rng.choice(HOBBIES))
    return q, ("Give me " + str(n) + " more.", "Which one would you pick and why?", "Rank them.",
               "Make them funnier.", "Shorter please, just the items.")


def _passage(rng: random.Random, sentences: int = 1) -> str:
    parts = [rng.choice(_BODIES).format(thing=rng.choice(_THINGS), day=rng.choice(_DAYS), reason=rng.choice(_REASONS))
             for _ in range(sentences)]
    text = ". ".join(p[0].upper() + p[1:] for p in parts) + "."
    opening = rng.choice(_OPENINGS)
    return (opening + " " + text).strip()


def _rewrite(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    text = _passage(rng, rng.randint(1, 3))
    if rng.random() < 0.4:
        text = _typos(rng, text.lower())
    q = rng.choice((
        "Rewrite this more professionally:\n\n{x}", "Make this friendlier: {x}", "Fix the grammar and spelling:\n{x}",
        "Can you make this shorter? \"{x}\"", "Turn this into bullet points:\n{x}", "Translate into {lang}: {x}",
        "Rewrite for a text message: {x}", "Make this sound less angry:\n\n{x}", "Is this clear? How would you "
        "improve it?\n\n{x}", "reword this so it doesn't sound passive aggressive: {x}",
    )).format(x=text, lang=rng.choice(("French", "German", "Spanish", "Italian", "Portuguese", "Dutch")))
    return q, ("Make it even more casual.", "Now a version for my boss.", "Can you give me two alternatives?")


def _summarise(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    kind = rng.random()
    if kind < 0.4:
        t, u = rng.sample(ALL_TOPICS, 2)
        frames = rng.sample(_FACT_FRAMES, rng.randint(4, 8))
        text = " ".join(f.format(t=t, u=u, p=rng.randint(20, 70)) for f in frames)
    elif kind < 0.7:
        people = rng.sample(("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"), 4)
        lines = [f"{rng.choice(people)}: {rng.choice(_BODIES).format(thing=rng.choice(_THINGS), day=rng.choice(_DAYS), reason=rng.choice(_REASONS))}"
                 for _ in range(rng.randint(4, 9))]
        text = "Meeting notes\n" + "\n".join(lines)
    else:
        who, where = rng.choice(("a retired baker", "a young engineer", "two sisters", "a lost dog", "a nervous student")), \
            rng.choice(PLACES)
        text = (f"Once, {who} travelled to {where}. " + " ".join(rng.sample((
            "The trip started badly, with a missed train and a lost bag.", "A stranger helped them find the way.",
            "They discovered a small market full of strange food.", "It rained for three days straight.",
            "On the last evening they watched the sunset from a hill.", "They learned a few words of the local language.",
            "An old friend appeared by pure coincidence.", "They decided to come back the next year."), 5)))
    q = rng.choice((
        "Summarise this:\n\n{x}", "TL;DR please:\n{x}", "Can you give me the key points of the following?\n\n{x}",
        "{x}\n\nSummarise the above in two sentences.", "What are the action items here?\n\n{x}",
        "Give this a title and a one-line summary:\n\n{x}", "{x}\n\nwhat's the main point",
    )).format(x=text)
    return q, ("What's missing from it?", "Shorter, one sentence.", "Who would care about this most?")


def _creative(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    subject = rng.choice(ALL_TOPICS + ANIMALS + PLACES + FOODS)
    q = rng.choice((
        "Write a poem about {s}.", "Write a limerick about {s}.", "Write a short story ({w} words) about {s}.",
        "Write a song chorus about {s}.", "Tell me a joke about {s}.", "Write a haiku about {s} in {season}.",
        "Write a bedtime story for a {age}-year-old about {a}.", "Write the opening line of a mystery novel set in {p}.",
        "Write a sonnet about {s}, but make it funny.", "Write a short dialogue between {a} and a {j}.",
        "Describe {p} at dawn in a paragraph.", "Write a motivational speech about {s} for a {j}.",
        "Write a rap verse about {s}.", "Invent a myth that explains {sc}.",
    )).format(s=subject, w=rng.choice((50, 100, 150, 200)), season=rng.choice(("winter", "spring", "summer", "autumn")),
              age=rng.randint(3, 10), a=rng.choice(ANIMALS), p=rng.choice(PLACES), j=rng.choice(JOBS),
              sc=rng.choice(SCIENCE))
    return q, ("Make it rhyme.", "Make it sadder.", "Give it a title.", "Now write a second verse.",
               "Make it shorter.", "Change the ending.")


def _roleplay(rng: random.Random) -> tuple[str, tuple[str, ...], str | None]:
    role, opener = rng.choice(ROLEPLAYS)
    if rng.random() < 0.5:
        system = rng.choice(("You are {r}. Stay in character.", "Role-play as {r}. Never break character.",
                             "Act as {r} in a text adventure. Keep replies under 100 words.")).format(r=role)
        return opener, ("What happens next?", "I look around.", "Tell me more.", "*smiles* and then?"), system
    text = rng.choice(("Let's play a game. You're {r}. {o}", "Pretend to be {r}. {o}", "act like {r}. {o}",
                       "Roleplay: you are {r} and I'm a visitor. {o}")).format(r=role, o=opener)
    return text, ("What happens next?", "I walk away. What do you say?", "ok now break character and explain the game"), None


def _message(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    q = rng.choice((
        "Write an email to my {to} saying {what}.", "Help me text my {to} that {what}.", "Draft a LinkedIn post "
        "announcing that {what}.", "Write a short speech for my {to}'s retirement party.", "Write a card message "
        "for my {to} who {event}.", "How do I tell my {to} that {what} without sounding rude?", "Write a cover letter "
        "opening for a {j} position.", "Write a complaint to my {to} because {reason}.", "Write a reply declining "
        "an offer from a recruiter for a {j} role.", "Help me write an apology to my {to}; {what}.",
    )).format(to=rng.choice(("landlord", "manager", "team", "sister", "best friend", "neighbour", "teacher", "client",
                             "flatmate", "mum", "coach")),
              what=rng.choice(("I'll be late on Monday", "I can't make the party", "the project is finished early",
                               "I'm moving out in June", "I broke their favourite mug", "I need the weekend off",
                               "we won the contract", "I got a new job")),
              event=rng.choice(("just graduated", "is moving abroad", "had a baby", "is recovering from surgery",
                                "turned 40")), j=rng.choice(JOBS), reason=rng.choice(_REASONS))
    return q, ("Make it warmer.", "Shorter, please.", "More formal.", "Add a joke at the end.")


def _plan(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    q = rng.choice((
        "Plan a {d}-day trip to {p}.", "Make me a weekly meal plan with {f} in it.", "I want to learn {h} in {w} weeks. "
        "Make a plan.", "Create a study schedule for an exam on {t} in {w} weeks.", "Plan a birthday party for {n} "
        "kids.", "What's a good morning routine for a {j}?", "Make a {w}-week running plan to go from 0 to 5k.",
        "Help me plan my Saturday: gym, groceries, laundry and dinner with friends at 8.", "Itinerary for one day in {p}, "
        "I like {h}.", "I want to save {b} in {w} months. How?",
    )).format(d=rng.randint(2, 10), p=rng.choice(PLACES), f=rng.choice(FOODS), h=rng.choice(HOBBIES),
              w=rng.randint(2, 12), t=rng.choice(ALL_TOPICS), n=rng.randint(5, 20), j=rng.choice(JOBS),
              b=rng.choice(("1,000", "3,000", "500", "10k")))
    return q, ("Make it cheaper.", "Can you make it more relaxed?", "Put it in a table by day.", "What if it rains?")


def _language(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    word = rng.choice(("ubiquitous", "serendipity", "pragmatic", "nuance", "ephemeral", "cynical", "resilient",
                       "procrastinate", "ambiguous", "benevolent", "meticulous", "candid", "nostalgia", "irony"))
    lang = rng.choice(("French", "Spanish", "German", "Japanese", "Italian", "Korean", "Portuguese", "Swedish"))
    q = rng.choice((
        "What does '{w}' mean?", "Use '{w}' in three sentences.", "How do you say '{p}' in {l}?", "What's the "
        "difference between 'fewer' and 'less'?", "Is it 'who' or 'whom' here: '___ did you call?'", "Give me a "
        "synonym for '{w}'.", "How do I pronounce '{w}'?", "What's the {l} word for '{n}'?", "Conjugate the verb 'to {v}' "
        "in {l}, present tense.", "Tips for learning {l} as an adult?", "Correct my {l}: '{bad}'",
        "When do I use a semicolon?", "What's the origin of the word '{w}'?",
    )).format(w=word, l=lang, p=rng.choice(("good luck", "I'm hungry", "see you tomorrow", "how much is this",
                                            "where is the bathroom", "happy birthday")),
              n=rng.choice(("umbrella", "library", "kitchen", "butterfly", "train", "friendship")),
              v=rng.choice(("eat", "go", "be", "have", "speak", "want")),
              bad=rng.choice(("je suis allé au magasin hier et j'ai acheter du pain", "yo tengo veinte años y me gusta "
                              "mucho el leer", "ich habe gestern ins Kino gegangen")))
    return q, ("Give me another example.", "Is that formal or informal?", "How would a native speaker say it?")


def _quick(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    q = rng.choice((
        "capital of {c}?", "how tall is mount everest", "Who painted the Mona Lisa?", "How far is the Moon?",
        "What year did the {h} begin?", "Is a tomato a fruit?", "How many bones are in the human body?",
        "what's the boiling point of water in fahrenheit", "Who wrote Pride and Prejudice?", "How long do {a} live?",
        "What do {a} eat?", "What time zone is {p} in?", "What's the population of {p}, roughly?",
        "What's the fastest land animal?", "Are {a} endangered?", "What's the currency in {p}?",
    )).format(c=rng.choice(("Canada", "Peru", "Kenya", "Vietnam", "Norway", "Morocco", "New Zealand", "Chile")),
              h=rng.choice(HISTORY), a=rng.choice(ANIMALS), p=rng.choice(PLACES))
    return q, ("Are you sure?", "Tell me something surprising about it.", "why?")


def _json(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    fields = rng.choice(_FIELDS)
    if rng.random() < 0.5:
        src = rng.choice((
            "Hi, I'm {n}, you can reach me at {e} or {ph}.", "Order: {q} x {pr} at ${pc} each.",
            "Forecast for {ci} on {d}: around {t} degrees.", "'{ti}' by {n}, published {y}.",
            "{n} joined {co} as a {j} earning {s} a year.", "Flight from {ci} to {ci2} leaves at {h}:{m}.",
        )).format(n=rng.choice(("Maria Lopez", "Tom Becker", "Aisha Khan", "Li Wei")), e="someone@example.com",
                  ph=f"555-{rng.randint(1000, 9999)}", q=rng.randint(1, 9), pr=rng.choice(("mugs", "notebooks", "cables")),
                  pc=rng.randint(2, 40), ci=rng.choice(PLACES), ci2=rng.choice(PLACES), d=rng.choice(_DAYS),
                  t=rng.randint(-5, 35), ti=rng.choice(("The Long Road", "Quiet Water", "Numbers")), y=rng.randint(1950, 2023),
                  co=rng.choice(("Acme", "Globex", "Initech")), j=rng.choice(JOBS), s=rng.randint(30, 120) * 1000,
                  h=rng.randint(5, 22), m=rng.choice(("05", "30", "45")))
        q = rng.choice(("Extract {f} from this text as JSON: {x}", "Return only JSON with keys {f}.\n\n{x}",
                        "Parse this into a JSON object ({f}):\n{x}")).format(f=", ".join(fields), x=src)
    else:
        q = rng.choice((
            "Give me a JSON array of {n} {what} with fields {f}.", "Generate sample JSON data: {n} {what}, keys {f}.",
            "What would a JSON schema for {what} with {f} look like?", "Convert this to JSON: {what} — {f}",
            "Make a YAML config for a web server with port, host and log level.", "Write a CSV with {n} rows of {what} "
            "({f}).",
        )).format(n=rng.randint(2, 5), what=rng.choice(("customers", "books", "orders", "weather reports", "employees")),
                  f=", ".join(fields))
    return q, ("Now add an id field.", "Can you make it valid JSON without comments?", "Now as a Python dict.")


def _tools(rng: random.Random) -> tuple[str, tuple[str, ...], str]:
    tools = rng.sample(TOOLS, rng.randint(2, 4))
    system = rng.choice((
        "You can call these tools. To call one, answer with JSON {{\"tool\": name, \"arguments\": {{...}}}}.\n{t}",
        "Tools available:\n{t}\nWhen a tool is needed, reply only with a JSON tool call.",
        "You are an assistant with function calling. Functions: {t}",
    )).format(t="\n".join(json.dumps(t) for t in tools))
    ask = {
        "get_weather": f"What's the weather like in {rng.choice(PLACES)} right now?",
        "search_web": f"Find me recent news about {rng.choice(TECH + SCIENCE)}.",
        "send_email": f"Email {rng.choice(('Sam', 'my boss', 'the team'))} that I'll be {rng.randint(5, 30)} minutes late.",
        "create_event": f"Put a dentist appointment in my calendar for {rng.choice(_DAYS)} at {rng.randint(8, 17)}:00.",
        "convert_currency": f"How much is {rng.randint(10, 900)} euros in {rng.choice(('dollars', 'yen', 'pounds'))}?",
        "set_timer": f"Set a timer for {rng.randint(3, 45)} minutes for the {rng.choice(FOODS)}.",
    }[rng.choice(tools)["name"]]
    if rng.random() < 0.2:
        ask = f"Tell me about {rng.choice(ALL_TOPICS)}."  # no tool fits
    return ask, ("Thanks. Do it again for tomorrow.", "The tool returned an error. What now?"), system


def _earlier_turns(rng: random.Random) -> tuple[list[dict], tuple[str, ...]]:
    user, assistant, nexts = rng.choice(_SETUPS)
    fill = dict(p=rng.choice(PLACES), l=rng.choice(LANGS), h=rng.choice(HOBBIES), t=rng.choice(ALL_TOPICS))
    messages = [{"role": "user", "content": user.format(**fill)}, {"role": "assistant", "content": assistant},
                {"role": "user", "content": rng.choice(nexts)}]
    return messages, ("Thanks, what next?", "Can you be more specific?", "ok great")


def _self_instruct(rng: random.Random) -> dict:
    ask = rng.choice((
        "Write one message that {p} might send to an AI assistant to {g}. Write only the message.",
        "You are {p}. Write the exact message you would type to a chatbot to {g}. Output the message only.",
        "Imagine {p} opening a chat app. They want to {g}. What do they type? Give only their message.",
        "Write a realistic chat message from {p} who wants to {g}. No preamble, just the message.",
    )).format(p=rng.choice(PERSONAS), g=rng.choice(GOALS).format(t=rng.choice(ALL_TOPICS), l=rng.choice(LANGS),
                                                               e=rng.choice(EVERYDAY), h=rng.choice(HOBBIES),
                                                               p=rng.choice(PLACES)))
    return {"writer": [{"role": "user", "content": ask}], "writer_seed": rng.getrandbits(31),
            "follow_ups": _follow_ups(rng, ())}


_SIMPLE = {"explain": _explain, "advice": _advice, "howto": _howto, "code_write": _code_write, "code_debug": _code_debug,
           "code_concept": _code_concept, "maths": _maths, "lists": _lists, "rewrite": _rewrite,
           "summarise": _summarise, "creative": _creative, "message": _message, "plan": _plan,
           "language": _language, "quick": _quick, "json": _json}


def _follow_ups(rng: random.Random, specific: tuple[str, ...]) -> list[str]:
    """0, 1 or 2 follow-up turns (about 30 % of conversations have one, 8 % two)."""
    r = rng.random()
    n = 2 if r < 0.08 else 1 if r < 0.30 else 0
    pool = list(specific) * 2 + list(GENERIC_FOLLOW_UPS)
    return rng.sample(pool, n) if n else []


def kind_of(seed: int, index: int) -> str:
    """The task kind of conversation ``index`` (weights in :data:`KINDS`)."""
    rng = random.Random(f"bank{BANK_VERSION}/{seed}/{index}/kind")
    return rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]


def bank_conversation(seed: int, index: int) -> dict:
    """Conversation ``index`` of the bank (see the module docstring for its shape)."""
    kind = kind_of(seed, index)
    rng = random.Random(f"bank{BANK_VERSION}/{seed}/{index}")
    if kind == "self_instruct":
        return _self_instruct(rng)
    system = None
    if kind == "roleplay":
        text, specific, system = _roleplay(rng)
        messages = [{"role": "user", "content": text}]
    elif kind == "tools":
        text, specific, system = _tools(rng)
        messages = [{"role": "user", "content": text}]
    elif kind == "earlier_turns":
        messages, specific = _earlier_turns(rng)
    else:
        text, specific = _SIMPLE[kind](rng)
        if kind not in _VERBATIM:
            text = text + rng.choice(FORMATS) if kind not in ("quick", "maths") else text
            text = rng.choice(VOICES)[1](rng, text)
        messages = [{"role": "user", "content": text}]
    if system is None and rng.random() < 0.22:
        system = rng.choice(SYSTEMS)
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    return {"messages": messages, "follow_ups": _follow_ups(rng, specific)}
